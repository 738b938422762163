"""datacache.heap: a fill's processes keep the memory they free between batches (glibc's M_TOP_PAD).

Measured, not assumed: minor page faults (the kernel's count, ``getrusage``) of a real LMDB writer and
of a decode worker's allocation pattern, batch after batch, in fresh interpreters with and without it."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from datacache.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    "musl" in (ctypes.util.find_library("c") or "") or not sys.platform.startswith("linux"),
    reason="glibc's mallopt is what is tuned; this libc has none")

PROBE = r"""
import json, os, resource, sys

from datacache.heap import keep_freed_heap
from datacache.stores import LMDBStore


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def lmdb_batches(path, batches=5, per=64, size=256 * 341 * 3):
    # what a fill's writer does per batch: receive the chunk's records (fresh bytes, as unpickled from
    # a worker), write them in one transaction (LMDB mallocs each value's overflow pages and frees them
    # at commit), drop them
    store = LMDBStore(path)
    out = []
    for b in range(batches):
        before = faults()
        values = [os.urandom(size) for _ in range(per)]
        assert store.put_many([(b"%d-%d" % (b, i), v) for i, v in enumerate(values)]) == per
        del values
        out.append(faults() - before)
    store.close()
    return out


def worker_chunks(chunks=5, per=32):
    # what a decode worker does per chunk: decode buffers, resized images, records, all freed after
    out = []
    for _ in range(chunks):
        before = faults()
        held = [bytearray(500 * 375 * 3) for _ in range(per)] + [bytearray(256 * 341 * 3) for _ in range(per)]
        del held
        out.append(faults() - before)
    return out


mode, path = sys.argv[1], sys.argv[2]
if mode == "kept":
    assert keep_freed_heap(env={}) == {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TOP_PAD_": 64 << 20}
if mode == "pad-only":  # what the pad does without the threshold: not enough (module docstring)
    assert keep_freed_heap(env={"MALLOC_MMAP_THRESHOLD_": "131072"}) == {"MALLOC_TOP_PAD_": 64 << 20}
if mode == "daemon-worker":
    from cache_daemon.heap import decode_worker_heap
    from datacache.decodepool import DecodePool

    pool = DecodePool(1, worker_setup=lambda: decode_worker_heap(env={}))  # fork: nothing pickled
    print(json.dumps({"worker": pool.get().apply(worker_chunks)}))
    pool.close(timeout=30)
else:
    print(json.dumps({"lmdb": lmdb_batches(path), "worker": worker_chunks()}))
"""


def _probe(mode: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = REPO
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(tmp_path / mode)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_memory_is_reused_batch_after_batch_not_faulted_in_again(tmp_path) -> None:
    plain, pad_only, kept = (_probe(m, tmp_path) for m in ("plain", "pad-only", "kept"))
    pages = 64 * (256 * 341 * 3) // 4096  # one batch's records, in 4 KiB pages (LMDB copies them too)
    # the reference: glibc as it is hands the memory back, so every batch faults it in again; so it
    # does with the pad alone (each block over 128 KiB mapped on its own)
    for ref in (plain, pad_only):
        assert min(ref["lmdb"][1:]) > pages and min(ref["worker"][1:]) > 0.5 * ref["worker"][0], ref
    # kept: the first batch faults the memory in, the later ones reuse it
    assert kept["lmdb"][0] > pages and max(kept["lmdb"][1:]) < 0.05 * pages, kept
    # (its first chunk may already reuse what the LMDB batches freed: compared with a chunk's own faults)
    assert max(kept["worker"][1:]) < 0.05 * plain["worker"][0], kept


def test_the_daemons_decode_workers_keep_it_too(tmp_path) -> None:
    (first, *later) = _probe("daemon-worker", tmp_path)["worker"]
    assert max(later) < 0.05 * first, (first, later)


def test_the_environment_wins_and_bad_sizes_are_refused() -> None:
    from datacache.heap import FILL_TOP_PAD, keep_freed_heap

    # (only the environment check runs here: this test process's allocator is left as it is)
    assert keep_freed_heap(env={"MALLOC_TOP_PAD_": "0", "MALLOC_MMAP_THRESHOLD_": "131072"}) == {}
    tunables = "glibc.malloc.arena_max=2:glibc.malloc.top_pad=0:glibc.malloc.mmap_threshold=131072"
    assert keep_freed_heap(env={"GLIBC_TUNABLES": tunables}) == {}
    assert keep_freed_heap(env={"DATACACHE_KEEP_FREED_HEAP": "0"}) == {}  # the opt-out
    with pytest.raises(ConfigError, match=r"DATACACHE_KEEP_FREED_HEAP='yes': valid values are 1 .* and 0"):
        keep_freed_heap(env={"DATACACHE_KEEP_FREED_HEAP": "yes"})
    from cache_daemon.heap import decode_worker_heap

    assert decode_worker_heap(env={"DATACACHE_KEEP_FREED_HEAP": "yes"}) is False  # never raises in a worker
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=r"nbytes must be in \[0, 2 GiB\)"):
            keep_freed_heap(bad, env={})
    assert 0 < FILL_TOP_PAD < 2**31


def test_datacache_warm_keeps_it_before_forking_its_pool(monkeypatch, small_imagefolder, tmp_path) -> None:
    """The CLI's fill asks for it before warm_cache forks its decode pool (the workers inherit it)."""
    from datacache import cli, heap, warm

    order: list[str] = []
    monkeypatch.setattr(heap, "keep_freed_heap", lambda *a, **k: order.append("kept") or {})
    real = warm.warm_cache
    monkeypatch.setattr(warm, "warm_cache", lambda *a, **k: order.append("fill") or real(*a, **k))
    assert cli.main(["warm", small_imagefolder, "--cache", f"lmdb://{tmp_path}/c", "--no-progress",
                     "--workers", "1"]) == 0
    assert order == ["kept", "fill"]


@pytest.mark.parametrize(("command", "code"), [(["-m", "datacache.cli", "warm", "/nowhere"], 1),  # user error
                                               (["-m", "cache_daemon", "--check"], 2)])  # config error
def test_a_bad_switch_stops_the_command_in_one_line(command: list[str], code: int, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
    env.update(PYTHONPATH=REPO, DATACACHE_KEEP_FREED_HEAP="yes", DATACACHE_DAEMON_CACHE=f"lmdb://{tmp_path}/c")
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == code and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "DATACACHE_KEEP_FREED_HEAP='yes': valid values are 1" in line, line
