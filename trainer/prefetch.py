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
    ``stats`` holds the counters of the current/last pass.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, augment: DeviceAugment,
                 size: int) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.augment = augment
        self.size = int(size)
        self.stats = PrefetchStats()
        self.use_streams = self.device.type == "cuda" and torch.cuda.is_available()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _next(self, it: Iterator[Any]) -> Any | None:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return None
        dt = time.perf_counter() - t
        self.stats.wait_s += dt
        self.stats.waits.append(dt)
        self.stats.steps += 1
        self.stats.samples += len(batch) if isinstance(batch, CropBatch) else int(batch[1].shape[0])
        return batch

    def _augment(self, batch: Any) -> tuple[Tensor, Tensor]:
        t = time.perf_counter()
        out = self.augment(to_device(batch, self.device, non_blocking=self.use_streams), self.size)
        self.stats.augment_s += time.perf_counter() - t
        return out

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        self.stats = PrefetchStats()
        it = iter(self.loader)
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
