"""Rolling fill: a dataset bigger than the cluster's memory, filled in the order live runs will read it.

With live run plans (:mod:`datacache.run_plan`) for a dataset, a daemon's pass becomes a rolling session
of short steps instead of the MinIO fill (a fixed subset, never evicted). Each step:

1. reads the dataset's plan slots (one pipelined round trip: ``GETRANGE``, bounded, and ``PTTL``); a slot
   that is malformed, oversized or has no expiry is ignored and counted (``invalid``); a run whose owners
   digest differs from this daemon's slot map, whose sample count differs from the manifest, or that was
   re-planned mid-epoch is live but *not understood*;
2. computes, for every sample this node owns, its next use over the understood runs (the earliest, in
   per-rank samples after the loaders' frontier) and whether every run has read it this epoch
   (:func:`datacache.run_plan.combine`);
3. picks the next uncached samples in next-use order, skipping those the trainers will reach before this
   node can fill them (the run's measured rate, this node's measured fill rate and a slack for the
   progress record's age; greedily: a skipped sample takes no fill time, :func:`reachable`), about
   ``STEP_FILL_S`` seconds' worth, and only once one of them would otherwise be late within ``LEAD_S``
   seconds (just in time: a window far ahead of the readers costs memory and, near an epoch's end,
   decodes of samples evicted too early);
4. makes room under the memory budget by deleting cached samples outside every live run's share of
   the window (each run keeps its soonest ``capacity / runs`` needs; one run: Belady's window), never one
   in flight (``trained <= position < drawn``), the latest needed first, and only one whose next use is
   later than the sample it makes room for (Belady's rule); when any live run is not understood, nothing
   is deleted (its needs are unknown);
5. fills them (:func:`datacache.warm.fill_missing`, the daemon's decode pool, ``SET NX``) and checks what
   landed.

A session returns to the daemon's round loop after ``SESSION_S`` seconds (other datasets get their pass)
or when no understood run is live any more (the next pass is MinIO's: nothing is deleted then). The
memory budget is the MinIO one (``memory_budget``, else the master's ``maxmemory``) kept at
``HEADROOM`` of it, so ``maxmemory`` + ``noeviction`` stays the hard guard and is never hit by design.
Presence is tracked in memory and re-checked with ``EXISTS`` every ``VERIFY_S`` seconds (a master that
restarted empty is refilled in plan order).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_daemon.record_cost import nominal_record_bytes, sampled_record_bytes
from datacache.epoch_plan import owners_digest
from datacache.run_plan import (
    IN_FLIGHT,
    MAX_RECORD_BYTES,
    MAX_TTL_S,
    NOT_READ,
    EpochOrder,
    PlanRecordError,
    RunRecord,
    combine,
    epoch_order,
    parse_record,
    slot_keys,
    uses_at,
)
from datacache.warm import fill_missing, missing_in

log = logging.getLogger("cache_daemon.rolling")
SESSION_S = 60.0  # a rolling session's length before the round loop runs again
VERIFY_S = 60.0  # presence re-checked with EXISTS this often (a restarted master is seen at once: run_id)
HEADROOM = 0.97  # of the memory budget: the rolling fill keeps below it (maxmemory stays the hard guard)
# a sample needed sooner than this (plus the fill queue ahead of it) is left to the reader: the progress
# it is computed from is up to one publish interval old (0.25 s) and a chunk of 16 takes ~0.4 s to land
SLACK_S = 0.75
STEP_FILL_S = 0.5  # one step fills about this many seconds' worth (then looks at the plans again)
MAX_STEP = 2048  # samples filled per step at most
# Just in time: fill only once some candidate would otherwise be late within LEAD_S seconds. Filling
# further ahead buys no hit (the fill keeps up) but holds memory longer, and a window that runs far
# ahead of the readers evicts, near an epoch's end, samples kept for the next epoch that then have to be
# decoded again: decodes above MinIO's (1 - f) N per epoch. Shorter, and a lag in the progress record
# or a slow step makes the fill late: misses. (A simulation of bench.bigger's node -- 800 samples, half
# cached, 80 reads/s, fill 42/s, progress 0.25 s old -- gave hit 0.98 / decodes 1.10x MinIO at 4 s,
# 1.00 / 1.16x at 5 s, 0.95 / 1.08x at 3 s; with 1 s old progress, 5 s and 2 s per step: 0.93 / 1.30x.)
LEAD_S = 4.0
IDLE_S = 0.25  # wait when a step had nothing to do
SIZE_EVERY = 50  # steps between two measurements of the records' size


@dataclass
class RollingStats:
    """What ``/status`` and ``/metrics`` report per dataset (see the module docstring)."""

    runs: int = 0  # live plans understood
    held: int = 0  # live plans not understood (their needs unknown: nothing is deleted)
    invalid: int = 0  # slots ignored at the last read (malformed, oversized, no expiry)
    window: int = 0  # owned samples cached now
    lead: int = 0  # samples cached in a row ahead of the loaders' frontier, in next-use order
    evicted: int = 0
    filled: int = 0
    hits: int = 0  # samples read while a plan was live that were cached when last seen before the read
    misses: int = 0
    fill_rate: float = 0.0
    active: bool = False
    live: list[dict[str, Any]] = field(default_factory=list)  # the understood runs' progress (<= 16)

    def as_json(self) -> dict[str, Any]:
        seen = self.hits + self.misses
        return {"active": self.active, "runs": self.runs, "held": self.held, "invalid": self.invalid,
                "window": self.window, "lead": self.lead, "evicted": self.evicted, "filled": self.filled,
                "hits": self.hits, "misses": self.misses,
                "hit_ratio": round(self.hits / seen, 4) if seen else None,
                "fill_rate": round(self.fill_rate, 1), "live": list(self.live)}


def read_runs(store: Any, fingerprint: str, tag: str) -> tuple[list[RunRecord], list[str]]:
    """The valid live records of a dataset's plan slots (one per run: the highest ``seq``), and one
    problem text per ignored slot (never its content)."""
    keys = slot_keys(fingerprint, tag)
    pipe = store.client_for(keys[0]).pipeline(transaction=False)  # (every slot on one master)
    for k in keys:
        pipe.getrange(k, 0, MAX_RECORD_BYTES)  # MAX + 1 bytes at most: "longer than MAX" is seen
        pipe.pttl(k)
    replies = pipe.execute(raise_on_error=False)
    runs: dict[str, RunRecord] = {}
    problems: list[str] = []
    for s in range(len(keys)):
        raw, ttl = replies[2 * s], replies[2 * s + 1]
        if isinstance(raw, Exception) or isinstance(ttl, Exception):
            bad = raw if isinstance(raw, Exception) else ttl
            problems.append(f"slot {s:02d}: unreadable ({type(bad).__name__})")
            continue
        if not raw:
            continue
        if not isinstance(ttl, int) or ttl < 0 or ttl > MAX_TTL_S * 1000:
            problems.append(f"slot {s:02d}: no expiry or one over {MAX_TTL_S:.0f} s (a run always sets PX)")
            continue
        try:
            rec = parse_record(bytes(raw))
        except PlanRecordError as e:
            problems.append(f"slot {s:02d}: {e}")
            continue
        if rec.run not in runs or runs[rec.run].seq < rec.seq:
            runs[rec.run] = rec
    return list(runs.values()), problems


class RollingFill:
    """One dataset's rolling fill state across sessions (kept in the daemon's per-dataset memo)."""

    def __init__(self) -> None:
        self.stats = RollingStats()
        self.own: np.ndarray | None = None  # owned dataset indices (int64, ascending)
        self.cached: np.ndarray | None = None  # bool per owned index
        self.verified_at = 0.0
        self.orders: dict[tuple[Any, ...], EpochOrder] = {}
        self.slots_of: tuple[int, np.ndarray] | None = None  # (n, slot of every index's key)
        self.prev: tuple[frozenset[tuple[str, int]], np.ndarray, np.ndarray] | None = None
        self.avg_bytes = 0.0  # Redis memory per record (_record_bytes)
        self.size_age = 0
        self.warned: set[str] = set()
        self.logged = False  # the start of rolling was logged (once per stretch of live plans)
        self.unusable: frozenset[str] = frozenset()  # live runs the last step could not reproduce
        self.run_ids: tuple[str, ...] = ()  # of the servers holding this node's samples (restart = new id)

    # ------------------------------------------------------------ plans -> next uses
    def _owners(self, store: Any, prefix: bytes, n: int, masters: list[str]) -> np.ndarray:
        if not getattr(store, "sharded", False):
            return np.full(n, -1, dtype=np.int16)
        from datacache.stores.redis_cluster import index_key_slots

        if self.slots_of is None or self.slots_of[0] != n:
            self.slots_of = (n, index_key_slots(prefix, np.arange(n)))
        addrs, table = store.slot_table()
        node = np.array([masters.index(a) if a in masters else -1 for a in addrs] + [-1], dtype=np.int16)
        at = table[self.slots_of[1]]
        return node[np.where(at >= 0, at, len(addrs))]

    def understood(self, store: Any, prefix: bytes, n: int, runs: list[RunRecord]
                   ) -> tuple[list[tuple[RunRecord, EpochOrder]], list[str]]:
        ok: list[tuple[RunRecord, EpochOrder]] = []
        held: list[str] = []
        for rec in runs:
            if rec.samples != n:
                held.append(f"run {rec.run}: plans {rec.samples} samples, the dataset has {n}")
                continue
            if rec.replanned:
                held.append(f"run {rec.run}: re-planned mid-epoch (held until its next epoch)")
                continue
            owners = self._owners(store, prefix, n, rec.masters)
            if owners_digest(owners) != rec.owners_digest:
                held.append(f"run {rec.run}: planned with another slot map (held until its next epoch)")
                continue
            key = (rec.run, rec.epoch, rec.seed, rec.exchange, rec.drop_last, tuple(rec.node_of_rank),
                   rec.owners_digest)
            order = self.orders.get(key)
            if order is None:
                order = epoch_order(rec, owners)
                self.orders = {k: v for k, v in self.orders.items() if k[0] != rec.run}  # one per run
                self.orders[key] = order
            ok.append((rec, order))
        live = {r.run for r in runs}
        self.orders = {k: v for k, v in self.orders.items() if k[0] in live}
        return ok, held

    # ------------------------------------------------------------ one step
    def step(self, cfg: Any, state: Any, store: Any, work: Any, *, decoder: Any, pool: Any,
             stop: threading.Event, node_memory: Any) -> bool:
        """One rolling step; False when no understood run is live (the caller goes back to MinIO)."""
        reader = work.reader
        n = len(reader.manifest)
        try:
            runs, problems = read_runs(store, state.fingerprint, work.tag)
        except Exception as e:  # the plans' master is down or refuses: no plan is known -> MinIO
            self._warn_once(f"unreadable {type(e).__name__}", "%s %s: run plans unreadable (%s); MinIO fill "
                            "until they can be read", state.spec.source, work.tag, type(e).__name__)
            runs, problems = [], []
        self.stats.invalid = len(problems)
        for p in problems:
            self._warn_once(p, "%s %s: run plan ignored: %s", state.spec.source, work.tag, p)
        good, held = self.understood(store, reader.prefix, n, runs)
        for h in held:
            self._warn_once(h, "%s %s: %s", state.spec.source, work.tag, h)
        self.stats.runs, self.stats.held = len(good), len(held)
        self.stats.live = [{"run": rec.run, "epoch": rec.epoch, "trained": rec.trained, "drawn": rec.drawn,
                            "rate": round(rec.rate, 1)} for rec, _ in good]
        self.unusable = frozenset(r.run for r in runs) - {rec.run for rec, _ in good}
        if not good:
            self.stats.active = False
            self.prev = None
            return False
        self.stats.active = True
        own = work.own.indices
        if self.own is None or len(self.own) != len(own) or not np.array_equal(self.own, own):
            self.own, self.cached, self.verified_at = np.asarray(own, dtype=np.int64), None, 0.0
            self.prev = None  # (another ownership: the last step's arrays are of other samples)
        assert self.own is not None
        now = time.monotonic()
        ids = _run_ids(cfg, store)
        if ids != self.run_ids:  # a master restarted (empty): what it held is gone, look again now
            self.cached, self.run_ids = None, ids
        if self.cached is None or now - self.verified_at >= VERIFY_S:
            missing = missing_in(reader, store, self.own)
            self.cached = ~np.isin(self.own, missing)
            self.verified_at = now
        cached = self.cached
        per_run = [uses_at(order, rec.trained, rec.drawn) for rec, order in good]
        u = combine(per_run, n)
        nu = u.next_use[self.own]
        consumed = u.consumed[self.own]
        self._count_reads(good, nu, consumed)

        # 3. what to fill: uncached, ahead of every frontier, reachable before the trainers get there
        ahead = (nu >= 0) & (nu != NOT_READ)
        cand = np.flatnonzero(~cached & ahead)
        cand = cand[np.argsort(nu[cand], kind="stable")]
        rate = max((rec.rate for rec, _ in good), default=0.0)  # per-rank samples/s of the fastest run
        want = min(MAX_STEP, max(16 * max(1, pool.workers if pool is not None else 1) * 2,
                                 int(self.stats.fill_rate * STEP_FILL_S)))
        if rate > 0 and len(cand):
            per = 1.0 / self.stats.fill_rate if self.stats.fill_rate > 0 else 0.0
            cand, slack = reachable(nu[cand] / rate, per, want, cand)
            if per > 0 and len(cand) and slack.min() >= LEAD_S:
                cand = cand[:0]  # just in time: nothing would be late yet (see LEAD_S)
        cand = cand[:want]

        # 4. room under the budget: delete what every run has read, latest needed first (Belady)
        used, budget = node_memory(cfg, store)
        if budget and len(cand):
            avg = self._record_bytes(reader, store, cached)
            fits = int(max(0.0, HEADROOM * budget - used) // avg)
            if fits < len(cand):
                evict: np.ndarray = np.empty(0, dtype=np.int64)
                if not held:  # a live run we do not understand may need anything: delete nothing
                    keep = self._protected(per_run, int(cached.sum()) + fits)
                    pool_e = np.flatnonzero(cached & ~keep & (nu != IN_FLIGHT))
                    pool_e = pool_e[np.argsort(-nu[pool_e], kind="stable")]
                    pairs = min(len(pool_e), len(cand) - fits)
                    better = nu[pool_e[:pairs]] > nu[cand[fits:fits + pairs]]
                    k = int(np.argmin(better)) if not better.all() else pairs
                    evict = pool_e[:k]
                cand = cand[:fits + len(evict)]
                if len(evict):
                    keys = reader.keys(self.own[evict].tolist())
                    gone = store.delete_many(keys)
                    cached[evict] = False
                    self.stats.evicted += int(gone)
        if not len(cand):
            self._finish(nu, cached)
            stop.wait(IDLE_S)
            return True

        # 5. fill them in next-use order, then see what landed
        t0 = time.monotonic()
        halt = _Halt(stop)

        def on_chunk(_rep: Any) -> None:  # the hard check after every written chunk (as MinIO's)
            if budget and node_memory(cfg, store)[0] >= HEADROOM * budget:
                halt.full = True

        rep = fill_missing(reader, self.own[cand], workers=cfg.workers or None, decoder=decoder,
                           progress=False, stop=halt, on_chunk=on_chunk, store=store,
                           store_spec=work.store_spec, pool=pool, desc=f"{cfg.node} {work.tag} rolling",
                           quiet=True)
        seconds = time.monotonic() - t0
        landed = ~np.isin(self.own[cand], missing_in(reader, store, self.own[cand]))
        cached[cand] = landed
        self.stats.filled += int(rep.written)
        state.decoded += rep.decoded
        state.bytes_read += rep.bytes_read
        state.write_errors += rep.write_errors
        state.quarantined.add(rep.quarantined)
        if rep.decoded and seconds > 0:
            fresh = rep.decoded / seconds
            old = self.stats.fill_rate
            self.stats.fill_rate = fresh if not old else 0.7 * old + 0.3 * fresh
        self._finish(nu, cached)
        return True

    def _record_bytes(self, reader: Any, store: Any, cached: np.ndarray) -> float:
        """Memory one of this dataset's records costs in Redis (:mod:`cache_daemon.record_cost`), measured
        again every ``SIZE_EVERY`` steps. Not the ``used_memory`` difference of a fill: other clients'
        buffers move it by more than a record."""
        assert self.own is not None
        self.size_age -= 1
        if self.avg_bytes and self.size_age > 0:
            return self.avg_bytes
        got = sampled_record_bytes(reader, store, self.own[np.flatnonzero(cached)], np.random.default_rng())
        if got:
            self.avg_bytes, self.size_age = got, SIZE_EVERY
            return got
        return self.avg_bytes or nominal_record_bytes(reader.variant)

    def _protected(self, per_run: list[Any], capacity: int) -> np.ndarray:
        """Owned samples no deletion may touch: each live run's soonest ``capacity / runs`` needs
        (this epoch ahead, in flight, or the next epoch's start). One run: Belady's window. Several: a
        fair share each, so a run -- or a forged plan -- can never push out what another run needs next."""
        assert self.own is not None
        keep = np.zeros(len(self.own), dtype=bool)
        share = max(1, capacity // max(1, len(per_run)))
        for u in per_run:
            nu = u.next_use[self.own]
            keep |= nu == IN_FLIGHT
            ahead = np.flatnonzero((nu >= 0) & (nu != NOT_READ))
            if len(ahead) > share:
                ahead = ahead[np.argpartition(nu[ahead], share - 1)[:share]]
            keep[ahead] = True
        return keep

    def _finish(self, nu: np.ndarray, cached: np.ndarray) -> None:
        ahead = np.flatnonzero((nu >= 0) & (nu != NOT_READ))
        order = ahead[np.argsort(nu[ahead], kind="stable")]
        run = cached[order]
        self.stats.lead = int(np.argmin(run)) if not run.all() else len(run)
        self.stats.window = int(cached.sum())

    def _count_reads(self, good: list[tuple[RunRecord, EpochOrder]], nu: np.ndarray,
                     consumed: np.ndarray) -> None:
        """Hits and misses as this daemon sees them: a sample ahead at the last step that has since been
        drawn or trained, cached or not when last seen (same runs and epochs only)."""
        assert self.cached is not None
        ident = frozenset((rec.run, rec.epoch) for rec, _ in good)
        ahead = (nu >= 0) & (nu != NOT_READ) & ~consumed  # still to be read this epoch
        if self.prev is not None and self.prev[0] == ident:
            _, prev_ahead, prev_cached = self.prev
            read = prev_ahead & ~ahead
            self.stats.hits += int((read & prev_cached).sum())
            self.stats.misses += int((read & ~prev_cached).sum())
        self.prev = (ident, ahead, self.cached.copy())

    def _warn_once(self, what: str, fmt: str, *args: Any) -> None:
        if what not in self.warned:
            self.warned.add(what)
            if len(self.warned) > 256:
                self.warned = {what}
            log.warning(fmt, *args)


def reachable(until: np.ndarray, per: float, want: int, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first ``want`` candidates (in next-use order, ``until``: seconds until the readers reach each)
    this node can fill before the readers get there with ``SLACK_S`` to spare, filling one every ``per``
    seconds in this order, and their slack. Greedy: a candidate left to the reader takes no fill time, so
    it does not make the ones behind it late (counting it would skip whole stretches at a low fill rate)."""
    keep: list[int] = []
    slack: list[float] = []
    for j in range(len(cand)):
        s = float(until[j]) - (len(keep) + 1) * per
        if s > SLACK_S:
            keep.append(j)
            slack.append(s)
            if len(keep) >= want:
                break
    return cand[np.asarray(keep, dtype=np.int64)], np.asarray(slack, dtype=np.float64)


class _Halt:
    """Stops one fill step on SIGTERM (the daemon's event) or when the node reaches the headroom."""

    def __init__(self, outer: threading.Event) -> None:
        self.outer = outer
        self.full = False

    def is_set(self) -> bool:
        return self.full or self.outer.is_set()


def _run_ids(cfg: Any, store: Any) -> tuple[str, ...]:
    """The ``run_id`` of the server(s) holding this node's samples: this node's master (a cluster), the
    one server otherwise. One ``INFO server`` each; ``()`` when it cannot be read (then nothing changes)."""
    try:
        addrs = [cfg.redis_node] if getattr(store, "sharded", False) and cfg.redis_node else store.masters()
        return tuple(str(store.node_client(a).info("server").get("run_id", "")) for a in addrs)
    except Exception:
        return ()


def session(cfg: Any, state: Any, store: Any, work: Any, rolling: RollingFill, *, decoder: Any, pool: Any,
            stop: threading.Event, node_memory: Any, report: Any = None) -> bool:
    """Rolling steps for up to ``SESSION_S`` seconds; False when no understood run was live at the start
    (the caller runs the MinIO pass instead)."""
    t0 = time.monotonic()
    first = True
    last_report = 0.0
    while not stop.is_set() and time.monotonic() - t0 < SESSION_S:
        active = rolling.step(cfg, state, store, work, decoder=decoder, pool=pool, stop=stop,
                              node_memory=node_memory)
        if not active:
            if rolling.logged:
                log.info("%s %s: no live run plan: back to the MinIO fill (nothing is deleted)",
                         state.spec.source, work.tag)
            rolling.logged = False
            return not first
        if first and not rolling.logged:
            rolling.logged = True
            log.info("%s %s: rolling fill for %d live run(s): filling in plan order, deleting what every run "
                     "has read", state.spec.source, work.tag, rolling.stats.runs)
        first = False
        state.status = "rolling"
        state.done = rolling.stats.window
        if report is not None and time.monotonic() - last_report >= 1.0:
            last_report = time.monotonic()
            report()
    return not first
