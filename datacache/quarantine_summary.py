"""A bounded summary of quarantined files: what a long-lived process reports, whatever their number.

A daemon filling ImageNet with 1 % bad files meets 12,800 of them. Listing every one in ``/status``
(or a log line each) makes reports grow with the dataset; :class:`QuarantineSummary` keeps instead

* ``count``: distinct files (deduplicated by a 64-bit hash of the path, 8 bytes each in a sorted
  array -- not a set of Python ints, whose objects, allocated one by one through a long fill, pin
  the heap pages around them -- a file seen again by a later pass is not counted twice);
* ``by_reason``: counts per reason *kind* (:func:`reason_kind`: the reason without its per-file details,
  such as byte counts or quoted paths), at most :data:`MAX_KINDS` kinds (the rest under ``"other"``);
* ``examples``: the first :data:`MAX_EXAMPLES` files seen, with their full reasons.

Nothing in it is sorted per request; its JSON does not grow with the number of files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

MAX_EXAMPLES = 10
MAX_KINDS = 20
MERGE_AT = 4096  # hashes kept in a small set before they are merged into the sorted array
# parenthesised details and quoted names are dropped, except an exception type name such as "(OSError)"
_DETAILS = re.compile(r"\s*\((?![A-Z][A-Za-z0-9_]*\))[^)]*\)|'[^']*'|\"[^\"]*\"")


def reason_kind(reason: str) -> str:
    """``"cannot decode: not a decodable image (1011 bytes); remove the file..."`` -> ``"cannot decode:
    not a decodable image"``: the text before the first ``;``, without parenthesised details or quoted
    names (an exception type name in parentheses stays: ``"... image data (OSError)"``), printable ASCII,
    at most 100 characters."""
    head = "".join(ch if " " <= ch <= "~" else "?" for ch in str(reason).split(";", 1)[0])
    return " ".join(_DETAILS.sub("", head).split())[:100] or "unknown"


class QuarantineSummary:
    """See the module docstring. Not thread-safe: one writer (the pass thread); readers take
    :meth:`as_json`, a snapshot of small dicts."""

    def __init__(self) -> None:
        self._sorted = np.zeros(0, dtype=np.uint64)  # hashes of the files counted, ascending
        self._recent: set[int] = set()  # and those not merged into it yet (< MERGE_AT)
        self.by_reason: dict[str, int] = {}
        self.examples: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def _seen(self, h: int) -> bool:
        if h in self._recent:
            return True
        j = int(np.searchsorted(self._sorted, np.uint64(h)))
        return j < len(self._sorted) and int(self._sorted[j]) == h

    def _merge(self) -> None:
        new = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
        self._sorted = np.union1d(self._sorted, new)  # disjoint: _seen checked both
        self._recent.clear()

    def add(self, files: Mapping[str, str]) -> int:
        """Record ``{relative path: reason}``; returns how many of them were new."""
        new = 0
        for path, reason in files.items():
            h = xxhash.xxh3_64_intdigest(path.encode("utf-8", "surrogateescape"))
            if self._seen(h):
                continue
            self._recent.add(h)
            if len(self._recent) >= MERGE_AT:
                self._merge()
            new += 1
            kind = reason_kind(reason)
            if kind not in self.by_reason and len(self.by_reason) >= MAX_KINDS:
                kind = "other"
            self.by_reason[kind] = self.by_reason.get(kind, 0) + 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples[path] = reason
        return new

    def as_json(self) -> dict[str, Any]:
        return {"count": len(self), "by_reason": dict(self.by_reason), "examples": dict(self.examples)}
