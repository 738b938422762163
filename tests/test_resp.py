"""The Redis read path's receive buffers: recycled only when no value sliced out of them is alive."""

from __future__ import annotations

import os

import numpy as np

from datacache.stores import open_store
from datacache.stores.resp import ArenaPool


def test_an_arena_is_reused_only_after_every_view_of_it_is_gone() -> None:
    pool = ArenaPool(keep_bytes=1 << 20)
    a = pool.take(1000)
    assert pool.take(1000) is not a  # still being filled by its taker
    pool.give_back(a)
    view = np.frombuffer(memoryview(a)[10:20], dtype=np.uint8)  # what a record decoded from it holds
    b = pool.take(1000)
    assert b is not a  # a numpy view of a is alive
    pool.give_back(b)
    del view
    assert pool.take(1000) is a  # now nothing refers to it: recycled, no fresh memory
    assert pool.take(1 << 21) not in pool._arenas  # over keep_bytes: handed out, not kept


def test_values_held_across_reads_are_never_overwritten(redis_url: str) -> None:
    store = open_store(redis_url + "&fetch_bytes=65536")  # several round trips (arenas) per call
    items = [(b"resp:%d" % i, os.urandom(20_000 + i)) for i in range(40)]
    store.put_many(items, overwrite=True)
    keys = [k for k, _ in items]
    first = store.get_many(keys)
    kept = [np.frombuffer(v, dtype=np.uint8) for v in first]  # the views training code holds
    del first
    for _ in range(5):  # later reads must take other buffers while `kept` is alive
        again = store.get_many(keys[::-1])
        assert [bytes(v) for v in again] == [v for _, v in items[::-1]]
        del again
    assert [a.tobytes() for a in kept] == [v for _, v in items]
