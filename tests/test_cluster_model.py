"""The paper-scale traffic model (trainer.cluster_model) against independent re-statements."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from client.locality_sampler import plan_epoch
from trainer.cluster_model import ClusterAssumptions, cache_remote_fraction, gradient_bytes_per_node, model


def _ring_all_reduce_received(nbytes: float, p: int) -> float:
    """Bytes one participant receives in a ring all-reduce, step by step (reduce-scatter + all-gather)."""
    chunk = nbytes / p
    return sum(chunk for _ in range(p - 1)) + sum(chunk for _ in range(p - 1))


def _ring_all_gather_received(per_rank: float, p: int) -> float:
    return sum(per_rank for _ in range(p - 1))


@pytest.mark.parametrize("m,n", [(2, 2), (3, 4), (16, 8)])
def test_gradient_bytes_match_a_step_by_step_ring(m: int, n: int) -> None:
    d, rho = 1_000_000, 0.01
    torus = sum(_ring_all_reduce_received(4 * d / n, m) for _ in range(n))  # n streams, d/n each
    assert gradient_bytes_per_node("torus", d, m, rho) == pytest.approx(torus)
    k = rho * d / n  # pairs each GPU selects from its d/n chunk
    hitopk = sum(_ring_all_gather_received(8 * k, m) for _ in range(n))
    assert gradient_bytes_per_node("hitopk", d, m, rho) == pytest.approx(hitopk)
    assert gradient_bytes_per_node("hitopk", d, m, rho, fp16_values=True) == pytest.approx(hitopk * 6 / 8)


@pytest.mark.parametrize("nodes", [3, 16])
def test_cache_fractions_match_the_samplers(nodes: int) -> None:
    n, q = 48_000, 0.1
    owners = np.random.default_rng(0).integers(0, nodes, n)
    ranks = np.repeat(np.arange(nodes), 2)
    local = plan_epoch(owners, ranks, seed=0, epoch=0, exchange=q)
    assert 1 - local.local_fraction == pytest.approx(cache_remote_fraction("local", nodes, q), abs=0.02)
    # a global shuffle: each rank's samples come from any shard
    perm = np.random.default_rng(1).permutation(n)
    node_of_read = np.repeat(np.arange(nodes), n // nodes)
    remote = float((owners[perm[: len(node_of_read)]] != node_of_read).mean())
    assert remote == pytest.approx(cache_remote_fraction("global", nodes, q), abs=0.02)


def test_paper_cluster_figures() -> None:
    r = model(ClusterAssumptions())
    p96 = r["phases"][0]
    assert p96["input_px"] == 96 and p96["samples_per_s_per_node"] == pytest.approx(366_208 / 16)
    # DESIGN/FACTS: ~48 KB a sample at short side ~110, ~1.1 GB/s a node, ~9 Gbit/s of it (15/16 remote)
    assert 40e3 < p96["record_bytes"] < 50e3
    assert 6.5 < p96["cache_gbit_per_node"]["global"] < 9.5
    assert p96["cache_gbit_per_node"]["local"] < 0.15 * p96["cache_gbit_per_node"]["global"]
    assert p96["gradient_gbit_per_node"]["hitopk"] < p96["gradient_gbit_per_node"]["torus"] / 4
    assert p96["fits_nic"]["local+hitopk"]
    for v in r["variants"]:  # Redis keeps at least the pixels, at most jemalloc's rounding + ~200 B a key
        per_key = v["redis_bytes_per_node"] * 16 / 1_281_167
        assert v["record_bytes"] <= per_key <= 1.25 * v["record_bytes"] + 200


def test_cli_prints_assumptions_and_refuses_bad_values(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "trainer.cluster_model", "--nodes", "4", "--json",
                          str(tmp_path / "m.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "assumptions: nodes=4" in out.stdout and (tmp_path / "m.json").exists()
    bad = subprocess.run([sys.executable, "-m", "trainer.cluster_model", "--nic-gbit", "nan"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nic_gbit must be a finite number" in bad.stderr
