"""decode_image against an independent reference of the documented policy, on real hostile files.

The corpus is a vendored subset of Pillow's own test images (``tests/data/pillow/README.md``). The
reference below is written from the policy in ``datacache/decode.py``'s docstring with plain Pillow
and numpy calls -- it never calls datacache.decode: open, DCT-scale JPEG/MPO with ``draft`` to the
target in the stored orientation, ``load()``, ``ImageOps.exif_transpose``, convert to RGB (alpha over
white, 16-bit scaled with rounding), Pillow resize with ``reducing_gap=3``. Every file either decodes
to exactly the reference's bytes, or -- when the reference itself cannot decode it -- raises a
one-line :class:`DecodeError` (and ``fill_one`` skips it with a reason, no crash).
"""

from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest
from PIL import Image, ImageOps

from datacache.config import Variant
from datacache.decode import DecodeError, decode_image
from datacache.fill import fill_one

CORPUS = os.path.join(os.path.dirname(__file__), "data", "pillow")
FILES = sorted(f for f in os.listdir(CORPUS) if f != "README.md")
VARIANTS = [Variant(short_side=48), Variant(short_side=100, max_long_side=150, resample="bicubic")]
RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def _size(w: int, h: int, short: int, cap: int) -> tuple[int, int]:
    """torchvision's ``Resize(short, max_size=cap)`` size rule, as its documentation states it: the short
    side becomes ``short``, the long one ``int(short * long / short_side)``; if that exceeds ``cap``, the
    long side becomes ``cap`` and the short one is scaled down with it (truncated)."""
    s_side, l_side = min(w, h), max(w, h)
    new_s, new_l = short, int(short * l_side / s_side)
    if new_l > cap:
        new_s, new_l = int(cap * new_s / new_l), cap
    new_s, new_l = max(1, new_s), max(1, new_l)
    return (new_s, new_l) if w <= h else (new_l, new_s)


def _draft(size: tuple[int, int]) -> tuple[int, int]:
    """The project's DCT-scaling rule (docs): ask Pillow's draft for 1.15x the target, so a resize of at
    least 1.15x always follows the DCT scaling."""
    return math.ceil(size[0] * 1.15), math.ceil(size[1] * 1.15)


def _rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        v = np.clip(np.asarray(im).astype(np.int64), 0, 65535)
        return Image.fromarray(((v * 255 + 32767) // 65535).astype(np.uint8)).convert("RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        over = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(over, im.convert("RGBA")).convert("RGB")
    if im.mode == "1":
        return im.convert("L").convert("RGB")
    return im.convert("RGB")


def reference(data: bytes, v: Variant) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    w, h = im.size
    if im.format in ("JPEG", "MPO"):
        turned = im.getexif().get(274, 1) >= 5
        tw, th = _size(h, w, v.short_side, v.long_cap) if turned else _size(w, h, v.short_side, v.long_cap)
        im.draft("RGB", _draft((th, tw) if turned else (tw, th)))
        im.load()
        im = ImageOps.exif_transpose(im)
    else:
        im.load()
        im = ImageOps.exif_transpose(im)
        tw, th = _size(im.width, im.height, v.short_side, v.long_cap)
    im = _rgb(im)
    if im.size != (tw, th):
        im = im.resize((tw, th), RESAMPLE[v.resample], reducing_gap=3.0)
    return np.asarray(im)


def _read(name: str) -> bytes:
    with open(os.path.join(CORPUS, name), "rb") as f:
        return f.read()


def test_corpus_is_small_and_broad() -> None:
    total = sum(os.path.getsize(os.path.join(CORPUS, f)) for f in os.listdir(CORPUS))
    assert 40 <= len(FILES) <= 80 and total < 3 * 2**20
    names = " ".join(FILES)
    for must in ("g4_orientation_8.tif", "hopper_orientation_8.jpg", "pil_sample_cmyk.jpg", ".mpo",
                 "16bit", "iccprofile", "truncated_jpeg.jpg", "app13-multiple.jpg"):
        assert must in names


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.tag())
@pytest.mark.parametrize("name", FILES)
def test_corpus_file_matches_reference_or_is_a_clear_error(name: str, v: Variant) -> None:
    data = _read(name)
    try:
        want = reference(data, v)
    except Exception:  # the reference cannot decode it: a clear one-line DecodeError, never a crash
        with pytest.raises(DecodeError) as e:
            decode_image(data, v, name=name)
        assert name in str(e.value) and "\n" not in str(e.value)
        got = fill_one(data, rel=name, size=len(data), label=0, key=b"dc:0:x:0", variant=v)
        assert got.record is None and got.reason.startswith("cannot decode") and got.remember
        return
    got = decode_image(data, v, name=name)
    assert got.dtype == np.uint8 and got.flags.c_contiguous and got.shape == want.shape, (name, got.shape)
    assert np.array_equal(got, want), (name, int(np.abs(got.astype(int) - want).max()))


def test_tiff_orientation_is_upright_not_squashed() -> None:
    """The reported defect: libtiff orients a TIFF during load() and drops the tag; the old code took
    the tag from before load() and made a 590x88 image 14 wide x 94 high. Every orientation now gives
    the same upright geometry as orientation 1 (93 wide x 14 high: int(14 * 590 / 88), torchvision's
    Resize rule)."""
    v = Variant(short_side=14, max_long_side=200)
    shapes = {decode_image(_read(f"g4_orientation_{i}.tif"), v).shape for i in range(1, 9)}
    assert shapes == {(14, 93, 3)}
    upright = decode_image(_read("g4_orientation_1.tif"), Variant(short_side=88, max_long_side=590))
    for i in range(2, 9):  # the same picture, not just the same size
        got = decode_image(_read(f"g4_orientation_{i}.tif"), Variant(short_side=88, max_long_side=590))
        assert np.abs(got.astype(int) - upright).mean() < 8, i


def test_jpeg_orientations_give_the_same_picture() -> None:
    v = Variant(short_side=64)
    upright = decode_image(_read("hopper.jpg"), v).astype(int)
    for i in range(2, 9):
        got = decode_image(_read(f"hopper_orientation_{i}.jpg"), v)
        assert got.shape == upright.shape and np.abs(got.astype(int) - upright).mean() < 12, i


def test_simplejpeg_at_pillows_draft_scale_is_byte_identical_on_the_corpus() -> None:
    """The fast path's premise, checked directly on every plain corpus JPEG at scales 1, 1/2, 1/4, 1/8:
    simplejpeg asked for the size Pillow's draft gives decodes exactly Pillow's pixels."""
    from datacache.decode import _sj_at_pil_scale

    checked = 0
    for name in FILES:
        data = _read(name)
        try:
            with Image.open(io.BytesIO(data)) as im:
                plain = im.format == "JPEG" and im.mode in ("RGB", "L") and min(im.size) >= 16
                w, h = im.size
        except Exception:
            continue
        if not plain:
            continue
        for div in (1, 2, 4, 8):
            req = (max(1, w // div), max(1, h // div))
            try:
                with Image.open(io.BytesIO(data)) as im:
                    im.draft("RGB", req)
                    want = np.asarray(im.convert("RGB"))
            except Exception:
                break  # Pillow cannot decode it (truncated): decode_image never takes the fast path
            try:
                got = _sj_at_pil_scale(data, req)
            except ValueError:
                break  # simplejpeg refuses a file Pillow accepts: decode_image falls back to Pillow
            assert got is not None and np.array_equal(got, want), (name, req)
            checked += 1
    assert checked >= 40
