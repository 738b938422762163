"""``lmdb://``: the embedded, server-less T2 store (memory-mapped file on the node's local disk).

Process model (the fork/spawn hazards)
    An LMDB environment must only be used in the process that opened it, once per process.
    The store is picklable (only its configuration travels) and opens the environment lazily
    in the process that first uses it; all stores of one path in a process share that handle
    (a registry keyed by path, pid-checked on every call).

    **Fork.** A forked child inherits the parent's open environment: its memory maps, its file
    descriptors and, in the lock file's *shared* map, the reader table the parent uses. The
    child must never close (nor let Python free) that inherited handle:

    * closing it aborts the transactions it still tracks -- such as a read transaction a parent
      thread was inside at fork time -- and an abort writes into the parent's reader slot in the
      shared lock file (LMDB marks the slot free), so a writer may reuse pages the parent thread
      is still reading;
    * POSIX ``fcntl`` locks belong to the process and are released when *any* descriptor of the
      file is closed, so closing the inherited descriptor would also drop the lock of the child's
      own environment on the same lock file.

    So the at-fork hook in the child moves inherited handles to a keep-forever list (with an
    extra reference, so not even interpreter shutdown frees them) and the child opens its own
    environment on first use. py-lmdb refuses to open a path that is already open in the process
    (its registry of open environments -- file identities since py-lmdb 3 -- still holds the
    inherited handle's entry); the child removes only that entry (:func:`_forget_inherited_path`)
    before opening. Environments are opened with
    ``max_spare_txns=0`` so no cached read transaction holds a reader slot across a fork (py-lmdb's
    documented advice), and stale slots of killed processes are cleared on open (``reader_check``).
    ``max_readers`` (default 1024) leaves room for many DataLoader workers and threads.

Failures (see :mod:`datacache.stores.base`)
    A directory that cannot be written (read-only filesystem, permissions) is opened read-only;
    a store that cannot be opened at all is all misses. ``?readonly=1`` opens read-only on purpose.
    Writes to a read-only store, a full disk (``ENOSPC``) or a map that cannot grow are skipped
    and counted in ``write_errors`` (one warning); reads keep working.

Map size
    ``map_size`` is only an address-space reservation. It starts modest (1 GiB) and doubles
    whenever a write transaction hits ``MDB_MAP_FULL`` (the batch is retried), up to
    ``max_map_size`` (default: what the disk can hold). Another process that then begins a
    transaction gets ``MDB_MAP_RESIZED``; it adopts the new size (``set_mapsize(0)``) and retries.
    Opening races the same way: py-lmdb begins a transaction inside ``lmdb.open`` (to open the
    main database) after LMDB read the size from the file, so a writer that grows and commits in
    between makes the open itself fail (``MDB_MAP_RESIZED``, or ``EINVAL`` from that first
    ``mdb_txn_begin``); nothing has been written then, and the open is retried (:func:`_open_retrying`).

Reads and writes
    ``get_many`` runs one read transaction per call and returns ``bytes`` copies (a ``buffers=True``
    view would dangle once the transaction ends). ``put_many`` writes the whole batch in one write
    transaction (``SET NX`` unless ``overwrite``). Commits use ``sync=True, metasync=False``:
    integrity is kept on a crash, the last batch may be lost (it is a cache). Layout:
    ``<path>/data.mdb`` + ``<path>/lock.mdb``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import logging
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb

from datacache.stores.base import BaseStore, ReadOnlyStoreError

log = logging.getLogger("datacache.stores.lmdb")
_T = TypeVar("_T")


class _SharedEnv:
    """One open environment per (path, process), shared by every LMDBStore of that path."""

    def __init__(self, env: Any, readonly: bool, why_readonly: str) -> None:
        self.env = env
        self.readonly = readonly
        self.why_readonly = why_readonly  # "" when opened read-write
        self.lock = threading.RLock()  # set_mapsize needs no transaction active in the process
        self.pid = os.getpid()
        self.refs = 0


_REGISTRY: dict[str, _SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()
_INHERITED: list[Any] = []          # environments inherited over fork: never closed, never freed
_INHERITED_PATHS: set[str] = set()  # their real paths, still in py-lmdb's registry of open paths


def _after_fork_in_child() -> None:
    """Fork boundary (see the module docstring): keep inherited handles forever, open our own later."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()  # a parent thread may have held it at fork time
    for path, shared in _REGISTRY.items():
        _INHERITED.append(shared.env)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(shared.env))  # survives even interpreter shutdown
        _INHERITED_PATHS.add(os.path.realpath(path))
    _REGISTRY.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _env_ids(path: str) -> list[Any]:
    """What py-lmdb's "already open in this process" registry holds for the environment at ``path``:
    the (st_dev, st_ino) keys of its files (py-lmdb >= 3, ``lmdb._envid``), or its real path (older)."""
    ids: list[Any] = [os.path.realpath(path)]
    try:
        from lmdb import _envid

        ids.extend(_envid.env_keys(path, True))
    except (ImportError, AttributeError, TypeError):
        pass
    return ids


def _pylmdb_registries() -> list[set]:
    """py-lmdb's registry of environments open in this process (a ``set``: C-static in the CPython
    binding, module-level in the CFFI one). Found exactly: open a probe environment under a unique
    name and look for the set(s) holding its identifiers."""
    with tempfile.TemporaryDirectory(prefix="datacache-probe-") as tmp:
        probe = os.path.join(tmp, uuid.uuid4().hex)
        env = lmdb.open(probe, map_size=1 << 16, max_dbs=0, max_spare_txns=0)
        ids = _env_ids(probe)
        found = [o for o in gc.get_objects() if type(o) is set and any(i in o for i in ids)]
        env.close()
    return found


def _forget_inherited_path(path: str) -> None:
    """Let this (forked) process open ``path`` although an inherited handle of it is kept open."""
    real = os.path.realpath(path)
    if real not in _INHERITED_PATHS:
        return
    ids = _env_ids(path)
    for registry in _pylmdb_registries():
        for i in ids:
            registry.discard(i)
    _INHERITED_PATHS.discard(real)


_RACE_TRIES = 16  # attempts at an open or a read that keeps losing to another process's growth


def _open_race(exc: BaseException) -> bool:
    """Did ``lmdb.open`` fail in its own first transaction because another process grew the map?"""
    return isinstance(exc, lmdb.MapResizedError) or (
        isinstance(exc, lmdb.InvalidParameterError) and str(exc).startswith("mdb_txn_begin"))


def _race_pause(attempt: int) -> None:
    """Back off before retrying a lost race: the writer's commit is over in microseconds, and a
    random phase keeps a retry from meeting the same writer's next growth."""
    time.sleep(min(0.001 * 2 ** attempt, 0.05) * (0.5 + random.random()))


def _open_retrying(open_env: Callable[[], _T], on_retry: Callable[[], None]) -> _T:
    """``open_env()``, retried while it loses the open/grow race (see the module docstring)."""
    for attempt in range(_RACE_TRIES):
        try:
            return open_env()
        except lmdb.Error as exc:
            if not _open_race(exc) or attempt == _RACE_TRIES - 1:
                raise
            on_retry()
            _race_pause(attempt)
    raise AssertionError("unreachable")


def _write_blocked(exc: BaseException) -> bool:
    """Whether opening read-write failed because the location cannot be written."""
    code = getattr(exc, "errno", None)
    text = str(exc)
    return code in (errno.EACCES, errno.EROFS, errno.EPERM) or isinstance(exc, lmdb.ReadonlyError) or any(
        s in text for s in ("Permission denied", "Read-only file system", "Operation not permitted"))


class LMDBStore(BaseStore):
    """LMDB-backed store (see the module docstring)."""

    backend = "lmdb"

    def __init__(self, path: str, *, map_size: int = 1 << 30, max_map_size: int | None = None,
                 max_readers: int = 1024, readonly: bool = False, sync: bool = True,
                 readahead: bool = False) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.map_size = int(map_size)
        self.max_map_size = int(max_map_size) if max_map_size else None
        self.max_readers = int(max_readers)
        self.sync = bool(sync)
        self.readahead = bool(readahead)
        super().__init__("lmdb://" + self.path, readonly=readonly)

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._shared: _SharedEnv | None = None
        self._counters.update(grows=0, resized_seen=0, open_retries=0)

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_shared")

    # ------------------------------------------------------------------- env
    def _open(self, readonly: bool, lock: bool = True) -> Any:
        return _open_retrying(lambda: lmdb.open(
            self.path, map_size=self.map_size, subdir=True, readonly=readonly, lock=lock,
            max_readers=self.max_readers, max_dbs=0, sync=self.sync, metasync=False,
            readahead=self.readahead, meminit=False, create=not readonly, max_spare_txns=0),
            on_retry=lambda: self._count("open_retries"))

    def _open_shared(self) -> _SharedEnv:
        _forget_inherited_path(self.path)
        why = ""
        if self.readonly:
            env = self._open(readonly=True)
        else:
            try:
                os.makedirs(self.path, exist_ok=True)
                env = self._open(readonly=False)
            except (lmdb.Error, OSError) as e:
                if not _write_blocked(e):
                    raise
                why = f"{type(e).__name__}: {e}"
                try:  # an existing cache on a location we cannot write: serve what it holds
                    env = self._open(readonly=True)
                except (lmdb.Error, OSError) as e2:
                    if "Read-only file system" not in str(e2) and getattr(e2, "errno", None) != errno.EROFS:
                        raise
                    # read-only filesystem: the lock file cannot be written, and nothing can write the
                    # data file either, so reading without the reader table is safe
                    env = self._open(readonly=True, lock=False)
                log.warning("%s: cannot open for writing (%s); opened read-only, new samples are not cached",
                            self.url, why)
        if not (self.readonly or why):
            with contextlib.suppress(lmdb.Error):
                env.reader_check()  # free reader slots left by killed processes
        return _SharedEnv(env, self.readonly or bool(why), why)

    def _acquire(self) -> _SharedEnv:
        """The shared environment of this path in *this* process, opened on first use."""
        shared = self._shared
        if shared is not None and shared.pid == os.getpid():
            return shared
        if shared is not None:  # we were forked: counters restart in the child
            self._reset_process_state()
        with _REGISTRY_LOCK:
            shared = _REGISTRY.get(self.path)
            if shared is None:
                shared = _REGISTRY[self.path] = self._open_shared()
            shared.refs += 1
        self._shared = shared
        return shared

    def _cap(self, env: Any) -> int:
        if self.max_map_size:
            return self.max_map_size
        return env.info()["map_size"] + shutil.disk_usage(self.path).free

    # ------------------------------------------------------------------ reads
    def _read(self, fn: Callable[[Any], _T], *, buffers: bool) -> _T:
        """``fn(txn)`` in a read transaction, retried when another process grew the map."""
        shared = self._acquire()
        with shared.lock:
            env = shared.env
            for attempt in range(_RACE_TRIES):
                try:
                    with env.begin(buffers=buffers) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # another process grew the map
                    self._count("resized_seen")
                    env.set_mapsize(0)
                if attempt:  # it grew again between our adopting its size and our next begin
                    _race_pause(attempt)
        raise lmdb.MapResizedError(f"{self.url}: map resized repeatedly during a read")

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self._read(lambda txn: [txn.get(bytes(k)) for k in keys], buffers=False)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        def probe(txn: Any) -> list[bool]:
            cur = txn.cursor()
            return [cur.set_key(bytes(k)) for k in keys]

        return self._read(probe, buffers=True)

    # ----------------------------------------------------------------- writes
    def _put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool) -> int:
        shared = self._acquire()
        if shared.readonly:
            raise ReadOnlyStoreError(f"{self.url} is open read-only ({shared.why_readonly or '?readonly=1'})")
        with shared.lock:
            env = shared.env
            while True:
                try:
                    n = 0
                    with env.begin(write=True) as txn:  # one transaction per batch
                        for k, v in items:
                            if txn.put(bytes(k), v, overwrite=overwrite):
                                n += 1
                    return n
                except lmdb.MapResizedError:
                    self._count("resized_seen")
                    env.set_mapsize(0)
                except lmdb.MapFullError:  # the txn was aborted by the context manager
                    self._grow(env, sum(len(v) + len(k) for k, v in items))

    def _grow(self, env: Any, batch_bytes: int) -> None:
        cur = env.info()["map_size"]
        cap = self._cap(env)
        if cur >= cap:
            raise lmdb.MapFullError(f"LMDB map is full at {cur / 2**30:.2f} GiB and cannot grow (limit "
                                    f"{cap / 2**30:.2f} GiB: max_map_size or free disk)")
        new = min(max(cur * 2, cur + 4 * batch_bytes), cap)
        env.set_mapsize(new)  # safe: no transaction of this process is active (we hold shared.lock)
        self._count("grows")
        log.info("%s: LMDB map grown %.2f -> %.2f GiB", self.url, cur / 2**30, new / 2**30)

    def _advice(self, exc: BaseException) -> str:
        if isinstance(exc, lmdb.MapFullError):
            return "Free disk space or raise ?max_map_size=."
        if "No space left" in str(exc):
            return "The disk is full: free space or point cache= at a bigger local disk."
        return super()._advice(exc)

    # ------------------------------------------------------------------ misc
    def _stats(self) -> dict[str, Any]:
        shared = self._acquire()
        with shared.lock:
            st = shared.env.stat()
            info = shared.env.info()
        used = st["psize"] * (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"])
        return {"entries": st["entries"], "bytes": used, "map_size": info["map_size"],
                "readers": info["num_readers"], "readonly": shared.readonly}

    def _health(self) -> str:
        self._read(lambda txn: txn.get(b"datacache:health"), buffers=False)
        return "read-only" if self._acquire().readonly else "read-write"

    def _close(self) -> None:
        """Release this store's reference; the environment closes with the last one in the process
        that opened it (never in a forked child: see the module docstring)."""
        shared, self._shared = self._shared, None
        if shared is None or shared.pid != os.getpid():
            return
        with _REGISTRY_LOCK:
            shared.refs -= 1
            if shared.refs <= 0 and _REGISTRY.get(self.path) is shared:
                _REGISTRY.pop(self.path)
                with shared.lock:
                    shared.env.close()
