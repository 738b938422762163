"""One fill pass of one dataset: list -> own -> skip cached -> decode pool -> batched writes -> report.

A pass (:func:`ingest_pass`):

1. lists the source (the manifest is persisted and revalidated like ``CachedImageNet`` does, so
   daemons and clients agree on the fingerprint and therefore on the keys);
2. keeps the indices this daemon owns (:mod:`cache_daemon.ownership`, asked again every pass; computed
   from the indices without building the dataset's keys, and reused while the node's slots and the
   dataset are unchanged);
   **idle shortcut** (:mod:`cache_daemon.presence`): when the last pass found every owned sample
   present less than ``verify_interval`` seconds ago and the servers holding them have removed nothing
   since (same run id, same removal counters, no slot with fewer keys), the pass ends here: a full
   dataset's pass costs a few INFO/COUNTKEYSINSLOT round trips, not one ``EXISTS`` per sample;
3. **MinIO policy** (the default): if this node's Redis master is at its memory budget
   (``memory_budget``, else the master's ``maxmemory``), nothing more is filled -- the cache keeps
   what it has and the rest is served from the source, so the hit ratio equals the cached
   fraction instead of an LRU's thrashing; checked again after every written chunk;
4. runs :func:`datacache.warm.fill_missing` over the owned indices that are not cached
   (resumable, bounded in-flight chunks, SIGTERM drains) writing straight to the Redis tier, with the
   daemon's one long-lived decode pool (no process is created when nothing is missing);
5. reports ``owned``/``done`` to Redis (:mod:`datacache.fillstatus`) about once a second and at the
   end, and keeps the figures for ``/status`` and ``/metrics``.

A write is acknowledged when Redis answered ``OK`` to it (``SET NX``, atomic): a daemon killed with
SIGKILL loses at most the chunks in flight, which the next pass (or a restarted daemon) decodes again;
a record is never half written and never written twice under one key.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import posixpath
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache_daemon.daemon_config import DaemonConfig, DatasetSpec, list_limits
from cache_daemon.decoders import variant_for
from cache_daemon.ownership import Owned, owned_indices
from cache_daemon.presence import Stamp, take_stamp
from cache_daemon.record_cost import nominal_record_bytes, sampled_record_bytes
from cache_daemon.rolling import RollingFill, read_runs, session
from cache_daemon.watchdog import Watchdog
from datacache.cacheurl import parse_cache_url
from datacache.confine import redirect_guard_options
from datacache.decodepool import DecodePool, WorkerLost
from datacache.fillstatus import report_fill
from datacache.manifest import LIST_EXTENSIONS, ListLimits, Manifest
from datacache.quarantine_summary import QuarantineSummary
from datacache.readthrough import ReadThrough, manifest_dir_for
from datacache.redact import redact, redact_text
from datacache.warm import WarmReport, fill_missing, missing_in

log = logging.getLogger("cache_daemon.ingest")
REPORT_EVERY_S = 1.0
REPREPARE_S = 120.0  # while rolling: the source is listed again (revalidated) at most this often


@dataclass
class PassMemo:
    """What one pass leaves for the next -- kept apart from what is reported (never in ``/status``)."""

    manifest: Manifest | None = None  # the last pass's (revalidated in memory by the next)
    owned: Owned | None = None  # the last pass's ownership answer (reused while slots are unchanged)
    # (stamp, prefix, ownership digest, monotonic time) of the last pass that found nothing missing
    verified: tuple[Stamp, bytes, bytes, float] | None = None
    # quarantine keys of files THIS daemon failed to decode (across passes): an entry found in the store
    # counts as done only when it is here, so a forged or stale entry is re-checked by one decode
    bad_checked: set[bytes] = field(default_factory=set)
    rolling: RollingFill = field(default_factory=RollingFill)  # live run plans: cache_daemon.rolling
    work: Any = None  # the last _prepare's _Pass, reused between rolling sessions for REPREPARE_S
    work_at: float = 0.0


@dataclass
class DatasetState:
    """What the daemon reports about one dataset (``/status`` and ``/metrics`` read it), and its
    :class:`PassMemo`."""

    spec: DatasetSpec
    status: str = "pending"  # pending | listing | filling | full | budget | error
    fingerprint: str = ""
    total: int = 0
    owned: int = 0
    done: int = 0
    decoded: int = 0
    bytes_read: int = 0
    write_errors: int = 0
    pillow_fallbacks: int = 0  # DALI refused these plain JPEGs: Pillow decoded them (the family's rule)
    decoder_unavailable: int = 0  # samples left unfilled: the DALI pipeline could not run in a worker
    rate: float = 0.0
    passes: int = 0
    error: str = ""
    quarantined: QuarantineSummary = field(default_factory=QuarantineSummary)  # bounded, whatever the count
    variant_tag: str = ""  # the tag filled (its decoder family is the daemon decoder's), set by a pass
    shortcut_passes: int = 0  # passes that skipped the per-key check (nothing removed since)
    # from the registry (POST /datasets), not the config file: confined to allowed_sources (confine_for)
    registered: bool = False
    memo: PassMemo = field(default_factory=PassMemo, repr=False)

    @property
    def manifest(self) -> Manifest | None:
        """The last pass's manifest (``memo.manifest``)."""
        return self.memo.manifest

    @property
    def fill(self) -> float:
        return self.done / self.owned if self.owned else 1.0

    def as_json(self) -> dict[str, Any]:
        tag = self.variant_tag or self.spec.variant().tag()
        return {"source": redact(self.spec.source), "variant": tag, "status": self.status,
                "fingerprint": self.fingerprint, "total": self.total, "owned": self.owned, "done": self.done,
                "fill": round(self.fill, 6), "decoded": self.decoded, "rate": round(self.rate, 1),
                "bytes_read": self.bytes_read, "write_errors": self.write_errors, "passes": self.passes,
                "decoder": {"pillow_fallbacks": self.pillow_fallbacks,
                            "unavailable": self.decoder_unavailable},
                "error": self.error, "shortcut_passes": self.shortcut_passes,
                "quarantined_count": len(self.quarantined),
                "quarantined_by_reason": dict(self.quarantined.by_reason),
                "quarantined": dict(self.quarantined.examples),  # the first few, with their reasons
                "rolling": self.memo.rolling.stats.as_json()}


@dataclass
class _Pass:
    """One pass's working set, from :func:`_prepare` to :func:`_settle`."""

    reader: ReadThrough
    tag: str
    own: Owned
    stamp: Stamp | None
    store_spec: Any  # the StoreSpec the decode workers write to


class _Stop:
    """Stops a pass on SIGTERM (the daemon's event) or when the node reaches its memory budget."""

    def __init__(self, outer: threading.Event) -> None:
        self.outer = outer
        self.budget = False
        self.plan = False  # a live run plan appeared: the rolling fill takes over

    def is_set(self) -> bool:
        return self.outer.is_set() or self.budget or self.plan


def node_memory(cfg: DaemonConfig, store: Any) -> tuple[int, int]:
    """(used_memory, budget) of this node's Redis master; budget 0 = none.

    The server measured depends on the store, not on the ownership mode: a Redis Cluster -> the master
    ``redis_node`` (whatever the ownership); one Redis server -> that server. Where there is no
    per-node figure -- a cluster without ``redis_node`` (ownership ``hash``/``all``), or a store that
    is not Redis (``lmdb://``, ``memory://``) -- the answer is ``(0, 0)``: no budget, because a budget
    that can never be measured must never block (nor mark) filling. ``memory_budget`` is then
    ignored; Redis still refuses writes at its own ``maxmemory`` (counted as write errors).
    """
    masters = store.masters()
    if store.sharded:
        addr = cfg.redis_node
    else:
        addr = masters[0] if len(masters) == 1 else ""
    if not addr:
        return 0, 0
    mem = store.node_client(addr).info("memory")
    budget = cfg.memory_budget or int(mem.get("maxmemory", 0))
    return int(mem.get("used_memory", 0)), budget


def ingest_pass(cfg: DaemonConfig, state: DatasetState, store: Any, *, decoder: Any, stop: threading.Event,
                progress: bool | None = None, pool: DecodePool | None = None,
                watch: Watchdog | None = None) -> WarmReport | None:
    """One pass over ``state.spec`` (see the module docstring): :func:`_prepare`, then either
    :func:`_shortcut` or :func:`_fill` and :func:`_settle`. Never raises (errors go to ``state``).

    ``pool``: the daemon's long-lived decode pool (without one, a pass that has work forks its own);
    a worker that died mid-pass fails the pass and the pool is discarded (a fresh one next time).
    ``watch``: told how much the pass owns, so a derived deadline grows with the work."""
    try:
        memo = state.memo
        fresh = memo.work is not None and time.monotonic() - memo.work_at < REPREPARE_S
        if state.status == "rolling" and fresh:
            work = memo.work  # between two rolling sessions: no re-listing (the readers are waiting)
        else:
            work = _prepare(cfg, state, store, decoder, stop)
            memo.work, memo.work_at = work, time.monotonic()
        if plans_possible(cfg, store) and session(
                cfg, state, store, work, state.memo.rolling, decoder=decoder, pool=pool, stop=stop,
                node_memory=node_memory, report=lambda: _report(cfg, state, store, work.tag)):
            state.passes += 1
            state.memo.verified = None  # the rolling fill deletes: the next MinIO pass checks every key
            state.error = ""
            return None
        if _nothing_removed(cfg, state, work.own, work.stamp):
            return _shortcut(cfg, state, store, work)
        if watch is not None:
            watch.work(work.own.count)
        rep, at_budget = _fill(cfg, state, store, work, decoder=decoder, stop=stop, progress=progress,
                               pool=pool)
        _settle(cfg, state, store, work, rep, at_budget)
        return rep
    except Exception as e:  # a pass that fails is reported and retried on the next poll, never fatal
        if isinstance(e, WorkerLost) and pool is not None:
            pool.discard()  # its lost chunk would never come back; the next pass forks a fresh pool
        state.status, state.error = "error", redact_text(f"{type(e).__name__}: {e}")[:1000]
        state.memo.verified = None  # the next pass checks every key
        log.warning("%s: fill pass failed (%s); retried in %.0f s", state.spec.source, state.error,
                    cfg.poll_interval)
        return None


def plans_possible(cfg: DaemonConfig, store: Any) -> bool:
    """Whether run plans can drive this daemon's fill: ``rolling_fill`` on, and a Redis store (the plans
    live there; an embedded store has no second process to publish them)."""
    return cfg.rolling_fill and hasattr(store, "client_for")


def plans_live(cfg: DaemonConfig, state: DatasetState, store: Any) -> bool:
    """Whether ``state``'s dataset has a valid live run plan now (one round trip; False on any error)."""
    if not (plans_possible(cfg, store) and state.fingerprint and state.variant_tag):
        return False
    try:
        runs = read_runs(store, state.fingerprint, state.variant_tag)[0]
    except Exception:
        return False
    # a run the last rolling step could not use (another slot map, another size, re-planned) does not
    # count: the MinIO pass goes on and the wait between rounds is kept, until another run appears
    return any(r.run not in state.memo.rolling.unusable for r in runs)


def _prepare(cfg: DaemonConfig, state: DatasetState, store: Any, decoder: Any,
             stop: threading.Event) -> _Pass:
    """List (first pass: in a child process) or revalidate the source, build the confined reader, ask
    which indices this node owns and take the presence stamp (before any check: a removal after it shows
    as a change)."""
    spec = parse_cache_url(cfg.cache)
    state.status = "listing"
    persist = manifest_dir_for(spec)
    allow = confine_for(cfg, state)  # listing: HTTP redirects followed only under these
    if state.memo.manifest is None:
        list_in_child(state.spec, persist, stop, allow=allow, limits=list_limits(cfg))  # see list_in_child
    # the previous pass's manifest is revalidated in memory: no re-read of the persisted copy
    man = Manifest.build(state.spec.source, persist_dir=persist, revalidate=state.spec.revalidate,
                         reuse=state.memo.manifest, list_limits=list_limits(cfg),
                         storage_options=redirect_guard_options(state.spec.source, allow=allow))
    state.memo.manifest = man
    variant = variant_for(state.spec.variant(), decoder)  # the decoder's family: keys never mix
    state.variant_tag = variant.tag()
    reader = ReadThrough(man, variant, spec, t1_dir=None if cfg.t1_dir == "none" else cfg.t1_dir,
                         t1_max_bytes=cfg.t1_max_bytes or None,
                         record_key_file=cfg.record_key_file or None,  # MACs records and quarantine
                         confine=confine_for(cfg, state, man.root),  # every file, every read
                         writer=True, verified_bad=state.memo.bad_checked)
    state.fingerprint, state.total = man.fingerprint, len(man)
    own = owned_indices(cfg, store, reader.prefix, len(man), state.memo.owned)
    state.memo.owned = own
    state.owned = own.count
    return _Pass(reader, variant.tag(), own, _stamp(cfg, store, own), spec.tiers[-1])


def _shortcut(cfg: DaemonConfig, state: DatasetState, store: Any, work: _Pass) -> WarmReport:
    """The idle pass: nothing was removed since every owned sample was last seen present."""
    assert work.stamp is not None and state.memo.verified is not None
    state.memo.verified = (work.stamp, work.own.prefix, work.own.digest, state.memo.verified[3])
    state.done, state.passes, state.status, state.error = state.owned, state.passes + 1, "full", ""
    state.shortcut_passes += 1
    log.debug("%s %s: pass %d: nothing removed since the last check: %d owned samples present",
              state.spec.source, work.tag, state.passes, state.owned)
    _report(cfg, state, store, work.tag)
    return WarmReport(total=work.own.count, skipped=work.own.count)


def _within_budget(work: _Pass, store: Any, mine: Any, used: int, budget: int) -> tuple[Any, bool]:
    """``(what to fill, capped)``: ``mine`` when the node's budget holds all of it (or there is none),
    else the missing ones that fit in ``budget - used`` at the measured cost of a record
    (:mod:`cache_daemon.record_cost`), lowest indices first. Without the cap a pass would write every
    record in flight when ``used_memory`` crossed the budget: up to the decode pool's chunks in flight,
    far over a small budget (issue 36: 36 records past it on a 3.7 MB test budget)."""
    if not budget:
        return mine, False
    room = budget - used
    cost = nominal_record_bytes(work.reader.variant)
    if room >= len(mine) * cost * 2:  # everything fits twice over (the usual pass): no extra round trips
        return mine, False
    missing = missing_in(work.reader, store, mine)
    cached = np.setdiff1d(np.asarray(mine, dtype=np.int64), missing, assume_unique=True)
    cost = sampled_record_bytes(work.reader, store, cached, np.random.default_rng()) or cost
    fits = max(0, int(room // cost))
    if fits >= len(missing):
        return missing, False
    return missing[:fits], True


def _fill(cfg: DaemonConfig, state: DatasetState, store: Any, work: _Pass, *, decoder: Any,
          stop: threading.Event, progress: bool | None, pool: DecodePool | None
          ) -> tuple[WarmReport | None, bool]:
    """Decode and write what this node owns and lacks, unless the node is at its memory budget (checked
    before and after every written chunk); reports about once a second. ``(report or None when nothing
    was filled, at the budget)``."""
    mine = work.own.indices  # (int64, a third of the dataset on 3 nodes: held only while this pass runs)
    halt = _Stop(stop)
    last = [0.0]
    seen_q = [0]  # entries of the fill report's quarantine already added to the summary
    base_decoded, base_bytes = state.decoded, state.bytes_read
    t0 = time.monotonic()

    def on_chunk(rep: WarmReport) -> None:
        state.decoded, state.bytes_read = base_decoded + rep.decoded, base_bytes + rep.bytes_read
        if len(rep.quarantined) > seen_q[0]:  # only the new ones (the report's dict only grows)
            state.quarantined.add(dict(itertools.islice(rep.quarantined.items(), seen_q[0], None)))
            seen_q[0] = len(rep.quarantined)
        state.done = done_before + rep.skipped + rep.written + len(rep.quarantined)
        state.rate = (rep.decoded + len(rep.quarantined)) / max(1e-6, time.monotonic() - t0)
        used, budget = node_memory(cfg, store)  # one INFO per written chunk
        if budget and used >= budget:
            halt.budget = True
        if time.monotonic() - last[0] >= REPORT_EVERY_S:
            last[0] = time.monotonic()
            _report(cfg, state, store, work.tag)
            if plans_live(cfg, state, store):  # a run published its plan: fill in its order instead
                halt.plan = True

    used, budget = node_memory(cfg, store)
    if budget and used >= budget:
        halt.budget = True  # MinIO policy: the node keeps what it has, nothing more is filled
    state.status = "filling"
    if halt.budget:
        return None, True
    todo, capped = _within_budget(work, store, mine, used, budget)
    if capped and not len(todo):  # not one more record fits
        return None, True
    done_before = len(mine) - len(todo)  # (owned samples this pass does not visit: cached)
    rep = fill_missing(work.reader, todo, workers=cfg.workers or None, decoder=decoder,
                       progress=sys.stderr.isatty() if progress is None else progress, stop=halt,
                       on_chunk=on_chunk, store=store, store_spec=work.store_spec, pool=pool,
                       desc=f"{cfg.node} {work.tag}")
    state.write_errors += rep.write_errors
    state.pillow_fallbacks += rep.pillow_fallbacks
    state.decoder_unavailable += rep.decoder_unavailable
    state.quarantined.add(rep.quarantined)
    if rep.decoder_unavailable:
        log.warning("%s %s: %d samples left unfilled this pass: the %s decoder could not run in a decode "
                    "worker (see the worker's warning above); they are retried next pass, never filled with "
                    "another decoder's pixels", state.spec.source, work.tag, rep.decoder_unavailable,
                    work.reader.variant.decoder_family)
    if rep.pillow_fallbacks:
        log.info("%s %s: %d plain JPEGs that DALI refused were decoded by Pillow (the family's rule for "
                 "files DALI cannot decode)", state.spec.source, work.tag, rep.pillow_fallbacks)
    # capped: the rest did not fit (at the budget as far as this pass can tell: the next pass measures
    # again and fills what then fits)
    return rep, halt.budget or capped


def _settle(cfg: DaemonConfig, state: DatasetState, store: Any, work: _Pass, rep: WarmReport | None,
            at_budget: bool) -> None:
    """Count what is still missing, decide the status (full / budget / filling), remember whether the
    next pass may take the shortcut, log and report."""
    mine = work.own.indices
    # nothing was missing when the fill looked: no second round trip (a full dataset's pass is cheap)
    missing = 0 if rep is not None and rep.skipped == len(mine) else len(missing_in(work.reader, store, mine))
    used, budget = node_memory(cfg, store)
    refused = rep is not None and rep.write_errors > 0  # Redis answered OOM: the node is at its budget
    at_budget = at_budget or bool(budget and missing and (refused or used >= 0.98 * budget))
    state.done = state.owned - missing
    state.passes += 1
    # every owned sample was seen present after the stamp was taken: later passes may trust it
    state.memo.verified = (None if missing or work.stamp is None
                           else (work.stamp, work.own.prefix, work.own.digest, time.monotonic()))
    status = "full" if not missing else ("budget" if at_budget else "filling")
    if at_budget and missing:
        log.warning("%s: node %s reached its memory budget (%d of %d bytes): %d of %d owned samples stay "
                    "uncached and are served from the source (MinIO policy)", state.spec.source, cfg.node,
                    used, budget, missing, state.owned)
    state.error = ""
    log.info("%s %s: pass %d: owned %d, cached %d, decoded %d, skipped %d (already cached), status %s",
             state.spec.source, work.tag, state.passes, state.owned, state.done,
             rep.decoded if rep else 0, rep.skipped if rep else 0, status)
    # the report first, then the local status: a node whose /status says "full" has already
    # published the figures every peer's cluster summary reads (best effort: a failed write is logged)
    _report(cfg, state, store, work.tag)
    state.status = status


# the source (and where redirects may lead) travel in the environment, never on the command line: a
# presigned source's signature or a userinfo password would be public in ``ps``; /proc/PID/environ is
# readable by this user only
LIST_CODE = ("import json, os, sys\nfrom datacache.manifest import ListLimits, Manifest\n"
             "from datacache.confine import redirect_guard_options\n"
             "a = json.loads(os.environ.pop('DATACACHE_LIST_ARGS'))\n"
             "opts = redirect_guard_options(a['source'], allow=a['allow'] or None)\n"
             "Manifest.build(a['source'], persist_dir=sys.argv[1], revalidate=sys.argv[2],\n"
             "               storage_options=opts,\n"
             "               list_limits=ListLimits(int(sys.argv[3]), int(sys.argv[4])))\n")


def confine_for(cfg: DaemonConfig, state: DatasetState, root: str | None = None) -> tuple[str, ...]:
    """The prefixes every file of ``state``'s dataset must really lie under (``Source(confine=)``), and
    HTTP redirects may lead to: a dataset registered over HTTP (``state.registered``), ``allowed_sources``
    only; one from the config file, its own root (``root``: the manifest's; by default the source, or a
    file list's directory) plus ``allowed_sources`` -- so a symlink farm whose links point elsewhere needs
    those targets in ``allowed_sources``."""
    if state.registered:  # (a registration equal to a config entry keeps the config's state: service.py)
        return tuple(cfg.allowed_sources)
    spec = state.spec
    if root is None:
        bare = spec.source.split("?", 1)[0].rstrip("/")
        root = posixpath.dirname(bare) if bare.lower().endswith(LIST_EXTENSIONS) else spec.source
    return (root, *cfg.allowed_sources)


def list_in_child(spec: DatasetSpec, persist_dir: str, stop: threading.Event,
                  allow: Sequence[str] = (), limits: ListLimits | None = None) -> bool:
    """List (or revalidate) ``spec``'s source in a short-lived child process that persists the manifest,
    so this long-lived daemon only *loads* it. Listing in-process churns through ~1 KB of short-lived
    fsspec objects per file and leaves tens of MB more resident than the manifest at ImageNet scale for
    the daemon's whole life (allocator retention: nothing is referenced;
    bench/results/NOTES.md#listing-memory); loading allocates the columns in a few large blocks. False when
    the child failed (the caller then lists in-process, which raises the listing's own clear error).

    Process boundary: ``subprocess`` (fork + exec of this interpreter, safe beside the daemon's
    threads); the child is killed when ``stop`` is set (SIGTERM of the daemon), and its output is kept
    only for the log (never file contents: the listing reads names and sizes only)."""
    # allow: where HTTP redirects may lead (datacache.confine.redirect_guard_options; () = under the source)
    lim = limits or ListLimits()  # a file list: the same bounds as the daemon's own listing
    cmd = [sys.executable, "-c", LIST_CODE, persist_dir, spec.revalidate, str(lim.max_bytes),
           str(lim.max_lines)]
    env = {**os.environ, "DATACACHE_LIST_ARGS": json.dumps({"source": spec.source, "allow": list(allow)})}
    # stderr to a file, not a pipe: a child writing more than a pipe holds would block while we wait
    with tempfile.TemporaryFile() as errf:
        try:
            child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env=env)
        except OSError as e:
            log.warning("%s: cannot start the listing process (%s); listing in the daemon", spec.source, e)
            return False
        while child.poll() is None:
            if stop.is_set():
                child.kill()
                child.wait()
                return False
            stop.wait(0.2)
        errf.seek(0)
        err = errf.read()[-2000:].decode("utf-8", "replace")
    if child.returncode != 0:
        log.warning("%s: the listing process failed (exit %d): %s; listing in the daemon", spec.source,
                    child.returncode, err.strip().splitlines()[-1:] or "")
        return False
    return True


def _stamp(cfg: DaemonConfig, store: Any, own: Owned) -> Stamp | None:
    """The presence stamp of the servers holding ``own`` (None when the store has none or it failed:
    this pass and the next then check every key)."""
    if cfg.verify_interval <= 0:
        return None
    try:
        return take_stamp(cfg, store, own.slots)
    except Exception as e:  # a server down or refusing INFO: no shortcut, the full check decides
        log.debug("presence stamp failed (%s: %s); checking every key", type(e).__name__, e)
        return None


def _nothing_removed(cfg: DaemonConfig, state: DatasetState, own: Owned, stamp: Stamp | None) -> bool:
    """Whether this pass may skip the per-key check (see :mod:`cache_daemon.presence`)."""
    v = state.memo.verified
    if stamp is None or v is None:  # (``verified`` is set only by a pass that found nothing missing)
        return False
    old, prefix, digest, when = v
    fresh = time.monotonic() - when < cfg.verify_interval
    return fresh and (prefix, digest) == (own.prefix, own.digest) and old.covers(stamp)


def _report(cfg: DaemonConfig, state: DatasetState, store: Any, tag: str) -> None:
    try:
        report_fill(store, state.fingerprint, tag, cfg.node, owned=state.owned, done=state.done,
                    quarantined=len(state.quarantined), total=state.total, rate=state.rate)
    except Exception as e:  # reporting is best effort: the fill itself goes on
        log.debug("fill report failed: %s", e)
