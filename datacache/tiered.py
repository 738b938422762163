"""``TieredStore``: several stores read nearest-first behind the one store contract.

``lmdb:///local/cache::redis+cluster://h1:7000,h2:7000`` opens as ``TieredStore([LMDBStore,
RedisClusterStore])`` (:meth:`datacache.cacheurl.CacheSpec.open`):

* ``get_many`` asks tier 0 for every key, tier 1 for what tier 0 missed, and so on. A hit in a
  farther tier is **promoted** to the nearer writable tiers (``SET NX``), so the next read is local.
  Every tier's hits, misses and bytes are counted (``stats()["tiers"]``, and flat in
  :meth:`counters` as ``tier0_hits`` ... for the client's per-tier ratios).
* ``put_many`` writes to every writable tier (``readonly`` tiers are skipped). Local tiers (LMDB,
  memory) are written in the caller's thread; **remote tiers** (``store.remote``: Redis) get the
  items through a bounded background queue, so a slow or dead Redis never stalls a batch. A full
  queue (``queue_bytes``, default 256 MiB, or ``queue_batches``) drops the new items and counts
  ``writeback_dropped``; the samples are simply decoded again on a later miss. Nothing blocks
  forever: :meth:`flush` waits at most its timeout.
* ``contains`` is true where any tier holds the key; ``health()`` reports every tier.

Failure policy: each tier is a :class:`~datacache.stores.base.BaseStore`, so a failing tier yields
misses / skipped writes and counts them itself; the tiered store never raises either.

Per-process state (fork/spawn boundary): the queue, its lock and the writer thread belong to the
process that created them. A forked child (DataLoader worker) starts with an empty queue -- the
parent still owns and writes its own queued items -- and starts its own writer on first use.
Queued items are flushed by :meth:`close`, at interpreter exit, and in ``multiprocessing``
children (DataLoader workers) by a ``multiprocessing.util.Finalize`` hook that runs when the
worker process exits normally (bounded by ``flush_timeout``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing import util as mp_util
from typing import Any

from datacache.stores.base import BASE_COUNTERS, BaseStore, Value

log = logging.getLogger("datacache.tiered")


class TieredStore(BaseStore):
    """Tiers read nearest-first, promote hits, write fills to every writable tier (module docstring)."""

    backend = "tiered"

    def __init__(self, tiers: Sequence[Any], *, queue_bytes: int = 256 << 20, queue_batches: int = 256,
                 flush_timeout: float = 10.0) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.queue_bytes = int(queue_bytes)
        self.queue_batches = int(queue_batches)
        self.flush_timeout = float(flush_timeout)
        self.remote = any(getattr(t, "remote", False) for t in self.tiers)
        super().__init__("::".join(t.url for t in self.tiers))

    # ------------------------------------------------------------ per process
    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._pid = os.getpid()
        self._cond = threading.Condition()
        # (items, overwrite, bit mask of the target tiers, bytes of the items)
        self._queue: deque[tuple[list[tuple[bytes, bytes]], bool, int, int]] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._writer: threading.Thread | None = None
        for i in range(len(getattr(self, "tiers", []))):
            self._counters.update({f"tier{i}_hits": 0, f"tier{i}_misses": 0, f"tier{i}_bytes": 0,
                                   f"tier{i}_promoted": 0})
        # writeback_*: per remote tier write attempted = written (acknowledged) + present (NX found the
        # key) + errors (error replies, failed calls, writer-thread failures); dropped never attempted.
        self._counters.update(writeback_queued=0, writeback_dropped=0, writeback_written=0,
                              writeback_attempted=0, writeback_present=0, writeback_errors=0)

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_pid", "_cond", "_queue", "_queued_bytes", "_busy", "_writer")

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: the parent owns (and writes) what was queued before
            self._reset_process_state()

    # ------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        self._check_pid()
        keys = list(keys)
        out: list[Value | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            got = tier.get_many([keys[i] for i in todo])
            hits = [(i, v) for i, v in zip(todo, got) if v is not None]
            for i, v in hits:
                out[i] = v
            self._count(f"tier{t}_hits", len(hits))
            self._count(f"tier{t}_misses", len(todo) - len(hits))
            self._count(f"tier{t}_bytes", sum(len(v) for _, v in hits))
            if t and hits:
                self._promote(t, [(keys[i], bytes(v)) for i, v in hits])
            todo = [i for i, v in zip(todo, got) if v is None]
        self._count("hits", len(keys) - len(todo))
        self._count("misses", len(todo))
        return out

    def _promote(self, t: int, items: list[tuple[bytes, bytes]]) -> None:
        """Copy hits of tier ``t`` into the nearer writable tiers (NX: never overwrites a newer fill)."""
        self._count(f"tier{t}_promoted", len(items))
        self._write(self.tiers[:t], items, overwrite=False)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = list(keys)
        have = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(have) if not h]
            if not todo:
                break
            for i, h in zip(todo, tier.contains([keys[i] for i in todo])):
                have[i] = h
        return have

    # ------------------------------------------------------------ writes
    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool = False,
                 on_ack: Callable[[int, int, int], None] | None = None) -> int:
        """Write ``items`` to every writable tier; returns what the nearest local tier stored (or, with
        only remote tiers, how many items were queued). Never raises, never blocks on a remote tier.
        ``on_ack(written, present, errors)`` is called from the writer thread once the nearest remote tier
        answered this batch (what the server acknowledged; NX hits; refused or failed writes)."""
        self._check_pid()
        if not items:
            return 0
        return self._write(self.tiers, list(items), overwrite=overwrite, on_ack=on_ack)

    @property
    def remote_only(self) -> bool:
        """True when no writable tier is local: ``put_many`` then returns what was *queued*."""
        return not any(not getattr(t, "remote", False) and not getattr(t, "readonly", False)
                       for t in self.tiers)

    def _write(self, tiers: Sequence[Any], items: list[tuple[bytes, bytes]], *, overwrite: bool,
               on_ack: Callable[[int, int, int], None] | None = None) -> int:
        written: int | None = None
        remote = False
        for tier in tiers:
            if getattr(tier, "readonly", False):
                continue
            if getattr(tier, "remote", False):
                remote = True
                continue
            n = tier.put_many(items, overwrite=overwrite)
            written = n if written is None else written
        if written:
            self._count("puts", written)  # what a local tier stored; remote writes count when acknowledged
        if remote:
            queued = self._enqueue(items, overwrite, tiers, on_ack)
            written = queued if written is None else written
        return written or 0

    def _enqueue(self, items: list[tuple[bytes, bytes]], overwrite: bool, tiers: Sequence[Any],
                 on_ack: Callable[[int, int, int], None] | None = None) -> int:
        nbytes = sum(len(k) + len(v) for k, v in items)
        targets = [i for i, t in enumerate(self.tiers) if t in tiers and getattr(t, "remote", False)
                   and not getattr(t, "readonly", False)]
        with self._cond:
            if self._queued_bytes + nbytes > self.queue_bytes or len(self._queue) >= self.queue_batches:
                self._count("writeback_dropped", len(items))  # never block the batch: decoded again later
                if "dropped" not in self._warned:
                    self._warned.add("dropped")
                    log.warning("%s: write-back queue full (%d batches, %.0f MB): dropping new write-backs "
                                "(counted in writeback_dropped; those samples are decoded again on a later "
                                "miss). The remote tier is slower than the fill rate or unreachable.",
                                self.url, len(self._queue), self._queued_bytes / 1e6)
                return 0
            self._queue.append((items, overwrite, sum(1 << i for i in targets), nbytes, on_ack))
            self._queued_bytes += nbytes
            self._count("writeback_queued", len(items))
            self._cond.notify()
        self._start_writer()
        return len(items)

    def _start_writer(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            return
        self._writer = threading.Thread(target=self._drain, name="datacache-writeback", daemon=True)
        self._writer.start()
        # Process-exit boundary: multiprocessing children (DataLoader workers) leave through os._exit and
        # skip atexit, but run multiprocessing's finalizers (so does the main process, from atexit).
        mp_util.Finalize(None, TieredStore.flush, args=(self,), exitpriority=10)

    def _drain(self) -> None:
        """Writer thread of this process: pops queued batches and writes them to the remote tiers."""
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait(timeout=1.0)
                    if not self._queue and self._pid != os.getpid():
                        return
                items, overwrite, mask, nbytes, on_ack = self._queue[0]
                self._busy = True
            try:
                acked = None
                for i, tier in enumerate(self.tiers):
                    if mask & (1 << i):
                        got = self._write_remote(tier, items, overwrite)
                        acked = got if acked is None else acked  # the nearest remote tier's answer
                if on_ack is not None and acked is not None:
                    try:
                        on_ack(*acked)
                    except Exception as e:  # a caller's counter must never kill the writer thread
                        log.debug("write-back acknowledgement callback failed: %s", e)
            finally:
                with self._cond:
                    self._queue.popleft()
                    self._queued_bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _write_remote(self, tier: Any, items: list[tuple[bytes, bytes]], overwrite: bool
                      ) -> tuple[int, int, int]:
        """One queued batch to one remote tier, counted in the shared counters (writer thread; only this
        thread writes remote tiers, so the tier's present/write_errors deltas are this batch's). Returns
        ``(written, present, errors)``."""
        self._count("writeback_attempted", len(items))
        before = tier.counters()
        try:
            n = tier.put_many(items, overwrite=overwrite)
        except Exception as e:  # put_many never raises by contract; a bug must still be counted, not lost
            self._count("writeback_errors", len(items))
            if "writer" not in self._warned:
                self._warned.add("writer")
                log.warning("%s: write-back to %s failed (%s: %s); counted in writeback.errors", self.url,
                            getattr(tier, "url", tier), type(e).__name__, e)
            return 0, 0, len(items)
        after = tier.counters()
        self._count("writeback_written", n)
        if not any(not getattr(x, "remote", False) and not getattr(x, "readonly", False) for x in self.tiers):
            self._count("puts", n)  # no local tier counts the puts: the acknowledged remote writes do
        present = after.get("present", 0) - before.get("present", 0)
        errors = after.get("write_errors", 0) - before.get("write_errors", 0)
        self._count("writeback_present", present)
        self._count("writeback_errors", errors)
        return n, present, errors

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write-back queue is empty (at most ``timeout``, default ``flush_timeout``);
        True when everything queued was written (or attempted)."""
        if self._pid != os.getpid():
            return True
        deadline = time.monotonic() + (self.flush_timeout if timeout is None else timeout)
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s: %d write-back batches still queued after the flush timeout; they are "
                                "not cached", self.url, len(self._queue))
                    return False
                self._cond.wait(timeout=left)
        return True

    # ------------------------------------------------------------ reporting
    def counters(self) -> dict[str, int]:
        """This process's counters: the tiered ones plus the sum over tiers of the error counters."""
        out = dict(self._counters)
        per_tier = [t.counters() for t in self.tiers]
        for name in BASE_COUNTERS:
            if name.endswith("_errors") or name in ("unavailable", "present"):
                out[name] = sum(c.get(name, 0) for c in per_tier)
        return out

    def stats(self) -> dict[str, Any]:
        c = self.counters()
        tiers = []
        for i, t in enumerate(self.tiers):
            hits, misses = c[f"tier{i}_hits"], c[f"tier{i}_misses"]
            tiers.append({**t.stats(), "hits": hits, "misses": misses, "bytes": c[f"tier{i}_bytes"],
                          "promoted": c[f"tier{i}_promoted"],
                          "hit_ratio": hits / (hits + misses) if hits + misses else None})
        with self._cond:
            queued = len(self._queue)
        return {"url": self.url, "backend": self.backend, "tiers": tiers,
                "writeback": {"queued_batches": queued, "queued": c["writeback_queued"],
                              "attempted": c["writeback_attempted"], "written": c["writeback_written"],
                              "present": c["writeback_present"], "errors": c["writeback_errors"],
                              "dropped": c["writeback_dropped"]},
                **{k: c[k] for k in BASE_COUNTERS}}

    def health(self) -> dict[str, Any]:
        tiers = [t.health() for t in self.tiers]
        return {"ok": all(h["ok"] for h in tiers), "url": self.url, "backend": self.backend,
                "detail": "; ".join(f"{h['url']}: {h['detail']}" for h in tiers), "tiers": tiers}

    def hint_value_bytes(self, nbytes: int) -> None:
        for t in self.tiers:
            t.hint_value_bytes(nbytes)

    def close(self) -> None:
        self.flush()
        for t in self.tiers:
            t.close()
