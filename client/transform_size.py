"""The resolution a transform needs: the cached short side that ``CachedImageNet`` derives from it.

A transform written for ImageFolder resizes and crops full-resolution images. Served from a cache of
smaller images it would upscale them and train (and validate) at a lower effective resolution, with
nothing to say so. :func:`required_short_side` walks the transform and returns the largest short side
any of its steps asks for:

* the walk: ``Compose.transforms`` (torchvision v1 and v2, ``RandomApply``/``RandomChoice``/``RandomOrder``:
  any object with a list/tuple ``transforms``), ``torch.nn.Sequential``/``ModuleList``, nested to any
  depth; a lambda or other opaque callable contributes nothing;
* steps are recognised by class name, the class's or a base class's (so subclasses and look-alike classes
  of other libraries count), and their ``size`` attribute (``height``/``width`` where there is no ``size``):

  ============================================  ========================================================
  ``Resize(s)`` / ``Resize([s])``               ``s`` (the short side becomes ``s``)
  ``Resize((h, w))``                            ``max(h, w)`` (either side may be the image's short one)
  ``CenterCrop``/``RandomCrop``/``FiveCrop``/    ``max(h, w)`` of the crop (a crop larger than the image
  ``TenCrop`` ``(h, w)``                        pads or fails)
  ``RandomResizedCrop(s)`` / ``(h, w)``         ``round(max(h, w) * 256 / 224)``: 256 for 224 (below)
  ============================================  ========================================================

Why ``RandomResizedCrop(s) -> round(s * 256 / 224)``: a random-resized crop samples a *relative* box
(scale in [0.08, 1] of the area, aspect ratio in [3/4, 4/3]) and resizes it to ``s``, so no single stored
size reproduces every crop of the full-resolution file; some rule must be picked. The ImageNet recipe pairs
``RandomResizedCrop(224)`` for training with ``Resize(256)`` + ``CenterCrop(224)`` for validation (ratio
0.875, the "crop_pct" of timm and of PyTorch's example); storing at ``256 / 224`` times the crop size makes
the training set's variant the one its validation twin needs (one variant serves both splits, and the
validation pipeline then matches ImageFolder, measured in tests/test_dropin.py), and is the short side that
resolution-bounded loaders such as FFCV's ImageNet configs commonly store (max 256-512 px). The cost,
stated plainly: a crop covering less than ``(224/256)^2 = 77 %`` of the stored image's area is upscaled
from fewer than ``s`` pixels, which a full-resolution source (ImageNet's median short side is ~375-500 px)
would not need; pass ``short_side=`` explicitly (e.g. 320, ``(320/256)^2 = 1.56x`` the bytes) to keep more
of that detail.

Nothing recognised: None (the dataset then uses its default short side, 160, and logs so).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["RRC_STORED_RATIO", "SizeNeed", "required_short_side"]

RRC_STORED_RATIO = 256 / 224  # stored short side per RandomResizedCrop output side (see the module docstring)
_MAX_DEPTH = 32
_RESIZE = ("Resize",)
_RRC = ("RandomResizedCrop",)
_CROPS = ("CenterCrop", "RandomCrop", "FiveCrop", "TenCrop")


@dataclass(frozen=True)
class SizeNeed:
    """The largest short side a transform asks for, and which step asks it (e.g. ``"Resize(256)"``)."""

    short_side: int
    step: str


def _sizes(obj: Any) -> list[int]:
    """The ints of a step's ``size`` (int, or a sequence of ints), else of its ``height``/``width``."""
    size = getattr(obj, "size", None)
    h, w = getattr(obj, "height", None), getattr(obj, "width", None)
    if size is None and isinstance(h, int) and isinstance(w, int):
        size = (h, w)
    if isinstance(size, bool):
        return []
    if isinstance(size, int):
        return [size]
    if isinstance(size, (list, tuple)) and size and all(isinstance(s, int) and not isinstance(s, bool)
                                                         for s in size):
        return [int(s) for s in size]
    return []


def _kind(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        name = cls.__name__
        if name in _RESIZE or name in _RRC or name in _CROPS:
            return name
    return None


def _need_of(obj: Any) -> SizeNeed | None:
    kind = _kind(obj)
    if kind is None:
        return None
    sizes = [s for s in _sizes(obj) if s > 0]
    if not sizes:
        return None  # e.g. v2 Resize(size=None, max_size=...): nothing to hold
    label = f"{kind}({sizes[0] if len(set(sizes)) == 1 else tuple(sizes)})"
    if kind in _RRC:
        return SizeNeed(round(max(sizes) * RRC_STORED_RATIO), label)
    return SizeNeed(max(sizes), label)


def _children(obj: Any) -> Iterable[Any]:
    inner = getattr(obj, "transforms", None)
    if isinstance(inner, (list, tuple)):
        return inner
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return ()
    if isinstance(obj, (torch.nn.Sequential, torch.nn.ModuleList)):
        return list(obj)
    return ()


def required_short_side(transform: Any) -> SizeNeed | None:
    """The largest short side ``transform`` asks for (module docstring), or None when nothing is found."""
    best: SizeNeed | None = None
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(transform, 0)]
    while todo:
        obj, depth = todo.pop()
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(obj))
        need = _need_of(obj)
        if need is not None and (best is None or need.short_side > best.short_side):
            best = need
        todo.extend((c, depth + 1) for c in reversed(list(_children(obj))))
    return best
