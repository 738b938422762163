"""The daemon's DALI GPU fill is what its key says (issue 23, item 1), tested with a stand-in DALI
(``tests/fake_dali``: records each pipeline's kwargs, fails on demand, flips the pixels' lowest bit so
its pixels differ from Pillow's) and a stand-in NVML device list:

* the family is settled in the daemon's parent through NVML -- CUDA is never initialised there
  (``torch.cuda.is_available`` never called, torch never imported), so forked workers can use CUDA;
* GPU workers are capped and spread over the visible GPUs (``CUDA_VISIBLE_DEVICES`` rules);
* a worker whose GPU pipeline cannot be built, or stops working, leaves its plain JPEGs unfilled
  (counted, shown in ``/status``, logged, retried) -- never Pillow's pixels under a ``dali-gpu`` key;
* a file DALI refuses while its pipeline works goes to Pillow, as the family's rule says (counted).
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from cache_daemon import gpu_probe
from cache_daemon.gpu_probe import GpuProbe, probe_gpus, visible_ordinals
from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError, Variant
from datacache.decode import decode_image
from datacache.decodepool import DecodePool
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.record import decode_record
from datacache.warm import fill_missing, missing_in

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(REPO, "tests", "fake_dali")
UUIDS = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333", "GPU-cccc4444"]


@pytest.fixture
def fake_dali(monkeypatch: pytest.MonkeyPatch, tmp_path) -> str:
    """The stand-in DALI importable (here and in forked workers), in place of an installed DALI (CI has
    one: its modules are taken out of ``sys.modules`` and put back by monkeypatch afterwards); returns
    its log file."""
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(FAKE)
    log = str(tmp_path / "dali.log")
    monkeypatch.setenv("FAKE_DALI_LOG", log)
    for var in ("FAKE_DALI_FAIL_BUILD", "FAKE_DALI_FAIL_RUN_AFTER"):
        monkeypatch.delenv(var, raising=False)
    import nvidia.dali

    assert nvidia.dali.__file__.startswith(FAKE), nvidia.dali.__file__  # the stand-in, not a real DALI
    yield log
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        del sys.modules[name]  # the stand-in's; monkeypatch then restores what was imported before


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML lists four GPUs; CUDA_VISIBLE_DEVICES leaves the last two (ordinals 0 and 1)."""
    monkeypatch.setattr(gpu_probe, "nvml_devices", lambda: list(UUIDS))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")


def events(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f]


def jpeg(rgb: tuple[int, int, int], size: tuple[int, int] = (96, 72), comment: bytes = b"") -> bytes:
    rng = np.random.default_rng(sum(rgb))
    px = np.clip(np.array(rgb, dtype=np.int16) + rng.integers(-40, 40, (size[1], size[0], 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(px.astype(np.uint8)).save(buf, format="JPEG", quality=90, comment=comment)
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path) -> str:
    """40 plain JPEGs and one PNG (never a DALI file: Pillow's by the family's rule) in 2 classes."""
    root = tmp_path / "train"
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(20):
            (root / f"c{c}" / f"{i:03d}.JPEG").write_bytes(jpeg((40 + 90 * c, 30 + 5 * i, 120)))
    buf = io.BytesIO()
    Image.new("RGB", (90, 70), (10, 200, 30)).save(buf, format="PNG")
    (root / "c1" / "zz.png").write_bytes(buf.getvalue())
    return str(root)


def fake_pixels(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """What the stand-in DALI makes of ``data`` at the record's size (its own definition, re-stated)."""
    img = Image.open(io.BytesIO(data)).convert("RGB").resize((shape[1], shape[0]), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8) ^ 1


def fill(root: str, cache: str, decoder, workers: int = 1):  # type: ignore[no-untyped-def]
    from cache_daemon.decoders import variant_for

    variant = variant_for(Variant(short_side=48), decoder)
    reader = ReadThrough(Manifest.build(root), variant, parse_cache_url(cache), t1_dir=None)
    rep = fill_missing(reader, range(len(reader.manifest)), workers=workers, decoder=decoder, progress=False)
    return reader, rep


def records(reader: ReadThrough) -> dict[str, np.ndarray | None]:
    man = reader.manifest
    keys = reader.keys(range(len(man)))
    out = {}
    for i, (k, v) in enumerate(zip(keys, reader.store.get_many(keys))):
        got = decode_record(v, k, reader.variant) if v is not None else None
        out[man.paths[i]] = None if got is None else np.asarray(got[0])
    return out


# ---------------------------------------------------------------- the probe


def test_visible_ordinals_follow_cuda_visible_devices_rules() -> None:
    assert visible_ordinals(UUIDS, None) == (0, 1, 2, 3)
    assert visible_ordinals(UUIDS, "3,1") == (0, 1)
    assert visible_ordinals(UUIDS, "") == () and visible_ordinals(UUIDS, "-1") == ()
    assert visible_ordinals(UUIDS, "0,7,1") == (0,)  # CUDA stops at the first entry naming no device
    assert visible_ordinals(UUIDS, "1,1,2") == (0,)  # a device named twice ends the list too
    assert visible_ordinals(UUIDS, "GPU-bbbb,0") == (0, 1)  # a unique UUID prefix names a device
    assert visible_ordinals(UUIDS, "GPU-cccc") == ()  # an ambiguous prefix names none
    assert visible_ordinals(UUIDS, " 2 , 0 ") == (0, 1)


def test_probe_says_why_there_is_no_gpu() -> None:
    def missing() -> list[str]:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    p = probe_gpus(missing, environ={})
    assert not p and "NVML" in p.reason and "cannot open" in p.reason
    assert probe_gpus(lambda: [], environ={}) == GpuProbe(reason="NVML lists no GPU on this machine")
    hidden = probe_gpus(lambda: list(UUIDS), environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert not hidden and "hides all 4 GPUs" in hidden.reason
    assert probe_gpus(lambda: list(UUIDS), environ={"CUDA_VISIBLE_DEVICES": "1"}).ordinals == (0,)
    if not os.path.exists("/dev/nvidiactl"):  # this machine: the real NVML probe answers, never raises
        assert not probe_gpus() and probe_gpus().reason


PARENT = r"""
import json, os, sys
sys.path.insert(0, {fake!r})
import nvidia.dali
assert nvidia.dali.__file__.startswith({fake!r}), nvidia.dali.__file__
record = {record!r}
if {with_torch}:
    import torch
    def is_available():
        with open(record, "a") as f:
            f.write(f"is_available in pid {{os.getpid()}}\n")
        return False
    torch.cuda.is_available = is_available
from cache_daemon import gpu_probe
gpu_probe.nvml_devices = lambda: ["GPU-0", "GPU-1"]
from cache_daemon.decoders import gpu_available, make_decoder, variant_for
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant
from datacache.decodepool import DecodePool
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.warm import fill_missing
assert gpu_available()
dec, size = make_decoder("dali", "auto", cores=4)
reader = ReadThrough(Manifest.build({root!r}), variant_for(Variant(short_side=48), dec),
                     parse_cache_url("lmdb://" + {cache!r}), t1_dir=None)
pool = DecodePool(size)
rep = fill_missing(reader, range(len(reader.manifest)), decoder=dec, pool=pool, progress=False)
pool.close(10.0)
print(json.dumps({{"family": dec.family, "size": size, "threads": dec.threads, "written": rep.written,
                   "torch": "torch" in sys.modules}}))
"""


@pytest.mark.parametrize("with_torch", [False, True], ids=["no-torch", "torch-loaded"])
def test_the_daemon_parent_never_initialises_cuda(folder: str, tmp_path, with_torch: bool) -> None:
    """The family (``dali-gpu``) is settled through NVML; ``torch.cuda.is_available`` (cuInit: a forked
    worker could never use CUDA again) is called in no process, and torch is never imported for it."""
    record = str(tmp_path / "is_available.txt")
    code = PARENT.format(fake=FAKE, record=record, with_torch=with_torch, root=folder,
                         cache=str(tmp_path / "c"))
    env = {**os.environ, "PYTHONPATH": REPO, "FAKE_DALI_LOG": str(tmp_path / "dali.log")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"family": "dali-gpu", "size": 2, "threads": 2, "written": 41, "torch": with_torch}
    assert not os.path.exists(record), open(record).read()  # noqa: SIM115
    builds = [e for e in events(str(tmp_path / "dali.log")) if e["event"] == "build"]
    assert builds and all(e["ok"] and e["device"] == "mixed" for e in builds)


# ---------------------------------------------------------------- sizing and devices


def test_gpu_decode_workers_capped_and_threads_fill_the_cores(fake_dali: str, two_gpus: None) -> None:
    from cache_daemon.decoders import make_decoder

    dec, size = make_decoder("dali", "auto", workers=0, cores=16)
    assert (dec.family, dec.gpus, size, dec.threads) == ("dali-gpu", (0, 1), 2, 8)
    dec, size = make_decoder("dali", "auto", workers=0, gpu_decode_workers=3, cores=16)
    assert (size, dec.threads) == (3, 5)
    dec, size = make_decoder("dali", "auto", workers=1, cores=16)  # the configured workers still cap it
    assert (size, dec.threads) == (1, 16)
    dec, size = make_decoder("dali", "cpu", workers=0, cores=16)  # CPU DALI: one process per core
    assert (dec.family, size, dec.threads) == ("dali", 16, 1)
    assert make_decoder("pillow", workers=0, cores=6) == (None, 6)


def test_device_gpu_without_a_gpu_is_a_config_error(fake_dali: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cache_daemon.decoders import DaliDecoder, make_decoder

    monkeypatch.setattr(gpu_probe, "nvml_devices", lambda: [])
    with pytest.raises(ConfigError) as ei:
        make_decoder("dali", "gpu")
    assert "NVML lists no GPU" in str(ei.value) and '"cpu"' in str(ei.value)
    assert DaliDecoder(device="auto").family == "dali"  # auto without a GPU: the CPU family


def _slot_and_device(dec) -> tuple[int, int | None]:  # type: ignore[no-untyped-def]
    from cache_daemon.decoders import _worker_slot

    return _worker_slot(), dec.device_id


def test_each_pool_worker_decodes_on_its_own_gpu(fake_dali: str, two_gpus: None) -> None:
    from cache_daemon.decoders import DaliDecoder

    dec = DaliDecoder(device="auto")
    assert dec.family == "dali-gpu" and dec.device_id == 0  # the parent (slot 0)
    workers = DecodePool(2)  # the daemon's own pool (fork, workers ignore SIGTERM, bounded close)
    try:
        pool = workers.get()
        # worker numbers count every process this one started, so they are consecutive, not 0-based
        slots = [p._identity[-1] - 1 for p in pool._pool]
        got = set(pool.map(_slot_and_device, [dec] * 30, chunksize=1))
    finally:
        workers.close(timeout=10)
    assert {s % 2 for s in slots} == {0, 1}  # a pool of 2 spans both GPUs
    assert got and all(slot in slots and dev == (0, 1)[slot % 2] for slot, dev in got)


def test_gpu_fill_writes_dali_pixels_on_the_chosen_devices(fake_dali: str, two_gpus: None, folder: str,
                                                           tmp_path) -> None:
    from cache_daemon.decoders import make_decoder

    dec, size = make_decoder("dali", "auto", cores=4)
    reader, rep = fill(folder, f"lmdb://{tmp_path}/c", dec, workers=size)
    assert rep.written == 41 and rep.decoder_unavailable == 0 and rep.pillow_fallbacks == 0
    assert reader.variant.decoder_family == "dali-gpu"
    for rel, px in records(reader).items():
        data = open(os.path.join(folder, rel), "rb").read()  # noqa: SIM115
        want = decode_image(data, reader.variant) if rel.endswith(".png") else fake_pixels(data, px.shape)
        assert np.array_equal(px, want), rel
    builds = [e for e in events(fake_dali) if e["event"] == "build"]
    assert builds and {e["device_id"] for e in builds} <= {0, 1}
    assert all(e["num_threads"] == 2 and e["device"] == "mixed" for e in builds)
    assert len({e["pid"] for e in builds}) == len(builds)  # one pipeline per worker process


# ---------------------------------------------------------------- failures


def test_unbuildable_gpu_pipeline_never_writes_pillow_pixels(fake_dali: str, two_gpus: None, folder: str,
                                                             tmp_path, monkeypatch) -> None:
    from cache_daemon.decoders import make_decoder

    monkeypatch.setenv("FAKE_DALI_FAIL_BUILD", "mixed")
    dec, _ = make_decoder("dali", "auto", cores=2)
    reader, rep = fill(folder, f"lmdb://{tmp_path}/c", dec, workers=1)
    got = records(reader)
    assert [rel for rel, px in got.items() if px is not None] == ["c1/zz.png"]  # Pillow's file only
    assert rep.decoder_unavailable == 40 and rep.written == 1
    reasons = {r for rel, r in rep.quarantined.items() if rel.endswith(".JPEG")}
    assert len(reasons) == 1 and next(iter(reasons)).startswith("decoder unavailable: DALI (dali-gpu)")
    assert len(missing_in(reader, reader.store, range(41))) == 40  # not remembered as bad: retried
    builds = [e for e in events(fake_dali) if e["event"] == "build"]
    assert len(builds) == 1 and not builds[0]["ok"]  # one failed build per worker, not two per sample
    assert "could not build its pipeline on GPU" in next(iter(reasons))  # the worker logged the error
    monkeypatch.delenv("FAKE_DALI_FAIL_BUILD")  # the GPU works again: the next fill completes the family
    reader, rep = fill(folder, f"lmdb://{tmp_path}/c", dec, workers=1)
    assert rep.written == 40 and all(px is not None for px in records(reader).values())


def test_pipeline_that_stops_working_is_not_replaced_by_pillow(fake_dali: str, two_gpus: None, folder: str,
                                                               tmp_path, monkeypatch) -> None:
    """The first chunk's run works, then every run fails (a lost device): the failed batch is retried file
    by file, the known-good JPEG fails too, so the pipeline is at fault -- nothing after the first chunk
    is written, and what was written is DALI's."""
    from cache_daemon.decoders import make_decoder

    monkeypatch.setenv("FAKE_DALI_FAIL_RUN_AFTER", "1")
    dec, _ = make_decoder("dali", "auto", cores=2)
    reader, rep = fill(folder, f"lmdb://{tmp_path}/c", dec, workers=1)
    written = {rel: px for rel, px in records(reader).items() if px is not None}
    assert rep.written == len(written) == 17 and rep.decoder_unavailable == 24 and rep.pillow_fallbacks == 0
    for rel, px in written.items():
        data = open(os.path.join(folder, rel), "rb").read()  # noqa: SIM115
        if not rel.endswith(".png"):
            assert np.array_equal(px, fake_pixels(data, px.shape)), rel


def test_a_file_dali_refuses_goes_to_pillow_and_is_counted(fake_dali: str, two_gpus: None, folder: str,
                                                           tmp_path) -> None:
    from cache_daemon.decoders import make_decoder

    odd = os.path.join(folder, "c0", "005.JPEG")
    with open(odd, "wb") as f:
        f.write(jpeg((200, 10, 10), comment=b"dali-refuses"))
    dec, _ = make_decoder("dali", "auto", cores=2)
    reader, rep = fill(folder, f"lmdb://{tmp_path}/c", dec, workers=1)
    assert rep.written == 41 and rep.pillow_fallbacks == 1 and rep.decoder_unavailable == 0
    px = records(reader)["c0/005.JPEG"]
    assert np.array_equal(px, decode_image(open(odd, "rb").read(), reader.variant))  # noqa: SIM115
    refused = [e["batch"] for e in events(fake_dali) if e["event"] == "refused"]
    assert sorted(refused) == [1, 16]  # in its chunk's batch, then alone: never a third time


def test_device_gpu_with_no_gpu_given_is_refused(fake_dali: str) -> None:
    from cache_daemon.decoders import DaliDecoder

    with pytest.raises(ConfigError, match="no GPU given"):
        _ = DaliDecoder(device="gpu", gpus=()).family


def test_daemon_status_and_log_show_unfilled_samples(fake_dali: str, two_gpus: None, folder: str, tmp_path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.decoders import make_decoder
    from cache_daemon.ingest import DatasetState, ingest_pass
    from datacache.stores import open_store

    monkeypatch.setenv("FAKE_DALI_FAIL_BUILD", "mixed")
    cfg = DaemonConfig(cache=f"lmdb://{tmp_path}/c", node="n0", workers=1, t1_dir="none", decoder="dali")
    dec, size = make_decoder(cfg.decoder, cfg.decoder_device, workers=cfg.workers)
    store = open_store(parse_cache_url(cfg.cache).tiers[-1])
    state = DatasetState(DatasetSpec(folder, short_side=48))
    pool = DecodePool(size)
    try:
        with caplog.at_level(logging.INFO):
            ingest_pass(cfg, state, store, decoder=dec, stop=threading.Event(), progress=False, pool=pool)
        st = state.as_json()
        assert st["decoder"] == {"pillow_fallbacks": 0, "unavailable": 40}
        assert st["status"] == "filling" and st["done"] == 1 and st["variant"].endswith("-dali-gpu")
        assert "40 samples left unfilled this pass: the dali-gpu decoder could not run" in caplog.text
    finally:
        pool.close(5.0)
        store.close()


def test_config_keys_for_the_decoder_device() -> None:
    from cache_daemon.daemon_config import DaemonConfig

    with pytest.raises(ConfigError) as ei:
        DaemonConfig(cache="lmdb:///tmp/x", decoder="dali", decoder_device="cuda")
    assert "decoder_device" in str(ei.value) and "auto, cpu, gpu" in str(ei.value)
    with pytest.raises(ConfigError, match="gpu_decode_workers"):
        DaemonConfig(cache="lmdb:///tmp/x", gpu_decode_workers=-1)
