"""Reading original files (T0) through a local raw-bytes disk cache (T1).

Every source is an fsspec URL (``/data/train``, ``file://``, ``slowfile://`` (the NFS
stand-in, :mod:`datacache.devtools.slowfs`), ``s3://``, ``http://`` ...). T1 keeps raw file bytes in
``t1_dir``, one file per source path named like fsspec's ``simplecache`` (sha256 of the path),
with three deliberate differences from ``simplecache``:

* **Keyed by the file's identity.** Each entry starts with a small header holding the identity
  the manifest listed for the file (size, mtime, and the ETag/version where the protocol has one:
  :meth:`datacache.manifest.Manifest.identity`). A lookup hits only when the entry's identity
  *and* its length equal the manifest entry's, so a file replaced by another of the same size
  (rsync's write-then-rename) is never served from its old copy: the entry is refilled.
  Reads without an identity skip T1.
* **Atomic fills.** simplecache downloads straight into the final cache file, so a concurrent
  reader (another DataLoader worker) can see half a file and an interrupted download leaves a
  truncated file that is served forever. Misses are read from the source filesystem (with
  retries) and published with ``os.replace`` of a temp file.
* **Length check.** A read from the source whose length differs from the manifest's size (the
  file changed, or a short read) is a transient failure (:class:`SizeMismatchError`): retried,
  then reported as a :class:`SourceError` for this run, and never written to T1.

Local sources skip T1: for ``file://`` copying a file from one local disk to another gains
nothing and doubles the disk use (``force_t1=True`` overrides; a URL that already chains a
cache, ``simplecache::...``, is used as given). fsspec's caches have no size cap, so with
``t1_max_bytes`` the directory is trimmed LRU-by-atime: hits refresh the entry's atime
explicitly (``relatime`` mounts would not), and after every ~5 % of the cap written the
directory is scanned and the least recently used entries are removed down to 90 % of the
cap. Several processes may trim at once; a reader that loses its entry to a trim just
re-fetches it.

Transient errors (``OSError``/``TimeoutError`` other than not-found, is-a-directory,
not-a-directory and permission errors; aiohttp client errors other than 4xx) are retried
``retries`` times with exponential backoff and jitter (``backoff * 2**attempt``). Concurrent
reads use fsspec's async ``fs.cat(paths, on_error="return")`` when the protocol is async
(http, s3), a small thread pool otherwise.

Pickling (DataLoader workers, fork *and* spawn): only the configuration travels; the
filesystem objects and the thread pool are created lazily in each process (pid-checked).

**Confinement** (``confine=(prefix, ...)``; None, the default for a user's own dataset, = none): every
file must lie under one of the prefixes (URLs or paths, like the daemon's ``allowed_sources``) or it is
not read -- a :class:`ConfinementError` (permanent, never retried; its text names no bytes and no path
outside). Checked on every read path (``read``, ``read_many``'s T1 lookups, async gather and threads):

* **local files** (``file://``, plain paths, and local stand-ins such as ``slowfile://``): the file is
  opened first (``O_NONBLOCK``: a FIFO cannot hang the reader; ``O_CLOEXEC``), then the real path of
  the OPEN descriptor is checked -- ``os.readlink("/proc/self/fd/N")`` on Linux; elsewhere (no
  ``/proc``) ``os.path.realpath`` of the name, accepted only when it is the same file (device, inode)
  as the descriptor -- and only then is it read, from that descriptor: no time-of-check/time-of-use
  gap for a symlink swapped in between. A FIFO, socket or device is refused (:class:`NotARegularFile`).
  Not detected: hard links and bind mounts (the same file by every path; creating them needs rights
  over the dataset that already allow replacing its files). A confined local source uses no T1 (a hit
  would skip the descriptor check; copying local files gains nothing anyway).
* **other protocols**: the file's URL (scheme, host:port, ``..``-normalised path, also after
  percent-decoding) must lie under a prefix of the same scheme and host. HTTP(S) follows **no redirect
  outside the prefixes** (:func:`datacache.confine.redirect_guard_options`): aiohttp's redirect hook
  checks each ``Location`` before anything is sent there (:class:`RedirectRefused`); a redirect inside them (a
  server's ``/dir`` -> ``/dir/``) is followed; a 3xx that is not followed is an error, so a redirect's
  body is never taken for the file. T1 entries written by a confined source carry their own magic, so
  an entry written by an unconfined reader (which may have followed any redirect) is never served to a
  confined one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import random
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from datacache.config import default_t1_dir
from datacache.confine import (
    OPEN_FLAGS,
    OUTSIDE,
    Prefix,
    confine_prefix,
    fd_real_path,
    guarded_options,
    path_under,
    url_under,
)
from datacache.source_errors import (
    ConfinementError,
    NotARegularFile,
    SizeMismatchError,
    SourceError,
    is_transient,
)

_LOCAL_PROTOCOLS = ("file", "local")
_INIT_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def _new_init_lock() -> None:  # fork boundary: a lock held by a parent thread would stay held
    global _INIT_LOCK
    _INIT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_init_lock)

_T1_MAGIC = b"DCT1"
_T1_CONFINED = b"DCC1"  # written by a confined source: the only entries a confined source serves


def _t1_header(identity: str, magic: bytes = _T1_MAGIC) -> bytes:
    ident = identity.encode()
    return magic + len(ident).to_bytes(2, "little") + ident


def _t1_unwrap(raw: bytes, identity: str, confined: bool = False) -> bytes | None:
    """The payload of a T1 entry if it was written for ``identity`` (by a confined source when
    ``confined``; an unconfined reader takes either kind), else None."""
    for magic in (_T1_CONFINED,) if confined else (_T1_MAGIC, _T1_CONFINED):
        head = _t1_header(identity, magic)
        if raw.startswith(head):
            return raw[len(head):]
    return None


def _wrong_size(data: bytes, size: int | None) -> bool:
    """Whether ``data``'s length differs from the manifest's ``size`` (None or -1: unknown)."""
    return size is not None and size >= 0 and len(data) != size

def normalise_url(url: str) -> str:
    """Plain paths become absolute ``file://`` URLs; URLs are returned unchanged."""
    if "://" in url or "::" in url:
        return url
    return "file://" + os.path.abspath(os.path.expanduser(url))


class Source:
    """Reads relative paths under one dataset URL (see the module docstring)."""

    def __init__(self, url: str, *, t1_dir: str | None = "default", t1_max_bytes: int | None = None,
                 storage_options: dict | None = None, retries: int = 3, backoff: float = 0.2,
                 force_t1: bool = False, workers: int = 8, confine: Sequence[str] | None = None) -> None:
        self.url = normalise_url(url)
        if confine is not None and "::" in self.url:
            raise ValueError(f"{self.url}: a confined source cannot be a chained (cached) URL")
        # None: no confinement; a tuple (even empty: nothing is allowed) of normalised prefixes
        self.confine: tuple[Prefix, ...] | None = (None if confine is None
                                                   else tuple(confine_prefix(p) for p in confine))
        self.storage_options = dict(storage_options or {})
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.workers = int(workers)
        protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        chained = "::" in self.url
        self.t1_dir = default_t1_dir() if t1_dir == "default" else t1_dir
        if self.t1_dir:  # absolute: DataLoader workers / daemons may run with another cwd
            self.t1_dir = os.path.abspath(os.path.expanduser(self.t1_dir))
        self.use_t1 = bool(self.t1_dir) and not chained and (force_t1 or protocol not in _LOCAL_PROTOCOLS)
        self.t1_max_bytes = t1_max_bytes
        self._reset()

    def _reset(self) -> None:
        self._pid = -1
        self._fs: Any = None
        self._cfs: Any = None
        self._root = ""
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._trim_lock = threading.Lock()
        self._local = False  # a local-family filesystem (confined reads go through a descriptor)
        self._stats = {"t1_hits": 0, "t1_misses": 0, "bytes_read": 0, "retries": 0, "errors": 0,
                       "t1_evicted_bytes": 0, "refused": 0}
        self._since_trim = 0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_pid", "_fs", "_cfs", "_root", "_pool", "_lock", "_trim_lock", "_stats",
                             "_since_trim", "_local")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # ------------------------------------------------------------ per process
    def _ensure(self) -> None:
        if self._pid == os.getpid():
            return
        with _INIT_LOCK:  # several threads may make the first call at once
            if self._pid == os.getpid():
                return
            # a fork inherits the parent's fs objects and pool threads (threads do not survive a
            # fork, so the pool would hang): rebuild everything in this process
            self._reset()
            opts = (self.storage_options if self.confine is None
                    else guarded_options(self.url, self.storage_options, self.confine))
            fs, root = fsspec.core.url_to_fs(self.url, **opts)
            self._fs, self._root = fs, root.rstrip("/")
            self._local = isinstance(fs, LocalFileSystem)
            if self.confine is not None and self._local:
                self.use_t1 = False  # a T1 hit would skip the descriptor check (module docstring)
            if self.use_t1:
                self.use_t1 = self._t1_dir_ok()
            if self.use_t1:
                self._cfs = fsspec.filesystem("simplecache", fs=fs, cache_storage=self.t1_dir)
            self._pid = os.getpid()

    def _t1_dir_ok(self) -> bool:
        """Create the T1 directory (mode 0700) or check the existing one: this user's, not writable by
        group or others (a symlink to such a directory is fine). Another user's directory -- or one
        others can write -- could serve us their bytes or read our private ones: T1 is then not used
        (a warning, once per process), and every read goes to the source."""
        from datacache.ownership import ensure_private_dir

        try:
            _, why = ensure_private_dir(self.t1_dir, what="T1 cache directory", follow_symlinks=True)
        except OSError as e:
            why = f"T1 cache directory {self.t1_dir}: cannot create it ({e.strerror})"
        if why:
            log.warning("%s; T1 (the raw-bytes disk cache) is off for this process: fix the directory "
                        "or set another t1_dir", why)
            return False
        return True

    def _full(self, relpath: str) -> str:
        return posixpath.join(self._root, relpath.lstrip("/")) if self._root else relpath

    def url_of(self, relpath: str) -> str:
        """Full URL of ``relpath`` (for messages; a ``?query`` of the root is left out)."""
        return posixpath.join(self.url.split("?", 1)[0].rstrip("/"), relpath.lstrip("/"))

    # ------------------------------------------------------------ confinement
    def _refuse(self, why: str = OUTSIDE) -> ConfinementError:
        self._count("refused")
        return ConfinementError(why)

    def _check_url(self, relpath: str) -> None:
        """Confined non-local sources: the file's URL must lie under a prefix (module docstring)."""
        if self.confine is None or self._local:
            return
        if not url_under(self._fs.unstrip_protocol(self._full(relpath)), self.confine):
            raise self._refuse()

    def _read_local(self, full: str, size: int | None) -> bytes:
        """A confined local read: open, check the open descriptor's real path, read from it."""
        assert self.confine is not None
        path = self._fs._strip_protocol(full)
        fd = os.open(path, OPEN_FLAGS)
        try:
            try:
                real = fd_real_path(fd, path)
            except ConfinementError:
                self._count("refused")
                raise
            if not any(kind == "local" and path_under(real, pp) for kind, _, pp in self.confine):
                raise self._refuse()
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile("not a regular file (a FIFO, socket or device); remove it from the "
                                      "dataset")
            limit = size + 1 if size is not None and size >= 0 else -1  # a file grown huge is not slurped
            if type(self._fs) is LocalFileSystem:
                with os.fdopen(fd, "rb", closefd=True) as f:
                    fd = -1
                    return f.read(limit)
            # a local stand-in (slowfile://, a test/bench stand-in) reads through its own opener (its
            # pacing): that opens the name again, so the file it opened must be the one checked (device,
            # inode); a FIFO swapped in between would block that second open (plain local files: no reopen)
            with self._fs.open(full, "rb") as f:
                fst = os.fstat(f.fileno())
                if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                    raise self._refuse("the file changed while it was being opened; refused")
                return f.read(limit)
        finally:
            if fd >= 0:
                os.close(fd)

    def _t1_file(self, full: str) -> str:
        cfs = self._cfs
        return os.path.join(cfs.storage[-1], cfs._mapper(cfs._strip_protocol(full)))  # simplecache layout

    # -------------------------------------------------------------- reading
    def read(self, relpath: str, *, size: int | None = None, identity: str | None = None) -> bytes:
        """Bytes of ``relpath``; ``size``/``identity`` from the manifest (see the module docstring).
        Raises :class:`SourceError` naming the file."""
        self._ensure()
        return self._read(relpath, size, identity, lookup=True)

    def _read(self, relpath: str, size: int | None, identity: str | None, *, lookup: bool) -> bytes:
        for attempt in range(self.retries + 1):
            try:
                return self._read_once(relpath, size, identity, lookup and attempt == 0)
            except Exception as e:
                if attempt < self.retries and is_transient(e):
                    self._count("retries")
                    time.sleep(self.backoff * (2**attempt) * (0.5 + random.random()))
                    continue
                self._count("errors")
                raise SourceError(self.url_of(relpath), e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _fetch(self, full: str, size: int | None) -> bytes:
        data = self._read_local(full, size) if self.confine is not None and self._local else \
            self._fs.cat_file(full)
        self._count("bytes_read", len(data))
        if _wrong_size(data, size):
            raise SizeMismatchError(len(data), size)  # transient; never reaches T1
        return data

    def _read_once(self, relpath: str, size: int | None, identity: str | None, lookup: bool) -> bytes:
        self._check_url(relpath)  # before T1: an entry must not launder a URL outside the prefixes
        full = self._full(relpath)
        if not self.use_t1 or identity is None:
            return self._fetch(full, size)
        fn = self._t1_file(full)
        hit = self._t1_get(fn, size, identity) if lookup else None
        if hit is not None:
            return hit
        data = self._fetch(full, size)
        self._t1_put(fn, data, identity)
        return data

    def _t1_get(self, fn: str, size: int | None, identity: str) -> bytes | None:
        try:
            with os.fdopen(os.open(fn, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                raw = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._count("t1_misses")
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            self._count("t1_misses")  # a symlink is never an entry of ours: refilled over it
            return None
        data = _t1_unwrap(raw, identity, confined=self.confine is not None)
        if data is None or _wrong_size(data, size):
            self._count("t1_misses")  # another version of the file (or damaged): refilled by the caller
            return None
        if self.t1_max_bytes:
            with contextlib.suppress(FileNotFoundError):
                os.utime(fn)  # LRU clock for trimming (relatime would not update atime)
        self._count("t1_hits")
        return data

    def _t1_put(self, fn: str, data: bytes, identity: str) -> None:
        tmp = f"{fn}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)  # what a killed process of the same pid and thread id left
            # 0600 (private remote data), created here (O_EXCL: never through a link or over a file)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_t1_header(identity, _T1_MAGIC if self.confine is None else _T1_CONFINED))
                f.write(data)
            os.replace(tmp, fn)  # atomic publish: readers never see a partial entry
        except OSError:  # a full or read-only T1 disk must not fail the read
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return
        if self.t1_max_bytes:
            with self._lock:
                self._since_trim += len(data)
                due = self._since_trim >= max(self.t1_max_bytes // 20, 1)
                if due:
                    self._since_trim = 0
            if due:
                self.trim_t1()

    def trim_t1(self) -> int:
        """Remove least-recently-used T1 entries until the directory is under 90 % of the cap.
        Trims of the reader threads run one after another, each on a fresh scan (concurrent trims
        would each remove the same oldest entries' worth again and empty the cache)."""
        if not (self.use_t1 and self.t1_max_bytes):
            return 0
        with self._trim_lock:
            return self._trim()

    def _trim(self) -> int:
        assert self.t1_max_bytes is not None
        entries = []
        with os.scandir(self.t1_dir) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False) and ".tmp-" not in e.name:
                        st = e.stat(follow_symlinks=False)
                        entries.append((st.st_atime, st.st_size, e.path))
                except FileNotFoundError:
                    continue
        total = sum(s for _, s, _ in entries)
        if total <= self.t1_max_bytes:
            return 0
        goal = int(self.t1_max_bytes * 0.9)
        removed = 0
        for _, size, path in sorted(entries):
            if total - removed <= goal:
                break
            try:
                os.remove(path)
                removed += size
            except FileNotFoundError:
                continue
        self._count("t1_evicted_bytes", removed)
        return removed

    def read_many(self, relpaths: Sequence[str], *, sizes: Sequence[int] | None = None,
                  identities: Sequence[str] | None = None) -> list[bytes | SourceError]:
        """Read many files concurrently; a failing file yields its SourceError, never raises."""
        self._ensure()
        n = len(relpaths)
        sz: list[int | None] = list(sizes) if sizes is not None else [None] * n
        ids: list[str | None] = list(identities) if identities is not None else [None] * n
        out: list[bytes | SourceError | None] = [None] * n
        todo = list(range(n))
        if self.confine is not None and not self._local:  # URLs outside the prefixes: no T1, no request
            todo = []
            for i, rp in enumerate(relpaths):
                try:
                    self._check_url(rp)
                    todo.append(i)
                except ConfinementError as e:
                    self._count("errors")
                    out[i] = SourceError(self.url_of(rp), e)
        if self.use_t1:
            todo, candidates = [], todo
            for i in candidates:
                rp = relpaths[i]
                ident = ids[i]
                hit = None if ident is None else self._t1_get(self._t1_file(self._full(rp)), sz[i], ident)
                if hit is None:
                    todo.append(i)
                else:
                    out[i] = hit
        if todo and getattr(self._fs, "async_impl", False) and len(todo) > 1:
            todo = self._read_async(relpaths, todo, sz, ids, out)
        if todo:
            if self._pool is None:
                # Thread pool of THIS process: threads do not survive a fork, so _ensure() drops
                # an inherited pool (pid check) and __getstate__ never ships it (spawn).
                self._pool = ThreadPoolExecutor(max_workers=max(1, self.workers),
                                                thread_name_prefix="datacache-source")
            futs = {i: self._pool.submit(self._read_or_error, relpaths[i], sz[i], ids[i]) for i in todo}
            for i, f in futs.items():
                out[i] = f.result()
        return out  # type: ignore[return-value]

    def _read_async(self, relpaths: Sequence[str], todo: list[int], sz: list[int | None],
                    ids: list[str | None], out: list[Any]) -> list[int]:
        """One concurrent async gather; returns the positions to retry through the per-file path."""
        fulls = [self._full(relpaths[i]) for i in todo]
        try:
            got = self._fs.cat(fulls, on_error="return")
        except Exception:  # the gather itself failed: fall back to per-file reads with retries
            got = {}
        retry = []
        for i, full in zip(todo, fulls):
            val = got.get(full, got.get(self._fs._strip_protocol(full)))
            if isinstance(val, (bytes, bytearray)):
                data = bytes(val)
                self._count("bytes_read", len(data))
                if _wrong_size(data, sz[i]):
                    retry.append(i)  # length differs from the listing: transient, retried
                    continue
                if self.use_t1 and ids[i] is not None:
                    self._t1_put(self._t1_file(full), data, ids[i])
                out[i] = data
            elif isinstance(val, BaseException) and not is_transient(val):
                self._count("errors")
                out[i] = SourceError(self.url_of(relpaths[i]), val)  # permanent: no second request
            else:
                retry.append(i)  # transient errors go through read()'s retry loop
        return retry

    def _read_or_error(self, relpath: str, size: int | None, identity: str | None) -> bytes | SourceError:
        try:  # the T1 lookup was already done by read_many: go to the source (with retries)
            return self._read(relpath, size, identity, lookup=False)
        except SourceError as e:
            return e

    # ---------------------------------------------------------------- misc
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        """Counters of this process: t1_hits, t1_misses, bytes_read, retries, errors, t1_evicted_bytes."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._reset()
