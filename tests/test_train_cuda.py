"""The trainer end to end on a real GPU: ``python -m trainer`` on the digits data set with everything a
GPU run turns on at once -- the CUDA-stream prefetcher, device augmentation, fp16 autocast with its
GradScaler, an NCCL process group with a sparse comm hook on the fp16 wire, LARS with PTO -- stopped
mid-run and resumed from its checkpoint (the resume's warm-up step runs under the same autocast).

The same flow runs on the CPU (gloo, bf16 autocast, no prefetcher stream) so that a CPU-only CI proves
the test itself; the CUDA run is the one that needs the hardware and skips without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import free_port, subprocess_env
from trainer import checkpoint

# upper bounds that only catch a hang: the bf16 run takes ~3 min alone on 2 cores, several times that
# beside the rest of a parallel suite or a busy machine
HANG_S = 1800


def _records(out: str, event: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == event]


def _digits_run(digits: dict, out: str, device: str, amp: str,
                extra: list[str]) -> subprocess.CompletedProcess:
    # one rank under torchrun: NCCL (CUDA) or gloo (CPU) process group, DDP and the hooks all real
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "trainer", "--recipe", "digits",
           "--data", digits["train"], "--val-data", digits["val"], "--cache", digits["cache"],
           "--device", device, "--amp", amp, "--comm", "hitopk", "--density", "0.1", "--fp16-comm",
           # LARS at the DAWNBench recipe's trust coefficient (lr 0.1 with the default 0.001 barely moves)
           "--optimizer", "lars", "--pto", "--lr", "2.0", "--trust-coefficient", "0.01",
           "--epochs", "4", "--checkpoint-every", "20",
           "--out", out, "--no-progress", *extra]
    return subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=HANG_S)


def _stop_and_resume(digits: dict, tmp_path, device: str, amp: str) -> list[dict]:
    out = str(tmp_path / f"run-{device}")
    first = _digits_run(digits, out, device, amp, ["--stop-at-step", "30"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert checkpoint.resolve("auto", out).endswith("step00000030")
    second = _digits_run(digits, out, device, amp, ["--resume", "auto"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    epochs = _records(out, "epoch")
    assert sorted({e["epoch"] for e in epochs}) == [0, 1, 2, 3]
    last = [e for e in epochs if e["epoch"] == 3][-1]
    assert last["val_samples"] == 359 and last["cache_misses"] == 0
    assert last["val_top1"] >= 0.85, epochs  # a trained model, not only a run that did not crash
    starts = _records(out, "start")
    assert len(starts) == 2 and all(s["device"].startswith(device) for s in starts)
    # selector auto (the default): MSTopK on the CPU, torch.topk on CUDA, and the start record says which
    assert {s["selector"] for s in starts} == {"mstopk" if device == "cpu" else "exact"}
    return epochs


@pytest.mark.slow
@pytest.mark.timeout(2 * HANG_S + 300)
def test_the_same_run_on_the_cpu(digits_data: dict, tmp_path) -> None:
    """The CUDA test's flow with gloo and bf16 autocast: it proves the test where CI has no GPU."""
    _stop_and_resume(digits_data, tmp_path, "cpu", "bf16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.timeout(2 * HANG_S + 300)
def test_trainer_stops_and_resumes_on_one_gpu_with_fp16_amp(digits_data: dict, tmp_path) -> None:
    """Prefetcher streams, device augmentation, fp16 AMP + GradScaler, NCCL + HiTopK on the fp16 wire,
    LARS + PTO, a checkpoint and its resume: the whole GPU path of the trainer, trained to accuracy."""
    _stop_and_resume(digits_data, tmp_path, "cuda", "fp16")
