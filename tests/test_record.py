from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest

from datacache.config import Variant
from datacache.keys import sample_key
from datacache.record import FORMAT_VERSION, decode_record, encode_record

K = sample_key("0123456789abcdef", "s160m320bilinear-raw", 5)


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, 120 * 160 * 3).reshape(120, 160, 3)
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def test_raw_roundtrip_is_zero_copy(pixels: np.ndarray) -> None:
    rec = encode_record(pixels, 7, key=K)
    buf = bytearray(rec)
    out = decode_record(memoryview(buf), K)
    assert out is not None
    arr, label = out
    assert label == 7 and arr.dtype == np.uint8 and arr.shape == pixels.shape
    assert np.array_equal(arr, pixels)
    assert np.shares_memory(arr, np.frombuffer(buf, dtype=np.uint8))  # a view, not a copy
    assert decode_record(rec, K) is not None and decode_record(bytes(rec), K)[1] == 7


def test_jpeg_encoding_is_smaller_and_close(pixels: np.ndarray) -> None:
    raw = encode_record(pixels, 1, key=K)
    jpg = encode_record(pixels, 1, Variant(encoding="jpeg"), key=K)
    assert len(jpg) * 3 < len(raw)
    arr, label = decode_record(jpg, K)
    assert label == 1 and arr.shape == pixels.shape
    assert np.abs(arr.astype(int) - pixels.astype(int)).mean() < 6


def test_rejects_bad_input_to_encoder() -> None:
    with pytest.raises(ValueError):
        encode_record(np.zeros((4, 4, 3), np.float32), 0, key=K)
    with pytest.raises(ValueError):
        encode_record(np.zeros((4, 4), np.uint8), 0, key=K)


def test_every_damaged_record_is_a_miss(pixels: np.ndarray) -> None:
    small = pixels[:40, :50]
    for rec in (encode_record(small, 3, key=K), encode_record(small, 3, Variant(encoding="jpeg"), key=K)):
        # truncation anywhere
        for cut in sorted({0, 1, 3, 4, 10, len(rec) // 2, len(rec) - 1}):
            assert decode_record(rec[:cut], K) is None, cut
        # one flipped bit anywhere (header or payload)
        rng = np.random.default_rng(1)
        for pos in list(range(0, 40)) + list(rng.integers(40, len(rec), 60)):
            bad = bytearray(rec)
            bad[int(pos)] ^= 1 << int(rng.integers(0, 8))
            assert decode_record(bytes(bad), K) is None, pos  # the checksum covers header and payload
        assert decode_record(rec + b"x", K) is None  # trailing garbage


def test_header_lies_and_foreign_values_are_misses(pixels: np.ndarray) -> None:
    rec = encode_record(pixels[:8, :8], 2, key=K)
    n = int.from_bytes(rec[:4], "little")
    hdr = msgpack.unpackb(rec[4:4 + n])
    payload = rec[4 + n:]

    def rebuild(**changes: object) -> bytes:
        h = msgpack.packb({**hdr, **changes})
        return len(h).to_bytes(4, "little") + h + payload

    assert decode_record(rebuild(), K) is not None
    assert decode_record(rebuild(v=FORMAT_VERSION + 1), K) is None
    assert decode_record(rebuild(h=9), K) is None          # size mismatch
    assert decode_record(rebuild(dtype="float32"), K) is None
    assert decode_record(rebuild(enc="png"), K) is None
    assert decode_record(rebuild(xxh3=hdr["xxh3"] ^ 1), K) is None
    assert decode_record(rebuild(label="7"), K) is None
    # never unpickled: a pickle (even of a valid-looking tuple) is just a miss
    assert decode_record(pickle.dumps((pixels[:8, :8], 2)), K) is None
    for junk in (b"", b"\x00" * 16, b"\xff" * 64, "not bytes"):
        assert decode_record(junk, K) is None  # type: ignore[arg-type]


def test_record_is_bound_to_its_key(pixels: np.ndarray) -> None:
    """A valid record returned under another key (another index, fingerprint or variant) is a miss."""
    rec = encode_record(pixels[:8, :8], 2, key=K)
    assert decode_record(rec, K) is not None
    for other in (sample_key("0123456789abcdef", "s160m320bilinear-raw", 6),
                  sample_key("fedcba9876543210", "s160m320bilinear-raw", 5),
                  sample_key("0123456789abcdef", "s128m256bilinear-raw", 5), b""):
        assert decode_record(rec, other) is None, other
    jpg = encode_record(pixels[:16, :16], 2, Variant(encoding="jpeg"), key=K)
    assert decode_record(jpg, K) is not None and decode_record(jpg, K + b"0") is None


def test_format_1_records_are_misses(pixels: np.ndarray) -> None:
    """A record written by format 1 (checksum without the key) is a miss, not an error."""
    import xxhash

    px = np.ascontiguousarray(pixels[:8, :8])
    payload = px.tobytes()
    x = xxhash.xxh3_64()
    x.update(f"1:8:8:3:uint8:2:raw:{len(payload)}:".encode())
    x.update(payload)
    hdr = msgpack.packb({"v": 1, "h": 8, "w": 8, "c": 3, "dtype": "uint8", "label": 2, "enc": "raw",
                         "n": len(payload), "xxh3": x.intdigest()}, use_bin_type=True)
    old = len(hdr).to_bytes(4, "little") + hdr + payload
    assert FORMAT_VERSION == 4 and decode_record(old, K) is None


def test_format_3_records_are_misses(pixels: np.ndarray) -> None:
    """Format 3 pixels were sized by rounding the long side and DCT-scaled right down to the target;
    format 4 follows torchvision's Resize geometry: a valid format-3 record (its checksum right) is a
    miss, rewritten with the new pixels."""
    from tests.test_record_fuzz import _xxh3

    px = np.ascontiguousarray(pixels[:8, :8])
    payload = px.tobytes()
    digest = _xxh3(K, 3, 8, 8, 3, 2, "raw", len(payload), payload)
    hdr = msgpack.packb({"v": 3, "h": 8, "w": 8, "c": 3, "dtype": "uint8", "label": 2, "enc": "raw",
                         "n": len(payload), "xxh3": digest}, use_bin_type=True)
    v3 = len(hdr).to_bytes(4, "little") + hdr + payload
    assert decode_record(v3, K) is None
    same = encode_record(px, 2, key=K)  # the same sample in format 4 is a hit
    assert decode_record(same, K) is not None


def test_records_are_rgb_and_fit_their_variant(pixels: np.ndarray) -> None:
    """Encoder and decoder agree that records are RGB; with a variant, the encoding and the geometry the
    variant produces (short side 160, long side <= 320) are checked too."""
    with pytest.raises(ValueError, match="RGB"):
        encode_record(np.zeros((4, 4, 1), np.uint8), 0, key=K)
    v = Variant(short_side=120)  # pixels are 120x160: the short side is 120
    raw = encode_record(pixels, 3, v, key=K)
    assert decode_record(raw, K, v) is not None and decode_record(raw, K) is not None
    assert decode_record(raw, K, Variant(short_side=160)) is None          # another geometry
    assert decode_record(raw, K, Variant(short_side=120, encoding="jpeg")) is None  # another encoding
    assert decode_record(raw, K, Variant(short_side=100, max_long_side=160)) is None
    capped = Variant(short_side=130, max_long_side=160)  # the cap binds: long side 160, short side <= 130
    assert decode_record(raw, K, capped) is not None
    jpg = encode_record(pixels, 3, Variant(short_side=120, encoding="jpeg"), key=K)
    assert decode_record(jpg, K, Variant(short_side=120, encoding="jpeg")) is not None
    assert decode_record(jpg, K, v) is None
