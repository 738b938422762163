"""Compact columns for million-entry listings: packed strings and read-only sequence views.

A Python list of 1.28M path strings costs ~150 MB resident and pickles (into every spawn
DataLoader worker) as 1.28M objects. :class:`PackedStrings` keeps them as FFCV does: one
``uint8`` blob of UTF-8 bytes and an ``int64`` offsets array (``n + 1`` entries), ~40 bytes per
path in total, pickled as two buffers. :class:`PackedStrings` and :class:`ArrayView` are
read-only :class:`~collections.abc.Sequence` views, so ``paths[i]``, ``len``, iteration, slicing
and ``==`` against a list work as with lists, at the cost of building each item on access.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


def _seq_equal(a: Sequence[Any], b: Any) -> bool:
    if not isinstance(b, Sequence) or isinstance(b, (str, bytes)):
        return NotImplemented  # type: ignore[return-value]
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


class PackedStrings(Sequence[str]):
    """Strings packed into one UTF-8 blob with offsets (see the module docstring)."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self.blob = np.ascontiguousarray(blob, dtype=np.uint8)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or int(self.offsets[-1]) != len(self.blob):
            raise ValueError("PackedStrings: offsets must have n + 1 entries ending at len(blob)")

    @classmethod
    def pack(cls, strings: Sequence[str]) -> PackedStrings:
        encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        if encoded:
            np.cumsum(np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded)),
                      out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(blob, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _one(self, i: int) -> str:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.blob[a:b].tobytes().decode("utf-8", "surrogateescape")

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._one(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"index {i} out of range for {n} strings")
        return self._one(k)

    def __iter__(self) -> Iterator[str]:
        blob = self.blob.tobytes()  # one copy, then slicing bytes is cheap
        offs = self.offsets.tolist()
        for a, b in itertools.pairwise(offs):
            yield blob[a:b].decode("utf-8", "surrogateescape")

    def __eq__(self, other: object) -> bool:
        return _seq_equal(self, other)

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"PackedStrings([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes + self.offsets.nbytes)


class ArrayView(Sequence[Any]):
    """A read-only sequence view of a 1-D numpy array yielding Python scalars (``int``/``float``)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.array[i].tolist()
        return self.array[i].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        return _seq_equal(self, other)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.array if dtype is None else self.array.astype(dtype)

    def __repr__(self) -> str:
        return f"ArrayView({self.array!r})"


class PairsView(Sequence[tuple[str, int]]):
    """``(prefix + path, label)`` pairs built on access: torchvision's ``ImageFolder.samples`` shape."""

    def __init__(self, prefix: str, paths: PackedStrings, labels: np.ndarray) -> None:
        self.prefix = prefix
        self.paths = paths
        self.labels = labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.prefix + self.paths[i], int(self.labels[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return ((self.prefix + p, t) for p, t in zip(self.paths, self.labels.tolist()))

    def __eq__(self, other: object) -> bool:
        return _seq_equal(self, other)
