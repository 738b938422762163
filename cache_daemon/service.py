"""The daemon's main loop: fill passes over the configured and registered datasets, until SIGTERM.

Each round runs one :func:`~cache_daemon.ingest.ingest_pass` per dataset (config datasets first,
then the Redis registry's), then waits ``poll_interval`` seconds (or until a dataset is registered
over HTTP). A dataset that is full is re-checked every round, so a master that restarted empty is
refilled by its node's daemon on the next round. ``once=True`` (``--once``) returns after the first
round in which every dataset is full or at its budget (tests, batch warm-ups).

Threads: the passes run in a **pass thread**; the main thread only supervises (signals are always
handled in Python's main thread, which therefore never blocks on a pool, a queue or a store). Every
pass of every dataset uses the daemon's **one decode pool** (:class:`~datacache.decodepool.DecodePool`),
forked on the first pass that has something to decode and closed at shutdown; a pass over a full
dataset starts no process. A :class:`~cache_daemon.watchdog.Watchdog` gives each pass a deadline
(``pass_timeout``); a pass past it makes ``/livez`` (and ``/health``) answer 503 naming the dataset and
since when. Liveness (:meth:`Daemon.liveness`, this process's loop) is apart from readiness
(:meth:`Daemon.readiness`, this node's own store): another node's master being down fails neither.

Signals: the first SIGTERM/SIGINT sets the stop event -- the pass in progress stops submitting chunks,
finishes and writes the chunks in flight (drain), the pool's workers exit, and :meth:`Daemon.run`
returns 0. When the drain has not finished ``drain_timeout`` seconds after the signal (a stopped or
wedged worker, a frozen store), or on a second SIGTERM/SIGINT, the decode workers are SIGKILLed and
the process exits at once with :data:`EXIT_FORCED` (3) -- ``os._exit``, because the interpreter's own
exit would join the pool's threads and could block again. Chunks not yet acknowledged are decoded
again by the next run (writes are ``SET NX``: nothing is torn or duplicated).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from cache_daemon.daemon_config import DaemonConfig, DatasetSpec, source_allowed
from cache_daemon.decoders import make_decoder
from cache_daemon.heap import decode_worker_heap, release_free_heap
from cache_daemon.ingest import DatasetState, ingest_pass, plans_live
from cache_daemon.registry import register, registered, unregister
from cache_daemon.watchdog import Watchdog
from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError
from datacache.confine import redirect_guard_options
from datacache.decodepool import DecodePool
from datacache.fillstatus import read_fill, summarize
from datacache.manifest import ManifestError, validate_file_list
from datacache.redact import redact, redact_text
from datacache.stores import open_store

log = logging.getLogger("cache_daemon")
FAILED_ROUNDS_UNHEALTHY = 3  # consecutive rounds that failed before any pass: /livez (and /health) 503
PLAN_CHECK_S = 2.0  # between rounds: how often a dataset's run plans are looked for
EXIT_FORCED = 3  # SIGTERM's drain did not finish in drain_timeout (or a second signal): pool killed


class Daemon:
    """One per node (see the module docstring)."""

    def __init__(self, cfg: DaemonConfig, *, progress: bool | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        spec = parse_cache_url(cfg.cache, check=True)  # wrong credentials: a clear error now
        self.store = open_store(spec.tiers[-1])  # the shared tier itself: synchronous, acknowledged writes
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.states: dict[str, DatasetState] = {d.ident(): DatasetState(d) for d in cfg.datasets}
        # NVML only (never CUDA, never torch) before the pool forks: cache_daemon.gpu_probe
        self.decoder, workers = make_decoder(cfg.decoder, cfg.decoder_device, workers=cfg.workers,
                                             gpu_decode_workers=cfg.gpu_decode_workers)
        self.http: Any = None
        self.force = threading.Event()  # a second signal: stop without waiting for the drain
        self.stop_at = 0.0  # monotonic time of the first signal
        # forked on first use; shared by every pass; its workers undo the daemon's small mmap threshold
        self.pool = DecodePool(workers, worker_setup=decode_worker_heap)
        self.watch = Watchdog(cfg.pass_timeout, self.pool.workers)
        self.failed_rounds, self.round_error = 0, ""  # rounds that failed before their passes ran
        self.registry_error = ""  # the last registry read's failure ("" = read fine): /status shows it
        self.pass_thread: threading.Thread | None = None  # set by run(); /livez checks it is alive

    # ------------------------------------------------------------ used by the HTTP thread
    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return [s.as_json() for s in self.states.values()]

    def store_health(self) -> dict[str, Any]:
        """The whole store (every master of a cluster): ``/metrics``' ``store_up``."""
        return self.store.health()

    def liveness(self) -> dict[str, Any]:
        """``/livez``: is this daemon's own loop alive and not stuck? Asks no server (a store that is down
        is readiness, not liveness: restarting the daemon would not bring it back). ``{"ok", "reason",
        "loop"}``; not ok when the pass thread died (outside a shutdown), a pass is past its deadline, or
        rounds failed before any pass ``FAILED_ROUNDS_UNHEALTHY`` times in a row."""
        loop = self.loop_status()
        reason = None
        t = self.pass_thread  # (None before run(): a server made in-process without the loop is live)
        if t is not None and not t.is_alive() and not self.stop.is_set():
            reason = "the pass thread is not running (it died of an error: see the daemon's log)"
        elif loop["stuck"]:
            stuck = loop["stuck"]
            reason = stuck["reason"] if isinstance(stuck, dict) else str(stuck)
        return {"ok": reason is None, "reason": reason, "loop": loop}

    def readiness(self) -> dict[str, Any]:
        """``/readyz``: does this node's OWN store answer? With a Redis Cluster and ``redis_node``, that
        master only is PINGed (another node's master being down does not make this node unready);
        otherwise the store itself (``redis://``, ``lmdb://``, ``memory://``, a cluster without
        ``redis_node``). The store's health dict (``ok``, ``detail``, ...)."""
        from datacache.stores.redis_cluster import RedisClusterStore

        if self.cfg.redis_node and isinstance(self.store, RedisClusterStore):
            return self.store.node_health(self.cfg.redis_node)
        return self.store.health()

    def store_status(self) -> dict[str, Any]:
        """``/status``' ``store``: a cluster's masters (up/down, slots each), masters down, slots uncovered;
        another store's health. Never raises (a failure is the answer)."""
        from datacache.stores.redis_cluster import RedisClusterStore

        if isinstance(self.store, RedisClusterStore):
            try:
                return self.store.cluster_health()
            except Exception as e:  # no node answers CLUSTER SLOTS
                return {"ok": False, "url": self.store.url, "backend": self.store.backend,
                        "detail": redact_text(f"{type(e).__name__}: {e}")[:500]}
        return self.store.health()

    def status(self) -> dict[str, Any]:
        datasets = self.snapshot()
        for d in datasets:
            try:
                d["cluster"] = summarize(read_fill(self.store, d["fingerprint"], d["variant"]), d["total"]) \
                    if d["fingerprint"] else None
            except Exception as e:
                d["cluster"] = {"error": redact_text(f"{type(e).__name__}: {e}")[:500]}
        # source URLs are shown (operators need them); file contents never are (decode reasons carry sizes)
        return {"node": self.cfg.node, "cache": self.store.url, "ownership": self.cfg.ownership,
                "redis_node": self.cfg.redis_node, "decoder": self.cfg.decoder,
                "registration": {"enabled": bool(self.cfg.api_token and self.cfg.allowed_sources),
                                 "allowed_sources": [redact(p) for p in self.cfg.allowed_sources],
                                 "max_registrations": self.cfg.max_registrations},
                "datasets": datasets, "loop": self.loop_status(), "live": self.liveness()["ok"],
                "ready": self.readiness()["ok"], "store": self.store_status(),
                "registry": {"ok": not self.registry_error, "error": self.registry_error}}

    def register(self, body: Any) -> str:
        """Validate and register a dataset (POST /datasets); raises ConfigError with the reason. The
        source must lie under ``allowed_sources``; nothing is read or contacted before that check."""
        spec = DatasetSpec.from_dict(body, "POST /datasets")
        if redact(spec.source) != spec.source:
            # the registry (dcd:datasets) is readable by every cache client: no credential goes there
            raise ConfigError("a source URL registered over HTTP must not carry a password or a credential "
                              "query parameter (sig=, token=, X-Amz-*, ...; the registry is "
                              "readable by every cache client); give the daemon its storage credentials "
                              "through its environment or fsspec's configuration")
        if not self.cfg.allowed_sources:
            raise PermissionError("this daemon accepts no registrations over HTTP: allowed_sources is "
                                  "empty (list the permitted URL prefixes in daemon.toml, or add the dataset "
                                  "there)")
        if not source_allowed(spec.source, self.cfg.allowed_sources):
            raise PermissionError(f"source {redact(spec.source)!r} is outside allowed_sources "
                                  f"({', '.join(redact(p) for p in self.cfg.allowed_sources)})")
        try:  # a .txt/.csv list (allowed by now) is read and checked line by line: 400 naming the line
            validate_file_list(spec.source, storage_options=redirect_guard_options(
                spec.source, allow=self.cfg.allowed_sources), max_bytes=self.cfg.max_list_bytes,
                max_lines=self.cfg.max_list_lines)  # the limits of each pass too (ingest.list_limits)
        except ManifestError as e:
            raise ConfigError(f"POST /datasets: {e}") from None
        register(self.store, spec, max_registrations=self.cfg.max_registrations)
        with self.lock:  # registered: confined to allowed_sources (cache_daemon.ingest.confine_for)
            self.states.setdefault(spec.ident(), DatasetState(spec, registered=True))
        self.wake.set()
        log.info("registered %s", spec.ident())
        return spec.ident()

    def unregister(self, ident: str) -> bool:
        """Remove a registration (DELETE /datasets/{id}); ConfigError for a config dataset, False when
        no such registration exists."""
        if any(d.ident() == ident for d in self.cfg.datasets):
            raise ConfigError(f"dataset {ident!r} comes from this daemon's config file and cannot be deleted "
                              "over HTTP; remove it from daemon.toml and restart")
        removed = unregister(self.store, ident)
        with self.lock:
            self.states.pop(ident, None)
        if removed:
            log.info("unregistered %s", ident)
        return removed

    def _sync_registry(self) -> None:
        """Pass thread: adopt the registry's datasets (those under this daemon's ``allowed_sources``) and
        stop filling registered ones that were deleted (``DELETE /datasets/{id}`` on any daemon); the
        config file's datasets always stay. An unreachable registry raises (the round is retried) instead
        of reading as "every registration was deleted"."""
        # the cap holds on read too: entries written to Redis directly (not through POST) are bounded
        specs = registered(self.store, self.cfg.allowed_sources, strict=True,
                           max_registrations=self.cfg.max_registrations)
        keep = {d.ident() for d in self.cfg.datasets} | {s.ident() for s in specs}
        with self.lock:
            for spec in specs:
                self.states.setdefault(spec.ident(), DatasetState(spec, registered=True))
            for ident in [i for i in self.states if i not in keep]:
                log.info("dataset %s is no longer registered: not filled any more", ident)
                del self.states[ident]

    # ------------------------------------------------------------ main loop
    def loop_status(self) -> dict[str, Any]:
        """Liveness of the pass loop and the decode pool (``/status``, ``/livez`` and ``/health`` show it)."""
        out = self.watch.as_json()
        out["pool"] = {"created": self.pool.created, "workers": self.pool.workers, "pids": self.pool.pids()}
        out["failed_rounds"], out["round_error"] = self.failed_rounds, self.round_error
        if not out.get("stuck") and self.failed_rounds >= FAILED_ROUNDS_UNHEALTHY:
            # no pass can start while every round fails before its passes: /livez must say so
            out["stuck"] = {"reason": f"{self.failed_rounds} rounds in a row failed before any pass: "
                                      f"{self.round_error}"}
        return out

    def _handle_signal(self, signum: int, _frame: Any) -> None:
        # Runs in the main thread (Python's rule), which only supervises: setting events never blocks.
        name = signal.Signals(signum).name
        if self.stop.is_set():
            log.warning("%s received again: stopping now without waiting for the drain", name)
            self.force.set()
            return
        log.warning("%s received: draining the chunks in flight (at most %.0f s), then exiting", name,
                    self.cfg.drain_timeout)
        self.stop_at = time.monotonic()
        self.stop.set()
        self.wake.set()

    def _poll_wait(self) -> float | None:
        """Seconds to wait between rounds. Config validation refuses a non-finite ``poll_interval``;
        should one get here anyway, NaN waits the default 30 s and +inf waits for a registration or a
        signal -- never a busy loop, never an exception in the loop."""
        x = float(self.cfg.poll_interval)
        if math.isnan(x) or x <= 0:
            return 30.0
        return None if math.isinf(x) else x

    def _loop(self, once: bool) -> None:
        """The pass thread (see the module docstring); returns when stopped or, with ``once``, done."""
        while not self.stop.is_set():
            try:
                try:
                    self._sync_registry()
                    self.registry_error = ""
                except Exception as e:
                    # The registry's master is down (or unreachable): keep the datasets known so far (the
                    # config's and the last read's, none dropped) and run their passes -- this node's own
                    # share does not depend on another master. Not a failed round: restarting the daemon
                    # would not help (/livez stays 200); /status shows it under "registry".
                    if not self.registry_error:
                        log.warning("dataset registry unreadable (%s: %s): filling the datasets known so far",
                                    type(e).__name__, redact_text(str(e))[:300])
                    self.registry_error = redact_text(f"{type(e).__name__}: {e}")[:500]
                with self.lock:
                    states = list(self.states.values())
                worked = False
                for state in states:
                    if self.stop.is_set():
                        break
                    self.watch.begin(state.spec.ident())
                    before = (state.decoded, state.manifest)
                    try:
                        ingest_pass(self.cfg, state, self.store, decoder=self.decoder, stop=self.stop,
                                    progress=self.progress, pool=self.pool, watch=self.watch)
                    finally:
                        self.watch.end()
                    # the pass listed the dataset (a new manifest) or decoded: it allocated a lot
                    worked = worked or state.decoded != before[0] or state.manifest is not before[1]
                if worked:
                    release_free_heap()  # what the pass allocated and freed goes back to the OS
                self.watch.end_round()
                if once and states and all(s.status in ("full", "budget") for s in states):
                    return
                self.failed_rounds, self.round_error = 0, ""
            except Exception as e:  # an unexpected failure before the passes (a bug): next round retries
                self.failed_rounds += 1
                self.round_error = redact_text(f"{type(e).__name__}: {e}")[:500]
                log.warning("round failed (%s); retried in %s s", self.round_error, self._poll_wait())
            self._wait_round()
            self.wake.clear()

    def _wait_round(self) -> None:
        """The wait between rounds: ``poll_interval`` (or a registration / signal), cut short when a
        dataset has a live run plan (:mod:`cache_daemon.rolling`): checked every ``PLAN_CHECK_S`` seconds,
        one small read per dataset, so a run that starts is followed within about that long."""
        wait = self._poll_wait()
        end = None if wait is None else time.monotonic() + wait
        while not self.stop.is_set():
            with self.lock:
                states = list(self.states.values())
            if any(s.status == "rolling" or plans_live(self.cfg, s, self.store) for s in states):
                return
            left = PLAN_CHECK_S if end is None else min(PLAN_CHECK_S, end - time.monotonic())
            if left <= 0 or self.wake.wait(left):
                return

    def _supervise(self, worker: threading.Thread) -> bool:
        """Main thread: wait for the pass thread; False when the drain ran out of time (or a 2nd signal)."""
        while worker.is_alive():
            if self.force.is_set():
                return False
            if self.stop.is_set():
                left = self.stop_at + self.cfg.drain_timeout - time.monotonic()
                if left <= 0:
                    return False
                worker.join(min(0.1, left))
            else:
                worker.join(0.5)
        return True

    def _force_exit(self) -> None:
        log.error("daemon %s: drain not finished within %.1f s (or a second signal): killing the decode "
                  "pool and exiting with code %d; unacknowledged chunks are decoded again by the next run",
                  self.cfg.node, self.cfg.drain_timeout, EXIT_FORCED)
        self.pool.kill()
        for stream in (sys.stderr, sys.stdout):
            with contextlib.suppress(Exception):
                stream.flush()
        # Hazard: not sys.exit -- interpreter shutdown joins the pool's threads and runs its finalizer,
        # which can block for ever on a queue lock a killed worker held. Nothing is left to flush:
        # every acknowledged write is in the store already.
        os._exit(EXIT_FORCED)

    def run(self, *, once: bool = False) -> int:
        """Serve until SIGTERM/SIGINT (or ``once`` done): 0 after a clean drain, 1 when the pass thread
        died of a bug; a forced stop never returns (the process exits with :data:`EXIT_FORCED`)."""
        # Signal boundary: the handlers are this process's until run() returns; the previous ones come
        # back then, so an embedding process (a test, a notebook) does not keep a stopped daemon's
        # handler -- children it forks later would inherit it and ignore SIGTERM (Process.terminate()).
        previous = {sig: signal.signal(sig, self._handle_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._serve(once)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _serve(self, once: bool) -> int:
        from cache_daemon.http import make_server

        self.http = make_server(self, self.cfg.http_host, self.cfg.http_port)
        where = f" ({self.cfg.redis_node})" if self.cfg.redis_node else ""
        log.info("daemon %s: cache %s, ownership %s%s, %s decoder", self.cfg.node, self.store.url,
                 self.cfg.ownership, where, self.cfg.decoder)
        crashed: list[BaseException] = []

        def passes() -> None:
            try:
                self._loop(once)
            except BaseException as e:  # a bug: reported by the main thread, which exits 1
                crashed.append(e)
                log.exception("the pass loop died")

        worker = threading.Thread(target=passes, name="datacache-daemon-passes", daemon=True)
        self.pass_thread = worker  # /livez: 503 if it dies while the daemon is not stopping
        worker.start()
        if not self._supervise(worker):
            self._force_exit()
        left = self.cfg.drain_timeout - (time.monotonic() - self.stop_at if self.stop.is_set() else 0.0)
        if not self.pool.close(timeout=max(0.1, left), abort=self.force):  # still busy after the drain
            self._force_exit()
        if self.http is not None:
            self.http.shutdown()
        self.store.close()
        if crashed:
            return 1
        log.info("daemon %s stopped cleanly", self.cfg.node)
        return 0
