"""Per-worker statistics counters in one small shared-memory tensor.

DataLoader workers are separate processes, so plain Python counters on the dataset would
only ever be seen by the worker that incremented them. :class:`SharedCounters` keeps them
in an ``int64`` tensor of shape ``[1 + MAX_WORKERS, len(names)]`` moved to shared memory
(``share_memory_()``) when the dataset is created:

* row 0 belongs to the main process, row ``worker_id + 1`` to DataLoader worker ``worker_id``.
  Every process adds only to its own row, so increments are never lost (no read-modify-write
  races between processes) and no lock is needed;
* fork: the child inherits the mapping of the same shared-memory segment;
* spawn / forkserver: the dataset is pickled by ``multiprocessing``'s ForkingPickler, for which
  torch registers a reduction that passes the shared storage (file descriptor or file name)
  instead of copying it, so the worker writes into the parent's tensor. (A plain
  ``pickle.dumps`` copies the values instead; that is fine, it just detaches the copy.)

The parent sums the rows to get totals across all workers of all epochs. Processes that
are not DataLoader workers (e.g. a user's own ``multiprocessing`` pool over a forked
dataset) all write row 0, where concurrent increments can be lost: counts are then a
lower bound.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from datacache.cacheurl import MAX_TIERS

MAX_WORKERS = 64  # rows for workers 0..63; more workers share rows modulo 64 (documented race)
# Where each byte went: a Redis Cluster tier opened with ``local=host:port`` counts the hits and bytes
# served by the master on this node (local) and by the others (remote); per tier of the cache URL.
PLACEMENT = ("local_hits", "remote_hits", "local_bytes", "remote_bytes")
PLACEMENT_COUNTERS = tuple(f"tier{i}_{what}" for i in range(MAX_TIERS) for what in PLACEMENT)


def current_row() -> int:
    """Row of the calling process: 0 in the main process, ``worker_id + 1`` in a DataLoader worker."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return 0
    # Beyond MAX_WORKERS workers share rows; then concurrent increments of one row may race.
    return 1 + info.id % MAX_WORKERS


_LOCK: tuple[int, threading.Lock] | None = None


def _row_lock() -> threading.Lock:
    """This process's lock for its counter row. Fork boundary: a child gets a fresh lock (one inherited
    from a parent thread that held it at the fork would stay locked forever)."""
    global _LOCK
    if _LOCK is None or _LOCK[0] != os.getpid():
        _LOCK = (os.getpid(), threading.Lock())
    return _LOCK[1]


class SharedCounters:
    """Named int64 counters, one row per process, in shared memory (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.table = torch.zeros((1 + MAX_WORKERS, len(self.names)), dtype=torch.int64).share_memory_()

    def add(self, deltas: Mapping[str, int]) -> None:
        """Add ``deltas`` (name -> amount) to the calling process's row in one tensor op. Thread-safe within
        a process (the write-back thread adds acknowledgements while the loader adds batches)."""
        vec = np.zeros(len(self.names), dtype=np.int64)
        for name, amount in deltas.items():
            if amount:
                vec[self.index[name]] += int(amount)
        if vec.any():
            with _row_lock():
                self.table[current_row()] += torch.from_numpy(vec)

    def totals(self) -> dict[str, int]:
        """Sum over all rows (main process + every worker)."""
        sums = self.table.sum(dim=0).tolist()
        return {n: int(v) for n, v in zip(self.names, sums)}

    def active_rows(self) -> int:
        """How many processes (rows) have recorded anything."""
        return int((self.table != 0).any(dim=1).sum())

    def reset(self) -> None:
        self.table.zero_()


def format_stats(c: Mapping[str, int], *, quarantined: int, processes: int, store: str,
                 tier_urls: Sequence[str] = ()) -> dict[str, Any]:
    """Turn CachedImageNet's counter totals into the user-facing ``ds.stats()`` dict."""
    from datacache.decode import backend_name

    lookups = c["t2_hits"] + c["t2_misses"]
    t1_total = c["t1_hits"] + c["t1_misses"]
    tiers = []
    for i, url in enumerate(tier_urls):
        if len(tier_urls) == 1:  # one tier: its figures are the cache's
            hits, misses, nbytes = c["t2_hits"], c["t2_misses"], c["t2_bytes"]
        else:
            hits, misses, nbytes = c[f"tier{i}_hits"], c[f"tier{i}_misses"], c[f"tier{i}_bytes"]
        tiers.append({"url": url, "hits": hits, "misses": misses, "bytes": nbytes,
                      "hit_ratio": hits / (hits + misses) if hits + misses else None,
                      **{what: c.get(f"tier{i}_{what}", 0) for what in PLACEMENT}})
    return {
        "samples": c["samples"],
        "hits": c["t2_hits"],
        "misses": c["t2_misses"],
        "hit_ratio": c["t2_hits"] / lookups if lookups else 0.0,
        "decoded": c["decoded"],
        "errors": c["errors"],
        "substituted": c["substituted"],
        "quarantined": quarantined,
        "bytes_read": c["t0_bytes"],
        "tiers": tiers,
        # summed over the tiers; 0 unless a tier knows its local master (redis+cluster://...?local=)
        **{what: sum(t[what] for t in tiers) for what in PLACEMENT},
        "t2": {"hits": c["t2_hits"], "misses": c["t2_misses"], "invalid_rewritten": c["t2_invalid"],
               "known_bad": c["t2_known_bad"], "written": c["t2_written"], "bytes": c["t2_bytes"],
               "read_errors": c["t2_read_errors"], "write_errors": c["t2_write_errors"],
               "unavailable": c["t2_unavailable"], "writeback_dropped": c.get("writeback_dropped", 0),
               # remote-only caches: written = what the server acknowledged, queued = handed to the writer
               "queued": c.get("t2_queued", 0), "writeback_present": c.get("t2_writeback_present", 0),
               "writeback_errors": c.get("t2_writeback_errors", 0)},
        "t1": {"hits": c["t1_hits"], "misses": c["t1_misses"],
               "hit_ratio": c["t1_hits"] / t1_total if t1_total else None},
        "t0": {"bytes_read": c["t0_bytes"], "retries": c["t0_retries"], "errors": c["t0_errors"]},
        "decode_backend": backend_name(),
        "store": store,
        "processes": processes,
    }
