"""The store contract, and the one place where store failures are turned into misses.

Every tier (``memory://``, ``lmdb://``, later Redis) subclasses :class:`BaseStore` and implements
the underscored methods; the public methods wrap them with the failure policy, so no caller
needs a ``try``:

* ``get_many(keys) -> [value | None]`` batched read. A store that cannot be read (cannot be
  opened, I/O error, server down) yields **misses** for the whole call, counts
  ``read_errors`` and logs one warning per store and process. A failure that means the store
  cannot be *reached* (connection refused or reset, timeout, a cluster that is down or whose slot
  map moved: :meth:`BaseStore._is_unavailable`) also counts ``unavailable``. A network store
  whose call fails only for part of the keys (one cluster node down) reports exactly those keys
  as misses through :meth:`BaseStore._partial_failure`.
* ``put_many(items, overwrite=False) -> int`` batched write with ``SET NX`` semantics unless
  ``overwrite``. A write that fails (read-only store or filesystem, permissions, a full disk,
  a map that cannot grow, a server refusing writes) is **skipped**: it returns 0, counts
  ``write_errors`` and logs one warning per store and process. It never raises.
* ``contains(keys) -> [bool]`` (False on a read failure), ``stats()`` (never raises: a failing
  backend reports ``error``), ``health() -> {"ok", "url", "backend", "detail"}`` and ``close()``.

Only ``BaseException``s that are not ``Exception`` (KeyboardInterrupt, SystemExit) pass through.
The sample is then served from the source by the caller (decoded again), so a broken cache
costs speed, never a training job.

Round trips are bounded by bytes, not key counts, inside the store: a store whose reads cross
a network sets ``fetch_bytes`` (e.g. 2 MiB); ``get_many`` then splits the keys into chunks of
about ``fetch_bytes`` of expected reply, using a running mean of the value sizes it has seen
(seeded with :meth:`hint_value_bytes`). Local stores (LMDB, memory) leave it ``None``: one call.

Stores are picklable: only the configuration travels; handles and counters are per process
(``_reset_process_state``), opened lazily where they are used (fork/spawn boundary).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("datacache.stores")

Value = bytes | memoryview
# puts: writes the backend acknowledged; present: SET NX that found the key (not written, not an error)
BASE_COUNTERS = ("hits", "misses", "puts", "present", "read_errors", "write_errors", "unavailable")


@runtime_checkable
class Store(Protocol):
    """What every store offers (see the module docstring); implemented by :class:`BaseStore`."""

    url: str

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]: ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False) -> int: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def stats(self) -> dict[str, Any]: ...

    def health(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ReadOnlyStoreError(PermissionError):
    """A write was attempted on a store opened read-only (counted as a write error, never raised)."""


class BaseStore:
    """Failure policy, counters and byte-capped chunking shared by every store."""

    backend = "base"
    remote = False  # a network store (Redis): TieredStore writes to it through its background queue
    fetch_bytes: int | None = None  # cap of one read round trip (network stores); None: one call

    def __init__(self, url: str, *, readonly: bool = False, fetch_bytes: int | None = None) -> None:
        self.url = url
        self.readonly = bool(readonly)
        if fetch_bytes:
            self.fetch_bytes = int(fetch_bytes)
        self._value_hint = 64 << 10
        self._reset_process_state()

    # ------------------------------------------------------------ per process
    def _reset_process_state(self) -> None:
        """Counters and handles of *this* process (called at creation, after unpickling)."""
        self._counters: dict[str, int] = dict.fromkeys(BASE_COUNTERS, 0)
        # a TieredStore's write-back thread and the reading thread count into the same store
        self._count_lock = threading.Lock()
        self._warned: set[str] = set()
        self._mean_value = 0.0

    def _process_attrs(self) -> tuple[str, ...]:
        """Attributes that must not cross a process boundary (subclasses extend)."""
        return ("_counters", "_warned", "_mean_value", "_count_lock")

    def __getstate__(self) -> dict[str, Any]:
        skip = set(self._process_attrs())
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # ------------------------------------------------------------ servers (typed: callers never sniff)
    sharded = False  # keys spread over several masters by hash slot (Redis Cluster)

    def masters(self) -> list[str]:
        """``host:port`` of the servers that hold this store's keys: every master of a Redis Cluster, the
        one server of ``redis://``; ``[]`` for a store without servers (LMDB, memory)."""
        return []

    def node_client(self, addr: str) -> Any:
        """This process's redis-py client of the server ``addr`` (one of :meth:`masters`, or a cluster's
        ``redis_node``); KeyError for a store that has no such server."""
        raise KeyError(f"{self.url} has no server {addr!r}")

    # ------------------------------------------------------------ the policy
    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def _is_unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the store cannot be reached (network stores specialise)."""
        return isinstance(exc, (ConnectionError, TimeoutError))

    def _partial_failure(self, kind: str, exc: BaseException, n: int) -> None:
        """A failure of ``n`` keys inside an otherwise successful call (same policy, same counters)."""
        self._failed(kind, exc, n)

    def _failed(self, kind: str, exc: BaseException, n: int) -> None:
        """Count a failed read/write of ``n`` keys and warn once per kind (per store and process)."""
        self._count(f"{kind}_errors", n)
        if self._is_unavailable(exc):
            self._count("unavailable", n)
        if kind not in self._warned:
            self._warned.add(kind)
            what = ("cannot be read: these lookups are misses and the samples are decoded from the source"
                    if kind == "read" else
                    "cannot be written: new samples are served from the source but not cached")
            log.warning("%s %s (%s: %s). %s Counted in stats()['%s_errors']; further failures are not "
                        "logged.", self.url, what, type(exc).__name__, exc, self._advice(exc), kind)
        else:
            log.debug("%s: %s of %d keys failed (%s: %s)", self.url, kind, n, type(exc).__name__, exc)

    def _advice(self, exc: BaseException) -> str:
        """What the user can do about ``exc`` (subclasses specialise)."""
        if isinstance(exc, ReadOnlyStoreError):
            return "The store was opened read-only (?readonly=1 or a read-only location)."
        if isinstance(exc, PermissionError):
            return "Fix the permissions or pass a cache location you can write."
        if isinstance(exc, OSError) and exc.errno == 28:
            return "The disk is full: free space or point cache= at a bigger disk."
        return ""

    # ------------------------------------------------------------ public API
    def counters(self) -> dict[str, int]:
        """A copy of this process's counters (cheap: no backend call, unlike :meth:`stats`)."""
        return dict(self._counters)

    def hint_value_bytes(self, nbytes: int) -> None:
        """Expected size of one value (seeds the byte-capped chunking before any value was seen)."""
        self._value_hint = max(1, int(nbytes))

    def _lanes(self) -> int:
        """Round trips one chunk is spread over in parallel (a cluster: its masters); the chunk cap is
        ``fetch_bytes`` per lane."""
        return 1

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        if not self.fetch_bytes or n <= 1:
            return [(0, n)]
        mean = self._mean_value or float(self._value_hint)
        step = max(1, int(self.fetch_bytes * max(1, self._lanes()) // max(mean, 1.0)))
        return [(s, min(n, s + step)) for s in range(0, n, step)]

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        """Values (``None`` = miss) for ``keys``; never raises (a failed read is all misses)."""
        keys = list(keys)
        out: list[Value | None] = []
        for s, e in self._chunks(len(keys)):
            try:
                got = self._get_many(keys[s:e])
            except Exception as exc:
                self._failed("read", exc, e - s)
                got = [None] * (e - s)
            out.extend(got)
        hits = len(out) - out.count(None)
        if self.fetch_bytes and hits:  # running mean of value sizes for the next chunking
            batch_mean = sum(len(v) for v in out if v is not None) / hits
            old = self._mean_value
            self._mean_value = batch_mean if not old else 0.8 * old + 0.2 * batch_mean
        self._count("hits", hits)
        self._count("misses", len(out) - hits)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False) -> int:
        """Write ``items`` (``SET NX`` unless ``overwrite``); returns how many were written, never raises."""
        if not items:
            return 0
        try:
            if self.readonly:
                raise ReadOnlyStoreError(f"{self.url} is read-only")
            n = self._put_many(items, overwrite=overwrite)
        except Exception as exc:
            self._failed("write", exc, len(items))
            return 0
        self._count("puts", n)
        return n

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys exist (False where the store cannot be read)."""
        try:
            return self._contains(list(keys))
        except Exception as exc:
            self._failed("read", exc, len(keys))
            return [False] * len(keys)

    def stats(self) -> dict[str, Any]:
        """Backend figures (entries, bytes, ...) and this process's counters; never raises."""
        out: dict[str, Any] = {"url": self.url, "backend": self.backend}
        try:
            out.update(self._stats())
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out.update(self._counters)
        return out

    def health(self) -> dict[str, Any]:
        """``{"ok": bool, "url", "backend", "detail"}``: can the store be read right now?"""
        try:
            detail = self._health()
            ok = True
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        return {"ok": ok, "url": self.url, "backend": self.backend, "detail": detail}

    def close(self) -> None:
        """Release this process's handles; never raises."""
        try:
            self._close()
        except Exception as exc:  # closing a broken store is not worth a crash
            log.debug("%s: close failed (%s)", self.url, exc)

    # ------------------------------------------------------------ to implement
    def _get_many(self, keys: list[bytes]) -> list[Value | None]:
        raise NotImplementedError

    def _put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool) -> int:
        raise NotImplementedError

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return [v is not None for v in self._get_many(keys)]

    def _stats(self) -> dict[str, Any]:
        return {}

    def _health(self) -> str:
        self._get_many([b"datacache:health"])
        return "readable"

    def _close(self) -> None:
        return None
