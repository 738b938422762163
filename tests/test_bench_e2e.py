"""``python -m bench.e2e``: its argument checks (anywhere) and a ``--quick`` smoke run on the emulated
3-node cluster (root: network namespaces; skipped with the reason elsewhere). The smoke run starts the
real cluster (redis-servers, daemons, shaped veths) and three torchrun jobs; it checks what the JSON
reports against what the variants must show, not rates (the machine is shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.emucluster import why_unavailable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
SKIP = why_unavailable()
pytestmark = pytest.mark.netns  # the smoke run builds an emulated cluster
# an upper bound that only catches a hang: the smoke run takes ~4 min alone on 2 cores, several times
# that beside the rest of a parallel suite or a busy machine
HANG_S = 2400


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.e2e", *args], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["--variants", "naive,bogus"], ["bogus", "cache_local_hitopk"]),
    (["--batch", "100"], ["--batch 100", "multiple of the 3 ranks"]),
    (["--rates", "1,zero"], ["--rates", "comma-separated"]),
    (["--rates", "0"], ["--rates must be > 0"]),
    (["--rates", "1,0.1=naive+turbo"], ["--rates", "unknown variant(s) ['turbo']"]),
])
def test_bad_arguments_are_one_line_errors(args: list[str], words: list[str]) -> None:
    r = _run(args, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster: {SKIP}")
@pytest.mark.timeout(HANG_S + 300)
def test_quick_smoke_on_the_emulated_cluster(tmp_path) -> None:
    r = _run(["--quick", "--epochs", "1", "--variants", "naive,cache_global_hitopk,cache_local_hitopk",
              "--rates", "1,0.5=cache_local_hitopk+cache_global_hitopk", "--out", str(tmp_path)],
             timeout=HANG_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads((tmp_path / "e2e_quick.json").read_text())
    assert (tmp_path / "e2e_quick.png").stat().st_size > 0
    assert set(doc) == {"machine", "config", "results", "ratios", "notes"}
    res, ratios = doc["results"], doc["ratios"]
    naive, glob, local = res["naive"], res["cache_global_hitopk"], res["cache_local_hitopk"]
    # the naive loader never touches the cache; the cached variants read only hits (the daemons filled it)
    assert naive["cache_hits"] == naive["local_bytes"] == naive["remote_bytes"] == 0
    for v in (glob, local):
        assert v["cache_misses"] == 0 and v["cache_hits"] == v["samples"] > 0
        assert v["comm_method"] == ["hitopk"]
    assert naive["comm_method"] == ["allreduce"]
    # every job moved gradients across the links; the link total holds the remote cache bytes
    for v in (naive, glob, local):
        assert v["gradient_link_bytes_per_sample"] > 0
        assert v["link_bytes_per_sample"] >= v["cache_link_bytes_per_sample"]
    # 3 nodes: the global shuffle reads ~2/3 remotely, the local sampler (Q = 0.1) ~1/15
    assert 0.15 < glob["local_read_fraction"] < 0.6
    assert local["local_read_fraction"] > 0.8
    assert local["cache_link_bytes_per_sample"] < 0.5 * glob["cache_link_bytes_per_sample"]
    assert ratios["local_read_fraction"] == local["local_read_fraction"]
    assert ratios["link_bytes_local_vs_global"] == pytest.approx(
        local["cache_link_bytes_per_sample"] / glob["cache_link_bytes_per_sample"])
    assert ratios["e2e_full_vs_naive"] == pytest.approx(local["samples_per_s"] / naive["samples_per_s"])
    assert ratios["e2e_cache_dense_vs_naive"] is None  # cache_global_dense did not run
    assert "phases" in res["paper_scale_model"]
    assert any("load average" in n for n in doc["notes"])
    assert doc["config"]["load_average_before"] and doc["config"]["rate_gbit"] == 1.0
    # two rates, the second with two variants only; one repeat; the naive worker sweep of one
    assert doc["config"]["rates_gbit"] == [1.0, 0.5] and doc["config"]["repeats"] == 1
    assert doc["config"]["variants_per_rate"] == {
        "1": ["naive", "cache_global_hitopk", "cache_local_hitopk"],
        "0.5": ["cache_global_hitopk", "cache_local_hitopk"]}
    assert set(res["0.5gbit"]) == {"cache_global_hitopk", "cache_local_hitopk"}
    assert res["1gbit"]["cache_local_hitopk"]["repeat_samples_per_s"] == [local["samples_per_s"]]
    assert set(res["naive_workers_samples_per_s"]) == {"1"} and res["fill_s"] >= 0
    assert 0 < local["link_utilisation"] == pytest.approx(local["link_gbit_per_node_mean"] / 1.0)
    slow = res["0.5gbit"]
    assert 0 < slow["cache_local_hitopk"]["link_utilisation"] == pytest.approx(
        slow["cache_local_hitopk"]["link_gbit_per_node_mean"] / 0.5)
    # the link-bound ratio at the lowest rate where both ran; naive never ran at 0.5: no such ratio
    assert ratios["e2e_local_vs_global_linkbound"] == pytest.approx(
        slow["cache_local_hitopk"]["samples_per_s"] / slow["cache_global_hitopk"]["samples_per_s"])
    assert res["linkbound_rate_gbit"] == {"cache_local_hitopk/cache_global_hitopk": 0.5}
    assert ratios["e2e_full_vs_naive_linkbound"] is None


def test_rates_with_variant_subsets() -> None:
    from bench.e2e import DEFAULT_RATES, parse_rates

    vs = ["naive", "cache_global_dense", "cache_global_hitopk", "cache_local_hitopk"]
    got = parse_rates(DEFAULT_RATES, vs)
    assert got == {1.0: vs, 0.05: vs, 0.01: ["cache_global_hitopk", "cache_local_hitopk"]}
    assert parse_rates("1,0.01=cache_local_hitopk", ["naive"]) == {1.0: ["naive"]}  # subset not selected
    with pytest.raises(ValueError, match="'x=naive' is not RATE"):
        parse_rates("1,x=naive", vs)


def test_a_full_convergence_run_keeps_the_sampler_rows() -> None:
    from bench.convergence import _carry_sampler_rows

    old = {"accuracy": {"dense": 0.9, "sampler_global": 0.99, "sampler_local_q0.1": 0.98},
           "results": {"curves": {"dense": [0.9]}, "sampler_curves": {"sampler_global": [0.99]}},
           "ratios": {"topk_minus_dense_pp": 0.0, "sampler_local_q0.1_minus_global_pp": -1.0},
           "config": {"sampler_rows": {"world_size": 3}}, "notes": ["old note", "sampler rows: measured"]}
    new = {"accuracy": {"dense": 0.95}, "results": {"curves": {"dense": [0.95]}},
           "ratios": {"topk_minus_dense_pp": 0.5}, "config": {"world_size": 4}, "notes": ["new note"]}
    _carry_sampler_rows(old, new)
    assert new["accuracy"] == {"dense": 0.95, "sampler_global": 0.99, "sampler_local_q0.1": 0.98}
    assert new["results"]["sampler_curves"] == {"sampler_global": [0.99]}
    assert new["results"]["curves"] == {"dense": [0.95]}  # the new run's own rows win
    assert new["ratios"] == {"topk_minus_dense_pp": 0.5, "sampler_local_q0.1_minus_global_pp": -1.0}
    assert new["config"] == {"world_size": 4, "sampler_rows": {"world_size": 3}}
    assert new["notes"] == ["new note", "sampler rows: measured"]


def test_readme_splits_the_committed_gain_into_cache_compression_and_locality() -> None:
    """The README's e2e rows multiply cache x compression x locality from the committed run's medians."""
    import re
    from pathlib import Path

    root = Path(REPO)
    doc = json.loads((root / "bench" / "results" / "e2e.json").read_text())
    readme = (root / "README.md").read_text()
    split = r"= cache ([0-9.]+)x × (?:HiTopK )?compression ([0-9.]+)x × locality ([0-9.]+)x"
    parts = re.findall(split, readme)
    assert len(parts) == 2, parts
    for (cache, comp, loc), rate in zip(parts, ("1gbit", "0.05gbit")):
        per = {k: v["samples_per_s"] for k, v in doc["results"][rate].items()}
        want = (per["cache_global_dense"] / per["naive"],
                per["cache_global_hitopk"] / per["cache_global_dense"],
                per["cache_local_hitopk"] / per["cache_global_hitopk"])
        assert [float(x) for x in (cache, comp, loc)] == [pytest.approx(w, abs=0.006) for w in want], rate
