"""``memory://``: a process-local dict store (tests, demos, single-process experiments).

Each process has its own contents: pickling a MemoryStore (spawn, DataLoader workers)
gives the child an *empty* store with the same URL. Values are copied to ``bytes`` on put.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class MemoryStore:
    """Dict-backed :class:`~datacache.stores.base.Store`."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._data: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"])  # type: ignore[misc]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            out = [self._data.get(bytes(k)) for k in keys]
        hits = sum(v is not None for v in out)
        self._hits += hits
        self._misses += len(out) - hits
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False) -> int:
        n = 0
        with self._lock:
            for k, v in items:
                k = bytes(k)
                if overwrite or k not in self._data:
                    self._data[k] = bytes(v)
                    n += 1
        return n

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [bytes(k) in self._data for k in keys]

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            nbytes = sum(len(v) for v in self._data.values())
            return {"url": self.url, "backend": "memory", "entries": len(self._data), "bytes": nbytes,
                    "hits": self._hits, "misses": self._misses}

    def close(self) -> None:
        with self._lock:
            self._data.clear()
