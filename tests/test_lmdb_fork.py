"""Fork safety of the LMDB store: a forked child never touches the parent's reader slots.

The scenario of issue 9, item 4: a parent thread is inside a read transaction; a child forks,
opens its own environment (reads and writes), and exits; the parent's reader must still be in
the lock file's reader table, and its snapshot must still read correctly while another process
rewrites every key (a writer may only reuse pages no live reader can see).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

from datacache.stores import LMDBStore

N = 200


def _value(i: int, gen: int) -> bytes:
    return bytes([gen]) * 4000 + b"%d" % i


def _child(store: LMDBStore, q: mp.Queue) -> None:
    q.put((store.put_many([(b"child", b"c")]), store.get_many([b"k0"])[0]))


def _rewriter(path: str, q: mp.Queue) -> None:
    s = LMDBStore(path)
    for gen in range(2, 8):  # several transactions: freed pages become reusable to later ones
        s.put_many([(b"k%d" % i, _value(i, gen)) for i in range(N)], overwrite=True)
    q.put(s.stats()["puts"])


def _reader_pids(env) -> list[tuple[int, str]]:
    rows = [line.split() for line in env.readers().strip().splitlines()[1:]]
    return [(int(r[0]), r[2]) for r in rows if len(r) == 3]


def test_forked_child_leaves_the_parents_reader_and_snapshot_intact(tmp_path) -> None:
    path = str(tmp_path / "db")
    store = LMDBStore(path)
    assert store.put_many([(b"k%d" % i, _value(i, 1)) for i in range(N)]) == N
    env = store._acquire().env
    inside, release, result = threading.Event(), threading.Event(), {}

    def hold_snapshot() -> None:
        with env.begin() as txn:  # a parent thread inside a read transaction across the fork
            inside.set()
            release.wait(120)
            result["values"] = [txn.get(b"k%d" % i) for i in range(N)]

    t = threading.Thread(target=hold_snapshot)
    t.start()
    assert inside.wait(30)
    try:
        readers_before = _reader_pids(env)
        assert any(pid == os.getpid() and txn != "-" for pid, txn in readers_before), readers_before

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_child, args=(store, q))
        child.start()
        written, k0 = q.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        # the child opened its own environment: it wrote and read (a store error would be 0 / None)
        assert (written, k0) == (1, _value(0, 1))
        # the parent's reader slot is still there, with its snapshot
        after = _reader_pids(env)
        assert [r for r in after if r[0] == os.getpid()] == [r for r in readers_before if r[0] == os.getpid()]

        spawn = mp.get_context("spawn")
        q2 = spawn.Queue()
        writer = spawn.Process(target=_rewriter, args=(path, q2))
        writer.start()
        assert q2.get(timeout=120) == 6 * N
        writer.join(60)
        assert writer.exitcode == 0
    finally:
        release.set()
        t.join(60)
    assert result["values"] == [_value(i, 1) for i in range(N)]  # the snapshot, untouched
    assert store.get_many([b"k7", b"child"]) == [_value(7, 6 + 1), b"c"]  # new readers see the rewrite
