"""Decode image bytes into the cached variant: C-contiguous RGB uint8 ``[H, W, 3]``.

One definition of a variant's pixels
    The bytes under a key are a function of (file bytes, variant) only: not of the process that fills
    it (the daemon never imports torch, a client usually has it loaded), nor of which optional decoder
    is installed. The reference is stock Pillow, step by step::

        im = Image.open(f)                       # first frame of multi-frame files
        if im.format in ("JPEG", "MPO"):         # DCT scaling (see "JPEG DCT scaling")
            im.draft("RGB", 1.15 x target in the file's stored orientation)
        im.load()
        im = ImageOps.exif_transpose(im)         # orientation read from the *loaded* image
        im = to_rgb(im)                          # "Colour modes"
        im = im.resize(target, resample, reducing_gap=3.0)   # only if the size differs

    Orientation is applied once, after ``load()``, for every format: a loader that orients the pixels
    itself (Pillow's libtiff TIFF loader does, and drops the tag) leaves nothing for
    ``exif_transpose`` to do, and the target size is computed from the upright image. JPEG, MPO,
    PNG (EXIF and XMP) and WebP keep their tag through ``load()`` and are turned here (all covered by
    the corpus test). HEIF: pillow-heif is not installed here, so it is untested; it orients on load by
    default, and this rule is right for it only if it then drops the tag, as libtiff does. ICC
    profiles are not applied (pixel values are taken as stored).

    Fast paths are used only where they reproduce these bytes exactly:

    * ``simplejpeg`` (the ``fast`` extra) decodes a plain JPEG (RGB/YCbCr/gray, no EXIF rotation,
      sides >= 16) at **the scale Pillow's draft would choose** (never libjpeg-turbo's M/8 factors,
      which Pillow never uses); the resize is Pillow's. Both are libjpeg-turbo with the same IDCT and
      upsampling: byte-identical on the vendored Pillow corpus (``tests/test_decode_corpus.py``), and
      each process re-checks it once on synthetic JPEGs before using it (:func:`simplejpeg_agrees`);
      on any mismatch simplejpeg is not used. Its JPEG decode alone is faster, but decode + resize
      end to end is within noise of Pillow's draft path (bench/results/NOTES.md#decode);
      ``DATACACHE_DECODER=pil`` turns it off.
    * torch's antialiased bilinear kernel is **not** used: it differs from Pillow's in ~0.1-0.5 % of
      values (by 1), so a daemon and a client would write different bytes for the same key. Dropping
      it (and the M/8 scaling) costs a few percent of decode throughput (bench/results/NOTES.md#decode).
    * pillow-simd replaces ``PIL`` itself and its resize does not reproduce Pillow's (measured
      2026-11-23, pillow-simd 12.1.1.post0 built here in a separate venv vs Pillow 13.0.0, this policy
      on the corpus: full-size decodes identical, 73 of 123 resized outputs differ, 0.3 % of values by
      up to 2), so it is its own decoder family (``pil-simd``, :func:`pil_family`): filling a ``pil``
      variant with pillow-simd installed is refused (:func:`datacache.fill.fill_one`) with what to do.
    * DALI decodes with other code (its own libjpeg-turbo build or nvJPEG, and its own resize): its
      samples are the ``dali`` / ``dali-gpu`` families (``cache_daemon.decoders``), with their own keys.

Geometry
    The shorter side becomes ``variant.short_side`` (small images are upscaled), the longer
    side keeps the aspect ratio but is capped at ``variant.long_cap`` (default 2x the short
    side, so panoramas stay bounded; a capped image has its short side below
    ``short_side``). The sizes are torchvision's ``Resize(short_side, max_size=long_cap)``'s, to the
    pixel: the long side is truncated (``int(short_side * long / short)``), not rounded, so a
    ``Resize(short_side)`` in the user's transform is the identity on a cached image and the pipeline's
    output equals ``ImageFolder``'s (``tests/test_dropin.py``). From the upright image (orientation
    6 = rotated 90°: H and W swap). Resampling uses ``variant.resample`` (default bilinear; Pillow's
    resize is antialiased when shrinking; ``reducing_gap=3`` first reduces by an integer factor when
    the image is 3x or more the target, as documented by Pillow).

JPEG DCT scaling
    ``Image.draft()`` asks libjpeg for DCT-domain downscaling by 1/2, 1/4 or 1/8; Pillow picks
    the largest factor whose result is still **>= the requested size**. We request
    :data:`DRAFT_MARGIN` (1.15) times the final target size (:func:`draft_request`, in the stored
    orientation), so the last resize always shrinks by a factor between 1.15 and 2.3: no detail is
    lost, and the result stays close to Pillow's antialiased resize of the full image (a DCT-halved
    image resized by barely 1.0x keeps more high frequencies than that resize: a photo just above 2x the
    target measured 31-35 dB PSNR against it, >= 40 dB from 1.15x on). :func:`backend_name` reports
    the backend.

Colour modes
    CMYK (including Adobe-inverted JPEGs, handled by Pillow), YCbCr, L and 1-bit convert
    to RGB; images with transparency (RGBA, LA, P/PA with a transparency entry) are
    composited over **white** (what viewers show; dropping alpha would expose arbitrary
    colours under transparent pixels); 16-bit (``I;16*``, and ``I`` which is how Pillow
    opens 16-bit PNG/PGM) is scaled to 8 bits with rounding (``v * 255 / 65535``), not
    clipped; float ``F`` images are taken as 0..1 when their maximum is <= 1, else 0..255.

Decompression-bomb policy (bounded memory)
    We never change Pillow's global ``Image.MAX_IMAGE_PIXELS`` (importing this module only
    silences Pillow's ``DecompressionBombWarning``, which the checks below replace; Pillow's
    hard ``DecompressionBombError`` above 2x the limit still applies); instead each decode checks
    the header size itself: a JPEG (draftable: with 1/8 DCT scaling a 10000x8000 image
    needs ~4 MB, not 240 MB) may have up to :data:`JPEG_MAX_PIXELS` (1.5e8) pixels; any
    other format, which must be decoded at full size, at most :data:`FULL_DECODE_MAX_PIXELS`
    (Pillow's default 89.5M, ~270 MB as RGB). Larger images raise :class:`DecodeError` that
    says to downscale the file offline (or convert it to JPEG). Truncated files are
    errors (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False): a half image is a wrong sample.
    Limit: a JPEG whose entropy-coded data is damaged but that still ends with a proper EOI
    marker is repaired by libjpeg (grey fill, a warning Pillow does not expose), as in every
    Pillow-based loader; only structural damage is detected here.

Decode memory budget
    The pixel limits bound pixels, not bytes: a 9400x9400 16-bit PNG of 190 KB is under them. Each
    decode therefore also computes, from the header and before anything is allocated, the peak bytes
    it will hold (:func:`decode_peak_bytes`): the image as Pillow stores it (1 byte per pixel for
    ``1``/``L``/``P``, 2 for ``I;16*``, 4 for every other mode, 8 for a mode unknown here), at the
    size it is loaded at (after JPEG DCT scaling), plus the format's decoder buffers
    (:func:`_loader_bytes`: a multi-scan/progressive JPEG's whole-image DCT coefficients, a TIFF
    strip or tile decoded raw and as RGBA, WebP's canvas, a few full frames for JPEG 2000 and the
    less common formats), and the largest of the later stages: EXIF transpose (two images), the
    colour conversion (source + RGB image + one band's temporaries: the conversion runs in bands of
    256 Kpx, byte-identical to the whole-image conversion since every step is per pixel; 16-bit
    goes through a 65536-entry table, not int64), the resize (RGB image + ``reduce()`` result +
    Pillow's intermediate pass + output; the source is closed first) and the way into numpy; plus
    :data:`DECODE_OVERHEAD` (16 MiB). The check runs again after ``load()`` with the mode and
    orientation the loader reports. Over the budget -> :class:`DecodeBudgetError` (a
    :class:`DecodeError`, not transient: the file is quarantined like any undecodable file) whose
    reason names the needed and the allowed MiB. The budget is :data:`DEFAULT_DECODE_BUDGET` (512 MiB:
    every ImageNet JPEG decodes at a few MB with DCT scaling, and any 8-bit RGB or grey image within
    the pixel limit fits; 16-bit grey fits up to ~80 Mpx, RGBA/CMYK/float up to ~33 Mpx), or
    ``$DATACACHE_DECODE_BUDGET_MB`` (:func:`parse_decode_budget`: a whole number of MiB in 16..1048576,
    or ``default``), or ``decode_image(..., budget=bytes)``. Peak RSS of one decode <= the process's
    baseline + the input file + the budget (measured growth stays under the computed need:
    ``tests/test_decode_budget.py``). The budget is not part of the variant's key: processes with
    different budgets can disagree on which files are quarantined.
"""

from __future__ import annotations

import importlib.metadata
import io
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from datacache.config import ConfigError, Variant

try:  # optional fast JPEG decoder (libjpeg-turbo with DCT scaling)
    import simplejpeg as _sj  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _sj = None

JPEG_MAX_PIXELS = 150_000_000
FULL_DECODE_MAX_PIXELS = 89_478_485  # Pillow's default MAX_IMAGE_PIXELS, restated deliberately

MiB = 2**20
DEFAULT_DECODE_BUDGET = 512 * MiB  # bytes one decode may allocate (module docstring, "Decode memory budget")
DECODE_BUDGET_ENV = "DATACACHE_DECODE_BUDGET_MB"
DECODE_BUDGET_RANGE_MB = (16, 1_048_576)  # valid budgets, MiB (16 MiB .. 1 TiB)
DECODE_OVERHEAD = 16 * MiB  # per decode, on top of the arrays: libraries' row buffers, zlib, bands, Python
_BAND_PIXELS = 1 << 18  # pixels per band of the banded colour conversion (temporaries ~ 40 B/pixel)

_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST, "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR, "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS,
}
_ROTATING_ORIENTATIONS = (5, 6, 7, 8)

# Our own pixel limits (below) replace Pillow's decompression-bomb *warning* (a process-wide
# filter: warnings.catch_warnings() per call would not be thread-safe); its hard error stays.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class DecodeError(Exception):
    """``name`` could not be decoded; ``reason`` says why and what to do.

    ``transient`` is True when the failure says nothing about the file (out of memory): the
    caller may skip the sample for now but must not remember the file as bad.
    """

    def __init__(self, name: str, reason: str, transient: bool = False) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason
        self.transient = transient

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across DataLoader worker processes
        return (DecodeError, (self.name, self.reason, self.transient))


class DecodeBudgetError(DecodeError):
    """The decode of ``name`` would need about ``needed`` bytes, over the ``budget`` (module docstring,
    "Decode memory budget"): a property of the file (and the budget), so it is quarantined like any
    undecodable file."""

    def __init__(self, name: str, reason: str, needed: int = 0, budget: int = 0) -> None:
        super().__init__(name, reason)
        self.needed = needed
        self.budget = budget

    def __reduce__(self) -> tuple[Any, ...]:
        return (DecodeBudgetError, (self.name, self.reason, self.needed, self.budget))


def parse_decode_budget(value: object) -> int:
    """Bytes of a decode budget given in MiB: an int (or its decimal string) in
    :data:`DECODE_BUDGET_RANGE_MB`, or ``"default"`` (:data:`DEFAULT_DECODE_BUDGET`). Raises
    :class:`~datacache.config.ConfigError` naming the valid values."""
    lo, hi = DECODE_BUDGET_RANGE_MB
    if isinstance(value, str) and value.strip().lower() == "default":
        return DEFAULT_DECODE_BUDGET
    mb: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mb = value
    elif isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 10:
        mb = int(value.strip())
    if mb is None or not lo <= mb <= hi:
        shown = repr(value)[:40]
        raise ConfigError(f"decode memory budget ({DECODE_BUDGET_ENV}) must be a whole number of MiB in "
                          f"{lo}..{hi} or 'default' (= {DEFAULT_DECODE_BUDGET // MiB}), got {shown}")
    return mb * MiB


_BUDGET_SEEN: list[tuple[str, int]] = []  # (raw environment value, bytes): parsed once per value


def decode_budget() -> int:
    """This process's decode budget in bytes: ``$DATACACHE_DECODE_BUDGET_MB`` (validated by
    :func:`parse_decode_budget`; inherited by decode workers) or :data:`DEFAULT_DECODE_BUDGET`."""
    raw = os.environ.get(DECODE_BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_DECODE_BUDGET
    seen = _BUDGET_SEEN[:1]
    if seen and seen[0][0] == raw:
        return seen[0][1]
    value = parse_decode_budget(raw)
    _BUDGET_SEEN[:] = [(raw, value)]
    return value


# Bytes per pixel of Pillow's in-memory image by mode (Storage.c: 1/L/P one byte, I;16* two, every other
# mode four; checked against Pillow's block allocator in tests/test_decode_budget.py); 8 for a mode
# Pillow may add later.
_STORAGE_BPP = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2,
                **dict.fromkeys(("RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "LAB", "HSV", "I", "F",
                                 "LA", "La", "PA"), 4)}
# formats whose Pillow decoder streams rows into the image (buffers of a few rows)
_STREAMING_FORMATS = frozenset({"PNG", "GIF", "BMP", "DIB", "PPM", "PCX", "TGA", "SGI", "SUN", "XBM",
                                "IM", "MSP"})
_BAND_TEMP_BPP = 48  # temporaries of one band of the colour conversion, bytes per pixel of the band
_ARRAY_OUT_BPP = 13  # the resized image (4) and its way into numpy (tobytes' chunks and join, the copy)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def storage_bytes_per_pixel(mode: str) -> int:
    """Bytes per pixel of a Pillow image of ``mode`` in memory (8 for a mode not known here)."""
    return _STORAGE_BPP.get(mode, 8)


def _resize_bytes(size: tuple[int, int], target: tuple[int, int]) -> int:
    """What ``resize(target, reducing_gap=3.0)`` of an RGB image of ``size`` allocates: the
    ``reduce()`` result, the horizontal pass's temporary and the output."""
    (w, h), (tw, th) = size, target
    if (w, h) == (tw, th):
        return 0
    fx, fy = max(1, int(w / tw / 3.0)), max(1, int(h / th / 3.0))
    rw, rh = _cdiv(w, fx), _cdiv(h, fy)
    reduced = rw * rh * 4 if (fx, fy) != (1, 1) else 0
    temp = tw * rh * 4 if rw != tw and rh != th else 0
    return reduced + temp + tw * th * 4


def decode_peak_bytes(mode: str, size: tuple[int, int], target: tuple[int, int], *, loader_bytes: int = 0,
                      transpose: bool = False) -> int:
    """Upper bound of the bytes :func:`decode_image` holds at once for an image of ``mode`` and ``size``
    (as loaded: after JPEG draft) turned into ``target`` (module docstring, "Decode memory budget"):
    the largest of the stages load (image + ``loader_bytes``, the format's decoder buffers),
    EXIF transpose (two images), colour conversion (image + RGB image + one band's temporaries),
    resize (RGB image + reduce + temporary + output) and the way into numpy, plus
    :data:`DECODE_OVERHEAD`."""
    w, h = size
    px = w * h
    img = px * storage_bytes_per_pixel(mode)
    stages = [img + loader_bytes, 2 * img if transpose else 0]
    if mode != "RGB":
        band = min(px, max(w, (_BAND_PIXELS // max(1, w)) * w))
        stages.append(img + 4 * px + band * _BAND_TEMP_BPP)
    stages.append(4 * px + _resize_bytes(size, target))
    stages.append(target[0] * target[1] * _ARRAY_OUT_BPP)
    return DECODE_OVERHEAD + max(stages)


def _jpeg_single_scan(data: bytes, components: int) -> bool:
    """Whether the first scan of a JPEG holds all its components (libjpeg then decodes it row by row);
    otherwise (progressive, or non-interleaved scans) it keeps every DCT coefficient of the whole image.
    Walks the markers up to the first SOS; anything unexpected counts as multi-scan."""
    i, n = 2, len(data)
    while i + 4 < n:
        if data[i] != 0xFF:
            return False
        m = data[i + 1]
        if m == 0xFF:
            i += 1
        elif m == 0x01 or 0xD0 <= m <= 0xD8:
            i += 2
        elif m == 0xDA:
            return data[i + 4] >= components
        else:
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return False


def _loader_bytes(im: Image.Image, data: bytes, full: tuple[int, int]) -> int:
    """Buffers the format's decoder allocates during ``load()`` besides the image (``full``: the size
    before JPEG draft). Conservative where the decoder is not known to stream."""
    fmt = im.format or ""
    w, h = im.size
    px = w * h
    if fmt in ("JPEG", "MPO"):
        extra = 3 * px  # the simplejpeg path's numpy output at the draft scale
        layers = [x for x in getattr(im, "layer", []) if isinstance(x, tuple) and len(x) >= 3]
        if im.info.get("progressive") or not _jpeg_single_scan(data, max(1, len(layers))):
            # multi-scan: the whole image's coefficients (64 x int16 per 8x8 block per component)
            if layers:
                hmax = max(max(1, int(x[1])) for x in layers)
                vmax = max(max(1, int(x[2])) for x in layers)
                for x in layers:
                    bw = _cdiv(_cdiv(full[0] * max(1, int(x[1])), hmax), 8)
                    bh = _cdiv(_cdiv(full[1] * max(1, int(x[2])), vmax), 8)
                    extra += (bw + 1) * (bh + 2) * 128
            else:
                extra += full[0] * full[1] * 8
        return extra
    if fmt in _STREAMING_FORMATS:
        return 0
    if fmt == "TIFF":
        if not getattr(im, "use_load_libtiff", True):
            return 0  # uncompressed: Pillow's raw decoder reads 64 KiB blocks
        tags: Any = getattr(im, "tag_v2", {})
        try:
            bits = tags.get(258, (8,))
            bits = tuple(bits) if isinstance(bits, (tuple, list)) else (int(bits),)
            samples = int(tags.get(277, len(bits)))
            total = sum(int(b) for b in bits) if len(bits) == samples else int(bits[0]) * samples
            if 322 in tags and 323 in tags:
                uw, uh = int(tags[322]), int(tags[323])
            else:
                uw, uh = w, min(h, int(tags.get(278, h)))
            # a strip/tile decoded raw, its RGBA form (libtiff's RGBA path) and the file read once more
            return _cdiv(uw * max(1, total), 8) * uh + 4 * uw * uh + len(data)
        except (TypeError, ValueError, IndexError):
            return 16 * px + len(data)
    if fmt == "WEBP":
        return 8 * px + len(data)  # libwebp's canvas and its copy as bytes
    return 16 * px + len(data)  # JPEG 2000 (int32 per sample), AVIF, QOI, PSD...: a few full frames


def _over_budget(name: str, im: Image.Image, needed: int, budget: int) -> DecodeBudgetError:
    w, h = im.size
    return DecodeBudgetError(
        name, f"image over the decode memory budget ({im.format} {w}x{h} needs about {_cdiv(needed, MiB)} "
        f"MiB, the budget is {budget / MiB:.0f} MiB, {DECODE_BUDGET_ENV}); mode {im.mode}: downscale the "
        "file offline (or convert it to JPEG, which decodes with DCT scaling)", needed, budget)


def _pillow_flavour() -> str:
    try:
        return f"pillow-simd-{importlib.metadata.version('pillow-simd')}"
    except importlib.metadata.PackageNotFoundError:
        import PIL

        return f"pillow-{PIL.__version__}"


_PILLOW = _pillow_flavour()


def pil_family() -> str:
    """Decoder family of :func:`decode_image` in this process: ``pil`` (stock Pillow) or ``pil-simd``."""
    return "pil-simd" if _PILLOW.startswith("pillow-simd") else "pil"


# memoised simplejpeg_agrees(). No lock on purpose: threads that race compute the same answer, and a lock
# held by another thread at a fork would stay locked forever in the child (decode pools fork).
_SJ_CHECK: list[bool] = []


def _synthetic_jpegs() -> list[bytes]:
    """Small JPEGs with the features that matter for identity: chroma subsampling 4:2:0 / 4:4:4,
    progressive, grayscale, odd sizes (edge blocks)."""
    rng = np.random.default_rng(1234)
    base = rng.integers(0, 256, (9, 11, 3), dtype=np.uint8)
    im = Image.fromarray(base).resize((173, 131), Image.Resampling.BICUBIC)
    noisy = np.clip(np.asarray(im).astype(np.int16) + rng.integers(-24, 25, (131, 173, 3)), 0, 255)
    im = Image.fromarray(noisy.astype(np.uint8))
    out = []
    for kw in ({"subsampling": 2}, {"subsampling": 0}, {"progressive": True}, {"subsampling": 1}):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=88, **kw)
        out.append(buf.getvalue())
    buf = io.BytesIO()
    im.convert("L").save(buf, "JPEG", quality=85)
    out.append(buf.getvalue())
    return out


def simplejpeg_agrees() -> bool:
    """Whether simplejpeg, asked for Pillow's draft scale, reproduces Pillow's decode byte for byte on
    synthetic JPEGs at scales 1, 1/2, 1/4 and 1/8 (computed once per process; False without simplejpeg)."""
    if _sj is None:
        return False
    if not _SJ_CHECK:
        ok = True
        try:
            for data in _synthetic_jpegs():
                for req in ((173, 131), (80, 60), (40, 30), (20, 15)):
                    ref = _pil_draft_rgb(data, req)
                    got = _sj_at_pil_scale(data, req)
                    ok = ok and got is not None and np.array_equal(ref, got)
        except Exception:  # any failure of the fast path means: do not use it
            ok = False
        _SJ_CHECK[:] = [ok]
    return _SJ_CHECK[0]


def _pil_draft_rgb(data: bytes, req: tuple[int, int]) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        im.draft("RGB", req)
        return np.asarray(im.convert("RGB"))


def _sj_at_pil_scale(data: bytes, req: tuple[int, int], im: Image.Image | None = None,
                     check: Callable[[Image.Image], None] | None = None) -> np.ndarray | None:
    """simplejpeg decode at the scale Pillow's ``draft("RGB", req)`` picks; None if it cannot match.
    ``im``: the file already opened by Pillow (header only), else it is opened here; ``check`` is called
    with it once drafted (the decode budget), before anything is decoded."""
    if im is None:
        with Image.open(io.BytesIO(data)) as opened:
            return _sj_at_pil_scale(data, req, opened, check)
    if im.format != "JPEG" or im.mode not in ("RGB", "L") or min(im.size) < 16:
        return None
    im.draft("RGB", req)  # header only: sets the scaled size, decodes nothing
    if check is not None:
        check(im)
    dw, dh = im.size
    arr = _sj.decode_jpeg(data, colorspace="RGB", min_width=dw, min_height=dh)
    # libjpeg-turbo picks the smallest M/8 factor >= (dw, dh); with sides >= 16 the next smaller
    # factor is always too small, so this is Pillow's factor: the shape check is a second guard
    return arr if arr.shape == (dh, dw, 3) else None


def _use_simplejpeg() -> bool:
    return (_sj is not None and os.environ.get("DATACACHE_DECODER", "").lower() != "pil"
            and simplejpeg_agrees())


def backend_name() -> str:
    """Which decoder runs, e.g. ``"pillow-13.0.0 (draft)"`` or ``"simplejpeg-1.9.0+pillow-13.0.0 ..."``."""
    if _use_simplejpeg():
        return f"simplejpeg-{getattr(_sj, '__version__', '?')}+{_PILLOW} (draft scale, pillow resize)"
    return f"{_PILLOW} (draft)"


def target_size(w: int, h: int, variant: Variant) -> tuple[int, int]:
    """Output (width, height) for an upright ``w x h`` image: torchvision's ``Resize(short_side,
    max_size=long_cap)`` size rule, truncations included (see "Geometry" in the module docstring)."""
    short, long_ = (w, h) if w <= h else (h, w)
    new_short, new_long = variant.short_side, int(variant.short_side * long_ / short)
    if new_long > variant.long_cap:
        new_short, new_long = int(variant.long_cap * new_short / new_long), variant.long_cap
    new_short, new_long = max(1, new_short), max(1, new_long)
    return (new_short, new_long) if w <= h else (new_long, new_short)


DRAFT_MARGIN = 1.15  # DCT scaling only where a resize of at least this factor still follows it


def draft_request(size: tuple[int, int]) -> tuple[int, int]:
    """What :meth:`PIL.Image.Image.draft` is asked for a ``size`` target: :data:`DRAFT_MARGIN` times it, so
    the DCT-scaled image is always resized by >= 1.15x afterwards (module docstring, "JPEG DCT scaling")."""
    return math.ceil(size[0] * DRAFT_MARGIN), math.ceil(size[1] * DRAFT_MARGIN)


def plain_jpeg_target(data: bytes, variant: Variant) -> tuple[int, int] | None:
    """Target (width, height) of a *plain* JPEG -- 8-bit RGB/YCbCr/gray, no EXIF rotation, within the
    pixel limit -- that another decoder (DALI) may decode to the same variant; None for anything else
    (CMYK, rotated, PNG, corrupt headers...), which :func:`decode_image` handles. Parses the header only."""
    if data[:2] != b"\xff\xd8":
        return None
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG" or im.mode not in ("RGB", "L") or im.width * im.height > JPEG_MAX_PIXELS:
                return None
            if im.getexif().get(0x0112, 1) != 1:
                return None
            return target_size(im.width, im.height, variant)
    except Exception:  # unreadable header: let decode_image produce the error message
        return None


_LUT16 = ((np.arange(65536, dtype=np.int64) * 255 + 32767) // 65535).astype(np.uint8)  # v*255/65535


def _bands(w: int, h: int) -> list[tuple[int, int, int, int]]:
    rows = max(1, _BAND_PIXELS // max(1, w))
    return [(0, y, w, min(h, y + rows)) for y in range(0, h, rows)]


def _band_to_rgb(band: Image.Image, alpha: bool, peak: float) -> Image.Image:
    """One band of :func:`_to_rgb`: every step is per pixel, so bands give the whole image's bytes."""
    mode = band.mode
    if mode in ("L", "CMYK", "YCbCr", "LAB", "HSV"):
        return band.convert("RGB")
    if mode == "1":
        return band.convert("L").convert("RGB")
    if alpha:
        rgba = band.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        a = np.asarray(band)
        if a.ndim == 3:
            a = a[..., 0]
        if mode == "F":
            a = a.astype(np.float32, copy=False)
            g = np.clip(np.nan_to_num(a) * (255.0 / peak) + 0.5, 0, 255).astype(np.uint8)
        else:  # I;16, I;16B, I;16L, I (16-bit PNG/PGM): v * 255 / 65535 with rounding, a table lookup
            g = _LUT16[a if a.dtype.itemsize <= 2 and a.dtype.kind == "u" else np.clip(a, 0, 65535)]
        return Image.fromarray(np.ascontiguousarray(g), "L").convert("RGB")
    return band.convert("RGB")


def _float_peak(im: Image.Image) -> float:
    """``F`` images: 1.0 when the largest non-NaN value is <= 1, else 255.0 (all NaN: 255.0)."""
    top = -math.inf
    seen = False
    for box in _bands(*im.size):
        a = np.asarray(im.crop(box)).astype(np.float32, copy=False)
        m = float(np.fmax.reduce(a, axis=None))
        if not math.isnan(m):
            top, seen = max(top, m), True
    return 1.0 if seen and top <= 1.0 else 255.0


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB (see "Colour modes"), band by band: the memory beyond the
    source and the RGB result is one band's temporaries (module docstring, "Decode memory budget")."""
    mode = im.mode
    if mode == "RGB":
        return im
    alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in im.info)
    peak = _float_peak(im) if mode == "F" else 255.0
    boxes = _bands(*im.size)
    if len(boxes) == 1:
        return _band_to_rgb(im, alpha, peak)
    out = Image.new("RGB", im.size)
    for box in boxes:
        out.paste(_band_to_rgb(im.crop(box), alpha, peak), box[:2])
    return out


def _finish(im: Image.Image, size: tuple[int, int], variant: Variant) -> np.ndarray:
    """The variant's one resize: Pillow's, whatever else is loaded in this process (module docstring).
    ``im`` is this decode's own image: closed (its memory freed) once resized."""
    if im.size != size:
        src, im = im, im.resize(size, _RESAMPLE[variant.resample], reducing_gap=3.0)
        src.close()
    arr = np.asarray(im)
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C")  # writable so torch.from_numpy works without a warning
    return arr


def _decode_simplejpeg(data: bytes, variant: Variant, name: str, budget: int) -> np.ndarray | None:
    """simplejpeg at Pillow's draft scale for plain JPEGs without EXIF rotation; None -> use Pillow."""
    with Image.open(io.BytesIO(data)) as probe:  # header parse only, no pixel decode
        if probe.format != "JPEG" or probe.mode not in ("RGB", "L") or min(probe.size) < 16:
            return None
        w, h = probe.size
        if w * h > JPEG_MAX_PIXELS or probe.getexif().get(0x0112, 1) != 1:
            return None  # too big (Pillow's message) or rotated (Pillow applies the orientation)
        size = target_size(w, h, variant)

        def check(drafted: Image.Image) -> None:  # the RGB image made from simplejpeg's array
            extra = _loader_bytes(drafted, data, (w, h))
            need = decode_peak_bytes("RGB", drafted.size, size, loader_bytes=extra)
            if need > budget:
                raise _over_budget(name, drafted, need, budget)

        arr = _sj_at_pil_scale(data, draft_request(size), probe, check)
    if arr is None:
        return None
    return _finish(Image.fromarray(arr, "RGB"), size, variant)


def _may_turn(im: Image.Image) -> bool:
    """Whether a non-JPEG file may carry an orientation (EXIF or XMP metadata, a TIFF tag), read without
    loading it."""
    tags: Any = getattr(im, "tag_v2", None)
    if tags is not None and tags.get(0x0112, 1) != 1:
        return True
    return any(k in im.info for k in ("exif", "xmp", "XML:com.adobe.xmp", "Raw profile type exif"))


def _check_budget(name: str, im: Image.Image, loader: int, size: tuple[int, int], turned: bool,
                  budget: int) -> None:
    need = decode_peak_bytes(im.mode, im.size, size, loader_bytes=loader, transpose=turned)
    if need > budget:
        raise _over_budget(name, im, need, budget)


def decode_image(data: bytes, variant: Variant, *, name: str = "<bytes>",
                 budget: int | None = None) -> np.ndarray:
    """Decode ``data`` to the variant (module docstring); raises :class:`DecodeError`
    (:class:`DecodeBudgetError` when the decode would need more than ``budget`` bytes, default
    :func:`decode_budget`)."""
    if not data:
        raise DecodeError(name, "zero-byte file: nothing to decode (re-copy the file from its origin)")
    limit_bytes = decode_budget() if budget is None else int(budget)
    if data[:2] == b"\xff\xd8" and _use_simplejpeg():
        try:
            out = _decode_simplejpeg(bytes(data), variant, name, limit_bytes)
        except DecodeError:
            raise
        except MemoryError:
            raise DecodeError(name, "out of memory while decoding (transient: retried in a later epoch)",
                              transient=True) from None
        except Exception:  # anything simplejpeg or the header parse refuses: Pillow decides
            out = None  # (Pillow then decodes it, or produces the error message)
        if out is not None:
            return out
    try:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        if w < 1 or h < 1:
            raise DecodeError(name, f"image has an empty size {w}x{h}")
        draftable = im.format in ("JPEG", "MPO")
        limit = JPEG_MAX_PIXELS if draftable else FULL_DECODE_MAX_PIXELS
        if w * h > limit:
            raise DecodeError(name, f"{im.format} image of {w}x{h} = {w * h / 1e6:.0f} Mpx exceeds the "
                              f"{limit / 1e6:.0f} Mpx limit for {'JPEG' if draftable else 'non-JPEG'} "
                              "input; downscale the file offline (or convert it to JPEG, which decodes "
                              "with DCT scaling)")
        if draftable:
            # Pillow's JPEG loader never applies the orientation, so the header's value is the one
            # exif_transpose reads after load(): ask for the target in the stored orientation
            turned = im.getexif().get(0x0112, 1) != 1
            rot = im.getexif().get(0x0112, 1) in _ROTATING_ORIENTATIONS
            tw, th = target_size(*((h, w) if rot else (w, h)), variant)
            im.draft("RGB", draft_request((th, tw) if rot else (tw, th)))  # DCT scaling: result >= request
        else:  # (getexif() would load a PNG: any EXIF/XMP may hold an orientation, counted as a transpose)
            turned = _may_turn(im)
            tw, th = target_size(w, h, variant)
        # the decode budget, from the header (size and mode as loaded) before anything is allocated
        _check_budget(name, im, _loader_bytes(im, data, (w, h)), (max(tw, th),) * 2, turned, limit_bytes)
        im.load()
        # orientation from the loaded image's state: a loader that oriented the pixels itself (libtiff)
        # dropped the tag, so nothing is applied twice; XMP orientation (PNG, WebP) is honoured too
        turn = im.getexif().get(0x0112, 1)
        rot = turn in _ROTATING_ORIENTATIONS
        # again with what load() made (a loader may change the mode, or reveal an orientation)
        _check_budget(name, im, 0, (max(tw, th),) * 2, turn != 1, limit_bytes)
        ImageOps.exif_transpose(im, in_place=True)
        if draftable:  # target from the full-size upright geometry, not the DCT-scaled one
            size = target_size(*((h, w) if rot else (w, h)), variant)
        else:
            size = target_size(im.width, im.height, variant)
        rgb = _to_rgb(im)
        if rgb is not im:
            im.close()  # the source's memory goes before the resize allocates
        del im
        return _finish(rgb, size, variant)
    except DecodeError:
        raise
    except UnidentifiedImageError:
        raise DecodeError(name, f"not a decodable image ({len(data)} bytes); "
                          "remove the file or replace it with a valid image") from None
    except Image.DecompressionBombError:  # (reasons never quote an exception's text: it can hold file bytes)
        raise DecodeError(name, "image exceeds the decompression-bomb pixel limit of Pillow "
                          "(DecompressionBombError); downscale the file offline") from None
    except MemoryError:  # the process, not the file: never remembered as a bad file
        raise DecodeError(name, "out of memory while decoding (transient: retried in a later epoch)",
                          transient=True) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError,
            ZeroDivisionError) as e:
        # the type only: Pillow's messages quote bytes of the file ("Token too long in file header: ...")
        raise DecodeError(name, f"corrupt or truncated image data ({type(e).__name__}); re-copy the "
                          "file from its origin or remove it") from None
