"""The daemon's idle pass: ownership without building keys, and no per-key check when nothing was removed.

References are the servers themselves: ``CLUSTER KEYSLOT`` and ``CLUSTER SLOTS`` for ownership,
``INFO commandstats`` (how many ``EXISTS`` the server executed) for "no per-key check", and ``EXISTS``
of every owned key for "the dataset is full again" after each fault.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest

from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
from cache_daemon.ingest import DatasetState, ingest_pass
from datacache.config import ConfigError
from datacache.stores import open_store
from tests.redis_utils import cli, needs_redis, slot_owners

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHORT = 16


def exists_calls(port: int) -> int:
    """``EXISTS`` commands the server has executed (its own count)."""
    import redis

    stat = redis.Redis(port=port).info("commandstats").get("cmdstat_exists", {})
    return int(stat.get("calls", 0))


class Node:
    """One daemon's passes in this process (real store, real cluster), with what each pass did."""

    def __init__(self, url: str, root: str, redis_node: str, **kw: object) -> None:
        from datacache.cacheurl import parse_cache_url

        self.cfg = DaemonConfig(cache=url, node="n0", redis_node=redis_node, ownership="cluster", workers=1,
                                t1_dir="none", **kw)  # type: ignore[arg-type]
        self.store = open_store(parse_cache_url(url).tiers[-1])
        self.state = DatasetState(DatasetSpec(root, short_side=SHORT))

    def run(self):
        rep = ingest_pass(self.cfg, self.state, self.store, decoder=None, stop=threading.Event(),
                          progress=False)
        assert self.state.status == "full" and not self.state.error, self.state.error
        return rep

    def owned_keys(self) -> list[bytes]:
        from datacache.keys import sample_key

        return [sample_key(self.state.fingerprint, self.state.variant_tag, int(i))
                for i in self.state.memo.owned.indices]  # type: ignore[union-attr]

    def all_present(self, port: int) -> bool:
        import redis

        r = redis.Redis(port=port)
        return all(r.exists(k) for k in self.owned_keys())


# ------------------------------------------------------------------ slots from indices
def test_index_key_slots_equal_redis_py_key_slot() -> None:
    from redis.crc import key_slot

    from datacache.stores.redis_cluster import index_key_slots

    prefix = b"dc:0123456789abcdef:s32m64bilinear-raw:"
    rng = np.random.default_rng(0)
    idx = np.concatenate([np.arange(2000), rng.integers(0, 10**7, 5000), [10**9, 2**40, 2**62]])
    got = index_key_slots(prefix, idx)
    want = [key_slot(prefix + b"%d" % i) for i in idx.tolist()]
    assert got.tolist() == want
    # a prefix with a hash tag takes the general path (only the tag is hashed)
    tagged = b"dc:{x}:"
    want = [key_slot(tagged + b"%d" % i) for i in range(50)]
    assert index_key_slots(tagged, np.arange(50)).tolist() == want
    with pytest.raises(ValueError, match=">= 0"):
        index_key_slots(prefix, np.array([3, -1]))


@needs_redis
def test_index_key_slots_equal_the_servers_keyslot(redis_cluster) -> None:
    from datacache.stores.redis_cluster import index_key_slots

    prefix = b"dc:fedcba9876543210:s16m64bilinear-raw:"
    idx = np.array([0, 1, 9, 10, 99, 12345, 1281166, 987654321])
    port = redis_cluster.masters[0].port
    want = [int(cli(port, "cluster", "keyslot", (prefix + b"%d" % i).decode())) for i in idx.tolist()]
    assert index_key_slots(prefix, idx).tolist() == want


@needs_redis
def test_owned_indices_are_the_keys_whose_slots_the_node_serves(cluster_url, redis_cluster) -> None:
    from cache_daemon.ownership import owned_indices
    from datacache.stores import open_store

    store = open_store(cluster_url)
    owners = slot_owners(redis_cluster.masters[0].port)  # the servers' own map
    prefix, n = b"dc:00112233aabbccdd:t:", 3000
    slot_of = {i: int(cli(redis_cluster.masters[0].port, "cluster", "keyslot", (prefix + b"%d" % i).decode()))
               for i in range(0, n, 97)}  # a sample checked against the server
    seen = np.zeros(n, dtype=int)
    for m in redis_cluster.masters:
        cfg = DaemonConfig(cache=cluster_url, redis_node=m.addr)
        own = owned_indices(cfg, store, prefix, n)
        seen[own.indices] += 1
        assert own.count == len(own.indices) and own.bits.nbytes == (n + 7) // 8  # kept: 1 bit per sample
        for i, s in slot_of.items():
            assert (i in set(own.indices.tolist())) == (owners[s] == m.addr)
        assert owned_indices(cfg, store, prefix, n, own) is own  # same inputs: reused, not recomputed
        assert owned_indices(cfg, store, prefix + b"x", n, own) is not own
    assert (seen == 1).all()  # exactly one owner per sample


def test_hash_and_all_ownership_cover_every_index_once_across_chunks() -> None:
    """``hash``: index i is owned by rank xxh3_64(prefix + str(i)) % world_size (the documented hash,
    re-stated here per key), over more than one HASH_CHUNK; ``all``: everything."""
    import xxhash

    from cache_daemon.ownership import HASH_CHUNK, owned_indices

    prefix, n, world = b"dc:0123456789abcdef:t:", HASH_CHUNK + 4465, 3
    want = np.array([xxhash.xxh3_64_intdigest(prefix + str(i).encode()) % world for i in range(n)])
    for rank in range(world):
        own = owned_indices(DaemonConfig(cache="redis://h:1", ownership="hash", rank=rank, world_size=world),
                            None, prefix, n)
        assert np.array_equal(own.indices, np.flatnonzero(want == rank)) and own.count == (want == rank).sum()
    everything = owned_indices(DaemonConfig(cache="redis://h:1", ownership="all"), None, prefix, n)
    assert np.array_equal(everything.indices, np.arange(n)) and everything.count == n


# ------------------------------------------------------------------ the idle shortcut
@pytest.fixture
def filled(fresh_cluster, imagefolder_factory):
    root = imagefolder_factory(classes=3, per_class=20, size=(48, 32))
    m = fresh_cluster.masters[0]
    node = Node(fresh_cluster.url, root, m.addr)
    rep = node.run()
    assert rep.written > 0 and node.state.done == node.state.owned > 5
    return fresh_cluster, node, m


@needs_redis
def test_idle_pass_checks_no_key_when_nothing_was_removed(filled, imagefolder_factory) -> None:
    cluster, node, m = filled
    before = exists_calls(m.port)
    for _ in range(3):
        rep = node.run()
        assert rep.skipped == node.state.owned and rep.decoded == 0
    assert exists_calls(m.port) == before  # not one EXISTS: the server says so
    assert node.state.shortcut_passes == 3 and node.state.done == node.state.owned
    # another dataset filling the same slots only adds keys: still nothing to check
    other = Node(cluster.url, imagefolder_factory(classes=2, per_class=15, size=(40, 30)), m.addr)
    other.run()
    before = exists_calls(m.port)
    node.run()
    assert exists_calls(m.port) == before and node.state.shortcut_passes == 4


@needs_redis
@pytest.mark.parametrize("fault", ["del", "unlink", "expire", "flushall", "restart_empty", "resetstat"])
def test_any_removal_makes_the_next_pass_check_and_refill(filled, fault) -> None:
    import time

    import redis

    cluster, node, m = filled
    node.run()
    assert node.state.shortcut_passes == 1
    r = redis.Redis(port=m.port)
    victim = node.owned_keys()[3]
    if fault == "del":
        assert r.delete(victim) == 1
    elif fault == "unlink":
        assert r.unlink(victim) == 1
    elif fault == "expire":
        assert r.pexpire(victim, 1)
        deadline = time.monotonic() + 5
        while r.exists(victim) and time.monotonic() < deadline:
            time.sleep(0.01)
    elif fault == "flushall":
        r.flushall()
    elif fault == "restart_empty":
        cluster.restart_empty(0)
    elif fault == "resetstat":
        # a removal hidden by zeroed counters: total_commands_processed went down -> a full check
        assert r.delete(victim) == 1
        r.config_resetstat()
    rep = node.run()
    assert node.state.shortcut_passes == 1  # this pass checked every key
    assert rep.decoded >= 1
    assert node.all_present(m.port)  # refilled: the dataset is full again
    node.run()
    assert node.state.shortcut_passes == 2  # and trusted again afterwards


@needs_redis
def test_a_removal_path_the_counters_miss_is_caught_by_the_slot_counts(filled, monkeypatch) -> None:
    import redis

    from cache_daemon import presence

    _, node, m = filled
    node.run()
    # pretend DEL were a removal path nobody listed: only the per-slot key counts can notice it
    monkeypatch.setattr(presence, "REMOVING_COMMANDS", tuple(c for c in presence.REMOVING_COMMANDS
                                                             if c != "del"))
    node.run()  # (whether this one is a shortcut depends on earlier DELs: the counter changed meaning)
    node.run()
    trusted = node.state.shortcut_passes
    assert redis.Redis(port=m.port).delete(node.owned_keys()[0]) == 1
    rep = node.run()
    assert node.state.shortcut_passes == trusted and rep.decoded == 1 and node.all_present(m.port)


@needs_redis
def test_verify_interval_bounds_how_long_the_shortcut_is_trusted(fresh_cluster, imagefolder_factory) -> None:
    root = imagefolder_factory(classes=2, per_class=6, size=(48, 32))
    m = fresh_cluster.masters[0]
    never = Node(fresh_cluster.url, root, m.addr, verify_interval=0.0)
    never.run()
    before = exists_calls(m.port)
    never.run()
    assert never.state.shortcut_passes == 0 and exists_calls(m.port) > before
    import time

    # the interval must outlast one pass on a loaded machine (a pass here takes ~50 ms; under a busy CI
    # it has taken longer than 0.2 s): the shortcut is trusted for 2 s, then no longer
    interval = 2.0
    short = Node(fresh_cluster.url, root, m.addr, verify_interval=interval)
    short.run()
    short.run()
    assert short.state.shortcut_passes == 1
    time.sleep(interval + 0.5)
    before = exists_calls(m.port)
    short.run()  # older than verify_interval: every key is checked again
    assert short.state.shortcut_passes == 1 and exists_calls(m.port) > before


@needs_redis
def test_standalone_redis_has_the_shortcut_too(redis_url, redis_server, imagefolder_factory) -> None:
    import redis

    from datacache.cacheurl import parse_cache_url

    root = imagefolder_factory(classes=2, per_class=5, size=(48, 32))
    cfg = DaemonConfig(cache=redis_url, node="n0", ownership="all", workers=1, t1_dir="none")
    store = open_store(parse_cache_url(redis_url).tiers[-1])
    state = DatasetState(DatasetSpec(root, short_side=SHORT))
    for _ in range(3):
        ingest_pass(cfg, state, store, decoder=None, stop=threading.Event(), progress=False)
    assert state.status == "full" and state.shortcut_passes == 2
    keys = redis.Redis(port=redis_server.port).keys("dc:*")
    redis.Redis(port=redis_server.port).delete(keys[0])
    rep = ingest_pass(cfg, state, store, decoder=None, stop=threading.Event(), progress=False)
    assert state.shortcut_passes == 2 and rep is not None and rep.decoded == 1


def test_lmdb_has_no_stamp_and_checks_every_key(imagefolder_factory, tmp_path) -> None:
    from datacache.cacheurl import parse_cache_url

    root = imagefolder_factory(classes=2, per_class=3, size=(48, 32))
    url = f"lmdb://{tmp_path}/lmdb"
    cfg = DaemonConfig(cache=url, node="n0", ownership="all", workers=1, t1_dir="none")
    store = open_store(parse_cache_url(url).tiers[-1])
    state = DatasetState(DatasetSpec(root, short_side=SHORT))
    try:
        for _ in range(2):
            ingest_pass(cfg, state, store, decoder=None, stop=threading.Event(), progress=False)
        assert state.status == "full" and state.shortcut_passes == 0
    finally:
        store.close()


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_verify_interval_must_be_finite_and_not_negative(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"verify_interval.*0 = check every key"):
        DaemonConfig(cache="lmdb:///tmp/x", verify_interval=bad)


def test_every_config_field_can_be_set_in_toml_and_the_environment(tmp_path) -> None:
    # a new DaemonConfig field must also be a TOML key (deploy/daemon.toml sets verify_interval)
    from dataclasses import fields

    from cache_daemon.daemon_config import _KINDS, load_config

    assert {f.name for f in fields(DaemonConfig)} - {"datasets"} == set(_KINDS)
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'cache = "lmdb://{tmp_path}/c"\nverify_interval = 30\n')
    assert load_config(str(cfg), env={}).verify_interval == 30.0
    env = {"DATACACHE_DAEMON_VERIFY_INTERVAL": "0"}
    assert load_config(str(cfg), env=env).verify_interval == 0.0


def test_release_free_heap_calls_glibc_trim_or_says_it_cannot(monkeypatch) -> None:
    import ctypes.util

    from cache_daemon import heap

    libc = ctypes.util.find_library("c") or ""
    assert heap.release_free_heap() is ("musl" not in libc)  # glibc here: trimmed
    monkeypatch.setattr(heap, "_TRIM", False)  # a libc without malloc_trim: nothing to call, no error
    assert heap.release_free_heap() is False


HEAP_PROBE = r"""
import ctypes, json, sys


def big_block_in_heap(size=2 << 20):
    big = bytearray(16 << 20)
    del big  # untuned glibc now serves blocks up to 16 MiB from its heap (its mmap threshold followed)
    blk = bytearray(size)
    addr = ctypes.addressof((ctypes.c_char * len(blk)).from_buffer(blk))
    for line in open("/proc/self/maps"):  # (the kernel may show the heap as several mappings)
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


if sys.argv[1] == "tuned":
    from cache_daemon.heap import decode_worker_heap, limit_heap_growth
    from datacache.decodepool import DecodePool

    print(json.dumps(limit_heap_growth(env={})))
    print(json.dumps(big_block_in_heap()))
    pool = DecodePool(1, worker_setup=lambda: decode_worker_heap(env={}))  # fork: nothing pickled
    print(json.dumps(pool.get().apply(big_block_in_heap, (8 << 20,))))  # a decode buffer's size
    pool.close(timeout=30)
else:
    print(json.dumps(big_block_in_heap()))
"""


def test_limit_heap_growth_keeps_big_blocks_out_of_the_heap_and_yields_to_the_environment() -> None:
    """After a 16 MiB block is freed, glibc (left as is) serves a 2 MiB block from its heap, where
    freed space fragments; with the daemon's settings the block is mapped on its own (returned whole
    when freed). Its decode workers go back to serving blocks up to 32 MiB from the heap (an 8 MiB
    decode buffer: reused, not mapped and zeroed per image). A variable set in the environment is left
    to glibc."""
    import ctypes.util
    import json
    import subprocess
    import sys

    if "musl" in (ctypes.util.find_library("c") or "") or not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt is what is tuned; this libc has none")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = REPO

    def probe(mode: str) -> list:
        out = subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True,
                             env=env, timeout=60, check=True).stdout
        return [json.loads(line) for line in out.splitlines()]

    assert probe("plain") == [True]  # the reference: glibc's dynamic threshold puts it in the heap
    assert probe("tuned") == [{"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 1 << 20}, False, True]
    from cache_daemon.heap import decode_worker_heap, limit_heap_growth

    # (in this process only the environment check runs: every variable is set, nothing is changed)
    assert limit_heap_growth(env={"MALLOC_ARENA_MAX": "4", "MALLOC_MMAP_THRESHOLD_": "65536"}) == {}
    assert decode_worker_heap(env={"MALLOC_MMAP_THRESHOLD_": "65536"}) is False


def test_the_first_listing_runs_in_a_child_that_persists_the_manifest(imagefolder_factory, tmp_path,
                                                                      caplog) -> None:
    import time

    from cache_daemon.ingest import list_in_child
    from datacache.manifest import Manifest

    root = imagefolder_factory(classes=2, per_class=3, size=(40, 30))
    pdir = str(tmp_path / "manifests")
    stop = threading.Event()
    assert list_in_child(DatasetSpec(root), pdir, stop)
    saved = Manifest.persist_path(pdir, Manifest.build(root).root)
    assert os.path.exists(saved) and len(Manifest.load(saved)) == 6
    with caplog.at_level("WARNING", logger="cache_daemon.ingest"):
        assert not list_in_child(DatasetSpec(str(tmp_path / "missing")), pdir, stop)  # the daemon lists
    assert "the listing process failed" in caplog.text and "does not exist" in caplog.text
    stop.set()
    t = time.monotonic()
    assert not list_in_child(DatasetSpec(root), str(tmp_path / "m2"), stop)  # SIGTERM: child killed
    assert time.monotonic() - t < 5 and not os.path.exists(str(tmp_path / "m2"))


def test_the_listing_process_gets_its_source_through_the_environment_not_argv(imagefolder_factory, tmp_path,
                                                                             monkeypatch) -> None:
    """A presigned source's signature (or a userinfo password) must not be public in ``ps``: the listing
    child's command line carries neither the source nor the allowed prefixes."""
    import subprocess
    import threading

    from cache_daemon.daemon_config import DatasetSpec
    from cache_daemon.ingest import list_in_child

    root = imagefolder_factory(classes=2, per_class=2, size=(40, 30))
    seen: list[list[str]] = []
    real = subprocess.Popen

    def spy(cmd, *a, **k):  # type: ignore[no-untyped-def]
        seen.append(list(cmd))
        return real(cmd, *a, **k)

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert list_in_child(DatasetSpec(root), str(tmp_path / "m"), threading.Event(), allow=(root,))
    assert seen and not any(root in arg for arg in seen[0][3:]), seen  # argv: [python, -c, code, ...]
