"""Host half of the split augmentation: loader workers only cut crop windows out of the records.

Resizing every random-resized-crop on the CPU in the loader workers (:class:`client.augment.
AugmentCollate`; bench/results/NOTES.md#crop) is the largest cost of a warm batch. The trainer
splits the work: a worker draws each sample's box exactly as torchvision's RandomResizedCrop
does (:func:`client.augment.draw_crops`, the same draws as the CPU path), copies the box's
pixels -- a slice and a ``memcpy`` per row, nothing else -- into ONE uint8 batch buffer (packed
back to back, HWC, the records' own layout, so each row is one contiguous copy; the device pads
them into ``[B, Hmax, Wmax, 3]``), and records per sample the window size, the source box to
resample, and the flip flag.
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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from client.augment import SeededCollate, check_images, draw_crops, shared_uint8, untag
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


# CropBatch.padded() on the CPU scatters in chunks of (output bytes / this): bounds its index temporaries
PADDED_CHUNK_DIVISOR = 128

# Debug switch: run the device (non-CPU) code path of CropBatch.padded and of
# trainer.device_augment.resize_matmul on CPU tensors too. Tests use it to check, on a machine
# without a GPU, the values and the op counts of the exact code a CUDA batch runs (as
# trainer.comm.topk_keys.DEVICE_PATH_ON_CPU does for the comm stack).
DEVICE_PATH_ON_CPU = False


def device_path(t: Tensor) -> bool:
    """Whether batch tensor ``t`` takes the device code path: a few large batched ops, nothing
    read on the host (True off the CPU, and on the CPU under :data:`DEVICE_PATH_ON_CPU`). The CPU
    path instead bounds its temporaries with more, smaller ops."""
    return t.device.type != "cpu" or DEVICE_PATH_ON_CPU

# columns of CropBatch.meta
_H, _W, _TOP, _LEFT, _Y0, _YEXT, _X0, _XEXT, _FLIP, _LABEL, _OFF = range(11)
META_COLUMNS = ("h", "w", "top", "left", "y0", "y_extent", "x0", "x_extent", "flip", "label", "offset")


@dataclass
class CropBatch:
    """A batch of crop windows for the device to resize (see the module docstring).

    Two tensors, so a batch crosses the worker -> main process boundary, the pin thread and the
    host -> device copy as two transfers (each shared-memory tensor costs a file descriptor and
    an ``mmap`` per batch):

    * ``pixels`` uint8 ``[N]``: the windows packed back to back, each one HWC-contiguous
      (``h_k * w_k * 3`` bytes at ``offset_k``). Packed, not padded to the batch's largest
      window: RRC windows fill ~half of a ``[B, Hmax, Wmax, 3]`` box, and the padded buffer's
      extra shared-memory pages cost 15-20 % of the warm loader's rate here (measured: 0.80 of the
      copy-only ceiling padded, 0.96 packed). :meth:`padded` builds the padded batch on the device
      (one row gather there; a chunked scatter on the CPU);
    * ``meta`` float64 ``[B, 11]``, columns :data:`META_COLUMNS`: the window size ``(h, w)``, its
      ``(top, left)`` in the record, the source box ``(y0, y_extent, x0, x_extent)`` in window
      pixels (may be fractional) that becomes the ``S x S`` output -- sampling is clamped to the
      window --, the flip flag, the label and the window's offset in ``pixels`` (all exact in
      float64).

    ``hmax``/``wmax``: the largest window (host ints, so padding needs no device -> host read).
    ``size``: the output size the boxes were made for, 0 when any size works (the box is the
    whole window). ``epoch``/``step``: the batch's place in training (-1 when untagged).
    """

    pixels: Tensor
    meta: Tensor
    hmax: int
    wmax: int
    size: int = 0
    epoch: int = -1
    step: int = -1
    # a worker's pooled buffer (client.batch_pool): travels with the batch, None once it has arrived
    ticket: Any = field(default=None, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # Process boundary: every batch from a worker arrives through _crop_batch_arrived, which
        # registers a pooled buffer and gives back the ones the main process dropped (batch_pool).
        flags, slot = self.ticket if self.ticket is not None else (None, -1)
        return (_crop_batch_arrived, (self.pixels, self.meta, self.hmax, self.wmax, self.size, self.epoch,
                                      self.step, flags, slot))

    def __len__(self) -> int:
        return int(self.meta.shape[0])

    # Columns are taken with narrow/select, not Python indexing: the same ops, and they also run on
    # fake CUDA tensors (FakeTensorMode on a CPU-only torch), where tests check device placement.
    @property
    def windows(self) -> Tensor:
        """``(h, w)`` of each window, int64 ``[B, 2]``."""
        return self.meta.narrow(1, _H, 2).to(torch.int64)

    @property
    def offsets(self) -> Tensor:
        """``(top, left)`` of each window in its record, int64 ``[B, 2]``."""
        return self.meta.narrow(1, _TOP, 2).to(torch.int64)

    @property
    def boxes(self) -> Tensor:
        """``(y0, y_extent, x0, x_extent)``, float64 ``[B, 4]``."""
        return self.meta.narrow(1, _Y0, 4)

    @property
    def flips(self) -> Tensor:
        return self.meta.select(1, _FLIP) > 0.5

    @property
    def labels(self) -> Tensor:
        return self.meta.select(1, _LABEL).to(torch.int64)

    def views(self) -> list[Tensor]:
        """Every window as a uint8 ``[h, w, 3]`` view of ``pixels`` (reads ``meta`` on the host)."""
        rows = self.meta[:, [_H, _W, _OFF]].to(torch.int64).tolist()
        return [self.pixels[off:off + h * w * 3].view(h, w, 3) for h, w, off in rows]

    def padded(self, chunk: int = 0) -> Tensor:
        """The windows in one zero-padded uint8 ``[B, hmax, wmax, 3]`` batch, built where the batch
        is: index arithmetic only, no device -> host read.

        Device path (:func:`device_path`: CUDA batches): ONE gather of whole rows, ~12 ops for the
        batch (:meth:`_padded_rows`). CPU path: a scatter of every byte. Its int64 index arithmetic
        costs ~8 bytes per index and several arrays live at once, so it runs over the packed bytes
        in chunks of ``chunk`` (default: the output size / :data:`PADDED_CHUNK_DIVISOR`): the
        temporaries stay under ~0.7x the output instead of ~40 bytes per pixel byte (measured:
        ``bench/augment_memory.py``). Each chunk finds its bytes' windows with one ``searchsorted``
        over the window ends. ``chunk`` applies to the CPU path only: on a GPU each chunk is ~14
        kernel launches (dozens of chunks for a 256-image batch), which is what the gather avoids."""
        if device_path(self.pixels):
            return self._padded_rows()
        n, hp, wp = len(self), self.hmax, self.wmax
        dev = self.pixels.device
        h, w, off = (self.meta.select(1, c).to(torch.int64) for c in (_H, _W, _OFF))
        total = self.pixels.numel()
        out = torch.zeros(n * hp * wp * 3, dtype=torch.uint8, device=dev)
        ends = off + h * w * 3                                  # [B] end of each window's bytes
        row_len = w * 3
        base = torch.arange(n, device=dev) * (hp * wp * 3)      # [B] start of each sample's slot
        step = int(chunk) if chunk > 0 else max(1 << 12, out.numel() // PADDED_CHUNK_DIVISOR)
        for c0 in range(0, total, step):
            c = min(step, total - c0)
            src = torch.arange(c0, c0 + c, device=dev)          # byte index in `pixels`
            sample = torch.searchsorted(ends, src, right=True)  # its window
            pos = src.sub_(off.index_select(0, sample))          # byte within the window (in place)
            rl = row_len.index_select(0, sample)
            row = torch.div(pos, rl, rounding_mode="floor")
            pos.sub_(row * rl)                                   # column byte within the row
            pos.add_(row.mul_(wp * 3)).add_(base.index_select(0, sample))  # destination
            del row, rl, sample
            out.index_copy_(0, pos, self.pixels.narrow(0, c0, c))
        return out.view(n, hp, wp, 3)

    def _padded_rows(self) -> Tensor:
        """:meth:`padded` on the device: output row ``r`` of sample ``k`` is the ``wmax * 3`` bytes
        that start at ``offset_k + r * w_k * 3`` in ``pixels``, so the whole batch is one
        ``index_select`` of ``B * hmax`` row starts from an overlapping ``unfold`` view of the
        bytes, then one multiply zeroes the columns past each window's width. Rows past a window's
        height start at the zero tail appended to the bytes (``wmax * 3`` zeros, so every row's
        read stays in bounds, the last window's included). The index is ``B * hmax`` int64s, not
        one per byte; the temporaries are a copy of the packed bytes (~0.5x the output for RRC
        windows) and ``[B, hmax]``/``[B, wmax * 3]`` tables. 12 ops whatever the batch, no chunks,
        no host read (sizes come from ``meta`` on the device; ``hmax``/``wmax`` are host ints)."""
        n, hp, row = len(self), self.hmax, self.wmax * 3
        dev = self.pixels.device
        out = torch.empty((n, hp, row), dtype=torch.uint8, device=dev)
        if out.numel() == 0:
            return out.view(n, hp, self.wmax, 3)
        total = self.pixels.numel()
        # HAZARD (host/device): sizes stay on the device (no .tolist()/.item(): a sync on CUDA); only
        # hmax/wmax/numel, host ints, shape the ops. One conversion: h, w, offset are whole numbers.
        m = self.meta.to(torch.int64)
        h, row_len, off = m.select(1, _H).unsqueeze(1), m.select(1, _W).unsqueeze(1) * 3, m.select(1, _OFF)
        r = torch.arange(hp, device=dev)
        starts = torch.addcmul(off.unsqueeze(1), r, row_len)                 # [B, hp] first byte of each row
        starts.masked_fill_(r >= h, total)                                   # rows past h_k: the zero tail
        src = torch.cat((self.pixels, self.pixels.new_zeros(row)))            # bytes + one row of zeros
        torch.index_select(src.unfold(0, row, 1), 0, starts.view(-1), out=out.view(n * hp, row))
        out.mul_((torch.arange(row, device=dev) < row_len).unsqueeze(1))   # zero the bytes past w_k * 3
        return out.view(n, hp, self.wmax, 3)

    def pin_memory(self, device: Any = None) -> CropBatch:
        """Page-locked copies (DataLoader's pin thread calls this with ``pin_memory=True``)."""
        return replace(self, pixels=self.pixels.pin_memory(), meta=self.meta.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> CropBatch:
        """Both tensors on ``device`` (``non_blocking`` is asynchronous only from pinned memory)."""
        return replace(self, pixels=self.pixels.to(device, non_blocking=non_blocking),
                       meta=self.meta.to(device, non_blocking=non_blocking))


def _crop_batch_arrived(pixels: Tensor, meta: Tensor, hmax: int, wmax: int, size: int, epoch: int, step: int,
                        flags: Tensor | None, slot: int) -> CropBatch:
    from client.batch_pool import arrived

    arrived(pixels, flags, slot)
    return CropBatch(pixels, meta, hmax, wmax, size, epoch, step)


Box = tuple[float, float, float, float]


def _meta(windows: Sequence[tuple[int, int, int, int]], boxes: Sequence[Box] | None,
          flips: Sequence[bool] | None, samples: Sequence[tuple[Tensor, int]], offsets: np.ndarray) -> Tensor:
    """The ``meta`` table; ``boxes=None``: each box is its whole window; ``flips=None``: no flips."""
    win = np.asarray(windows, dtype=np.float64).reshape(len(windows), 4)  # top, left, h, w
    meta = np.zeros((len(windows), len(META_COLUMNS)))
    meta[:, [_H, _W, _TOP, _LEFT]] = win[:, [2, 3, 0, 1]]
    if boxes is None:
        meta[:, _YEXT], meta[:, _XEXT] = win[:, 2], win[:, 3]
    else:
        meta[:, _Y0:_XEXT + 1] = np.asarray(boxes, dtype=np.float64).reshape(len(windows), 4)
    if flips is not None:
        meta[:, _FLIP] = np.asarray(flips, dtype=np.float64)
    meta[:, _LABEL] = [int(s[1]) for s in samples]
    meta[:, _OFF] = offsets
    return torch.from_numpy(meta)


def pack_windows(images: Sequence[Tensor], windows: Sequence[tuple[int, int, int, int]],
                 pool: Any = None) -> tuple[Tensor, np.ndarray] | tuple[Tensor, np.ndarray, Any]:
    """Copy window ``(top, left, h, w)`` of each uint8 CHW image, HWC, back to back into one buffer.

    Returns ``(pixels uint8 [N], offsets int64 [B])`` -- and the buffer's ticket as a third item when
    ``pool`` (a :class:`~client.batch_pool.BatchPool`) gave the buffer. The buffer is in shared memory
    inside a DataLoader worker (:func:`client.augment.shared_uint8`, or the pool's reused buffers).
    Images that are views of HWC memory
    (CachedImageNet's records) copy one contiguous run per row. The copies go through numpy views
    of the same memory: measured several times faster than torch indexing, whose per-call
    overhead dominated (bench/results/NOTES.md#crop).
    """
    sizes = np.array([h * w * 3 for _, _, h, w in windows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else sizes
    ticket = None
    if pool is None:
        pixels = shared_uint8(int(sizes.sum()))
    else:
        pixels, ticket = pool.take(int(sizes.sum()))
    dst = pixels.numpy()  # a view: writes land in the (shared) tensor
    try:
        for img, (top, left, h, w), off in zip(images, windows, offsets.tolist()):
            src = img.numpy().transpose(1, 2, 0)  # HWC view of the record
            dst[off:off + h * w * 3].reshape(h, w, 3)[...] = src[top:top + h, left:left + w]
    except BaseException:
        if pool is not None:
            pool.give_back(ticket)  # never sent: the slot is the worker's again
        raise
    return (pixels, offsets) if pool is None else (pixels, offsets, ticket)


Window = tuple[int, int, int, int]


def _batch(images: Sequence[Tensor], windows: Sequence[Window], boxes: Sequence[Box] | None,
           flips: Sequence[bool] | None, samples: Sequence[tuple[Tensor, int]], size: int,
           request: BatchRequest | None, pool: Any = None) -> CropBatch:
    if pool is None:
        pixels, offsets = pack_windows(images, windows)
        ticket = None
    else:
        pixels, offsets, ticket = pack_windows(images, windows, pool)  # type: ignore[misc]
    meta = _meta(windows, boxes, flips, samples, offsets)
    hmax = max(w[2] for w in windows)
    wmax = max(w[3] for w in windows)
    return CropBatch(pixels, meta, hmax, wmax, size, *_place(request), ticket=ticket)


def _place(request: BatchRequest | None) -> tuple[int, int]:
    return (request.epoch, request.step) if request is not None else (-1, -1)


class CropCollate(SeededCollate):
    """Training ``collate_fn``: torchvision RandomResizedCrop boxes + flip flags, windows only.

    ``scale``/``ratio``/``flip_p`` as torchvision's (defaults (0.08, 1), (3/4, 4/3), 0.5);
    randomness as :class:`~client.augment.SeededCollate` (per batch with a
    :class:`BatchRequest`). Returns a :class:`CropBatch` with ``size = 0``.
    """

    def __call__(self, data: Any) -> CropBatch:
        request, samples, generator = self.unpack(data)
        images = [s[0] for s in samples]
        check_images(images, "CropCollate")
        windows, flips = draw_crops(images, generator, self.scale, self.ratio, self.flip_p)
        return _batch(images, windows, None, flips, samples, 0, request, self.pool)  # box = the whole window


def draw_pad_crops(images: Sequence[Tensor], generator: torch.Generator | None, size: int, padding: int,
                   flip_p: float) -> tuple[list[tuple[int, int]], list[bool]]:
    """The random part of ``RandomCrop(size, padding)`` + flip: ``(tops_lefts, flips)``.

    ``(i, j)`` is the crop's corner in the zero-padded image (torchvision's ``RandomCrop.get_params``
    on the padded ``(H + 2p) x (W + 2p)`` image: ``i`` uniform in ``[0, H + 2p - size]``, ``j`` in
    ``[0, W + 2p - size]``), drawn for the whole batch at once (``2 * B`` draws, then ``B`` for the
    flips), so the boxes are torchvision's while the draws are not its per-sample sequence."""
    n = len(images)
    hi = torch.tensor([int(img.shape[1]) + 2 * padding - size + 1 for img in images], dtype=torch.float64)
    wi = torch.tensor([int(img.shape[2]) + 2 * padding - size + 1 for img in images], dtype=torch.float64)
    if bool((hi < 1).any()) or bool((wi < 1).any()):
        k = int(torch.nonzero((hi < 1) | (wi < 1))[0])
        raise ValueError(f"image {k} ({tuple(images[k].shape[1:])}) padded by {padding} is smaller than the "
                         f"{size}-px crop: lower the resolution or raise --pad")
    u = torch.rand(2, n, generator=generator, dtype=torch.float64)
    # floor(u * count) is uniform over 0..count-1; min() guards u * count rounding up to count
    tops = torch.minimum((u[0] * hi).floor(), hi - 1).to(torch.int64).tolist()
    lefts = torch.minimum((u[1] * wi).floor(), wi - 1).to(torch.int64).tolist()
    flips = (torch.rand(n, generator=generator) < flip_p).tolist()
    return list(zip(tops, lefts)), flips


def pad_crop_geometry(h: int, w: int, top: int, left: int, size: int, padding: int) -> tuple[
        tuple[int, int, int, int], tuple[float, float, float, float]]:
    """Window and box of the ``size x size`` crop at ``(top, left)`` of the image zero-padded by
    ``padding``: the window is the part of the crop that lies on the image (``(top, left, wh, ww)``
    in image pixels), the box the whole crop relative to that window (``y0``/``x0`` <= 0 where the
    crop starts in the padding; extent ``size``: no resize). The device's resampling gives every
    output pixel outside the window weight 0, i.e. the zero padding."""
    out = []
    for start, n in ((top - padding, h), (left - padding, w)):
        lo, hi = max(0, start), min(n, start + size)
        out.append((lo, hi - lo, float(start - lo)))
    (wt, wh, y0), (wl, ww, x0) = out
    return (wt, wl, wh, ww), (y0, float(size), x0, float(size))


class PadCropCollate(SeededCollate):
    """Training ``collate_fn`` for small images: torchvision's ``RandomCrop(size, padding=padding)``
    (zero fill) then ``RandomHorizontalFlip(flip_p)``, windows only.

    The worker cuts the part of each crop that lies on the image (:func:`pad_crop_geometry`); the device
    places it in a zeroed ``size x size`` output, flips and normalises (:mod:`trainer.device_augment`,
    a resampling at scale 1: exact copies). Randomness as :class:`~client.augment.SeededCollate`.
    Returns a :class:`CropBatch` made for ``size``.
    """

    def __init__(self, size: int, padding: int = 4, **kw: Any) -> None:
        super().__init__(**kw)
        if int(size) < 1 or not 0 <= int(padding) < int(size):
            raise ConfigError(f"pad-crop needs size >= 1 and 0 <= padding < size, got size={size!r}, "
                              f"padding={padding!r}")
        self.size = int(size)
        self.padding = int(padding)

    def __call__(self, data: Any) -> CropBatch:
        request, samples, generator = self.unpack(data)
        images = [s[0] for s in samples]
        check_images(images, "PadCropCollate")
        corners, flips = draw_pad_crops(images, generator, self.size, self.padding, self.flip_p)
        geoms = [pad_crop_geometry(int(img.shape[1]), int(img.shape[2]), i, j, self.size, self.padding)
                 for img, (i, j) in zip(images, corners)]
        return _batch(images, [g[0] for g in geoms], [g[1] for g in geoms], flips, samples, self.size,
                      request, self.pool)


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
        request, samples = untag(data)
        images = [s[0] for s in samples]
        check_images(images, "CenterCropCollate")
        geoms = [center_crop_geometry(int(img.shape[1]), int(img.shape[2]), self.size, self.crop_fraction)
                 for img in images]
        return _batch(images, [g[0] for g in geoms], [g[1] for g in geoms], None, samples, self.size, request)
