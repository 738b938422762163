"""Batched random-resized-crop + flip (client.augment)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


def _reference_box(height: int, width: int, tries: list[list[float]], pos: list[float],
                   scale: tuple[float, float], ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params written out per sample, fed with given uniforms."""
    import math

    area = height * width
    for u_area, u_ratio in tries:
        target = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u_ratio)
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return (min(int(pos[0] * (height - h + 1)), height - h),
                    min(int(pos[1] * (width - w + 1)), width - w), h, w)
    if width / height < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif width / height > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("scale", [(0.08, 1.0), (0.5, 0.6), (2.0, 3.0)])
def test_vectorised_rrc_params_match_per_sample_reference(scale: tuple[float, float]) -> None:
    g = torch.Generator().manual_seed(4)
    sizes = [(160, w) for w in torch.randint(1, 330, (400,), generator=g).tolist()]
    sizes += [(h, 160) for h in range(1, 330, 7)] + [(1, 100), (100, 10), (50, 60), (1, 1)]
    ratio = (3 / 4, 4 / 3)
    boxes = rrc_params_batch(sizes, torch.Generator().manual_seed(9), scale, ratio)
    # the same uniforms, in the same order: [n, 10, 2] tries, then [n, 2] positions
    g = torch.Generator().manual_seed(9)
    tries = torch.rand((len(sizes), 10, 2), generator=g).tolist()
    pos = torch.rand((len(sizes), 2), generator=g).tolist()
    expected = [_reference_box(h, w, tries[k], pos[k], scale, ratio) for k, (h, w) in enumerate(sizes)]
    assert [tuple(b) for b in boxes] == expected
    if scale == (2.0, 3.0):  # every try fails: all rows took the centre-crop fallback
        assert boxes[-4:] == [(0, 49, 1, 1), ((100 - 13) // 2, 0, 13, 10), (0, 0, 50, 60), (0, 0, 1, 1)]
    # the one-sample function makes the same draws as one batch row
    assert rrc_params(160, 213, torch.Generator().manual_seed(3), scale) == \
        rrc_params_batch([(160, 213)], torch.Generator().manual_seed(3), scale)[0]


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
