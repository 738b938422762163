"""Per-node circuit breakers: a frozen (SIGSTOP) Redis node is not waited on batch after batch.

Real redis-server processes, real SIGSTOP/SIGCONT (always SIGCONT in a ``finally``), real DataLoader
workers. The only time bounds are generous ratios/limits that prove "no per-batch timeout".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch
from torch.utils.data import DataLoader

from client.dataset import CachedImageNet
from datacache.decode import decode_image
from datacache.stores import open_store
from tests.redis_utils import needs_redis, private

pytestmark = needs_redis

TIMEOUTS = "socket_timeout=0.5&connect_timeout=0.5"


def _as_list(batch: list) -> list:
    return batch


def _reference(ds: CachedImageNet, i: int) -> torch.Tensor:
    """A direct decode of the file, independent of every cache."""
    with open(os.path.join(ds.manifest.root[len("file://"):], ds.manifest.paths[i]), "rb") as f:
        return torch.from_numpy(decode_image(f.read(), ds.variant)).permute(2, 0, 1)


def _wait_closed(store, addr: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.stats()["breakers"].get(addr, {}).get("state") == "closed":
            return
        time.sleep(0.1)
    raise AssertionError(f"breaker of {addr} still open after {timeout} s: {store.stats()['breakers']}")


def _child_state(store, q) -> None:
    q.put((store.breakers().state(), store.breakers().allow(store.addr)))


def test_frozen_standalone_opens_the_breaker_then_probe_closes_it(redis_server) -> None:
    store = open_store(f"redis://{redis_server.addr}/0?{TIMEOUTS}")
    keys = [b"dc:br:%d" % i for i in range(8)]
    store.put_many([(k, b"v") for k in keys])
    addr = redis_server.addr
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for _ in range(20):  # without a breaker: 20 x 0.5 s of socket timeout
            assert store.get_many(keys) == [None] * 8
        elapsed = time.monotonic() - t0
        st = store.stats()
        assert st["breakers"][addr]["state"] == "open" and st["breakers"][addr]["opened"] == 1
        assert st["breaker_skipped"] >= 19 * 8 and elapsed < 5.0, (elapsed, st)
        assert store.put_many([(b"dc:br:new", b"v")]) == 0  # skipped, counted
        assert store.counters()["write_errors"] == 1 and not store.health()["ok"]
        # fork boundary: a forked worker starts with closed breakers of its own
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child_state, args=(store, q))
        p.start()
        child_state, child_allows = q.get(timeout=30)
        p.join(30)
        assert child_state == {} and child_allows
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    _wait_closed(store, addr)
    assert [bytes(v) for v in store.get_many(keys)] == [b"v"] * 8
    assert store.health()["ok"]
    store.close()


def _epoch(ds: CachedImageNet) -> tuple[float, list[tuple[torch.Tensor, int]]]:
    t0 = time.monotonic()
    seen = []
    for batch in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_as_list, shuffle=False):
        seen.extend((img.clone(), label) for img, label in batch)
    return time.monotonic() - t0, seen


def test_frozen_cluster_master_costs_no_per_batch_timeout(fresh_cluster, imagefolder_factory) -> None:
    root = imagefolder_factory(classes=3, per_class=64, size=(160, 120))
    # a reply timeout well under the epoch's length, so "< 3x normal" tells one timeout per worker
    # (fine) from one per batch (48 batches x 2 GETs x 0.1 s, ~20x normal here)
    url = private(f"{fresh_cluster.url}?socket_timeout=0.1&connect_timeout=0.1")
    ds = CachedImageNet(root, cache=url, short_side=32, t1_dir=None)
    n = len(ds)
    store = ds.store.tiers[0]
    owners = store.master_of(ds.reader.keys(range(n)))
    victim = fresh_cluster.masters[1]
    share = [i for i in range(n) if owners[i] == victim.addr]
    assert 0 < len(share) < n
    refs = [_reference(ds, i) for i in range(n)]

    _epoch(ds)  # the first epoch fills the cluster (write-back from the workers, flushed at their exit)
    normal, seen = _epoch(ds)  # the normal (warm) epoch time, measured here
    assert len(seen) == n
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        frozen, seen = _epoch(ds)
        assert len(seen) == n
        for i, (img, label) in enumerate(seen):  # the frozen master's samples decoded from the source
            assert label == ds.targets[i] and torch.equal(img, refs[i]), i
        print(f"epoch times: normal {normal:.2f} s, one master frozen {frozen:.2f} s")
        assert frozen < 3 * normal, (frozen, normal)
        # the main process opens its own breaker, then the node comes back
        ds.__getitems__(share)
        assert store.stats()["breakers"][victim.addr]["state"] == "open"
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    _wait_closed(store, victim.addr)
    before = ds.stats()["t2"]["hits"]
    for i, (img, label) in zip(share, ds.__getitems__(share)):
        assert label == ds.targets[i] and torch.equal(img, refs[i]), i
    assert ds.stats()["t2"]["hits"] - before == len(share)  # the node's keys are hits again


def test_backoff_doubles_from_one_second_to_thirty_with_jitter() -> None:
    from datacache.stores.breaker import Breakers

    br = Breakers(lambda addr: None)
    for failures, base in [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (40, 30.0)]:
        got = [br._backoff(failures) for _ in range(200)]
        assert all(0.8 * base <= g <= 1.2 * base for g in got), (failures, min(got), max(got))
        assert max(got) - min(got) > 0.05 * base  # jittered, not in step


def test_refused_node_keeps_one_prober_and_backs_off_while_it_stays_down() -> None:
    """Nothing listens on the port (real refused connections): the breaker opens on the first call,
    the one probe thread fails again and the back-off grows; later calls never start a second one."""
    import threading

    from trainer.distenv import free_port

    port = free_port()
    addr = f"127.0.0.1:{port}"
    store = open_store(f"redis://{addr}/0?connect_timeout=0.2")
    try:
        for _ in range(30):
            assert store.get_many([b"dc:x"]) == [None]
            store.put_many([(b"dc:x", b"v")])
        probers = [t for t in threading.enumerate() if t.name == f"datacache-probe-{addr}"]
        assert len(probers) == 1
        deadline = time.monotonic() + 15
        while store.stats()["breakers"][addr]["failures"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        state = store.stats()["breakers"][addr]
        assert state["state"] == "open" and state["failures"] >= 3 and state["opened"] == 1, state
        assert state["retry_in_s"] is not None
        assert store.counters()["breaker_skipped"] >= 58  # 29 reads + 29 writes not sent
    finally:
        store.close()
