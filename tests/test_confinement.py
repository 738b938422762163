"""Confinement: the cache daemon reads only files that really lie under its allowed sources (issue 22).

Every escape that was reproduced is replayed against a REAL daemon -- the in-process ``Daemon`` with its
HTTP server on a free loopback port, a real redis-server, its real decode pool, or the ``cache_daemon``
process itself -- on real files, symlinks and local HTTP servers: a ``../`` or absolute file-list entry
(refused at ``POST /datasets`` with the list's line number, and at listing time), a file symlink and a
directory symlink out of the allowed folder, a file swapped for a symlink after the listing, an HTTP
redirect to another server, and a huge numeric label. "Never read" is shown by what the daemon
counted (``bytes_read`` equals the bytes of the files inside), by the quarantine it reports, and by
the keys Redis holds -- not by making the outside file unreadable afterwards.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
from cache_daemon.registry import REGISTRY_KEY
from datacache.confine import fd_real_path
from datacache.devtools.redis_local import free_port
from datacache.devtools.synth import make_imagefolder
from datacache.source import Source, SourceError
from datacache.source_errors import ConfinementError, NotARegularFile, RedirectRefused
from tests.redis_utils import cli, needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "confine-token-" + "y" * 24
SHORT = 32
SECRET = "zz_private"  # the outside folder's name: must never appear in an answer


# ------------------------------------------------------------------------------------------------ helpers
def _post(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/datasets", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {TOKEN}",
                                                         "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=30) as r:
        return json.loads(r.read())


def _images(root: str, classes: int, per_class: int, seed: int = 0) -> str:
    make_imagefolder(root, classes=classes, per_class=per_class, size=(64, 48), seed=seed)
    return root


def _read(path: Any) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Node:
    """A real daemon in this process (its HTTP API on a free loopback port) whose fill passes the test
    runs one round at a time, exactly as its pass thread would (registry sync, then one pass each)."""

    def __init__(self, cfg: DaemonConfig) -> None:
        from cache_daemon.http import make_server
        from cache_daemon.service import Daemon

        self.d = Daemon(cfg, progress=False)
        self.srv = make_server(self.d, "127.0.0.1", 0)
        self.port = self.srv.server_address[1]

    def round(self) -> list[Any]:
        from cache_daemon.ingest import ingest_pass

        self.d._sync_registry()
        with self.d.lock:
            states = list(self.d.states.values())
        for st in states:
            ingest_pass(self.d.cfg, st, self.d.store, decoder=self.d.decoder, stop=self.d.stop,
                        progress=False, pool=self.d.pool)
        return states

    def cached(self, state: Any) -> list[bool]:
        """Per manifest index: whether Redis holds the sample (keys made the daemon's way)."""
        from cache_daemon.decoders import variant_for
        from datacache.cacheurl import parse_cache_url
        from datacache.readthrough import ReadThrough

        reader = ReadThrough(state.manifest, variant_for(state.spec.variant(), self.d.decoder),
                             parse_cache_url(self.d.cfg.cache), t1_dir=None)
        return list(self.d.store.contains(reader.keys(range(len(state.manifest)))))

    def close(self) -> None:
        self.d.pool.close(timeout=30)
        self.srv.shutdown()
        self.srv.server_close()
        self.d.store.close()


@pytest.fixture
def node(redis_url: str, tmp_path, monkeypatch) -> Iterator[Any]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # manifests and T1 of the daemon go there
    made: list[Node] = []

    def make(**kw: Any) -> Node:
        n = Node(DaemonConfig(cache=redis_url, node="n1", workers=1, api_token=TOKEN, **kw))
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def _sample_keys(redis_url: str) -> list[str]:
    port = int(redis_url.rsplit(":", 1)[1].split("/", 1)[0])
    return [k for k in cli(port, "--scan", "--pattern", "dc:*").splitlines() if k]


# ------------------------------------------------------------------------------------------ file lists
@needs_redis
def test_list_entries_that_climb_or_are_absolute_are_refused_at_registration_with_the_line(
        node, redis_url: str, tmp_path) -> None:
    allowed = tmp_path / "allowed"
    root = _images(str(allowed / "ds"), classes=2, per_class=2)
    outside = _images(str(tmp_path / SECRET), classes=1, per_class=1, seed=7)
    lst = allowed / "ds" / "train.txt"
    n = node(allowed_sources=(str(allowed),))
    good = ["# train split", "c000/00000.JPEG,0", "c001/00000.JPEG,1", "c001/00001.JPEG,1"]
    cases = {f"../../{SECRET}/c000/00000.JPEG,0": "'..'",             # climbs (reproduced: was cached)
             f"c000/../../../{SECRET}/c000/00000.JPEG,0": "'..'",
             f"{outside}/c000/00000.JPEG,0": "absolute",               # was read as a relative path
             f"file://{outside}/c000/00000.JPEG,0": "URL",
             "C:\\data\\x.JPEG,0": "backslash",
             "c000/00000.JPEG,20000000": "too large"}                  # 20M class names: 3 GB
    for bad, why in cases.items():
        lst.write_text("\n".join([*good[:2], bad, *good[2:]]) + "\n")
        code, reply = _post(n.port, {"source": str(lst), "short_side": SHORT})
        assert code == 400, (bad, code, reply)
        err = reply["error"]
        assert "line 3" in err and why in err, (bad, err)
        assert SECRET not in err and "20000000" not in err  # the line's text is never echoed
    assert n.d.store.status_get(REGISTRY_KEY) == {}
    # a good list registers; rewritten afterwards to climb out, the daemon's own listing refuses it
    lst.write_text("\n".join(good) + "\n")
    code, reply = _post(n.port, {"source": str(lst), "short_side": SHORT})
    assert code == 201, reply
    with open(lst, "a") as f:
        f.write(f"../../{SECRET}/c000/00000.JPEG,0\n")
    (state,) = n.round()
    assert state.status == "error" and "line 5" in state.error and "'..'" in state.error, state.error
    assert SECRET not in json.dumps(_status(n.port))
    assert _sample_keys(redis_url) == []  # nothing decoded, the outside image least of all
    assert os.path.isdir(root)


@needs_redis
def test_a_list_that_cannot_be_read_is_refused_at_registration(node, tmp_path) -> None:
    allowed = tmp_path / "allowed"
    _images(str(allowed / "ds"), classes=1, per_class=2)
    n = node(allowed_sources=(str(allowed),))
    code, reply = _post(n.port, {"source": str(allowed / "ds" / "nope.txt"), "short_side": SHORT})
    assert code == 400 and "cannot read the file list (FileNotFoundError)" in reply["error"], reply
    assert n.d.store.status_get(REGISTRY_KEY) == {}


def test_a_list_is_read_bounded(tmp_path) -> None:
    """validate_file_list (what POST /datasets runs) reads at most max_bytes: a larger list is refused by
    its size, or -- size unknown (an HTTP answer without Content-Length) -- once the stream passes it."""
    import io

    from datacache.filelist import _stream_lines
    from datacache.manifest import ManifestError, validate_file_list

    lst = tmp_path / "big.csv"
    lst.write_text("path,label\n" + "c000/00000.JPEG,0\n" * 4000)
    with pytest.raises(ManifestError, match="is 72011 bytes, more than the 10000 bytes"):
        validate_file_list(str(lst), max_bytes=10_000)
    with pytest.raises(ManifestError, match="larger than the 10000 bytes"):
        list(_stream_lines(io.BytesIO(lst.read_bytes()), 10_000, "x"))
    assert validate_file_list(str(lst), max_bytes=100_000) == 4000


# ------------------------------------------------------------------------------------------ symlinks
@needs_redis
def test_symlinks_out_of_the_allowed_folder_are_quarantined_and_never_read(node, redis_url: str,
                                                                           tmp_path) -> None:
    """An ImageFolder with a file symlink out of the allowed folder (and one pointing inside, which stays
    fine), and a file list naming files through a DIRECTORY symlink out of it (fsspec's ``ls`` follows it;
    its folder walk does not descend into directory links)."""
    allowed = tmp_path / "allowed"
    root = _images(str(allowed / "ds"), classes=2, per_class=3)
    outside = _images(str(tmp_path / SECRET), classes=2, per_class=2, seed=9)
    os.symlink(os.path.join(outside, "c000", "00000.JPEG"), os.path.join(root, "c000", "evil.JPEG"))  # file
    os.symlink(os.path.join(outside, "c001"), os.path.join(root, "c001", "sub"))  # a directory
    os.symlink("../c000/00001.JPEG", os.path.join(root, "c001", "alias.JPEG"))  # inside: fine
    lst = os.path.join(root, "list.txt")
    with open(lst, "w") as f:
        f.write("c000/00000.JPEG,0\nc001/sub/00000.JPEG,1\nc001/sub/00001.JPEG,1\nc001/00000.JPEG,1\n"
                "c000/evil.JPEG,0\n")
    n = node(allowed_sources=(str(allowed),))
    for src in (root, lst):
        code, reply = _post(n.port, {"source": src, "short_side": SHORT})
        assert code == 201, reply
    states = {st.spec.source: st for st in n.round()}
    for src, total, escaping in ((root, 8, {"c000/evil.JPEG"}),
                                 (lst, 5, {"c000/evil.JPEG", "c001/sub/00000.JPEG", "c001/sub/00001.JPEG"})):
        state = states[src]
        man = state.manifest
        assert state.error == "" and len(man) == total and escaping <= set(man.paths), state.error
        assert len(state.quarantined) == len(escaping) and set(state.quarantined.examples) == escaping
        for reason in state.quarantined.examples.values():
            assert "ConfinementError" in reason and "outside the allowed sources" in reason, reason
        # the escaping files' bytes were never read: bytes_read is the sum of the files inside
        inside = [p for p in man.paths if p not in escaping]
        assert state.bytes_read == sum(os.path.getsize(os.path.join(root, p)) for p in inside)
        cached = n.cached(state)
        assert {p for i, p in enumerate(man.paths) if not cached[i]} == escaping
    assert len(_sample_keys(redis_url)) == 7 + 2  # the folder's 6 images and alias, the list's 2
    status = _status(n.port)
    assert sorted(d["quarantined_count"] for d in status["datasets"]) == [1, 3]
    assert SECRET not in json.dumps(status)


@needs_redis
def test_a_file_swapped_for_an_outside_symlink_after_the_listing_is_refused(node, redis_url: str,
                                                                           tmp_path) -> None:
    """TOCTOU: the listing saw a regular file; by read time it is a symlink to an outside file of the same
    size (so the size check cannot catch it). The daemon opens it, checks the real path of the open
    descriptor and refuses; the image outside is never decoded."""
    from datacache.cacheurl import parse_cache_url
    from datacache.manifest import Manifest
    from datacache.readthrough import manifest_dir_for

    root = _images(str(tmp_path / "ds"), classes=1, per_class=4)
    files = sorted((os.path.getsize(os.path.join(root, "c000", f)), f) for f in os.listdir(root + "/c000"))
    (_, donor), (size, victim) = files[0], files[-1]
    assert os.path.getsize(os.path.join(root, "c000", donor)) < size
    os.makedirs(tmp_path / SECRET)
    secret = tmp_path / SECRET / "other.JPEG"  # another image, padded to the victim's size (still decodes)
    data = _read(os.path.join(root, "c000", donor))
    secret.write_bytes(data + b"\0" * (size - len(data)))
    spec = DatasetSpec(root, short_side=SHORT, revalidate="none")  # the pass trusts the listing below
    n = node(datasets=(spec,))
    Manifest.build(root, persist_dir=manifest_dir_for(parse_cache_url(redis_url)))  # the listing
    victim_path = os.path.join(root, "c000", victim)
    os.remove(victim_path)
    os.symlink(secret, victim_path)  # swapped in after the listing
    (state,) = n.round()
    assert state.error == "" and list(state.quarantined.examples) == [f"c000/{victim}"]
    assert "ConfinementError" in state.quarantined.examples[f"c000/{victim}"]
    cached = n.cached(state)
    assert [p for i, p in enumerate(state.manifest.paths) if not cached[i]] == [f"c000/{victim}"]


def test_a_symlink_swapped_in_while_reading_never_serves_the_outside_bytes(tmp_path) -> None:
    """A path flipped between an inside file and a symlink to an outside file of the same size, as fast
    as a thread can, while a confined Source reads it: every read is the inside bytes or a refusal
    (realpath-then-open would sometimes read the outside file). Asserts no timing."""
    root = tmp_path / "ds"
    (root / "c").mkdir(parents=True)
    (tmp_path / SECRET).mkdir()
    inside, outside = b"I" * 4096, b"O" * 4096
    (root / "master.bin").write_bytes(inside)
    (tmp_path / SECRET / "o.bin").write_bytes(outside)
    target = root / "c" / "x.JPEG"
    os.link(root / "master.bin", target)
    stop = threading.Event()

    def flip() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            tmp = root / f".tmp{k}"
            if k % 2:
                os.symlink(tmp_path / SECRET / "o.bin", tmp)
            else:
                os.link(root / "master.bin", tmp)
            os.replace(tmp, target)

    src = Source(str(root), confine=(str(root),), retries=0)
    t = threading.Thread(target=flip, daemon=True)
    t.start()
    got: dict[str, int] = {"inside": 0, "refused": 0}
    try:
        for _ in range(1500):
            try:
                data = src.read("c/x.JPEG")
            except SourceError as e:
                assert isinstance(e.cause, ConfinementError), e
                got["refused"] += 1
                continue
            assert data == inside, "the outside file was read"
            got["inside"] += 1
    finally:
        stop.set()
        t.join(10)
    assert got["inside"] + got["refused"] == 1500


def test_the_descriptor_check_itself_both_ways(tmp_path) -> None:
    """fd_real_path: /proc's link names the file that is OPEN (the swap after the open changes nothing);
    without /proc the name's real path is accepted only if it is still the open file."""
    (tmp_path / "ds").mkdir()
    (tmp_path / SECRET).mkdir()
    name = tmp_path / "ds" / "a.JPEG"
    name.write_bytes(b"inside")
    (tmp_path / SECRET / "b.JPEG").write_bytes(b"outside")
    fd = os.open(name, os.O_RDONLY)
    try:
        os.remove(name)
        os.symlink(tmp_path / SECRET / "b.JPEG", name)  # swapped after the open
        if os.path.isdir("/proc/self/fd"):
            assert fd_real_path(fd, str(name)).startswith(str(tmp_path / "ds" / "a.JPEG"))
        with pytest.raises(ConfinementError, match="changed while it was being opened"):
            fd_real_path(fd, str(name), use_proc=False)
    finally:
        os.close(fd)


def test_confined_local_reads_refuse_fifos_and_escapes_and_keep_inside_links(tmp_path) -> None:
    root = tmp_path / "ds"
    (root / "c").mkdir(parents=True)
    (tmp_path / SECRET).mkdir()
    (root / "c" / "a.JPEG").write_bytes(b"a")
    (tmp_path / SECRET / "s.JPEG").write_bytes(b"s")
    os.symlink(tmp_path / SECRET / "s.JPEG", root / "c" / "out.JPEG")
    os.symlink("a.JPEG", root / "c" / "in.JPEG")
    os.mkfifo(root / "c" / "fifo.JPEG")  # opening it without O_NONBLOCK would wait for a writer forever
    src = Source(str(root), confine=(str(root),), t1_dir=str(tmp_path / "t1"), force_t1=True)
    assert src.read("c/a.JPEG") == src.read("c/in.JPEG") == b"a"
    got = src.read_many(["c/a.JPEG", "c/out.JPEG", "c/fifo.JPEG", "../" + SECRET + "/s.JPEG"])
    assert got[0] == b"a"
    for e in got[1:]:
        assert isinstance(e, SourceError)
    assert isinstance(got[1].cause, ConfinementError) and isinstance(got[3].cause, ConfinementError)
    assert isinstance(got[2].cause, NotARegularFile)
    assert "outside the allowed sources" in str(got[1]) and SECRET not in str(got[1]).split(": ", 1)[1]
    assert src.stats()["refused"] == 2 and src.stats()["retries"] == 0  # permanent: not retried
    assert not os.path.exists(tmp_path / "t1")  # a confined local source keeps no T1 (no check skipped)
    # unconfined (a user's own CachedImageNet): symlinks are followed as before
    assert Source(str(root)).read("c/out.JPEG") == b"s"


@needs_redis
def test_a_config_dataset_is_confined_to_its_root_plus_allowed_sources(node, tmp_path) -> None:
    """A symlink farm listed in daemon.toml: its links' targets are read only once allowed_sources
    names them (documented)."""
    store = _images(str(tmp_path / "store"), classes=1, per_class=3)
    farm = tmp_path / "farm"
    _images(str(farm), classes=1, per_class=2)  # c000: real files
    (farm / "c001").mkdir()
    for f in os.listdir(os.path.join(store, "c000")):
        os.symlink(os.path.join(store, "c000", f), farm / "c001" / f)
    spec = DatasetSpec(str(farm), short_side=SHORT)
    (state,) = node(datasets=(spec,)).round()
    assert len(state.quarantined) == 3 and all(p.startswith("c001/") for p in state.quarantined.examples)
    (state,) = node(datasets=(spec,), allowed_sources=(store,)).round()
    assert len(state.quarantined) == 0 and state.status == "full", state.error


@needs_redis
def test_the_daemon_process_quarantines_an_escaping_symlink(redis_url: str, tmp_path) -> None:
    """The real ``cache_daemon`` process with a config dataset: the escaping link shows in /status's
    quarantine summary, every other sample is cached, and the daemon stops cleanly."""
    root = _images(str(tmp_path / "ds"), classes=2, per_class=2)
    outside = _images(str(tmp_path / SECRET), classes=1, per_class=1, seed=5)
    os.symlink(os.path.join(outside, "c000", "00000.JPEG"), os.path.join(root, "c001", "evil.JPEG"))
    port = free_port()
    log = tmp_path / "d.log"
    env = {**os.environ, "PYTHONPATH": REPO, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--no-progress", "--workers", "1",
                              "--poll-interval", "0.3", "--cache", redis_url, "--dataset", root,
                              "--short-side", str(SHORT), "--http-port", str(port), "--node", "n1"],
                             stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                (d,) = _status(port)["datasets"]
                if d["passes"] >= 1:
                    break
            except OSError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert d["quarantined_count"] == 1 and list(d["quarantined"]) == ["c001/evil.JPEG"], d
        assert "ConfinementError" in d["quarantined"]["c001/evil.JPEG"]
        assert "outside the allowed sources" in d["quarantined"]["c001/evil.JPEG"]
        assert len(_sample_keys(redis_url)) == 4
        assert SECRET not in log.read_text()
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            assert p.wait(60) == 0, log.read_text()
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


# ------------------------------------------------------------------------------------------ HTTP redirects
class _Recorder(http.server.BaseHTTPRequestHandler):
    """The server a redirect points to: records every request and would serve an image."""

    seen: ClassVar[list[str]] = []
    body: ClassVar[bytes] = b""

    def do_GET(self) -> None:
        type(self).seen.append(f"{self.command} {self.path}")
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(self.body)

    do_HEAD = do_GET

    def log_message(self, *a: Any) -> None:
        pass


class _Web(http.server.SimpleHTTPRequestHandler):
    """The allowed server: a directory tree (with its own ``/dir`` -> ``/dir/`` redirects), where
    ``evil.JPEG`` (and the list ``evil.txt``) redirect to the recorder, ``moved.JPEG`` to an image on this
    server under the allowed prefix, and ``noloc.JPEG`` answers 302 with no Location and an image as its
    body."""

    seen: ClassVar[list[str]] = []
    elsewhere: ClassVar[str] = ""
    body: ClassVar[bytes] = b""

    def _special(self) -> bool:
        type(self).seen.append(f"{self.command} {self.path}")
        name = self.path.rsplit("/", 1)[-1]
        if name not in ("evil.JPEG", "evil.txt", "moved.JPEG", "noloc.JPEG"):
            return False
        self.send_response(302)
        if name.startswith("evil."):
            self.send_header("Location", self.elsewhere)
        elif name == "moved.JPEG":
            self.send_header("Location", "/ds/c000/00000.JPEG")
        body = self.body if name == "noloc.JPEG" else b""
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)
        return True

    def do_GET(self) -> None:
        if not self._special():
            super().do_GET()

    def do_HEAD(self) -> None:
        if not self._special():
            super().do_HEAD()

    def log_message(self, *a: Any) -> None:
        pass


def _serve(handler: Any) -> tuple[http.server.ThreadingHTTPServer, int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


@pytest.fixture
def web(tmp_path) -> Iterator[dict[str, Any]]:
    """Two real HTTP servers on loopback: ``allowed`` (serving ``<tmp>/web``) and ``other``."""
    webroot = tmp_path / "web"
    _images(str(webroot / "ds"), classes=2, per_class=3)
    for name in ("evil.JPEG", "moved.JPEG", "noloc.JPEG"):  # listed in the directory page
        (webroot / "ds" / "c000" / name).write_bytes(b"placeholder")
    (webroot / "ds" / "train.txt").write_text("".join(f"{c}/{n},{k}\n" for k, c in enumerate(("c000", "c001"))
                                                      for n in sorted(os.listdir(webroot / "ds" / c))))
    secret = _images(str(tmp_path / SECRET), classes=1, per_class=1, seed=3)
    rec = type("Rec", (_Recorder,), {"seen": [], "body": _read(os.path.join(secret, "c000", "00000.JPEG"))})
    other, oport = _serve(rec)
    web_h = type("Web", (_Web,), {"seen": [], "elsewhere": f"http://127.0.0.1:{oport}/secret.JPEG",
                                  "body": rec.body})
    allowed, aport = _serve(functools.partial(web_h, directory=str(webroot)))
    yield {"url": f"http://127.0.0.1:{aport}/ds", "other": rec, "allowed": web_h, "root": str(webroot / "ds"),
           "secret": rec.body}
    for srv in (allowed, other):
        srv.shutdown()
        srv.server_close()


def test_http_redirects_leave_the_allowed_prefixes_never(web: dict, tmp_path) -> None:
    url, other = web["url"], web["other"]
    t1 = str(tmp_path / "t1")
    src = Source(url, confine=(url,), t1_dir=t1, backoff=0.001)
    ident = {"size": len(web["secret"]), "identity": f"{len(web['secret'])}:1.0:0"}
    with pytest.raises(SourceError) as ei:
        src.read("c000/evil.JPEG", **ident)
    assert isinstance(ei.value.cause, RedirectRefused) and "redirected (HTTP 302) outside" in str(ei.value)
    assert "secret.JPEG" not in str(ei.value)  # the Location is not echoed
    with pytest.raises(SourceError) as ei:
        src.read("c000/noloc.JPEG")  # the 3xx's body is an image: never taken for the file
    assert isinstance(ei.value.cause, RedirectRefused)
    assert src.read("c000/moved.JPEG") == _read(os.path.join(web["root"], "c000", "00000.JPEG"))  # inside
    got = src.read_many(["c000/00001.JPEG", "c000/evil.JPEG", "c001/00000.JPEG", "c000/noloc.JPEG"])
    assert got[0] == _read(os.path.join(web["root"], "c000", "00001.JPEG"))
    assert got[2] == _read(os.path.join(web["root"], "c001", "00000.JPEG"))
    assert isinstance(got[1], SourceError) and isinstance(got[1].cause, RedirectRefused)
    assert isinstance(got[3], SourceError) and isinstance(got[3].cause, RedirectRefused)
    for rel in ("c000/%2e%2e/%2e%2e/x.JPEG", "c000/..%2f..%2fx.JPEG", "c000/a\\..\\..\\x.JPEG"):
        with pytest.raises(SourceError, match="outside the allowed sources"):  # refused before any request
            src.read(rel)
    assert other.seen == []
    assert not any("x.JPEG" in s for s in web["allowed"].seen)
    # the same redirect unconfined (a user's own reader) does reach the other server: the setup is real.
    # Its bytes land in T1 -- and a confined reader with the same T1 and identity never serves them.
    assert Source(url, t1_dir=t1).read("c000/evil.JPEG", **ident) == web["secret"]
    assert other.seen == ["GET /secret.JPEG"]
    with pytest.raises(SourceError) as ei:
        Source(url, confine=(url,), t1_dir=t1).read("c000/evil.JPEG", **ident)
    assert isinstance(ei.value.cause, RedirectRefused) and other.seen == ["GET /secret.JPEG"]


@needs_redis
def test_the_daemon_follows_no_redirect_to_another_server(node, redis_url: str, web: dict) -> None:
    url, other = web["url"], web["other"]
    n = node(allowed_sources=(url,))
    code, reply = _post(n.port, {"source": url + "/evil.txt", "short_side": SHORT})  # the list redirects
    assert code == 400 and "cannot read the file list" in reply["error"] and other.seen == [], reply
    # an HTTP source is a file list (fsspec's HTTP "info" cannot tell a directory page from a file); its
    # directories are listed through the server's pages, whose /dir -> /dir/ redirects stay inside
    code, reply = _post(n.port, {"source": url + "/train.txt", "short_side": SHORT})
    assert code == 201, reply
    (state,) = n.round()
    man = state.manifest
    assert state.error == "" and len(man) == 9, (state.error, list(man.paths) if man else None)
    assert set(state.quarantined.examples) == {"c000/evil.JPEG", "c000/noloc.JPEG"}
    for reason in state.quarantined.examples.values():
        assert "RedirectRefused" in reason, reason
    assert other.seen == []  # the listing, the reads: not one request to the other server
    cached = n.cached(state)
    assert {p for i, p in enumerate(man.paths) if not cached[i]} == {"c000/evil.JPEG", "c000/noloc.JPEG"}
    assert len(_sample_keys(redis_url)) == 7


def test_unreadable_list_is_reported_without_its_content(tmp_path) -> None:
    """A "list" that is really some other file (anything under allowed_sources can be named .txt): the
    errors name lines and reasons, never the text."""
    from datacache.manifest import ManifestError, validate_file_list

    p = tmp_path / "notes.txt"
    p.write_text("user,hunter2\n/etc/shadow-ish,123456789\n")
    with pytest.raises(ManifestError) as ei:
        validate_file_list(str(p))
    assert "line 2" in str(ei.value) and "hunter2" not in str(ei.value) and "shadow" not in str(ei.value)
    shutil.copy(p, tmp_path / "b.csv")
    (tmp_path / "b.csv").write_bytes(b"\xff\xfe bad utf8\n")
    with pytest.raises(ManifestError, match="not UTF-8"):
        validate_file_list(str(tmp_path / "b.csv"))
    assert validate_file_list(str(tmp_path)) == 0  # a directory source: nothing to check


def test_a_confined_source_pickles_with_its_prefixes(tmp_path) -> None:
    """DataLoader workers (fork and spawn) get the configuration only: the prefixes travel with it."""
    import pickle

    root = tmp_path / "ds"
    root.mkdir()
    (tmp_path / SECRET).mkdir()
    (root / "a.JPEG").write_bytes(b"a")
    (tmp_path / SECRET / "s.JPEG").write_bytes(b"s")
    os.symlink(tmp_path / SECRET / "s.JPEG", root / "l.JPEG")
    src = Source(str(root), confine=(str(root),))
    assert src.read("a.JPEG") == b"a"
    copy = pickle.loads(pickle.dumps(src))
    assert copy.read("a.JPEG") == b"a"
    with pytest.raises(SourceError, match="outside the allowed sources"):
        copy.read("l.JPEG")
    with pytest.raises(ValueError, match="chained"):
        Source("simplecache::file://" + str(root), confine=(str(root),))


def test_url_prefix_rules() -> None:
    from datacache.confine import confine_prefix, url_under

    p = (confine_prefix("https://Data.Example.com/sets/"), confine_prefix("s3://bucket/imagenet"))
    assert p[0] == ("https", "data.example.com", "/sets")
    assert url_under("https://data.example.com/sets/a/b.JPEG", p)
    assert url_under("s3://bucket/imagenet/train/x.JPEG", p)
    for bad in ("http://data.example.com/sets/a.JPEG",         # another scheme
                "https://data.example.com:8443/sets/a.JPEG",    # another port
                "https://data.example.com.evil.org/sets/a.JPEG",
                "https://data.example.com/sets-evil/a.JPEG",    # not on a segment boundary
                "https://data.example.com/sets/../admin",
                "https://data.example.com/sets/%2e%2e/admin",   # decoded by the server
                "https://data.example.com/sets/a%2f..%2f..%2fadmin",
                "https://data.example.com/sets/a\\..\\..\\admin",
                "s3://bucket/imagenet-other/x.JPEG", "s3://other/imagenet/x.JPEG", "", "not a url"):
        assert not url_under(bad, p), bad


def test_a_confined_local_stand_in_reads_through_its_own_opener(tmp_path) -> None:
    """slowfile:// (the NFS stand-in the daemon tests and benches use) keeps its pacing: it reopens the
    name, and what it opened must be the file whose descriptor was checked."""
    from datacache.devtools import slowfs

    root = tmp_path / "ds"
    root.mkdir()
    (tmp_path / SECRET).mkdir()
    (root / "a.JPEG").write_bytes(b"a" * 100)
    (tmp_path / SECRET / "s.JPEG").write_bytes(b"s")
    os.symlink(tmp_path / SECRET / "s.JPEG", root / "l.JPEG")
    slowfs.reset_counters()
    src = Source(f"slowfile://{root}?latency_ms=0&mbps=0", confine=(f"slowfile://{root}",), t1_dir=None)
    assert src.read("a.JPEG") == b"a" * 100 and slowfs.COUNTERS["opens"] == 1
    with pytest.raises(SourceError, match="outside the allowed sources"):
        src.read("l.JPEG")
    assert slowfs.COUNTERS["opens"] == 1  # refused before the stand-in opened (or read) anything
