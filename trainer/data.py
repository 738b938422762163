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
* :class:`EpochRest` -- the rest of an epoch resumed on another world size or layout: the samples
  not yet trained that epoch, re-planned over the new ranks from the resumed step on
  (:mod:`trainer.epoch_rest`); the sampler's :meth:`~DistributedBatchSampler.state_dict` carries it.
* :func:`train_loader` / :func:`val_loader` -- ``DataLoader``\\ s over ``CachedImageNet`` whose
  workers only cut crop windows (:mod:`client.crop`); the device finishes the augmentation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class EpochRest:
    """Part ``part`` (1, 2, ...) of epoch ``epoch``: from step ``start_step`` on, ``batch`` samples per
    rank over the samples not yet trained this epoch. ``trained`` holds one flag per position of the
    sampler's ``indices``: trained (on any rank, in any earlier part) before ``start_step``."""

    epoch: int
    part: int
    start_step: int
    batch: int
    trained: np.ndarray

    def remaining(self) -> np.ndarray:
        """Positions (into the sampler's ``indices``) not trained before ``start_step``, ascending."""
        return np.flatnonzero(~self.trained)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "part": self.part, "start_step": self.start_step, "batch": self.batch,
                "n": len(self.trained), "trained": torch.from_numpy(np.packbits(self.trained))}

    @classmethod
    def from_state(cls, state: dict[str, Any], n: int) -> EpochRest:
        """The saved rest of an epoch over ``n`` samples; ConfigError if it does not fit."""
        try:
            epoch, part, start, batch, saved_n = (int(state[k]) for k in ("epoch", "part", "start_step",
                                                                          "batch", "n"))
            packed = np.asarray(state["trained"], dtype=np.uint8)
        except (KeyError, TypeError, ValueError):
            raise ConfigError("damaged epoch-rest record in the sampler state") from None
        if saved_n != n:
            raise ConfigError(f"the sampler state's epoch-rest record is for {saved_n} samples, this run "
                              f"has {n}")
        if packed.shape != ((n + 7) // 8,) or min(epoch, start, batch - 1, part - 1) < 0:
            raise ConfigError("damaged epoch-rest record in the sampler state")
        return cls(epoch, part, start, batch, np.unpackbits(packed, count=n).astype(bool))


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
        self.rest: EpochRest | None = None  # set by a resume on another world size or layout

    def set_epoch(self, epoch: int, batch_size: int, start_step: int = 0, max_steps: int = 0) -> None:
        """Epoch ``epoch`` with per-rank ``batch_size``, starting at step ``start_step``;
        ``max_steps`` > 0 ends the epoch early. For the epoch of :attr:`rest`, ``batch_size`` must be
        its batch and ``start_step`` at least its first step."""
        self.epoch, self.batch_size = int(epoch), int(batch_size)
        self.start_step, self.max_steps = int(start_step), int(max_steps)
        rest = self.current_rest()
        if rest is not None and (self.batch_size != rest.batch or self.start_step < rest.start_step):
            raise ValueError(f"epoch {epoch} was re-planned from step {rest.start_step} with {rest.batch} "
                             f"per rank; asked for batch {batch_size} from step {start_step}")
        if self.steps_in_epoch() == 0:
            raise ConfigError(f"per-rank batch {batch_size} x {self.world_size} ranks is larger than the "
                              f"{len(self.indices)} training samples: lower --batch-size")
        if not 0 <= self.start_step <= self.steps_in_epoch():
            raise ConfigError(f"start step {start_step} is outside epoch {epoch}'s {self.steps_in_epoch()} "
                              "steps (a checkpoint from another batch size or dataset?)")

    def rest_for(self, epoch: int) -> EpochRest | None:
        """:attr:`rest` when it is ``epoch``'s (re-planned) remainder, else None."""
        return self.rest if self.rest is not None and self.rest.epoch == epoch else None

    def current_rest(self) -> EpochRest | None:
        """:meth:`rest_for` the current epoch."""
        return self.rest_for(self.epoch)

    def plan(self) -> list[np.ndarray]:
        """Every rank's sample order for the current epoch (or, when re-planned, for its rest), as
        positions into ``indices``."""
        rest = self.current_rest()
        if rest is None:
            return self._plan_epoch()
        sub = rest.remaining()
        if len(sub) == 0:
            return [np.empty(0, dtype=np.int64) for _ in range(self.world_size)]
        return [sub[p] for p in self._plan_subset(sub, rest.part)]

    def _plan_epoch(self) -> list[np.ndarray]:
        """DistributedSampler's order (shuffle=True): a permutation seeded with ``seed + epoch``, padded
        by wrapping to a multiple of the world size, rank ``r`` taking every ``world``-th from ``r``."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(len(self.indices), generator=g).numpy()
        return self._deal(perm)

    def _plan_subset(self, sub: np.ndarray, part: int) -> list[np.ndarray]:
        """Part ``part`` of a re-planned epoch: the ``len(sub)`` remaining samples (positions into
        ``sub``) shuffled with a generator of its own (seed, epoch, part) and dealt like an epoch."""
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, self.epoch & 0xFFFFFFFF, 3, int(part)])
        return self._deal(rng.permutation(len(sub)))

    def _deal(self, perm: np.ndarray) -> list[np.ndarray]:
        total = math.ceil(len(perm) / self.world_size) * self.world_size
        perm = np.resize(perm, total)  # pads by repeating from the start (fewer than `world` copies)
        return [perm[r:total:self.world_size] for r in range(self.world_size)]

    def rank_order(self) -> np.ndarray:
        """This rank's sample order for the current epoch (or its re-planned rest)."""
        return self.indices[self.plan()[self.rank]]

    def steps_in_epoch(self) -> int:
        """Steps of the whole epoch (before ``start_step``), capped by ``max_steps``; a re-planned
        epoch has the steps before its rest plus the steps of the rest."""
        rest = self.current_rest()
        if rest is None:
            steps = math.ceil(len(self.indices) / self.world_size) // self.batch_size
        else:
            steps = rest.start_step + math.ceil(len(rest.remaining()) / self.world_size) // self.batch_size
        return min(steps, self.max_steps) if self.max_steps > 0 else steps

    def trained_mask(self, steps: int) -> np.ndarray:
        """One flag per position of ``indices``: trained on some rank once the first ``steps`` steps of
        the current epoch ran (every rank runs the same steps). Padding copies count as their sample."""
        rest = self.current_rest()
        first = rest.start_step if rest is not None else 0
        if not first <= steps <= self.steps_in_epoch():
            raise ValueError(f"step {steps} is outside the planned part of epoch {self.epoch} "
                             f"(steps {first} to {self.steps_in_epoch()})")
        mask = rest.trained.copy() if rest is not None else np.zeros(len(self.indices), dtype=bool)
        k = (steps - first) * self.batch_size
        for order in self.plan():
            mask[order[:k]] = True
        return mask

    def state_dict(self) -> dict[str, Any]:
        """What a mid-epoch checkpoint needs beyond ``(seed, epoch, step)``: the re-planned rest of the
        current epoch, if it has one (an ordinary epoch is a function of the seed and the world)."""
        rest = self.current_rest()
        return {"kind": "global", "seed": self.seed, **({"rest": rest.state_dict()} if rest else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved epoch on the same world: restores its re-planned rest, if any."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise ConfigError(f"the checkpoint's sampler used seed {state['seed']}, this run {self.seed}: "
                              "resume with the same --seed")
        saved = state.get("rest")
        self.rest = EpochRest.from_state(saved, len(self.indices)) if saved is not None else None

    def __len__(self) -> int:
        return self.steps_in_epoch() - self.start_step

    def __iter__(self) -> Iterator[BatchRequest]:
        order = self.rank_order()
        b = self.batch_size
        rest = self.current_rest()
        first = rest.start_step if rest is not None else 0
        for step in range(self.start_step, self.steps_in_epoch()):
            chunk = order[(step - first) * b:(step - first + 1) * b]
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
