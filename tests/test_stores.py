from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from typing import Any

import lmdb
import numpy as np
import pytest

from datacache.config import ConfigError
from datacache.record import decode_record, encode_record
from datacache.stores import LMDBStore, MemoryStore, Store, lmdb_store, open_store


def rec(i: int, side: int = 40) -> bytes:
    px = np.full((side, side, 3), i % 251, dtype=np.uint8)
    px[0, 0] = (i // 251) % 256
    return encode_record(px, i, key=b"k%d" % i)


def test_open_store_schemes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    s = open_store(f"lmdb://{tmp_path}/a?map_size=65536&max_readers=200")
    assert isinstance(s, LMDBStore) and isinstance(s, Store)
    assert (s.map_size, s.max_readers, s.url) == (65536, 200, f"lmdb://{tmp_path}/a")
    monkeypatch.chdir(tmp_path)
    assert open_store("lmdb://rel/dir").url == f"lmdb://{tmp_path}/rel/dir"  # relative -> absolute
    with pytest.raises(ConfigError, match=r"unknown scheme 'mongodb'.*lmdb://, memory://, redis://"):
        open_store("mongodb://localhost:6379")
    with pytest.raises(ConfigError, match=r"no scheme.*did you mean lmdb:///just/a/path"):
        open_store("/just/a/path")
    with pytest.raises(ConfigError, match=r"unknown option 'mapsize'.*map_size"):
        open_store(f"lmdb://{tmp_path}/b?mapsize=1")


@pytest.mark.parametrize("url", ["memory://", "lmdb"])
def test_nx_overwrite_contains_stats(url: str, tmp_path) -> None:
    s = open_store(url if url != "lmdb" else f"lmdb://{tmp_path}/db")
    assert s.put_many([(b"a", b"1"), (b"b", b"2")]) == 2
    assert s.put_many([(b"a", b"X"), (b"c", b"3")]) == 1  # SET NX: "a" is kept
    got = s.get_many([b"a", b"c", b"zz"])
    assert [bytes(v) if v is not None else None for v in got] == [b"1", b"3", None]
    assert s.put_many([(b"a", b"X")], overwrite=True) == 1
    assert bytes(s.get_many([b"a"])[0]) == b"X"
    assert s.contains([b"a", b"nope", b"b"]) == [True, False, True]
    assert s.put_many([]) == 0
    st = s.stats()
    assert st["entries"] == 3 and st["hits"] == 3 and st["misses"] == 1 and st["bytes"] > 0
    assert (st["read_errors"], st["write_errors"]) == (0, 0) and s.health()["ok"]
    s.close()


def test_lmdb_map_grows_and_full_map_is_not_fatal(tmp_path) -> None:
    s = LMDBStore(str(tmp_path / "grow"), map_size=64 << 10)
    for b in range(10):
        assert s.put_many([(b"k%d" % i, rec(i)) for i in range(b * 20, b * 20 + 20)]) == 20
    st = s.stats()
    assert st["entries"] == 200 and st["grows"] >= 1 and st["map_size"] > 64 << 10
    assert all(decode_record(v, b"k%d" % i)[1] == i
               for i, v in enumerate(s.get_many([b"k%d" % i for i in range(200)])))
    full = LMDBStore(str(tmp_path / "full"), map_size=64 << 10, max_map_size=256 << 10)
    written = sum(full.put_many([(b"k%d" % i, rec(i))]) for i in range(100))  # ~5 KB each, 500 KB total
    fst = full.stats()
    assert 0 < written < 100 and fst["write_errors"] == 100 - written and fst["entries"] == written
    assert full.get_many([b"k0"])[0] is not None  # reads keep working


def test_corrupt_record_in_lmdb_is_a_miss_and_repairable(tmp_path) -> None:
    s = LMDBStore(str(tmp_path / "db"))
    good = rec(5)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    s.put_many([(b"t", good[: len(good) // 2]), (b"f", bytes(flipped))])
    truncated, bitflip = s.get_many([b"t", b"f"])
    assert decode_record(truncated, b"k5") is None and decode_record(bitflip, b"k5") is None
    assert s.put_many([(b"t", good), (b"f", good)]) == 0  # NX keeps the bad ones ...
    assert s.put_many([(b"t", good), (b"f", good)], overwrite=True) == 2  # ... overwrite repairs them
    assert all(decode_record(v, b"k5")[1] == 5 for v in s.get_many([b"t", b"f"]))


def _child_use(store: Store, q: mp.Queue) -> None:
    q.put((os.getpid(), store.put_many([(b"child", b"c")]), [bytes(v) for v in store.get_many([b"parent"])]))


def test_store_survives_fork_and_spawn(tmp_path) -> None:
    s = LMDBStore(str(tmp_path / "db"))
    s.put_many([(b"parent", b"p")])  # the env is open in the parent before the fork
    assert pickle.loads(pickle.dumps(s)).get_many([b"parent"]) == [b"p"]
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child_use, args=(s, q))
        p.start()
        pid, n, got = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0 and pid != os.getpid() and got == [b"p"]
        assert n == (1 if method == "fork" else 0)
    assert s.get_many([b"child"]) == [b"c"]  # the parent sees the child's write
    assert s.put_many([(b"after", b"a")]) == 1
    m = MemoryStore()
    m.put_many([(b"x", b"1")])
    assert pickle.loads(pickle.dumps(m)).get_many([b"x"]) == [None]  # process-local by design


def _writer(path: str, start: int, stop: int, q: mp.Queue) -> None:
    s = LMDBStore(path, map_size=64 << 10)
    written = 0
    for b in range(start, stop, 10):
        written += s.put_many([(b"k%d" % i, rec(i, side=60)) for i in range(b, min(b + 10, stop))])
    st = s.stats()
    q.put((written, st["grows"], st["resized_seen"]))


def test_two_processes_write_overlapping_keys_with_map_growth(tmp_path) -> None:
    path = str(tmp_path / "shared")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, a, b, q)) for a, b in ((0, 300), (150, 450))]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(r[0] for r in results) == 450  # NX: every key written exactly once overall
    assert sum(r[1] for r in results) >= 1    # the map grew during the run (60x60 records, 64 KiB start)
    s = LMDBStore(path)
    vals = s.get_many([b"k%d" % i for i in range(450)])
    decoded = [decode_record(v, b"k%d" % i) for i, v in enumerate(vals)]
    assert all(d is not None and d[1] == i for i, d in enumerate(decoded))
    assert s.stats()["entries"] == 450


def test_open_retries_only_the_open_grow_race() -> None:
    """What ``lmdb.open`` raises when its first transaction loses to a grow is retried; nothing else is."""
    def scripted(errors: list[Exception]):
        calls: list[int] = []

        def open_env() -> str:
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return "env"
        return open_env, calls

    resized = lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED: Database contents grew")
    einval = lmdb.InvalidParameterError("mdb_txn_begin: Invalid argument")
    retries: list[int] = []
    open_env, calls = scripted([resized, einval, resized])
    assert lmdb_store._open_retrying(open_env, on_retry=lambda: retries.append(1)) == "env"
    assert len(calls) == 4 and len(retries) == 3
    for other in (lmdb.InvalidParameterError("mdb_env_set_mapsize: Invalid argument"),
                  lmdb.ReadonlyError("mdb_env_open: Permission denied"), lmdb.CorruptedError("x")):
        open_env, calls = scripted([other])
        with pytest.raises(type(other)):
            lmdb_store._open_retrying(open_env, on_retry=lambda: None)
        assert len(calls) == 1  # a real failure is not retried
    open_env, calls = scripted([resized] * 100)
    with pytest.raises(lmdb.MapResizedError):
        lmdb_store._open_retrying(open_env, on_retry=lambda: None)
    assert len(calls) == lmdb_store._RACE_TRIES  # a race that never ends is given up, not spun on


def _grower(path: str, stop: Any, grows: Any, started: Any) -> None:
    """Another process that grows the map in small steps, committing between: the harshest growth. It
    grows until told to stop, counting its grows where the test can read them."""
    env = lmdb.open(path, map_size=64 << 10, max_dbs=0, max_spare_txns=0, sync=False)
    i = 0
    started.set()
    while not stop.is_set():
        try:
            with env.begin(write=True) as txn:
                txn.put(b"g%d" % i, b"x" * 16000)
            i += 1
            time.sleep(0.0002)
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] + (32 << 10))
            with grows.get_lock():
                grows.value += 1
        except lmdb.MapResizedError:
            env.set_mapsize(0)


def test_opening_and_reading_while_another_process_grows_the_map(tmp_path) -> None:
    """Regression (CI, lmdb 1.4.1): py-lmdb begins a transaction inside ``lmdb.open``; a grow committed
    between LMDB reading the map size and that transaction failed the open, and the write was lost.
    Counts events, not time: it runs until the grower has grown the map more than 100 times, this process
    has opened more than 50 stores and met the race at least once (however slow a loaded machine makes
    any of them), 120 s at most."""
    path = str(tmp_path / "grown")
    LMDBStore(path, map_size=64 << 10).close()
    ctx = mp.get_context("spawn")
    stop, started, grows = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    p = ctx.Process(target=_grower, args=(path, stop, grows, started))
    p.start()
    opens = retries = resized = 0
    deadline = time.monotonic() + 120  # an upper bound only
    try:
        assert started.wait(60), "the grower process did not start"
        while p.is_alive() and (grows.value <= 100 or opens <= 50 or retries + resized < 1):
            assert time.monotonic() < deadline, (grows.value, opens, retries, resized)
            s = LMDBStore(path, map_size=64 << 10)
            key = b"o%d" % opens
            assert s.put_many([(key, rec(opens))]) == 1
            assert s.get_many([key]) == [rec(opens)]
            st = s.stats()
            assert st["write_errors"] == 0 and st["read_errors"] == 0, st
            opens += 1
            retries += st.get("open_retries", 0)
            resized += st["resized_seen"]
            s.close()
    finally:
        stop.set()
        p.join(60)
    assert p.exitcode == 0 and grows.value > 100
    assert opens > 50 and retries + resized >= 1, (opens, retries, resized)  # the race was really run
