"""Concurrent demos and the demo's report against a cache that was warm before the run.

* two real ``datacache demo`` processes started at once on one fresh dataset/cache dir both succeed
  (the generated dataset is published by rename; the own LMDB cache is cleared only under a lock);
* :func:`datacache.devtools.synth.publish_dir`: a lost race keeps the winner's tree, a failed build leaves
  nothing behind, and only the process's own temp directory is ever removed;
* a pre-warmed cache (kept LMDB cache) is reported as such, with no cold/warm speed-up.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from datacache.demo import DemoConfig, run_demo
from datacache.devtools import synth

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--images", "120", "--classes", "4", "--gen-size", "320", "240", "--epochs", "2", "--workers", "0",
         "--batch-size", "16", "--no-progress", "--t1-dir", "none"]


def test_two_demos_started_at_once_on_a_fresh_dir_both_succeed(tmp_path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-m", "datacache.cli", "demo", *SMALL], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out + err
        assert "epoch 2:" in out
    demo = tmp_path / "xdg" / "datacache" / "demo" / "datasets"
    # one published tree, no temp directory left over, every class complete
    assert os.listdir(demo) == ["imagefolder-4x30-320x240"]
    tree = demo / "imagefolder-4x30-320x240"
    assert sum(len([f for f in os.listdir(tree / c) if f.endswith(".JPEG") and not f.startswith("real_")])
               for c in os.listdir(tree)) == 120


def test_publish_dir_lost_race_keeps_the_winner_and_removes_only_its_temp(tmp_path) -> None:
    root = str(tmp_path / "ds")

    def build_and_lose(tmp: str) -> None:
        with open(os.path.join(tmp, "mine"), "w") as f:
            f.write("loser")
        os.mkdir(root)  # another process publishes meanwhile
        with open(os.path.join(root, "theirs"), "w") as f:
            f.write("winner")

    assert synth.publish_dir(root, build_and_lose) is False
    assert os.listdir(root) == ["theirs"]
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # the loser's temp dir is gone, nothing else touched
    # an existing tree is reused as it is: build is not even called
    assert synth.publish_dir(root, lambda tmp: pytest.fail("built again")) is False


def test_publish_dir_failed_build_leaves_no_partial_tree(tmp_path) -> None:
    (tmp_path / "neighbour").write_text("keep")
    root = str(tmp_path / "ds")

    def broken(tmp: str) -> None:
        with open(os.path.join(tmp, "half"), "w") as f:
            f.write("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        synth.publish_dir(root, broken)
    assert sorted(os.listdir(tmp_path)) == ["neighbour"]
    assert synth.ensure_imagefolder(root, classes=2, per_class=3, size=(64, 48)) is True
    assert sorted(os.listdir(root)) == ["c000", "c001"] and len(os.listdir(os.path.join(root, "c001"))) == 3


def test_report_is_honest_for_a_cache_that_was_warm_before_the_run(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = DemoConfig(images=24, classes=3, gen_size=(160, 120), epochs=2, workers=0, batch_size=8,
                     progress=False, t1_dir=None)
    cold = run_demo(cfg)
    out = capsys.readouterr().out
    assert cold[0].stats["hit_ratio"] == 0.0 and "the first (cold) epoch" in out and "x epoch 1" in out
    assert "was not cold" not in out
    cfg.keep_cache = True  # the same cache, already full: epoch 1 is all hits
    warm = run_demo(cfg)
    out = capsys.readouterr().out
    assert warm[0].stats["hit_ratio"] == 1.0 and warm[0].stats["decoded"] == 0
    assert "epoch 1 was not cold: 100% of its samples were already cached" in out
    assert "(cold)" not in out and "x epoch 1" not in out and "warm epochs:" in out
