"""The daemon's main loop: fill passes over the configured and registered datasets, until SIGTERM.

Each round runs one :func:`~cache_daemon.ingest.ingest_pass` per dataset (config datasets first,
then the Redis registry's), then waits ``poll_interval`` seconds (or until a dataset is registered
over HTTP). A dataset that is full is re-checked every round, so a master that restarted empty is
refilled by its node's daemon on the next round. ``once=True`` (``--once``) returns after the first
round in which every dataset is full or at its budget (tests, batch warm-ups).

Signals: SIGTERM and SIGINT set the stop event -- the pass in progress stops submitting chunks,
finishes and writes the chunks in flight (drain), reports, and :meth:`Daemon.run` returns 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from cache_daemon.config import DaemonConfig, DatasetSpec, source_allowed
from cache_daemon.decoders import make_decoder
from cache_daemon.ingest import DatasetState, ingest_pass
from cache_daemon.registry import register, registered, unregister
from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError
from datacache.fillstatus import read_fill, summarize

log = logging.getLogger("cache_daemon")


class Daemon:
    """One per node (see the module docstring)."""

    def __init__(self, cfg: DaemonConfig, *, progress: bool | None = None) -> None:
        self.cfg = cfg
        self.progress = progress
        spec = parse_cache_url(cfg.cache, check=True)  # wrong credentials: a clear error now
        self.store = spec.tiers[-1].open()  # the shared tier itself: synchronous, acknowledged writes
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.states: dict[str, DatasetState] = {d.ident(): DatasetState(d) for d in cfg.datasets}
        self.decoder = make_decoder(cfg.decoder)
        self.http: Any = None

    # ------------------------------------------------------------ used by the HTTP thread
    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return [s.as_json() for s in self.states.values()]

    def store_health(self) -> dict[str, Any]:
        return self.store.health()

    def status(self) -> dict[str, Any]:
        datasets = self.snapshot()
        for d in datasets:
            try:
                d["cluster"] = summarize(read_fill(self.store, d["fingerprint"], d["variant"]), d["total"]) \
                    if d["fingerprint"] else None
            except Exception as e:
                d["cluster"] = {"error": f"{type(e).__name__}: {e}"}
        # source URLs are shown (operators need them); file contents never are (decode reasons carry sizes)
        return {"node": self.cfg.node, "cache": self.store.url, "ownership": self.cfg.ownership,
                "redis_node": self.cfg.redis_node, "decoder": self.cfg.decoder,
                "registration": {"enabled": bool(self.cfg.api_token and self.cfg.allowed_sources),
                                 "allowed_sources": list(self.cfg.allowed_sources),
                                 "max_registrations": self.cfg.max_registrations},
                "datasets": datasets}

    def register(self, body: Any) -> str:
        """Validate and register a dataset (POST /datasets); raises ConfigError with the reason. The
        source must lie under ``allowed_sources``; nothing is read or contacted before that check."""
        spec = DatasetSpec.from_dict(body, "POST /datasets")
        if not self.cfg.allowed_sources:
            raise PermissionError("this daemon accepts no registrations over HTTP: allowed_sources is "
                                  "empty (list the permitted URL prefixes in daemon.toml, or add the dataset "
                                  "there)")
        if not source_allowed(spec.source, self.cfg.allowed_sources):
            raise PermissionError(f"source {spec.source!r} is outside allowed_sources "
                                  f"({', '.join(self.cfg.allowed_sources)})")
        register(self.store, spec, max_registrations=self.cfg.max_registrations)
        with self.lock:
            self.states.setdefault(spec.ident(), DatasetState(spec))
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

    # ------------------------------------------------------------ main loop
    def _handle_signal(self, signum: int, _frame: Any) -> None:
        log.warning("%s received: draining the chunks in flight, then exiting", signal.Signals(signum).name)
        self.stop.set()
        self.wake.set()

    def run(self, *, once: bool = False) -> int:
        signal.signal(signal.SIGTERM, self._handle_signal)
        signal.signal(signal.SIGINT, self._handle_signal)
        from cache_daemon.http import make_server

        self.http = make_server(self, self.cfg.http_host, self.cfg.http_port)
        where = f" ({self.cfg.redis_node})" if self.cfg.redis_node else ""
        log.info("daemon %s: cache %s, ownership %s%s, %s decoder", self.cfg.node, self.store.url,
                 self.cfg.ownership, where, self.cfg.decoder)
        try:
            while not self.stop.is_set():
                for spec in registered(self.store, self.cfg.allowed_sources):
                    with self.lock:
                        self.states.setdefault(spec.ident(), DatasetState(spec))
                with self.lock:
                    states = list(self.states.values())
                for state in states:
                    if self.stop.is_set():
                        break
                    ingest_pass(self.cfg, state, self.store, decoder=self.decoder, stop=self.stop,
                                progress=self.progress)
                if once and states and all(s.status in ("full", "budget") for s in states):
                    break
                self.wake.wait(self.cfg.poll_interval)
                self.wake.clear()
        finally:
            if self.http is not None:
                self.http.shutdown()
            self.store.close()
        log.info("daemon %s stopped cleanly", self.cfg.node)
        return 0
