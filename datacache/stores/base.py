"""The store protocol shared by every cache tier (memory, LMDB, Redis later).

Semantics every implementation keeps:

* ``get_many(keys)`` -> one value or ``None`` per key, in order. Values may be
  ``bytes`` or a zero-copy ``memoryview`` valid until the next call on the same store from
  the same thread (LMDB); callers that keep a value longer copy it.
* ``put_many(items, overwrite=False)`` writes a batch; with ``overwrite=False`` an existing
  key is kept (``SET NX``), so concurrent writers of the same deterministic sample are
  idempotent; ``overwrite=True`` replaces (used to repair a record that failed its check).
  Returns how many keys were written.
* ``contains(keys)``, ``stats()`` (counters of this process), ``close()``.
* Stores are picklable: handles are (re)opened lazily in the process that uses them
  (fork/spawn safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

Value = bytes | memoryview


@runtime_checkable
class Store(Protocol):
    """Key/value sample store (see the module docstring)."""

    url: str

    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]: ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False) -> int: ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def stats(self) -> dict[str, int | float | str]: ...

    def close(self) -> None: ...
