"""``--sampler local`` on the emulated cluster (3 network namespaces, one Redis master and one cache
daemon each, torchrun across them): every rank finds its own node's master by address (no
``--local-master``), and what the ranks read from their own master is exactly what the plan put there.
Needs root (ip netns); skipped otherwise."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from bench.emucluster import EmuCluster, EmuConfig, why_unavailable

SKIP = why_unavailable()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster: {SKIP}"), pytest.mark.slow,
              pytest.mark.netns]
IMAGES = 60


def _wait_full(c: EmuCluster, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        sts = [c.daemon_get(i, "/status")[1] for i in range(3)]
        if all(s and s["datasets"] and s["datasets"][0]["status"] == "full" for s in sts):
            return
        assert time.monotonic() < deadline, f"daemons did not fill within {timeout} s: {sts}"
        time.sleep(0.5)


def test_ranks_find_their_node_master_and_read_locally(tmp_path) -> None:
    c = EmuCluster(EmuConfig(state_dir=str(tmp_path / "state"), rate_gbit=None, images=IMAGES))
    c.up()
    try:
        _wait_full(c)
        data = str(tmp_path / "state" / f"dataset-{IMAGES}")
        outs = [str(tmp_path / f"out{i}") for i in range(3)]
        agents = []
        for i in range(3):
            train = ["-m", "trainer", "--data", data, "--val-data", data, "--cache", c.cache_url(),
                     "--short-side", "64", "--sampler", "local", "--device", "cpu", "--model",
                     "small_resnet_cifar", "--width", "4", "--resolution", "16", "--batch-size", "12",
                     "--epochs", "1", "--val-every", "0", "--workers", "0", "--no-progress", "--lr-scaling",
                     "none", "--out", outs[i]]
            agents.append(c.run_on(i, c.torchrun_argv(i, train), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
        for a in agents:
            _, err = a.communicate(timeout=300)
            assert a.returncode == 0, err[-3000:]
        with open(f"{outs[0]}/metrics.jsonl") as f:
            lines = [json.loads(x) for x in f.read().splitlines()]
        start = next(x for x in lines if x["event"] == "start")
        rec = next(x for x in lines if x["event"] == "epoch")
    finally:
        c.down()
    assert start["world_size"] == 3 and start["nodes"] == 3
    assert rec["cache_misses"] == 0 and rec["cache_hits"] == IMAGES  # 20 per rank, 5 batches of 4
    hits = rec["local_hits"] + rec["remote_hits"]
    assert hits == IMAGES and all(b > 0 for b in rec["rank_local_bytes"])  # each rank found its master
    # the reads match the plan: its local samples were read from the master on the reader's node
    assert rec["local_hits"] / hits == pytest.approx(rec["planned_local_fraction"], abs=1e-9)
    assert rec["planned_local_fraction"] > 0.5  # uniform sampling: ~1/3
