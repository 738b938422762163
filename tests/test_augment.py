"""Batched random-resized-crop + flip (client.augment)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from client.augment import AugmentCollate, random_resized_crop_flip, rrc_params, rrc_params_batch
from datacache.config import ConfigError


def _images(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(40, 90, (n,), generator=g).tolist()
    # HWC memory viewed as CHW, like CachedImageNet's hit path
    return [torch.randint(0, 256, (40, w, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
            for w in widths]


def test_rrc_params_follow_torchvision_rules() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        top, left, h, w = rrc_params(160, 213, g)
        assert top >= 0 and top + h <= 160 and left >= 0 and left + w <= 213
        assert 0.08 * 0.9 <= h * w / (160 * 213) <= 1.0
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    # 10 failed tries -> centre crop clamped to the ratio range (a 1 x 100 strip always fails)
    assert rrc_params(1, 100, g) == (0, 49, 1, 1)
    h = round(10 / 0.75)
    assert rrc_params(100, 10, g, scale=(2.0, 3.0)) == ((100 - h) // 2, 0, h, 10)
    assert rrc_params(50, 60, g, scale=(2.0, 3.0)) == (0, 0, 50, 60)  # in-range ratio: whole image


def test_batch_shape_determinism_and_flip() -> None:
    imgs = _images(6)
    a = random_resized_crop_flip(imgs, 24, generator=torch.Generator().manual_seed(7))
    b = random_resized_crop_flip(imgs, 24, generator=torch.Generator().manual_seed(7))
    c = random_resized_crop_flip(imgs, 24, generator=torch.Generator().manual_seed(8))
    assert a.shape == (6, 3, 24, 24) and a.dtype == torch.uint8
    assert torch.equal(a, b) and not torch.equal(a, c)
    # scale (1, 1) with the image's own ratio -> whole image; flip_p 1 -> mirrored resize
    img = imgs[0][:, :, :40]  # 40 x 40
    full = random_resized_crop_flip([img], 20, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=1.0)
    ref = F.interpolate(img.unsqueeze(0), size=(20, 20), mode="bilinear", antialias=True)[0].flip(-1)
    assert torch.equal(full[0], ref)
    noflip = random_resized_crop_flip([img], 20, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0)
    assert torch.equal(noflip[0], ref.flip(-1))


def test_grid_method_agrees_on_upscaling() -> None:
    img = _images(1)[0][:, :, :40]
    kw = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=1.0)
    a = random_resized_crop_flip([img], 64, method="interpolate", **kw).float()
    b = random_resized_crop_flip([img], 64, method="grid", **kw).float()
    # both bilinear, align_corners=False; they differ only at the border (clamping) and by rounding
    assert (a - b)[..., 2:-2, 2:-2].abs().max() <= 1.0
    with pytest.raises(ConfigError, match="interpolate, grid"):
        random_resized_crop_flip([img], 8, method="bicubic")
    with pytest.raises(ValueError, match="uint8"):
        random_resized_crop_flip([img.float()], 8)


def test_collate_seeded_and_global_rng() -> None:
    batch = [(im, k % 3) for k, im in enumerate(_images(5, seed=1))]
    x1, y1 = AugmentCollate(16, seed=3)(batch)
    x2, _ = AugmentCollate(16, seed=3)(batch)
    assert torch.equal(x1, x2) and y1.tolist() == [0, 1, 2, 0, 1] and y1.dtype == torch.int64
    assert x1.shape == (5, 3, 16, 16)
    torch.manual_seed(11)
    g1, _ = AugmentCollate(16)(batch)
    torch.manual_seed(11)
    g2, _ = AugmentCollate(16)(batch)
    assert torch.equal(g1, g2)
    assert not torch.equal(g1, x1)  # the seeded generator is independent of the global RNG


def _torchvision_spec_box(rng: random.Random, height: int, width: int) -> tuple[int, int]:
    """torchvision's RandomResizedCrop.get_params as its documentation states it, with Python's own
    RNG: area ~ U(0.08, 1) of the image, log aspect ratio ~ U(log 3/4, log 4/3), 10 attempts, then a
    centre crop clamped to the ratio range. Returns (h, w)."""
    for _ in range(10):
        area = height * width * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            return h, w
    if width / height < 3 / 4:
        return round(width / (3 / 4)), width
    if width / height > 4 / 3:
        return height, round(height * 4 / 3)
    return height, width


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(fa - fb).max())


@pytest.mark.parametrize("hw", [(160, 213), (160, 320), (320, 160), (100, 400)])
def test_box_distribution_matches_the_torchvision_spec(hw: tuple[int, int]) -> None:
    """Area fraction, aspect ratio and fallback rate of the boxes against an independent sampler."""
    height, width = hw
    n = 20000
    boxes = np.array(rrc_params_batch([hw] * n, torch.Generator().manual_seed(11)), dtype=np.int64)
    rng = random.Random(3)
    ref = np.array([_torchvision_spec_box(rng, height, width) for _ in range(n)], dtype=np.int64)
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= height).all() and (left + w <= width).all()
    crit = 1.95 * math.sqrt(2 / n)  # KS critical value at alpha = 0.001
    assert _ks(h * w / (height * width), ref[:, 0] * ref[:, 1] / (height * width)) < crit
    assert _ks(np.log(w / h), np.log(ref[:, 1] / ref[:, 0])) < crit
    # positions are uniform over the valid range
    room = height - h
    frac = top[room > 0] / room[room > 0]
    assert abs(frac.mean() - 0.5) < 0.02 and frac.min() == 0 and frac.max() == 1


def test_batch_pixels_equal_pil_crop_and_resize_of_the_same_boxes() -> None:
    """The reference is PIL: crop the box, resize bilinearly (antialiased when shrinking), mirror."""
    g = torch.Generator().manual_seed(2)
    hwc = []
    for h, w in [(160, 213), (160, 320), (90, 70), (60, 45), (200, 160), (48, 48)]:
        small = torch.randint(0, 256, (h // 4, w // 4, 3), dtype=torch.uint8, generator=g).numpy()
        hwc.append(np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)).copy())
    images = [torch.from_numpy(a).permute(2, 0, 1) for a in hwc]
    for size in (64, 24):
        out = random_resized_crop_flip(images, size, generator=torch.Generator().manual_seed(5))
        g = torch.Generator().manual_seed(5)  # the same boxes and flips as the call above drew
        boxes = rrc_params_batch([(int(i.shape[1]), int(i.shape[2])) for i in images], g)
        flips = (torch.rand(len(images), generator=g) < 0.5).tolist()
        assert 0 < sum(flips) < len(images)
        for k, (a, (top, left, h, w)) in enumerate(zip(hwc, boxes)):
            ref = Image.fromarray(a).crop((left, top, left + w, top + h)).resize((size, size),
                                                                                 Image.Resampling.BILINEAR)
            if flips[k]:
                ref = ref.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            diff = np.abs(np.asarray(ref).astype(int) - out[k].permute(1, 2, 0).numpy().astype(int))
            assert diff.max() <= 1 and diff.mean() < 0.5, (k, size, diff.max(), diff.mean())  # rounding only


def test_vectorised_and_per_sample_params_agree() -> None:
    """Consistency (not a reference): one row of the batch sampler equals the per-sample sampler."""
    for hw in [(160, 213), (1, 100), (100, 10), (50, 60), (330, 160)]:
        for seed in range(5):
            assert rrc_params(*hw, torch.Generator().manual_seed(seed)) == \
                rrc_params_batch([hw], torch.Generator().manual_seed(seed))[0]


def test_batch_matches_per_crop_interpolate_for_any_layout() -> None:
    """Every sample equals F.interpolate of its crop (antialiased only when shrinking), flipped
    exactly when its flip draw says so, whatever the input's memory layout or storage offset."""
    g = torch.Generator().manual_seed(2)
    hwc = [torch.randint(0, 256, (48, 70, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
           for _ in range(6)]
    chw = [torch.randint(0, 256, (3, 60, 45), dtype=torch.uint8, generator=g) for _ in range(6)]
    big = torch.randint(0, 256, (90, 100, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
    offset_views = [big[:, 7:70, 11:95], big[:, 30:, :50]]  # views with a storage offset
    images = hwc + chw + offset_views
    size = 32
    out = random_resized_crop_flip(images, size, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    boxes = rrc_params_batch([(int(i.shape[1]), int(i.shape[2])) for i in images], g)
    flips = (torch.rand(len(images), generator=g) < 0.5).tolist()
    assert 0 < sum(flips) < len(images)
    for k, (img, (top, left, h, w)) in enumerate(zip(images, boxes)):
        crop = img[:, top:top + h, left:left + w].unsqueeze(0)
        ref = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=h > size or w > size)[0]
        assert torch.equal(out[k], ref.flip(-1) if flips[k] else ref), k
