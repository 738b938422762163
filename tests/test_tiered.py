"""TieredStore: nearest-first reads, promotion, write-back to every tier through a bounded queue."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from datacache.cacheurl import parse_cache_url
from datacache.stores import LMDBStore, MemoryStore, open_store
from datacache.tiered import TieredStore
from tests.redis_utils import cli, needs_redis


def items(n: int, start: int = 0) -> list[tuple[bytes, bytes]]:
    return [(b"dc:k:%d" % i, b"v%d" % i * 100) for i in range(start, start + n)]


def test_reads_nearest_first_and_promote_hits(tmp_path) -> None:
    near, far = LMDBStore(str(tmp_path / "near")), MemoryStore("memory://far")
    t = TieredStore([near, far])
    far.put_many(items(10))
    near.put_many(items(3))
    got = t.get_many([k for k, _ in items(12)])
    assert got[:10] == [v for _, v in items(10)] and got[10:] == [None, None]
    c = t.counters()
    assert (c["tier0_hits"], c["tier0_misses"], c["tier1_hits"], c["tier1_misses"]) == (3, 9, 7, 2)
    assert c["tier1_promoted"] == 7 and near.contains([k for k, _ in items(10)]) == [True] * 10
    assert c["tier1_bytes"] == sum(len(v) for _, v in items(10)[3:])
    t.get_many([k for k, _ in items(10)])  # now all local
    assert t.counters()["tier0_hits"] == 13
    st = t.stats()
    assert [x["backend"] for x in st["tiers"]] == ["lmdb", "memory"] and st["tiers"][1]["hit_ratio"] == 7 / 9
    assert t.health()["ok"] and t.contains([b"dc:k:11", b"dc:k:2"]) == [False, True]


def test_fills_go_to_every_writable_tier(tmp_path) -> None:
    ro = MemoryStore("memory://ro", readonly=True)
    a, b = MemoryStore("memory://a"), LMDBStore(str(tmp_path / "b"))
    t = TieredStore([a, ro, b])
    assert t.put_many(items(5)) == 5
    assert a.contains([b"dc:k:4"]) == [True] and b.contains([b"dc:k:4"]) == [True]
    assert ro.contains([b"dc:k:4"]) == [False] and ro.counters()["write_errors"] == 0  # skipped, not failed


def test_chained_url_opens_a_tiered_store(tmp_path) -> None:
    spec = parse_cache_url(f"lmdb://{tmp_path}/l::memory://m")
    s = open_store(spec)
    assert isinstance(s, TieredStore) and [t.backend for t in s.tiers] == ["lmdb", "memory"]
    assert s.url == f"lmdb://{tmp_path}/l::memory://m"


@needs_redis
def test_slow_remote_never_stalls_and_full_queue_drops(tmp_path, redis_server, redis_url: str) -> None:
    local = LMDBStore(str(tmp_path / "local"))
    remote = open_store(redis_url + "&socket_timeout=10")
    t = TieredStore([local, remote], queue_batches=2)
    # a really slow Redis: every client is paused for 1.5 s (real server-side pause, no mock)
    assert cli(redis_server.port, "client", "pause", "1500", "all") == "OK"
    t0 = time.monotonic()
    written = [t.put_many(items(10, 10 * b)) for b in range(6)]
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, elapsed  # returned while Redis was paused: the batch never waited on it
    assert written == [10] * 6  # the local tier took everything
    c = t.counters()
    assert c["writeback_dropped"] >= 20 and c["writeback_queued"] + c["writeback_dropped"] == 60
    assert t.flush(timeout=10)
    got = remote.get_many([k for k, _ in items(60)])
    assert sum(g is not None for g in got) == t.counters()["writeback_queued"]  # queued = written
    assert t.stats()["writeback"]["dropped"] == c["writeback_dropped"]


@needs_redis
def test_queued_writes_are_flushed_when_a_process_exits(tmp_path, redis_url: str) -> None:
    code = f"""
from datacache.stores import open_store
t = open_store("memory://a::{redis_url}")
t.put_many([(b"dc:exit:%d" % i, b"x" * 1000) for i in range(200)])
"""  # no flush, no close: the exit hook writes what is queued
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    remote = open_store(redis_url)
    assert all(v == b"x" * 1000 for v in remote.get_many([b"dc:exit:%d" % i for i in range(200)]))


def test_writer_thread_does_not_cross_fork(tmp_path) -> None:
    import os

    t = TieredStore([MemoryStore("memory://a"), MemoryStore("memory://b")])
    t.put_many(items(3))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: its own (empty) queue and counters, still works
        try:
            ok = t.put_many(items(2, 100)) == 2 and t.counters()["puts"] == 2 and t.flush(1)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    assert threading.active_count() >= 1 and t.counters()["puts"] == 3


@pytest.mark.parametrize("n", [1, 3])
def test_tier_counters_reach_cached_imagenet_stats(small_imagefolder: str, tmp_path, n: int) -> None:
    from client.dataset import CachedImageNet

    url = "::".join([f"lmdb://{tmp_path}/l{i}" for i in range(n)])
    ds = CachedImageNet(small_imagefolder, cache=url, short_side=32, t1_dir=None)
    ds.__getitems__(list(range(8)))
    ds.__getitems__(list(range(8)))
    st = ds.stats()
    assert [t["url"] for t in st["tiers"]] == [f"lmdb://{tmp_path}/l{i}" for i in range(n)]
    assert st["tiers"][0]["hits"] == 8 and st["tiers"][0]["misses"] == 8 and st["decoded"] == 8
    if n == 3:  # filled into every tier; the nearest answered the second time
        assert st["tiers"][1]["misses"] == 8 and st["tiers"][2]["misses"] == 8
        assert all(open_store(f"lmdb://{tmp_path}/l{i}").stats()["entries"] >= 8 for i in range(3))
