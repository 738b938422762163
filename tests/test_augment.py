"""Batched random-resized-crop + flip (client.augment)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from client.augment import AugmentCollate, random_resized_crop_flip, rrc_params
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
