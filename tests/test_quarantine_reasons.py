"""Quarantine reasons carry no file bytes (issue 22, item 5c).

Pillow's exception texts can quote bytes of the file (``Token too long in file header: <bytes>`` for a
PPM/PGM header token). Every reason that reaches a quarantine entry, ``stats()``, ``ds.quarantined``, a
log line, a ``DatasetError``, ``datacache warm``'s report or the daemon's quarantine summary must carry the
exception's *type* and a fixed message. The test files hold a unique marker in every position Pillow may
quote; every output is scanned for it (and the stored values byte for byte: the whole LMDB directory, every
value in a real Redis).
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from datacache.config import Variant
from datacache.decode import DecodeError, decode_image
from datacache.fill import fill_one
from datacache.quarantine import read_failure_reason
from datacache.quarantine_summary import QuarantineSummary, reason_kind
from datacache.source import SourceError
from tests.redis_utils import needs_redis

MARKER = "QZXMARK7731"
M = MARKER.encode()
# not a PNG chunk id (not four word characters): Pillow quotes it, "broken PNG file (chunk b'Q-9Z')"
CID = "Q-9Z"
V = Variant(short_side=16)


def _png_chunk(kind: bytes, data: bytes, crc: int | None = None) -> bytes:
    c = struct.pack(">I", len(data)) + kind + data
    return c + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF if crc is None else crc)


def _valid(fmt: str, size: tuple[int, int] = (24, 18)) -> bytes:
    b = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(b, fmt)
    return b.getvalue()


def _leaks(text: str) -> bool:
    return MARKER in text or CID in text


def marked_files() -> dict[str, bytes]:
    """Undecodable files with the marker where Pillow may quote it (names are marker-free)."""
    png = _valid("PNG")
    idat = png.index(b"IDAT") - 4
    jpg = _valid("JPEG")
    com = b"\xff\xfe" + struct.pack(">H", len(M) + 2) + M
    big = _valid("PNG", (300, 300))
    at = big.index(b"IDAT") - 4
    zdata = big[at + 8:at + 8 + struct.unpack(">I", big[at:at + 4])[0]]
    # half the image data, then a chunk whose id is not a chunk id: Pillow quotes the id while loading
    cut = (big[:at] + _png_chunk(b"IDAT", zdata[:len(zdata) // 2]) + struct.pack(">I", 20) + CID.encode()
           + M * 2)
    return {
        "c000/ppm_token.ppm": b"P6\n" + M + b" 10\n255\n" + b"\x00" * 30,        # "Token too long": quotes it
        "c000/ppm_long.ppm": b"P6\n" + M * 20 + b"\n",
        "c000/pgm_width.pgm": b"P5\n12 " + M + b"\n255\n" + b"\x00" * 30,
        "c000/png_chunk.png": cut,
        "c000/png_crc.png": png[:idat] + _png_chunk(b"tEXt", b"k\x00" + M, crc=1) + png[idat:],
        "c000/png_idat.png": png[:idat] + _png_chunk(b"IDAT", M * 4) + _png_chunk(b"IEND", b""),
        "c000/jpeg_soi.JPEG": b"\xff\xd8" + M * 10,                               # garbage after the SOI
        "c000/jpeg_marker.JPEG": b"\xff\xd8\xff" + M * 10,
        "c000/jpeg_com.JPEG": jpg[:2] + com + jpg[2:len(jpg) // 2],  # a comment, then a truncated image
        "c000/text.JPEG": b"not an image " + M * 5,
    }


def write_dataset(root: str) -> dict[str, bytes]:
    from datacache.devtools.synth import make_imagefolder

    make_imagefolder(root, classes=2, per_class=2, size=(40, 30))
    files = marked_files()
    for rel, data in files.items():
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return files


def test_pillow_quotes_the_marker_so_the_test_means_something() -> None:
    """The reference: Pillow's own messages quote the file's bytes (the PPM token, the PNG chunk id)."""
    files = marked_files()
    with pytest.raises(ValueError) as ei:
        Image.open(io.BytesIO(files["c000/ppm_token.ppm"])).load()
    assert MARKER in str(ei.value)
    with pytest.raises(SyntaxError) as ei2:
        Image.open(io.BytesIO(files["c000/png_chunk.png"])).load()
    assert CID in str(ei2.value)


def test_decode_errors_carry_the_type_and_a_fixed_message() -> None:
    for rel, data in marked_files().items():
        with pytest.raises(DecodeError) as ei:
            decode_image(data, V, name=rel)
        e = ei.value
        for text in (str(e), e.reason, repr(e), str(e.__reduce__())):
            assert not _leaks(text), (rel, text)
        assert rel in str(e)  # the relative path may stay
        got = fill_one(data, rel=rel, size=len(data), label=0, key=b"dc:f:t:0", variant=V)
        assert got.record is None and got.remember and not _leaks(got.reason)
        assert got.reason.startswith("cannot decode: ") and not _leaks(reason_kind(got.reason))
    with pytest.raises(DecodeError) as ei:
        decode_image(marked_files()["c000/ppm_token.ppm"], V, name="x.ppm")
    assert "(ValueError)" in ei.value.reason  # the exception's type, not its text


def test_read_and_unexpected_decoder_failures_carry_no_message_text() -> None:
    for cause in (OSError(f"remote said: {MARKER}"), TimeoutError(MARKER), ValueError(MARKER),
                  FileNotFoundError(2, f"No such file {MARKER}"), f"repr of something {MARKER}"):
        reason = read_failure_reason(SourceError("c000/x.JPEG", cause))
        assert MARKER not in reason and reason.startswith("cannot read the file")
        got = fill_one(SourceError("c000/x.JPEG", cause), rel="c000/x.JPEG", size=10, label=0, key=b"k",
                       variant=V)
        assert MARKER not in got.reason and not got.remember
    assert "(TimeoutError)" in read_failure_reason(SourceError("p", TimeoutError(MARKER)))

    def leaky(data: bytes, variant: Variant, *, name: str = "") -> None:
        raise RuntimeError(f"decoder choked on {data[:20]!r}")

    leaky.family = "pil"  # type: ignore[attr-defined]
    data = b"\x00" + M
    got = fill_one(data, rel="c000/y.JPEG", size=len(data), label=0, key=b"k", variant=V, decoder=leaky)
    assert got.record is None and not got.remember and not _leaks(got.reason)
    assert "RuntimeError" in got.reason


def _scan_dir(path: str) -> list[str]:
    hits = []
    for d, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                data = f.read()
                if M in data or CID.encode() in data:
                    hits.append(os.path.join(d, n))
    return hits


def test_cached_imagenet_outputs_never_show_file_bytes(tmp_path, caplog) -> None:
    from client.dataset import CachedImageNet, DatasetError

    root = str(tmp_path / "ds")
    files = write_dataset(root)
    cache_dir = tmp_path / "lmdb"
    caplog.set_level(logging.DEBUG)
    ds = CachedImageNet(root, cache=f"lmdb://{cache_dir}", short_side=16, t1_dir=None)
    ds.__getitems__(list(range(len(ds))))
    q = ds.quarantined
    assert set(q) == set(files) and all(r.startswith("cannot decode") for r in q.values())
    st = json.dumps(ds.stats())
    stored = ds.store.get_many([ds.reader.qkey(i) for i in range(len(ds))])
    assert sum(v is not None for v in stored) == len(files)  # remembered (complete bytes)
    values = [bytes(v).decode("latin-1") for v in stored if v is not None]
    for text in (json.dumps(q), st, caplog.text, *values):
        assert not _leaks(text), text
    ds2 = CachedImageNet(root, cache=f"lmdb://{cache_dir}", short_side=16, t1_dir=None, on_error="raise")
    for i, rel in enumerate(ds2.manifest.paths):
        if rel in files:
            with pytest.raises(DatasetError) as ei:
                ds2[i]
            assert not _leaks(str(ei.value)) and rel in str(ei.value)
    assert not _leaks(json.dumps(ds2.quarantined)) and not _leaks(caplog.text)
    ds.store.flush() if hasattr(ds.store, "flush") else None
    assert _scan_dir(str(cache_dir)) == []  # not in any stored value (nor the persisted manifest)


@needs_redis
def test_warm_into_redis_never_stores_or_logs_file_bytes(tmp_path, caplog, redis_url, redis_server) -> None:
    import redis

    from datacache.warm import warm_cache

    root = str(tmp_path / "ds")
    files = write_dataset(root)
    caplog.set_level(logging.DEBUG)
    rep = warm_cache(root, redis_url, workers=1, short_side=16, t1_dir=None, progress=False,
                     record_key_file="")
    assert set(rep.quarantined) == set(files)
    summary = QuarantineSummary()
    summary.add(rep.quarantined)
    for text in (json.dumps(rep.quarantined), json.dumps(summary.as_json()), caplog.text):
        assert not _leaks(text), text
    assert any("(ValueError)" in k for k in summary.as_json()["by_reason"])  # kinds keep the type
    r = redis.Redis(port=redis_server.port)
    keys = list(r.scan_iter("*"))
    assert sum(k.startswith(b"dcq:") for k in keys) == len(files)
    for k in keys:
        value = r.get(k) if r.type(k) == b"string" else json.dumps(
            {str(f): str(v) for f, v in r.hgetall(k).items()}).encode()
        assert M not in value and CID.encode() not in value, k
