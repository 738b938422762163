"""One definition of a variant's pixels: the record bytes under a key depend on (file bytes, variant) only.

The same small dataset is filled (a) in this process by a client (``CachedImageNet``) with torch imported,
(b) by a subprocess that never imports torch (the daemon's ingest path: ``fill_missing`` over a process
pool), (c) by a subprocess in which simplejpeg is hidden by a meta-path blocker -> identical record bytes
per key. Decoder families that cannot reproduce those bytes (DALI, pillow-simd) get their own keys.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from datacache.cacheurl import parse_cache_url
from datacache.config import DECODER_FAMILY_CHOICES, ConfigError, Variant
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.stores import open_store

CORPUS = os.path.join(os.path.dirname(__file__), "data", "pillow")
V = Variant(short_side=64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILL = r"""
import json, sys
if sys.argv[3] == "hide-simplejpeg":
    class _Hide:  # a meta-path blocker: simplejpeg is "not installed" in this process
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "simplejpeg":
                raise ImportError("simplejpeg hidden by the test")
            return None
    sys.meta_path.insert(0, _Hide())
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant
from datacache.decode import backend_name
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.warm import fill_missing
man = Manifest.build(sys.argv[1])
reader = ReadThrough(man, Variant(short_side=64), parse_cache_url("lmdb://" + sys.argv[2]), t1_dir=None)
rep = fill_missing(reader, range(len(man)), workers=2, progress=False)
assert "torch" not in sys.modules, "the fill path imported torch"
print(json.dumps({"written": rep.written, "backend": backend_name(), "sj": "simplejpeg" in sys.modules}))
"""


def _photo(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (7, 9, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    noisy = np.asarray(base).astype(np.int16) + rng.integers(-20, 21, (h, w, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("ident") / "train"
    a, b = root / "a", root / "b"
    a.mkdir(parents=True)
    b.mkdir()
    # sizes where libjpeg-turbo's M/8 scaling (300x225 -> 6/8) and Pillow's draft (1/1) disagree, a 1/2
    # draft (500x375), 4:4:4 and progressive streams, odd sides
    for i, (w, h, kw) in enumerate([(300, 225, {}), (500, 375, {}), (333, 251, {"subsampling": 0}),
                                    (420, 300, {"progressive": True}), (97, 131, {})]):
        _photo(w, h, i).save(a / f"p{i}.jpg", "JPEG", quality=90, **kw)
    for name in ("g4_orientation_6.tif", "hopper_orientation_6.jpg", "16bit.cropped.tif",
                 "pil_sample_cmyk.jpg", "flower.jpg", "hopper.png", "hopper_gray.jpg"):
        shutil.copy(os.path.join(CORPUS, name), b / name)
    return str(root)


def _records(root: str, lmdb_dir: str) -> dict[bytes, bytes]:
    reader = ReadThrough(Manifest.build(root), V, parse_cache_url("lmdb://" + lmdb_dir), t1_dir=None)
    keys = reader.keys(range(len(reader.manifest)))
    store = open_store(parse_cache_url("lmdb://" + lmdb_dir).tiers[-1])
    vals = store.get_many(keys)
    out = {k: bytes(v) for k, v in zip(keys, vals) if v is not None}
    store.close()
    return out


def _fill_subprocess(root: str, lmdb_dir: str, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("DATACACHE_DECODER", None)
    r = subprocess.run([sys.executable, "-c", FILL, root, lmdb_dir, mode], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_same_bytes_whoever_fills(dataset: str, tmp_path) -> None:
    import torch  # noqa: F401  (a client process: torch is loaded while it fills)

    from client.dataset import CachedImageNet
    from datacache.decode import backend_name

    assert backend_name().startswith("simplejpeg")  # the fast path is in play in (a) and (b)
    ds = CachedImageNet(dataset, cache=f"lmdb://{tmp_path}/a", variant=V, t1_dir=None)
    for i in range(len(ds)):
        ds[i]
    ds.flush()
    n = len(ds)
    b = _fill_subprocess(dataset, f"{tmp_path}/b", "plain")
    c = _fill_subprocess(dataset, f"{tmp_path}/c", "hide-simplejpeg")
    assert b["written"] == n and b["sj"] and b["backend"].startswith("simplejpeg")
    assert c["written"] == n and not c["sj"] and c["backend"].startswith("pillow")
    ra, rb, rc = (_records(dataset, f"{tmp_path}/{x}") for x in "abc")
    assert len(ra) == len(rb) == len(rc) == n
    for key in ra:
        assert ra[key] == rb[key] == rc[key], key


def test_torch_being_loaded_does_not_change_a_decode() -> None:
    """In-process check of the resize: the variant's pixels equal Pillow's resize of the same decode."""
    import torch  # noqa: F401

    from datacache.decode import decode_image

    buf = io.BytesIO()
    _photo(500, 375, 7).save(buf, "PNG")
    got = decode_image(buf.getvalue(), V)
    ref = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB").resize(
        (85, 64), Image.Resampling.BILINEAR, reducing_gap=3.0))
    assert np.array_equal(got, ref)


def test_decoder_family_is_in_the_tag_and_validated() -> None:
    assert Variant().decoder_family == "pil" and Variant().tag() == "s160m320bilinear-raw"
    tags = {Variant(decoder_family=f).tag() for f in DECODER_FAMILY_CHOICES}
    assert len(tags) == len(DECODER_FAMILY_CHOICES)
    assert Variant(decoder_family="dali").tag() == "s160m320bilinear-raw-dali"
    with pytest.raises(ConfigError, match="decoder_family='turbo' is not valid; choose one of pil, pil-simd"):
        Variant(decoder_family="turbo")


def test_fill_refuses_a_decoder_of_another_family() -> None:
    from datacache.fill import fill_one

    class Other:
        family = "dali"

        def __call__(self, data: bytes, variant: Variant, *, name: str = "") -> np.ndarray:
            return np.zeros((64, 85, 3), np.uint8)  # the 40x30 file at short side 64

    buf = io.BytesIO()
    _photo(40, 30, 1).save(buf, "PNG")
    kw = {"rel": "x.png", "size": len(buf.getvalue()), "label": 0, "key": b"dc:0:t:0"}
    with pytest.raises(ConfigError, match="holds 'pil' pixels but the decoder here makes 'dali'"):
        fill_one(buf.getvalue(), variant=V, decoder=Other(), **kw)
    with pytest.raises(ConfigError, match=r"holds 'dali' pixels but the decoder here makes 'pil'.*wait_warm"):
        fill_one(buf.getvalue(), variant=Variant(short_side=64, decoder_family="dali"), **kw)
    assert fill_one(buf.getvalue(), variant=Variant(short_side=64, decoder_family="dali"), decoder=Other(),
                    **kw).record is not None


def test_pillow_simd_is_its_own_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """pillow-simd replaces PIL, so it cannot be installed beside Pillow here: the installed flavour is
    simulated. Filling a ``pil`` variant with it is refused; ``pil-simd`` is its own key space."""
    from cache_daemon.decoders import variant_for
    from datacache import decode
    from datacache.fill import fill_one

    monkeypatch.setattr(decode, "_PILLOW", "pillow-simd-12.1.1.post0")
    assert decode.pil_family() == "pil-simd"
    assert variant_for(V, None).tag() == "s64m128bilinear-raw-pil-simd"  # what its daemon fills
    buf = io.BytesIO()
    _photo(40, 30, 2).save(buf, "PNG")
    kw = {"rel": "x.png", "size": len(buf.getvalue()), "label": 0, "key": b"dc:0:t:0"}
    with pytest.raises(ConfigError, match="makes 'pil-simd' pixels"):
        fill_one(buf.getvalue(), variant=V, **kw)
    assert fill_one(buf.getvalue(), variant=Variant(short_side=64, decoder_family="pil-simd"), **kw).record


def test_simplejpeg_is_not_used_when_its_self_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-process check passes here; if it ever fails (another libjpeg-turbo build), the
    backend is plain Pillow and decodes are unchanged."""
    from datacache import decode

    assert decode.simplejpeg_agrees() and decode.backend_name().startswith("simplejpeg")
    buf = io.BytesIO()
    _photo(300, 225, 5).save(buf, "JPEG", quality=90)
    fast = decode.decode_image(buf.getvalue(), V)
    monkeypatch.setattr(decode, "_SJ_CHECK", [False])
    assert decode.backend_name().startswith("pillow")
    assert np.array_equal(decode.decode_image(buf.getvalue(), V), fast)


def test_dali_fills_distinct_keys(dataset: str, tmp_path) -> None:
    """DALI's pixels are not Pillow's: the same dataset filled by DALI lands under other keys (the
    ``-dali`` tag), so a reader of the ``pil`` variant never sees them."""
    from cache_daemon.decoders import DaliDecoder, dali_available, variant_for
    from datacache.warm import fill_missing

    if dali_available() is not None:
        pytest.skip(str(dali_available()))
    man = Manifest.build(dataset)
    dali = DaliDecoder(device="cpu")
    dv = variant_for(V, dali)
    assert dv.decoder_family == "dali" and dv.tag() != V.tag()
    reader = ReadThrough(man, dv, parse_cache_url(f"lmdb://{tmp_path}/d"), t1_dir=None)
    rep = fill_missing(reader, range(len(man)), workers=1, decoder=dali, progress=False)
    assert rep.written == len(man)
    filled = _records(dataset, f"{tmp_path}/d")  # read as the pil variant: nothing there
    assert filled == {}
    keys = reader.keys(range(len(man)))
    assert all(v is not None for v in reader.store.get_many(keys))


@pytest.mark.parametrize("forced", ["", "pil"])
def test_a_truncated_jpeg_is_an_error_on_both_paths(forced: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """simplejpeg refuses what Pillow refuses (a cut stream): neither path turns it into pixels."""
    from datacache.decode import DecodeError, backend_name, decode_image

    monkeypatch.setenv("DATACACHE_DECODER", forced)
    assert backend_name().startswith("pillow" if forced else "simplejpeg")
    buf = io.BytesIO()
    _photo(400, 300, 9).save(buf, "JPEG", quality=90)
    for cut in (0.5, 0.99):
        with pytest.raises(DecodeError, match="truncated"):
            decode_image(buf.getvalue()[: int(len(buf.getvalue()) * cut)], V, name="cut.jpg")
