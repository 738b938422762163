"""Publish a training run's plan and progress for the cache daemons' rolling fill (:mod:`datacache.run_plan`).

Rank 0 of a run that samples with the locality plan makes one :class:`PlanPublisher`; the sampler tells it
the epoch (with its owners snapshot), how many indices the loader has drawn and how many samples were
trained; a background thread writes the record four times a second (``interval``; ``SET ... PX ttl``), so
the daemons see a run that stopped (killed, frozen, finished) expire after ``ttl`` seconds by the
server's clock. Publishing never raises into the training loop: a failure is logged once and counted,
and the run goes on with the daemons' plain (MinIO) fill.

    pub = PlanPublisher.for_dataset(dataset, seed=0, exchange=0.1, drop_last=False,
                                    node_of_rank=layout, masters=masters_by_node)
    sampler = LocalitySampler(owners, layout, rank, seed=0, exchange=0.1, publisher=pub)

Threads: the writer thread only reads plain ints/floats the training thread sets (no lock needed for
single attribute stores under the GIL) and builds the record from a snapshot of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from datacache.epoch_plan import owners_digest
from datacache.run_plan import (
    DEFAULT_TTL_S,
    MAX_RUNS,
    PlanRecordError,
    RunRecord,
    new_run_id,
    parse_record,
    slot_key,
)

log = logging.getLogger("datacache.run_plan")


class PlanPublisher:
    """One run's plan record (see the module docstring). ``store``: the cache's Redis tier (a store with
    ``client_for``); ``fingerprint``/``tag``: the dataset's manifest fingerprint and variant tag."""

    def __init__(self, store: Any, fingerprint: str, tag: str, *, seed: int, exchange: float, drop_last: bool,
                 node_of_rank: Sequence[int], masters: Sequence[str], ttl: float = DEFAULT_TTL_S,
                 interval: float = 0.25, run: str | None = None) -> None:
        self.store, self.fingerprint, self.tag = store, fingerprint, tag
        self.ttl_ms = max(1, int(ttl * 1000))
        self.interval = float(interval)
        self.record = RunRecord(run=run or new_run_id(), seed=int(seed), epoch=0, exchange=float(exchange),
                                drop_last=bool(drop_last), node_of_rank=[int(n) for n in node_of_rank],
                                masters=[str(m) for m in masters], owners_digest="0" * 16, samples=1)
        self.record.encode()  # too many ranks or nodes for one record: PlanRecordError now, not in a thread
        self.slot: int | None = None
        self.started = False
        self.trained = self.drawn = 0
        self.errors = 0
        self.published = 0
        self._rate_mark: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one publish at a time (the thread, and close)

    @classmethod
    def for_dataset(cls, dataset: Any, **kw: Any) -> PlanPublisher:
        """A publisher for a :class:`~client.dataset.CachedImageNet` whose cache has a Redis tier."""
        from datacache.fillstatus import status_store

        reader = dataset.reader
        pub = cls(status_store(reader.store), reader.manifest.fingerprint, reader.variant.tag(), **kw)
        hold_shared_writes(dataset)
        return pub

    # ------------------------------------------------------------ told by the sampler (training thread)
    def epoch(self, epoch: int, owners: np.ndarray, *, replanned: bool = False) -> None:
        """Epoch ``epoch`` starts with ``owners`` (the snapshot every rank plans with)."""
        r = self.record
        r.epoch, r.owners_digest, r.samples = int(epoch), owners_digest(owners), len(owners)
        r.replanned = bool(replanned)
        self.trained = self.drawn = 0
        self._rate_mark = None
        self.started = True
        self.start()

    def progress(self, *, trained: int | None = None, drawn: int | None = None) -> None:
        """Samples per rank trained / drawn by the loader so far this epoch (cheap: no I/O)."""
        if trained is not None:
            self.trained = int(trained)
            self.drawn = max(self.drawn, self.trained)
        if drawn is not None:
            self.drawn = max(int(drawn), self.trained)

    # ------------------------------------------------------------ the writer
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="datacache-plan", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.publish()
            self._stop.wait(self.interval)

    def _snapshot(self) -> bytes:
        r = self.record
        per_rank = r.samples // len(r.node_of_rank) if r.drop_last else -(-r.samples // len(r.node_of_rank))
        r.trained = min(self.trained, per_rank)
        r.drawn = min(max(self.drawn, r.trained), per_rank)
        now = time.monotonic()
        if self._rate_mark is None or r.trained < self._rate_mark[1]:
            self._rate_mark = (now, r.trained)
        elif now - self._rate_mark[0] >= 1.0:
            t0, n0 = self._rate_mark
            fresh = (r.trained - n0) / (now - t0)
            # no progress for a second (a stalled, resuming or finishing loop): rate 0, so the daemons do
            # not skip the next samples as "about to be read"; otherwise smoothed over about 2 s
            r.rate = 0.0 if fresh == 0 else (fresh if r.rate == 0 else 0.5 * r.rate + 0.5 * fresh)
            self._rate_mark = (now, r.trained)
        r.seq += 1
        return r.encode()

    def publish(self) -> bool:
        """Write the record now (claiming a slot if needed); False when it could not be written."""
        if not self.started:
            return False
        with self._lock:
            try:
                value = self._snapshot()
                client = self.store.client_for(slot_key(self.fingerprint, self.tag, 0))
                if self.slot is not None:
                    key = slot_key(self.fingerprint, self.tag, self.slot)
                    old = client.set(key, value, xx=True, px=self.ttl_ms, get=True)
                    if old is not None and _run_of(old) == self.record.run:
                        self.published += 1
                        return True
                    if old is not None:  # our slot expired (a frozen trainer) and another run took it
                        client.set(key, old, xx=True, px=self.ttl_ms)
                    self.slot = None
                for s in range(MAX_RUNS):
                    if client.set(slot_key(self.fingerprint, self.tag, s), value, nx=True, px=self.ttl_ms):
                        self.slot = s
                        self.published += 1
                        return True
                self._failed(f"all {MAX_RUNS} plan slots of this dataset are taken by live runs")
                return False
            except Exception as e:  # never into the training loop: the daemons fall back to MinIO
                self._failed(f"{type(e).__name__}: {str(e)[:200]}")
                return False

    def _failed(self, why: str) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("run plan not published (%s); the cache daemons fill this dataset without it "
                        "(MinIO: a fixed cached subset) until it is", why)

    def close(self) -> None:
        """Stop publishing and expire the record at once (the daemons stop planning for this run)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            if self.slot is None:
                return
            try:
                client = self.store.client_for(slot_key(self.fingerprint, self.tag, 0))
                key = slot_key(self.fingerprint, self.tag, self.slot)
                old = client.set(key, b"{}", xx=True, px=1, get=True)  # gone in a millisecond
                if old is not None and _run_of(old) not in (None, self.record.run):
                    client.set(key, old, xx=True, px=self.ttl_ms)  # not ours: put it back
            except Exception as e:
                log.debug("run plan: closing failed (%s); it expires in %d ms", e, self.ttl_ms)
            self.slot = None


def hold_shared_writes(dataset: Any) -> None:
    """Under a rolling fill the daemons own the window: this dataset (and every loader worker it is
    pickled to) decodes its misses and serves them without writing them back to a shared tier, even one
    opened ``?write_back=1``. Local tiers (LMDB) keep their write-back."""
    from dataclasses import replace

    from datacache.readthrough import SHARED_SCHEMES

    reader = dataset.reader
    cache = reader.cache
    tiers = tuple(replace(t, options=tuple(o for o in t.options if o[0] != "write_back"))
                  if t.scheme in SHARED_SCHEMES else t for t in cache.tiers)
    if tiers != cache.tiers:
        reader.cache = replace(cache, tiers=tiers)
        reader._reset()  # the store is opened again from the new spec: shared tiers read-only
        log.info("run plan: misses are not written back to the shared tiers (the daemons' rolling fill "
                 "owns the window)")


def _run_of(raw: bytes) -> str | None:
    try:
        return parse_record(raw).run
    except PlanRecordError:
        return None
