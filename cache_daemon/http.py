"""The daemon's HTTP endpoints, bound to 127.0.0.1 by default (``http_host`` to expose them).

* ``GET /health`` -- 200 ``{"ok": true, ...}`` while the daemon runs, its store answers and no fill
  pass is past its deadline; 503 with the store's detail, or the watchdog's reason in ``loop.stuck``
  (which dataset, since when), when not (systemd/Docker health checks, load balancers).
* ``GET /status`` -- JSON: node, cache, ownership, and per dataset its status, owned/done
  samples, fill fraction, fill rate (samples/s), quarantined files, and the fill reports of
  every daemon from Redis (``cluster``).
* ``GET /metrics`` -- Prometheus text format (``prometheus_client``).
* ``POST /datasets`` -- body ``{"source": "...", "short_side": 160}`` with ``Authorization: Bearer
  <api_token>``: registers a dataset under ``allowed_sources`` for every daemon
  (:mod:`cache_daemon.registry`); 201 with its id; 400 bad body, 401 missing/wrong token, 403 no token
  configured or source not allowed, 413 body too large.
* ``DELETE /datasets/{id}`` -- same token; removes a registration (id as returned by POST, URL-quoted);
  200, 404 when there is none, 409 for a dataset from the config file.

GET endpoints are unauthenticated and read-only. Every malformed request gets a 4xx JSON error
(``{"error": "..."}``), never a traceback or a dropped connection; a wrong method gets 405 with ``Allow``.

The server runs in a thread of the daemon process (``ThreadingHTTPServer``); handlers only read
the daemon's state (copies under its lock) and never block on a fill pass.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("cache_daemon.http")
MAX_BODY = 64 << 10
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request (a stalled body is not a hang)
ALLOW = {"/health": "GET", "/status": "GET", "/metrics": "GET", "/datasets": "POST"}
ENABLE_HINT = ("set api_token_file (or api_token, or DATACACHE_DAEMON_API_TOKEN) and allowed_sources in "
               "daemon.toml to enable registration over HTTP")


class RequestError(Exception):
    """A request the daemon refuses: HTTP status + one-line reason (sent as JSON)."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}


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
    token = daemon.cfg.api_token.encode()

    class Handler(BaseHTTPRequestHandler):
        server_version = "datacache-daemon"
        timeout = REQUEST_TIMEOUT

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json",
                  headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
            self._send(code, (json.dumps(obj, indent=1) + "\n").encode(), headers=headers)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            # the stdlib's own refusals (bad request line, oversize or too many headers, bad version):
            # JSON like ours, and the connection is closed (the rest of the request is not trusted)
            self.close_connection = True
            if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # unparsed line: answer HTTP/1.0
                self.request_version = "HTTP/1.0"
            with contextlib.suppress(OSError):  # the client already went away
                self._json(code, {"error": message or self.responses.get(code, ("error",))[0]})

        def __getattr__(self, name: str) -> Any:
            if name.startswith("do_"):  # any other method (PUT, PATCH, FOO...): 405, not the stdlib's 501
                return self._dispatch
            raise AttributeError(name)

        def do_GET(self) -> None:
            self._dispatch()

        def do_POST(self) -> None:
            self._dispatch()

        def do_DELETE(self) -> None:
            self._dispatch()

        def _dispatch(self) -> None:
            try:
                self._route()
            except RequestError as e:
                self.close_connection = True
                self._json(e.code, {"error": str(e)}, e.headers)
            except Exception as e:  # a bug or a store failure: logged once, answered, server keeps going
                log.exception("HTTP %s %s failed", self.command, self.path[:200])
                self.close_connection = True
                self._json(503, {"error": f"the daemon could not answer ({type(e).__name__}); see its log"})

        def _route(self) -> None:
            path = urllib.parse.urlsplit(self.path).path if self.path.startswith("/") else self.path
            allow = ALLOW.get(path) or ("DELETE" if path.startswith("/datasets/") else None)
            if allow is None:
                raise RequestError(404, f"no such endpoint {path[:100]!r}; try GET /health, /status, "
                                        "/metrics, POST /datasets, DELETE /datasets/<id>")
            if self.command not in (allow, "HEAD" if allow == "GET" else allow):
                raise RequestError(405, f"{self.command[:20]} is not allowed on {path[:100]}; use {allow}",
                                   {"Allow": allow})
            if path == "/health":
                h = daemon.store_health()
                loop = daemon.loop_status()  # the watchdog: a pass past its deadline fails the check
                ok = bool(h["ok"]) and not loop["stuck"]
                self._json(200 if ok else 503, {"ok": ok, "node": daemon.cfg.node, "store": h, "loop": loop})
            elif path == "/status":
                self._json(200, daemon.status())
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

        def _body(self) -> Any:
            if self.headers.get("Transfer-Encoding"):
                raise RequestError(411, "send the JSON body with a Content-Length (no Transfer-Encoding)")
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise RequestError(411, f"Content-Length is required (1..{MAX_BODY} bytes of JSON)")
            if not raw.strip().isdigit() or not raw.strip().isascii():
                raise RequestError(400, f"Content-Length must be a number of bytes, got {raw[:40]!r}")
            n = int(raw)
            if n > MAX_BODY:
                raise RequestError(413, f"body of {n} bytes is too large; at most {MAX_BODY} bytes of JSON")
            if n == 0:
                raise RequestError(400, "empty body; send {\"source\": ..., \"short_side\": 160}")
            data = self.rfile.read(n)
            if len(data) != n:
                raise RequestError(400, f"body ended after {len(data)} of {n} bytes")
            try:
                body = json.loads(data)
            except RecursionError:
                raise RequestError(400, "JSON nested too deeply; send a flat object") from None
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise RequestError(400, f"body is not JSON ({type(e).__name__} at {getattr(e, 'pos', '?')})"
                                   ) from None
            if not isinstance(body, dict):
                raise RequestError(400, "body must be a JSON object {\"source\": ..., \"short_side\": 160}")
            return body

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="datacache-daemon-http", daemon=True).start()
    log.info("HTTP on http://%s:%d (/health /status /metrics, POST/DELETE /datasets %s)", host,
             srv.server_address[1], "with the API token" if token else "disabled: no api_token")
    return srv
