"""The daemon's HTTP endpoints, bound to 127.0.0.1 by default (``http_host`` to expose them).

* ``GET /health`` -- 200 ``{"ok": true, ...}`` while the daemon runs, its store answers and no fill
  pass is past its deadline; 503 with the store's detail, or the watchdog's reason in ``loop.stuck``
  (which dataset, since when), when not (systemd/Docker health checks, load balancers).
* ``GET /status`` -- JSON: node, cache, ownership, and per dataset its status, owned/done
  samples, fill fraction, fill rate (samples/s), quarantined files, and the fill reports of
  every daemon from Redis (``cluster``).
* ``GET /metrics`` -- Prometheus text format (``prometheus_client``).
* ``POST /datasets`` -- body ``{"source": "...", "short_side": 160}``: registers a dataset for every
  daemon (:mod:`cache_daemon.registry`); 201 with its id, 400 with the reason for a bad one.

The server runs in a thread of the daemon process (``ThreadingHTTPServer``); handlers only read
the daemon's state (copies under its lock) and never block on a fill pass.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("cache_daemon.http")
MAX_BODY = 64 << 10


def make_metrics(daemon: Any) -> Any:
    """A prometheus_client registry whose collector reads ``daemon`` at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    per_dataset = [  # (metric, kind, help, field of DatasetState.as_json())
        ("datacache_daemon_fill_ratio", "gauge", "cached / owned samples", "fill"),
        ("datacache_daemon_owned_samples", "gauge", "samples this node owns", "owned"),
        ("datacache_daemon_cached_samples", "gauge", "owned samples cached or known bad", "done"),
        ("datacache_daemon_fill_rate", "gauge", "samples/s of the last pass", "rate"),
        ("datacache_daemon_decoded", "counter", "samples decoded and written", "decoded"),
        ("datacache_daemon_source_bytes", "counter", "bytes read from the source", "bytes_read"),
        ("datacache_daemon_quarantined_files", "gauge", "undecodable files", "quarantined_count"),
    ]

    class Collector:
        def collect(self) -> Any:
            states = daemon.snapshot()
            for name, kind, doc, key in per_dataset:
                family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                    name, doc, labels=["dataset", "variant"])
                for s in states:
                    family.add_metric([s["source"], s["variant"]], s[key])
                yield family
            up = GaugeMetricFamily("datacache_daemon_store_up", "1 when the cache store answers")
            up.add_metric([], 1.0 if daemon.store_health()["ok"] else 0.0)
            yield up

    registry = CollectorRegistry()
    registry.register(Collector())
    return registry


def make_server(daemon: Any, host: str, port: int) -> ThreadingHTTPServer:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    metrics = make_metrics(daemon)

    class Handler(BaseHTTPRequestHandler):
        server_version = "datacache-daemon"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, (json.dumps(obj, indent=1) + "\n").encode())

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                h = daemon.store_health()
                loop = daemon.loop_status()  # the watchdog: a pass past its deadline fails the check
                ok = bool(h["ok"]) and not loop["stuck"]
                self._json(200 if ok else 503, {"ok": ok, "node": daemon.cfg.node, "store": h, "loop": loop})
            elif path == "/status":
                self._json(200, daemon.status())
            elif path == "/metrics":
                self._send(200, generate_latest(metrics), CONTENT_TYPE_LATEST)
            else:
                self._json(404, {"error": f"no such endpoint {path}; try /health, /status, /metrics"})

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != "/datasets":
                self._json(404, {"error": "POST /datasets with {\"source\": ..., \"short_side\": 160}"})
                return
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY:
                self._json(400, {"error": f"body must be 1..{MAX_BODY} bytes of JSON"})
                return
            try:
                body = json.loads(self.rfile.read(n))
                ident = daemon.register(body)
            except (ValueError, TypeError) as e:  # ConfigError is a ValueError naming the problem
                self._json(400, {"error": str(e)})
                return
            self._json(201, {"registered": ident})

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="datacache-daemon-http", daemon=True).start()
    log.info("HTTP on http://%s:%d (/health /status /metrics, POST /datasets)", host, srv.server_address[1])
    return srv
