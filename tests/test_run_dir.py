"""Runs that cannot corrupt each other: the --out lock, the fresh-start refusal and --overwrite, a
pruner that only deletes its own run's checkpoints (never what `latest` names), durable writes,
and ranks that die with their launcher (PR_SET_PDEATHSIG). Real processes, real signals, real files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from datacache.config import ConfigError
from trainer import checkpoint
from trainer.comm.state import HookState
from trainer.rundir import RunLock, check_fresh_start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(k, None)
    return env


def _save(out: str, step: int, pruner: checkpoint.Pruner | None = None) -> str:
    model = torch.nn.Linear(2, 2)
    return checkpoint.save(out, rank=0, pos=checkpoint.Position(1, 0, step), model=model,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=None,
                           comm_state=HookState().state_dict(), schedules={}, config_json="{}", world_size=1,
                           pruner=pruner)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "Z" not in state.split()[1]  # a zombie has exited


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_second_run_on_a_locked_out_dir_is_refused_until_the_holder_dies(tmp_path) -> None:
    out = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from trainer.rundir import RunLock
            RunLock({out!r}).acquire()
            print("locked", flush=True)
            time.sleep(120)
        """)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid} holds"):
            RunLock(out).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel drops a flock however its holder dies
        holder.wait(timeout=30)
    with RunLock(out), pytest.raises(ConfigError, match="in use by another run"):
        RunLock(out).acquire()  # a second descriptor, even in one process
    RunLock(out).acquire().release()


def test_a_fresh_run_over_checkpoints_is_refused_and_overwrite_deletes_only_the_runs_files(tmp_path) -> None:
    out = str(tmp_path)
    check_fresh_start(out, resuming=False, overwrite=False)  # empty: fine
    _save(out, 22)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "README").write_text("also mine")
    with pytest.raises(ConfigError, match=r"already holds checkpoints.*--resume auto.*--overwrite"):
        check_fresh_start(out, resuming=False, overwrite=False)
    check_fresh_start(out, resuming=True, overwrite=False)  # a resume continues it
    assert os.path.isdir(tmp_path / "checkpoints" / "step00000022")
    check_fresh_start(out, resuming=False, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "notes.txt"]
    assert os.listdir(tmp_path / "checkpoints") == ["README"]


def test_pruning_keeps_other_runs_checkpoints_and_what_latest_names(tmp_path) -> None:
    """The reported failure: run 1 left step00000100; run 2 (same --out) with keep=1 saved steps 10
    and 20 and the name-sorted pruner deleted run 2's newest (`latest`) checkpoint."""
    out = str(tmp_path)
    _save(out, 100)  # another run's
    pruner = checkpoint.Pruner(os.path.join(out, "checkpoints"), keep=1)
    _save(out, 10, pruner)
    last = _save(out, 20, pruner)
    assert checkpoint.resolve("auto", out) == last and os.path.exists(os.path.join(last, "train.pt"))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step00000020", "step00000100"]
    # what `latest` names survives even when it is this run's oldest
    root = os.path.join(out, "checkpoints")
    pruner.written = ["step00000020", "step00000100", "step00000030"]
    os.makedirs(os.path.join(root, "step00000030"))
    assert pruner.prune() == ["step00000100"]
    assert sorted(os.listdir(root)) == ["latest", "step00000020", "step00000030"]


def test_checkpoint_files_and_directories_are_fsynced_before_latest_moves(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:  # records which file or directory was synced, then syncs it
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", os.path.abspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    d = os.path.abspath(_save(str(tmp_path), 5))
    latest = os.path.abspath(os.path.join(tmp_path, "checkpoints", "latest"))
    moved = events.index(("replace", latest))
    before = [path for kind, path in events[:moved] if kind == "fsync"]
    assert any(p.startswith(os.path.join(d, "train.pt.tmp")) for p in before)
    assert any(p.startswith(os.path.join(d, "comm_rank0.pt.tmp")) for p in before)
    assert d in before  # the directory entries of the renamed files
    assert ("fsync", os.path.dirname(latest)) in events[moved:]  # and latest's own rename


_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""
_CHILD = """
import time
from trainer.distenv import die_with_parent
if {arm}:
    assert die_with_parent()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("arm", [True, False])
def test_a_rank_exits_when_its_launcher_is_killed(arm: bool) -> None:
    """A launcher-like parent starts a rank-like child in its own session (as torchrun puts each
    worker in its own process group); SIGKILL of the parent must take the child with it when the
    child armed PR_SET_PDEATHSIG (the unarmed control shows the orphan the bug report saw)."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(child=_CHILD.format(arm=arm))],
                              env=_env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = int(parent.stdout.readline())
    try:
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        if arm:
            assert _wait_gone(child_pid), "the child outlived its killed parent"
        else:
            time.sleep(1.0)
            assert _alive(child_pid)  # without it: an orphan that goes on running
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def test_kill_9_of_torchrun_takes_its_ranks_down(digits_data: dict, tmp_path) -> None:
    """The reported failure, end to end: a real torchrun running the trainer is SIGKILLed; its rank
    (in its own process group, so not reached by the signal) must not go on training."""
    from tests.dist_utils import free_port

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer", "--recipe", "digits",
           "--data", digits_data["train"], "--cache", digits_data["cache"], "--device", "cpu",
           "--threads", "1", "--epochs", "500", "--width", "4", "--resolution", "16", "--workers", "0",
           "--no-progress", "--val-every", "0", "--out", out]
    launcher = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        metrics = os.path.join(out, "metrics.jsonl")
        while time.monotonic() < deadline and not os.path.exists(metrics):  # the rank is training
            assert launcher.poll() is None, "torchrun ended early"
            time.sleep(0.2)
        assert os.path.exists(metrics)
        ranks = _children(launcher.pid)
        assert ranks and all(_alive(p) for p in ranks)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        assert all(_wait_gone(p) for p in ranks), "a rank outlived its killed torchrun"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in ranks:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
