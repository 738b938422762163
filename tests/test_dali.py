"""The DALI decode backend: its own decoder family (keys distinct from Pillow's), same record shape,
pixels within a tolerance of Pillow's.

Skipped only when ``nvidia-dali-cuda120`` (the ``[dali]`` extra, not in CI's default extras) is not
installed; the GPU ``mixed`` decoder test is skipped when there is no GPU.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from cache_daemon.decoders import DaliDecoder, dali_available, gpu_available
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant
from datacache.decode import decode_image
from datacache.devtools import synth
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.record import decode_record
from datacache.stores import open_store
from datacache.warm import fill_missing

pytestmark = pytest.mark.skipif(dali_available() is not None, reason=str(dali_available()))


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("dali") / "train")
    synth.make_imagefolder(root, classes=2, per_class=6, size=(500, 375), include_real_photos=True, seed=3)
    return root


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _compare(root: str, dec: DaliDecoder) -> None:
    files = sorted(f for f in glob.glob(os.path.join(root, "*", "*")) if os.path.isfile(f))
    datas = [open(f, "rb").read() for f in files]  # noqa: SIM115
    v = Variant(short_side=160)
    dec.prepare(datas, v)
    via_dali = sum(id(d) in dec._ready for d in datas)
    assert via_dali >= len([f for f in files if f.lower().endswith((".jpeg", ".jpg"))]) - 1
    for f, data in zip(files, datas):
        a, b = dec(data, v, name=f), decode_image(data, v, name=f)
        assert a.shape == b.shape and a.dtype == np.uint8, f  # same variant -> same record shape
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 4.0 and psnr(a, b) > 28.0, (f, psnr(a, b))


def test_dali_cpu_pixels_match_pillow_within_tolerance(photos: str) -> None:
    _compare(photos, DaliDecoder(device="cpu"))


@pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU on this machine: DALI's mixed (nvJPEG) decoder "
                                                "needs one")
def test_dali_gpu_mixed_decoder_matches_pillow(photos: str) -> None:
    _compare(photos, DaliDecoder(device="gpu"))


def test_ingest_with_dali_fills_its_own_family_keys(photos: str, tmp_path) -> None:
    """DALI fills the ``dali`` family (distinct keys); asking it to fill a ``pil`` variant is refused."""
    from cache_daemon.decoders import variant_for
    from datacache.config import ConfigError

    man = Manifest.build(photos)
    v = Variant(short_side=96)
    out, tags = {}, {}
    dali = DaliDecoder(device="cpu")
    assert dali.family == "dali" and variant_for(v, dali).tag() == "s96m192bilinear-raw-dali"
    with open(os.path.join(photos, man.paths[0]), "rb") as f:
        dali.prepare([f.read()], v)  # used in the parent before the pool forks: never reuse its pipeline
    for name, decoder in (("pillow", None), ("dali", dali)):
        vv = variant_for(v, decoder)
        reader = ReadThrough(man, vv, parse_cache_url(f"lmdb://{tmp_path}/{name}"), t1_dir=None)
        rep = fill_missing(reader, range(len(man)), workers=2, decoder=decoder, progress=False)
        assert rep.written == len(man) and not rep.quarantined
        keys = reader.keys(range(len(man)))
        tags[name] = keys
        out[name] = [decode_record(b, k) for b, k in zip(reader.store.get_many(keys), keys)]
    assert not set(tags["pillow"]) & set(tags["dali"])
    for (pa, la), (pb, lb) in zip(out["pillow"], out["dali"]):
        assert la == lb and pa.shape == pb.shape and psnr(pa, pb) > 28.0
    wrong = ReadThrough(man, v, parse_cache_url(f"lmdb://{tmp_path}/wrong"), t1_dir=None)
    with pytest.raises(ConfigError, match="'pil' pixels but the decoder here makes 'dali'"):
        wrong.fill_many([0], [b"x"], decoder=dali)


def test_a_chunk_with_a_corrupt_jpeg_does_not_change_its_neighbours(photos: str) -> None:
    """A file's DALI pixels do not depend on the files in its chunk: a batch that DALI refuses (one
    corrupt JPEG) is decoded file by file, giving the same bytes as a clean batch."""
    files = sorted(f for f in glob.glob(os.path.join(photos, "*", "*"))
                   if f.lower().endswith((".jpeg", ".jpg")))
    datas = [open(f, "rb").read() for f in files[:4]]  # noqa: SIM115
    v = Variant(short_side=64, decoder_family="dali")
    dec = DaliDecoder(device="cpu")
    dec.prepare(datas, v)
    clean = [dec(d, v) for d in datas]
    bad = datas[0][:600] + b"\xff\xd9"  # a JPEG header whose scan is cut short: DALI refuses the batch
    dec.prepare([bad, *datas], v)
    assert sum(id(d) in dec._ready for d in datas) == len(datas)
    for d, want in zip(datas, clean):
        assert np.array_equal(dec(d, v), want)


def test_daemon_pass_with_dali_fills_and_reports_the_dali_tag(photos: str, tmp_path) -> None:
    """The daemon's ``decoder = "dali"`` fills the ``-dali`` keys and reports that tag in /status; a
    client asking for ``decoder_family="dali"`` reads them, one asking for ``pil`` does not."""
    import threading

    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.ingest import DatasetState, ingest_pass

    cache = f"lmdb://{tmp_path}/lmdb"
    cfg = DaemonConfig(cache=cache, node="n0", workers=1, t1_dir="none", ownership="all")
    store = open_store(parse_cache_url(cache).tiers[-1])
    state = DatasetState(DatasetSpec(photos, short_side=48))
    try:
        rep = ingest_pass(cfg, state, store, decoder=DaliDecoder(device="cpu"), stop=threading.Event(),
                          progress=False)
        assert state.status == "full" and not state.error, state.error
        assert rep is not None and rep.written == state.total > 0
        assert state.as_json()["variant"] == "s48m96bilinear-raw-dali"
    finally:
        store.close()
    man = Manifest.build(photos)
    for family, present in (("dali", True), ("pil", False)):
        reader = ReadThrough(man, Variant(short_side=48, decoder_family=family), parse_cache_url(cache),
                             t1_dir=None)
        keys = reader.keys(range(len(man)))
        got = reader.store.get_many(keys)
        assert all((g is not None) == present for g in got), family


def test_an_unprepared_call_gives_the_same_bytes_as_a_prepared_chunk(photos: str) -> None:
    """``fill_one`` may call the decoder without ``prepare`` (a single sample): a plain JPEG is still
    decoded by DALI, so the ``dali`` family's bytes do not depend on how the caller batched."""
    files = sorted(f for f in glob.glob(os.path.join(photos, "*", "*"))
                   if f.lower().endswith((".jpeg", ".jpg")))[:3]
    datas = [open(f, "rb").read() for f in files]  # noqa: SIM115
    v = Variant(short_side=64, decoder_family="dali")
    dec = DaliDecoder(device="cpu")
    dec.prepare(datas, v)
    batched = [dec(d, v) for d in datas]
    alone = [DaliDecoder(device="cpu")(bytes(d), v) for d in datas]
    for a, b, d in zip(batched, alone, datas):
        assert np.array_equal(a, b)
        assert not np.array_equal(a, decode_image(d, Variant(short_side=64)))  # DALI's, not Pillow's
