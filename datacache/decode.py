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
"""

from __future__ import annotations

import importlib.metadata
import io
import math
import os
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from datacache.config import Variant

try:  # optional fast JPEG decoder (libjpeg-turbo with DCT scaling)
    import simplejpeg as _sj  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    _sj = None

JPEG_MAX_PIXELS = 150_000_000
FULL_DECODE_MAX_PIXELS = 89_478_485  # Pillow's default MAX_IMAGE_PIXELS, restated deliberately

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


def _sj_at_pil_scale(data: bytes, req: tuple[int, int], im: Image.Image | None = None) -> np.ndarray | None:
    """simplejpeg decode at the scale Pillow's ``draft("RGB", req)`` picks; None if it cannot match.
    ``im``: the file already opened by Pillow (header only), else it is opened here."""
    if im is None:
        with Image.open(io.BytesIO(data)) as opened:
            return _sj_at_pil_scale(data, req, opened)
    if im.format != "JPEG" or im.mode not in ("RGB", "L") or min(im.size) < 16:
        return None
    im.draft("RGB", req)  # header only: sets the scaled size, decodes nothing
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


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB (see "Colour modes")."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("L", "CMYK", "YCbCr", "LAB", "HSV"):
        return im.convert("RGB")
    if mode == "1":
        return im.convert("L").convert("RGB")
    if mode == "P" and "transparency" not in im.info:
        return im.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "P", "RGBa", "La"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        a = np.asarray(im)
        if mode == "F":
            a = a.astype(np.float32)
            peak = 1.0 if a.size and float(np.nanmax(a)) <= 1.0 else 255.0
            g = np.clip(np.nan_to_num(a) * (255.0 / peak) + 0.5, 0, 255).astype(np.uint8)
        else:  # I;16, I;16B, I;16L, I (16-bit PNG/PGM): scale 0..65535 -> 0..255 with rounding
            a = np.clip(a.astype(np.int64), 0, 65535)
            g = ((a * 255 + 32767) // 65535).astype(np.uint8)
        if g.ndim == 3:
            g = g[..., 0]
        return Image.fromarray(np.ascontiguousarray(g), "L").convert("RGB")
    return im.convert("RGB")


def _finish(im: Image.Image, size: tuple[int, int], variant: Variant) -> np.ndarray:
    """The variant's one resize: Pillow's, whatever else is loaded in this process (module docstring)."""
    if im.size != size:
        im = im.resize(size, _RESAMPLE[variant.resample], reducing_gap=3.0)
    arr = np.asarray(im)
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C")  # writable so torch.from_numpy works without a warning
    return arr


def _decode_simplejpeg(data: bytes, variant: Variant) -> np.ndarray | None:
    """simplejpeg at Pillow's draft scale for plain JPEGs without EXIF rotation; None -> use Pillow."""
    with Image.open(io.BytesIO(data)) as probe:  # header parse only, no pixel decode
        if probe.format != "JPEG" or probe.mode not in ("RGB", "L") or min(probe.size) < 16:
            return None
        w, h = probe.size
        if w * h > JPEG_MAX_PIXELS or probe.getexif().get(0x0112, 1) != 1:
            return None  # too big (Pillow's message) or rotated (Pillow applies the orientation)
        size = target_size(w, h, variant)
        arr = _sj_at_pil_scale(data, draft_request(size), probe)
    if arr is None:
        return None
    return _finish(Image.fromarray(arr, "RGB"), size, variant)


def decode_image(data: bytes, variant: Variant, *, name: str = "<bytes>") -> np.ndarray:
    """Decode ``data`` to the variant (module docstring); raises :class:`DecodeError`."""
    if not data:
        raise DecodeError(name, "zero-byte file: nothing to decode (re-copy the file from its origin)")
    if data[:2] == b"\xff\xd8" and _use_simplejpeg():
        try:
            out = _decode_simplejpeg(bytes(data), variant)
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
            rot = im.getexif().get(0x0112, 1) in _ROTATING_ORIENTATIONS
            tw, th = target_size(*((h, w) if rot else (w, h)), variant)
            im.draft("RGB", draft_request((th, tw) if rot else (tw, th)))  # DCT scaling: result >= request
        im.load()
        # orientation from the loaded image's state: a loader that oriented the pixels itself (libtiff)
        # dropped the tag, so nothing is applied twice; XMP orientation (PNG, WebP) is honoured too
        rot = im.getexif().get(0x0112, 1) in _ROTATING_ORIENTATIONS
        ImageOps.exif_transpose(im, in_place=True)
        if draftable:  # target from the full-size upright geometry, not the DCT-scaled one
            size = target_size(*((h, w) if rot else (w, h)), variant)
        else:
            size = target_size(im.width, im.height, variant)
        return _finish(_to_rgb(im), size, variant)
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
