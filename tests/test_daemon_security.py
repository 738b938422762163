"""The daemon's HTTP API is authenticated, confined to allowed_sources and strict about its input.

A real daemon (real Redis, real HTTP server on a free loopback port, in-process so the fuzz is fast)
answers real HTTP requests sent over raw sockets; a real local HTTP server records any request the
daemon would make to a URL that is not allowed (SSRF).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import msgpack
import pytest

from cache_daemon.daemon_config import DaemonConfig, DatasetSpec, normalize_source, source_allowed
from cache_daemon.registry import REGISTRY_KEY, registered
from tests.redis_utils import needs_redis

TOKEN = "s3cret-token-" + "x" * 20


def _request(port: int, raw: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` bytes, read the whole answer (the server closes after it): status, headers, body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(raw)  # the server may answer (and close) before reading everything
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    data = b"".join(chunks)
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"no complete HTTP response to {raw[:80]!r}: {data[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    version, code, *_ = lines[0].split(" ", 2)
    assert version.startswith("HTTP/1."), lines[0]
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(code), headers, body


def _http(port: int, method: str, path: str, body: bytes | None = None, token: str | None = None,
          extra: str = "") -> tuple[int, dict[str, str], dict]:
    hdr = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}"
    if token is not None:
        hdr += f"Authorization: Bearer {token}\r\n"
    if body is not None:
        hdr += f"Content-Length: {len(body)}\r\nContent-Type: application/json\r\n"
    code, headers, data = _request(port, hdr.encode() + b"\r\n" + (body or b""))
    return code, headers, json.loads(data) if headers.get("content-type") == "application/json" else {}


class _Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        from cache_daemon.http import make_server
        from cache_daemon.service import Daemon

        self.d = Daemon(cfg, progress=False)
        self.srv = make_server(self.d, "127.0.0.1", 0)
        self.port = self.srv.server_address[1]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
        self.d.store.close()


@pytest.fixture
def daemon_factory(redis_url: str):
    made: list[_Daemon] = []

    def make(**kw) -> _Daemon:
        d = _Daemon(DaemonConfig(cache=redis_url, node="n1", **kw))
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []

    def _any(self) -> None:
        _Recorder.seen.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = _any

    def log_message(self, *a) -> None:
        pass


@pytest.fixture
def recorder():
    _Recorder.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _registry(d: _Daemon) -> dict:
    return d.d.store.status_get(REGISTRY_KEY)


# ------------------------------------------------------------------------ prefix normalisation
def test_allowed_sources_compare_whole_segments_after_resolving(tmp_path) -> None:
    data = tmp_path / "data" / "imagenet"
    data.mkdir(parents=True)
    (tmp_path / "data" / "imagenet-evil").mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", data / "link")
    allowed = (str(data),)
    assert source_allowed(str(data), allowed) and source_allowed(str(data / "train"), allowed)
    assert not source_allowed(str(tmp_path / "data" / "imagenet-evil"), allowed)
    assert not source_allowed(str(data / ".." / ".." / "secret"), allowed)
    assert not source_allowed(str(data / "link"), allowed)  # a symlink out of the prefix
    assert not source_allowed("/etc", allowed) and not source_allowed("file:///etc", allowed)
    web = ("https://data.example.com/sets",)
    assert source_allowed("https://DATA.example.com/sets/a/", web)
    assert not source_allowed("https://data.example.com/sets-evil/a", web)
    assert not source_allowed("https://data.example.com/sets/../admin", web)
    assert not source_allowed("http://data.example.com/sets/a", web)  # another scheme
    assert not source_allowed("https://data.example.com.evil.org/sets/a", web)  # another host
    assert not source_allowed("https://data.example.com:8443/sets/a", web)  # another port
    assert normalize_source("s3://b/x/./y/../z") == ("s3", "b", "/x/z")


# ------------------------------------------------------------------------ authorisation and confinement
@needs_redis
def test_post_and_delete_are_refused_without_a_configured_token(daemon_factory, small_imagefolder) -> None:
    d = daemon_factory(allowed_sources=(os.path.dirname(small_imagefolder),))
    body = json.dumps({"source": small_imagefolder}).encode()
    code, _, reply = _http(d.port, "POST", "/datasets", body, token="anything-at-all-123")
    assert code == 403 and "api_token" in reply["error"]
    code, _, reply = _http(d.port, "DELETE", "/datasets/x", token="anything-at-all-123")
    assert code == 403 and "api_token" in reply["error"]
    assert _registry(d) == {}
    assert _http(d.port, "GET", "/health")[0] == 200  # GETs need no token


@needs_redis
def test_registration_needs_the_token_and_an_allowed_source(daemon_factory, tmp_path, recorder,
                                                            imagefolder_factory) -> None:
    root = imagefolder_factory(classes=1, per_class=2)
    private = tmp_path / "private"
    private.mkdir()
    (private / "a.jpg").write_bytes(b"password=hunter2")
    rport = recorder.server_address[1]
    d = daemon_factory(api_token=TOKEN, allowed_sources=(root,), max_registrations=2)
    ok = json.dumps({"source": root, "short_side": 32}).encode()
    code, headers, _ = _http(d.port, "POST", "/datasets", ok)
    assert code == 401 and headers["www-authenticate"] == "Bearer"
    assert _http(d.port, "POST", "/datasets", ok, token=TOKEN + "x")[0] == 401
    assert _http(d.port, "POST", "/datasets", ok, extra=f"Authorization: Basic {TOKEN}\r\n")[0] == 401
    outside = ["/etc", str(private), root + "/../../..", root + "-evil", f"file://{private}",
               f"http://127.0.0.1:{rport}/secret/", f"https://127.0.0.1:{rport}/x"]
    for src in outside:
        code, _, reply = _http(d.port, "POST", "/datasets", json.dumps({"source": src}).encode(), token=TOKEN)
        assert code == 403 and "allowed_sources" in reply["error"], (src, reply)
    assert _registry(d) == {} and recorder_seen_nothing()
    for bad in ({"source": root, "short_side": 5000}, {"source": root, "short_side": 0},
                {"source": root, "short_side": True}, {"source": root, "encoding": 5},
                {"source": root, "revalidate": "bogus"}, {"source": root, "revalidate": ["a"]},
                {"source": root, "evil": 1}, {"source": ""}, {"source": 7}):
        code, _, reply = _http(d.port, "POST", "/datasets", json.dumps(bad).encode(), token=TOKEN)
        assert code == 400 and "error" in reply, (bad, code, reply)
    assert _registry(d) == {}
    code, _, reply = _http(d.port, "POST", "/datasets", ok, token=TOKEN)
    assert code == 201
    ident = reply["registered"]
    assert list(_registry(d)) == [ident.encode()]
    # the cap: a second entry fits, a third is refused, re-registering an existing one is fine
    assert _http(d.port, "POST", "/datasets", json.dumps({"source": root, "short_side": 40}).encode(),
                 token=TOKEN)[0] == 201
    third = json.dumps({"source": root, "short_side": 48}).encode()
    code, _, reply = _http(d.port, "POST", "/datasets", third, token=TOKEN)
    assert code == 400 and "max_registrations" in reply["error"]
    assert _http(d.port, "POST", "/datasets", ok, token=TOKEN)[0] == 201
    # DELETE removes it from Redis; unknown ids are 404; the token is needed
    path = "/datasets/" + urllib.parse.quote(ident, safe="")
    assert _http(d.port, "DELETE", path)[0] == 401
    code, _, reply = _http(d.port, "DELETE", path, token=TOKEN)
    assert code == 200 and reply["deleted"] == ident and ident.encode() not in _registry(d)
    assert _http(d.port, "DELETE", path, token=TOKEN)[0] == 404
    assert recorder_seen_nothing()


def recorder_seen_nothing() -> bool:
    assert _Recorder.seen == [], _Recorder.seen
    return True


@needs_redis
def test_config_datasets_cannot_be_deleted(daemon_factory, small_imagefolder) -> None:
    spec = DatasetSpec(source=small_imagefolder, short_side=32)
    d = daemon_factory(api_token=TOKEN, allowed_sources=(small_imagefolder,), datasets=(spec,))
    code, _, reply = _http(d.port, "DELETE", "/datasets/" + urllib.parse.quote(spec.ident(), safe=""),
                           token=TOKEN)
    assert code == 409 and "daemon.toml" in reply["error"]
    assert spec.ident() in {s["source"] + "|" + s["variant"] for s in d.d.snapshot()}


@needs_redis
def test_registry_entries_outside_own_allowed_sources_are_skipped(redis_url: str, tmp_path, caplog) -> None:
    from datacache.stores import open_store

    allowed = tmp_path / "ok"
    allowed.mkdir()
    store = open_store(redis_url)
    try:
        # a rogue writer to Redis, bypassing any daemon's checks
        good = DatasetSpec(source=str(allowed / "train"), short_side=32)
        rogue = {"/etc|x": {"source": "/etc", "short_side": 32, "encoding": "raw", "revalidate": "dirs"},
                 "u|x": {"source": "http://127.0.0.1:9/secret/", "short_side": 32, "encoding": "raw",
                         "revalidate": "dirs"},
                 "big|x": {"source": str(allowed), "short_side": 5000, "encoding": "raw",
                           "revalidate": "dirs"}}
        for field_name, value in rogue.items():
            store.status_set(REGISTRY_KEY, field_name, msgpack.packb(value))
        store.status_set(REGISTRY_KEY, "junk", b"\xc1not msgpack")
        store.status_set(REGISTRY_KEY, good.ident(), msgpack.packb(good.__dict__))
        with caplog.at_level("WARNING", logger="cache_daemon.registry"):
            assert registered(store, (str(allowed),)) == [good]
        assert "outside this daemon's allowed_sources" in caplog.text
        assert registered(store, ()) == []  # a daemon that allows nothing reads nothing from the registry
    finally:
        store.close()


# ------------------------------------------------------------------------ no file contents in errors
def test_non_image_reason_carries_no_file_bytes(tmp_path) -> None:
    from datacache.config import Variant
    from datacache.decode import DecodeError, decode_image
    from datacache.warm import warm_cache

    secret = b"password=hunter2 and more private text"
    with pytest.raises(DecodeError) as ei:
        decode_image(secret, Variant(short_side=32), name="a.jpg")
    assert "password" not in str(ei.value) and f"{len(secret)} bytes" in ei.value.reason
    root = tmp_path / "ds"
    (root / "c").mkdir(parents=True)
    (root / "c" / "notes.jpg").write_bytes(secret)
    rep = warm_cache(str(root), f"lmdb://{tmp_path / 'lmdb'}", workers=1, short_side=32, t1_dir=None,
                     progress=False)
    (reason,) = rep.quarantined.values()
    assert "password" not in reason and "hunter2" not in reason and "not a decodable image" in reason


# ------------------------------------------------------------------------ malformed requests
@needs_redis
def test_every_malformed_request_gets_a_4xx_json_error(daemon_factory, small_imagefolder) -> None:
    d = daemon_factory(api_token=TOKEN, allowed_sources=(small_imagefolder,))
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    post = "POST /datasets HTTP/1.1\r\nHost: x\r\n" + auth
    cases = {
        "cl-abc": (post + "Content-Length: abc\r\n\r\n{}", 400),
        "cl-negative": (post + "Content-Length: -5\r\n\r\n{}", 400),
        "cl-huge": (post + "Content-Length: 99999999999999999999\r\n\r\n{}", 413),
        "cl-missing": (post + "\r\n{}", 411),
        "chunked": (post + "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
        "cl-zero": (post + "Content-Length: 0\r\n\r\n", 400),
        "non-json": (post + "Content-Length: 5\r\n\r\nhello", 400),
        "non-utf8": (post + "Content-Length: 2\r\n\r\n\xff\xfe", 400),
        "list": (post + "Content-Length: 2\r\n\r\n[]", 400),
        "revalidate-bogus": (post + 'Content-Length: 41\r\n\r\n{"source": "/x/y", "revalidate": "bogus"}',
                             400),
        "unknown-path": ("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        "put": ("PUT /datasets HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        "get-datasets": ("GET /datasets HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        "post-health": ("POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
        "weird-method": ("FROB /status HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        "bad-request-line": ("garbage\r\n\r\n", 400),
        "huge-header": ("GET /health HTTP/1.1\r\nX-Big: " + "a" * 70000 + "\r\n\r\n", 431),
        "many-headers": ("GET /health HTTP/1.1\r\n" + "X-A: b\r\n" * 150 + "\r\n", 431),
        "bad-quote": ("DELETE /datasets/%ff%fe HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n", 400),
    }
    cases["nested"] = (post + "Content-Length: 20000\r\n\r\n" + "[" * 20000, 400)
    for name, (raw, want) in cases.items():
        code, headers, body = _request(d.port, raw.encode("latin-1"))
        assert code == want, (name, code, body[:300])
        err = json.loads(body)["error"]
        assert isinstance(err, str) and err and "Traceback" not in err, name
        if name == "revalidate-bogus":
            assert "revalidate" in err and "dirs" in err  # names the key and the choices
        if want == 405:
            assert headers["allow"] in ("GET", "POST", "DELETE"), name
    assert _http(d.port, "GET", "/health")[0] == 200


@needs_redis
def test_fuzzed_requests_never_get_5xx_and_the_server_survives(daemon_factory, small_imagefolder) -> None:
    d = daemon_factory(api_token=TOKEN, allowed_sources=(small_imagefolder,))
    rng = random.Random(1234)
    methods = ["GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS", "PATCH", "X", "get", "P0ST"]
    paths = ["/health", "/livez", "/readyz", "/status", "/datasets", "/datasets/", "/datasets/a%7Cb",
             "/metrics", "/", "//",
             "/datasets/%zz", "/status?x=1", "/../etc/passwd", "*", "/datasets/" + "a" * 3000, "/%00"]
    values = [0, -1, 1, 2048, 2049, 10 ** 30, 1.5, "x", "", None, True, [], {}, [1, [2]], "raw", "jpeg",
              "dirs", "full", "none", small_imagefolder, "/etc", "http://127.0.0.1:9/x"]
    keys = ["source", "short_side", "encoding", "revalidate", "evil", ""]

    def body() -> bytes:
        kind = rng.randrange(6)
        if kind == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        if kind == 1:
            return (("[" if rng.random() < 0.5 else '{"a":') * rng.randrange(1, 3000)).encode()
        obj = {rng.choice(keys): rng.choice(values) for _ in range(rng.randrange(5))}
        return json.dumps(obj).encode()

    n = 0
    for _ in range(4000):
        method, path = rng.choice(methods), rng.choice(paths)
        head = f"{method} {path} HTTP/1.{rng.randrange(2)}\r\nHost: x\r\n"
        if rng.random() < 0.6:
            head += f"Authorization: {rng.choice(['Bearer ', 'bearer ', 'Basic ', ''])}" \
                    f"{rng.choice([TOKEN, 'x', '', TOKEN * 2])}\r\n"
        data = body() if rng.random() < 0.7 else b""
        cl = rng.choice([str(len(data))] * 6 + ["abc", "-1", "", "1e3", str(10 ** 12), " 3"])
        if cl == str(len(data)) or rng.random() < 0.5:
            head += f"Content-Length: {cl}\r\n"
        if rng.random() < 0.05:
            head += "X-Junk: " + "j" * rng.randrange(70000) + "\r\n"
        raw = head.encode("latin-1") + b"\r\n" + data
        if method.upper() not in ("POST",) or cl != str(len(data)):
            raw = head.encode("latin-1") + b"\r\n"  # a body the server may not read would stall the socket
            if cl.strip().isdigit() and 0 < int(cl) <= 65536:
                raw += b"x" * int(cl)
        code, _, _ = _request(d.port, raw)
        assert 200 <= code < 500, (raw[:200], code)
        n += 1
    assert n == 4000
    # the fuzz could not register anything outside allowed_sources
    for ident in _registry(d):
        assert ident.decode().startswith(small_imagefolder + "|")
    assert _http(d.port, "GET", "/health")[0] == 200


@needs_redis
def test_warm_via_daemon_sends_the_token_from_a_file(daemon_factory, imagefolder_factory, tmp_path,
                                                     monkeypatch, capsys) -> None:
    from datacache.cli import main as datacache_main

    root = imagefolder_factory(classes=1, per_class=2)
    d = daemon_factory(api_token=TOKEN, allowed_sources=(root,))
    base = f"http://127.0.0.1:{d.port}"
    monkeypatch.delenv("DATACACHE_DAEMON_API_TOKEN", raising=False)
    assert datacache_main(["warm", root, "--via-daemon", base, "--short-side", "32"]) != 0
    assert "401" in capsys.readouterr().err and _registry(d) == {}
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    assert datacache_main(["warm", root, "--via-daemon", base, "--short-side", "32",
                           "--api-token-file", str(tok)]) == 0
    assert len(_registry(d)) == 1


@needs_redis
def test_a_deleted_registration_stops_on_every_daemon_and_an_unreachable_registry_drops_nothing(
        redis_url: str, tmp_path, imagefolder_factory) -> None:
    """DELETE on one daemon removes the Redis entry; every other daemon drops the dataset at its next
    round. A registry that cannot be read is not "everything deleted": nothing is dropped then."""
    from cache_daemon.registry import register, unregister
    from cache_daemon.service import Daemon

    root = imagefolder_factory(classes=2, per_class=2, size=(40, 30))
    cfg = DaemonConfig(cache=redis_url, node="n1", allowed_sources=(str(os.path.dirname(root)),),
                       http_port=0)
    d = Daemon(cfg, progress=False)
    try:
        spec = DatasetSpec(source=root, short_side=16)
        register(d.store, spec, max_registrations=4)  # as POST on another daemon would
        d._sync_registry()
        assert spec.ident() in d.states
        real = d.store.status_get

        def down(_name):
            raise ConnectionError("registry unreachable")

        d.store.status_get = down  # the registry's server is down for this round (a real store, one call)
        with pytest.raises(ConnectionError):
            d._sync_registry()
        assert spec.ident() in d.states  # not dropped
        d.store.status_get = real
        assert unregister(d.store, spec.ident())  # DELETE on another daemon
        d._sync_registry()
        assert spec.ident() not in d.states
    finally:
        d.store.close()


def test_encoded_traversal_in_a_url_source_is_refused() -> None:
    """A server may decode ``%2e%2e`` or ``%2f`` after our prefix check: such paths never pass."""
    allowed = ("http://127.0.0.1:8000/sets",)
    assert source_allowed("http://127.0.0.1:8000/sets/train", allowed)
    for evil in ("http://127.0.0.1:8000/sets/%2e%2e/secret", "http://127.0.0.1:8000/sets/%2E%2E%2Fsecret",
                 "http://127.0.0.1:8000/sets/a\\..\\..\\secret", "http://127.0.0.1:8000/sets/a;/../../x"):
        assert not source_allowed(evil, allowed), evil


def test_a_daemon_without_a_redis_tier_runs_its_passes(tmp_path, imagefolder_factory) -> None:
    """An LMDB-only daemon has no registry: rounds run their passes (regression: the registry sync raised
    "no Redis tier" before every pass, so no pass ever ran while /health said 200)."""
    from cache_daemon.service import Daemon

    root = imagefolder_factory(classes=2, per_class=2, size=(40, 30))
    cfg = DaemonConfig(cache=f"lmdb://{tmp_path}/cache", node="n1", http_port=0, workers=1,
                       datasets=(DatasetSpec(source=root, short_side=16),))
    d = Daemon(cfg, progress=False)
    d._sync_registry()  # no exception, nothing dropped
    assert list(d.states) == [cfg.datasets[0].ident()]
    assert d.run(once=True) == 0
    assert d.loop_status()["passes"] >= 1 and d.loop_status()["failed_rounds"] == 0
    d.failed_rounds, d.round_error = 3, "ConnectionError: registry unreachable"  # three failed rounds
    assert "3 rounds in a row failed" in d.loop_status()["stuck"]["reason"]  # /health turns 503 on "stuck"


@needs_redis
def test_probe_endpoints_are_get_only_need_no_token_and_answer_head(daemon_factory) -> None:
    d = daemon_factory(api_token=TOKEN)
    for path in ("/livez", "/readyz", "/health"):
        code, _, body = _http(d.port, "GET", path)
        assert code == 200 and body["ok"] is True and body["node"] == "n1", (path, body)
        code, headers, raw = _request(d.port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert code == 200 and raw == b"" and int(headers["content-length"]) > 0, path
        for method in ("POST", "DELETE", "PUT"):
            code, headers, body = _http(d.port, method, path, body=b"{}" if method == "POST" else None,
                                        token=TOKEN)
            assert code == 405 and headers["allow"] == "GET" and "use GET" in body["error"], (path, method)
    code, _, body = _http(d.port, "GET", "/nope")
    assert code == 404 and "/livez" in body["error"] and "/readyz" in body["error"]
    live, ready = _http(d.port, "GET", "/livez")[2], _http(d.port, "GET", "/readyz")[2]
    assert live["reason"] is None and live["loop"]["stuck"] is None
    assert ready["store"]["backend"] == "redis" and ready["store"]["detail"].startswith("PONG")
