"""``python -m bench.overlap --quick`` on the emulated cluster (root, network namespaces): it runs every
method in both modes on 3 namespaced gloo ranks and writes the issue's ratio names and the PNGs.
The ResNet-50-shaped stack carries ResNet-50's parameter count (25.6M, the published figure) / scale.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.emucluster import why_unavailable
from bench.overlap import METHODS, analyse, r50_profile, r50_stack

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.netns  # the quick runs build an emulated cluster
# an upper bound that only catches a hang: a quick run takes ~1.5 min alone on 2 cores, several times
# that beside the rest of a parallel suite or a busy machine
HANG_S = 1800


def test_r50_stack_has_resnet50s_profile() -> None:
    sizes = r50_profile(1.0)
    assert len(sizes) == 54  # 53 convolutions (16 bottlenecks x 3, 4 downsamples, the stem) + fc
    assert abs(sum(sizes) - 25.5e6) / 25.5e6 < 0.01  # torchvision: 25,557,032 incl. BN and biases
    model = r50_stack(64.0, 64)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - sum(r50_profile(64.0))) / n < 0.05  # each block rounds up to whole rows


@pytest.mark.skipif(why_unavailable() is not None, reason=f"emulated cluster: {why_unavailable()}")
@pytest.mark.timeout(HANG_S + 300)
def test_quick_run_writes_every_ratio(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "bench.overlap", "--quick", "--results-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "overlap_quick.json").read_text())
    for m in METHODS:
        assert doc["ratios"][f"overlap_{m}_vs_sync_fast"] > 0 and doc["ratios"][f"overlap_{m}_vs_sync"] > 0
        ratios = doc["ratios"]
        assert ratios[f"overlap_vs_bound_{m}"] > 0 and ratios[f"overlap_vs_machine_bound_{m}"] > 0
        row = doc["results"]["table"]["fast"]["r50stack"][m]
        assert row["async"]["comm_busy_s"] > 0 and row["none"]["comm_busy_s"] is None
        assert row["cross"]["comm_busy_s"] > 0 and ratios[f"overlap_{m}_cross_vs_sync"] > 0
        assert row["bound_s"] >= row["compute_s"] > 0 and row["cpu_floor_s"] > 0
        assert row["none"]["comm_inline_s"] > 0 and row["async"]["comm_inline_s"] is None
    assert (tmp_path / "overlap_quick.png").stat().st_size > 0
    assert (tmp_path / "overlap_quick_timeline.png").stat().st_size > 0
    assert "machine:" in r.stdout


@pytest.mark.skipif(why_unavailable() is not None, reason=f"emulated cluster: {why_unavailable()}")
def test_two_nodes_run_two_ranks_under_their_own_name(tmp_path: Path) -> None:
    """--nodes 2 (a core per rank on a 2-core machine): two ranks on the 3-node emulated cluster, written
    under --name."""
    r = subprocess.run([sys.executable, "-m", "bench.overlap", "--quick", "--nodes", "2", "--methods",
                        "torus", "--name", "overlap_two", "--results-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "overlap_two.json").read_text())
    assert doc["config"]["nodes"] == 2 and doc["ratios"]["overlap_torus_vs_sync"] > 0
    assert "Topology: 2 nodes of 1 ranks" in r.stderr and "Topology: 3 nodes" not in r.stderr
    assert (tmp_path / "overlap_two.png").stat().st_size > 0


def test_help_explains_itself() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.overlap", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--rates" in r.stdout and "async" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.overlap", "--methods", "ring"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "allreduce, torus, naive_ag, hitopk" in bad.stderr
    for args, why in ((["--nodes", "1"], "--nodes 1: needs at least 2"),
                      (["--name", "../x"], "--name '../x': lower-case letters")):
        bad = subprocess.run([sys.executable, "-m", "bench.overlap", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr


def test_ratio_names_and_bounds_from_measured_steps() -> None:
    """The issue's names at 1 Gbit/s (no suffix) and suffixed rates; bound = max(compute, comm)."""
    def run(steps: list[float], busy: list[float], cpu: list[float]) -> dict:
        return {"step_s": steps, "cpu_s": cpu, "cpu_all_ranks_s": [3 * c for c in cpu], "comm_busy_s": busy,
                "comm_inline_s": [] if busy else [0.05]}

    res = {"compute/hitopk": run([0.10, 0.12, 0.11], [], [0.1] * 3),
           "hitopk/none": run([0.30, 0.32, 0.31], [], [0.1] * 3),
           "hitopk/async": run([0.20, 0.21, 0.22], [0.18, 0.19, 0.17], [0.1] * 3),
           "hitopk/cross": run([0.25, 0.24, 0.26], [0.2] * 3, [0.1] * 3)}
    table, ratios = analyse({"1": {"r50stack": res}, "0.2": {"r50stack": res}}, ["hitopk"], ["r50stack"], 2)
    row = table["1"]["r50stack"]["hitopk"]
    assert row["compute_s"] == 0.11 and row["comm_s"] == 0.18 and row["bound_s"] == 0.18
    assert row["best_mode"] == "async"  # the headline ratio is the better overlap mode's
    assert ratios["overlap_hitopk_vs_sync"] == ratios["overlap_hitopk_vs_sync_0.2gbit"] == 0.31 / 0.21
    assert ratios["overlap_hitopk_cross_vs_sync"] == 0.31 / 0.25
    assert ratios["overlap_vs_bound_hitopk"] == 0.18 / 0.21
    assert row["cpu_floor_s"] == pytest.approx(0.15)
    assert ratios["overlap_vs_machine_bound_hitopk"] == 0.18 / 0.21
    assert row["model_pieces"] == 1 and row["backward_share"] == pytest.approx(2 / 3)  # unmeasured: defaults
    # the model's ceiling from the measured forward share and bucket count (the formulas restated by hand;
    # tests/test_cost_model.py checks them against an event simulation)
    res["compute/hitopk"]["fwd_s"] = [0.04, 0.04, 0.05]
    res["hitopk/none"]["timeline"] = {"buckets": [{"bucket": i} for i in range(4)]}
    table, ratios = analyse({"1": {"r50stack": res}}, ["hitopk"], ["r50stack"], 2)
    row = table["1"]["r50stack"]["hitopk"]
    f, b, comm, n = 0.04, 0.11 - 0.04, 0.18, 4
    asyn, cross = f + max(b + comm / n, b / n + comm), max(f + b + comm / n, comm)
    assert row["model_pieces"] == 4 and row["model"]["async"] == pytest.approx(asyn)
    assert ratios["overlap_hitopk_model_ceiling"] == pytest.approx(0.31 / min(asyn, cross))
    assert ratios["overlap_hitopk_async_vs_model"] == pytest.approx(asyn / 0.21)
    res["hitopk/cross"]["step_s"] = [0.15, 0.16, 0.14]
    table, ratios = analyse({"1": {"r50stack": res}}, ["hitopk"], ["r50stack"], 2)
    assert table["1"]["r50stack"]["hitopk"]["best_mode"] == "cross"
    assert ratios["overlap_hitopk_vs_sync"] == 0.31 / 0.15
    assert ratios["overlap_vs_bound_hitopk"] == 0.18 / 0.15
