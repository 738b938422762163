"""Give freed heap memory back to the operating system after a pass that allocated a lot.

A long-lived daemon decodes and writes millions of samples (and may list a dataset again when it
changed); afterwards CPython and glibc keep much of the freed memory in their heaps, so the daemon's
resident size stays above what it holds (bench/results/NOTES.md#listing-memory).
:func:`release_free_heap` asks glibc to return it.

Hazard: ``malloc_trim`` is a glibc extension reached through ``ctypes``; where it is missing (musl,
macOS) nothing happens. It walks the heap under glibc's lock (milliseconds here), so the daemon calls it
only after a pass that did work, never on an idle pass.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Any

_TRIM: Any = None


def _malloc_trim() -> Any:
    global _TRIM
    if _TRIM is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _TRIM = libc.malloc_trim
            _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc: nothing to call
            _TRIM = False
    return _TRIM


def release_free_heap() -> bool:
    """Collect garbage and return free heap pages to the OS; False where glibc's trim is unavailable."""
    gc.collect()
    trim = _malloc_trim()
    if not trim:
        return False
    trim(0)
    return True
