"""``memory://``: a process-local dict store (tests, demos, single-process experiments).

Each process has its own contents: pickling a MemoryStore (spawn, DataLoader workers)
gives the child an *empty* store with the same URL. Values are copied to ``bytes`` on put.
``memory://name?fetch_bytes=N`` makes it chunk reads like a network store (for tests).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from datacache.stores.base import BaseStore, Value


class MemoryStore(BaseStore):
    """Dict-backed store (see the module docstring)."""

    backend = "memory"

    def __init__(self, url: str = "memory://", *, readonly: bool = False,
                 fetch_bytes: int | None = None) -> None:
        super().__init__(url, readonly=readonly, fetch_bytes=fetch_bytes)

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._data: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_data", "_lock")

    def _get_many(self, keys: list[bytes]) -> list[Value | None]:
        with self._lock:
            return [self._data.get(bytes(k)) for k in keys]

    def _put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool) -> int:
        n = 0
        with self._lock:
            for k, v in items:
                k = bytes(k)
                if overwrite or k not in self._data:
                    self._data[k] = bytes(v)
                    n += 1
        return n

    def _contains(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [bytes(k) in self._data for k in keys]

    def _stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._data), "bytes": sum(len(v) for v in self._data.values())}

    def _health(self) -> str:
        return "in-process dict"

    def _close(self) -> None:
        with self._lock:
            self._data.clear()
