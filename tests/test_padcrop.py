"""Pad-and-crop + flip for small images (``--augment padcrop``): the host cuts the part of each
crop that lies on the image (client.crop.PadCropCollate), the device places, flips and normalises it
(trainer.device_augment). References: torchvision's own ``RandomCrop(size, padding)`` /
``RandomHorizontalFlip`` / ``ToTensor`` / ``Normalize`` code (pure Python, via the shim) over PIL images;
inputs: Pillow's vendored ``hopper.png`` (real pixels) and, where Debian's package is installed,
Zalando's Fashion-MNIST (single-channel).
"""

from __future__ import annotations

import gzip
import os
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torch._subclasses.fake_tensor import FakeTensorMode

from client.crop import BatchRequest, PadCropCollate, draw_pad_crops, pad_crop_geometry
from datacache.config import ConfigError
from tests.torchvision_ref import torchvision_or_skip
from trainer.device_augment import DeviceAugment
from trainer.train_config import FASHION_MEAN, FASHION_STD, make_config

HOPPER = os.path.join(os.path.dirname(__file__), "data", "pillow", "hopper.png")
FASHION = "/usr/share/datasets/fashion-mnist"


def _tiles(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    """Real pixels: windows of Pillow's hopper.png, one per ``(h, w)``."""
    src = Image.open(HOPPER).convert("RGB")
    out = []
    for k, (h, w) in enumerate(sizes):
        x, y = (7 * k) % (src.width - w), (11 * k) % (src.height - h)
        out.append(src.crop((x, y, x + w, y + h)))
    return out


def _chw(img: Image.Image) -> torch.Tensor:
    """The cache's layout: HWC memory viewed as a uint8 ``[3, H, W]`` tensor."""
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def _reference(tv, img: Image.Image, top: int, left: int, size: int, pad: int, flip: bool) -> np.ndarray:
    """torchvision's RandomCrop(size, padding=pad) + RandomHorizontalFlip with the box and flip given."""
    import torchvision.transforms.functional as F

    padded = F.pad(img, pad, fill=0, padding_mode="constant")
    out = F.crop(padded, top, left, size, size)
    if flip:
        out = F.hflip(out)
    return np.array(out, dtype=np.float32).transpose(2, 0, 1)


@pytest.mark.parametrize("shape,size,pad", [((28, 28), 28, 4), ((20, 31), 24, 4), ((32, 32), 32, 2),
                                            ((28, 28), 28, 0)])
def test_device_output_equals_torchvision_pad_crop_flip(shape: tuple[int, int], size: int, pad: int) -> None:
    tv = torchvision_or_skip()
    images = _tiles([shape] * 24)
    batch = PadCropCollate(size, pad, seed=3)([(_chw(im), k) for k, im in enumerate(images)])
    # the same draws again: a fresh collate's generator starts where the first one's did
    corners, flips = draw_pad_crops([_chw(im) for im in images],
                                    PadCropCollate(size, pad, seed=3)._generator(), size, pad, 0.5)
    got = DeviceAugment().resize(batch, size)  # pixel units, before normalisation
    assert got.shape == (24, 3, size, size)
    for k, im in enumerate(images):
        ref = _reference(tv, im, *corners[k], size, pad, flips[k])
        assert np.array_equal(got[k].numpy(), ref), f"sample {k}: box {corners[k]} flip {flips[k]}"
    assert any(flips) and not all(flips)


def test_boxes_cover_torchvision_get_params_range_uniformly() -> None:
    tv = torchvision_or_skip()
    import torchvision.transforms as T

    img = _chw(_tiles([(20, 31)])[0])
    seen: Counter[tuple[int, int]] = Counter()
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        corners, _ = draw_pad_crops([img] * 100, g, 24, 4, 0.5)
        seen.update(corners)
    # torchvision's own get_params on the padded image, the definition of the box range
    padded = torch.zeros(3, 20 + 8, 31 + 8)
    ref = {T.RandomCrop.get_params(padded, (24, 24))[:2] for _ in range(4000)}  # (i, j, h, w)
    assert set(seen) == ref == {(i, j) for i in range(5) for j in range(16)}
    counts = np.array(list(seen.values()))
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()  # 6,000 draws, 80 cells
    assert tv is not None


def test_geometry_window_lies_on_the_image_and_box_holds_the_padding() -> None:
    # corner (0, 0): the crop starts 4 px into the padding on both axes
    assert pad_crop_geometry(28, 28, 0, 0, 28, 4) == ((0, 0, 24, 24), (-4.0, 28.0, -4.0, 28.0))
    # corner (8, 8): the crop ends 4 px into the padding
    assert pad_crop_geometry(28, 28, 8, 8, 28, 4) == ((4, 4, 24, 24), (0.0, 28.0, 0.0, 28.0))
    assert pad_crop_geometry(28, 28, 4, 4, 28, 4) == ((0, 0, 28, 28), (0.0, 28.0, 0.0, 28.0))


def test_normalised_batch_equals_totensor_normalize() -> None:
    tv = torchvision_or_skip()
    import torchvision.transforms as T

    mean, std = float(FASHION_MEAN), float(FASHION_STD)
    images = _tiles([(28, 28)] * 8)
    collate = PadCropCollate(28, 4, seed=9)
    batch = collate([(_chw(im), k) for k, im in enumerate(images)])
    corners, flips = draw_pad_crops([_chw(im) for im in images], PadCropCollate(28, 4, seed=9)._generator(),
                                    28, 4, 0.5)
    x, y = DeviceAugment((mean,) * 3, (std,) * 3)(batch, 28)
    to_input = T.Compose([T.ToTensor(), T.Normalize((mean,), (std,))])  # a 1-value mean broadcasts
    for k, im in enumerate(images):
        ref = to_input(Image.fromarray(_reference(tv, im, *corners[k], 28, 4, flips[k])
                                       .transpose(1, 2, 0).astype(np.uint8)))
        torch.testing.assert_close(x[k], ref, rtol=0, atol=2e-6)
    assert y.tolist() == list(range(8))


def test_same_batch_whichever_worker_makes_it() -> None:
    images = [(_chw(im), k) for k, im in enumerate(_tiles([(28, 28)] * 6))]
    req = BatchRequest(tuple(range(6)), epoch=2, step=7, rank=1)
    a = PadCropCollate(28, 4, seed=1)((req, images))
    b = PadCropCollate(28, 4, seed=1)((req, images))
    c = PadCropCollate(28, 4, seed=1)((BatchRequest(req.indices, 2, 8, 1), images))
    assert torch.equal(a.pixels, b.pixels) and torch.equal(a.meta, b.meta)
    assert not torch.equal(a.meta, c.meta)


def test_bad_sizes_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="padding < size"):
        PadCropCollate(28, 28)
    img = _chw(_tiles([(10, 10)])[0])
    with pytest.raises(ValueError, match=r"image 0 \(\(10, 10\)\) padded by 4 is smaller than the 28-px"):
        PadCropCollate(28, 4, seed=0)([(img, 0)])
    with pytest.raises(ConfigError, match="padcrop crops one size"):
        make_config("fashion", resolution="0:24,5:28")
    with pytest.raises(ConfigError, match="pad=28 must be smaller"):
        make_config("fashion", pad=28)
    with pytest.raises(ConfigError, match=r"mean='0.1,0.2': expected 3 comma-separated numbers"):
        make_config("fashion", mean="0.1,0.2")
    with pytest.raises(ConfigError, match="all > 0"):
        make_config("fashion", std="0")
    with pytest.raises(ConfigError, match="augment='crop'; choose one of rrc, padcrop"):
        make_config("fashion", augment="crop")


def test_device_placement_under_fake_cuda() -> None:
    images = [(_chw(im), k) for k, im in enumerate(_tiles([(28, 28)] * 4))]
    batch = PadCropCollate(28, 4, seed=0)(images)
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = batch.to(torch.device("cuda", 0))
        aug = DeviceAugment((0.286,) * 3, (0.353,) * 3)
        assert aug.method_for(dev) == "matmul"
        x, y = aug(dev, 28)
        assert x.device.type == "cuda" and y.device.type == "cuda" and tuple(x.shape) == (4, 3, 28, 28)


def _idx(path: str) -> np.ndarray:
    with gzip.open(path) as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * d:8 + 4 * d], "big") for d in range(dims)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="Debian's dataset-fashion-mnist is not installed "
                    "(apt-get install dataset-fashion-mnist; ./quickstart.sh test installs it)")
def test_fashion_constants_and_single_channel_images_become_three_equal_channels(tmp_path) -> None:
    """The recipe's mean/std are the training split's; a grayscale PNG is served as 3 equal channels,
    exactly what ImageFolder's RGB loader gives, and trains through the same batch."""
    tv = torchvision_or_skip()
    import torchvision.datasets as datasets

    from client.dataset import CachedImageNet

    train = _idx(os.path.join(FASHION, "train-images-idx3-ubyte.gz")).astype(np.float64) / 255.0
    assert abs(train.mean() - float(FASHION_MEAN)) < 5e-5 and abs(train.std() - float(FASHION_STD)) < 5e-5
    labels = _idx(os.path.join(FASHION, "train-labels-idx1-ubyte.gz"))
    for k in range(12):
        d = tmp_path / "tree" / str(int(labels[k]))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray((train[k] * 255).round().astype(np.uint8), mode="L").save(d / f"{k:05d}.png")
    ours = CachedImageNet(str(tmp_path / "tree"), cache=f"lmdb://{tmp_path / 'cache'}", short_side=28)
    ref = datasets.ImageFolder(str(tmp_path / "tree"))
    assert ours.samples == ref.samples
    for k in range(len(ref)):
        img, target = ours[k]
        pil, ref_target = ref[k]
        assert pil.mode == "RGB" and target == ref_target
        assert tuple(img.shape) == (3, 28, 28)
        assert torch.equal(img, _chw(pil)) and torch.equal(img[0], img[1]) and torch.equal(img[1], img[2])
    batch = PadCropCollate(28, 4, seed=0)([ours[k] for k in range(len(ours))])
    x = DeviceAugment().resize(batch, 28)
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 1], x[:, 2])
    assert tv is not None


def test_place_path_equals_the_matmul_path_and_validation_windows() -> None:
    """The CPU placement (auto on CPU pad-crop batches) gives the matmul path's pixels, also for boxes that
    start inside their window (a centre crop at scale 1 of a taller image)."""
    from client.crop import CenterCropCollate

    images = [(_chw(im), k) for k, im in enumerate(_tiles([(28, 28)] * 16 + [(30, 28), (28, 33)]))]
    for batch in (PadCropCollate(28, 4, seed=5)(images[:16]), CenterCropCollate(28, 1.0)(images[16:])):
        assert DeviceAugment().method_for(batch) == "place"
        placed = DeviceAugment(method="place").resize(batch, 28)
        ref = DeviceAugment(method="matmul").resize(batch, 28)
        assert placed.dtype == torch.uint8 and placed.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(placed.float(), ref)
    with pytest.raises(ValueError, match=r"method='place'\) needs a CPU batch of 28-px boxes at scale 1"):
        DeviceAugment(method="place").resize(CenterCropCollate(28, 0.875)(images[:2]), 28)
