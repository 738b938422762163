"""``--sampler local`` in real training runs: 2 gloo ranks as 2 "nodes" (LOCAL_WORLD_SIZE=1) on a real
3-master Redis Cluster on loopback, each rank given its node's master with ``--local-master`` (on one
host all masters are 127.0.0.1, so it cannot be found by address).

* every sample is trained on exactly once per epoch over the ranks, every rank runs the same number of
  batches, and each rank reads mostly its own master's samples; the trainer's per-rank local/remote
  bytes equal a reference computed from the servers (``CLUSTER SLOTS``/``KEYSLOT``, ``STRLEN``);
* a mid-epoch resume continues bit for bit, even after a reshard between the save and the resume
  (the checkpoint carries the epoch's owners snapshot);
* without a Redis Cluster tier ``local`` is an ordinary exactly-once shuffle (said once in the log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import redis

from tests.dist_utils import RecordingBatchSampler, run_distributed
from tests.redis_utils import cli, needs_redis, private, slot_owners
from trainer.train_config import make_config

pytestmark = needs_redis


def _rank(rank: int, world: int, cfg_values: dict, masters: list[str]) -> dict:
    from trainer.data import train_loader
    from trainer.run import train
    from trainer.train_config import TrainConfig

    seen: list = []

    def make_loader(data, sampler):
        return train_loader(data.train, RecordingBatchSampler(sampler, seen), workers=cfg.workers,
                            seed=cfg.seed, crop_scale=cfg.crop_scale, flip=cfg.flip)

    cfg = TrainConfig.from_dict({**cfg_values, "local_master": masters[rank]})
    res = train(cfg, make_loader=make_loader, record_losses=True)
    return {"seen": seen, "losses": res.step_losses, "epochs": res.epochs,
            "state": {k: v.detach().numpy().copy() for k, v in res.model.state_dict().items()}}


def _fill(root: str, url: str) -> list[bytes]:
    from client.dataset import CachedImageNet

    ds = CachedImageNet(root, cache=url, short_side=32)
    ds.__getitems__(list(range(len(ds))))
    return [ds.key(i) for i in range(len(ds))]


def _owner_and_size(cluster, keys: list[bytes]) -> tuple[list[str], list[int]]:
    """Each key's master and value size, asked of the servers (independent of the store's slot map)."""
    r = redis.Redis(host="127.0.0.1", port=cluster.masters[0].port)
    owner = slot_owners(cluster.masters[0].port)
    clients = {m.addr: redis.Redis(host="127.0.0.1", port=m.port) for m in cluster.masters}
    owners = [owner[int(r.execute_command("CLUSTER KEYSLOT", k))] for k in keys]
    sizes = [int(clients[o].strlen(k)) for o, k in zip(owners, keys)]
    return owners, sizes


def _cfg(digits: dict, url: str, out: str, **kw) -> dict:
    # the digits validation folder (359 images) as the training set: 180 per rank (one sample padded,
    # as DistributedSampler pads), 5 batches of 36 -- no batch dropped
    base = dict(data=digits["val"], val_data=digits["val"], cache=url, short_side=32,
                model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16",
                batch_size="72", epochs=2, lr=0.1, lr_scaling="none", workers=1, device="cpu", progress=False,
                seed=5, val_every=0, sampler="local", exchange=0.1, out=out, keep_checkpoints=0)
    return make_config(**{**base, **kw}).to_dict()


@pytest.mark.slow
def test_every_sample_once_equal_batches_and_bytes_per_rank(digits_data, redis_cluster, cluster_url,
                                                          tmp_path) -> None:
    keys = _fill(digits_data["val"], cluster_url)
    n = len(keys)
    assert n == 359 and -(-n // 2) == 5 * 36  # one padded sample, no batch dropped
    masters = [redis_cluster.masters[0].addr, redis_cluster.masters[1].addr]  # node 0, node 1
    owners, sizes = _owner_and_size(redis_cluster, keys)
    cfg = _cfg(digits_data, cluster_url, str(tmp_path / "run"))
    res = run_distributed(_rank, world_size=2, local_size=1, args=(cfg, masters))
    for epoch in range(2):
        per_rank = [[i for e, _, idx in r["seen"] if e == epoch for i in idx] for r in res]
        steps = [[s for e, s, _ in r["seen"] if e == epoch] for r in res]
        assert steps[0] == steps[1] == list(range(5))  # the same number of batches on every rank
        both = per_rank[0] + per_rank[1]
        assert sorted(set(both)) == list(range(n)) and len(both) == n + 1  # every sample once, 1 padded
        for rank in range(2):  # mostly its own master's samples (the third master's go to either)
            own = [i for i in range(n) if owners[i] == masters[rank]]
            got = sum(1 for i in per_rank[rank] if owners[i] == masters[rank])
            assert got >= 0.8 * len(own), (epoch, rank, got, len(own))
            # the trainer's byte accounting = the servers' sizes of what this rank read, split by master
            rec = res[0]["epochs"][epoch]
            local = sum(sizes[i] for i in per_rank[rank] if owners[i] == masters[rank])
            remote = sum(sizes[i] for i in per_rank[rank] if owners[i] != masters[rank])
            assert (rec["rank_local_bytes"][rank], rec["rank_remote_bytes"][rank]) == (local, remote)
        assert rec["local_bytes"] == sum(rec["rank_local_bytes"]) and rec["sampler"] == "local"
    # the two epochs differ (seeded per epoch) and the log says where the bytes went
    assert [r for e, _, r in res[0]["seen"] if e == 0] != [r for e, _, r in res[0]["seen"] if e == 1]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [x for x in lines if x["event"] == "epoch"]
    assert epochs[0]["rank_local_bytes"] == res[0]["epochs"][0]["rank_local_bytes"]


@pytest.mark.slow
def test_mid_epoch_resume_is_bit_exact_across_a_reshard(digits_data, fresh_cluster, tmp_path) -> None:
    url = private(fresh_cluster.url)
    keys = _fill(digits_data["val"], url)
    masters = [fresh_cluster.masters[0].addr, fresh_cluster.masters[1].addr]
    cfg = _cfg(digits_data, url, str(tmp_path / "a"), epochs=1, checkpoint_every=2, comm="naive_ag",
               selector="exact", density=0.1)
    full = run_distributed(_rank, world_size=2, local_size=1, args=(cfg, masters))
    ckpt = tmp_path / "a" / "checkpoints" / "step00000002"
    assert (ckpt / "train.pt").exists()
    # move 4000 slots from master 0 to master 1: the owners of the remaining batches change
    before, _ = _owner_and_size(fresh_cluster, keys)
    a, b = fresh_cluster.masters[0], fresh_cluster.masters[1]
    ids = {m.addr: cli(m.port, "cluster", "myid") for m in (a, b)}
    out = subprocess.run(["redis-cli", "--cluster", "reshard", a.addr, "--cluster-from", ids[a.addr],
                          "--cluster-to", ids[b.addr], "--cluster-slots", "4000", "--cluster-yes"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fresh_cluster.wait_agreed()
    after, _ = _owner_and_size(fresh_cluster, keys)
    assert before != after  # the reshard really moved samples of this data set
    resumed_cfg = {**cfg, "resume": str(ckpt), "out": str(tmp_path / "b")}
    resumed = run_distributed(_rank, world_size=2, local_size=1, args=(resumed_cfg, masters))
    for rank in range(2):
        f, r = full[rank], resumed[rank]
        assert [s for s in f["seen"] if s[1] >= 2] == r["seen"]  # the same remaining batches, same order
        assert f["losses"][2:] == r["losses"]
        for k, v in f["state"].items():
            assert np.array_equal(v, r["state"][k]), k


@pytest.mark.slow
def test_local_without_a_cluster_is_a_plain_shuffle_and_resume_refuses_changes(digits_data, tmp_path, capsys,
                                                                              in_process_training) -> None:
    from datacache.config import ConfigError
    from trainer.run import train
    from trainer.train_config import TrainConfig

    cfg = _cfg(digits_data, digits_data["cache"], str(tmp_path / "a"), epochs=1, checkpoint_every=2,
               workers=0)
    res = train(TrainConfig.from_dict(cfg))
    said = capsys.readouterr().out
    assert said.count("no Redis Cluster tier, so each epoch is an ordinary seeded exactly-once shuffle") == 1
    assert res.epochs[0]["local_bytes"] == res.epochs[0]["remote_bytes"] == 0  # LMDB: nothing placed
    ckpt = str(tmp_path / "a" / "checkpoints" / "step00000002")
    for change, match in (({"sampler": "global"}, "saved mid-epoch with --sampler local"),
                          ({"exchange": 0.3}, "exchange 0.1")):
        bad = TrainConfig.from_dict({**cfg, **change, "resume": ckpt, "out": str(tmp_path / "b")})
        with pytest.raises(ConfigError, match=match):
            train(bad)


@pytest.mark.parametrize("args,expected", [
    (["--sampler", "nearby"], "--sampler: invalid choice: 'nearby' (choose from"),
    (["--exchange", "1.5"], "exchange=1.5; must be a fraction in [0, 1]"),
    (["--local-master", "node0"], "local_master='node0' is not host:port"),
    (["--local-master", "127.0.0.1:7000"], "the cache has no redis+cluster:// tier"),
])
def test_bad_sampler_options_are_one_line_errors(digits_data, tmp_path, args, expected) -> None:
    cmd = [sys.executable, "-m", "trainer", "--data", digits_data["val"], "--cache", digits_data["cache"],
           "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress", *args]
    # a fresh one-rank run: not the torchrun variables an in-process train() of this pytest process set
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "Traceback" not in out.stderr
    assert args[0] != "--sampler" or ("global" in out.stderr and "local" in out.stderr)  # the valid choices


def test_unreachable_cluster_at_an_epoch_start_gives_a_plain_shuffle_epoch(caplog) -> None:
    from datacache.stores import open_store
    from trainer.distenv import free_port
    from trainer.locality import epoch_owners

    dead = open_store(f"redis+cluster://127.0.0.1:{free_port()}?connect_timeout=0.5")  # nothing listens
    with caplog.at_level("WARNING", logger="trainer.locality"):
        owners = epoch_owners(dead, [b"dc:x:%d" % i for i in range(7)], ["127.0.0.1:1"])
    assert owners.dtype == np.int16 and owners.tolist() == [-1] * 7  # no node owns anything: plain shuffle
    assert "cannot read the slot map" in caplog.text and "ordinary exactly-once shuffle" in caplog.text


@pytest.mark.slow
def test_a_node_joining_mid_epoch_re_plans_the_rest_once_and_local(digits_data, redis_cluster, cluster_url,
                                                                   tmp_path) -> None:
    """2 nodes stopped after step 2 of 5, resumed on 3 nodes (the third master's node joined): the
    untrained samples are re-planned over the 3 ranks from the owners at resume time, each trained
    once, each rank reading mostly its own master; global batch 72 kept (24 per rank)."""
    keys = _fill(digits_data["val"], cluster_url)
    n = len(keys)
    masters = [m.addr for m in redis_cluster.masters[:3]]
    owners, _ = _owner_and_size(redis_cluster, keys)
    cfg = _cfg(digits_data, cluster_url, str(tmp_path / "a"), epochs=1, checkpoint_every=2)
    two = run_distributed(_rank, world_size=2, local_size=1, args=(cfg, masters[:2]))
    first = [i for r in two for e, s, ix in r["seen"] if e == 0 and s < 2 for i in ix]
    ckpt = tmp_path / "a" / "checkpoints" / "step00000002"
    resumed_cfg = {**cfg, "resume": str(ckpt), "out": str(tmp_path / "b")}
    three = run_distributed(_rank, world_size=3, local_size=1, args=(resumed_cfg, masters))
    rest = [[i for e, _, ix in r["seen"] if e == 0 for i in ix] for r in three]
    for r in three:
        assert [s for e, s, _ in r["seen"]] == [2, 3, 4] and all(len(ix) == 24 for _, _, ix in r["seen"])
    # the plan's one padded copy (359 samples on 2 x 180) lands at any step of its rank, as the plan shuffles
    # each node's list after padding: the first 2 steps hold it (143 distinct) or the re-plan pads
    # (215 untrained on 3 x 72), never both
    assert len(first) == 2 * 72 and len(set(first)) >= 2 * 72 - 1
    both = first + [i for part in rest for i in part]
    assert sorted(set(both)) == list(range(n)) and len(both) == n + 1  # every sample trained, one padded copy
    assert not set(first) & {i for part in rest for i in part}  # nothing of the first 2 steps again
    local = sum(owners[i] == masters[rank] for rank, part in enumerate(rest) for i in part)
    assert local >= 0.8 * sum(len(p) for p in rest), local
    assert three[0]["epochs"][0]["planned_local_fraction"] >= 0.8


def _rank_publishing(rank: int, world: int, cfg_values: dict, masters: list[str]) -> dict:
    """:func:`_rank`, recording every run-plan record rank 0's publisher wrote."""
    from client.run_publisher import PlanPublisher

    published: list[dict] = []
    real = PlanPublisher.publish

    def publish(self):
        ok = real(self)
        if ok:
            published.append(json.loads(self.record.encode()))
        return ok

    PlanPublisher.publish = publish  # (this spawned process only)
    out = _rank(rank, world, cfg_values, masters)
    return {**out, "published": published}


@pytest.mark.slow
def test_the_trainer_publishes_the_plan_the_daemons_reproduce(digits_data, redis_cluster, cluster_url,
                                                             tmp_path) -> None:
    """Rank 0 publishes each epoch's plan and progress; a daemon that recomputes the plan from the record
    and its own slot map gets exactly the order every rank trained (so the rolling fill fills in the
    order the samples are read)."""
    from cache_daemon.rolling import RollingFill
    from client.dataset import CachedImageNet
    from datacache.epoch_plan import owners_digest
    from datacache.run_plan import epoch_order, parse_record
    from datacache.stores import open_store

    keys = _fill(digits_data["val"], cluster_url)
    masters = [redis_cluster.masters[0].addr, redis_cluster.masters[1].addr]
    cfg = _cfg(digits_data, cluster_url, str(tmp_path / "run"))
    res = run_distributed(_rank_publishing, world_size=2, local_size=1, args=(cfg, masters))
    records = [parse_record(json.dumps(r).encode()) for r in res[0]["published"]]
    assert res[1]["published"] == []  # rank 0 only
    assert {r.epoch for r in records} == {0, 1} and len({r.run for r in records}) == 1
    ds = CachedImageNet(digits_data["val"], cache=cluster_url, short_side=32)
    store = open_store(ds.reader.store.tiers[-1].spec) if hasattr(ds.reader.store, "tiers") else None
    store = store or ds.reader.store
    for epoch in (0, 1):
        rec = [r for r in records if r.epoch == epoch][-1]
        assert rec.samples == len(keys) and rec.masters == masters and rec.node_of_rank == [0, 1]
        owners = RollingFill()._owners(store, ds.reader.prefix, len(keys), rec.masters)
        assert owners_digest(owners) == rec.owners_digest  # the daemon's slot map gives the same owners
        order = epoch_order(rec, owners)
        length = order.length
        for rank in range(2):
            seen = [i for e, _, idx in res[rank]["seen"] if e == epoch for i in idx]
            assert order.idx_now[rank * length:(rank + 1) * length].tolist() == seen, (epoch, rank)
        assert 0 <= rec.trained <= rec.drawn <= length
    for epoch in (0, 1):  # progress: whole steps of 36 per rank, never backwards within the epoch
        trained = [r.trained for r in records if r.epoch == epoch]
        assert trained == sorted(trained) and all(t % 36 == 0 for t in trained)
    assert max(r.trained for r in records) >= 36
