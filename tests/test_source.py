from __future__ import annotations

import functools
import http.server
import multiprocessing as mp
import os
import pickle
import shutil
import threading
from collections.abc import Iterator

import aiohttp
import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from datacache.devtools import slowfs
from datacache.manifest import Manifest
from datacache.source import SizeMismatchError, Source, SourceError, is_transient


def slow_url(root: str) -> str:
    return f"slowfile://{root}?latency_ms=1&mbps=0"


def idents(root: str, rels: list[str]) -> dict:
    """What CachedImageNet passes for these files: the manifest's sizes and identities."""
    m = Manifest.build(root)
    pos = {p: k for k, p in enumerate(m.paths)}
    return {"sizes": [int(m.sizes[pos[r]]) for r in rels], "identities": [m.identity(pos[r]) for r in rels]}


def raw(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as f:
        return f.read()


def test_local_source_skips_t1(small_imagefolder: str, tmp_path) -> None:
    t1 = str(tmp_path / "t1")
    s = Source(small_imagefolder, t1_dir=t1)
    assert s.url == "file://" + small_imagefolder and not s.use_t1
    assert s.read("c000/00000.JPEG") == raw(small_imagefolder, "c000/00000.JPEG")
    assert not os.path.exists(t1) and s.stats()["t1_hits"] == s.stats()["t1_misses"] == 0
    forced = Source(small_imagefolder, t1_dir=t1, force_t1=True)
    ident = idents(small_imagefolder, ["c000/00000.JPEG"])["identities"][0]
    forced.read("c000/00000.JPEG", identity=ident)
    forced.read("c000/00000.JPEG", identity=ident)
    assert forced.stats()["t1_misses"] == 1 and forced.stats()["t1_hits"] == 1
    assert Source("slowfile:///x", t1_dir=None).use_t1 is False


def test_t1_hits_avoid_the_slow_source(small_imagefolder: str, tmp_path) -> None:
    t1 = str(tmp_path / "t1")
    rels = [f"c00{c}/0000{i}.JPEG" for c in range(3) for i in range(4)]
    kw = idents(small_imagefolder, rels)
    slowfs.reset_counters()
    first = Source(slow_url(small_imagefolder), t1_dir=t1)
    assert first.use_t1
    got = first.read_many(rels, **kw)
    assert got == [raw(small_imagefolder, r) for r in rels]
    assert slowfs.COUNTERS["opens"] == len(rels) and first.stats()["t1_misses"] == len(rels)
    assert first.stats()["bytes_read"] == sum(len(g) for g in got)
    # a later job (fresh Source, same T1 dir) never touches the slow filesystem
    slowfs.reset_counters()
    second = Source(slow_url(small_imagefolder), t1_dir=t1)
    assert second.read_many(rels, **kw) == got
    assert second.read(rels[0], identity=kw["identities"][0]) == got[0]
    assert slowfs.COUNTERS["requests"] == 0 and second.stats()["t1_hits"] == len(rels) + 1
    assert second.stats()["bytes_read"] == 0
    # without the manifest's identity T1 cannot be trusted: the read goes to the source
    assert second.read(rels[0]) == got[0] and slowfs.COUNTERS["opens"] == 1


def test_plain_simplecache_chain_over_slowfile(small_imagefolder: str, tmp_path) -> None:
    url = "simplecache::slowfile://" + small_imagefolder + "/c001/00002.JPEG"
    opts = {"simplecache": {"cache_storage": str(tmp_path / "c")}, "slowfile": {"latency_ms": 1, "mbps": 500}}
    slowfs.reset_counters()
    for _ in range(3):
        with fsspec.open(url, **opts) as f:
            assert f.read() == raw(small_imagefolder, "c001/00002.JPEG")
    assert slowfs.COUNTERS["opens"] == 1  # only the first open reached the slow filesystem
    fs = fsspec.filesystem("slowfile", latency_ms=3, mbps=7)
    assert (fs.latency_s, fs.bytes_per_s) == (0.003, 7e6)
    q_fs, q_path = fsspec.core.url_to_fs("slowfile:///data/x?latency_ms=9&mbps=1")
    assert (q_fs.latency_s, q_fs.bytes_per_s, q_path) == (0.009, 1e6, "/data/x")


def test_unreadable_files_name_the_file(bad_imagefolder: str, bad_cases: dict, tmp_path) -> None:
    for url in (bad_imagefolder, slow_url(bad_imagefolder)):
        s = Source(url, t1_dir=str(tmp_path / "t1"), backoff=0.001)
        for case, advice in (("dangling_symlink", "does not exist"),
                             ("directory_named_jpeg", "is a directory")):
            rel = bad_cases[case]
            with pytest.raises(SourceError, match=advice) as ei:
                s.read(rel)
            assert ei.value.path.endswith(rel) and rel in str(ei.value)
            assert isinstance(ei.value.cause, OSError)
        rels = [bad_cases["unicode"], bad_cases["dangling_symlink"], "c000/missing.JPEG",
                bad_cases["directory_named_jpeg"], bad_cases["zero_byte"]]
        out = s.read_many(rels)
        assert out[0] == raw(bad_imagefolder, bad_cases["unicode"]) and out[4] == b""
        for i in (1, 2, 3):
            assert isinstance(out[i], SourceError) and out[i].path.endswith(rels[i])
        st = s.stats()
        assert st["errors"] == 5 and st["retries"] == 0  # permanent errors are not retried
        err = pickle.loads(pickle.dumps(out[1]))  # travels back from DataLoader workers
        assert err.path == out[1].path and "does not exist" in str(err)


class FlakyFileSystem(LocalFileSystem):
    """Local files that fail with EIO the first ``FAILS`` reads of each path (a real transient fault)."""

    protocol = ("flakyfile",)
    FAILS = 2
    seen: dict[str, int] = {}  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path):  # type: ignore[override]
        path = str(path)
        return LocalFileSystem._strip_protocol(path[len("flakyfile://"):] if path.startswith("flakyfile://")
                                               else path)

    def cat_file(self, path, start=None, end=None, **kw):  # type: ignore[override]
        n = self.seen.get(path, 0)
        self.seen[path] = n + 1
        if n < self.FAILS:
            raise OSError(5, "Input/output error (injected)", path)
        return super().cat_file(path, start, end, **kw)


fsspec.register_implementation("flakyfile", FlakyFileSystem, clobber=True)


def test_transient_errors_are_retried_with_backoff(small_imagefolder: str, tmp_path) -> None:
    FlakyFileSystem.seen.clear()
    s = Source("flakyfile://" + small_imagefolder, t1_dir=str(tmp_path / "t1"), retries=3, backoff=0.001)
    assert s.read("c000/00001.JPEG") == raw(small_imagefolder, "c000/00001.JPEG")
    assert s.stats()["retries"] == 2 and s.stats()["errors"] == 0
    out = s.read_many(["c000/00002.JPEG", "c000/00003.JPEG"])
    assert all(isinstance(o, bytes) for o in out) and s.stats()["retries"] == 6
    FlakyFileSystem.seen.clear()
    stubborn = Source("flakyfile://" + small_imagefolder, t1_dir=None, retries=1, backoff=0.001)
    with pytest.raises(SourceError, match="Input/output error"):
        stubborn.read("c000/00004.JPEG")
    assert stubborn.stats()["retries"] == 1 and stubborn.stats()["errors"] == 1
    assert is_transient(TimeoutError()) and is_transient(aiohttp.ClientConnectionError())
    assert not is_transient(PermissionError()) and not is_transient(ValueError())
    info = aiohttp.RequestInfo(url="http://x", method="GET", headers={}, real_url="http://x")  # type: ignore[arg-type]
    assert is_transient(aiohttp.ClientResponseError(info, (), status=503))
    assert not is_transient(aiohttp.ClientResponseError(info, (), status=403))


def test_t1_trim_is_lru_by_atime(small_imagefolder: str, tmp_path) -> None:
    t1 = str(tmp_path / "t1")
    rels = [f"c00{c}/0000{i}.JPEG" for c in range(3) for i in range(8)]
    size = max(os.path.getsize(os.path.join(small_imagefolder, r)) for r in rels)
    ident = dict(zip(rels, idents(small_imagefolder, rels)["identities"]))
    s = Source(slow_url(small_imagefolder), t1_dir=t1, t1_max_bytes=6 * size)
    s.read(rels[0], identity=ident[rels[0]])
    for r in rels[1:]:
        s.read(r, identity=ident[r])
        s.read(rels[0], identity=ident[rels[0]])  # keeps rels[0] the most recently used
    total = sum(os.path.getsize(os.path.join(t1, f)) for f in os.listdir(t1))
    assert total <= 6 * size and s.stats()["t1_evicted_bytes"] > 0
    slowfs.reset_counters()
    s.read(rels[0], identity=ident[rels[0]])
    s.read(rels[-1], identity=ident[rels[-1]])
    assert slowfs.COUNTERS["opens"] == 0  # the hot entry and the newest entry survived
    s.read(rels[1], identity=ident[rels[1]])
    assert slowfs.COUNTERS["opens"] == 1  # an old one was evicted


def test_t1_is_keyed_by_the_files_identity(tmp_path) -> None:
    """A file replaced by another of the same size (rsync's write-then-rename) is never served from
    its old T1 copy; a read whose length differs from the listing is a transient failure."""
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    f = root / "a" / "x.jpg"
    f.write_bytes(b"old-bytes")
    os.utime(f, (1_000_000, 1_000_000))
    url = slow_url(str(root))
    s = Source(url, t1_dir=str(tmp_path / "t1"), backoff=0.001)
    assert s.read_many(["a/x.jpg"], **idents(str(root), ["a/x.jpg"])) == [b"old-bytes"]
    tmp = root / "a" / ".x.jpg.tmp"
    tmp.write_bytes(b"new-bytes")  # same size, new content, new mtime, renamed over the old file
    os.replace(tmp, f)
    kw = idents(str(root), ["a/x.jpg"])
    assert s.read_many(["a/x.jpg"], **kw) == [b"new-bytes"]
    assert s.read("a/x.jpg", **{"size": kw["sizes"][0], "identity": kw["identities"][0]}) == b"new-bytes"
    assert s.stats()["t1_hits"] == 1  # the refilled entry, not the old one
    # the file changes length after listing: a read from the source is retried, then a SourceError
    # for this run, and nothing is written to T1
    f.write_bytes(b"longer new bytes")
    fresh_t1 = tmp_path / "t1b"
    s2 = Source(url, t1_dir=str(fresh_t1), backoff=0.001, retries=2)
    out = s2.read_many(["a/x.jpg"], **kw)
    assert isinstance(out[0], SourceError) and isinstance(out[0].cause, SizeMismatchError)
    assert "changed since the dataset was listed" in str(out[0]) and s2.stats()["retries"] == 2
    assert not fresh_t1.exists() or not os.listdir(fresh_t1)
    with pytest.raises(SourceError, match="read 16 bytes but the listing says 9"):
        Source(url, t1_dir=None, backoff=0.001).read("a/x.jpg", size=kw["sizes"][0])


def _child_read(src: Source, rel: str, q: mp.Queue) -> None:
    q.put(src.read_many([rel, "nope.jpg"]))


def test_source_pickles_for_fork_and_spawn(small_imagefolder: str, tmp_path) -> None:
    s = Source(slow_url(small_imagefolder), t1_dir=str(tmp_path / "t1"))
    s.read_many(["c000/00000.JPEG", "c000/00001.JPEG"])  # the pool and filesystem exist in the parent
    clone = pickle.loads(pickle.dumps(s))
    assert clone.stats()["t1_misses"] == 0 and clone.read("c000/00000.JPEG")
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child_read, args=(s, "c002/00003.JPEG", q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0
        assert got[0] == raw(small_imagefolder, "c002/00003.JPEG") and isinstance(got[1], SourceError)


@pytest.fixture
def http_root(small_imagefolder: str) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=small_imagefolder)
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_async_protocol_reads_concurrently_through_t1(http_root: str, small_imagefolder: str,
                                                      tmp_path) -> None:
    t1 = str(tmp_path / "t1")
    s = Source(http_root, t1_dir=t1, backoff=0.001)
    rels = ["c000/00000.JPEG", "c001/00001.JPEG", "c002/00002.JPEG", "c000/missing.JPEG"]
    kw = idents(small_imagefolder, rels[:3])
    out = s.read_many(rels, sizes=[*kw["sizes"], -1], identities=[*kw["identities"], "0:0.0:0"])
    assert out[:3] == [raw(small_imagefolder, r) for r in rels[:3]]
    assert isinstance(out[3], SourceError) and "missing.JPEG" in out[3].path
    assert isinstance(out[3].cause, FileNotFoundError) and "does not exist" in str(out[3])
    assert s.stats()["t1_misses"] == 4 and s.stats()["errors"] == 1 and len(os.listdir(t1)) == 3
    again = Source(http_root, t1_dir=t1).read_many(rels[:3])  # no identity: T1 is not trusted
    assert again == out[:3]
    shutil.rmtree(t1)
