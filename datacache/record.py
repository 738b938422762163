"""Record codec: the bytes stored under one cache key.

Layout::

    [u32 little-endian header length N][N bytes msgpack header][payload]

The header is a msgpack map ``{v, h, w, c, dtype, label, enc, n}`` -- format version, shape, dtype
(always ``"uint8"``), the integer label, the payload encoding (``"raw"`` pixels or ``"jpeg"``), the
payload length -- plus **one** integrity field over the key the record is stored under, every other
header field and the payload:

* ``xxh3`` (no record key): an xxh3_64 checksum. It catches bit flips, torn writes and a record
  returned under another key (a reassembled multi-node reply, a copy bug): :func:`decode_record` is
  given the key it was asked for. It is **unkeyed**: anyone who can write to the cache can compute it,
  so it says nothing about who wrote the record.
* ``mac`` (a writer with a :class:`RecordKey`, ``record_key_file``: the daemons, ``datacache warm``): a
  keyed MAC, BLAKE2b with the secret key (``hashlib.blake2b(key=..., digest_size=16)``) over the same
  fields, written **beside** the ``xxh3`` checksum. Only a holder of the key file can make a record a
  keyed reader accepts: for a keyed reader an unkeyed record or a record MAC'd with another key is a
  miss. An unkeyed reader checks the ``xxh3`` of any record. **Trainers read, daemons write**: the
  trainers' Redis role cannot write at all, so trainers need no key (it stays where records are
  written) and still read the daemons' keyed records at the cost of one xxh3 pass; a record of the
  previous keyed layout (``mac`` alone) is a miss for an unkeyed reader.

Format 2 introduced the key binding; format 3 marks pixels made under "one definition of a variant's
pixels" (:mod:`datacache.decode`); format 4 those made with torchvision's ``Resize`` geometry (the long
side truncated) and DCT scaling only where a >= 1.15x resize follows it. Records of older formats are
misses (re-decoded and rewritten).
``raw`` payloads are decoded zero-copy: :func:`decode_record` returns a read-only ``np.frombuffer``
view of the payload slice of the buffer it was given (an LMDB ``buffers=True`` memoryview, a Redis
reply ...), so a cache hit costs one checksum pass and no copy. A ``jpeg`` payload
(``Variant(encoding="jpeg")``) is the resized sample re-encoded as JPEG (``jpeg_quality``, default
90): ~7x smaller, a capacity option for large variants, at the price of a decode on every hit.

A cache value is untrusted input (another process, a full disk, a bit flip, a poisoned Redis, anyone
holding the trainers' Redis credential): nothing is ever unpickled, the msgpack header is parsed with
small limits, and :func:`decode_record` **never raises**: any failed check -- length, version, dtype,
encoding, integrity, the channel count (records are RGB: 3), the geometry the variant produces
(:func:`shape_fits_variant`), a pixel bound checked *before* a JPEG payload is decoded (its header
size must equal the record's), the JPEG decode itself, even ``MemoryError`` or Pillow's
``DecompressionBombError`` -- returns ``None``: a miss that the caller re-fills (with
``overwrite=True``), never an exception in the training loop.

Record key (:class:`RecordKey`, :func:`load_record_key`): a secret read from a file of at least 32
characters (e.g. ``(umask 077; head -c 32 /dev/urandom | base64 > FILE)``). The key bytes never appear
in a repr, a log line, an error or a pickle: a :class:`RecordKey` pickles as its file's path and a
short key id, and the unpickling process (a spawned DataLoader worker, a decode-pool task) reads the
file itself -- once per process -- and refuses (ConfigError) when the file now holds another key.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import stat
import struct
from typing import Any

import msgpack
import numpy as np
import xxhash
from PIL import Image

from datacache.config import ConfigError, Variant

FORMAT_VERSION = 4
CHANNELS = 3  # every record is RGB (datacache.decode makes C-contiguous [H, W, 3] uint8)
_LEN = struct.Struct("<I")
_MAX_HEADER = 256
_MAX_SIDE = 1 << 15
MAX_PIXELS = 1 << 26  # bound on h * w when no variant is given (a variant's is short_side * long_cap)
MAC_BYTES = 16
_FIELDS_XXH3 = frozenset({"v", "h", "w", "c", "dtype", "label", "enc", "n", "xxh3"})
# the previous keyed layout (the MAC alone)
_FIELDS_MAC = frozenset({"v", "h", "w", "c", "dtype", "label", "enc", "n", "mac"})
_FIELDS_BOTH = _FIELDS_XXH3 | _FIELDS_MAC  # a keyed writer's record: readable with or without the key
ENCODINGS = ("raw", "jpeg")

RECORD_KEY_ENV = "DATACACHE_RECORD_KEY_FILE"
RECORD_KEY_MIN_CHARS = 32
RECORD_KEY_HOW = "e.g. (umask 077; head -c 32 /dev/urandom | base64 > FILE); chmod 600 FILE"

log = logging.getLogger("datacache.record")


# ---------------------------------------------------------------------------------------- record key
class RecordKey:
    """A secret record key (see the module docstring). ``path``: the file it came from; ``key_id``: a
    short public fingerprint (a keyed hash of nothing: it identifies the key, it reveals nothing of it).
    The key bytes are in no repr, str or pickle."""

    __slots__ = ("_mac_key", "_q_key", "key_id", "path")

    def __init__(self, material: bytes, path: str) -> None:
        if len(material) < RECORD_KEY_MIN_CHARS:
            raise ConfigError(f"record_key_file {path}: the key is shorter than {RECORD_KEY_MIN_CHARS} "
                              f"characters; {RECORD_KEY_HOW.replace('FILE', path)}")
        # blake2b takes keys of at most 64 bytes: derive fixed-size keys from any length of material,
        # one per use (records, quarantine entries), so a MAC of one kind is never valid as the other
        self._mac_key = hashlib.blake2b(material, digest_size=32, person=b"dc-record-key").digest()
        self._q_key = hashlib.blake2b(material, digest_size=32, person=b"dc-quarant-key").digest()
        self.key_id = hashlib.blake2b(b"key id", key=self._mac_key, digest_size=6).hexdigest()
        self.path = path

    def __repr__(self) -> str:
        return f"RecordKey(path={self.path!r}, id={self.key_id})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        # Process boundary: the key bytes never travel in a pickle; the receiving process reads the file
        return (_record_key_for, (self.path, self.key_id))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordKey) and hmac.compare_digest(self._mac_key, other._mac_key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def record_mac(self) -> Any:
        """A fresh keyed BLAKE2b for one record."""
        return hashlib.blake2b(key=self._mac_key, digest_size=MAC_BYTES, person=b"dc-record-v3")

    def quarantine_mac(self) -> Any:
        """A fresh keyed BLAKE2b for one quarantine entry."""
        return hashlib.blake2b(key=self._q_key, digest_size=MAC_BYTES, person=b"dc-quarantine")


# absolute path -> key: each file is read once per process. No lock on purpose: dict get/setdefault are
# atomic under the GIL (two threads racing read the file twice and keep one), and a lock held by another
# thread at a fork would stay locked forever in the child (DataLoader workers and decode pools fork).
_KEYS: dict[str, RecordKey] = {}


def load_record_key(path: str) -> RecordKey:
    """The record key in ``path`` (read once per process; ConfigError naming the file -- never its
    content -- when it cannot be used, e.g. readable by group/others or owned by another user)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"record_key_file must be a file path, got {type(path).__name__}")
    apath = os.path.abspath(os.path.expanduser(path))
    got = _KEYS.get(apath)
    if got is not None:
        return got
    return _KEYS.setdefault(apath, _read_key(apath))


def _read_key(apath: str) -> RecordKey:
    from datacache.secretfile import read_secret_file

    how = RECORD_KEY_HOW.replace("FILE", apath)
    try:
        st = os.stat(apath)
    except OSError as e:
        raise ConfigError(f"record_key_file {apath}: cannot read it ({type(e).__name__}: "
                          f"{e.strerror or 'unreadable'}); create it readable only by this user, "
                          f"{how}") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open forever, a device would never end
        raise ConfigError(f"record_key_file {apath}: not a regular file; {how}")
    # read_secret_file refuses (one line, no content) a key file that is group/world-readable or not
    # this user's: anyone who can read -- or chose -- the key can forge cache records
    text = read_secret_file(apath, what="record_key_file", min_len=RECORD_KEY_MIN_CHARS)
    return RecordKey(text.encode("utf-8"), apath)


def _record_key_for(path: str, key_id: str) -> RecordKey:
    """Unpickling a :class:`RecordKey`: this process's key from ``path``, which must be the same key."""
    key = load_record_key(path)
    if key.key_id != key_id:
        raise ConfigError(f"record_key_file {path}: the file holds another key than when this job started "
                          f"(id {key.key_id}, expected {key_id}); restart every process with the new key")
    return key


def resolve_record_key_file(path: str | None) -> str | None:
    """``path`` as given ("" = no key), else ``$DATACACHE_RECORD_KEY_FILE`` when set, else None."""
    if path is not None:
        return path or None
    return os.environ.get(RECORD_KEY_ENV) or None


def record_key_from(path: str | None) -> RecordKey | None:
    """:func:`load_record_key` of ``path`` (after :func:`resolve_record_key_file`), or None."""
    resolved = resolve_record_key_file(path)
    return load_record_key(resolved) if resolved else None


# ---------------------------------------------------------------------------------------- geometry
def shape_fits_variant(h: int, w: int, variant: Variant) -> bool:
    """Whether ``h x w`` is a size :func:`datacache.decode.target_size` can produce for ``variant``.

    target_size scales by ``min(short / min(W, H), cap / max(W, H))`` and rounds. When the short side
    binds, the short side becomes ``short_side`` exactly and the long side stays <= the cap; when the
    cap binds, the long side becomes the cap exactly and the short side stays in 1..short_side. Both
    cases are reachable for every such size (it is its own target: target_size is idempotent), so the
    rule below is exactly the set of target sizes (tests/test_record_fuzz.py checks it against
    target_size itself)."""
    s, cap = variant.short_side, variant.long_cap
    a, b = min(h, w), max(h, w)
    return (a == s and b <= cap) or (b == cap and 1 <= a <= s)


# ---------------------------------------------------------------------------------------- codec
def _feed(x: Any, key: bytes, v: int, h: int, w: int, c: int, label: int, enc: str, n: int,
          payload: bytes | memoryview) -> None:
    x.update(b"%d:" % len(key))
    x.update(key)
    x.update(f"{v}:{h}:{w}:{c}:uint8:{label}:{enc}:{n}:".encode())
    x.update(payload)


def _digest(key: bytes, v: int, h: int, w: int, c: int, label: int, enc: str, n: int,
            payload: bytes | memoryview) -> int:
    """xxh3_64 over the key, the header fields *and* the payload (unkeyed)."""
    x = xxhash.xxh3_64()
    _feed(x, key, v, h, w, c, label, enc, n, payload)
    return x.intdigest()


def _mac(rk: RecordKey, key: bytes, v: int, h: int, w: int, c: int, label: int, enc: str, n: int,
         payload: bytes | memoryview) -> bytes:
    """Keyed BLAKE2b over the key, the header fields and the payload."""
    m = rk.record_mac()
    _feed(m, key, v, h, w, c, label, enc, n, payload)
    return m.digest()


def encode_record(pixels: np.ndarray, label: int, variant: Variant | None = None, *, key: bytes,
                  record_key: RecordKey | None = None) -> bytes:
    """Serialise an ``[H, W, 3]`` uint8 sample and its label for storage under ``key`` (JPEG payload if
    the variant says so; with ``record_key`` a keyed MAC beside the xxh3 checksum)."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != CHANNELS:
        raise ValueError(f"encode_record expects uint8 [H, W, 3] (RGB) pixels, got {pixels.dtype} "
                         f"{pixels.shape}")
    h, w, c = (int(x) for x in pixels.shape)
    if variant is not None and variant.encoding == "jpeg":
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels)).save(buf, format="JPEG", quality=variant.jpeg_quality)
        payload, enc = buf.getvalue(), "jpeg"
    else:
        payload, enc = np.ascontiguousarray(pixels).tobytes(), "raw"
    fields = {"v": FORMAT_VERSION, "h": h, "w": w, "c": c, "dtype": "uint8", "label": int(label), "enc": enc,
              "n": len(payload)}
    fields["xxh3"] = _digest(bytes(key), FORMAT_VERSION, h, w, c, int(label), enc, len(payload), payload)
    if record_key is not None:
        fields["mac"] = _mac(record_key, bytes(key), FORMAT_VERSION, h, w, c, int(label), enc, len(payload),
                             payload)
    header = msgpack.packb(fields, use_bin_type=True)
    return _LEN.pack(len(header)) + header + payload


def _header(mv: memoryview) -> tuple[dict, int] | None:
    if len(mv) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(mv, 0)
    if n == 0 or n > _MAX_HEADER or _LEN.size + n > len(mv):
        return None
    hdr = msgpack.unpackb(mv[_LEN.size:_LEN.size + n], raw=False, max_bin_len=MAC_BYTES, max_array_len=0,
                          max_map_len=16, max_str_len=64, max_ext_len=0)
    return (hdr, _LEN.size + n) if isinstance(hdr, dict) else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_record(buf: bytes | memoryview, key: bytes, variant: Variant | None = None, *,
                  record_key: RecordKey | None = None) -> tuple[np.ndarray, int] | None:
    """``(pixels [H, W, 3] uint8, label)`` or ``None`` when the record fails any check -- including when
    it was not written for ``key``, does not fit ``variant`` (its encoding and geometry; the read path
    always passes it), or -- with ``record_key`` -- was not MAC'd with it (without a key: its xxh3).
    Never raises (module docstring)."""
    try:
        return _decode(buf, key, variant, record_key)
    except Exception:  # anything at all -- a decoder error, MemoryError, a bomb -- is a miss, by contract
        return None


def _decode(buf: bytes | memoryview, key: bytes, variant: Variant | None,
            record_key: RecordKey | None) -> tuple[np.ndarray, int] | None:
    mv = memoryview(buf).cast("B")
    parsed = _header(mv)
    if parsed is None:
        return None
    hdr, off = parsed
    fields = hdr.keys()
    if record_key is None:
        if fields != _FIELDS_XXH3 and fields != _FIELDS_BOTH:
            return None  # an unkeyed reader checks the xxh3: a record without one is a miss
    elif fields != _FIELDS_BOTH and fields != _FIELDS_MAC:
        return None  # a keyed reader never accepts a record without the MAC
    h, w, c, label, enc, n = hdr["h"], hdr["w"], hdr["c"], hdr["label"], hdr["enc"], hdr["n"]
    if hdr["v"] != FORMAT_VERSION or hdr["dtype"] != "uint8" or enc not in ENCODINGS:
        return None
    # exact ints (type() is int: no bool, no subclass); spelled out, this runs on every cache hit
    if not (type(h) is int and type(w) is int and type(c) is int and type(label) is int
            and type(n) is int) or c != CHANNELS:
        return None
    if not (0 < h <= _MAX_SIDE and 0 < w <= _MAX_SIDE) or off + n != len(mv):
        return None
    if variant is not None:
        if enc != variant.encoding or not shape_fits_variant(h, w, variant):
            return None
        max_pixels = variant.short_side * variant.long_cap
    else:
        max_pixels = MAX_PIXELS
    if h * w > max_pixels:
        return None
    if enc == "raw" and n != h * w * c:
        return None
    payload = mv[off:]
    if "xxh3" in fields:  # checked by every reader (a keyed one too: no field of a record goes unchecked)
        digest = hdr["xxh3"]
        if not _is_int(digest) or _digest(key, FORMAT_VERSION, h, w, c, label, enc, n, payload) != digest:
            return None
    if record_key is not None:
        mac = hdr["mac"]
        if not isinstance(mac, bytes) or len(mac) != MAC_BYTES:
            return None
        want = _mac(record_key, key, FORMAT_VERSION, h, w, c, label, enc, n, payload)
        if not hmac.compare_digest(want, mac):
            return None
    if enc == "raw":
        return np.frombuffer(payload, dtype=np.uint8).reshape(h, w, c), label  # zero-copy view
    arr = _decode_jpeg(payload, h, w)
    return None if arr is None else (arr, label)


def _decode_jpeg(payload: memoryview, h: int, w: int) -> np.ndarray | None:
    """The JPEG payload as ``[h, w, 3]``: its header's size must equal the record's (bounded above)
    before anything is decoded; only Pillow's JPEG plugin is tried."""
    if bytes(payload[:2]) != b"\xff\xd8":
        return None
    with Image.open(io.BytesIO(payload), formats=["JPEG"]) as im:  # parses the header only
        if im.format != "JPEG" or im.size != (w, h) or im.mode != "RGB":
            return None
        arr = np.asarray(im.convert("RGB"))  # decodes: at most the bounded h * w pixels
    if arr.dtype != np.uint8 or arr.shape != (h, w, CHANNELS):
        return None
    return arr
