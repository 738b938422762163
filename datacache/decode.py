"""Decode image bytes into the cached variant: C-contiguous RGB uint8 ``[H, W, 3]``.

Geometry
    The shorter side becomes ``variant.short_side`` (small images are upscaled), the longer
    side keeps the aspect ratio but is capped at ``variant.long_cap`` (default 2x the short
    side, so panoramas stay bounded; a capped image has its short side below
    ``short_side``). Sizes are rounded to the nearest pixel. EXIF orientation is applied
    first (orientation 6 = rotated 90°: H and W swap), exactly like ``ImageOps.exif_transpose``.
    Resampling uses ``variant.resample`` (default bilinear; Pillow's resize is antialiased
    when shrinking, with ``reducing_gap=3`` which is visually identical and faster). In a process
    that has torch loaded already (DataLoader workers, the trainer) a bilinear *shrink* of an RGB
    image runs in torch's uint8 antialiased bilinear kernel instead (``F.interpolate(...,
    antialias=True)``, the same filter: within 1 grey level of Pillow's, PSNR > 60 dB, tested) --
    about twice as fast as stock Pillow's, which matters on the cold path. Processes without torch
    (``datacache warm``, the daemon) never import it for this.

JPEG fast path
    ``Image.draft()`` asks libjpeg for DCT-domain downscaling by 1/2, 1/4 or 1/8; Pillow picks
    the largest factor whose result is still **>= the requested size**, and we request the
    final target size, so the last resize always shrinks by a factor < 2 and no detail is
    lost. When ``simplejpeg`` is installed (the ``fast`` extra) and the JPEG is plain RGB/gray
    without EXIF rotation, it decodes with the same DCT scaling (``min_width/min_height``)
    and Pillow only resizes; otherwise Pillow does everything. pillow-simd is used
    automatically when it is the installed ``PIL``. :func:`backend_name` reports the
    backend; ``DATACACHE_DECODER=pil`` forces plain Pillow.

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
import os
import sys
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


def _use_simplejpeg() -> bool:
    return _sj is not None and os.environ.get("DATACACHE_DECODER", "").lower() != "pil"


def backend_name() -> str:
    """Which decoder runs, e.g. ``"pillow-13.0.0 (draft)"`` or ``"simplejpeg-1.9.0+pillow-13.0.0"``."""
    if _use_simplejpeg():
        return f"simplejpeg-{getattr(_sj, '__version__', '?')}+{_PILLOW} (draft fallback)"
    return f"{_PILLOW} (draft)"


def target_size(w: int, h: int, variant: Variant) -> tuple[int, int]:
    """Output (width, height) for an upright ``w x h`` image (see the module docstring)."""
    scale = variant.short_side / min(w, h)
    scale = min(scale, variant.long_cap / max(w, h))
    return max(1, round(w * scale)), max(1, round(h * scale))


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


def _torch_shrink(im: Image.Image, size: tuple[int, int]) -> np.ndarray | None:
    """Bilinear antialiased shrink of an RGB image with torch, if torch is already loaded; else None.

    Fork hazard: torch's intra-op (OpenMP) pool does not survive a fork; a forked process that runs
    this must use one intra-op thread (DataLoader workers do; :mod:`datacache.warm`'s pool sets it)."""
    torch = sys.modules.get("torch")
    if torch is None or im.mode != "RGB" or size[0] > im.size[0] or size[1] > im.size[1]:
        return None
    src = np.asarray(im)
    if not src.flags.writeable:
        src = src.copy()
    t = torch.from_numpy(src).permute(2, 0, 1).unsqueeze(0)
    out = torch.nn.functional.interpolate(t, size=(size[1], size[0]), mode="bilinear", antialias=True,
                                          align_corners=False)
    return out[0].permute(1, 2, 0).contiguous().numpy()


def _finish(im: Image.Image, size: tuple[int, int], variant: Variant) -> np.ndarray:
    if im.size != size:
        fast = _torch_shrink(im, size) if variant.resample == "bilinear" else None
        if fast is not None:
            return fast
        im = im.resize(size, _RESAMPLE[variant.resample], reducing_gap=3.0)
    arr = np.asarray(im)
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C")  # writable so torch.from_numpy works without a warning
    return arr


def _decode_simplejpeg(data: bytes, variant: Variant) -> np.ndarray | None:
    """simplejpeg path for plain RGB/gray JPEGs without EXIF rotation; None -> use Pillow."""
    try:
        h, w, colorspace, _ = _sj.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("RGB", "YCbCr", "Gray"):
        return None  # CMYK/YCCK: Pillow handles the conversion
    if b"Exif" in data[:65536]:
        with Image.open(io.BytesIO(data)) as probe:  # header parse only, no pixel decode
            if probe.getexif().get(0x0112, 1) != 1:
                return None  # rotated: Pillow applies the orientation
    tw, th = target_size(w, h, variant)
    if w * h > JPEG_MAX_PIXELS:
        return None
    arr = _sj.decode_jpeg(data, colorspace="RGB", min_width=tw, min_height=th)
    return _finish(Image.fromarray(arr, "RGB"), (tw, th), variant)


def decode_image(data: bytes, variant: Variant, *, name: str = "<bytes>") -> np.ndarray:
    """Decode ``data`` to the variant (module docstring); raises :class:`DecodeError`."""
    if not data:
        raise DecodeError(name, "zero-byte file: nothing to decode (re-copy the file from its origin)")
    if _use_simplejpeg() and data[:2] == b"\xff\xd8":
        try:
            out = _decode_simplejpeg(bytes(data), variant)
        except (ValueError, RuntimeError):
            out = None  # corrupt for libjpeg-turbo too: let Pillow produce the error message
        except MemoryError:
            raise DecodeError(name, "out of memory while decoding (transient: retried in a later epoch)",
                              transient=True) from None
        if out is not None:
            return out
    try:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        if w < 1 or h < 1:
            raise DecodeError(name, f"image has an empty size {w}x{h}")
        draftable = im.format == "JPEG"
        limit = JPEG_MAX_PIXELS if draftable else FULL_DECODE_MAX_PIXELS
        if w * h > limit:
            raise DecodeError(name, f"{im.format} image of {w}x{h} = {w * h / 1e6:.0f} Mpx exceeds the "
                              f"{limit / 1e6:.0f} Mpx limit for {'JPEG' if draftable else 'non-JPEG'} "
                              "input; downscale the file offline (or convert it to JPEG, which decodes "
                              "with DCT scaling)")
        orientation = im.getexif().get(0x0112, 1) if im.format in ("JPEG", "TIFF", "PNG", "WEBP") else 1
        uw, uh = (h, w) if orientation in _ROTATING_ORIENTATIONS else (w, h)
        size = target_size(uw, uh, variant)
        if draftable:
            dw, dh = (size[1], size[0]) if orientation in _ROTATING_ORIENTATIONS else size
            im.draft("RGB", (dw, dh))  # DCT scaling; result is >= (dw, dh)
        im.load()
        if orientation != 1:
            im = ImageOps.exif_transpose(im)
        return _finish(_to_rgb(im), size, variant)
    except DecodeError:
        raise
    except UnidentifiedImageError:
        raise DecodeError(name, f"not a decodable image ({len(data)} bytes); "
                          "remove the file or replace it with a valid image") from None
    except Image.DecompressionBombError as e:
        raise DecodeError(name, f"{e}; downscale the file offline") from None
    except MemoryError:  # the process, not the file: never remembered as a bad file
        raise DecodeError(name, "out of memory while decoding (transient: retried in a later epoch)",
                          transient=True) from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, KeyError, TypeError,
            ZeroDivisionError) as e:
        raise DecodeError(name, f"corrupt or truncated image data ({type(e).__name__}: {e}); re-copy the "
                          "file from its origin or remove it") from None
