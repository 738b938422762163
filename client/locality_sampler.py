"""The torch-style face of the locality-aware epoch plan (:mod:`datacache.epoch_plan`): a sampler that
resumes by trained samples, and the owners of a Redis Cluster store's keys."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from datacache.config import ConfigError
from datacache.epoch_plan import EpochPlan, owners_digest, plan_epoch

__all__ = ["EpochPlan", "LocalitySampler", "owners_digest", "owners_from_store", "plan_epoch"]


class LocalitySampler:
    """A torch-style sampler over the plan: ``set_epoch(e)``, then iterate this rank's indices.

    ``owners`` must be the same array on every rank (take it once at the epoch's start on one rank and
    broadcast it, or pass a node list to :func:`owners_from_store` on every rank with the same slot
    map).

    Resuming counts what was TRAINED, not what was fetched: a ``DataLoader`` draws indices ahead of the
    training loop (``num_workers x prefetch_factor`` batches), so the iterator's position says nothing
    about what the model has seen. The training loop reports each finished batch with
    :meth:`mark_trained` (the consumer's side, as torchdata's ``StatefulDataLoader`` counts batches it
    yielded, not ones its workers fetched); ``state_dict()`` records that count with the epoch, seed,
    exchange, ``drop_last``, the rank layout and the owners' digest, and ``load_state_dict`` refuses a
    state that differs in any of them (one line naming what differs). Without ``mark_trained`` calls a
    resume replays the epoch from its start: samples are trained again, never skipped.

        sampler = LocalitySampler(owners, node_of_rank, rank, seed=0)
        loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=4)
        for epoch in ...:
            sampler.set_epoch(epoch)
            for x, y in loader:
                train_step(x, y)
                sampler.mark_trained(len(y))
    """

    def __init__(self, owners: np.ndarray | Sequence[int], node_of_rank: Sequence[int], rank: int, *,
                 seed: int = 0, exchange: float = 0.0, drop_last: bool = False,
                 publisher: Any = None) -> None:
        if not 0 <= rank < len(node_of_rank):
            raise ConfigError(f"locality sampler: rank {rank} is not in [0, {len(node_of_rank)})")
        self.owners = np.asarray(owners, dtype=np.int16)
        self.node_of_rank = [int(n) for n in node_of_rank]
        self.rank, self.seed, self.exchange = int(rank), int(seed), float(exchange)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.start = 0  # where this epoch's iteration starts (the trained count of a resumed state)
        self.trained = 0  # samples of this epoch the consumer reported trained (mark_trained)
        self._plan: EpochPlan | None = None
        # rank 0's client.run_publisher.PlanPublisher (or None): told the epoch, the drawn and trained
        # counts, so the cache daemons fill in this plan's order (datacache.run_plan)
        self.publisher = publisher

    def set_epoch(self, epoch: int, owners: np.ndarray | Sequence[int] | None = None) -> None:
        """Start epoch ``epoch`` (optionally with a new owners snapshot, identical on every rank)."""
        if owners is not None:
            self.owners = np.asarray(owners, dtype=np.int16)
        self.epoch, self.start, self.trained, self._plan = int(epoch), 0, 0, None
        if self.publisher is not None:
            self.publisher.epoch(self.epoch, self.owners)

    def plan(self) -> EpochPlan:
        if self._plan is None:
            self._plan = plan_epoch(self.owners, self.node_of_rank, seed=self.seed, epoch=self.epoch,
                                    exchange=self.exchange, drop_last=self.drop_last)
        return self._plan

    def __len__(self) -> int:
        return len(self.plan().per_rank[self.rank]) - self.start

    def __iter__(self) -> Iterator[int]:
        mine = self.plan().per_rank[self.rank]
        pub = self.publisher
        for i in range(self.start, len(mine)):
            if pub is not None:  # the loader draws in the main process: this counts what it has taken
                pub.progress(drawn=i + 1)
            yield int(mine[i])

    def mark_trained(self, samples: int) -> None:
        """Record that ``samples`` more of this epoch's indices (in iteration order) were trained."""
        total = len(self.plan().per_rank[self.rank])
        if samples < 0 or self.trained + samples > total:
            raise ConfigError(f"locality sampler: mark_trained({samples}) after {self.trained} of this "
                              f"rank's {total} samples this epoch; report each trained batch once")
        self.trained += int(samples)
        if self.publisher is not None:
            self.publisher.progress(trained=self.trained)

    def state_dict(self) -> dict[str, Any]:
        return {"format": 2, "epoch": self.epoch, "trained": self.trained, "seed": self.seed,
                "exchange": self.exchange, "drop_last": self.drop_last,
                "node_of_rank": list(self.node_of_rank), "rank": self.rank,
                "owners_digest": owners_digest(self.owners)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != 2:
            raise ConfigError("locality sampler: the state predates the trained-sample count and the rank "
                              "layout record (it counted fetched samples); resume from an epoch start")
        if state.get("owners_digest") != owners_digest(self.owners):
            raise ConfigError("locality sampler: the checkpoint was planned with another owners snapshot "
                              "(slot map); resume with the owners array saved with it")
        now = {"seed": self.seed, "exchange": self.exchange, "drop_last": self.drop_last,
               "node_of_rank": self.node_of_rank, "rank": self.rank}
        diff = [f"{k} saved {state.get(k)!r}, now {v!r}" for k, v in now.items() if state.get(k) != v]
        if diff:
            raise ConfigError("locality sampler: the checkpoint's epoch cannot continue here: "
                              + "; ".join(diff))
        self.set_epoch(int(state["epoch"]))
        self.start = self.trained = int(state["trained"])
        if self.publisher is not None:  # a resumed run's progress may go backwards: the daemons refill
            self.publisher.progress(trained=self.trained)


def owners_from_store(store: Any, keys: Sequence[bytes], node_masters: Sequence[str]) -> np.ndarray:
    """``owners[i]`` for a Redis Cluster store: the node (index into ``node_masters``, the master
    address on each node) whose master serves ``keys[i]``'s slot; ``-1`` for a master on no listed node,
    and all ``-1`` for a store without shards (LMDB, one Redis server). A tiered store (``ds.store``) is
    asked through its Redis Cluster tier."""
    tiers = getattr(store, "tiers", None)
    if tiers is not None:  # a TieredStore is not itself sharded: its cluster tier holds the slot map
        store = next((t for t in tiers if getattr(t, "sharded", False)), None)
    if store is None or not store.sharded:
        return np.full(len(keys), -1, dtype=np.int16)
    index = {addr: i for i, addr in enumerate(node_masters)}
    return np.fromiter((index.get(a, -1) if a is not None else -1 for a in store.master_of(keys)),
                       dtype=np.int16, count=len(keys))
