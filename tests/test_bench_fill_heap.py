"""``python -m bench.fill_heap``: the smoke run's JSON and PNG (every ratio named and finite, both fills
really decoded every file into their own LMDB) and the argument checks. Never a timing assert."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
RATIOS = {"fill_kept_vs_plain", "fill_cpu_kept_vs_plain", "fill_faults_plain_per_kept"}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.fill_heap", *args], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=600)


def test_quick_run_writes_every_ratio(tmp_path) -> None:
    r = _run(["--quick", "--out-dir", str(tmp_path)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "machine: " in r.stdout
    doc = json.loads((tmp_path / "fill_heap_quick.json").read_text())
    assert (tmp_path / "fill_heap_quick.png").stat().st_size > 0
    assert set(doc) == {"machine", "config", "results", "ratios", "notes"}
    assert set(doc["ratios"]) == RATIOS
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in doc["ratios"].values())
    res, n = doc["results"], doc["config"]["images"]
    for mode in ("kept", "plain"):
        (run,) = res["runs"][mode]
        said = run["said"]
        assert said.startswith("warmed lmdb://") and f"{n} samples, decoded {n}, skipped 0" in said, said
        assert run["minor_faults"] > 0 and run["user_s"] > 0
    assert set(res["pair_ratios"]) == RATIOS


def test_bad_arguments_exit_2_and_say_which() -> None:
    r = _run(["--rounds", "0"])
    assert r.returncode == 2 and "--rounds" in r.stderr
