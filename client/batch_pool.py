"""Shared-memory batch buffers that DataLoader workers reuse once the main process has let go of them.

A worker's batch travels to the main process in shared memory. Allocating a fresh segment per batch
and faulting its pages in costs a quarter of what a worker spends on a batch of 128-px crops
(bench/results/NOTES.md#batch-pool); FFCV avoids it by reusing preallocated buffers, with the contract
that a batch is only valid for a few iterations. Here reuse is **safe without any contract**:

* each worker keeps a small ring of shared buffers (:class:`WorkerRing`) and a shared ``uint8`` flag
  per slot (``FREE`` / ``BUSY``). A batch is built in a ``FREE`` slot, which turns ``BUSY`` *before*
  the batch leaves the worker;
* the batch travels as a :class:`PooledBatch` (a ``tuple``) whose pickling carries the slot's flag
  array and index along; unpickled in the main process (by DataLoader's result queue, or its
  pin-memory thread) it becomes a plain ``tuple`` again and the buffer is registered with a
  :class:`~torch.multiprocessing.reductions.StorageWeakRef` of its storage;
* every arrival polls the registry: a buffer whose storage has **no reference left in the main
  process** -- no tensor, no view, no ``.numpy()`` array of it -- is marked ``FREE``, and only then
  may its worker write into it again. A consumer that keeps batches (or slices of them) keeps them
  intact; the worker then allocates fresh buffers for as long as all its slots are held.

Hazards (process and memory boundaries):

* the flags are written by two processes, but never the same value at the same time: the worker
  writes ``BUSY`` only to a ``FREE`` slot, the main process writes ``FREE`` only to a ``BUSY`` slot
  whose storage it no longer references -- each slot has one writer at a time, and the main process's
  last read of the pixels happened before it dropped its last reference;
* a batch handed on to *another* process (a second ``multiprocessing`` queue) leaves the main
  process's references behind: turn reuse off there (``reuse_buffers=0``);
* a batch that never reaches the main process (a worker shut down with batches in flight) leaves
  its slot ``BUSY``; the ring then allocates, as without reuse -- never a wrong pixel, at worst the
  old speed;
* ``num_workers=0``: nothing crosses a process; batches are plain private tensors, no ring.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

FREE, BUSY = 0, 1
STAT_ALLOCATED, STAT_REUSED = 0, 1
MAX_WORKERS_COUNTED = 256  # rows of the shared allocation counters (worker ids beyond share the last)


def _shared_flat(numel: int) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(max(1, numel))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (max(1, numel),), (1,))


class WorkerRing:
    """A worker process's reusable shared buffers (see the module docstring)."""

    def __init__(self, slots: int) -> None:
        self.slots = int(slots)
        self.flags = torch.zeros(self.slots, dtype=torch.uint8).share_memory_()
        self._flags = self.flags.numpy()  # a view of the shared flags: plain loads and stores
        self.buffers: list[torch.Tensor | None] = [None] * self.slots

    def take(self, numel: int) -> tuple[torch.Tensor, int, bool] | None:
        """``(flat uint8 view of numel bytes, slot, reused)`` from a FREE slot (now BUSY), or None when
        every slot is held by the main process. A free buffer large enough is reused; otherwise the
        free slot with the smallest buffer gets a new one -- exactly ``numel`` the first time, with 25 %
        headroom when it replaces a smaller one (batches of varying size, e.g. packed crop windows)."""
        free = [s for s in range(self.slots) if self._flags[s] == FREE]
        if not free:
            return None
        fits = [s for s in free if self.buffers[s] is not None and self.buffers[s].numel() >= numel]  # type: ignore[union-attr]
        if fits:
            s = min(fits, key=lambda k: self.buffers[k].numel())  # type: ignore[union-attr]
            reused = True
        else:
            s = min(free, key=lambda k: -1 if self.buffers[k] is None else self.buffers[k].numel())  # type: ignore[union-attr]
            grow = self.buffers[s] is not None
            size = -(-(numel + numel // 4) // 65536) * 65536 if grow else numel
            self.buffers[s] = _shared_flat(size)
            reused = False
        self._flags[s] = BUSY  # before the batch is filled and sent: only the main process frees it
        buf = self.buffers[s]
        assert buf is not None
        return buf[:numel], s, reused


_RINGS: dict[tuple[int, int], WorkerRing] = {}  # (pid, slots) -> ring: per worker process (fork boundary)


def ring_for(slots: int) -> WorkerRing:
    key = (os.getpid(), int(slots))
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = WorkerRing(slots)
    return ring


class BatchPool:
    """What a ``collate_fn`` holds to build batches in reused buffers: ``slots`` per worker (0 = off)
    and allocation counters shared by all workers (:meth:`stats`)."""

    def __init__(self, slots: int) -> None:
        if int(slots) < 0:
            raise ValueError(f"reuse_buffers must be >= 0 (0 = a fresh buffer per batch), got {slots}")
        self.slots = int(slots)
        # created in the main process, before workers start: forked workers inherit the mapping, spawned
        # ones receive it as a file descriptor (torch's pickling of shared tensors)
        self.counters = torch.zeros((MAX_WORKERS_COUNTED, 2), dtype=torch.int64).share_memory_()

    def take(self, numel: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None]:
        """A flat ``uint8`` tensor of ``numel`` bytes for one batch, and the ``(flags, slot)`` ticket to
        send with it (None: a one-off buffer, nothing to give back). Inside a DataLoader worker the
        buffer is shared memory; elsewhere it is ordinary memory and never pooled."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return torch.empty(numel, dtype=torch.uint8), None
        row = self.counters[min(info.id, MAX_WORKERS_COUNTED - 1)]
        got = ring_for(self.slots).take(numel) if self.slots else None
        if got is None:
            row[STAT_ALLOCATED] += 1
            return _shared_flat(numel)[:numel], None
        buf, slot, reused = got
        row[STAT_REUSED if reused else STAT_ALLOCATED] += 1
        return buf, (ring_for(self.slots).flags, slot)

    def give_back(self, ticket: tuple[torch.Tensor, int] | None) -> None:
        """Worker side: free a slot whose batch was never sent (the collate failed)."""
        if ticket is not None:
            flags, slot = ticket
            flags[slot] = FREE

    def stats(self) -> dict[str, int]:
        """Batches built in a fresh buffer (``allocated``) and in a reused one (``reused``), all workers."""
        tot = self.counters.sum(dim=0).tolist()
        return {"allocated": int(tot[STAT_ALLOCATED]), "reused": int(tot[STAT_REUSED])}


class PooledBatch(tuple):
    """A collate output built in a pooled buffer: a ``tuple`` that carries its buffer's ticket across
    the process boundary and arrives as a plain ``tuple`` (see the module docstring)."""

    ticket: tuple[torch.Tensor, int] | None

    def __new__(cls, items: tuple[Any, ...], ticket: tuple[torch.Tensor, int] | None) -> Any:
        if torch.utils.data.get_worker_info() is None:
            return tuple(items)  # nothing crosses a process: a plain tuple
        # Even a batch in a one-off buffer (ticket None) travels as a PooledBatch: its arrival polls the
        # registry, which is what frees the slots -- without it, a worker whose slots were all held
        # would build only one-off batches, no arrival would poll, and its slots would never come back.
        self = super().__new__(cls, items)
        self.ticket = ticket
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        flags, slot = self.ticket if self.ticket is not None else (None, -1)
        return (_arrived, (tuple(self), flags, slot))


class _Registry:
    """Main process: buffers received and not yet given back (weak references to their storages)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the pin-memory thread and the main thread may both unpickle
        self.held: list[tuple[Any, np.ndarray, int]] = []

    def add(self, storage: torch.UntypedStorage, flags: torch.Tensor, slot: int) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        with self.lock:
            self.held.append((StorageWeakRef(storage), flags.numpy(), slot))

    def poll(self) -> int:
        """Give back every buffer the main process no longer references; how many were freed."""
        with self.lock:
            keep, freed = [], 0
            for ref, flags, slot in self.held:
                if ref.expired():
                    flags[slot] = FREE  # no tensor of this process refers to the pixels any more
                    freed += 1
                else:
                    keep.append((ref, flags, slot))
            self.held = keep
        return freed


REGISTRY = _Registry()


def arrived(buffer: torch.Tensor, flags: torch.Tensor | None, slot: int) -> None:
    """A batch from a worker was unpickled here (main process): register its pooled ``buffer`` (when
    ``flags`` is given) and give back the buffers no longer referenced. Every batch type that uses a
    :class:`BatchPool` calls this from its unpickling (:class:`PooledBatch`, ``client.crop.CropBatch``)."""
    if flags is not None:
        REGISTRY.add(buffer.untyped_storage(), flags, slot)
    REGISTRY.poll()


def _arrived(items: tuple[Any, ...], flags: torch.Tensor | None, slot: int) -> tuple[Any, ...]:
    """Unpickling a :class:`PooledBatch`: a plain tuple again (its first item is the pooled buffer)."""
    arrived(items[0], flags, slot)
    return items
