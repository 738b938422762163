"""Batched random-resized-crop + horizontal flip for uint8 CHW images of different sizes.

The cache serves uint8 ``[3, H, W]`` tensors whose short side is the variant's (e.g. 160)
and whose long side varies. Training wants one fixed-size ``uint8 [B, 3, S, S]`` batch.
:func:`random_resized_crop_flip` does that for a whole list at once:

* crop parameters follow torchvision's ``RandomResizedCrop.get_params`` exactly (area scale
  ``(0.08, 1)``, log-uniform aspect ratio ``(3/4, 4/3)``, 10 tries, then a centre crop
  clamped to the ratio range), drawn from a ``torch.Generator`` so results are reproducible;
* the resize runs in torch for the whole batch. Two methods are implemented:

  - ``"interpolate"`` (default): each crop is a strided *view* of its source (no copy), resized
    by ``F.interpolate(..., mode="bilinear", antialias=True)`` directly on uint8 (torch's
    AVX2 uint8 resampling kernel, the one torchvision uses) straight into its slot of the
    preallocated output batch. Antialiasing matches torchvision's tensor RRC.
  - ``"grid"``: one affine grid per sample and a single ``F.grid_sample`` over a padded float
    batch. One call, but it has to convert the padded batch to float first and it does not
    antialias (aliasing when shrinking a 320-px crop to 128).

  Measured on this (shared, 2-core) machine, B=256 crops of 160x(160..320) HWC records to
  128 px, one thread: "interpolate" 37-70 ms per batch, "grid" 290-530 ms (the float
  conversion of the padded batch and grid_sample's per-pixel gather dominate), so
  "interpolate" is the default and "grid" is kept for comparison (``python -m
  client.augment`` re-measures). Contiguous CHW inputs are ~2x slower than the HWC-backed
  views the cache yields.
* each resize writes straight into its slot of the output batch (``out=``); the flip is one
  batched ``flip(-1)`` over the chosen samples at the end.

:class:`AugmentCollate` is a ``collate_fn`` for ``torch.utils.data.DataLoader``: it runs in
the DataLoader worker processes, so augmentation is parallel across workers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

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
    """torchvision's RandomResizedCrop parameter sampling: returns ``(top, left, h, w)``."""
    return rrc_params_batch([(height, width)], generator, scale, ratio)[0]


def rrc_params_batch(sizes: Sequence[tuple[int, int]], generator: torch.Generator | None = None,
                     scale: tuple[float, float] = (0.08, 1.0),
                     ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> list[tuple[int, int, int, int]]:
    """:func:`rrc_params` for many ``(height, width)`` at once: all random draws in two torch
    calls (per-sample ``torch.rand`` calls cost ~14 us a sample, more than a tenth of the resize)."""
    n = len(sizes)
    tries = torch.rand((n, 10, 2), generator=generator).tolist()
    pos = torch.rand((n, 2), generator=generator).tolist()
    return [_rrc_from(h, w, tries[k], pos[k], scale, ratio) for k, (h, w) in enumerate(sizes)]


def _check_images(images: Sequence[torch.Tensor]) -> None:
    if len(images) == 0:
        raise ValueError("random_resized_crop_flip needs at least one image")
    for k, img in enumerate(images):
        if img.dim() != 3 or img.shape[0] != 3 or img.dtype != torch.uint8:
            raise ValueError(f"image {k}: expected a uint8 [3, H, W] tensor, got {img.dtype} "
                             f"{tuple(img.shape)} (CachedImageNet yields uint8 CHW tensors)")


# The ATen entry points behind F.interpolate(mode="bilinear"[, antialias=True]); private, so
# looked up defensively (None -> the F.interpolate fallback).
_AA = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
_NOAA = getattr(torch._C._nn, "upsample_bilinear2d", None)


def _new_batch(n: int, size: int) -> torch.Tensor:
    """Allocate the ``uint8 [n, 3, size, size]`` channels_last output batch.

    Process boundary: inside a DataLoader worker the batch is allocated in shared memory
    (as torch's default_collate does), so sending it to the main process moves a file
    descriptor instead of copying 12 MB through a pipe.
    """
    numel = n * 3 * size * size
    if torch.utils.data.get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(numel)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel,), (1,))
    else:
        flat = torch.empty(numel, dtype=torch.uint8)
    # memory order N, H, W, C == channels_last strides for the logical N, C, H, W shape
    return flat.view(n, size, size, 3).permute(0, 3, 1, 2)


def _resize_interpolate(images: Sequence[torch.Tensor], boxes: list[tuple[int, int, int, int]],
                        flips: list[bool], size: int) -> torch.Tensor:
    out = _new_batch(len(images), size)
    for k, (img, (top, left, h, w)) in enumerate(zip(images, boxes)):
        crop = img[:, top:top + h, left:left + w].unsqueeze(0)  # a strided view, no copy
        # Antialiasing only changes the result when shrinking; skipping it when enlarging saves time.
        antialias = h > size or w > size
        if _AA is not None and _NOAA is not None:
            # The ATen kernels directly, writing into the batch slot (out=): no temporary, no copy,
            # and none of F.interpolate's ~10 us of Python argument checking per call.
            (_AA if antialias else _NOAA)(crop, (size, size), False, None, out=out[k:k + 1])
        else:  # pragma: no cover - torch builds without these private entry points
            out[k] = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=antialias,
                                   align_corners=False)[0]
    flipped = [k for k, f in enumerate(flips) if f]
    if flipped:  # one batched flip of the chosen samples
        idx = torch.tensor(flipped)
        out[idx] = out[idx].flip(-1)
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


def random_resized_crop_flip(images: Sequence[torch.Tensor], size: int, *,
                             generator: torch.Generator | None = None,
                             scale: tuple[float, float] = (0.08, 1.0),
                             ratio: tuple[float, float] = (3 / 4, 4 / 3),
                             flip_p: float = 0.5, method: str = "interpolate") -> torch.Tensor:
    """Crop, resize to ``size x size`` and randomly flip each image; return ``uint8 [B, 3, S, S]``.

    Deterministic given ``generator`` (the global torch RNG when None). ``images`` may have
    different heights and widths. ``method`` is one of :data:`METHODS`.
    """
    if method not in METHODS:
        from datacache.config import ConfigError

        raise ConfigError(f"method={method!r} is not valid; choose one of {', '.join(METHODS)}")
    _check_images(images)
    sizes = [(int(img.shape[1]), int(img.shape[2])) for img in images]
    boxes = rrc_params_batch(sizes, generator, scale, ratio)
    flips = (torch.rand(len(images), generator=generator) < flip_p).tolist()
    if method == "grid":
        return _resize_grid(images, boxes, flips, size)
    return _resize_interpolate(images, boxes, flips, size)


class AugmentCollate:
    """``collate_fn`` turning ``[(uint8 CHW tensor, label), ...]`` into ``(uint8 [B,3,S,S], int64 [B])``.

    Runs inside DataLoader workers (it is a small picklable object, fine for spawn), so the
    crop/resize work is spread across them. Randomness:

    * ``seed=None``: the process's global torch RNG. DataLoader seeds each worker's RNG from
      ``base_seed + worker_id`` with a fresh ``base_seed`` per epoch drawn from the main
      process (or from the DataLoader's ``generator=``), so runs are reproducible given
      ``torch.manual_seed`` / ``generator=`` and epochs differ.
    * ``seed=int``: a private generator per process, seeded from ``seed`` and (inside a worker)
      the worker's DataLoader seed, so it is also independent of other global RNG use.
    """

    def __init__(self, size: int, *, seed: int | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5,
                 method: str = "interpolate") -> None:
        if method not in METHODS:
            from datacache.config import ConfigError

            raise ConfigError(f"method={method!r} is not valid; choose one of {', '.join(METHODS)}")
        self.size = int(size)
        self.seed = seed
        self.scale = scale
        self.ratio = ratio
        self.flip_p = flip_p
        self.method = method
        self._gen: torch.Generator | None = None
        self._gen_key: int | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_gen"] = None  # a fresh generator per process (fork/spawn boundary)
        state["_gen_key"] = None
        return state

    def _generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        info = torch.utils.data.get_worker_info()
        key = info.seed if info is not None else -1
        if self._gen is None or self._gen_key != key:
            self._gen = torch.Generator().manual_seed((self.seed * 1_000_003 + key) % (2**63))
            self._gen_key = key
        return self._gen

    def __call__(self, batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = [item[0] for item in batch]
        labels = torch.tensor([int(item[1]) for item in batch], dtype=torch.int64)
        out = random_resized_crop_flip(images, self.size, generator=self._generator(), scale=self.scale,
                                       ratio=self.ratio, flip_p=self.flip_p, method=self.method)
        return out, labels


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
