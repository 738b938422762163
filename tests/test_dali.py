"""The DALI decode backend: same variant, same record shape, pixels within a tolerance of Pillow's.

Skipped only when ``nvidia-dali-cuda120`` (the ``[dali]`` extra, not in CI's default extras) is not
installed; the GPU ``mixed`` decoder test is skipped when there is no GPU.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from cache_daemon.decoders import DaliDecoder, dali_available, gpu_available
from datacache import synth
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant
from datacache.decode import decode_image
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.record import decode_record
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


def test_ingest_with_dali_writes_the_same_records_as_pillow(photos: str, tmp_path) -> None:
    man = Manifest.build(photos)
    v = Variant(short_side=96)
    out = {}
    dali = DaliDecoder(device="cpu")
    with open(os.path.join(photos, man.paths[0]), "rb") as f:
        dali.prepare([f.read()], v)  # used in the parent before the pool forks: never reuse its pipeline
    for name, decoder in (("pillow", None), ("dali", dali)):
        reader = ReadThrough(man, v, parse_cache_url(f"lmdb://{tmp_path}/{name}"), t1_dir=None)
        rep = fill_missing(reader, range(len(man)), workers=2, decoder=decoder, progress=False)
        assert rep.written == len(man) and not rep.quarantined
        keys = reader.keys(range(len(man)))
        out[name] = [decode_record(b, k) for b, k in zip(reader.store.get_many(keys), keys)]
    for (pa, la), (pb, lb) in zip(out["pillow"], out["dali"]):
        assert la == lb and pa.shape == pb.shape and psnr(pa, pb) > 28.0
