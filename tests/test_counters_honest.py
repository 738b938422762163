"""Write counters count what Redis acknowledged: at ``maxmemory 1mb`` + ``noeviction`` most writes are
refused (``OOM``), and written + present + errors == attempted, written == the keys that exist."""

from __future__ import annotations

import os
import subprocess

import pytest

from datacache.devtools.redis_local import start_server
from datacache.stores import open_store
from datacache.tiered import TieredStore
from tests.redis_utils import needs_redis, private

pytestmark = needs_redis


def _dbsize(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True, timeout=10)
    return int(out.stdout.strip())


def test_writeback_counts_what_a_full_server_acknowledged(tmp_path) -> None:
    srv = start_server(str(tmp_path / "full"), maxmemory="1mb", policy="noeviction")
    try:
        store = open_store(f"redis://{srv.addr}/0", background_writes=True)
        assert isinstance(store, TieredStore)
        value = os.urandom(5_000)
        batches = [[(b"dc:honest:%d" % i, value) for i in range(s, s + 10)] for s in range(0, 200, 10)]
        # the first batch again while the server has room: NX finds those keys -> "present" (once the
        # server is full, noeviction refuses even a SET NX of an existing key with OOM: an error)
        batches.insert(1, batches[0])
        for items in batches:
            store.put_many(items)
        assert store.flush(timeout=30)
        wb = store.stats()["writeback"]
        assert wb["attempted"] == 210 and wb["dropped"] == 0
        assert wb["written"] + wb["present"] + wb["errors"] == wb["attempted"], wb
        keys = _dbsize(srv.port)
        assert 0 < keys < 200 and wb["written"] == keys, (wb, keys)  # the server refused most
        assert keys >= 10 and wb["present"] == 10 and wb["errors"] == 200 - keys, wb
        assert store.stats()["puts"] == keys
        store.close()
    finally:
        srv.stop()


def test_a_failing_tier_call_in_the_writer_thread_is_counted(tmp_path) -> None:
    """A tier whose put_many raises (breaking its contract) still counts every item as an error."""
    srv = start_server(str(tmp_path / "ok"))
    try:
        store = open_store(f"redis://{srv.addr}/0", background_writes=True)
        tier = store.tiers[0]

        def broken(items, *, overwrite=False):
            raise RuntimeError("boom")

        tier.put_many = broken  # the thread boundary is what is tested; the tier is real otherwise
        store.put_many([(b"dc:x:%d" % i, b"v") for i in range(7)])
        assert store.flush(timeout=30)
        wb = store.stats()["writeback"]
        assert wb["attempted"] == 7 and wb["errors"] == 7 and wb["written"] == 0, wb
        store.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_store_put_many_counts_present_separately(kind: str, redis_url: str, cluster_url: str) -> None:
    from datacache.stores import open_store

    store = open_store(redis_url if kind == "standalone" else cluster_url)
    items = [(b"dc:p:%d" % i, b"v") for i in range(20)]
    assert store.put_many(items[:12]) == 12
    assert store.put_many(items) == 8
    c = store.counters()
    assert c["puts"] == 20 and c["present"] == 12 and c["write_errors"] == 0
    store.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_stats_written_is_what_the_server_acknowledged(tmp_path, imagefolder_factory,
                                                               workers: int) -> None:
    """The reported case: ``CachedImageNet`` over a Redis that refuses most writes (noeviction, full).
    ``stats()['t2']['written']`` is what Redis acknowledged (the keys that exist afterwards), not what
    was queued; queued = written + present + refused, counted across DataLoader workers."""
    from torch.utils.data import DataLoader

    from client.dataset import CachedImageNet

    srv = start_server(str(tmp_path / "full"), maxmemory="64mb", policy="noeviction")
    try:
        used = int(subprocess.run(["redis-cli", "-p", str(srv.port), "memory", "stats"], capture_output=True,
                                  text=True, timeout=10).stdout.split("total.allocated\n")[1].split()[0])
        # room for ~6 of the 24 records (~96 KB each) above what the empty server uses
        subprocess.run(["redis-cli", "-p", str(srv.port), "config", "set", "maxmemory", str(used + 600_000)],
                       check=True, capture_output=True, timeout=10)
        root = imagefolder_factory(classes=3, per_class=8, size=(200, 150))
        ds = CachedImageNet(root, cache=private(f"redis://{srv.addr}/0"), short_side=160, t1_dir=None)
        loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=list)
        assert sum(len(b) for b in loader) == 24
        assert ds.flush(timeout=30)  # the main process's queue (workers flushed theirs at exit)
        t2 = ds.stats()["t2"]
        keys = _dbsize(srv.port)
        assert 0 < keys < 24, keys  # 24 x ~96 KB records: most were refused
        assert t2["written"] == keys, (t2, keys)
        answered = t2["written"] + t2["writeback_present"] + t2["writeback_errors"]
        assert t2["queued"] == 24 and answered == 24, t2
    finally:
        srv.stop()
