"""``bench.gpu_input`` (issue 38): its CPU smoke mode runs every variant through the same code the GPU run
uses (CUDA events aside) and writes its JSON and PNG; ``bench.gpu`` puts it first, with the prefetcher and
top-k benchmarks, so one call on a GPU gives them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_mode_runs_every_variant(tmp_path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # (the generated folder lands there)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_input", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_input_smoke.json").read_text())
    assert (out / "gpu_input_smoke.png").stat().st_size > 0
    res = doc["results"]
    for name in ("gpu_alone", "imagefolder", "cold", "warm_transforms", "warm_fast"):
        r = res[name]
        assert r["images_per_s"] > 0 and 0 < r["gpu_busy_fraction"] <= 1, name
        assert 0 <= r["data_wait_fraction"] < 1, name
        gap = r["idle_gap_ms"]  # the timeline between steps
        assert 0 <= gap["mean"] <= gap["max"] and gap["p90"] <= gap["max"], (name, gap)
    assert res["imagefolder"]["num_workers"] in (0, 2) and set(res["imagefolder"]["tried"]) == {"0", "2"}
    # the cold epoch decoded and filled; the warm runs read the cache only (no decode)
    assert res["cold"]["cache"]["misses"] > 0 and res["warm_fast"]["cache"]["misses"] == 0
    assert res["images"] == doc["config"]["images"] >= 32
    for key in ("input_warm_fast_vs_imagefolder_64", "gpu_busy_warm_fast_64", "gpu_busy_warm_transforms_64",
                "input_cold_vs_imagefolder_64", "imagefolder_vs_gpu_alone_64"):
        assert doc["ratios"][key] > 0, key
    assert any("input_cold_vs_imagefolder_64" in n for n in doc["notes"])


def test_bench_gpu_runs_it_first_with_the_prefetcher_and_topk(tmp_path) -> None:
    from bench import gpu

    names = [c.name for c in gpu.build_checks()]
    assert names[:4] == ["gpu-input", "train-gpu", "topk", "cuda-tests"]
    first = {c.name: c for c in gpu.build_checks()}
    # the first three fit one call's default budget with room for the CUDA tests
    assert sum(first[n].expect_s for n in names[:4]) <= gpu.DEFAULT_BUDGET_S
    assert first["gpu-input"].writes == ("gpu_input_gpu.json", "gpu_input_gpu.png")
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert "gpu-input" in proc.stdout and "bench.gpu_input" in proc.stdout, proc.stdout[-2000:]
