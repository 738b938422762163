"""A locality-aware, exactly-once epoch plan for a cache sharded across nodes (core: no torch).

The trainers' samplers (:mod:`client.locality_sampler`, :mod:`trainer.locality`) and the daemons' rolling
fill (:mod:`cache_daemon.rolling`) compute the same plan from the same inputs, so a daemon knows the order in
which its node's samples will be read.

With uniform sampling over a cache sharded across ``M`` nodes, ``(M-1)/M`` of the sample bytes cross
the link between nodes. This module plans each epoch so that a node's ranks read mostly the samples
that its own shard (the Redis master on that node) holds, while every epoch still covers the dataset
exactly once across all ranks and every rank gets the same number of samples.

Inputs (identical on every rank): ``owners[i]`` -- the node whose shard holds sample ``i`` (``-1``: no
node's shard, e.g. a master on no training node, or an unsharded store), ``node_of_rank`` -- the node of
each rank, ``seed``, ``epoch`` and the exchange fraction ``exchange`` (Q). The plan for one epoch:

1. each node's own samples are shuffled (a generator seeded with ``(seed, epoch)``);
2. **exchange** (partial local shuffling, Nguyen et al., IPDPS'22): a fraction Q of every node's samples
   is pooled, the pool is shuffled and dealt back, each node receiving as many as it gave -- so no node
   trains on a fixed subset of the data across epochs;
3. **balance**: a node needs ``ranks_on_node * per_rank`` samples; unowned samples first fill nodes that
   have too few, then each node's surplus (chosen at random) moves to the nodes short of samples. The
   samples that cross nodes here are exactly the surplus, the smallest set that equalises the counts;
4. with ``drop_last`` the ``len % world`` samples left over are dropped (a different random set each
   epoch); otherwise each short node repeats a few of its own samples (as ``DistributedSampler`` pads);
5. each node's list is shuffled again and dealt to its ranks in equal contiguous parts; a rank dealt
   two copies of one sample swaps one of them with another rank (of the same node when one fits), so a
   padded copy never lands on the rank that holds its original, as with ``DistributedSampler``.

The plan depends only on the inputs above, so it is deterministic, identical on every rank, and a
resumed run recomputes it exactly (see :class:`LocalitySampler`'s ``state_dict``). With one node, or
no owners at all, it is an ordinary seeded exactly-once shuffle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from datacache.config import ConfigError


@dataclass(frozen=True)
class EpochPlan:
    """The per-rank sample order of one epoch and where each sample is read from."""

    per_rank: list[np.ndarray]  # rank -> indices, each of the same length
    crossing: int  # samples read by a node whose shard does not hold them (owners >= 0 only)
    local: int  # samples read by the node whose shard holds them

    @property
    def local_fraction(self) -> float:
        owned = self.local + self.crossing
        return self.local / owned if owned else 1.0


def owners_digest(owners: np.ndarray) -> str:
    """A short digest of an owners array (checkpoints store it to detect a different snapshot)."""
    a = np.ascontiguousarray(owners, dtype=np.int16)
    return hashlib.blake2b(a.tobytes(), digest_size=8).hexdigest()


def _rng(seed: int, epoch: int, salt: int, part: int = 0) -> np.random.Generator:
    key = [int(seed) & 0xFFFFFFFF, int(epoch) & 0xFFFFFFFF, salt]
    return np.random.default_rng([*key, int(part)] if part else key)  # part 0: the original epoch streams


def plan_epoch(owners: np.ndarray | Sequence[int], node_of_rank: Sequence[int], *, seed: int, epoch: int,
               exchange: float = 0.0, drop_last: bool = False, part: int = 0) -> EpochPlan:
    """One epoch's plan (see the module docstring). ``part`` > 0: the plan of the rest of an epoch
    re-planned on another layout (``owners`` then lists the remaining samples only), drawn from
    random streams of its own."""
    owners = np.asarray(owners, dtype=np.int64)
    node_of_rank = np.asarray(node_of_rank, dtype=np.int64)
    n, world = len(owners), len(node_of_rank)
    if world == 0 or n == 0:
        raise ConfigError(f"locality sampler: needs at least one rank and one sample (ranks {world}, "
                          f"samples {n})")
    if not 0.0 <= float(exchange) <= 1.0:
        raise ConfigError(f"locality sampler: exchange must be a fraction in [0, 1], got {exchange!r}")
    if node_of_rank.min() < 0:
        raise ConfigError("locality sampler: node_of_rank must hold node numbers >= 0")
    nodes = int(node_of_rank.max()) + 1
    if (owners >= nodes).any():  # a shard on a node without ranks: nobody is local to it
        owners = np.where(owners >= nodes, -1, owners)
    ranks_on = np.bincount(node_of_rank, minlength=nodes)
    per_rank = n // world if drop_last else -(-n // world)
    if per_rank == 0:
        raise ConfigError(f"locality sampler: {n} samples cannot give each of {world} ranks one sample "
                          "with drop_last=True")
    need = ranks_on * per_rank

    rng = _rng(seed, epoch, 1, part)
    # 1. each node's own samples, shuffled; unowned samples in one shuffled pool
    by_node = [rng.permutation(np.flatnonzero(owners == m)) for m in range(nodes)]
    free = rng.permutation(np.flatnonzero(owners < 0))
    # 2. exchange: Q of each node's samples pooled, shuffled, dealt back in the same amounts
    if exchange > 0 and nodes > 1:
        give = [round(exchange * len(b)) for b in by_node]
        pool = rng.permutation(np.concatenate([b[:g] for b, g in zip(by_node, give)]))
        cuts = np.cumsum([0, *give])
        by_node = [np.concatenate([b[g:], pool[cuts[m]:cuts[m + 1]]]) for m, (b, g) in enumerate(zip(by_node,
                                                                                                  give))]
    # 3. balance: unowned samples fill the short nodes first, then surpluses move to short nodes
    have = np.array([len(b) for b in by_node])
    short = np.maximum(need - have, 0)
    take = np.minimum(short, _split(len(free), short))
    cuts = np.cumsum([0, *take])
    by_node = [np.concatenate([b, free[cuts[m]:cuts[m + 1]]]) for m, b in enumerate(by_node)]
    free = free[cuts[-1]:]
    surplus = [rng.permutation(b)[: max(0, len(b) - int(k))] for b, k in zip(by_node, need)]
    by_node = [b if len(s) == 0 else np.setdiff1d(b, s, assume_unique=True) for b, s in zip(by_node, surplus)]
    moving = rng.permutation(np.concatenate([*surplus, free]))
    short = need - np.array([len(b) for b in by_node])
    # 4. what no node can take is the drop_last remainder; a node still short pads with its own samples
    cuts = np.cumsum([0, *np.maximum(short, 0)])
    by_node = [np.concatenate([b, moving[cuts[m]:cuts[m + 1]]]) for m, b in enumerate(by_node)]
    if drop_last:  # what no node took is the remainder n - world * per_rank, a random set each epoch
        assert len(moving) - int(cuts[-1]) == n - world * per_rank
    for m, b in enumerate(by_node):
        pad = int(need[m]) - len(b)
        if pad > 0:  # without drop_last: repeat a few samples, the node's own when it has any
            src = b if len(b) else np.arange(n)
            by_node[m] = np.concatenate([b, rng.choice(src, pad, replace=pad > len(src))])
    # 5. each node's list shuffled again and dealt to its ranks in equal contiguous parts
    out: list[np.ndarray] = [np.empty(0, np.int64)] * world
    order_rng = _rng(seed, epoch, 2, part)
    for m in range(nodes):
        lst = order_rng.permutation(by_node[m])
        for j, r in enumerate(np.flatnonzero(node_of_rank == m)):
            out[r] = lst[j * per_rank:(j + 1) * per_rank].copy()
    if not drop_last and world * per_rank > n:
        _separate_copies(out, node_of_rank)
    crossing = local = 0
    for r, part in enumerate(out):
        own = owners[part]
        local += int((own == node_of_rank[r]).sum())
        crossing += int(((own >= 0) & (own != node_of_rank[r])).sum())
    return EpochPlan(per_rank=out, crossing=crossing, local=local)


def _separate_copies(out: list[np.ndarray], node_of_rank: np.ndarray) -> None:
    """Swap away every second copy of a sample on one rank (padding makes fewer than ``world`` copies),
    preferring a partner rank on the same node, so locality is kept. Deterministic: ranks, positions
    and partners are visited in order. In place."""
    world = len(out)
    for r in range(world):
        _, counts = np.unique(out[r], return_counts=True)
        if not (counts > 1).any():
            continue
        mine = set(out[r].tolist())
        seen: set[int] = set()
        for pos in range(len(out[r])):
            v = int(out[r][pos])
            if v not in seen:
                seen.add(v)
                continue
            for q in sorted(range(world), key=lambda q: (node_of_rank[q] != node_of_rank[r], q)):
                theirs = out[q].tolist()
                if q == r or v in theirs:
                    continue
                p = next((i for i, w in enumerate(theirs) if w not in mine), None)
                if p is None:
                    continue
                w = theirs[p]
                out[r][pos], out[q][p] = w, v
                mine.add(w)
                seen.add(w)
                break


def _split(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (integers, summing to ``total`` when weights > 0)."""
    w = np.asarray(weights, dtype=np.int64)
    if total <= 0 or w.sum() == 0:
        return np.zeros_like(w)
    if total >= w.sum():
        return w.copy()
    share = (w * total) // w.sum()
    rest = total - int(share.sum())
    order = np.argsort(-(w * total - share * w.sum()), kind="stable")
    share[order[:rest]] += 1
    return share
