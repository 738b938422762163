"""The daemon's HTTP endpoints, bound to 127.0.0.1 by default (``http_host`` to expose them).

* ``GET /livez`` -- liveness: 200 while this daemon's own loop is alive and not stuck (the pass thread
  runs, no fill pass is past its deadline, rounds do not fail before their passes
  ``FAILED_ROUNDS_UNHEALTHY`` times in a row); 503 with the reason in ``loop.stuck`` when not. It
  asks no server: a restart of the daemon would help exactly when it is 503 (wire the liveness probe of
  systemd/Docker/Kubernetes here).
* ``GET /readyz`` -- readiness: 200 while this node's OWN store answers -- ``redis_node`` for a Redis
  Cluster (that master is PINGed, no other), the store itself for ``redis://``, ``lmdb://``,
  ``memory://``; 503 with the detail when not. Another node's master being down fails neither.
* ``GET /health`` -- live AND ready (200 or 503; ``live``, ``ready``, ``store`` = the readiness detail,
  ``loop``): what an operator or load balancer checks.
* ``GET /status`` -- JSON: node, cache, ownership, per dataset its status, owned/done samples, fill
  fraction, fill rate (samples/s), quarantined files, the fill reports of every daemon from Redis
  (``cluster``); ``store``: the whole cluster as this daemon sees it (masters down, slots uncovered);
  ``live``/``ready``; ``http``: connections, evictions, refusals, request deadline.
* ``GET /metrics`` -- Prometheus text format (``prometheus_client``).
* ``POST /datasets`` -- body ``{"source": "...", "short_side": 160}`` with ``Authorization: Bearer
  <api_token>``: registers a dataset under ``allowed_sources`` for every daemon
  (:mod:`cache_daemon.registry`); 201 with its id; 400 bad body, 401 missing/wrong token, 403 no token
  configured or source not allowed, 408 body not sent within the request deadline, 413 body too large.
* ``DELETE /datasets/{id}`` -- same token; removes a registration (id as returned by POST, URL-quoted);
  200, 404 when there is none, 409 for a dataset from the config file.

GET endpoints are unauthenticated and read-only. Every malformed request gets a 4xx JSON error
(``{"error": "..."}``), never a traceback or a dropped connection; a wrong method gets 405 with ``Allow``.

Slow clients are bounded (:class:`cache_daemon.http_server.BoundedHTTPServer`): at most 64 connections at
once, each request complete within 10 s, the oldest waiting connection evicted at the cap (measured with
1,000 slow clients in ``tests/test_http_limits.py``).

The server runs in a thread of the daemon process; handlers only read the daemon's state (copies under
its lock) and never block on a fill pass.
"""

from __future__ import annotations

import hmac
import logging
import threading
import urllib.parse
from typing import Any

from cache_daemon.http_server import (
    MAX_CONNECTIONS,
    REQUEST_DEADLINE,
    BoundedHTTPServer,
    Handler,
    RequestError,
)

log = logging.getLogger("cache_daemon.http")
ALLOW = {"/health": "GET", "/livez": "GET", "/readyz": "GET", "/status": "GET", "/metrics": "GET",
         "/datasets": "POST"}
ENDPOINTS = "GET /livez, /readyz, /health, /status, /metrics, POST /datasets, DELETE /datasets/<id>"
ENABLE_HINT = ("set api_token_file (or api_token, or DATACACHE_DAEMON_API_TOKEN) and allowed_sources in "
               "daemon.toml to enable registration over HTTP")


def make_metrics(daemon: Any) -> Any:
    """A prometheus_client registry whose collector reads ``daemon`` at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from datacache.redact import redact_text

    per_dataset = [  # (metric, kind, help, field of DatasetState.as_json())
        ("datacache_daemon_fill_ratio", "gauge", "cached / owned samples", "fill"),
        ("datacache_daemon_owned_samples", "gauge", "samples this node owns", "owned"),
        ("datacache_daemon_cached_samples", "gauge", "owned samples cached or known bad", "done"),
        ("datacache_daemon_fill_rate", "gauge", "samples/s of the last pass", "rate"),
        ("datacache_daemon_decoded", "counter", "samples decoded and written", "decoded"),
        ("datacache_daemon_source_bytes", "counter", "bytes read from the source", "bytes_read"),
        ("datacache_daemon_quarantined_files", "gauge", "undecodable files", "quarantined_count"),
        # the rolling fill (cache_daemon.rolling): live run plans of the dataset
        ("datacache_daemon_rolling_active", "gauge", "1 while live run plans drive the fill",
         "rolling.active"),
        ("datacache_daemon_rolling_runs", "gauge", "live run plans understood", "rolling.runs"),
        ("datacache_daemon_rolling_held_runs", "gauge", "live run plans not understood (no deletion)",
         "rolling.held"),
        ("datacache_daemon_rolling_invalid_plans", "gauge", "plan slots ignored (malformed, oversized, no "
         "expiry)", "rolling.invalid"),
        ("datacache_daemon_rolling_window_samples", "gauge", "owned samples cached now", "rolling.window"),
        ("datacache_daemon_rolling_lead_samples", "gauge", "samples cached in a row ahead of the loaders",
         "rolling.lead"),
        ("datacache_daemon_rolling_evicted", "counter", "samples deleted after the runs read them",
         "rolling.evicted"),
        ("datacache_daemon_rolling_filled", "counter", "samples filled in plan order", "rolling.filled"),
        ("datacache_daemon_rolling_hits", "counter", "samples read while a plan was live, cached when last "
         "seen", "rolling.hits"),
        ("datacache_daemon_rolling_misses", "counter", "samples read while a plan was live, not cached",
         "rolling.misses"),
    ]

    class Collector:
        def collect(self) -> Any:
            states = daemon.snapshot()
            for name, kind, doc, key in per_dataset:
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                    name, doc, labels=["dataset", "variant"])
                for s in states:  # labels are public (any scraper): redacted whatever the state holds
                    value = s
                    for part in key.split("."):  # "rolling.window": a field of a nested object
                        value = value[part]
                    family.add_metric([redact_text(s["source"]), redact_text(s["variant"])], float(value))
                yield family
            # per live run: its progress as the daemons read it (run ids are random, not secrets)
            run_docs = (("epoch", "the run's epoch"), ("trained", "samples per rank trained this epoch"),
                        ("drawn", "samples per rank drawn by its loaders"), ("rate", "samples/s per rank"))
            run_labels = ["dataset", "variant", "run"]
            run_fams = [GaugeMetricFamily(f"datacache_daemon_run_{k}", doc, labels=run_labels)
                        for k, doc in run_docs]
            for s in states:
                for run in s["rolling"]["live"]:
                    labels = [redact_text(s["source"]), redact_text(s["variant"]), run["run"]]
                    for fam, k in zip(run_fams, ("epoch", "trained", "drawn", "rate")):
                        fam.add_metric(labels, float(run[k]))
            yield from run_fams
            for name, doc, value in (
                    ("datacache_daemon_store_up", "1 when the cache store answers (every master of it)",
                     daemon.store_health()["ok"]),
                    ("datacache_daemon_live", "1 when the daemon's loop is alive and not stuck (/livez)",
                     daemon.liveness()["ok"]),
                    ("datacache_daemon_ready", "1 when this node's own store answers (/readyz)",
                     daemon.readiness()["ok"])):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], 1.0 if value else 0.0)
                yield g

    registry = CollectorRegistry()
    registry.register(Collector())
    return registry


def make_server(daemon: Any, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
                request_deadline: float = REQUEST_DEADLINE) -> BoundedHTTPServer:
    """Serve ``daemon`` on ``host:port`` from a thread of this process (see the module docstring)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    metrics = make_metrics(daemon)
    token = daemon.cfg.api_token.encode()

    class DaemonHandler(Handler):
        def _route(self) -> None:
            path = urllib.parse.urlsplit(self.path).path if self.path.startswith("/") else self.path
            allow = ALLOW.get(path) or ("DELETE" if path.startswith("/datasets/") else None)
            if allow is None:
                raise RequestError(404, f"no such endpoint {path[:100]!r}; try {ENDPOINTS}")
            if self.command not in (allow, "HEAD" if allow == "GET" else allow):
                raise RequestError(405, f"{self.command[:20]} is not allowed on {path[:100]}; use {allow}",
                                   {"Allow": allow})
            node = daemon.cfg.node
            if path == "/livez":  # the daemon's own loop only: no server is asked
                live = daemon.liveness()
                self._json(200 if live["ok"] else 503, {"ok": live["ok"], "node": node, **live})
            elif path == "/readyz":  # this node's own store only
                ready = daemon.readiness()
                self._json(200 if ready["ok"] else 503, {"ok": ready["ok"], "node": node, "store": ready})
            elif path == "/health":  # live AND ready
                live, ready = daemon.liveness(), daemon.readiness()
                ok = bool(live["ok"] and ready["ok"])
                self._json(200 if ok else 503, {"ok": ok, "node": node, "live": live["ok"],
                                                "ready": ready["ok"], "store": ready, "loop": live["loop"]})
            elif path == "/status":
                self._json(200, {**daemon.status(), "http": srv.stats()})
            elif path == "/metrics":
                self._send(200, generate_latest(metrics), CONTENT_TYPE_LATEST)
            elif path == "/datasets":
                self._authorise()
                body = self._body()
                try:
                    ident = daemon.register(body)
                except PermissionError as e:
                    raise RequestError(403, str(e)) from None
                except (ValueError, TypeError) as e:  # ConfigError is a ValueError naming the problem
                    raise RequestError(400, str(e)) from None
                self._json(201, {"registered": ident})
            else:
                self._authorise()
                try:
                    ident = urllib.parse.unquote(path[len("/datasets/"):], errors="strict")
                except UnicodeDecodeError:
                    raise RequestError(400, "dataset id is not URL-quoted UTF-8") from None
                try:
                    removed = daemon.unregister(ident)
                except ValueError as e:
                    raise RequestError(409, str(e)) from None
                if not removed:
                    raise RequestError(404, f"no registered dataset {ident[:300]!r} (ids are source|variant, "
                                            "as POST /datasets and GET /status show them)")
                self._json(200, {"deleted": ident})

        def _authorise(self) -> None:
            if not token:
                raise RequestError(403, f"registration over HTTP is disabled on this daemon: {ENABLE_HINT}")
            got = self.headers.get("Authorization", "")
            scheme, _, value = got.partition(" ")
            # constant-time comparison: the token's bytes are not guessable from response times
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode("utf-8", "replace"),
                                                                     token):
                raise RequestError(401, "missing or wrong token: send 'Authorization: Bearer <api_token>'",
                                   {"WWW-Authenticate": "Bearer"})

    srv = BoundedHTTPServer((host, port), DaemonHandler, max_connections=max_connections,
                            request_deadline=request_deadline)
    threading.Thread(target=srv.serve_forever, name="datacache-daemon-http", daemon=True).start()
    log.info("HTTP on http://%s:%d (/livez /readyz /health /status /metrics, POST/DELETE /datasets %s; "
             "at most %d connections, %g s per request)", host, srv.server_address[1],
             "with the API token" if token else "disabled: no api_token", max_connections, request_deadline)
    return srv
