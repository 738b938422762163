"""``lmdb://``: the embedded, server-less T2 store (memory-mapped file on the node's disk).

Process model (the fork/spawn hazards)
    An LMDB environment must only be used in the process that opened it, and only once
    per process. The store is picklable (only its configuration travels) and opens the
    environment lazily, in the process that first uses it; all stores of one path in a
    process share that handle (a registry keyed by path, pid-checked on every call). After
    a fork, an ``os.register_at_fork`` hook in the child closes the inherited handles —
    py-lmdb's way to let the child open the environment again (it refuses a second open
    while the inherited one is registered). That close only unmaps the child's copy and
    closes the child's descriptors; the parent's fcntl locks and reader slots belong to
    the parent's pid, and the store never keeps a transaction open between calls, so no
    parent transaction is touched. ``lock=True`` with ``max_readers`` (default 1024) slots
    leaves room for many DataLoader workers and threads; stale reader slots of killed
    processes are cleared on open (``reader_check``).

Map size
    ``map_size`` is only an address-space reservation. It starts modest (1 GiB) and doubles
    whenever a write transaction hits ``MDB_MAP_FULL`` (the batch is retried), up to
    ``max_map_size`` (default: what the disk can hold). Another process that then begins a
    transaction gets ``MDB_MAP_RESIZED`` (``lmdb.MapResizedError``); it must call
    ``env.set_mapsize(0)`` to adopt the new size and retry — done here for reads and writes.
    A map that cannot grow any more (disk full / ``max_map_size``) does not crash the
    training loop: ``put_many`` logs once, counts ``full_errors`` and writes nothing more
    (reads keep working; the missing samples are decoded from the source each epoch).

Reads and writes
    ``get_many`` runs one read transaction per call and returns ``bytes`` copies (a
    ``buffers=True`` view would dangle once the transaction ends; at ~10 GB/s the copy is
    not the bottleneck). ``put_many`` writes the whole batch in one write transaction
    (LMDB serialises writers across processes with its own lock) using
    ``txn.put(..., overwrite=False)`` = ``SET NX`` unless ``overwrite=True``. Commits use
    ``sync=True, metasync=False``: integrity is kept on a crash, the last batch may be lost
    (it is a cache). Layout: ``subdir=True`` -> ``<path>/data.mdb`` + ``<path>/lock.mdb``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lmdb

log = logging.getLogger("datacache.stores.lmdb")
_T = TypeVar("_T")


class _SharedEnv:
    """One open environment per (path, process), shared by every LMDBStore of that path.

    LMDB (and py-lmdb) forbid opening the same environment twice in a process, and
    ``set_mapsize`` needs no transaction active in the process, so all stores of a path
    share the handle and one lock.
    """

    def __init__(self, env: Any, readonly: bool) -> None:
        self.env = env
        self.readonly = readonly
        self.lock = threading.RLock()
        self.pid = os.getpid()
        self.refs = 0


_REGISTRY: dict[str, _SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """Fork boundary: the child must not use the parent's environments (nor a lock that a
    parent thread may have held at fork time). Closing the inherited handle is how py-lmdb
    lets the child open the environment again; it only unmaps the child's copy and closes
    the child's descriptors (fcntl locks and reader slots belong to the parent's pid)."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for shared in _REGISTRY.values():
        with contextlib.suppress(lmdb.Error):
            shared.env.close()
    _REGISTRY.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LMDBStore:
    """LMDB-backed :class:`~datacache.stores.base.Store` (see the module docstring)."""

    def __init__(self, path: str, *, map_size: int = 1 << 30, max_map_size: int | None = None,
                 max_readers: int = 1024, subdir: bool = True, readonly: bool = False,
                 sync: bool = True, readahead: bool = False) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.url = "lmdb://" + self.path
        self.map_size = int(map_size)
        self.max_map_size = int(max_map_size) if max_map_size else None
        self.max_readers = int(max_readers)
        self.subdir = bool(subdir)
        self.readonly = bool(readonly)
        self.sync = bool(sync)
        self.readahead = bool(readahead)
        self._reset()

    def _reset(self) -> None:
        self._shared: _SharedEnv | None = None
        self._counters = {"hits": 0, "misses": 0, "puts": 0, "grows": 0, "resized_seen": 0,
                          "full_errors": 0}
        self._full_logged = False

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_shared", "_counters", "_full_logged"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    # ------------------------------------------------------------------- env
    def _acquire(self) -> _SharedEnv:
        """The shared environment of this path in *this* process, opened on first use."""
        shared = self._shared
        if shared is not None and shared.pid == os.getpid():
            return shared
        if shared is not None:  # we were forked: counters restart in the child
            self._reset()
        with _REGISTRY_LOCK:
            shared = _REGISTRY.get(self.path)
            if shared is not None and shared.pid != os.getpid():  # no at-fork hook ran (defensive)
                _REGISTRY.pop(self.path)
                shared = None
            if shared is None:
                if self.subdir and not self.readonly:
                    os.makedirs(self.path, exist_ok=True)
                env = lmdb.open(self.path, map_size=self.map_size, subdir=self.subdir, readonly=self.readonly,
                                lock=True, max_readers=self.max_readers, max_dbs=0, sync=self.sync,
                                metasync=False, readahead=self.readahead, meminit=False,
                                create=not self.readonly)
                with contextlib.suppress(lmdb.Error):
                    env.reader_check()  # free reader slots left by killed processes
                shared = _SharedEnv(env, self.readonly)
                _REGISTRY[self.path] = shared
            elif shared.readonly and not self.readonly:
                raise PermissionError(f"{self.url} is already open readonly in this process")
            shared.refs += 1
        self._shared = shared
        return shared

    def _cap(self, env: Any) -> int:
        if self.max_map_size:
            return self.max_map_size
        free = shutil.disk_usage(self.path if os.path.isdir(self.path) else os.path.dirname(self.path)).free
        return env.info()["map_size"] + free

    # ------------------------------------------------------------------ reads
    def _read(self, fn: Callable[[Any], _T], *, buffers: bool) -> _T:
        """``fn(txn)`` in a read transaction, retried when another process grew the map."""
        shared = self._acquire()
        with shared.lock:
            env = shared.env
            for _ in range(3):
                try:
                    with env.begin(buffers=buffers) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # another process grew the map
                    self._counters["resized_seen"] += 1
                    env.set_mapsize(0)
        raise RuntimeError(f"{self.url}: map resized repeatedly during a read")  # pragma: no cover

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out = self._read(lambda txn: [txn.get(bytes(k)) for k in keys], buffers=False)
        hits = sum(v is not None for v in out)
        self._counters["hits"] += hits
        self._counters["misses"] += len(out) - hits
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        def probe(txn: Any) -> list[bool]:
            cur = txn.cursor()
            return [cur.set_key(bytes(k)) for k in keys]

        return self._read(probe, buffers=True)

    # ----------------------------------------------------------------- writes
    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False) -> int:
        if not items:
            return 0
        if self.readonly:
            raise PermissionError(f"{self.url} was opened readonly")
        shared = self._acquire()
        with shared.lock:
            env = shared.env
            while True:
                try:
                    n = 0
                    with env.begin(write=True) as txn:  # one transaction per batch
                        for k, v in items:
                            if txn.put(bytes(k), v, overwrite=overwrite):
                                n += 1
                    self._counters["puts"] += n
                    return n
                except lmdb.MapResizedError:
                    self._counters["resized_seen"] += 1
                    env.set_mapsize(0)
                except lmdb.MapFullError:  # the txn was aborted by the context manager
                    if not self._grow(env, sum(len(v) + len(k) for k, v in items)):
                        return 0

    def _grow(self, env: Any, batch_bytes: int) -> bool:
        cur = env.info()["map_size"]
        new = max(cur * 2, cur + 4 * batch_bytes)
        cap = self._cap(env)
        if cur >= cap:
            self._counters["full_errors"] += 1
            if not self._full_logged:
                log.error("%s: LMDB map is full at %.1f GiB and cannot grow (limit %.1f GiB: max_map_size or "
                          "free disk); new samples are not cached. Free disk space or raise max_map_size.",
                          self.url, cur / 2**30, cap / 2**30)
                self._full_logged = True
            return False
        new = min(new, cap)
        env.set_mapsize(new)  # safe: no transaction of this process is active (we hold shared.lock)
        self._counters["grows"] += 1
        log.info("%s: LMDB map grown %.2f -> %.2f GiB", self.url, cur / 2**30, new / 2**30)
        return True

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict[str, int | float | str]:
        shared = self._acquire()
        with shared.lock:
            env = shared.env
            st = env.stat()
            info = env.info()
            used = st["psize"] * (st["leaf_pages"] + st["branch_pages"] + st["overflow_pages"])
            return {"url": self.url, "backend": "lmdb", "entries": st["entries"], "bytes": used,
                    "map_size": info["map_size"], "readers": info["num_readers"], **self._counters}

    def close(self) -> None:
        """Release this store's reference; the environment closes with the last one in the process."""
        shared, self._shared = self._shared, None
        if shared is None or shared.pid != os.getpid():
            return
        with _REGISTRY_LOCK:
            shared.refs -= 1
            if shared.refs <= 0 and _REGISTRY.get(self.path) is shared:
                _REGISTRY.pop(self.path)
                with shared.lock:
                    shared.env.close()
