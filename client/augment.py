"""Batched random-resized-crop + horizontal flip for uint8 CHW images of different sizes.

The cache serves uint8 ``[3, H, W]`` tensors whose short side is the variant's (e.g. 160)
and whose long side varies. Training wants one fixed-size ``uint8 [B, 3, S, S]`` batch.
:func:`random_resized_crop_flip` does that for a whole list at once:

* crop parameters follow torchvision's ``RandomResizedCrop.get_params`` exactly (area scale
  ``(0.08, 1)``, log-uniform aspect ratio ``(3/4, 4/3)``, 10 tries, then a centre crop
  clamped to the ratio range), drawn from a ``torch.Generator`` so results are reproducible.
  :func:`rrc_params_batch` evaluates all 10 tries of all samples at once in torch and picks
  the first valid try per row (measured much faster than the per-sample Python loop it
  replaced, bench/results/NOTES.md#augment), with the same draws and the same boxes as the
  per-sample :func:`rrc_params`;
* the resize runs in torch for the whole batch. Two methods are implemented:

  - ``"interpolate"`` (default): each crop is a strided *view* of its source (one
    ``as_strided``, no copy), resized by torch's uint8 bilinear kernel (``antialias=True``
    when the crop is larger than the output in either side, as torchvision's tensor RRC does;
    plain bilinear when enlarging, where antialiasing changes nothing) straight into its slot
    of the preallocated output batch (``out=``), calling the ATen entry points directly.
  - ``"grid"``: one affine grid per sample and a single ``F.grid_sample`` over a padded float
    batch. One call, but it has to convert the padded batch to float first and it does not
    antialias (aliasing when shrinking a 320-px crop to 128).

  "interpolate" measured more than an order of magnitude faster than "grid" (whose float
  conversion of the padded batch and per-pixel gather dominate; figures in bench/results/NOTES.md#augment), so
  "interpolate" is the default and "grid" is kept for comparison (``python -m client.augment``
  re-measures). Contiguous CHW inputs are slower than the HWC-backed views the cache yields.
* the flip mirrors each chosen sample right after its resize, while its 48 KiB slot is still in
  cache (``slot.copy_(slot.flip(1))`` in HWC order). The batched ``out[idx] = out[idx].flip(-1)``
  used before gathered, flipped and scattered the channels_last batch with 3-byte strides and
  cost as much as all the resizes (measured, see the augment notes).

:class:`AugmentCollate` is a ``collate_fn`` for ``torch.utils.data.DataLoader``: it runs in
the DataLoader worker processes, so augmentation is parallel across workers. The trainer splits
the work instead: :class:`client.crop.CropCollate` only cuts the crop windows in the workers
(same draws, :func:`draw_crops`) and the resize runs batched on the device
(:mod:`trainer.device_augment`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from datacache.config import ConfigError

METHODS = ("interpolate", "grid")


def _rrc_from(height: int, width: int, tries: Sequence[Sequence[float]], pos: Sequence[float],
              scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, given its uniform draws (10 tries x 2, then 2)."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for u_area, u_ratio in tries:
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_lo + (log_hi - log_lo) * u_ratio)
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            # uniform integer in [0, height - h] (torch.randint's distribution) from a uniform float
            top = min(int(pos[0] * (height - h + 1)), height - h)
            left = min(int(pos[1] * (width - w + 1)), width - w)
            return top, left, h, w
    # Fallback: centre crop, clamped to the ratio range (same as torchvision).
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def rrc_params(height: int, width: int, generator: torch.Generator | None = None,
               scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop parameter sampling: returns ``(top, left, h, w)``.

    One sample, in plain Python (what a per-sample pipeline pays); it makes the same draws as
    one row of :func:`rrc_params_batch` and gives the same box.
    """
    tries = torch.rand((1, 10, 2), generator=generator).tolist()[0]
    pos = torch.rand((1, 2), generator=generator).tolist()[0]
    return _rrc_from(height, width, tries, pos, scale, ratio)


def rrc_params_batch(sizes: Sequence[tuple[int, int]], generator: torch.Generator | None = None,
                     scale: tuple[float, float] = (0.08, 1.0),
                     ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> list[tuple[int, int, int, int]]:
    """:func:`rrc_params` for many ``(height, width)`` at once, vectorised over the batch.

    All random draws come from two ``torch.rand`` calls (``[n, 10, 2]`` for the 10 tries, then
    ``[n, 2]`` for the position), exactly the draws :func:`rrc_params` makes per sample; the 10
    tries of every sample are evaluated at once in float64 and the first valid try of each row
    is picked (``argmax`` of the validity mask returns the first ``True``). Rows where all 10 tries
    fail (rare for real images) take torchvision's centre-crop fallback in Python. Per-sample
    This replaced per-sample Python loops over the tries (measured faster: bench/results/NOTES.md#augment).
    """
    n = len(sizes)
    tries = torch.rand((n, 10, 2), generator=generator).double()
    pos = torch.rand((n, 2), generator=generator).double()
    if n == 0:
        return []
    hw = torch.tensor(sizes, dtype=torch.float64)
    height, width = hw[:, 0:1], hw[:, 1:2]
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target_area = (height * width) * (scale[0] + (scale[1] - scale[0]) * tries[..., 0])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * tries[..., 1])
    w = torch.round(torch.sqrt(target_area * aspect))  # round half to even, like Python's round()
    h = torch.round(torch.sqrt(target_area / aspect))
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = ok.to(torch.uint8).argmax(dim=1, keepdim=True)  # first valid try (0 when none is)
    h = h.gather(1, first)
    w = w.gather(1, first)
    # uniform integer in [0, height - h] (torch.randint's distribution) from a uniform float
    top = torch.minimum(torch.floor(pos[:, 0:1] * (height - h + 1)), height - h)
    left = torch.minimum(torch.floor(pos[:, 1:2] * (width - w + 1)), width - w)
    rows = torch.cat([top, left, h, w], dim=1).to(torch.int64).tolist()
    boxes = [tuple(r) for r in rows]
    for k in torch.nonzero(~ok.any(dim=1)).flatten().tolist():  # all tries failed: centre crop
        boxes[k] = _rrc_from(sizes[k][0], sizes[k][1], (), (0.0, 0.0), scale, ratio)
    return boxes  # type: ignore[return-value]


def draw_crops(images: Sequence[torch.Tensor], generator: torch.Generator | None,
               scale: tuple[float, float], ratio: tuple[float, float],
               flip_p: float) -> tuple[list[tuple[int, int, int, int]], list[bool]]:
    """The random part of RRC + flip for a batch: ``(boxes, flips)``, boxes as ``(top, left, h, w)``.

    The draws (in this order: :func:`rrc_params_batch`, then one ``torch.rand(n)`` for the flips)
    are shared by the CPU path (:func:`random_resized_crop_flip`) and the host-crop path
    (:class:`client.crop.CropCollate`), so both give the same boxes and flips for one generator.
    """
    sizes = [(int(img.shape[1]), int(img.shape[2])) for img in images]
    boxes = rrc_params_batch(sizes, generator, scale, ratio)
    flips = (torch.rand(len(images), generator=generator) < flip_p).tolist()
    return boxes, flips


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not valid; choose one of {', '.join(METHODS)}")


def check_images(images: Sequence[torch.Tensor], who: str = "random_resized_crop_flip") -> None:
    """``ValueError`` unless ``images`` is a non-empty list of uint8 ``[3, H, W]`` tensors."""
    if len(images) == 0:
        raise ValueError(f"{who} needs at least one image")
    for k, img in enumerate(images):
        if img.dim() != 3 or img.shape[0] != 3 or img.dtype != torch.uint8:
            raise ValueError(f"image {k}: expected a uint8 [3, H, W] tensor, got {img.dtype} "
                             f"{tuple(img.shape)} (CachedImageNet yields uint8 CHW tensors)")


# The ATen entry points behind F.interpolate(mode="bilinear"[, antialias=True]); private, so
# looked up defensively (None -> the F.interpolate fallback).
_AA = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
_NOAA = getattr(torch._C._nn, "upsample_bilinear2d", None)


def shared_uint8(numel: int) -> torch.Tensor:
    """A flat ``uint8`` tensor of ``numel`` bytes, in shared memory inside a DataLoader worker.

    Process boundary: a batch a worker returns travels to the main process; allocated in shared
    memory (as torch's default_collate does), it moves as a file descriptor instead of being
    copied through a pipe. In the main process it is ordinary memory.
    """
    if torch.utils.data.get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(numel)
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel,), (1,))
    return torch.empty(numel, dtype=torch.uint8)


def _new_batch(n: int, size: int) -> torch.Tensor:
    """Allocate the ``uint8 [n, 3, size, size]`` channels_last output batch (shared memory in a
    DataLoader worker, :func:`shared_uint8`)."""
    return batch_view(shared_uint8(n * 3 * size * size), n, size)


def resize_crops(images: Sequence[torch.Tensor], boxes: list[tuple[int, int, int, int]],
                        flips: list[bool], size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Resize every crop ``(top, left, h, w)`` of ``images`` (uint8 CHW, ideally views of HWC
    memory) into its slot of ``out`` (default: a new :func:`_new_batch`), flipping the chosen
    ones; ``out`` must be a channels_last ``uint8 [n, 3, size, size]`` batch. Antialiased
    bilinear (Pillow's filter) when shrinking. The trainer's CPU device-resize uses it too."""
    if out is None:
        out = _new_batch(len(images), size)
    slots = out.split(1)  # [1, 3, S, S] channels_last views of the batch, made in one call
    hwc = out.permute(0, 2, 3, 1).unbind(0) if any(flips) else ()  # [S, S, 3] contiguous views
    direct = _AA is not None and _NOAA is not None
    for k, (img, (top, left, h, w)) in enumerate(zip(images, boxes)):
        # The crop as a strided [1, 3, h, w] view of the record (no copy). One as_strided call
        # is measurably cheaper per sample than img[:, t:t+h, l:l+w].unsqueeze(0).
        sc, sy, sx = img.stride()
        crop = img.as_strided((1, 3, h, w), (sc * 3, sc, sy, sx), img.storage_offset() + top * sy + left * sx)
        # Antialiasing only changes the result when shrinking; skipping it when enlarging saves time.
        antialias = h > size or w > size
        if direct:
            # The ATen kernels directly, writing into the batch slot (out=): no output temporary
            # and none of F.interpolate's Python argument checking per call. (The kernel itself
            # copies a crop narrower than its record into a contiguous buffer first: a small
            # share of its time in `perf`; the separable passes dominate. Figures: bench/results/NOTES.md.)
            if top == 0 and left == 0 and crop.is_contiguous():
                # A whole contiguous CHW image (not a cache record, which is an HWC view) trips an
                # internal assert of these kernels with a channels_last out= (torch 2.13): give it
                # channels_last too (one copy, only for this rare case; tests/test_batch_pool.py).
                crop = crop.contiguous(memory_format=torch.channels_last)
            (_AA if antialias else _NOAA)(crop, (size, size), False, None, out=slots[k])
        else:  # pragma: no cover - torch builds without these private entry points
            out[k] = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=antialias,
                                   align_corners=False)[0]
        if flips[k]:
            # Mirror the slot while it is still in cache: one 48 KiB flip + copy in HWC order
            # A batched ``out[idx] = out[idx].flip(-1)`` over the channels_last batch gathers,
            # flips and scatters with 3-byte strides: measured far slower (bench/results/NOTES.md).
            sample = hwc[k]
            sample.copy_(sample.flip(1))
    return out


def _resize_grid(images: Sequence[torch.Tensor], boxes: list[tuple[int, int, int, int]],
                 flips: list[bool], size: int) -> torch.Tensor:
    hmax = max(int(img.shape[1]) for img in images)
    wmax = max(int(img.shape[2]) for img in images)
    padded = torch.zeros((len(images), 3, hmax, wmax), dtype=torch.float32)
    theta = torch.zeros((len(images), 2, 3), dtype=torch.float32)
    for k, (img, (top, left, h, w)) in enumerate(zip(images, boxes)):
        padded[k, :, : img.shape[1], : img.shape[2]] = img
        # Affine map from output coords in [-1, 1] to input coords (align_corners=False).
        sx = w / wmax
        sy = h / hmax
        cx = (2 * left + w) / wmax - 1
        cy = (2 * top + h) / hmax - 1
        theta[k] = torch.tensor([[-sx if flips[k] else sx, 0.0, cx], [0.0, sy, cy]])
    grid = F.affine_grid(theta, [len(images), 3, size, size], align_corners=False)
    res = F.grid_sample(padded, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return res.round_().clamp_(0, 255).to(torch.uint8)


def batch_view(flat: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """``flat`` (``n * 3 * size * size`` uint8 bytes) as a channels_last ``uint8 [n, 3, size, size]``."""
    # memory order N, H, W, C == channels_last strides for the logical N, C, H, W shape
    return flat[: n * 3 * size * size].view(n, size, size, 3).permute(0, 3, 1, 2)


def random_resized_crop_flip(images: Sequence[torch.Tensor], size: int, *,
                             generator: torch.Generator | None = None,
                             scale: tuple[float, float] = (0.08, 1.0),
                             ratio: tuple[float, float] = (3 / 4, 4 / 3),
                             flip_p: float = 0.5, method: str = "interpolate",
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Crop, resize to ``size x size`` and randomly flip each image; return ``uint8 [B, 3, S, S]``.

    Deterministic given ``generator`` (the global torch RNG when None). ``images`` may have
    different heights and widths. ``method`` is one of :data:`METHODS`. ``out``: a channels_last
    ``uint8 [B, 3, S, S]`` batch to write into (``"interpolate"`` only; e.g. :func:`batch_view` of a
    pooled buffer).
    """
    _check_method(method)
    check_images(images)
    boxes, flips = draw_crops(images, generator, scale, ratio, flip_p)
    if method == "grid":
        return _resize_grid(images, boxes, flips, size)
    return resize_crops(images, boxes, flips, size, out=out)


def _check_range(name: str, pair: tuple[float, float]) -> tuple[float, float]:
    lo, hi = (float(v) for v in pair)
    if not (0 < lo <= hi):
        raise ConfigError(f"{name}={pair!r}: expected (low, high) with 0 < low <= high")
    return lo, hi


def untag(data: Any) -> tuple[Any, Sequence[tuple[torch.Tensor, int]]]:
    """``(request, samples)`` from a ``(BatchRequest, samples)`` pair (the output of
    :class:`client.crop.TaggedDataset`), ``(None, data)`` for a plain list of samples."""
    tagged = isinstance(data, tuple) and len(data) == 2 and hasattr(data[0], "indices")
    if tagged and hasattr(data[0], "step"):
        return data[0], data[1]
    return None, data


class SeededCollate:
    """Randomness and options shared by the augmenting ``collate_fn`` classes.

    Randomness:

    * ``seed=None``: the process's global torch RNG. DataLoader seeds each worker's RNG from
      ``base_seed + worker_id`` with a fresh ``base_seed`` per epoch drawn from the main
      process (or from the DataLoader's ``generator=``), so runs are reproducible given
      ``torch.manual_seed`` / ``generator=`` and epochs differ.
    * ``seed=int``: a private generator per process, seeded from ``seed`` and (inside a worker)
      the worker's DataLoader seed, so it is also independent of other global RNG use.
    * ``seed=int`` and a batch that names itself (``(epoch, step, rank)``, as the trainer's batch
      sampler does, :class:`client.crop.BatchRequest`): a fresh generator per batch seeded from
      those numbers only, so a batch's crops do not depend on which worker made it or on what
      that worker did before -- what a bit-exact mid-epoch resume needs.
    """

    def __init__(self, *, seed: int | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                 reuse_buffers: int = 4) -> None:
        from client.batch_pool import BatchPool

        try:  # shared batch buffers each worker reuses (client.batch_pool); 0 = a fresh one per batch
            self.pool = BatchPool(reuse_buffers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.seed = seed
        self.scale = _check_range("scale", scale)
        self.ratio = _check_range("ratio", ratio)
        if not 0.0 <= float(flip_p) <= 1.0:
            raise ConfigError(f"flip_p={flip_p!r}: expected a probability in [0, 1]")
        self.flip_p = float(flip_p)
        self._gen: torch.Generator | None = None
        self._gen_key: int | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_gen"] = None  # a fresh generator per process (fork/spawn boundary)
        state["_gen_key"] = None
        return state

    def buffer_stats(self) -> dict[str, int]:
        """Batches built in fresh and in reused shared buffers, all workers (:mod:`client.batch_pool`)."""
        return self.pool.stats()

    def unpack(self, data: Any) -> tuple[Any, Sequence[tuple[torch.Tensor, int]], torch.Generator | None]:
        """``(request or None, samples, generator)`` for a plain list of samples or a
        ``(BatchRequest, samples)`` pair from :class:`client.crop.TaggedDataset`."""
        request, samples = untag(data)
        if request is not None:
            return request, samples, self._generator((request.epoch, request.step, request.rank))
        return None, samples, self._generator()

    def _generator(self, tag: tuple[int, ...] | None = None) -> torch.Generator | None:
        if self.seed is None:
            return None
        if tag is not None:  # a per-batch stream: depends on (seed, tag) only
            mixed = int(self.seed)
            for v in tag:
                mixed = (mixed * 1_000_003 + int(v) + 7919) % (2**61 - 1)
            return torch.Generator().manual_seed(mixed)
        info = torch.utils.data.get_worker_info()
        key = info.seed if info is not None else -1
        if self._gen is None or self._gen_key != key:
            self._gen = torch.Generator().manual_seed((self.seed * 1_000_003 + key) % (2**63))
            self._gen_key = key
        return self._gen


class AugmentCollate(SeededCollate):
    """``collate_fn`` turning ``[(uint8 CHW tensor, label), ...]`` into ``(uint8 [B,3,S,S], int64 [B])``.

    Runs inside DataLoader workers (it is a small picklable object, fine for spawn), so the
    crop/resize work is spread across them (randomness: :class:`SeededCollate`). The trainer
    uses :class:`client.crop.CropCollate` instead, which leaves the resize to the device.

    ``reuse_buffers`` (default 4): shared-memory batch buffers each worker reuses once the main
    process holds no reference to them (:mod:`client.batch_pool`: safe whatever the consumer keeps;
    0 = a fresh buffer per batch, e.g. when batches are handed on to another process).
    :meth:`buffer_stats` counts batches built in fresh and in reused buffers.
    """

    def __init__(self, size: int, *, seed: int | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                 method: str = "interpolate", reuse_buffers: int = 4) -> None:
        _check_method(method)
        if int(reuse_buffers) < 0:
            raise ConfigError(f"reuse_buffers must be >= 0 (0 = a fresh buffer per batch), "
                              f"got {reuse_buffers}")
        super().__init__(seed=seed, scale=scale, ratio=ratio, flip_p=flip_p,
                         reuse_buffers=reuse_buffers if method == "interpolate" else 0)  # grid: own tensor
        self.size = int(size)
        self.method = method

    def __call__(self, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from client.batch_pool import PooledBatch

        _, batch, generator = self.unpack(data)
        images = [item[0] for item in batch]
        check_images(images)  # before a pooled buffer is taken: a refused batch holds no slot
        labels = torch.tensor([int(item[1]) for item in batch], dtype=torch.int64)
        ticket = None
        out = None
        if self.method == "interpolate":
            flat, ticket = self.pool.take(len(images) * 3 * self.size * self.size)
            out = batch_view(flat, len(images), self.size)
        try:
            out = random_resized_crop_flip(images, self.size, generator=generator, scale=self.scale,
                                           ratio=self.ratio, flip_p=self.flip_p, method=self.method, out=out)
        except BaseException:
            self.pool.give_back(ticket)  # nothing was sent: the slot is this worker's again
            raise
        return PooledBatch((out, labels), ticket)


def _measure() -> None:  # pragma: no cover - manual measurement helper
    import time

    g = torch.Generator().manual_seed(0)
    # HWC memory viewed as CHW, like CachedImageNet's hit path
    imgs = [torch.randint(0, 256, (160, int(w), 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
            for w in torch.randint(160, 320, (256,), generator=g).tolist()]
    torch.set_num_threads(1)
    for method in METHODS:
        random_resized_crop_flip(imgs[:8], 128, method=method)
        t = time.perf_counter()
        for _ in range(5):
            random_resized_crop_flip(imgs, 128, generator=torch.Generator().manual_seed(1), method=method)
        print(f"{method}: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms per batch of 256 (1 thread)")


if __name__ == "__main__":  # pragma: no cover
    _measure()
