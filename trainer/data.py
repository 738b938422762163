"""Datasets, the resumable distributed batch sampler and the loaders of a training run.

* :func:`split_indices` -- a seeded, per-class hold-out of a single ImageFolder (the
  validation split when no separate validation folder is given).
* :class:`DistributedBatchSampler` -- ``DistributedSampler``'s order (a permutation seeded with
  ``seed + epoch``, padded by wrapping to a multiple of the world size, rank ``r`` takes every
  ``world``-th index from ``r``), cut into per-rank batches of the current size (batch-size
  control changes it per epoch; an incomplete last batch is dropped so every rank steps
  alike). It yields :class:`~client.crop.BatchRequest`\\ s that name their ``(epoch, step,
  rank)``, and can start an epoch at any step: a resumed run sees exactly the remaining batches.
  It runs in the main process, so changing the batch size between epochs works with
  persistent loader workers.
* :func:`train_loader` / :func:`val_loader` -- ``DataLoader``\\ s over ``CachedImageNet`` whose
  workers only cut crop windows (:mod:`client.crop`); the device finishes the augmentation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from client.crop import BatchRequest, CenterCropCollate, CropCollate, PadCropCollate, TaggedDataset
from datacache.config import ConfigError


def split_indices(labels: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, val)`` index lists: ``round(val_fraction * n_c)`` samples of every class ``c``
    (at least one when the class has two or more), chosen by a permutation seeded with ``seed``."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train: list[int] = []
    val: list[int] = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        k = round(val_fraction * len(idx))
        if val_fraction > 0 and len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        val += idx[:k].tolist()
        train += idx[k:].tolist()
    return sorted(train), sorted(val)


class DistributedBatchSampler:
    """Per-rank batches of ``indices`` (see the module docstring). Call :meth:`set_epoch` before
    each epoch."""

    def __init__(self, indices: Sequence[int], world_size: int = 1, rank: int = 0, seed: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if len(indices) == 0:
            raise ConfigError("the training split is empty")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.epoch = 0
        self.batch_size = 1
        self.start_step = 0
        self.max_steps = 0

    def set_epoch(self, epoch: int, batch_size: int, start_step: int = 0, max_steps: int = 0) -> None:
        """Epoch ``epoch`` with per-rank ``batch_size``, starting at step ``start_step``;
        ``max_steps`` > 0 ends the epoch early."""
        self.epoch, self.batch_size = int(epoch), int(batch_size)
        self.start_step, self.max_steps = int(start_step), int(max_steps)
        if self.steps_in_epoch() == 0:
            raise ConfigError(f"per-rank batch {batch_size} x {self.world_size} ranks is larger than the "
                              f"{len(self.indices)} training samples: lower --batch-size")
        if not 0 <= self.start_step <= self.steps_in_epoch():
            raise ConfigError(f"start step {start_step} is outside epoch {epoch}'s {self.steps_in_epoch()} "
                              "steps (a checkpoint from another batch size or dataset?)")

    def rank_order(self) -> np.ndarray:
        """This rank's sample order for the current epoch (DistributedSampler's, shuffle=True)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.indices), generator=g).numpy()
        total = math.ceil(len(perm) / self.world_size) * self.world_size
        perm = np.concatenate([perm, perm[: total - len(perm)]]) if total > len(perm) else perm
        return self.indices[perm[self.rank:total:self.world_size]]

    def steps_in_epoch(self) -> int:
        """Steps of the whole epoch (before ``start_step``), capped by ``max_steps``."""
        per_rank = math.ceil(len(self.indices) / self.world_size)
        steps = per_rank // self.batch_size
        return min(steps, self.max_steps) if self.max_steps > 0 else steps

    def __len__(self) -> int:
        return self.steps_in_epoch() - self.start_step

    def __iter__(self) -> Iterator[BatchRequest]:
        order = self.rank_order()
        b = self.batch_size
        for step in range(self.start_step, self.steps_in_epoch()):
            chunk = order[step * b:(step + 1) * b]
            yield BatchRequest(tuple(chunk.tolist()), self.epoch, step, self.rank)


class ShardSampler:
    """Validation: rank ``r`` evaluates ``indices[r::world]`` in batches (the last may be short);
    every sample is evaluated exactly once over all ranks."""

    def __init__(self, indices: Sequence[int], world_size: int, rank: int, batch_size: int) -> None:
        self.indices = [int(i) for i in indices][rank::world_size]
        self.batch_size = int(batch_size)

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self) -> Iterator[BatchRequest]:
        for step, k in enumerate(range(0, len(self.indices), self.batch_size)):
            yield BatchRequest(tuple(self.indices[k:k + self.batch_size]), -1, step)


# Process boundary: how loader workers start. A rank is multithreaded by the time it needs
# workers (gloo's threads, the queue feeder threads of a running loader, tqdm's monitor), and
# fork()ing a multithreaded CPython can leave the child waiting forever for a lock another thread
# held at that instant -- seen here once in ~200 validation loaders forked mid-run (the child
# stuck in PyOS_AfterFork_Child). So workers come from a forkserver: a clean single-threaded
# process started once per rank that imports torch and the loader modules up front, from which
# every worker is forked; the dataset and the collate are pickled to it (CachedImageNet ships
# its manifest and shared-memory counters, never open handles).
WORKER_START = "forkserver"
_PRELOAD = ["torch", "numpy", "client.dataset", "client.crop"]


def worker_context() -> Any:
    """The multiprocessing context of the trainer's loader workers (see ``WORKER_START``)."""
    ctx = torch.multiprocessing.get_context(WORKER_START)
    if WORKER_START == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker_init(_: int) -> None:
    # Worker-process boundary: workers only slice and copy; torch intra-op threads in each
    # worker would just compete with the training process for the cores.
    torch.set_num_threads(1)


def worker_kwargs(workers: int) -> dict[str, Any]:
    """The DataLoader options of the trainer's worker processes (none without workers)."""
    if workers <= 0:
        return {}
    return {"persistent_workers": True, "worker_init_fn": _worker_init,
            "multiprocessing_context": worker_context()}


def train_loader(dataset: Any, sampler: DistributedBatchSampler, *, workers: int, seed: int,
                 crop_scale: float = 0.08, flip: bool = True, pin_memory: bool = False,
                 pad_crop: tuple[int, int] | None = None) -> DataLoader:
    """Persistent-worker loader of :class:`~client.crop.CropBatch`\\ es (crop windows only):
    random-resized-crop windows, or with ``pad_crop=(size, padding)`` torchvision's
    ``RandomCrop(size, padding)`` windows (:class:`~client.crop.PadCropCollate`)."""
    flip_p = 0.5 if flip else 0.0
    collate: CropCollate | PadCropCollate
    if pad_crop is not None:
        collate = PadCropCollate(pad_crop[0], pad_crop[1], seed=seed, flip_p=flip_p)
    else:
        collate = CropCollate(seed=seed, scale=(crop_scale, 1.0), flip_p=flip_p)
    return DataLoader(TaggedDataset(dataset), batch_sampler=sampler, num_workers=workers, collate_fn=collate,
                      pin_memory=pin_memory, prefetch_factor=4 if workers > 0 else None,
                      **worker_kwargs(workers))


def val_loader(dataset: Any, indices: Sequence[int], size: int, *, world_size: int, rank: int,
               batch_size: int, workers: int, crop_fraction: float = 0.875,
               pin_memory: bool = False) -> DataLoader:
    """Persistent-worker loader of centre-crop windows for output ``size`` (one per resolution of
    the schedule: its workers start at the first validation at that size and are reused)."""
    sampler = ShardSampler(indices, world_size, rank, batch_size)
    return DataLoader(TaggedDataset(dataset), batch_sampler=sampler, num_workers=workers,
                      collate_fn=CenterCropCollate(size, crop_fraction), pin_memory=pin_memory,
                      **worker_kwargs(workers))
