"""A mid-epoch resume on another world size or rank layout (``trainer.epoch_rest``): the epoch's
untrained samples re-planned over the new ranks, exactly once, the global batch kept.

Every count comes from iterating the samplers' batches, the way the DataLoader takes them (the test
hook), never from the sampler's own bookkeeping; the saved state goes through ``torch.save`` /
``torch.load(weights_only=True)`` as a checkpoint's does. The ordinary epochs are checked against
torch's own ``DistributedSampler``."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from datacache.config import ConfigError
from trainer.data import DistributedBatchSampler
from trainer.epoch_rest import continue_epoch
from trainer.locality import LocalityBatchSampler


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class World:
    """Every rank's sampler of one run (global or locality-aware)."""

    def __init__(self, indices, world: int, *, seed: int = 3, layout=None, owners=None, exchange=0.1):
        if layout is None:
            self.samplers = [DistributedBatchSampler(indices, world, r, seed) for r in range(world)]
        else:
            assert len(layout) == world
            self.samplers = [LocalityBatchSampler(indices, owners, layout, r, seed, exchange)
                             for r in range(world)]

    def resume(self, state, *, saved_world: int, global_batch: int, epoch: int, step: int) -> list[str]:
        return [continue_epoch(s, _roundtrip(state) if state is not None else None, saved_world=saved_world,
                               global_batch=global_batch, epoch=epoch, step=step) for s in self.samplers]

    def run(self, epoch: int, global_batch: int, start: int, stop: int | None = None) -> list[list[int]]:
        """Every rank's batches from ``start`` up to ``stop`` (exclusive; None: the epoch's end);
        asserts all ranks run the same steps with batches of ``global_batch / world``."""
        world = len(self.samplers)
        out = []
        steps = None
        for s in self.samplers:
            rest = s.rest_for(epoch)
            s.set_epoch(epoch, global_batch // world, start if rest is None else max(start, rest.start_step))
            got = [(b.step, list(b.indices)) for b in s if stop is None or b.step < stop]
            assert all(len(ix) == global_batch // world for _, ix in got)
            assert steps is None or [st for st, _ in got] == steps
            steps = [st for st, _ in got]
            out.append([i for _, ix in got for i in ix])
        return out

    def state(self) -> dict:
        return self.samplers[0].state_dict()


def _flat(per_rank: list[list[int]]) -> list[int]:
    return [i for r in per_rank for i in r]


@pytest.mark.parametrize("new_world", [3, 6, 2, 8])
def test_divisible_case_trains_every_sample_exactly_once_across_the_change(new_world: int) -> None:
    n, g = 960, 48  # 4 ranks x 12: 20 steps; stop after 5
    idx = list(range(1000, 1000 + n))
    a = World(idx, 4)
    first = a.run(0, g, 0, stop=5)
    state = a.state()
    b = World(idx, new_world)
    notes = b.resume(state, saved_world=4, global_batch=g, epoch=0, step=5)
    assert all("720 untrained samples re-planned over" in x and f"{g // new_world} per rank" in x
               for x in notes)
    second = b.run(0, g, 5)
    both = Counter(_flat(first) + _flat(second))
    assert sorted(both) == idx and set(both.values()) == {1}  # every sample exactly once
    assert b.samplers[0].steps_in_epoch() == 5 + 15
    # the next epoch is the new world's ordinary plan: torch's DistributedSampler order
    for r, s in enumerate(b.samplers):
        s.set_epoch(1, g // new_world)
        ref = DistributedSampler(range(n), num_replicas=new_world, rank=r, shuffle=True, seed=3)
        ref.set_epoch(1)
        assert [i for bt in s for i in bt.indices] == [idx[i] for i in ref][: len(s) * (g // new_world)]


def test_padding_and_dropped_tails_never_train_a_sample_twice_outside_padding() -> None:
    n, g = 1003, 64  # the case: 8 ranks x 8, resumed at step 3
    idx = list(range(n))
    a = World(idx, 8)
    first = a.run(0, g, 0, stop=3)
    for m in (2, 4, 16, 32):
        b = World(idx, m)
        b.resume(a.state(), saved_world=8, global_batch=g, epoch=0, step=3)
        second = _flat(b.run(0, g, 3))
        assert not set(second) & set(_flat(first))  # nothing trained before is trained again
        remaining = n - len(set(_flat(first)))
        pads = -remaining % m
        assert len(second) - len(set(second)) <= pads < m  # copies only from padding to a multiple of m
        per_rank = -(-remaining // m)
        assert len(second) == m * (per_rank // (g // m)) * (g // m)  # whole batches, like any epoch


def test_a_chain_of_changes_in_one_epoch_composes_and_a_same_world_resume_continues_bit_for_bit() -> None:
    n, g = 1000, 24
    idx = list(range(n))
    a = World(idx, 4)  # 4 ranks: 41 steps of 6
    trained = _flat(a.run(0, g, 0, stop=7))
    b = World(idx, 3)
    b.resume(a.state(), saved_world=4, global_batch=g, epoch=0, step=7)
    full_b = b.run(0, g, 7)  # what part 1 would do to the end
    trained += _flat(b.run(0, g, 7, stop=12))
    saved = b.state()
    assert saved["rest"]["part"] == 1 and saved["rest"]["start_step"] == 7
    # the same world resumed at step 12: exactly part 1's remaining batches
    b2 = World(idx, 3)
    assert b2.resume(saved, saved_world=3, global_batch=g, epoch=0, step=12) == [""] * 3
    assert b2.run(0, g, 12) == [r[(12 - 7) * 8:] for r in full_b]
    # another change: 3 -> 6 ranks (part 2), then 6 -> 2 (part 3) to the end
    c = World(idx, 6)
    c.resume(saved, saved_world=3, global_batch=g, epoch=0, step=12)
    trained += _flat(c.run(0, g, 12, stop=20))
    d = World(idx, 2)
    d.resume(c.state(), saved_world=6, global_batch=g, epoch=0, step=20)
    assert d.samplers[0].rest.part == 3
    trained += _flat(d.run(0, g, 20))
    counts = Counter(trained)
    assert max(counts.values()) == 1 and len(counts) >= n - 2 * (g // 2)  # once; at most the last tails left


def _owners(n: int, nodes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, nodes, n).astype(np.int16)


@pytest.mark.parametrize("layout", [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 1, 1, 1], [0, 1, 2]])
def test_locality_layout_change_trains_once_and_plans_the_rest_from_the_new_owners(layout) -> None:
    n, g = 1003, 48
    idx = list(range(n))
    old_layout = [0, 0, 0, 0, 1, 1, 1, 1]  # 2 nodes x 4 -> the 4 x 2 (same world) and others
    a = World(idx, 8, layout=old_layout, owners=_owners(n, 2, 1))
    first = _flat(a.run(0, g, 0, stop=3))
    m = len(layout)
    nodes = max(layout) + 1
    now = _owners(n, nodes, 2)  # the cluster at resume time: other masters, other slots
    b = World(idx, m, layout=layout, owners=_owners(n, 2, 1))
    notes = b.resume(a.state(), saved_world=8, global_batch=g, epoch=0, step=3)
    assert "planned for 2 nodes x 4 ranks" in notes[0]
    for s in b.samplers:
        s.set_owners(now)  # what the trainer does: a fresh snapshot for the re-planned rest
    second_per_rank = b.run(0, g, 3)
    second = _flat(second_per_rank)
    assert not set(second) & set(first)
    remaining = n - len(set(first))
    assert len(second) - len(set(second)) < m
    assert len(set(first) | set(second)) >= n - m * (g // m)  # at most one batch per rank's tail left
    # locality from the new owners: each rank reads mostly its own node's samples
    local = sum(int(now[i] == layout[r]) for r, part in enumerate(second_per_rank) for i in part)
    assert local / len(second) >= 0.85, local / len(second)
    assert b.samplers[0].local_fraction() >= 0.85
    assert remaining > 0


def test_refusals_name_what_differs() -> None:
    idx = list(range(200))
    a = World(idx, 2)
    a.run(0, 32, 0, stop=2)
    with pytest.raises(ConfigError, match=r"global batch 32 on 2 ranks; it does not split over 3 ranks.*"
                                          r"resume on 1, 2, 4, 8, 16, 32 ranks"):
        World(idx, 3).resume(a.state(), saved_world=2, global_batch=32, epoch=0, step=2)
    with pytest.raises(ConfigError, match="seed"):
        World(idx, 4, seed=4).resume(a.state(), saved_world=2, global_batch=32, epoch=0, step=2)
    # a locality state from before the layout record cannot be re-planned
    la = World(idx, 2, layout=[0, 1], owners=_owners(200, 2, 0))
    old = {k: v for k, v in la.state().items() if k != "node_of_rank"}
    with pytest.raises(ConfigError, match="predates the rank-layout record"):
        World(idx, 4, layout=[0, 0, 1, 1], owners=_owners(200, 2, 0)).resume(
            old, saved_world=2, global_batch=32, epoch=0, step=2)
    # a rest record for another dataset size
    b = World(idx, 4)
    b.resume(a.state(), saved_world=2, global_batch=32, epoch=0, step=2)
    rest_state = b.state()
    with pytest.raises(ConfigError, match="epoch-rest record is for 200 samples, this run has 199"):
        World(list(range(199)), 4).resume(rest_state, saved_world=4, global_batch=32, epoch=0, step=3)
