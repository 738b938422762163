"""The rolling fill (cache_daemon/rolling.py) on a real 3-master Redis Cluster: the daemons' passes run
in this process (the real ``ingest_pass``, real decode pool, real Redis), the "trainer" is three
lockstep ranks of :class:`LocalitySampler` reading through ``CachedImageNet`` with rank 0 publishing its
plan. Every sample served is compared with a direct Pillow decode of its file."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch

from cache_daemon import rolling
from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
from cache_daemon.ingest import DatasetState, ingest_pass
from client.dataset import CachedImageNet
from client.locality_sampler import LocalitySampler, owners_from_store
from client.run_publisher import PlanPublisher
from datacache.cacheurl import parse_cache_url
from datacache.decode import decode_image
from datacache.decodepool import DecodePool
from datacache.run_plan import RunRecord, slot_key
from datacache.stores import open_store
from tests.redis_utils import flushall, needs_redis

pytestmark = needs_redis
SHORT = 64
LAYOUT = [0, 1, 2]
BATCH = 8


_PUBLISHERS: list[PlanPublisher] = []


@pytest.fixture(autouse=True)
def short_sessions(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(rolling, "SESSION_S", 0.6)  # a pass returns quickly: the test interleaves
    monkeypatch.setattr(rolling, "IDLE_S", 0.02)
    real = PlanPublisher.__init__

    def track(self, *a, **kw):  # every publisher a test made is closed after it, even a failed one
        real(self, *a, **kw)
        _PUBLISHERS.append(self)

    monkeypatch.setattr(PlanPublisher, "__init__", track)
    yield
    while _PUBLISHERS:
        _PUBLISHERS.pop().close()


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    p = DecodePool(1)
    yield p
    p.close(timeout=10.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.conftest import make_imagefolder

    root = str(tmp_path_factory.mktemp("rolling") / "train")
    make_imagefolder(root, classes=4, per_class=45, size=(128, 96))
    return root


class Job:
    """Three lockstep ranks, rank 0 publishing; a daemon pass per node in this process."""

    def __init__(self, cluster, root: str, pool: DecodePool, *, fraction: float = 0.5, seed: int = 3,
                 ttl: float = 30.0) -> None:
        for m in cluster.masters:
            flushall(m.port)
        self.cluster, self.pool = cluster, pool
        self.url = cluster.url
        self.ds = CachedImageNet(root, cache=self.url, short_side=SHORT, t1_dir=None)
        self.n = len(self.ds)
        self.masters = [m.addr for m in cluster.masters]
        self.store = open_store(parse_cache_url(self.url).tiers[-1])
        self.owners = owners_from_store(self.store, [self.ds.key(i) for i in range(self.n)], self.masters)
        self.pub = self.publisher(seed, ttl)
        self.seed = seed
        self.samplers = [LocalitySampler(self.owners, LAYOUT, r, seed=seed, publisher=self.pub if r == 0
                                         else None) for r in range(3)]
        spec = DatasetSpec(source=root, short_side=SHORT)
        # budgets: the masters' memory now plus room for the connections still to come (the passes', the
        # decode worker's: tens of KB each) plus `fraction` of their share of the records
        per = SHORT * 85 * 3 + 300
        base = [redis.Redis(port=m.port).info("memory")["used_memory"] + 300_000 for m in cluster.masters]
        self.cfgs = [DaemonConfig(cache=self.url, node=f"n{i}", redis_node=m.addr, t1_dir="none", workers=1,
                                  memory_budget=base[i] + int(fraction * self.n / 3 * per), datasets=(spec,))
                     for i, m in enumerate(cluster.masters)]
        self.states = [DatasetState(spec) for _ in cluster.masters]
        self.deleted: list[tuple[list[bytes], list[int]]] = []  # (keys, trained per rank at the time)
        real = self.store.delete_many

        def spy(keys):  # what was deleted, and how far the trainer was then
            self.deleted.append((list(keys), [s.trained for s in self.samplers]))
            return real(keys)

        self.store.delete_many = spy  # type: ignore[method-assign]
        self.its: list[Iterator[int]] = []
        self.read: list[int] = []

    def publisher(self, seed: int, ttl: float = 30.0) -> PlanPublisher:
        return PlanPublisher.for_dataset(self.ds, seed=seed, exchange=0.0, drop_last=False,
                                         node_of_rank=LAYOUT, masters=self.masters, ttl=ttl, interval=0.05)

    def epoch(self, e: int) -> None:
        for s in self.samplers:
            s.set_epoch(e)
        self.its = [iter(s) for s in self.samplers]
        self.pub._rate_mark = None
        self.pub.publish()

    def passes(self) -> None:
        stop = threading.Event()
        for cfg, st in zip(self.cfgs, self.states):
            ingest_pass(cfg, st, self.store, decoder=None, stop=stop, progress=False, pool=self.pool)

    def step(self) -> list[int]:
        """One batch on every rank (checked against Pillow), then the trained counts are published."""
        got: list[int] = []
        for r, s in enumerate(self.samplers):
            batch = [next(self.its[r]) for _ in range(BATCH)]
            for i, (img, label) in zip(batch, self.ds.__getitems__(batch)):
                assert label == self.ds.targets[i]
                assert torch.equal(img, reference(self.ds, i)), i
            s.mark_trained(BATCH)
            got += batch
        self.read += got
        # the trainer here waits for the daemons' passes (no wall-clock race): publish no training rate, so
        # the daemons do not skip the next samples as "reached before they could be filled"
        self.pub._rate_mark = None
        self.pub.publish()
        return got

    def stats(self) -> list[dict]:
        return [st.memo.rolling.stats.as_json() for st in self.states]


def reference(ds: CachedImageNet, i: int) -> torch.Tensor:
    with open(os.path.join(ds.manifest.root[len("file://"):], ds.manifest.paths[i]), "rb") as f:
        return torch.from_numpy(decode_image(f.read(), ds.variant)).permute(2, 0, 1)


def positions(job: Job, epoch: int) -> dict[int, int]:
    """Sample -> its earliest per-rank position this epoch (the samplers' own plan)."""
    pos: dict[int, int] = {}
    for s in job.samplers:
        for p, i in enumerate(list(s.plan().per_rank[s.rank])):
            pos[int(i)] = min(pos.get(int(i), p), p)
    return pos


def test_fills_in_plan_order_and_deletes_only_what_was_read(redis_cluster, folder, pool) -> None:
    job = Job(redis_cluster, folder, pool, fraction=0.5)
    job.epoch(0)
    pos0 = positions(job, 0)
    per_rank = len(job.samplers[0].plan().per_rank[0])
    for _ in range(per_rank // BATCH):
        job.passes()
        job.step()
    assert all(st.status == "rolling" for st in job.states)
    decoded_by_trainer = job.ds.stats()["decoded"]
    # with half the dataset's memory the trainer still read (almost) everything from the cache
    assert decoded_by_trainer <= 0.1 * len(job.read), job.ds.stats()
    # every deletion was of a sample every rank had already trained (position < trained)
    assert job.deleted, "the window never rolled"
    for keys, trained in job.deleted:
        for k in keys:
            i = int(k.rsplit(b":", 1)[1])
            assert pos0[i] < min(trained), (i, pos0[i], trained)
    st = job.stats()
    assert sum(s["evicted"] for s in st) > 0 and all(s["runs"] == 1 for s in st)
    # the next epoch starts warm: the daemons filled its first samples while epoch 0 ended
    job.epoch(1)
    job.passes()
    job.step()
    assert job.ds.stats()["decoded"] - decoded_by_trainer <= 2
    job.pub.close()


def test_progress_backwards_refills_and_expired_run_falls_back(redis_cluster, folder, pool) -> None:
    job = Job(redis_cluster, folder, pool, fraction=0.4, ttl=1.0)
    job.epoch(0)
    for _ in range(6):
        job.passes()
        job.step()
    first = job.read[:3 * BATCH]  # the epoch's first batch, deleted since (the window moved on)
    present = job.store.contains([job.ds.key(i) for i in first])
    assert not all(present)
    # a resumed run (from the epoch's start): its progress goes backwards; the daemons refill
    for s in job.samplers:
        s.load_state_dict({**s.state_dict(), "trained": 0})
    job.its = [iter(s) for s in job.samplers]
    job.read = []
    before = job.ds.stats()["decoded"]
    for _ in range(10):  # (a pass is a 0.6 s session here: a loaded machine needs a few)
        job.passes()
        if all(job.store.contains([job.ds.key(i) for i in first])):
            break
    assert all(job.store.contains([job.ds.key(i) for i in first]))
    job.step()
    assert job.ds.stats()["decoded"] == before  # served from the refilled cache
    # the trainer is killed (no close): its record expires by TTL and the daemons go back to MinIO
    job.pub._stop.set()
    time.sleep(1.3)
    deletions = len(job.deleted)
    job.passes()
    assert all(not s["active"] for s in job.stats())
    assert all(st.status != "rolling" for st in job.states)
    assert len(job.deleted) == deletions  # MinIO deletes nothing


def test_forged_oversized_and_foreign_plans(redis_cluster, folder, pool) -> None:
    job = Job(redis_cluster, folder, pool, fraction=0.4)
    fp, tag = job.ds.manifest.fingerprint, job.ds.variant.tag()
    client = job.store.client_for(slot_key(fp, tag, 0))
    client.set(slot_key(fp, tag, 10), b"\x80not json", px=60_000)
    client.set(slot_key(fp, tag, 11), b"{" * 9000, px=60_000)  # oversized (and deeply nested)
    good = RunRecord(run="ab" * 8, seed=1, epoch=0, exchange=0.0, drop_last=False, node_of_rank=LAYOUT,
                     masters=job.masters, owners_digest="0" * 16, samples=job.n)
    client.set(slot_key(fp, tag, 12), good.encode())  # no expiry: would never expire
    # a well-formed run planned with another slot map: live, not understood -> nothing may be deleted
    client.set(slot_key(fp, tag, 13), good.encode(), px=60_000)
    job.epoch(0)
    for _ in range(3):
        job.passes()
        job.step()
    st = job.stats()
    assert all(s["invalid"] == 3 and s["held"] == 1 and s["runs"] == 1 for s in st), st
    assert job.deleted == []  # a run whose needs are unknown blocks every deletion
    assert all(json.dumps(s) for s in st)
    # without the foreign run, the window rolls again
    client.delete(slot_key(fp, tag, 13))
    for _ in range(3):
        job.passes()
        job.step()
    assert job.deleted
    job.pub.close()


def test_two_runs_never_lose_what_either_reads_next(redis_cluster, folder, pool) -> None:
    job = Job(redis_cluster, folder, pool, fraction=0.6)
    other = job.publisher(seed=99)
    others = [LocalitySampler(job.owners, LAYOUT, r, seed=99, publisher=other if r == 0 else None)
              for r in range(3)]
    job.epoch(0)
    for s in others:
        s.set_epoch(0)
    oits = [iter(s) for s in others]
    pos_a, pos_b = positions(job, 0), {}
    for s in others:
        for p, i in enumerate(list(s.plan().per_rank[s.rank])):
            pos_b[int(i)] = min(pos_b.get(int(i), p), p)
    trained_b = 0
    for k in range(7):
        n0, tb = len(job.deleted), trained_b
        job.passes()
        # never what either run reads in its next batch (each run keeps its share of the window)
        for keys, trained in job.deleted[n0:]:
            for key in keys:
                i = int(key.rsplit(b":", 1)[1])
                assert not min(trained) <= pos_a[i] < min(trained) + BATCH, (i, "run a")
                assert not tb <= pos_b[i] < tb + BATCH, (i, "run b")
        job.step()
        if k % 2 == 0:  # the second run trains at half the speed
            for r, s in enumerate(others):
                job.ds.__getitems__([next(oits[r]) for _ in range(BATCH)])
                s.mark_trained(BATCH)
            trained_b += BATCH
            other._rate_mark = None
            other.publish()
    assert job.deleted
    assert all(s["runs"] == 2 for s in job.stats())
    other.close()
    job.pub.close()


def test_a_restarted_daemon_rebuilds_its_window(redis_cluster, folder, pool) -> None:
    job = Job(redis_cluster, folder, pool, fraction=0.5)
    job.epoch(0)
    for _ in range(3):
        job.passes()
        job.step()
    # the daemons restart (their memory is gone; the cache and the published progress are not)
    job.states = [DatasetState(st.spec) for st in job.states]
    before = len(job.deleted)
    for _ in range(3):
        job.passes()
        job.step()
    for keys, trained in job.deleted[before:]:
        pos0 = positions(job, 0)
        assert all(pos0[int(k.rsplit(b":", 1)[1])] < min(trained) for k in keys)
    assert job.ds.stats()["decoded"] <= 0.1 * len(job.read)
    assert np.isfinite([s["window"] for s in job.stats()]).all()
    job.pub.close()


def test_a_publishing_client_does_not_write_misses_back(redis_cluster, folder) -> None:
    """Under a rolling fill the daemons own the window: even a ``?write_back=1`` client (its own Redis)
    serves its misses without writing them, in this process and in a loader worker."""
    from torch.utils.data import DataLoader

    from tests.redis_utils import private

    for m in redis_cluster.masters:
        flushall(m.port)
    ds = CachedImageNet(folder, cache=private(redis_cluster.url), short_side=SHORT, t1_dir=None)
    ds.__getitems__([0, 1])
    ds.store.flush(timeout=10)  # (write-back runs behind a background queue)
    assert all(ds.store.contains([ds.key(0), ds.key(1)]))  # write-back as asked, before the plan
    pub = PlanPublisher.for_dataset(ds, seed=0, exchange=0.0, drop_last=False, node_of_rank=LAYOUT,
                                    masters=[m.addr for m in redis_cluster.masters])
    try:
        got = ds.__getitems__([2, 3])
        assert all(torch.equal(img, reference(ds, i)) for i, (img, _) in zip([2, 3], got))
        loader = DataLoader(ds, batch_size=2, num_workers=1, sampler=[4, 5], collate_fn=lambda b: b)
        assert len(next(iter(loader))) == 2
        ds.store.flush(timeout=10)
        assert not any(ds.store.contains([ds.key(i) for i in (2, 3, 4, 5)]))
    finally:
        pub.close()


def test_a_layout_change_re_plans(redis_cluster, folder, pool) -> None:
    """The run comes back on another layout (2 nodes: ranks 0, 1 on node 0, rank 2 on node 1) from the
    next epoch: the daemons plan with the new record -- deletions only of what the NEW plan has read,
    and the trainer keeps reading from the cache."""
    job = Job(redis_cluster, folder, pool, fraction=0.5)
    job.epoch(0)
    for _ in range(3):
        job.passes()
        job.step()
    job.pub.close()
    layout, masters = [0, 0, 1], job.masters[:2]
    owners = owners_from_store(job.store, [job.ds.key(i) for i in range(job.n)], masters)
    job.pub = PlanPublisher.for_dataset(job.ds, seed=job.seed, exchange=0.0, drop_last=False,
                                        node_of_rank=layout, masters=masters, interval=0.05)
    job.samplers = [LocalitySampler(owners, layout, r, seed=job.seed, publisher=job.pub if r == 0 else None)
                    for r in range(3)]
    job.epoch(1)
    pos1 = positions(job, 1)
    before_del, before_dec = len(job.deleted), job.ds.stats()["decoded"]
    for _ in range(4):
        job.passes()
        job.step()
    assert all(s["runs"] == 1 and s["live"][0]["run"] == job.pub.record.run for s in job.stats())
    assert len(job.deleted) > before_del
    for keys, trained in job.deleted[before_del:]:
        for k in keys:
            i = int(k.rsplit(b":", 1)[1])
            assert not min(trained) <= pos1[i] < min(trained) + BATCH, i  # never what is read next
    assert job.ds.stats()["decoded"] - before_dec <= 0.1 * 4 * 3 * BATCH
    job.pub.close()


def test_an_unusable_plan_alone_leaves_minio_running_and_the_wait_kept(redis_cluster, folder, pool) -> None:
    """Only a plan this daemon cannot reproduce is live: the MinIO pass runs to its budget (not stopped
    chunk after chunk) and the round loop keeps its wait (plans_live is False), no busy loop; and the
    owners of a tiered store (``ds.store``) are its cluster tier's, not all -1."""
    from cache_daemon.ingest import plans_live

    job = Job(redis_cluster, folder, pool, fraction=0.4)
    job.pub.close()
    keys = [job.ds.key(i) for i in range(job.n)]
    assert (owners_from_store(job.ds.store, keys, job.masters) == job.owners).all()
    assert (job.owners >= 0).all()
    fp, tag = job.ds.manifest.fingerprint, job.ds.variant.tag()
    foreign = RunRecord(run="cd" * 8, seed=1, epoch=0, exchange=0.0, drop_last=False, node_of_rank=LAYOUT,
                        masters=job.masters, owners_digest="0" * 16, samples=job.n)
    job.store.client_for(slot_key(fp, tag, 3)).set(slot_key(fp, tag, 3), foreign.encode(), px=60_000)
    job.passes()
    job.passes()
    for st, cfg in zip(job.states, job.cfgs):
        assert st.memo.rolling.unusable == {"cd" * 8}
        assert st.status in ("budget", "full"), st.status  # the MinIO pass ran to its end
        assert not plans_live(cfg, st, job.store)
    assert job.deleted == []
