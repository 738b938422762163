"""Keep a long-lived daemon's resident memory close to what it holds.

A daemon decodes and writes millions of samples (and may list a dataset again when it changed);
afterwards CPython and glibc keep much of the freed memory in their heaps, so the daemon's resident
size stays above what it holds (bench/results/NOTES.md#listing-memory, #daemon-memory).

* :func:`limit_heap_growth` (once, at start, before any thread): at most 2 glibc arenas (by default
  glibc gives each new thread -- every HTTP request is served by one -- an arena of its own, up to 8
  per core, each keeping its free pages) and a fixed 1 MiB mmap threshold (glibc otherwise raises the
  threshold to the size of the largest block freed, so the 10 MB columns and index arrays that a pass
  allocates and frees come from the heap afterwards and fragment it). A variable already set in the
  environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) wins.
* :func:`decode_worker_heap` (first thing in each decode worker, forked from the tuned daemon): the
  workers' threshold goes back up to 32 MiB, the ceiling glibc's own threshold reaches, so a large
  image's decode buffers (9 MB for a 2000x1500 JPEG) are reused from the heap rather than mapped and
  zeroed per image (a third slower, bench/results/NOTES.md#daemon-memory), and the freed top of the
  heap is kept between chunks (:func:`datacache.heap.keep_freed_heap`) rather than faulted in again
  for each. Workers hold nothing long.
* :func:`release_free_heap` (after a pass that did work) asks glibc to return free heap pages.

Hazard: both are glibc extensions reached through ``ctypes``; where glibc is missing (musl, macOS)
nothing happens. The trim walks the heap under glibc's lock (milliseconds here), so the daemon calls it
only after a pass that did work, never on an idle pass. The settings are process-wide and inherited by
the decode pool's forked workers.
"""

from __future__ import annotations

import ctypes
import gc
import os
from typing import Any

from datacache.heap import keep_freed_heap, libc, mallopt
from datacache.options import ConfigError

_TRIM: Any = None
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt parameters (glibc's malloc.h)
ARENA_MAX = 2
MMAP_THRESHOLD = 1 << 20


def _malloc_trim() -> Any:
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = libc().malloc_trim
            _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
        except AttributeError:  # not glibc (or no libc found): nothing to call
            _TRIM = False
    return _TRIM


def limit_heap_growth(env: dict[str, str] | None = None) -> dict[str, int]:
    """Set glibc's arena count and mmap threshold (module docstring); returns what was set (empty where
    glibc's ``mallopt`` is unavailable, without what the environment already sets)."""
    env = os.environ if env is None else env
    fn = mallopt()
    if fn is None:
        return {}
    done: dict[str, int] = {}
    for name, param, value in (("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX),
                               ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD)):
        if name not in env and fn(param, value) == 1:  # mallopt returns 1 on success
            done[name] = value
    return done


def decode_worker_heap(env: dict[str, str] | None = None) -> bool:
    """In a decode worker: a fixed 32 MiB mmap threshold and the freed heap top kept (module docstring,
    :func:`datacache.heap.keep_freed_heap`); returns whether the threshold was set: False where glibc's
    ``mallopt`` is unavailable or ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (it wins; so
    does ``MALLOC_TOP_PAD_``)."""
    # Process-pool boundary: this runs as the pool's initializer, where an exception would kill every
    # worker as it starts (and Pool would fork replacements for ever); the daemon checked the switch
    # at start (cache_daemon.__main__), so a bad value here can only mean "leave glibc as it is".
    try:
        return "MALLOC_MMAP_THRESHOLD_" in keep_freed_heap(env=env)
    except ConfigError:
        return False


def release_free_heap() -> bool:
    """Collect garbage and return free heap pages to the OS; False where glibc's trim is unavailable."""
    gc.collect()
    trim = _malloc_trim()
    if not trim:
        return False
    trim(0)
    return True
