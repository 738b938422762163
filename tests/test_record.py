from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest

from datacache.config import Variant
from datacache.record import FORMAT_VERSION, decode_record, encode_record


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, 120 * 160 * 3).reshape(120, 160, 3)
    return np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def test_raw_roundtrip_is_zero_copy(pixels: np.ndarray) -> None:
    rec = encode_record(pixels, 7)
    buf = bytearray(rec)
    out = decode_record(memoryview(buf))
    assert out is not None
    arr, label = out
    assert label == 7 and arr.dtype == np.uint8 and arr.shape == pixels.shape
    assert np.array_equal(arr, pixels)
    assert np.shares_memory(arr, np.frombuffer(buf, dtype=np.uint8))  # a view, not a copy
    assert decode_record(rec) is not None and decode_record(bytes(rec))[1] == 7


def test_jpeg_encoding_is_smaller_and_close(pixels: np.ndarray) -> None:
    raw = encode_record(pixels, 1)
    jpg = encode_record(pixels, 1, Variant(encoding="jpeg"))
    assert len(jpg) * 3 < len(raw)
    arr, label = decode_record(jpg)
    assert label == 1 and arr.shape == pixels.shape
    assert np.abs(arr.astype(int) - pixels.astype(int)).mean() < 6


def test_rejects_bad_input_to_encoder() -> None:
    with pytest.raises(ValueError):
        encode_record(np.zeros((4, 4, 3), np.float32), 0)
    with pytest.raises(ValueError):
        encode_record(np.zeros((4, 4), np.uint8), 0)


def test_every_damaged_record_is_a_miss(pixels: np.ndarray) -> None:
    small = pixels[:40, :50]
    for rec in (encode_record(small, 3), encode_record(small, 3, Variant(encoding="jpeg"))):
        # truncation anywhere
        for cut in sorted({0, 1, 3, 4, 10, len(rec) // 2, len(rec) - 1}):
            assert decode_record(rec[:cut]) is None, cut
        # one flipped bit anywhere (header or payload)
        rng = np.random.default_rng(1)
        for pos in list(range(0, 40)) + list(rng.integers(40, len(rec), 60)):
            bad = bytearray(rec)
            bad[int(pos)] ^= 1 << int(rng.integers(0, 8))
            assert decode_record(bytes(bad)) is None, pos  # the checksum covers header and payload
        assert decode_record(rec + b"x") is None  # trailing garbage


def test_header_lies_and_foreign_values_are_misses(pixels: np.ndarray) -> None:
    rec = encode_record(pixels[:8, :8], 2)
    n = int.from_bytes(rec[:4], "little")
    hdr = msgpack.unpackb(rec[4:4 + n])
    payload = rec[4 + n:]

    def rebuild(**changes: object) -> bytes:
        h = msgpack.packb({**hdr, **changes})
        return len(h).to_bytes(4, "little") + h + payload

    assert decode_record(rebuild()) is not None
    assert decode_record(rebuild(v=FORMAT_VERSION + 1)) is None
    assert decode_record(rebuild(h=9)) is None          # size mismatch
    assert decode_record(rebuild(dtype="float32")) is None
    assert decode_record(rebuild(enc="png")) is None
    assert decode_record(rebuild(xxh3=hdr["xxh3"] ^ 1)) is None
    assert decode_record(rebuild(label="7")) is None
    # never unpickled: a pickle (even of a valid-looking tuple) is just a miss
    assert decode_record(pickle.dumps((pixels[:8, :8], 2))) is None
    for junk in (b"", b"\x00" * 16, b"\xff" * 64, "not bytes"):
        assert decode_record(junk) is None  # type: ignore[arg-type]
