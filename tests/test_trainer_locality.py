"""The locality-aware sampler inside the trainer (trainer.locality): local master, owners, batches."""

from __future__ import annotations

import numpy as np
import pytest

from datacache.config import ConfigError
from datacache.stores import open_store
from tests.redis_utils import needs_redis
from trainer.locality import LocalityBatchSampler, epoch_owners, local_master, node_masters


def test_local_master_explicit_unique_or_ambiguous() -> None:
    masters = ["127.0.0.1:7000", "127.0.0.1:7001", "192.0.2.10:7000"]  # 192.0.2.0/24: TEST-NET, never local
    assert local_master(masters, "127.0.0.1:7001") == ("127.0.0.1:7001", "given")
    with pytest.raises(ConfigError, match="not a master"):
        local_master(masters, "127.0.0.1:9999")
    mine, why = local_master(masters)
    assert mine is None and "--local-master" in why  # two on this host: ambiguous, never guessed
    assert local_master(["127.0.0.1:7000", "192.0.2.10:7000"])[0] == "127.0.0.1:7000"
    assert local_master(["192.0.2.10:7000"])[0] is None


def test_node_masters_without_a_process_group() -> None:
    assert node_masters("127.0.0.1:7000", [0]) == ["127.0.0.1:7000"]


def test_batches_equal_every_sample_once_and_resume() -> None:
    n, ranks = 600, [0, 0, 1, 1, 2, 2]
    indices = np.arange(1000, 1000 + n)  # a training split: dataset indices, not positions
    owners = np.random.default_rng(0).integers(0, 3, n).astype(np.int16)
    samplers = [LocalityBatchSampler(indices, owners, ranks, r, seed=3, exchange=0.1) for r in range(6)]
    for s in samplers:
        s.set_epoch(2, batch_size=25)
    batches = [list(s) for s in samplers]
    assert {len(b) for b in batches} == {4}  # 100 samples a rank, 4 full batches of 25
    seen = [i for b in batches for req in b for i in req.indices]
    assert len(seen) == len(set(seen)) == 600 and set(seen) == set(indices.tolist())
    # with Q = 0.1 most reads are from the node's own shard: all but the exchange and the surplus
    local = [owners[i - 1000] == ranks[r] for r, b in enumerate(batches) for req in b for i in req.indices]
    surplus = sum(max(0, int((owners == m).sum()) - 200) for m in range(3))
    assert np.mean(local) >= 1 - 0.1 - surplus / n
    state = samplers[4].state_dict()
    again = LocalityBatchSampler(indices, np.zeros(n, np.int16), ranks, 4, seed=3, exchange=0.1)
    again.load_state_dict(state)  # the owners snapshot travels with the checkpoint
    again.set_epoch(2, batch_size=25, start_step=2)
    assert [r.indices for r in again] == [r.indices for r in batches[4][2:]]
    bad = LocalityBatchSampler(indices, owners, ranks, 4, seed=3, exchange=0.2)
    with pytest.raises(ConfigError, match="--exchange"):
        bad.load_state_dict(state)


def test_mid_epoch_state_refuses_another_layout_of_the_same_world_size() -> None:
    """2 nodes x 4 -> 4 nodes x 2 (8 ranks both): continuing the saved epoch on the new layout would
    train some samples twice and others never (counted here); the state refuses it in one line."""
    n, batch, start = 1003, 16, 3
    indices = np.arange(n)
    owners = np.random.default_rng(1).integers(0, 2, n).astype(np.int16)
    saved_layout, new_layout = [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3]

    def batches(layout: list[int], start_step: int) -> list[list[int]]:
        out = []
        for r in range(8):
            s = LocalityBatchSampler(indices, owners, layout, r, seed=5, exchange=0.1)
            s.set_epoch(0, batch_size=batch, start_step=start_step)
            out.append([i for req in s for i in req.indices])
        return out

    trained = [i for b in batches(saved_layout, 0) for i in b[:start * batch]]
    naive = trained + [i for b in batches(new_layout, start) for i in b]  # what the old code did
    counts = np.bincount(naive, minlength=n)
    assert (counts == 0).sum() > 50 and (counts >= 2).sum() > 50  # lost and repeated samples
    state = LocalityBatchSampler(indices, owners, saved_layout, 0, seed=5, exchange=0.1).state_dict()
    resumed = LocalityBatchSampler(indices, owners, new_layout, 0, seed=5, exchange=0.1)
    with pytest.raises(ConfigError) as e:
        resumed.load_state_dict(state)
    msg = str(e.value)
    assert "2 nodes x 4 ranks" in msg and "4 nodes x 2 ranks" in msg and "\n" not in msg
    same = LocalityBatchSampler(indices, owners, saved_layout, 3, seed=5, exchange=0.1)
    same.load_state_dict(state)  # the same layout continues
    old = {k: v for k, v in state.items() if k != "node_of_rank"}  # a checkpoint from before the record
    with pytest.raises(ConfigError, match="predates the rank-layout record"):
        same.load_state_dict(old)


@needs_redis
def test_owners_follow_the_cluster_slot_map(redis_cluster) -> None:
    store = open_store(redis_cluster.url)
    keys = [b"dc:loc:%d" % i for i in range(300)]
    masters = store.masters()
    owners = epoch_owners(store, keys, masters)
    assert set(owners.tolist()) == {0, 1, 2}
    by_master = store.master_of(keys)
    assert all(masters[o] == m for o, m in zip(owners, by_master))
    only_first = epoch_owners(store, keys, [masters[0], "", ""])  # masters on no training node: -1
    assert set(only_first.tolist()) <= {0, -1}
