"""End to end on real data: the digits renderer, a short digits run under torchrun (2 ranks), a sweep
whose second run starts on a warm cache, and checkpoint resolution."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from datacache.config import ConfigError
from tests.dist_utils import free_port, subprocess_env
from trainer import checkpoint
from trainer.comm.state import HookState
from trainer.digits import render


def _records(out: str, event: str = "epoch") -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


def test_digits_render_holds_the_datasets_pixels(digits_data: dict, tmp_path) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    files = {}
    for split in ("train", "val"):
        for c in os.listdir(digits_data[split]):
            for name in os.listdir(os.path.join(digits_data[split], c)):
                files[int(name.split(".")[0])] = (split, int(c), os.path.join(digits_data[split], c, name))
    assert sorted(files) == list(range(1797))
    val = [i for i, (s, _, _) in files.items() if s == "val"]
    assert len(val) == 359 and set(np.bincount(d.target[val])) <= {35, 36, 37}  # 20 % of every class
    for i in (0, 5, 100, 1796):
        split, label, path = files[i]
        assert label == d.target[i]
        px = np.asarray(Image.open(path))
        assert px.shape == (32, 32)  # nearest-neighbour x4: each source pixel is a 4x4 block
        want = 255 - np.rint(d.images[i] * 255 / 16).astype(np.uint8)
        assert np.array_equal(px, np.kron(want, np.ones((4, 4), np.uint8)))
    # rendering again leaves identical files alone (their mtimes, and so the cache, stay valid)
    out = str(tmp_path / "again")
    render(out)
    first = os.path.join(out, "train", "0", sorted(os.listdir(os.path.join(out, "train", "0")))[0])
    mtime = os.stat(first).st_mtime_ns
    render(out)
    assert os.stat(first).st_mtime_ns == mtime


@pytest.mark.slow
def test_short_digits_run_under_torchrun_reaches_a_sane_accuracy(digits_data: dict, tmp_path) -> None:
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer", "--recipe", "digits", "--data",
           digits_data["train"], "--val-data", digits_data["val"], "--cache", digits_data["cache"],
           "--device", "cpu", "--threads", "1", "--epochs", "4", "--out", out, "--no-progress"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = _records(out)
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    assert epochs[-1]["val_top1"] >= 0.85 and epochs[-1]["val_samples"] == 359  # every val image, once
    assert epochs[-1]["loss"] < epochs[0]["loss"] and epochs[-1]["cache_misses"] == 0
    assert "epoch 4/4" in proc.stdout and "val top1" in proc.stdout
    start = _records(out, "start")[0]
    assert start["world_size"] == 2 and start["config"]["recipe"] == "digits"
    assert checkpoint.resolve("auto", out).endswith("step00000088")  # 4 epochs x 22 steps of 2 x 32


@pytest.mark.slow
def test_sweep_under_torchrun_second_run_starts_warm(digits_data: dict, tmp_path) -> None:
    out = str(tmp_path / "sweep")
    cache = "lmdb://" + str(tmp_path / "cold-cache")  # run 1 fills it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer", "sweep", "--grid", "lr=0.05,0.1",
           "--recipe", "digits",
           "--data", digits_data["train"], "--cache", cache, "--device", "cpu", "--epochs", "1",
           "--steps-per-epoch", "4", "--width", "4", "--resolution", "16", "--val-every", "0", "--out", out,
           "--no-progress", "--workers", "0", "--amp", "bf16"]  # bf16 autocast on the CPU too
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = [_records(os.path.join(out, d))[0] for d in sorted(os.listdir(out))]
    assert [r["lr"] > 0 for r in first] == [True, True] and len(first) == 2
    # 2 ranks x 4 steps x 32 samples
    assert first[0]["cache_misses"] == 4 * 64 and first[0]["decoded"] == 4 * 64  # run 1: cold
    assert first[1]["cache_misses"] == 0 and first[1]["cache_hits"] == 4 * 64    # run 2: warm from its start
    assert "sweep summary" in proc.stdout and "samples/s" in proc.stdout


def test_checkpoint_resolution_and_refusals(tmp_path) -> None:
    out = str(tmp_path)
    assert checkpoint.resolve("", out) is None and checkpoint.resolve("auto", out) is None
    with pytest.raises(ConfigError, match="no checkpoint there"):
        checkpoint.resolve(str(tmp_path / "nope"), out)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = {"lr": 0.1, "global_batch": 64, "seed": 0, "resolution": 32, "comm_method": "hitopk",
             "steps_in_epoch": 10}
    d = checkpoint.save(out, rank=0, pos=checkpoint.Position(1, 4, 14), model=model, optimizer=opt,
                        scaler=None, comm_state=HookState(step=14).state_dict(), schedules=sched,
                        config_json="{}", world_size=2)
    assert checkpoint.resolve("auto", out) == d and checkpoint.resolve(d + "/train.pt", out) == d
    loaded = checkpoint.load(d, rank=0, world_size=2)
    assert (loaded.pos.epoch, loaded.pos.step, loaded.pos.global_step) == (1, 4, 14)
    assert loaded.comm is not None and loaded.comm["step"] == 14
    checkpoint.check_resumable(loaded, {**sched, "lr": 0.05}, d)  # the LR is recomputed: fine
    pruner = checkpoint.Pruner(str(tmp_path / "checkpoints"), keep=2)
    for step in (20, 30, 40):  # keep=2: this run's oldest go once `latest` moved past them
        last = checkpoint.save(out, rank=0, pos=checkpoint.Position(2, 0, step), model=model, optimizer=opt,
                               scaler=None, comm_state=HookState().state_dict(), schedules=sched,
                               config_json="{}", world_size=2, pruner=pruner)
    # step00000014 was not written by this pruner's run: it stays
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step00000014", "step00000030",
                                                            "step00000040"]
    assert checkpoint.resolve("auto", out) == last
    with pytest.raises(ConfigError, match="schedules differ"):
        checkpoint.check_resumable(loaded, {**sched, "steps_in_epoch": 12}, d)
    # a re-planned rest of the epoch (another world size) has its own step count; nothing else may differ
    checkpoint.check_resumable(loaded, {**sched, "steps_in_epoch": 12}, d, replanned=True)
    with pytest.raises(ConfigError, match="schedules differ"):
        checkpoint.check_resumable(loaded, {**sched, "resolution": 64}, d, replanned=True)
