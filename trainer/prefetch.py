"""Prefetcher: overlap the next batch's host-to-device copy and augmentation with this step's compute.

The apex ``data_prefetcher`` pattern (see ../shared/seeds/pytorch-ddp-aws-prefetcher-blog.txt):
the loader hands over uint8 batches in pinned memory (``DataLoader(pin_memory=True)`` pins a
:class:`~client.crop.CropBatch` in its pin thread), and while the model computes step ``t`` on
the default stream, batch ``t + 1`` is copied host -> device with ``non_blocking=True`` and
resized / flipped / normalised (:class:`~trainer.device_augment.DeviceAugment`) on a side CUDA
stream. uint8 crosses the bus (4x fewer bytes than float) and the float conversion runs on the
device. Stream edges (each is a hazard, commented where it is handled):

1. before the training step uses batch ``t``, the compute stream ``wait_stream``\\ s the side
   stream (an event wait on the device: no host sync), so it never reads a half-written input;
2. the input tensors were allocated on the side stream and are used on the compute stream:
   ``record_stream`` tells the caching allocator, so their memory is not handed back to the side
   stream (for batch ``t + 2``) while step ``t`` may still read it;
3. the pinned host buffer of an in-flight copy must not be reused before the copy ends: torch's
   caching host allocator records an event for every ``non_blocking`` copy out of pinned
   memory and only recycles the block after it, so dropping our reference is safe.

Without CUDA (CPU tensors) it is synchronous: fetch, augment, return. Either way it measures
the time the training loop waits for the loader (``wait_s``, per step in ``waits``): the
data-wait part of step time. On the CPU ``augment_s`` is the (synchronous) device-augment time;
on CUDA it is only the time to enqueue it.

Where batch ``t + 1`` is staged (``staging``):

* ``inline`` (default): on the training thread, just before batch ``t`` is handed over. The step's
  one host sync drains the GPU's queue, so the GPU idles while the next batch is taken from the
  loader and its copy and augmentation are enqueued (docs/benchmarks.md, "The prefetcher on the H100").
* ``thread``: on a :class:`~trainer.staging.StagingThread`, one batch ahead. On CUDA the staged batch
  carries an event recorded on the side stream after its augmentation, and the compute stream waits
  for that event (edge 1 as an event wait instead of ``wait_stream``: the side stream may already hold
  the next batch's work). ``waits`` is then the time the training thread blocked for a staged batch.
  On the CPU the augmentation runs on that thread, beside the step. Same batches, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from client.crop import CropBatch
from trainer.device_augment import DeviceAugment
from trainer.staging import STAGING_CHOICES, StagingThread


@dataclass
class PrefetchStats:
    """Counters of one pass over the loader."""

    steps: int = 0
    samples: int = 0
    wait_s: float = 0.0     # blocked on the loader (data wait)
    augment_s: float = 0.0  # device augmentation (enqueue time on CUDA)
    waits: list[float] = field(default_factory=list)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """A :class:`CropBatch` or a ``(images, labels)`` pair moved to ``device``."""
    if isinstance(batch, CropBatch):
        return batch.to(device, non_blocking=non_blocking)
    images, labels = batch
    return images.to(device, non_blocking=non_blocking), labels.to(device, non_blocking=non_blocking)


class Prefetcher:
    """Iterate ``loader`` and yield ``(x, y)`` ready on ``device`` (see the module docstring).

    ``size`` is the output resolution of this pass (the resolution schedule's current value).
    ``staging``: ``inline`` or ``thread`` (module docstring). ``stats`` holds the counters of the
    current/last pass.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, augment: DeviceAugment,
                 size: int, staging: str = "inline") -> None:
        if staging not in STAGING_CHOICES:
            raise ValueError(f"prefetch staging {staging!r}; choose one of {', '.join(STAGING_CHOICES)}")
        self.loader = loader
        self.device = torch.device(device)
        self.augment = augment
        self.size = int(size)
        self.staging = staging
        self.stats = PrefetchStats()
        self.use_streams = self.device.type == "cuda" and torch.cuda.is_available()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _count(self, waited: float, samples: int) -> None:
        self.stats.wait_s += waited
        self.stats.waits.append(waited)
        self.stats.steps += 1
        self.stats.samples += samples

    def _next(self, it: Iterator[Any]) -> Any | None:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return None
        self._count(time.perf_counter() - t, _samples(batch))
        return batch

    def _augment(self, batch: Any) -> tuple[Tensor, Tensor]:
        t = time.perf_counter()
        out = self.augment(to_device(batch, self.device, non_blocking=self.use_streams), self.size)
        self.stats.augment_s += time.perf_counter() - t
        return out

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        self.stats = PrefetchStats()
        # A DataLoader forks its workers here: on the training thread, while no staging thread exists.
        it = iter(self.loader)
        if self.staging == "thread":
            yield from self._iter_staged(it)
            return
        if not self.use_streams:
            while (batch := self._next(it)) is not None:
                yield self._augment(batch)
            return
        yield from self._iter_cuda(it)

    def _preload(self, it: Iterator[Any], stream: torch.cuda.Stream) -> tuple[Tensor, Tensor] | None:
        batch = self._next(it)  # host side: waits for a loader worker (the measured data wait)
        if batch is None:
            return None
        with torch.cuda.stream(stream):
            # Copy + augment are enqueued on the side stream; from pinned memory the copy is
            # asynchronous (hazard 3 above: the host allocator keeps the pinned block alive).
            return self._augment(batch)

    def _iter_cuda(self, it: Iterator[Any]) -> Iterator[tuple[Tensor, Tensor]]:  # pragma: no cover - GPU
        stream = torch.cuda.Stream(device=self.device)
        nxt = self._preload(it, stream)
        while nxt is not None:
            compute = torch.cuda.current_stream(self.device)
            # Hazard 1: the step must not read x before the side stream finished writing it.
            compute.wait_stream(stream)
            x, y = nxt
            # Hazard 2: x, y were allocated on the side stream; they are used on `compute` now.
            x.record_stream(compute)
            y.record_stream(compute)
            # Enqueue batch t+1's copy and augmentation before handing batch t to the step, so
            # the side stream works while the compute stream runs the step.
            nxt = self._preload(it, stream)
            yield x, y

    def _stage(self, batch: Any, stream: torch.cuda.Stream | None) -> tuple[Tensor, Tensor, Any, int]:
        """On the staging thread: copy + augment one batch; on CUDA enqueued on the side stream, with an
        event recorded after it (the compute stream waits for that event, not for the whole stream)."""
        if stream is None:
            return (*self._augment(batch), None, _samples(batch))
        with torch.cuda.stream(stream):  # pragma: no cover - GPU
            # Hazard 3 (the pinned host block of the copy) as on the inline path: the host allocator
            # keeps it until the copy ends.
            x, y = self._augment(batch)
            done = torch.cuda.Event()
            done.record(stream)
            return x, y, done, _samples(batch)

    def _iter_staged(self, it: Iterator[Any]) -> Iterator[tuple[Tensor, Tensor]]:
        stream = torch.cuda.Stream(device=self.device) if self.use_streams else None
        # THREAD BOUNDARY: `it` is used on the staging thread only from here on; the thread's current
        # CUDA device is its own (per thread), set to ours before it stages anything.
        setup = (lambda: torch.cuda.set_device(self.device)) if self.use_streams else None
        staged = StagingThread(it, lambda batch: self._stage(batch, stream), setup=setup)
        try:
            for x, y, done, samples in staged:
                self._count(staged.waits[-1], samples)
                if done is not None:  # pragma: no cover - GPU
                    compute = torch.cuda.current_stream(self.device)
                    # Hazard 1: the step must not read x before the side stream finished writing it;
                    # an event wait on the device (no host sync), for this batch's work only.
                    compute.wait_event(done)
                    # Hazard 2: x, y were allocated on the side stream by the staging thread and are
                    # used on `compute` now (the allocator is thread-safe; the record keeps their
                    # blocks from the side stream until the compute stream is done with them).
                    x.record_stream(compute)
                    y.record_stream(compute)
                yield x, y
        finally:
            staged.close()  # a consumer that stops early: the thread joined, the loader's iterator freed


def _samples(batch: Any) -> int:
    return len(batch) if isinstance(batch, CropBatch) else int(batch[1].shape[0])
