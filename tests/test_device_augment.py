"""Device half of the split augmentation (trainer.device_augment): resize + flip + normalise of crop
windows, against PIL's crop + resize of the same boxes and against a sequential re-statement of
Pillow's resampling coefficients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from client.augment import draw_crops, random_resized_crop_flip
from client.crop import CenterCropCollate, CropCollate, resized_size
from trainer.device_augment import DeviceAugment, axis_weights, resize_interpolate, resize_matmul


def _photo(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Smooth structure plus noise (edges and texture, like a photo), uint8 HWC."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(x / 7.0 + c) * np.cos(y / 5.0 - c) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def samples() -> list[tuple[np.ndarray, torch.Tensor]]:
    rng = np.random.default_rng(0)
    sizes = list(zip(rng.integers(12, 160, 30), rng.integers(12, 220, 30)))
    arrays = [_photo(int(h), int(w), rng) for h, w in sizes]
    return [(a, torch.from_numpy(a).permute(2, 0, 1)) for a in arrays]  # CHW views of HWC memory


def _chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).int()


@pytest.mark.parametrize("size", [16, 48, 100])
@pytest.mark.parametrize("method", ["matmul", "interpolate"])
def test_training_batch_matches_pil_crop_and_resize(samples, size: int, method: str) -> None:
    images = [t for _, t in samples]
    batch = CropCollate(seed=1)([(t, k) for k, t in enumerate(images)])
    boxes, flips = draw_crops(images, CropCollate(seed=1)._generator(None), (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
    if method == "matmul":
        out = resize_matmul(batch, size).round().clamp(0, 255)
    else:
        out = resize_interpolate(batch, size)
    assert out.shape == (len(images), 3, size, size)
    diffs = []
    for k, ((arr, _), (top, left, h, w)) in enumerate(zip(samples, boxes)):
        ref = Image.fromarray(arr).crop((left, top, left + w, top + h)).resize((size, size), Image.BILINEAR)
        if flips[k]:
            ref = ref.transpose(Image.FLIP_LEFT_RIGHT)
        diffs.append((out[k].int() - _chw(ref)).abs())
    d = torch.stack(diffs)
    # Pillow resamples in fixed point and rounds its first (horizontal) pass to uint8 before the
    # vertical one; one rounding of the exact value can therefore differ from it by 1, never more.
    assert int(d.max()) <= 1
    assert float(d.float().mean()) < 0.25


def _pil_coeffs(in_size: int, out_size: int, box0: float, box1: float) -> np.ndarray:
    """Pillow's precompute_coeffs (Resample.c) for the bilinear filter, re-stated sequentially."""
    scale = (box1 - box0) / out_size
    filterscale = max(scale, 1.0)
    support = 1.0 * filterscale
    out = np.zeros((out_size, in_size))
    for xx in range(out_size):
        center = box0 + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        ws = [max(0.0, 1.0 - abs((x - center + 0.5) / filterscale)) for x in range(xmin, xmax)]
        total = sum(ws)
        for x, wv in zip(range(xmin, xmax), ws):
            out[xx, x] = wv / total if total else 0.0
    return out


def test_axis_weights_are_pillows_coefficients() -> None:
    cases = [(40, 16, 0.0, 40.0), (40, 16, 3.25, 30.5), (10, 37, 0.0, 10.0), (213, 64, 17.4, 190.0),
             (7, 7, 0, 7)]
    for n_in, n_out, b0, b1 in cases:
        w = axis_weights(torch.tensor([b0]), torch.tensor([b1 - b0]), torch.tensor([n_in]), n_out,
                         n_in + 5)[0]
        ref = _pil_coeffs(n_in, n_out, b0, b1)
        np.testing.assert_allclose(w[:, :n_in].numpy(), ref, atol=2e-6)
        assert float(w[:, n_in:].abs().max()) == 0.0  # the padding past the window is never read
    flipped = axis_weights(torch.tensor([0.0]), torch.tensor([40.0]), torch.tensor([40]), 16, 40,
                           flip=torch.tensor([True]))[0]
    np.testing.assert_allclose(flipped.numpy(), _pil_coeffs(40, 16, 0, 40)[::-1], atol=2e-6)


@pytest.mark.parametrize("size", [20, 64])
def test_validation_batch_matches_pil_resize_then_centre_crop(samples, size: int) -> None:
    batch = CenterCropCollate(size)([(t, 0) for _, t in samples])
    out = DeviceAugment().resize(batch, size).round().clamp(0, 255)  # fractional boxes: the matmul path
    for k, (arr, _) in enumerate(samples):
        h, w = arr.shape[:2]
        rh, rw = resized_size(h, w, int(size / 0.875))
        top, left = round((rh - size) / 2.0), round((rw - size) / 2.0)
        ref = Image.fromarray(arr).resize((rw, rh), Image.BILINEAR).crop((left, top, left + size, top + size))
        assert int((out[k].int() - _chw(ref)).abs().max()) <= 1, k
    with pytest.raises(ValueError, match="cut for output size"):
        DeviceAugment()(batch, size + 1)
    with pytest.raises(ValueError, match="whole-window"):
        resize_interpolate(batch, size)


def test_same_pixels_as_the_cpu_collate_and_normalisation(samples) -> None:
    images = [t for _, t in samples]
    cpu = random_resized_crop_flip(images, 32, generator=CropCollate(seed=2)._generator(None))  # today's path
    batch = CropCollate(seed=2)([(t, k % 10) for k, t in enumerate(images)])
    for method in ("matmul", "interpolate", "auto"):
        aug = DeviceAugment(method=method, memory_format=torch.channels_last)
        x, y = aug(batch, 32)
        assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(y, batch.labels)
        mean = torch.tensor(aug.mean).view(1, 3, 1, 1)
        std = torch.tensor(aug.std).view(1, 3, 1, 1)
        pixels = (x * std + mean) * 255  # undo the normalisation
        assert float((pixels - cpu.float()).abs().max()) <= 1.0 + 1e-3, method
    assert DeviceAugment().method_for(batch) == "interpolate"  # CPU training batch
    ready = random_resized_crop_flip(images, 8)
    x, _ = DeviceAugment(dtype=torch.bfloat16)((ready, torch.zeros(len(images), dtype=torch.long)), 8)
    ref = ((ready.float() / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
           / torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
    assert x.dtype == torch.bfloat16 and torch.allclose(x.float(), ref, atol=0.02)
    with pytest.raises(ValueError, match="uint8"):
        DeviceAugment()((ready.float(), torch.zeros(1)), 8)
    with pytest.raises(ValueError, match="auto, matmul, interpolate"):
        DeviceAugment(method="grid")


def test_upscaling_and_extreme_boxes_stay_finite() -> None:
    tiny = torch.full((3, 1, 1), 200, dtype=torch.uint8)  # a 1x1 window blown up to 64x64
    long = torch.randint(0, 256, (3, 2, 300), dtype=torch.uint8)
    batch = CropCollate(seed=0)([(tiny, 0), (long, 1)])
    out = resize_matmul(batch, 64)
    assert torch.isfinite(out).all() and torch.allclose(out[0], torch.full_like(out[0], 200.0))
    assert math.isclose(float(axis_weights(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1]), 64,
                                           4)[0].sum()), 64.0, rel_tol=1e-6)
