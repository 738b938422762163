"""Host half of the split augmentation: loader workers only cut crop windows out of the records.

Resizing every random-resized-crop on the CPU in the loader workers (:class:`client.augment.
AugmentCollate`, ~45 us a crop at 128 px) is the largest cost of a warm batch. The trainer
splits the work: a worker draws each sample's box exactly as torchvision's RandomResizedCrop
does (:func:`client.augment.draw_crops`, the same draws as the CPU path), copies the box's
pixels -- a slice and a ``memcpy`` per row, nothing else -- into ONE padded ``uint8
[B, Hmax, Wmax, 3]`` batch buffer (HWC, the records' own layout, so each row is one contiguous
copy), and records per sample the window size, the source box to resample, and the flip flag.
The device then resizes, flips and normalises the whole batch in a few tensor ops
(:mod:`trainer.device_augment`).

* :class:`CropCollate` (training): window = the random box itself; the box covers the whole
  window, so the batch does not depend on the output resolution (``size = 0``) and one
  persistent loader serves progressive resizing.
* :class:`CenterCropCollate` (validation): torchvision's ``Resize(int(S / 0.875))`` +
  ``CenterCrop(S)``. The window is the part of the record that the resampling filter touches;
  the box is fractional (the centre crop of the resized image, mapped back to record pixels),
  so the device reproduces resize-then-crop exactly. It is made for one output size ``S``.

Batches are :class:`CropBatch` objects. Inside a DataLoader worker the pixel buffer is in
shared memory (it crosses the process boundary as a file descriptor); with
``DataLoader(pin_memory=True)`` the loader's pin thread calls :meth:`CropBatch.pin_memory`,
so the host-to-device copy can run asynchronously (:class:`trainer.prefetch.Prefetcher`).

Reproducible batches: the trainer's batch sampler yields :class:`BatchRequest` objects (indices
plus epoch, step and rank) and wraps the dataset in :class:`TaggedDataset`, which hands the
request to the collate; the collate then seeds a fresh generator from ``(seed, epoch, step,
rank)``, so batch ``k`` of an epoch gets the same crops whichever worker makes it (a resumed
run repeats them). Given a plain list of samples (a plain ``DataLoader``) the collates behave
like :class:`~client.augment.AugmentCollate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from client.augment import SeededCollate, check_images, draw_crops, shared_uint8
from datacache.config import ConfigError


@dataclass(frozen=True)
class BatchRequest:
    """One batch as the trainer's sampler asks for it: dataset indices and where it sits."""

    indices: tuple[int, ...]
    epoch: int = 0
    step: int = 0
    rank: int = 0

    def __len__(self) -> int:
        return len(self.indices)


class TaggedDataset(Dataset):
    """Wrap a dataset so a batch sampler may yield :class:`BatchRequest`\\ s: ``__getitems__``
    returns ``(request, samples)`` for the collate (the samples via the wrapped dataset's
    batched ``__getitems__`` when it has one: one store round trip per batch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def _fetch(self, indices: Sequence[int]) -> list[Any]:
        get_many = getattr(self.dataset, "__getitems__", None)
        return list(get_many(list(indices))) if get_many else [self.dataset[i] for i in indices]

    def __getitems__(self, request: Any) -> Any:
        if isinstance(request, BatchRequest):
            return request, self._fetch(request.indices)
        return self._fetch(request)


@dataclass
class CropBatch:
    """A batch of crop windows for the device to resize (see the module docstring).

    ``pixels`` uint8 ``[B, Hp, Wp, 3]``: sample ``k``'s window in ``pixels[k, :h_k, :w_k]`` (the
    padding is never read: its resampling weights are zero). ``windows`` int64 ``[B, 2]``:
    ``(h_k, w_k)``; ``offsets`` int64 ``[B, 2]``: the window's ``(top, left)`` in its record.
    ``boxes`` float64 ``[B, 4]``: ``(y0, height, x0, width)`` of the source
    region (window pixel units, may be fractional) that becomes the ``S x S`` output; sampling
    is clamped to the window. ``flips`` bool ``[B]``; ``labels`` int64 ``[B]``. ``size``: the
    output size the boxes were made for, 0 when any size works (the box is the whole window).
    ``epoch``/``step``: the batch's place in training (-1 when untagged).
    """

    pixels: Tensor
    windows: Tensor
    offsets: Tensor
    boxes: Tensor
    flips: Tensor
    labels: Tensor
    size: int = 0
    epoch: int = -1
    step: int = -1

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _map(self, fn: Any) -> CropBatch:
        return replace(self, pixels=fn(self.pixels), windows=fn(self.windows), offsets=fn(self.offsets),
                       boxes=fn(self.boxes), flips=fn(self.flips), labels=fn(self.labels))

    def pin_memory(self, device: Any = None) -> CropBatch:
        """Page-locked copies (DataLoader's pin thread calls this with ``pin_memory=True``)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CropBatch:
        """All tensors on ``device`` (``non_blocking`` is asynchronous only from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def padded_bytes(self) -> int:
        return int(self.pixels.numel())


def _split(data: Any) -> tuple[BatchRequest | None, Sequence[tuple[Tensor, int]]]:
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], BatchRequest):
        return data[0], data[1]
    return None, data


def pack_windows(images: Sequence[Tensor], windows: Sequence[tuple[int, int, int, int]]) -> tuple[
        Tensor, Tensor, Tensor]:
    """Copy window ``(top, left, h, w)`` of each uint8 CHW image into one padded HWC batch.

    Returns ``(pixels uint8 [B, Hp, Wp, 3], sizes int64 [B, 2], offsets int64 [B, 2])``. The buffer
    is in shared memory inside a DataLoader worker (:func:`client.augment.shared_uint8`); the
    padding is left uninitialised (any byte is a finite value that gets weight 0). Images that are
    views of HWC memory (CachedImageNet's records) copy one contiguous run per row.
    """
    hp = max(w[2] for w in windows)
    wp = max(w[3] for w in windows)
    n = len(images)
    pixels = shared_uint8(n * hp * wp * 3).view(n, hp, wp, 3)
    for k, (img, (top, left, h, w)) in enumerate(zip(images, windows)):
        pixels[k, :h, :w].copy_(img.permute(1, 2, 0)[top:top + h, left:left + w])
    geometry = torch.tensor(windows, dtype=torch.int64).view(n, 4)
    return pixels, geometry[:, 2:].clone(), geometry[:, :2].clone()


def _place(request: BatchRequest | None) -> tuple[int, int]:
    return (request.epoch, request.step) if request is not None else (-1, -1)


def _labels(samples: Sequence[tuple[Tensor, int]]) -> Tensor:
    return torch.tensor([int(s[1]) for s in samples], dtype=torch.int64)


class CropCollate(SeededCollate):
    """Training ``collate_fn``: torchvision RandomResizedCrop boxes + flip flags, windows only.

    ``scale``/``ratio``/``flip_p`` as torchvision's (defaults (0.08, 1), (3/4, 4/3), 0.5);
    randomness as :class:`~client.augment.SeededCollate` (per batch with a
    :class:`BatchRequest`). Returns a :class:`CropBatch` with ``size = 0``.
    """

    def __call__(self, data: Any) -> CropBatch:
        request, samples = _split(data)
        images = [s[0] for s in samples]
        check_images(images, "CropCollate")
        tag = (request.epoch, request.step, request.rank) if request is not None else None
        boxes, flips = draw_crops(images, self._generator(tag), self.scale, self.ratio, self.flip_p)
        pixels, sizes, offsets = pack_windows(images, boxes)
        geom = torch.zeros((len(images), 4), dtype=torch.float64)
        geom[:, 1] = sizes[:, 0]
        geom[:, 3] = sizes[:, 1]
        flags = torch.tensor(flips, dtype=torch.bool)
        return CropBatch(pixels, sizes, offsets, geom, flags, _labels(samples), 0, *_place(request))


def resized_size(h: int, w: int, short: int) -> tuple[int, int]:
    """torchvision ``Resize(short)``'s output ``(h, w)``: the short side becomes ``short``, the long
    side ``int(short * long / short_in)`` (truncated, as torchvision does)."""
    if h <= w:
        return short, int(short * w / h)
    return int(short * h / w), short


def center_crop_geometry(h: int, w: int, size: int, crop_fraction: float = 0.875) -> tuple[
        tuple[int, int, int, int], tuple[float, float, float, float]]:
    """Window and box for ``Resize(int(size / crop_fraction))`` + ``CenterCrop(size)`` of an
    ``h x w`` image: ``((top, left, wh, ww), (y0, height, x0, width))``, the box relative to the
    window. The window is the centre crop's source region plus the bilinear filter's support
    (``max(1, scale)`` pixels), clamped to the image."""
    rh, rw = resized_size(h, w, int(size / crop_fraction))
    out: list[tuple[int, float, float, int]] = []
    for n_in, n_res in ((h, rh), (w, rw)):
        scale = n_in / n_res
        start = round((n_res - size) / 2.0) * scale  # torchvision CenterCrop's offset, in source px
        extent = size * scale
        support = max(1.0, scale)
        lo = max(0, math.floor(start - support))
        hi = min(n_in, math.ceil(start + extent + support))
        out.append((lo, start - lo, extent, hi - lo))
    (top, y0, hy, wh), (left, x0, wx, ww) = out
    return (top, left, wh, ww), (y0, hy, x0, wx)


class CenterCropCollate:
    """Validation ``collate_fn``: resize the short side to ``int(size / crop_fraction)`` and take
    the centre ``size x size`` crop (torchvision's evaluation transform), as a :class:`CropBatch`
    made for ``size``. Deterministic; accepts a :class:`BatchRequest`-tagged batch too."""

    def __init__(self, size: int, crop_fraction: float = 0.875) -> None:
        if int(size) < 1:
            raise ConfigError(f"CenterCropCollate size must be a positive int, got {size!r}")
        if not 0.0 < float(crop_fraction) <= 1.0:
            raise ConfigError(f"crop_fraction={crop_fraction!r}: expected a fraction in (0, 1]")
        self.size = int(size)
        self.crop_fraction = float(crop_fraction)

    def __call__(self, data: Any) -> CropBatch:
        request, samples = _split(data)
        images = [s[0] for s in samples]
        check_images(images, "CenterCropCollate")
        geoms = [center_crop_geometry(int(img.shape[1]), int(img.shape[2]), self.size, self.crop_fraction)
                 for img in images]
        pixels, sizes, offsets = pack_windows(images, [g[0] for g in geoms])
        boxes = torch.tensor([g[1] for g in geoms], dtype=torch.float64)
        flips = torch.zeros(len(images), dtype=torch.bool)
        return CropBatch(pixels, sizes, offsets, boxes, flips, _labels(samples), self.size, *_place(request))
