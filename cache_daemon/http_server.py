"""A small JSON HTTP server whose threads and descriptors stay bounded, whatever the clients do.

:class:`BoundedHTTPServer` is ``ThreadingHTTPServer`` with at most :data:`MAX_CONNECTIONS` connections at
once (each with a thread); a request (line + headers + body) must arrive within :data:`REQUEST_DEADLINE`
seconds in all, not per read (:class:`DeadlineReader`), or the connection is closed; at the cap, a new
connection evicts the one that has been waiting longest for its request (a slowloris connection, an idle
keep-alive), so a probe always gets through -- and when every connection is being answered it waits up
to :data:`ADMIT_WAIT_S` for one to finish, then gets a 503. :class:`Handler` answers JSON, refuses every
malformed request with a 4xx JSON error (never a traceback or a dropped connection; a request line that is
not ``METHOD target HTTP/x.y`` -- HTTP/0.9's ``GET /`` included -- gets 400 at once) and reads bodies of
at most :data:`MAX_BODY` bytes; every JSON answer goes through :func:`datacache.redact.redact_json`
(no URL password or credential query parameter is ever sent); the daemon's routes are in
:mod:`cache_daemon.http`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from datacache.redact import redact_json

log = logging.getLogger("cache_daemon.http")
MAX_BODY = 64 << 10
MAX_CONNECTIONS = 64  # connections at once (each has a thread): probes, scrapes, a few API clients
REQUEST_DEADLINE = 10.0  # seconds for a WHOLE request (line + headers + body), however it is dribbled
WRITE_TIMEOUT = 10.0  # seconds one write of an answer may block (a client that does not read it)
ADMIT_WAIT_S = 2.0  # at the cap with nothing to evict: how long a new connection waits for a slot
LISTEN_BACKLOG = 256  # kernel queue of connections not yet accepted (holds no descriptor of ours)
EVICTED = "connection evicted: the daemon is at its connection cap and this one was still sending its request"
_REFUSED_BODY = b'{"error": "every connection of the daemon is being answered; retry in a second"}\n'
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


class RequestError(Exception):
    """A request the daemon refuses: HTTP status + one-line reason (sent as JSON)."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}


@dataclass(eq=False)
class Conn:
    """One accepted connection, as the server tracks it (all fields guarded by the server's lock)."""

    sock: socket.socket
    since: float = field(default_factory=time.monotonic)  # start of the request being read
    evicted: bool = False  # its socket was shut down to make room; its thread is on its way out


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a connection cap, eviction of the oldest connection still reading its
    request, and per-request deadlines (see the module docstring).

    Threads: :meth:`process_request` runs in the accept thread (``serve_forever``); :meth:`begin_request`,
    :meth:`begin_answer` and :meth:`shutdown_request` in each connection's own thread. ``_live`` and
    ``_reading`` are guarded by ``_cond``'s lock; nothing blocks while holding it."""

    daemon_threads = True  # a connection thread never keeps the process alive at exit
    block_on_close = False  # server_close() does not join them (their sockets have deadlines anyway)
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, request_deadline: float = REQUEST_DEADLINE) -> None:
        if max_connections < 1 or not request_deadline > 0:
            raise ValueError(f"max_connections must be >= 1 and request_deadline > 0, got {max_connections}, "
                             f"{request_deadline}")
        self.max_connections = int(max_connections)
        self.request_deadline = float(request_deadline)
        self._cond = threading.Condition()
        self._live: dict[socket.socket, Conn] = {}  # every connection with a thread (evicted ones too)
        self._reading: dict[socket.socket, Conn] = {}  # still reading a request; oldest first
        self.counts = {"accepted": 0, "evicted": 0, "refused": 0, "timed_out": 0}
        super().__init__(address, handler)

    # ------------------------------------------------------------ accept thread
    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(request):
            self._refuse(request)
            return
        super().process_request(request, client_address)  # starts the connection's thread

    def _admit(self, sock: socket.socket) -> bool:
        """Make room for ``sock`` (evicting the oldest readers) and track it; False when no slot came free
        within ADMIT_WAIT_S (every connection is being answered)."""
        deadline = time.monotonic() + ADMIT_WAIT_S
        with self._cond:
            while len(self._live) >= self.max_connections:
                dying = sum(1 for c in self._live.values() if c.evicted)
                for _ in range(len(self._live) - self.max_connections + 1 - dying):
                    if not self._reading:
                        break
                    self._evict(next(iter(self._reading.values())))
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)  # an evicted thread exits at once (its recv returns): a slot frees
            self._live[sock] = self._reading[sock] = Conn(sock)
            self.counts["accepted"] += 1
            return True

    def _evict(self, conn: Conn) -> None:
        """Caller holds the lock. Hazard: the socket is only SHUT DOWN here, never closed -- its thread still
        owns the descriptor; closing it from this thread could let the next accept() reuse the number while
        that thread reads or writes it. shutdown() wakes the thread's blocked recv, which then exits."""
        conn.evicted = True
        del self._reading[conn.sock]
        self.counts["evicted"] += 1
        with contextlib.suppress(OSError):  # already gone
            conn.sock.shutdown(socket.SHUT_RDWR)

    def _refuse(self, sock: socket.socket) -> None:
        """A 503 without a thread: one non-blocking send of a short answer (never waits on the client)."""
        with self._cond:
            self.counts["refused"] += 1
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(REFUSED)
            # read what the client already sent (non-blocking, bounded: a client streaming bytes must not
            # hold the accept thread): closing with unread bytes sends a reset, which can destroy the 503
            # before the client reads it
            for _ in range(4):
                if not sock.recv(65536):
                    break
        super().shutdown_request(sock)

    # ------------------------------------------------------------ connection threads
    def begin_request(self, sock: socket.socket) -> Conn:
        """A request starts being read on ``sock``. The first keeps its place and clock from the accept (its
        deadline counts from there, whenever its thread got to run); a later one on the same connection
        (keep-alive; the server answers HTTP/1.0 and closes, so only if that changes) becomes the newest
        reader, so the last to be evicted."""
        with self._cond:
            conn = self._live[sock]
            if sock not in self._reading and not conn.evicted:
                conn.since = time.monotonic()
                self._reading[sock] = conn
            return conn

    def begin_answer(self, sock: socket.socket) -> None:
        """The request line and headers are in: the connection is no longer evictable (an authorised POST
        still reads its body, within the same deadline)."""
        with self._cond:
            self._reading.pop(sock, None)

    def count(self, what: str) -> None:
        with self._cond:
            self.counts[what] += 1

    def shutdown_request(self, request: Any) -> None:
        # the connection's thread at its end (or the accept thread when starting that thread failed):
        # close first, then free the slot, so descriptors never exceed the cap
        try:
            super().shutdown_request(request)
        finally:
            with self._cond:
                self._live.pop(request, None)
                self._reading.pop(request, None)
                self._cond.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that went away (reset, broken pipe, evicted): routine
            log.debug("HTTP connection from %s ended: %s", client_address, exc)
        else:  # a bug: logged with its traceback (the handler answers 503 before it gets here)
            log.error("HTTP connection from %s failed", client_address, exc_info=exc)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"connections": len(self._live), "reading": len(self._reading),
                    "max_connections": self.max_connections, "request_deadline_s": self.request_deadline,
                    **self.counts}


class DeadlineReader(io.RawIOBase):
    """The raw byte source of a handler's ``rfile``: every ``recv`` waits at most until the request's
    deadline, so a request dribbled a byte at a time still ends at the deadline (a per-read timeout
    never would); an evicted connection reads as a timeout, never as a short request. Thread hazard:
    only the connection's own thread sets its socket's timeout and reads or writes it; the accept thread
    only ever calls ``shutdown()`` on it (:meth:`BoundedHTTPServer._evict`)."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        super().__init__()
        self.sock = sock
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        h = self.handler
        if h.conn.evicted:
            raise TimeoutError(EVICTED)
        left = h.deadline - time.monotonic()
        if left <= 0:
            h.server.count("timed_out")
            raise TimeoutError(f"the request was not complete within {h.server.request_deadline:g} s")
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buf)
        except OSError as e:
            if h.conn.evicted:
                raise TimeoutError(EVICTED) from None
            if isinstance(e, TimeoutError):  # the deadline came during this read
                h.server.count("timed_out")
            raise
        if n == 0 and h.conn.evicted:  # shutdown() by the accept thread: not the client's end of request
            raise TimeoutError(EVICTED)
        return n


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (the routes are in :func:`make_server`)."""

    server: BoundedHTTPServer
    server_version = "datacache-daemon"
    timeout = REQUEST_DEADLINE  # until the first request starts (DeadlineReader sets it per read after)
    conn: Conn
    deadline = 0.0

    def setup(self) -> None:
        super().setup()
        # reads go through the deadline-aware reader; the stdlib's makefile reader is closed at once (it
        # only holds a reference count on the socket, which stays open)
        self.rfile.close()
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.conn = self.server.begin_request(self.request)
        self.deadline = self.conn.since + self.server.request_deadline
        self.command, self.requestline, self.request_version = "", "", "HTTP/0.9"  # until parsed
        super().handle_one_request()  # a TimeoutError (deadline, eviction) closes the connection quietly

    def parse_request(self) -> bool:
        # The stdlib takes a two-word line ("GET /", no version) as HTTP/0.9 and then waits for headers
        # that an HTTP/0.9 client never sends: the connection would be held until the deadline. Every line
        # that is not "METHOD target HTTP/x.y" (an empty line too) is answered 400 at once and closed.
        # (Longer lines, bad versions and oversize lines are the stdlib's refusals, also immediate.)
        words = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n").split()
        if len(words) < 3:
            self.close_connection = True
            self.requestline = str(self.raw_requestline[:200], "iso-8859-1").rstrip("\r\n")
            what = "HTTP/0.9 is not served" if len(words) == 2 else "malformed request line"
            self.send_error(400, f"{what}: send 'METHOD /path HTTP/1.1' and the headers")
            return False
        return super().parse_request()

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, body: bytes, ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.server.begin_answer(self.request)
        self.connection.settimeout(WRITE_TIMEOUT)  # writes: bounded too (a client that never reads)
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError as e:  # the client went away (or was evicted) while we answered: nothing to do
            self.close_connection = True
            log.debug("answer to %s not delivered: %s", self.address_string(), e)

    def _json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        # every string of every answer redacted (URL passwords, credential query parameters such as a
        # SAS sig=, registered secrets), whatever put it there: a source in an error, a pass's dataset id
        self._send(code, (json.dumps(redact_json(obj), indent=1) + "\n").encode(), headers=headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # the stdlib's own refusals (bad request line, oversize or too many headers, bad version):
        # JSON like ours, and the connection is closed (the rest of the request is not trusted)
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # unparsed line: answer HTTP/1.0
            self.request_version = "HTTP/1.0"
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
        self.server.begin_answer(self.request)  # line + headers are in: no longer evictable
        try:
            self._route()
        except RequestError as e:
            self.close_connection = True
            self._json(e.code, {"error": str(e)}, e.headers)
        except Exception as e:  # a bug or a store failure: logged once, answered, server keeps going
            log.exception("HTTP %s %s failed", self.command, self.path[:200])
            self.close_connection = True
            self._json(503, {"error": f"the daemon could not answer ({type(e).__name__}); see its log"})

    def _route(self) -> None:  # replaced per server by make_server
        raise NotImplementedError

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
        try:
            data = self.rfile.read(n)
        except TimeoutError:  # the deadline covers the body too (or the connection was evicted)
            raise RequestError(408, f"the body did not arrive within {self.server.request_deadline:g} s of "
                                    "the request's start") from None
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
