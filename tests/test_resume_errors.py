"""Resume failures name the file and say what to do; the whole run is validated before training;
a re-used --out is refused instead of mixing two runs. Real trainer runs (``python -m trainer``, one
rank, and torchrun with two ranks), real checkpoint files damaged the way disks and people do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from datacache.config import ConfigError
from tests.dist_utils import free_port, subprocess_env
from trainer import checkpoint
from trainer.train_config import make_config


def _args(digits: dict, out: str, *extra: str) -> list[str]:
    return ["--recipe", "digits", "--data", digits["train"], "--cache", digits["cache"], "--device", "cpu",
            "--threads", "1", "--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "32", "--width", "4",
            "--resolution", "16", "--val-every", "0", "--workers", "0", "--no-progress", "--out", out, *extra]


def _train(digits: dict, out: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *_args(digits, out, *extra)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("datacache-train: error: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained(digits_data: dict, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finished 2-epoch run with a mid-epoch checkpoint too (checkpoint every 2 steps, keep all)."""
    out = str(tmp_path_factory.mktemp("resume") / "run")
    proc = _train(digits_data, out, "--checkpoint-every", "2", "--keep-checkpoints", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def _copy(trained: str, tmp_path) -> str:
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    return out


def test_running_the_same_command_twice_is_refused_not_mixed(digits_data: dict, trained: str,
                                                             tmp_path) -> None:
    out = _copy(trained, tmp_path)
    before = sorted(os.listdir(os.path.join(out, "checkpoints")))
    line = _one_error_line(_train(digits_data, out))
    assert "already holds checkpoints" in line and "--resume auto" in line and "--overwrite" in line
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == before  # nothing touched
    done = _train(digits_data, out, "--resume", "auto")  # continues it (already finished: no epochs left)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = _train(digits_data, out, "--overwrite", "--keep-checkpoints", "1")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step00000006"]


def test_truncated_train_pt_names_the_file(digits_data: dict, trained: str, tmp_path) -> None:
    out = _copy(trained, tmp_path)
    d = checkpoint.resolve("auto", out)
    path = os.path.join(d, "train.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    line = _one_error_line(_train(digits_data, out, "--resume", "auto"))
    assert f"{path}: not a readable checkpoint file" in line and "--resume" in line and "--overwrite" in line


def test_random_bytes_in_comm_rank1_names_the_file(trained: str, tmp_path) -> None:
    out = _copy(trained, tmp_path)
    d = checkpoint.resolve("auto", out)
    bad = os.path.join(d, "comm_rank1.pt")
    with open(bad, "wb") as f:
        f.write(os.urandom(4096))
    with pytest.raises(ConfigError) as err:
        checkpoint.load(d, rank=1, world_size=2)
    msg = str(err.value)
    assert msg.startswith(f"{bad}: not a readable checkpoint file") and "\n" not in msg
    checkpoint.load(d, rank=0, world_size=2)  # rank 0's own file is fine
    # a readable file that is not a comm state: refused as well, naming it
    import torch

    torch.save({"step": "x"}, bad)
    with pytest.raises(ConfigError, match=rf"{bad}: not a comm state"):
        checkpoint.load(d, rank=1, world_size=2)


@pytest.mark.parametrize(("flags", "what"), [(("--optimizer", "lars"), "optimizer"),
                                             (("--width", "8"), "width"),
                                             (("--model", "small_resnet"), "model")])
def test_another_optimizer_or_model_is_refused_naming_train_pt(digits_data: dict, trained: str, tmp_path,
                                                               flags: tuple[str, str], what: str) -> None:
    out = _copy(trained, tmp_path)
    d = checkpoint.resolve("auto", out)
    line = _one_error_line(_train(digits_data, out, "--resume", d, "--epochs", "3", *flags))
    assert f"{d}/train.pt: the checkpoint was made with another {what}" in line
    assert f"resume with --{what}" in line


def test_another_world_size_mid_epoch_re_plans_the_rest_of_the_epoch(digits_data: dict, trained: str,
                                                                      tmp_path) -> None:
    """1 rank stopped at step 2 of 3, resumed under torchrun on 2: the epoch's untrained samples are
    re-planned over the 2 ranks, the global batch kept (said in the log); the run finishes."""
    out = _copy(trained, tmp_path)
    mid = os.path.join(out, "checkpoints", "step00000002")  # epoch 1, step 2 of 3: mid-epoch
    assert checkpoint.load(mid, 0, 1).pos.step == 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer",
           *_args(digits_data, out, "--resume", mid)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 1 was planned for 1 rank: its " in proc.stdout
    assert "untrained samples re-planned over 2 ranks, 16 per rank (global batch 32 kept)" in proc.stdout


def test_a_batch_phase_that_cannot_run_fails_at_start(digits_data: dict, tmp_path) -> None:
    out = str(tmp_path / "run")
    line = _one_error_line(_train(digits_data, out, "--batch-size", "0:32,1:5000"))
    assert "batch_size 5000 (schedule epoch 1: the run's epoch 2" in line and "training samples" in line
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # refused before any training


def test_validate_run_checks_every_phase_against_ranks_and_data() -> None:
    cfg = make_config(batch_size="0:64,5:96,9:1000", epochs=10)
    cfg.validate_run(1, 2000)
    cfg.validate_run(2, 2000)
    with pytest.raises(ConfigError, match=r"batch_size 64 .*does not split over 3 ranks"):
        cfg.validate_run(3, 2000)
    with pytest.raises(ConfigError, match=r"batch_size 1000 \(schedule epoch 9: the run's epoch 10"):
        cfg.validate_run(2, 998)  # 499 per rank < 500
    make_config(batch_size="0:64,20:1000", epochs=10).validate_run(1, 100)  # a phase that never runs
    with pytest.raises(ConfigError, match="batch_size 96"):
        make_config(batch_size="96", batch_per_rank=True, epochs=1).validate_run(4, 300)


def test_other_training_files_mid_epoch_or_other_classes_are_refused(digits_data: dict, trained: str,
                                                                     tmp_path) -> None:
    """The checkpoint records the training split (count, class names, files in order): mid-epoch a
    dataset with one file fewer, or the same count with one file renamed, would continue another sample
    order; at any point other class folders would load a head trained for other classes."""
    out = _copy(trained, tmp_path)
    mid = os.path.join(out, "checkpoints", "step00000002")
    fewer = str(tmp_path / "fewer")
    shutil.copytree(digits_data["train"], fewer)
    cls = sorted(os.listdir(fewer))[0]
    victim = sorted(os.listdir(os.path.join(fewer, cls)))[0]
    os.remove(os.path.join(fewer, cls, victim))
    line = _one_error_line(_train({**digits_data, "train": fewer}, out, "--resume", mid))
    assert f"{mid}/train.pt: saved mid-epoch on " in line and "--data" in line
    renamed = str(tmp_path / "renamed")
    shutil.copytree(digits_data["train"], renamed)
    os.rename(os.path.join(renamed, cls, victim), os.path.join(renamed, cls, "zz_" + victim))
    line = _one_error_line(_train({**digits_data, "train": renamed}, out, "--resume", mid))
    assert "(other files or another order)" in line
    moved = str(tmp_path / "moved" / "train")  # the same files elsewhere: the same split, it resumes
    shutil.copytree(digits_data["train"], moved)
    out_b = _copy(trained, tmp_path / "b")
    ok = _train({**digits_data, "train": moved}, out_b, "--resume",
                os.path.join(out_b, "checkpoints", "step00000002"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    end = os.path.join(out, "checkpoints", "step00000003")  # epoch 1's end
    assert checkpoint.load(end, 0, 1).pos.step == 0
    other = str(tmp_path / "other_classes")
    shutil.copytree(digits_data["train"], other)
    os.rename(os.path.join(other, cls), os.path.join(other, "z_" + cls))
    line = _one_error_line(_train({**digits_data, "train": other}, out, "--resume", end))
    assert "trained on other class folders" in line


def test_fingerprint_is_independent_of_the_root_and_follows_files_order_and_labels() -> None:
    a = checkpoint.dataset_fingerprint(["cat", "dog"], [("cat/1.png", 0), ("dog/2.png", 1)], 2)
    assert a == checkpoint.dataset_fingerprint(("cat", "dog"), iter([("cat/1.png", 0), ("dog/2.png", 1)]), 2)
    assert a["files"] != checkpoint.dataset_fingerprint(["cat", "dog"], [("dog/2.png", 1), ("cat/1.png", 0)],
                                                         2)["files"]
    assert a["files"] != checkpoint.dataset_fingerprint(["cat", "dog"], [("cat/1.png", 1), ("dog/2.png", 1)],
                                                         2)["files"]
    assert a["classes"] != checkpoint.dataset_fingerprint(["cat", "cow"], [], 0)["classes"]


def test_epoch_end_resume_on_more_ranks_re_splits_the_residuals(digits_data: dict, tmp_path) -> None:
    """1 rank with NaiveAG (residuals in its comm state) -> torchrun with 2 ranks at the epoch end: the
    residuals are re-split over the new ranks (logged), not dropped."""
    out = str(tmp_path / "run")
    first = _train(digits_data, out, "--epochs", "1", "--comm", "naive_ag", "--density", "0.05")
    assert first.returncode == 0, first.stderr[-2000:]
    d = checkpoint.resolve("auto", out)
    saved = checkpoint.read_comm_states(d, 1)[0]["ef"]
    assert saved["residuals"]  # something is owed
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer",
           *_args(digits_data, out, "--resume", "auto", "--comm", "naive_ag", "--density", "0.05")]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = proc.stdout + proc.stderr
    assert "error-feedback residuals re-split, their sum kept" in both and "dropping residual" not in both


@pytest.mark.parametrize("stop,position", [(2, (0, 2, 2)), (3, (1, 0, 3))])
def test_stop_at_step_leaves_a_checkpoint_there_and_resume_auto_finishes(digits_data: dict, tmp_path,
                                                                         stop: int, position) -> None:
    """--stop-at-step N: the run ends after global step N with a checkpoint at N (mid-epoch or an
    epoch end), and --resume auto trains the rest: the 2 x 3 steps of the run, once."""
    out = str(tmp_path / "run")
    first = _train(digits_data, out, "--stop-at-step", str(stop))
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"stopped after global step {stop} (--stop-at-step {stop}), checkpoint written" in first.stdout
    d = checkpoint.resolve("auto", out)
    pos = checkpoint.load(d, 0, 1).pos
    assert (pos.epoch, pos.step, pos.global_step) == position
    again = _one_error_line(_train(digits_data, out, "--resume", "auto", "--stop-at-step", str(stop)))
    assert f"--stop-at-step {stop}: {d} is already at global step {stop}; pass a later step" in again
    rest = _train(digits_data, out, "--resume", "auto")
    assert rest.returncode == 0, rest.stderr[-2000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f]
    epochs = [r for r in recs if r["event"] == "epoch"]
    # an epoch record counts the steps its process ran: a stop mid-epoch leaves its first part unrecorded
    unrecorded = position[1]
    assert [r["epoch"] for r in epochs] == [0, 1] and sum(r["steps"] for r in epochs) + unrecorded == 6
    assert [r["global_step"] for r in recs if r["event"] == "stop"] == [stop]
