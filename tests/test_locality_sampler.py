"""The locality-aware exactly-once epoch plan (client.locality_sampler), checked by its properties."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest
import torch

from client.locality_sampler import LocalitySampler, owners_digest, plan_epoch
from datacache.config import ConfigError


def _owners(n: int, nodes: int, seed: int = 0, skew: float = 0.0) -> np.ndarray:
    """Random shard owners, node 0 holding ``skew`` more than its share (unequal shards)."""
    rng = np.random.default_rng(seed)
    p = np.full(nodes, 1.0 / nodes)
    p[0] += skew
    return rng.choice(nodes, n, p=p / p.sum()).astype(np.int16)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n", [1000, 1001, 997])
def test_every_sample_exactly_once_equal_counts(n: int, drop_last: bool) -> None:
    owners, ranks = _owners(n, 3), [0, 0, 1, 1, 2, 2]
    plan = plan_epoch(owners, ranks, seed=1, epoch=0, exchange=0.1, drop_last=drop_last)
    sizes = {len(p) for p in plan.per_rank}
    assert len(sizes) == 1  # every rank the same number of samples
    allidx = np.concatenate(plan.per_rank)
    counts = np.bincount(allidx, minlength=n)
    if drop_last:  # each read at most once; exactly n % world dropped
        assert counts.max() == 1 and (counts == 0).sum() == n % len(ranks)
    else:  # each read at least once; exactly the padding repeated
        assert counts.min() == 1 and counts.sum() - n == (-n) % len(ranks)
    if n % len(ranks) == 0:
        assert (counts == 1).all()


def test_balanced_shards_read_locally_apart_from_the_exchange() -> None:
    n, q = 6000, 0.1
    owners = np.repeat(np.arange(3), n // 3).astype(np.int16)  # equal shards
    plan = plan_epoch(owners, [0, 0, 1, 1, 2, 2], seed=0, epoch=3, exchange=q)
    # a node gets back Q of its count from the pool, of which ~1/3 is its own: local ~ 1 - Q * 2/3
    assert plan.local_fraction >= 1 - q
    assert plan_epoch(owners, [0, 0, 1, 1, 2, 2], seed=0, epoch=3, exchange=0).local_fraction == 1.0
    for r, node in enumerate([0, 0, 1, 1, 2, 2]):
        mine = plan_epoch(owners, [0, 0, 1, 1, 2, 2], seed=0, epoch=3, exchange=0).per_rank[r]
        assert (owners[mine] == node).all()


def test_unequal_shards_cross_only_the_surplus() -> None:
    n = 3000
    owners = _owners(n, 3, seed=5, skew=0.3)
    plan = plan_epoch(owners, [0, 1, 2], seed=0, epoch=0, exchange=0.0)
    need = n // 3
    surplus = sum(max(0, int((owners == m).sum()) - need) for m in range(3))
    assert plan.crossing == surplus  # the smallest set of cross-node reads that equalises the ranks


def test_exchange_moves_samples_between_epochs() -> None:
    owners = np.repeat(np.arange(2), 500).astype(np.int16)
    seen = [set(plan_epoch(owners, [0, 1], seed=0, epoch=e, exchange=0.2).per_rank[0]) for e in range(6)]
    union = set().union(*seen)
    assert len(union) > 520  # node 0 saw samples of node 1's shard across epochs (no fixed subset)
    assert seen[0] != seen[1]


def test_deterministic_and_no_shards_is_a_plain_shuffle() -> None:
    owners = _owners(500, 3)
    a = plan_epoch(owners, [0, 1, 2], seed=7, epoch=2, exchange=0.1)
    b = plan_epoch(owners.copy(), [0, 1, 2], seed=7, epoch=2, exchange=0.1)
    assert all((x == y).all() for x, y in zip(a.per_rank, b.per_rank))
    c = plan_epoch(owners, [0, 1, 2], seed=7, epoch=3, exchange=0.1)
    assert not all((x == y).all() for x, y in zip(a.per_rank, c.per_rank))
    none = plan_epoch(np.full(500, -1), [0, 1, 2, 3], seed=0, epoch=0)
    assert sorted(np.concatenate(none.per_rank).tolist()) == list(range(500))
    assert none.crossing == 0 and none.local == 0


def test_resume_mid_epoch_continues_exactly() -> None:
    owners, ranks = _owners(800, 2), [0, 0, 1, 1]
    full = LocalitySampler(owners, ranks, rank=3, seed=4, exchange=0.1)
    full.set_epoch(5)
    order = list(full)
    s = LocalitySampler(owners, ranks, rank=3, seed=4, exchange=0.1)
    s.set_epoch(5)
    it = iter(s)
    head = [next(it) for _ in range(37)]
    s.mark_trained(37)
    state = s.state_dict()
    resumed = LocalitySampler(owners, ranks, rank=3, seed=4, exchange=0.1)
    resumed.load_state_dict(state)
    assert head + list(resumed) == order and len(resumed) == len(order) - 37
    moved = owners.copy()
    moved[:10] = (moved[:10] + 1) % 2  # another slot map: refused, not silently a different order
    other = LocalitySampler(moved, ranks, rank=3, seed=4, exchange=0.1)
    with pytest.raises(ConfigError, match="owners snapshot"):
        other.load_state_dict(state)
    assert owners_digest(moved) != owners_digest(owners)


class _Ids(torch.utils.data.Dataset):
    """Index i is sample i; with ``fetched`` (a shared semaphore) every fetch releases it once, in
    whichever worker process it happens."""

    def __init__(self, fetched: Any = None) -> None:
        self.fetched = fetched

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> int:
        if self.fetched is not None:
            self.fetched.release()
        return i


def test_state_counts_what_was_trained_not_what_the_loader_fetched() -> None:
    """A DataLoader with 2 workers fetches batches ahead of the loop: after one trained batch of 4 the
    state must say 4, and the resumed epoch must deliver the prefetched, untrained samples again."""
    owners, ranks = _owners(200, 2), [0, 0, 1, 1]
    s = LocalitySampler(owners, ranks, rank=1, seed=2)
    s.set_epoch(0)
    order = list(s)
    fetched = mp.get_context("spawn").Semaphore(0)
    loader = torch.utils.data.DataLoader(_Ids(fetched), batch_size=4, sampler=s, num_workers=2,
                                         multiprocessing_context="spawn")
    it = iter(loader)
    first = next(it).tolist()
    # the workers prefetch (prefetch_factor 2 x 2 workers = 4 batches ahead of the one consumed): wait
    # until they have fetched all 5 batches, so the state below is taken with untrained samples fetched
    for n in range(5 * 4):
        assert fetched.acquire(timeout=60), f"the loader fetched {n} samples, not 20"
    s.mark_trained(len(first))
    state = s.state_dict()
    del it
    assert first == order[:4] and state["trained"] == 4
    resumed = LocalitySampler(owners, ranks, rank=1, seed=2)
    resumed.load_state_dict(state)
    again = [i for b in torch.utils.data.DataLoader(_Ids(), batch_size=4, sampler=resumed)
             for i in b.tolist()]
    assert first + again == order  # nothing skipped, nothing twice
    with pytest.raises(ConfigError, match="report each trained batch once"):
        resumed.mark_trained(len(order))


def test_state_refuses_another_layout_drop_last_rank_or_an_old_format() -> None:
    owners = _owners(100, 2)
    s = LocalitySampler(owners, [0, 0, 1, 1], rank=0, seed=1, drop_last=False)
    s.set_epoch(3)
    s.mark_trained(5)
    state = s.state_dict()
    cases = [(LocalitySampler(owners, [0, 1, 2, 3], rank=0, seed=1), "node_of_rank saved [0, 0, 1, 1]"),
             (LocalitySampler(owners, [0, 0, 1, 1], rank=0, seed=1, drop_last=True), "drop_last saved False"),
             (LocalitySampler(owners, [0, 0, 1, 1], rank=2, seed=1), "rank saved 0, now 2"),
             (LocalitySampler(owners, [0, 0, 1, 1], rank=0, seed=9), "seed saved 1, now 9")]
    for other, what in cases:
        with pytest.raises(ConfigError) as e:
            other.load_state_dict(state)
        assert what in str(e.value) and "\n" not in str(e.value)
    old = {"epoch": 3, "consumed": 20, "seed": 1, "exchange": 0.0, "owners_digest": owners_digest(owners)}
    with pytest.raises(ConfigError, match="predates"):
        s.load_state_dict(old)


@pytest.mark.parametrize("n,ranks", [(7, [0, 0, 0, 0]), (9, [0, 0, 1, 1]), (5, [0, 1, 2, 3]),
                                     (13, [0, 0, 0, 1, 1, 1, 2, 2])])
def test_padding_never_puts_a_copy_on_the_rank_of_its_original(n: int, ranks: list[int]) -> None:
    """DistributedSampler's guarantee (checked on torch's own sampler first): every sample at least
    once, fewer than world copies added, and no rank holds one sample twice -- for 200 seeds."""
    world = len(ranks)
    ref = [list(torch.utils.data.DistributedSampler(range(n), world, r, shuffle=True, seed=0))
           for r in range(world)]
    assert all(len(set(p)) == len(p) for p in ref)
    for seed in range(200):
        owners = np.random.default_rng(seed).integers(-1, max(ranks) + 1, n)
        plan = plan_epoch(owners, ranks, seed=seed, epoch=0, exchange=0.1)
        allv = np.concatenate(plan.per_rank).tolist()
        assert set(allv) == set(range(n)) and len(allv) - n < world
        for part in plan.per_rank:
            assert len(set(part.tolist())) == len(part), (seed, plan.per_rank)


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ConfigError, match="exchange"):
        plan_epoch([0, 1], [0, 1], seed=0, epoch=0, exchange=1.5)
    with pytest.raises(ConfigError, match="drop_last"):
        plan_epoch([0], [0, 1], seed=0, epoch=0, drop_last=True)


def test_scales_to_imagenet_size() -> None:
    owners = _owners(1_281_167, 16)
    ranks = np.repeat(np.arange(16), 8)
    plan = plan_epoch(owners, ranks, seed=0, epoch=0, exchange=0.1)
    assert plan.local_fraction > 0.9 and len(plan.per_rank) == 128
