"""torchvision's pure-Python datasets and transforms without its package ``__init__`` (dev-only).

The drop-in tests (``tests/test_dropin.py``) and benchmark (``bench/dropin.py``) compare
``CachedImageNet`` with torchvision's own ``ImageFolder`` and transforms. The CPU-only torch of the
test environment (``torch==2.13.0+cpu``) pairs with a torchvision wheel (0.28.0, the ``[test]`` extra)
whose compiled operators do not load, so ``import torchvision`` fails in its ``__init__``
(``RuntimeError: operator torchvision::nms does not exist``). What the ImageNet example needs --
``torchvision.datasets.folder`` (ImageFolder, DatasetFolder, default_loader) and
``torchvision.transforms.transforms`` / ``.functional`` / ``.autoaugment`` -- is pure Python over
Pillow and torch.

:func:`install` registers *empty* package modules ``torchvision``, ``torchvision.datasets`` and
``torchvision.transforms`` in :data:`sys.modules`, each with the installed package's ``__path__`` (so
their submodules import normally, without running any package ``__init__``), then fills the two
sub-packages with the public names of ``torchvision.datasets.folder`` / ``.vision`` and
``torchvision.transforms.transforms`` / ``.autoaugment``: a script written against torchvision --
``import torchvision.transforms as transforms; transforms.Compose(...)``, ``import torchvision.datasets
as datasets; datasets.ImageFolder(...)`` -- runs unchanged once :func:`install` ran in its process.
``torchvision.transforms.v2`` is attempted too (:func:`v2_reason` says why it is missing where it is).

Process boundary: the shim lives in ``sys.modules`` of the process that installed it. A forked
DataLoader worker inherits it; a *spawned* one does not -- unpickling a torchvision transform there
imports the real package ``__init__`` and fails. Scripts using this shim use fork workers (Linux's default,
as PyTorch's ImageNet example does).

When a working ``torchvision`` is already imported (a CUDA torch with its matching wheel), :func:`install`
returns it untouched. Never imported by the library, the client, the daemon or the trainer.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import typing

__all__ = ["ShimUnavailable", "install", "v2_reason"]

_SUBMODULES = {
    "torchvision.datasets": ("torchvision.datasets.folder", "torchvision.datasets.vision"),
    "torchvision.transforms": ("torchvision.transforms.transforms", "torchvision.transforms.autoaugment"),
}
_V2_REASON: list[str] = []


class ShimUnavailable(RuntimeError):
    """torchvision is not installed, or its pure-Python modules cannot be imported; the message says why."""


def _public(mod: types.ModuleType) -> dict[str, object]:
    """The public names ``mod`` defines (its ``__all__``, else non-underscore names that are not modules and
    not classes/functions imported from outside torchvision)."""
    names = getattr(mod, "__all__", None)
    if names is not None:
        return {n: getattr(mod, n) for n in names}
    out: dict[str, object] = {}
    for n, v in vars(mod).items():
        if n.startswith("_") or isinstance(v, (types.ModuleType, typing.TypeVar)):
            continue
        owner = getattr(v, "__module__", None)
        if (isinstance(v, type) or callable(v)) and not str(owner).startswith("torchvision"):
            continue  # os, Path, Image, typing helpers imported by the module
        out[n] = v
    return out


def _get_image_backend() -> str:
    """What ``torchvision.get_image_backend()`` answers without accimage (``default_loader`` asks it)."""
    return "PIL"


def install() -> types.ModuleType:
    """Register the shim (module docstring) and return the ``torchvision`` module; idempotent.
    Raises :class:`ShimUnavailable` naming the reason (not installed, or a module failing to import)."""
    have = sys.modules.get("torchvision")
    if have is not None and (getattr(have, "__datacache_shim__", False) or hasattr(have, "ops")):
        return have  # the shim already, or a fully imported torchvision
    try:
        spec = importlib.util.find_spec("torchvision")  # locates the package; runs nothing of it
    except (ImportError, ValueError) as e:
        raise ShimUnavailable(f"torchvision cannot be located ({type(e).__name__}); "
                              "pip install torchvision==0.28.0 (the [test] extra)") from e
    if spec is None or not spec.submodule_search_locations:
        raise ShimUnavailable("torchvision is not installed; pip install torchvision==0.28.0 "
                              "(the [test] extra) to run the drop-in comparisons")
    base = next(iter(spec.submodule_search_locations))
    root = types.ModuleType("torchvision", "torchvision without its package __init__ (datacache dev shim)")
    root.__path__ = [base]
    root.__package__ = "torchvision"
    root.__datacache_shim__ = True  # type: ignore[attr-defined]
    root.get_image_backend = _get_image_backend  # type: ignore[attr-defined]
    try:
        root.__version__ = importlib.metadata.version("torchvision")  # type: ignore[attr-defined]
    except importlib.metadata.PackageNotFoundError:
        root.__version__ = "unknown"  # type: ignore[attr-defined]
    sys.modules["torchvision"] = root
    packages = {}
    for name in _SUBMODULES:
        pkg = types.ModuleType(name, f"{name} without its __init__ (datacache dev shim)")
        pkg.__path__ = [os.path.join(base, name.split(".")[1])]
        pkg.__package__ = name
        sys.modules[name] = pkg
        setattr(root, name.split(".")[1], pkg)
        packages[name] = pkg
    try:
        for name, sources in _SUBMODULES.items():
            for src in sources:
                vars(packages[name]).update(_public(importlib.import_module(src)))
    except Exception as e:  # a torchvision whose pure-Python modules changed: say which, undo the shim
        for name in ("torchvision", *_SUBMODULES):
            sys.modules.pop(name, None)
        raise ShimUnavailable(f"torchvision {root.__version__}: its pure-Python datasets/transforms modules "
                              f"do not import without the package __init__ ({type(e).__name__}: {e})") from e
    return root


def v2_reason() -> str | None:
    """None when ``torchvision.transforms.v2`` imports through the shim, else why not (installs the shim)."""
    install()
    if "torchvision.transforms.v2" in sys.modules:
        return None
    if _V2_REASON:
        return _V2_REASON[0]
    try:
        importlib.import_module("torchvision.transforms.v2")
    except Exception as e:  # v2 imports torchvision.ops / tv_tensors, which may need the compiled operators
        for name in [m for m in sys.modules if m.startswith("torchvision.transforms.v2")]:
            sys.modules.pop(name, None)
        _V2_REASON.append(f"torchvision.transforms.v2 does not import without the compiled operators "
                          f"({type(e).__name__})")
        return _V2_REASON[0]
    return None
