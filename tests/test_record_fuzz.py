"""Records that cannot crash or lie (issue 22, item 4): the geometry rule against ``target_size``, a record
fuzzer, and the forged records reproduced from the issue against a real redis-server.

References are independent of the code under test: the variant's geometry is checked against
:func:`datacache.decode.target_size` (what the decoder does), pixels against a fresh decode of the source
file, and "never decodes more than the bound" against the sizes Pillow is asked to load.
"""

from __future__ import annotations

import io
import math
import struct

import msgpack
import numpy as np
import pytest
import xxhash
from PIL import Image, ImageFile

from datacache.config import Variant
from datacache.decode import decode_image, target_size
from datacache.keys import sample_key
from datacache.record import FORMAT_VERSION, RecordKey, decode_record, encode_record, shape_fits_variant
from tests.redis_utils import needs_redis

V = Variant(short_side=16)  # long side capped at 32
VJ = Variant(short_side=16, encoding="jpeg")
K = sample_key("0123456789abcdef", V.tag(), 5)
FIELDS = ("v", "h", "w", "c", "dtype", "label", "enc", "n", "xxh3")


def _xxh3(key: bytes, v: int, h: int, w: int, c: int, label: int, enc: str, n: int, payload: bytes) -> int:
    """The format's unkeyed checksum, restated from docs/using-the-cache.md (what anyone with write access
    can compute)."""
    x = xxhash.xxh3_64()
    x.update(b"%d:" % len(key))
    x.update(key)
    x.update(f"{v}:{h}:{w}:{c}:uint8:{label}:{enc}:{n}:".encode())
    x.update(payload)
    return x.intdigest()


def forge(key: bytes, payload: bytes, **hdr: object) -> bytes:
    """A record made by an attacker holding the cache credential: any header, a *valid* xxh3."""
    fields = {"v": FORMAT_VERSION, "h": 1, "w": 1, "c": 3, "dtype": "uint8", "label": 0, "enc": "raw",
              "n": len(payload), **hdr}
    try:
        fields["xxh3"] = _xxh3(key, fields["v"], fields["h"], fields["w"], fields["c"], fields["label"],
                               fields["enc"], fields["n"], payload)
    except (TypeError, ValueError):
        fields["xxh3"] = 0
    h = msgpack.packb(fields, use_bin_type=True)
    return struct.pack("<I", len(h)) + h + payload


def jpeg_bytes(w: int, h: int, *, claim: tuple[int, int] | None = None) -> bytes:
    """A small JPEG; ``claim``: patch its SOF header to say (width, height) (a decompression bomb)."""
    b = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(b, "JPEG", quality=80)
    data = bytearray(b.getvalue())
    if claim is not None:
        sof = data.index(b"\xff\xc0")
        struct.pack_into(">HH", data, sof + 5, claim[1], claim[0])
    return bytes(data)


# ------------------------------------------------------------------------------------ the geometry rule
VARIANTS = [Variant(short_side=s, max_long_side=m) for s, m in
            ((1, None), (1, 1), (1, 5), (2, None), (7, None), (7, 7), (7, 20), (16, None), (16, 17),
             (33, None), (160, None), (224, None), (160, 200))]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.tag())
def test_shape_rule_is_exactly_the_set_of_target_sizes(variant: Variant) -> None:
    """Every size target_size makes is accepted (random upright shapes, extreme aspect ratios, 1 px to
    100k px), and every accepted size is one target_size makes (it is its own target)."""
    rng = np.random.default_rng(variant.short_side * 1000 + variant.long_cap)
    sides = np.exp(rng.uniform(0, math.log(100_000), (20_000, 2))).astype(int) + 1
    extra = [(1, 1), (1, 100_000), (100_000, 1), (2, 3), (3, 2), (variant.short_side, variant.long_cap),
             (variant.long_cap, variant.short_side), (variant.short_side * 2 + 1, variant.short_side)]
    for w, h in [*map(tuple, sides.tolist()), *extra]:
        tw, th = target_size(int(w), int(h), variant)
        assert shape_fits_variant(th, tw, variant), (w, h, tw, th)
    top = min(variant.long_cap + 3, 240)
    for h in range(1, top + 1):
        for w in range(1, top + 1):
            assert shape_fits_variant(h, w, variant) == (target_size(w, h, variant) == (w, h)), (h, w)


def test_real_decodes_are_hits_in_their_variant(tmp_path) -> None:
    """Images of odd sizes and orientations, decoded by the real decoder, encode to records that are hits
    for their variant (raw and jpeg) -- and misses for a variant of another size or encoding."""
    rng = np.random.default_rng(3)
    for (w, h), orient in (((1, 1), 1), ((3, 1000), 1), ((1000, 3), 1), ((200, 150), 6), ((150, 200), 1),
                           ((333, 500), 8), ((17, 16), 1), ((64, 16), 1), ((65, 16), 1)):
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        buf = io.BytesIO()
        exif = Image.Exif()
        exif[0x0112] = orient
        im.save(buf, "JPEG", quality=90, exif=exif.tobytes())
        for variant in (V, VJ, Variant(short_side=7, max_long_side=9)):
            px = decode_image(buf.getvalue(), variant)
            rec = encode_record(px, 4, variant, key=K)
            got = decode_record(rec, K, variant)
            assert got is not None and got[1] == 4 and got[0].shape == px.shape, ((w, h), variant.tag())
            other = Variant(short_side=variant.short_side + 1,
                            encoding="jpeg" if variant.encoding == "raw" else "raw")
            assert decode_record(rec, K, other) is None


# ------------------------------------------------------------------------------------ forged records
def test_forged_1x1x1_record_is_a_miss() -> None:
    """The issue's forgery: a 1x1x1 record with a valid (unkeyed) checksum and the right label."""
    rec = forge(K, b"\x00", h=1, w=1, c=1, label=3)
    assert decode_record(rec, K, V) is None and decode_record(rec, K) is None  # records are RGB
    rgb = forge(K, b"\x00\x00\x00", h=1, w=1, c=3, label=3)
    assert decode_record(rgb, K, V) is None  # a 1x1 sample is not a short-side-16 sample
    assert decode_record(rgb, K, Variant(short_side=1)) is not None  # ... but is one of short side 1


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_jpeg_bomb_header_is_a_miss_not_an_exception() -> None:
    """The issue's ~300-byte record whose JPEG header says 20000x20000 raised DecompressionBombError in
    the training process; now every variant of it is a miss, and nothing is decoded."""
    bomb = jpeg_bytes(16, 16, claim=(20000, 20000))
    assert len(bomb) < 1000
    cases = [forge(K, bomb, h=20000, w=20000, enc="jpeg", label=3),  # header agrees with the JPEG
             forge(K, bomb, h=16, w=21, enc="jpeg", label=3),        # header plausible, JPEG lies
             forge(K, jpeg_bytes(16, 16, claim=(9000, 9000)), h=9000, w=9000, enc="jpeg", label=3)]
    loads: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spy(self):  # type: ignore[no-untyped-def]
        loads.append(self.size)
        return real_load(self)

    ImageFile.ImageFile.load = spy  # type: ignore[method-assign]
    try:
        for rec in cases:
            assert decode_record(rec, K) is None
            assert decode_record(rec, K, VJ) is None
    finally:
        ImageFile.ImageFile.load = real_load  # type: ignore[method-assign]
    assert loads == []  # refused from the headers, before any pixel was decoded


# ------------------------------------------------------------------------------------ the fuzzer
def _originals() -> list[tuple[Variant, np.ndarray, bytes, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for h, w in ((16, 21), (21, 16), (16, 32), (9, 32), (16, 16)):
        px = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for variant in (V, VJ):
            rec = encode_record(px, 7, variant, key=K)
            got = decode_record(rec, K, variant)
            assert got is not None
            out.append((variant, px, rec, np.array(got[0])))
    return out


_VALUES = [0, -1, 1, 2, 3, 4, 9, 15, 16, 17, 21, 31, 32, 33, 1 << 15, (1 << 15) + 1, 1 << 31, (1 << 63) - 1,
           -(1 << 63), True, False, None, "3", "raw", "jpeg", "png", "uint8", "float32", b"\x00" * 8, 3.0,
           FORMAT_VERSION - 1, FORMAT_VERSION + 1]


def _split(rec: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(rec[:4], "little")
    return msgpack.unpackb(rec[4:4 + n]), rec[4 + n:]


def _mutate(rng: np.random.Generator, rec: bytes, key: bytes) -> tuple[bytes, bool]:
    """One random mutation of a valid record; True when the xxh3 was recomputed (an attacker's forgery)."""
    kind = int(rng.integers(0, 10))
    data = bytearray(rec)
    if kind == 0:  # bit flips anywhere
        for _ in range(int(rng.integers(1, 5))):
            p = int(rng.integers(0, len(data)))
            data[p] ^= 1 << int(rng.integers(0, 8))
        return bytes(data), False
    if kind == 1:  # truncation
        return bytes(data[:int(rng.integers(0, len(data)))]), False
    if kind == 2:  # trailing junk
        return bytes(data) + rng.bytes(int(rng.integers(1, 64))), False
    if kind == 3:  # a run of random bytes
        p = int(rng.integers(0, len(data)))
        run = rng.bytes(int(rng.integers(1, 32)))
        data[p:p + len(run)] = run
        return bytes(data[:len(rec)]), False
    if kind == 4:  # the header length prefix
        struct.pack_into("<I", data, 0, int(rng.choice([0, 1, 3, 255, 256, 257, 1 << 31, len(rec)])))
        return bytes(data), False
    hdr, payload = _split(rec)
    if kind == 5:  # header fields changed, checksum kept
        for _ in range(int(rng.integers(1, 3))):
            hdr[FIELDS[int(rng.integers(0, len(FIELDS)))]] = _VALUES[int(rng.integers(0, len(_VALUES)))]
        h = msgpack.packb(hdr, use_bin_type=True)
        return struct.pack("<I", len(h)) + h + payload, False
    if kind == 6:  # header fields changed, checksum recomputed (forged)
        fields = {f: hdr[f] for f in FIELDS[:-1]}
        for _ in range(int(rng.integers(1, 3))):
            fields[FIELDS[int(rng.integers(0, 8))]] = _VALUES[int(rng.integers(0, len(_VALUES)))]
        return forge(key, payload, **fields), True
    if kind == 7:  # payload swapped for another size / a bomb, header to match, forged
        w, h = (int(x) for x in rng.integers(1, 40, 2))
        claim = (20000, 20000) if rng.random() < 0.3 else None
        jp = jpeg_bytes(w, h, claim=claim)
        cw, ch = claim or (w, h)
        return forge(key, jp, h=ch, w=cw, enc="jpeg", label=hdr["label"]), True
    if kind == 8:  # raw pixels of another geometry, forged
        h, w, c = (int(x) for x in rng.integers(1, 40, 3))
        return forge(key, rng.bytes(h * w * c), h=h, w=w, c=c, enc="raw", label=hdr["label"]), True
    return rng.bytes(int(rng.integers(0, 300))), False  # kind 9: garbage


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
def test_fuzzed_records_never_raise_nor_lie(keyed: bool, monkeypatch) -> None:
    """Thousands of mutations of valid records: decode_record never raises; what it returns is either the
    original sample or (unkeyed forgeries only) a sample of the variant's geometry, RGB uint8; with a
    record key every mutation and every forgery is a miss; Pillow never loads more than the variant's
    pixels."""
    rk = RecordKey(b"fuzz-key-" * 5, "<test>") if keyed else None
    originals = _originals()
    if keyed:
        originals = [(v, px, encode_record(px, 7, v, key=K, record_key=rk), ref)
                     for v, px, _, ref in originals]
    loaded: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spy(self):  # type: ignore[no-untyped-def]
        loaded.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    rng = np.random.default_rng(2026 + keyed)
    stats = {"cases": 0, "none": 0, "original": 0, "forged_served": 0}
    for _ in range(3000):
        variant, _, rec, ref = originals[int(rng.integers(0, len(originals)))]
        bad, forged = _mutate(rng, rec, K)
        for v in (variant, None):
            got = decode_record(bad, K, v, record_key=rk)
            stats["cases"] += 1
            if got is None:
                stats["none"] += 1
                continue
            arr, label = got
            assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
            if bad == rec:
                assert label == 7 and np.array_equal(arr, ref)
                stats["original"] += 1
                continue
            assert forged and not keyed, "an unforged mutation (or any keyed one) was accepted"
            stats["forged_served"] += 1
            if v is not None:  # what an unkeyed reader may still be fed: at least the variant's geometry
                tw, th = target_size(arr.shape[1], arr.shape[0], v)
                assert (th, tw) == arr.shape[:2] and isinstance(label, int)
    # the variant's bound is 16 x 32 px; forged payloads are at most 39 x 39 px (readers without a variant
    # may decode those) or claim 20000 x 20000 (never decoded by anyone)
    assert loaded and all(w * h <= 39 * 39 for w, h in loaded), sorted(set(loaded))[-5:]
    assert stats["cases"] == 6000 and stats["none"] > 4000, stats
    if keyed:
        assert stats["forged_served"] == 0


@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
def test_decode_record_survives_memory_errors(keyed: bool, monkeypatch) -> None:
    """MemoryError (or any exception) inside the decode is a miss, not an exception in the training loop."""
    rk = RecordKey(b"m" * 40, "<test>") if keyed else None
    px = np.zeros((16, 20, 3), np.uint8)
    rec = encode_record(px, 1, VJ, key=K, record_key=rk)
    assert decode_record(rec, K, VJ, record_key=rk) is not None

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise MemoryError

    monkeypatch.setattr(Image.Image, "convert", boom)
    assert decode_record(rec, K, VJ, record_key=rk) is None
    def bomb(*a, **k):  # type: ignore[no-untyped-def]
        raise Image.DecompressionBombError("Image size (400000000 pixels) exceeds limit")

    monkeypatch.setattr(Image, "open", bomb)
    assert decode_record(rec, K, VJ, record_key=rk) is None


# ------------------------------------------------------------------------------------ through a real Redis
@needs_redis
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_forged_records_in_redis_are_misses_and_repaired(redis_url: str, redis_server,
                                                        imagefolder_factory) -> None:
    """Written with the trainers' credential into a real redis-server: the 1x1x1 record (served as a hit
    before) and the bomb record (raised DecompressionBombError before) are misses; the read serves the
    real sample and rewrites the record, and the next process reads it as a hit."""
    import redis

    from client.dataset import CachedImageNet

    root = imagefolder_factory(classes=2, per_class=2, size=(60, 45))
    ds = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file="")
    r = redis.Redis(port=redis_server.port)
    lab = [int(x) for x in ds.manifest.labels]
    r.set(ds.key(0), forge(ds.key(0), b"\x00", h=1, w=1, c=1, label=lab[0]))
    r.set(ds.key(1), forge(ds.key(1), jpeg_bytes(16, 16, claim=(20000, 20000)), h=20000, w=20000,
                           enc="jpeg", label=lab[1]))
    r.set(ds.key(2), forge(ds.key(2), b"\x07" * (16 * 21 * 3), h=16, w=21, c=3, label=lab[2] + 1))
    out = ds.__getitems__([0, 1, 2, 3])
    for i, (img, label) in enumerate(out):
        with open(f"{root}/{ds.manifest.paths[i]}", "rb") as f:
            ref = decode_image(f.read(), ds.variant)
        assert label == lab[i] and np.array_equal(img.permute(1, 2, 0).numpy(), ref), i
    st = ds.stats()
    assert st["t2"]["invalid_rewritten"] == 3 and st["decoded"] == 4, st
    assert ds.flush(30)
    for i in range(4):  # repaired: a valid record of the variant for its own key
        got = decode_record(r.get(ds.key(i)), ds.key(i), ds.variant)
        assert got is not None and got[1] == lab[i]
    ds2 = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file="")
    ds2.__getitems__([0, 1, 2, 3])
    assert ds2.stats()["decoded"] == 0 and ds2.stats()["hits"] == 4
