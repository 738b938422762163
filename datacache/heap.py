"""Let a fill keep the memory it frees between batches (glibc's ``M_TOP_PAD``, ``M_MMAP_THRESHOLD``).

A fill allocates and frees tens of megabytes per batch: decoded and resized images and their records
in the decode workers; in the writer, the records and LMDB's copy of each (it mallocs the overflow
pages of a large value per transaction and frees them at commit). glibc hands that memory back to the
kernel after every batch -- blocks over its mmap threshold are mapped and unmapped one by one, and a
freed heap top over 128 KiB is trimmed -- so every batch page-faults the same memory in again, and a
first touch is costly (more so in a virtual machine). :func:`keep_freed_heap` makes blocks up to
:data:`FILL_MMAP_THRESHOLD` come from the heap (the ceiling glibc's own dynamic threshold reaches) and
keeps up to :data:`FILL_TOP_PAD` of freed memory at its top: the next batch reuses it without a fault
(``tests/test_heap.py`` counts the faults; docs/benchmarks.md, "Fill: freed memory kept"). Both are
needed: with the pad alone, a block over the default 128 KiB threshold is still mapped on its own
whenever the heap top is short of room.

Who calls it: only processes that datacache owns and that fill -- ``datacache warm`` (before its
decode pool forks, so the workers inherit it) and the daemon's decode workers
(:func:`cache_daemon.heap.decode_worker_heap`). Never a training process or its DataLoader workers:
their allocator is the user's to tune (``MALLOC_TOP_PAD_`` / ``MALLOC_MMAP_THRESHOLD_`` do the same
from the environment). The daemon's own process keeps its tighter settings
(:func:`cache_daemon.heap.limit_heap_growth`).

Hazards: the settings are process-wide and inherited over fork; they cost up to :data:`FILL_TOP_PAD` of
resident memory per process that has touched that much, held until exit (or a ``malloc_trim``), and a
batch larger than the pad still faults its excess in. They are glibc extensions reached through
``ctypes``: where glibc is missing (musl, macOS) nothing happens. A value set in the environment
(``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``, or the same in ``GLIBC_TUNABLES``) wins;
``DATACACHE_KEEP_FREED_HEAP=0`` leaves glibc as it is (a host short of memory; ``bench.fill_heap``'s
reference).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from datacache.options import ConfigError

M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3  # mallopt parameters (glibc's malloc.h)
FILL_TOP_PAD = 64 << 20  # a fill batch of 128 records at short side 256 and LMDB's copies of them
FILL_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def libc() -> Any:
    """The C library (``ctypes``), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def mallopt() -> Any:
    """glibc's ``mallopt`` (``ctypes``), or None where this libc has none."""
    try:
        fn = libc().mallopt
    except AttributeError:  # not glibc, or no libc found
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def _from_environment(env: dict[str, str] | os._Environ[str], variable: str, tunable: str) -> bool:
    return variable in env or f"glibc.malloc.{tunable}" in env.get("GLIBC_TUNABLES", "")


def keep_switch(env: dict[str, str] | os._Environ[str]) -> bool:
    """``DATACACHE_KEEP_FREED_HEAP`` (default 1); a ``ConfigError`` listing the valid values otherwise.
    Checked where a command starts, before any pool forks (a worker's initializer must not raise)."""
    switch = env.get("DATACACHE_KEEP_FREED_HEAP", "1")
    if switch not in ("0", "1"):
        raise ConfigError(f"DATACACHE_KEEP_FREED_HEAP={switch!r}: valid values are 1 (keep the memory a "
                          "fill frees, the default) and 0 (leave glibc's allocator as it is)")
    return switch == "1"


def keep_freed_heap(nbytes: int = FILL_TOP_PAD, env: dict[str, str] | None = None) -> dict[str, int]:
    """Keep up to ``nbytes`` of freed memory in glibc's heap (module docstring); returns what was set,
    by environment variable name (empty where glibc's ``mallopt`` is unavailable; a setting the
    environment makes is left to it)."""
    if not 0 <= nbytes < 2**31:
        raise ValueError(f"keep_freed_heap: nbytes must be in [0, 2 GiB) (a C int), got {nbytes}")
    env = os.environ if env is None else env
    keep = keep_switch(env)
    fn = mallopt()
    if fn is None or not keep:
        return {}
    done: dict[str, int] = {}
    for name, tunable, param, value in (
            ("MALLOC_MMAP_THRESHOLD_", "mmap_threshold", M_MMAP_THRESHOLD, FILL_MMAP_THRESHOLD),
            ("MALLOC_TOP_PAD_", "top_pad", M_TOP_PAD, nbytes)):
        if not _from_environment(env, name, tunable) and fn(param, value) == 1:  # 1: success
            done[name] = value
    return done
