from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

from datacache.config import RESAMPLE_CHOICES, Variant
from datacache.decode import DecodeError, backend_name, decode_image, target_size

V = Variant()


def read(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def centre(a: np.ndarray) -> np.ndarray:
    h, w, _ = a.shape
    return a[h // 4: 3 * h // 4, w // 4: 3 * w // 4].reshape(-1, 3).mean(0)


def close(rgb: np.ndarray, want: tuple[int, int, int], tol: float = 6) -> bool:
    return bool(np.all(np.abs(rgb - np.array(want)) <= tol))


def test_geometry_and_layout(small_imagefolder: str) -> None:
    a = decode_image(read(small_imagefolder, "c000/00000.JPEG"), V, name="x")
    assert a.shape == (160, 213, 3) and a.dtype == np.uint8
    assert a.flags.c_contiguous and a.flags.writeable
    assert target_size(1000, 100, V) == (320, 32)  # the long side is capped at 2 x short side
    assert target_size(100, 1000, Variant(short_side=96, max_long_side=500)) == (50, 500)
    assert target_size(1, 1, V) == (160, 160)
    assert "draft" in backend_name() and "pillow" in backend_name()


def test_draft_keeps_quality() -> None:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    big = Image.fromarray(small).resize((2000, 1500), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=95)
    got = decode_image(buf.getvalue(), V)
    ref = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB").resize(
        (213, 160), Image.Resampling.BILINEAR, reducing_gap=None))
    assert got.shape == ref.shape == (160, 213, 3)
    mse = ((got.astype(float) - ref.astype(float)) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 32  # PSNR vs a full decode: DCT scaling kept the detail


def test_resample_choices_all_work(small_imagefolder: str) -> None:
    data = read(small_imagefolder, "c001/00003.JPEG")
    outs = {r: decode_image(data, Variant(short_side=64, resample=r)) for r in RESAMPLE_CHOICES}
    assert {o.shape for o in outs.values()} == {(64, 85, 3)}
    assert not np.array_equal(outs["nearest"], outs["lanczos"])


@pytest.mark.parametrize("case, want", [
    ("cmyk", (255, 0, 0)), ("palette", (255, 0, 0)), ("rgba", (255, 0, 0)), ("gray", (128, 128, 128)),
    ("png_named_jpeg", (0, 255, 0)), ("one_by_one", (0, 0, 255)), ("huge", (120, 120, 120)),
])
def test_odd_images_decode_to_right_colours(bad_imagefolder: str, bad_cases: dict, case: str,
                                            want: tuple[int, int, int]) -> None:
    a = decode_image(read(bad_imagefolder, bad_cases[case]), V, name=case)
    assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3 and min(a.shape[:2]) == 160
    assert close(centre(a), want), (case, centre(a))


def test_sixteen_bit_is_scaled_not_clipped(bad_imagefolder: str, bad_cases: dict) -> None:
    a = decode_image(read(bad_imagefolder, bad_cases["sixteen_bit"]), V)
    assert a.shape == (160, 320, 3)
    assert close(a[:, :140].reshape(-1, 3).mean(0), (255, 255, 255), 1)
    assert close(a[:, 180:].reshape(-1, 3).mean(0), (64, 64, 64), 1)  # 16384 * 255 / 65535 = 63.75


def test_exif_orientation_6_rotates(bad_imagefolder: str, bad_cases: dict) -> None:
    a = decode_image(read(bad_imagefolder, bad_cases["exif_rotated"]), V)
    assert a.shape == (320, 160, 3)  # stored 200x100 -> upright 100x200 -> 160x320
    assert close(a[:140].reshape(-1, 3).mean(0), (255, 0, 0), 8)   # stored left (red) is on top
    assert close(a[180:].reshape(-1, 3).mean(0), (0, 0, 255), 8)


def test_transparency_la_and_one_bit() -> None:
    def png(img: Image.Image) -> bytes:
        b = io.BytesIO()
        img.save(b, "PNG")
        return b.getvalue()

    half = Image.new("LA", (40, 20), (0, 255))
    half.paste((0, 0), (20, 0, 40, 20))  # right half fully transparent -> white background
    a = decode_image(png(half), Variant(short_side=20, max_long_side=40))
    assert close(a[:, :18].reshape(-1, 3).mean(0), (0, 0, 0), 2)
    assert close(a[:, 22:].reshape(-1, 3).mean(0), (255, 255, 255), 2)
    bits = Image.new("1", (16, 16), 1)
    assert close(centre(decode_image(png(bits), Variant(short_side=16))), (255, 255, 255), 0)
    i32 = Image.fromarray(np.full((8, 8), 32768, dtype=np.int32), "I")  # 32-bit int, as 16-bit PNGs open
    tif = io.BytesIO()
    i32.save(tif, "TIFF")
    assert close(centre(decode_image(tif.getvalue(), Variant(short_side=8))), (128, 128, 128), 0)


@pytest.mark.parametrize("case, reason", [
    ("corrupt", "corrupt or truncated"), ("truncated", "corrupt or truncated"), ("zero_byte", "zero-byte"),
])
def test_broken_files_raise_decode_error(bad_imagefolder: str, bad_cases: dict, case: str,
                                         reason: str) -> None:
    with pytest.raises(DecodeError, match=reason) as ei:
        decode_image(read(bad_imagefolder, bad_cases[case]), V, name=bad_cases[case])
    assert ei.value.name == bad_cases[case] and reason in ei.value.reason
    clone = pickle.loads(pickle.dumps(ei.value))  # crosses DataLoader worker boundaries
    assert clone.name == ei.value.name and clone.reason == ei.value.reason


def test_non_image_raises(bad_imagefolder: str, bad_cases: dict) -> None:
    with pytest.raises(DecodeError, match="not a decodable image"):
        decode_image(read(bad_imagefolder, bad_cases["non_image"]), V, name="notes.txt")


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h but whose pixel data is a few bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def _jpeg_with_size(w: int, h: int) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (16, 16)).save(b, "JPEG")
    data = bytearray(b.getvalue())
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, h, w)
    return bytes(data)


# pytest resets warning filters per test, undoing the one datacache.decode installs at import
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixel_limits_refuse_with_advice() -> None:
    with pytest.raises(DecodeError, match="downscale the file offline"):
        decode_image(_png_header_only(12000, 9000), V, name="big.png")  # 108 Mpx, not draftable
    with pytest.raises(DecodeError, match="downscale the file offline"):
        decode_image(_jpeg_with_size(20000, 10000), V, name="big.jpg")  # 200 Mpx JPEG


# Peak RSS is read from /proc/self/status (VmHWM) rather than resource.getrusage: Linux carries
# ru_maxrss across fork+exec, so a child of a pytest process that once held 300 MB reports 300 MB.
_RSS_SCRIPT = """
import io, sys
from PIL import Image
from datacache.config import Variant
from datacache.decode import decode_image

def hwm_kb():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1])

small = io.BytesIO()
Image.new('RGB', (64, 48)).save(small, 'JPEG')
decode_image(small.getvalue(), Variant())  # warm up code paths and the allocator
data = open(sys.argv[1], 'rb').read()
before = hwm_kb()
a = decode_image(data, Variant())
after = hwm_kb()
print(a.shape, before, after)
"""


def test_huge_jpeg_decodes_with_bounded_memory(bad_imagefolder: str, bad_cases: dict) -> None:
    path = os.path.join(bad_imagefolder, bad_cases["huge"])
    with Image.open(path) as im:
        assert im.size == (10000, 8000)
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    shape = " ".join(out[:3])
    before_kb, after_kb = int(out[3]), int(out[4])
    assert shape == "(160, 200, 3)"
    # a full RGB decode needs 240 MB; with draft (1/8 DCT scaling) the peak grows by a few MB
    assert after_kb - before_kb < 40 * 1024, (before_kb, after_kb)
    assert after_kb < 200 * 1024, (before_kb, after_kb)


def test_backend_choice_is_reported_and_consistent(small_imagefolder: str, bad_imagefolder: str,
                                                   bad_cases: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """simplejpeg (in the test extra, so CI runs this path) and Pillow produce the same samples, byte for
    byte; forcing Pillow always works and the report names the backend that ran."""
    import simplejpeg

    from datacache import decode

    assert decode._sj is simplejpeg and backend_name().startswith("simplejpeg")
    datas = [read(small_imagefolder, f"c00{c}/0000{i}.JPEG") for c in range(3) for i in range(3)]
    datas += [read(bad_imagefolder, bad_cases[k]) for k in ("exif_rotated", "cmyk", "gray")]
    default = [decode_image(d, V) for d in datas]
    monkeypatch.setenv("DATACACHE_DECODER", "pil")
    assert backend_name().startswith("pillow")
    forced = [decode_image(d, V) for d in datas]
    for a, b in zip(default, forced):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_simplejpeg_pixels_equal_pillows(small_imagefolder: str) -> None:
    """Full-size decodes agree exactly (both are libjpeg-turbo, islow IDCT, fancy upsampling); the
    DCT-scaled path is checked at Pillow's draft scales in tests/test_decode_corpus.py."""
    import simplejpeg

    from datacache.devtools.synth import real_photo_files

    files = [os.path.join(small_imagefolder, f"c00{c}/0000{i}.JPEG") for c in range(3) for i in range(2)]
    files += [p for p in real_photo_files() if p.lower().endswith((".jpg", ".jpeg"))]
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        sj = simplejpeg.decode_jpeg(data, colorspace="RGB")
        pil = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert sj.shape == pil.shape and np.array_equal(sj, pil), path
