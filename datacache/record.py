"""Record codec: the bytes stored under one cache key.

Layout::

    [u32 little-endian header length N][N bytes msgpack header][payload]

The header is a msgpack map ``{v, h, w, c, dtype, label, enc, n, xxh3}``: format version,
shape, dtype (always ``"uint8"``), the integer label, the payload encoding (``"raw"`` pixels
or ``"jpeg"``), the payload length and an xxh3_64 checksum over **the key the record is stored
under**, those fields and the payload. A flipped bit in the label is caught as well as one in the
pixels, and a record stored or returned under another key (a reassembled multi-node reply, a
copy bug) fails its check: :func:`decode_record` is given the key it was asked for. Format 2
introduced the key binding; format 3 marks pixels made under "one definition of a variant's pixels"
(:mod:`datacache.decode`: before it, the same key could hold torch- or Pillow-resized, M/8-scaled or
mis-oriented pixels depending on the filler). Records of older formats are misses (re-decoded and
rewritten). ``raw`` payloads
are decoded zero-copy: :func:`decode_record` returns a read-only ``np.frombuffer`` view of
the payload slice of the buffer it was given (an LMDB ``buffers=True`` memoryview, a Redis
reply ...), so a cache hit costs one checksum pass and no copy. A ``jpeg`` payload
(``Variant(encoding="jpeg")``) is the resized sample re-encoded as JPEG (``jpeg_quality``,
default 90): ~7x smaller, a capacity option for large variants, at the price of a decode
on every hit.

A cache value is untrusted input (another process, a full disk, a bit flip, a poisoned
Redis): nothing is ever unpickled, the msgpack header is parsed with small limits, and
**any** failed check (length, version, shape, dtype, encoding, checksum, JPEG decode) makes
:func:`decode_record` return ``None`` — a miss that the caller re-fills (with
``overwrite=True``), never an exception in the training loop.
"""

from __future__ import annotations

import io
import struct

import msgpack
import numpy as np
import xxhash
from PIL import Image

from datacache.config import Variant

FORMAT_VERSION = 3
_LEN = struct.Struct("<I")
_MAX_HEADER = 256
_MAX_SIDE = 1 << 15


def _digest(key: bytes, v: int, h: int, w: int, c: int, label: int, enc: str, n: int,
            payload: bytes | memoryview) -> int:
    """xxh3_64 over the key, the header fields *and* the payload."""
    x = xxhash.xxh3_64()
    x.update(b"%d:" % len(key))
    x.update(key)
    x.update(f"{v}:{h}:{w}:{c}:uint8:{label}:{enc}:{n}:".encode())
    x.update(payload)
    return x.intdigest()


def encode_record(pixels: np.ndarray, label: int, variant: Variant | None = None, *, key: bytes) -> bytes:
    """Serialise an ``[H, W, C]`` uint8 sample and its label for storage under ``key`` (JPEG payload
    if the variant says so)."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in (1, 3):
        raise ValueError(f"encode_record expects uint8 [H, W, 3|1] pixels, got {pixels.dtype} {pixels.shape}")
    h, w, c = (int(x) for x in pixels.shape)
    if variant is not None and variant.encoding == "jpeg":
        buf = io.BytesIO()
        img = Image.fromarray(np.ascontiguousarray(pixels[..., 0] if c == 1 else pixels))
        img.save(buf, format="JPEG", quality=variant.jpeg_quality)
        payload, enc = buf.getvalue(), "jpeg"
    else:
        payload, enc = np.ascontiguousarray(pixels).tobytes(), "raw"
    digest = _digest(bytes(key), FORMAT_VERSION, h, w, c, int(label), enc, len(payload), payload)
    header = msgpack.packb({"v": FORMAT_VERSION, "h": h, "w": w, "c": c, "dtype": "uint8",
                            "label": int(label), "enc": enc, "n": len(payload), "xxh3": digest},
                           use_bin_type=True)
    return _LEN.pack(len(header)) + header + payload


def _header(mv: memoryview) -> tuple[dict, int] | None:
    if len(mv) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(mv, 0)
    if n == 0 or n > _MAX_HEADER or _LEN.size + n > len(mv):
        return None
    try:
        hdr = msgpack.unpackb(mv[_LEN.size:_LEN.size + n], raw=False, max_bin_len=0, max_array_len=0,
                              max_map_len=16, max_str_len=64)
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
    return (hdr, _LEN.size + n) if isinstance(hdr, dict) else None


def decode_record(buf: bytes | memoryview, key: bytes) -> tuple[np.ndarray, int] | None:
    """``(pixels [H, W, C] uint8, label)`` or ``None`` when the record fails any check, including
    when it was not written for ``key``."""
    try:
        mv = memoryview(buf).cast("B")
    except (TypeError, ValueError):
        return None
    parsed = _header(mv)
    if parsed is None:
        return None
    hdr, off = parsed
    try:
        h, w, c, label, enc, n, digest = (hdr["h"], hdr["w"], hdr["c"], hdr["label"], hdr["enc"], hdr["n"],
                                          hdr["xxh3"])
        if hdr["v"] != FORMAT_VERSION or hdr["dtype"] != "uint8":
            return None
    except (KeyError, TypeError):
        return None
    ints = (h, w, c, label, n, digest)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ints):
        return None
    if not (0 < h <= _MAX_SIDE and 0 < w <= _MAX_SIDE and c in (1, 3)) or off + n != len(mv):
        return None
    payload = mv[off:]
    if _digest(key, hdr["v"], h, w, c, label, enc, n, payload) != digest:
        return None
    if enc == "raw":
        if n != h * w * c:
            return None
        arr = np.frombuffer(payload, dtype=np.uint8).reshape(h, w, c)  # zero-copy view
        return arr, label
    if enc == "jpeg":
        try:
            with Image.open(io.BytesIO(payload)) as im:
                if im.format != "JPEG" or im.size != (w, h):
                    return None
                arr = np.asarray(im.convert("RGB" if c == 3 else "L"))
        except (OSError, ValueError, SyntaxError):
            return None
        return (arr.reshape(h, w, c), label)
    return None
