"""``slowfile://``: local files behind real per-request latency and a bandwidth cap.

Real NFS cannot be mounted on the development machines (no kernel module), so this is the
documented NFS / object-store stand-in for tests and benchmarks: a subclass of fsspec's
``LocalFileSystem`` whose every *request* -- an ``info``/``exists`` metadata call, one
directory listing (``ls``, and so each directory of ``find``/``walk``) and each ``open`` --
first sleeps ``latency_ms`` milliseconds. A listing returns every entry's size and mtime for
that one latency, as NFS READDIRPLUS and S3 ListObjectsV2 do (the per-entry ``stat`` that
``LocalFileSystem.ls`` makes locally is not charged). Data transfer is paced
to ``mbps`` megabytes per second shared by all threads of the process (a link: each read
reserves ``nbytes / rate`` seconds of link time after the reads queued before it and
sleeps until its slot ends). The sleeps are real, so concurrent readers overlap their
latencies like concurrent NFS RPCs do, but not their bandwidth. The cap is per process
(DataLoader workers each get their own link). It is not a simulator of NFS caching or of
close-to-open consistency.

Options come from ``storage_options`` or the URL query string::

    fsspec.filesystem("slowfile", latency_ms=2, mbps=200)
    fsspec.open("slowfile:///data/train/a/1.JPEG?latency_ms=2&mbps=200")
    fsspec.open("simplecache::slowfile:///data/x.jpg", slowfile={"latency_ms": 5})

Every request is counted in :data:`COUNTERS` (per process: ``requests``, ``opens``,
``listings``, ``bytes``, and the most listings ever in flight at once,
``max_concurrent_listings``) so tests can show that a T1 hit makes no request at all
without asserting on time. fsspec finds the protocol through the package's ``fsspec.specs`` entry
point (pyproject.toml) and imports this module on first use of ``slowfile://``; importing it also
registers the protocol. Nothing in the production import path imports it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

COUNTERS: dict[str, int] = {"requests": 0, "opens": 0, "bytes": 0, "listings": 0,
                            "max_concurrent_listings": 0}
_listing_now = [0]  # listings in flight (for max_concurrent_listings)
_lock = threading.Lock()
_in_listing = threading.local()  # set while ls() stats its entries: those stats are not requests


def reset_counters() -> None:
    with _lock:
        for k in COUNTERS:
            COUNTERS[k] = 0


def _count(key: str, n: int = 1) -> None:
    with _lock:
        COUNTERS[key] += n
        if key in ("opens", "listings"):
            COUNTERS["requests"] += n


class SlowFileSystem(LocalFileSystem):
    """Local filesystem with ``latency_ms`` per request and a ``mbps`` (MB/s) link cap per process."""

    protocol = ("slowfile",)
    root_marker = "/"

    def __init__(self, latency_ms: float = 2.0, mbps: float | None = 200.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latency_s = float(latency_ms) / 1000.0
        self.bytes_per_s = float(mbps) * 1e6 if mbps else None
        self._link_lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time at which the shared link is idle again

    # -- URL handling: strip "slowfile://" and the query string
    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("slowfile://"):
            path = path[len("slowfile://"):]
        elif path.startswith("slowfile:"):
            path = path[len("slowfile:"):]
        path = path.split("?", 1)[0]
        return LocalFileSystem._strip_protocol(path)

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        query = urlsplit(path).query if "?" in path else ""
        out: dict[str, Any] = {}
        for k, v in parse_qsl(query):
            if k in ("latency_ms", "mbps"):
                out[k] = float(v)
        return out

    def unstrip_protocol(self, name: str) -> str:
        """``slowfile://<path>?latency_ms=..&mbps=..``: the URL keeps this instance's options, so a
        manifest root handed to a :class:`~datacache.source.Source` reads at the same speed."""
        mbps = self.bytes_per_s / 1e6 if self.bytes_per_s else 0
        return f"slowfile://{self._strip_protocol(name)}?latency_ms={self.latency_s * 1000:g}&mbps={mbps:g}"

    # -- the costs
    def _wait(self) -> None:
        _count("requests")
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _transfer(self, nbytes: int) -> None:
        _count("bytes", nbytes)
        if self.bytes_per_s and nbytes > 0:
            with self._link_lock:
                start = max(time.monotonic(), self._link_free_at)
                self._link_free_at = end = start + nbytes / self.bytes_per_s
            delay = end - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    # -- metadata requests
    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        if not getattr(_in_listing, "active", False):
            self._wait()
        return super().info(path, **kwargs)

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> Any:
        """One request per listing, sizes and mtimes included (READDIRPLUS / ListObjectsV2)."""
        _count("listings")
        with _lock:
            _listing_now[0] += 1
            COUNTERS["max_concurrent_listings"] = max(COUNTERS["max_concurrent_listings"], _listing_now[0])
        _in_listing.active = True
        try:
            if self.latency_s > 0:
                time.sleep(self.latency_s)
            return super().ls(path, detail=detail, **kwargs)
        finally:
            _in_listing.active = False
            with _lock:
                _listing_now[0] -= 1

    # -- data requests
    def _open(self, path: Any, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" not in mode:
            return super()._open(path, mode=mode, block_size=block_size, autocommit=autocommit, **kwargs)
        _count("opens")
        if self.latency_s > 0:
            time.sleep(self.latency_s)
        return _SlowFile(self, path, mode=mode, **kwargs)

    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        with self._open(path, "rb") as f:
            if start is not None:
                f.seek(start if start >= 0 else max(0, f.size + start))
            n = -1 if end is None else (end if end >= 0 else f.size + end) - (f.tell())
            return f.read(n)

    def get_file(self, rpath: Any, lpath: Any, **kwargs: Any) -> None:
        """Download through the throttled reader (LocalFileSystem would copy the file directly)."""
        if isinstance(lpath, str) and os.path.isdir(lpath):
            lpath = os.path.join(lpath, os.path.basename(self._strip_protocol(rpath)))
        with self._open(rpath, "rb") as src, open(lpath, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    def cp_file(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        self.get_file(path1, self._strip_protocol(path2))


class _SlowFile(LocalFileOpener):
    """A local file whose reads pay the filesystem's bandwidth cap (latency was paid at open)."""

    def __init__(self, sfs: SlowFileSystem, path: str, mode: str = "rb", **kwargs: Any) -> None:
        super().__init__(path, mode, fs=sfs, **kwargs)
        self._sfs = sfs
        self.size = os.path.getsize(path)

    def read(self, n: int = -1) -> bytes:
        data = super().read(n)
        self._sfs._transfer(len(data))
        return data

    def readinto(self, b: Any) -> int:
        n = super().readinto(b)
        self._sfs._transfer(n or 0)
        return n


fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)
