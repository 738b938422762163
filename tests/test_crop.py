"""Host side of the split augmentation (client.crop): crop windows, box statistics vs torchvision's
RandomResizedCrop spec, validation geometry, per-batch seeding, DataLoader workers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from client.augment import draw_crops, rrc_params_batch
from client.crop import (
    BatchRequest,
    CenterCropCollate,
    CropBatch,
    CropCollate,
    TaggedDataset,
    center_crop_geometry,
    resized_size,
)
from client.dataset import CachedImageNet


def _images(n: int, seed: int = 0, hmax: int = 60) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randint(8, hmax, (n,), generator=g).tolist()
    ws = torch.randint(8, 90, (n,), generator=g).tolist()
    # HWC memory viewed as CHW, like CachedImageNet's hit path
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
            for h, w in zip(hs, ws)]


def _same(a: CropBatch, b: CropBatch) -> bool:
    return (torch.equal(a.pixels, b.pixels) and torch.equal(a.meta, b.meta)
            and (a.hmax, a.wmax, a.size, a.epoch, a.step) == (b.hmax, b.wmax, b.size, b.epoch, b.step))


def test_windows_are_exact_copies_of_the_drawn_boxes() -> None:
    imgs = _images(12)
    batch = CropCollate(seed=5)([(im, k) for k, im in enumerate(imgs)])
    boxes, flips = draw_crops(imgs, CropCollate(seed=5)._generator(None), (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
    assert isinstance(batch, CropBatch) and len(batch) == 12 and batch.size == 0
    hp = max(b[2] for b in boxes)
    wp = max(b[3] for b in boxes)
    # packed: exactly the windows' bytes, back to back
    assert batch.pixels.dtype == torch.uint8
    assert batch.pixels.numel() == sum(3 * h * w for _, _, h, w in boxes)
    assert (batch.hmax, batch.wmax) == (hp, wp)
    padded = batch.padded()
    assert padded.shape == (12, hp, wp, 3)
    for k, (img, (top, left, h, w)) in enumerate(zip(imgs, boxes)):
        want = img[:, top:top + h, left:left + w].permute(1, 2, 0)
        assert batch.offsets[k].tolist() == [top, left] and batch.windows[k].tolist() == [h, w]
        assert torch.equal(batch.views()[k], want) and torch.equal(padded[k, :h, :w], want)
        assert not padded[k, h:].any() and not padded[k, :, w:].any()  # zero padding
        assert batch.boxes[k].tolist() == [0.0, h, 0.0, w]  # the whole window becomes the output
    assert batch.flips.tolist() == flips and batch.labels.tolist() == list(range(12))


def _torchvision_rrc(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, re-stated with Python's random module."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif in_ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, "right") / len(a)
    cdf_b = np.searchsorted(b, grid, "right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


@pytest.mark.parametrize("size", [(160, 213), (160, 320), (120, 90)])
def test_box_distribution_matches_torchvision_spec(size: tuple[int, int]) -> None:
    n = 20_000
    height, width = size
    ours = np.array(rrc_params_batch([size] * n, torch.Generator().manual_seed(0)), dtype=np.float64)
    rng = random.Random(1)
    ref = np.array([_torchvision_rrc(height, width, rng) for _ in range(n)], dtype=np.float64)

    def stats(b: np.ndarray) -> dict[str, np.ndarray]:
        top, left, h, w = b.T
        return {"area": h * w / (height * width), "log_aspect": np.log(w / h),
                "top": np.where(height > h, top / np.maximum(height - h, 1), 0.5),
                "left": np.where(width > w, left / np.maximum(width - w, 1), 0.5)}

    a, r = stats(ours), stats(ref)
    # KS critical value for two samples of 20,000 at alpha = 0.001 is ~0.0195
    for key in a:
        assert _ks(a[key], r[key]) < 0.025, key
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()
    assert abs(a["area"].mean() - r["area"].mean()) < 0.01


def test_per_batch_seed_depends_on_epoch_step_rank_only() -> None:
    samples = [(im, 0) for im in _images(6, seed=2)]
    collate = CropCollate(seed=9)
    a = collate((BatchRequest((0, 1, 2, 3, 4, 5), epoch=2, step=7, rank=1), samples))
    collate((BatchRequest((0,), epoch=0, step=0), samples[:1]))  # other batches in between change nothing
    b = CropCollate(seed=9)((BatchRequest((0, 1, 2, 3, 4, 5), epoch=2, step=7, rank=1), samples))
    c = collate((BatchRequest((0, 1, 2, 3, 4, 5), epoch=2, step=8, rank=1), samples))
    d = collate((BatchRequest((0, 1, 2, 3, 4, 5), epoch=2, step=7, rank=0), samples))
    assert _same(a, b) and a.step == 7 and a.epoch == 2
    assert not torch.equal(a.offsets, c.offsets) and not torch.equal(a.offsets, d.offsets)


def test_center_crop_geometry_follows_torchvision_resize_then_crop() -> None:
    assert resized_size(160, 213, 146) == (146, int(146 * 213 / 160))
    assert resized_size(300, 100, 73) == (int(73 * 300 / 100), 73)
    (top, left, wh, ww), (y0, hy, x0, wx) = center_crop_geometry(160, 213, 128)
    rh, rw = resized_size(160, 213, int(128 / 0.875))
    scale = 160 / rh
    # the output spans torchvision's centre crop of the resized image, mapped back to the record
    assert math.isclose(top + y0, round((rh - 128) / 2) * scale) and math.isclose(hy, 128 * scale)
    assert math.isclose(left + x0, round((rw - 128) / 2) * (213 / rw)) and math.isclose(wx, 128 * 213 / rw)
    # the window holds the crop plus the filter's support and stays inside the image
    assert top >= 0 and top + wh <= 160 and left >= 0 and left + ww <= 213
    assert y0 >= 1 and wh - (y0 + hy) >= 1 - 1e-9


def test_center_crop_collate_and_bad_input() -> None:
    imgs = _images(5, seed=3)
    batch = CenterCropCollate(24)([(im, 1) for im in imgs])
    assert batch.size == 24 and not batch.flips.any() and batch.labels.tolist() == [1] * 5
    views = batch.views()
    for k, img in enumerate(imgs):
        (top, left, wh, ww), box = center_crop_geometry(int(img.shape[1]), int(img.shape[2]), 24)
        assert torch.equal(views[k], img[:, top:top + wh, left:left + ww].permute(1, 2, 0))
        assert batch.boxes[k].tolist() == pytest.approx(list(box))
    with pytest.raises(ValueError, match="CropCollate needs at least one image"):
        CropCollate()([])
    with pytest.raises(ValueError, match="uint8"):
        CenterCropCollate(8)([(imgs[0].float(), 0)])
    with pytest.raises(ValueError, match="crop_fraction"):
        CenterCropCollate(8, crop_fraction=1.5)


def test_loader_workers_make_the_same_batches_as_the_main_process(small_imagefolder: str, tmp_path) -> None:
    ds = CachedImageNet(small_imagefolder, cache="lmdb://" + str(tmp_path / "c"), short_side=48)
    requests = [BatchRequest(tuple(range(k, k + 6)), epoch=1, step=k, rank=0) for k in range(0, 18, 6)]
    collate = CropCollate(seed=4)
    tagged = TaggedDataset(ds)
    direct = [collate(tagged.__getitems__(r)) for r in requests]
    loader = DataLoader(tagged, batch_sampler=requests, num_workers=2, collate_fn=collate)
    for want, got in zip(direct, loader):  # shared-memory buffers from the workers, same crops
        assert _same(want, got) and torch.equal(want.labels, got.labels) and got.step == want.step
    plain = DataLoader(ds, batch_size=4, collate_fn=CropCollate(seed=1))  # a plain DataLoader works too
    first = next(iter(plain))
    assert len(first) == 4 and first.step == -1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA device")
def test_pin_memory_and_to_device() -> None:  # pragma: no cover - GPU only
    batch = CropCollate(seed=0)([(im, 0) for im in _images(3)])
    pinned = batch.pin_memory()
    # the two tensors a batch holds (labels, flips are columns of meta, derived on access)
    assert pinned.pixels.is_pinned() and pinned.meta.is_pinned()
    dev = pinned.to("cuda", non_blocking=True)
    assert torch.equal(dev.pixels.cpu(), batch.pixels) and dev.flips.device.type == "cuda"
    assert torch.equal(dev.padded().cpu(), batch.padded())  # the scatter on the GPU
