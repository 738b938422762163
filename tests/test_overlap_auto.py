"""``--overlap auto``: synchronous hooks and the communication thread timed on the first steps, the faster
kept (trainer/comm/overlap_auto.py). The schedule and the decision rule against a scripted clock; on 4
real gloo ranks (2 nodes x 2) the parameters equal the synchronous run's bit for bit whatever is chosen
and every rank chooses the same from the mean of the ranks' medians; the trainer logs and records it."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from tests.test_comm_algorithms import from_plain
from tests.test_comm_overlap import CAP_MB, _batch, _model
from trainer.comm.comm_config import CommConfig
from trainer.comm.overlap_auto import OverlapTuner, decide
from trainer.comm.state import HookState
from trainer.train_config import ConfigError, make_config

CPU = torch.device("cpu")


class ScriptedClock:
    """``before_step`` reads the clock, then ``after_step``: each step lasts ``durations[mode]`` seconds,
    the mode being what the tuner set for it."""

    def __init__(self, state: HookState, durations: dict[str, float]) -> None:
        self.state, self.durations, self.now, self.calls = state, durations, 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # after_step: the step took its mode's time
            self.now += self.durations[self.state.overlap]
        return self.now


def _run_tuner(durations: dict[str, float], steps: int, **kw: object) -> tuple[OverlapTuner, list[str]]:
    state = HookState(CommConfig(overlap="auto"))
    tuner = OverlapTuner(state, device=CPU, clock=ScriptedClock(state, durations), **kw)
    modes = []
    for _ in range(steps):
        tuner.before_step()
        modes.append(state.overlap)
        tuner.after_step()
    return tuner, modes


def test_schedule_alternates_blocks_after_the_warmup_then_keeps_the_choice() -> None:
    tuner, modes = _run_tuner({"none": 0.10, "async": 0.08}, 3 + 16 + 3)
    assert modes[:3] == ["none"] * 3  # warm-up: DDP's bucket rebuild and the dense first step
    assert modes[3:19] == (["none"] * 4 + ["async"] * 4) * 2
    assert modes[19:] == ["async"] * 3 and tuner.decision is not None
    d = tuner.decision
    assert (d.mode, d.steps_per_mode, d.world) == ("async", 8, 1)
    assert (round(d.none_s, 9), round(d.async_s, 9)) == (0.1, 0.08)
    line = d.line()
    assert line.startswith("--overlap auto: async (median step 100.0 ms synchronous vs 80.0 ms async, "
                           "8 steps")
    assert "1.25x the synchronous step" in line


def test_async_must_be_margin_faster_to_be_kept() -> None:
    tuner, modes = _run_tuner({"none": 0.100, "async": 0.099}, 20)
    assert tuner.decision is not None and tuner.decision.mode == "none" and modes[-1] == "none"
    assert "under the 1.03x that pays for its thread" in tuner.decision.line()
    assert decide(1.0, 0.96, 0.03) == "async" and decide(1.0, 0.98, 0.03) == "none"
    assert decide(1.0, 0.98, 0.0) == "async"


def test_hook_state_follows_the_tuner_and_bad_settings_are_named() -> None:
    state = HookState(CommConfig(overlap="auto"))
    assert state.overlap == "none" and state.comm_thread() is None
    state.overlap_mode = "async"
    assert state.comm_thread() is not None
    state.close()
    assert HookState(CommConfig(overlap="async")).overlap == "async"
    with pytest.raises(ValueError, match="overlap='auto'"):
        OverlapTuner(HookState(CommConfig(overlap="async")), device=CPU)
    with pytest.raises(ValueError, match="an even blocks >= 2"):
        OverlapTuner(HookState(CommConfig(overlap="auto")), device=CPU, blocks=3)
    with pytest.raises(ValueError, match="none, async, cross, auto"):
        CommConfig(overlap="sometimes")
    assert make_config(overlap="auto").overlap == "auto"
    with pytest.raises(ConfigError, match="none, async, cross, auto"):
        make_config(overlap="sometimes")


STEPS = 6
TUNER = {"warmup": 1, "block": 1, "blocks": 4}  # steps: none | none async none async | decided


def _train(rank: int, method: str, overlap: str, durations: dict[str, float] | None) -> dict:
    from trainer.comm import maybe_step, register

    cfg = CommConfig(method=method, density=0.1, min_numel_for_sparse=300, overlap=overlap)
    state = HookState(cfg)
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    register(ddp, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    tuner = (OverlapTuner(state, device=CPU, clock=ScriptedClock(state, durations), **TUNER)  # type: ignore[arg-type]
             if overlap == "auto" else None)
    modes = []
    for step in range(STEPS):
        if tuner is not None:
            tuner.before_step()
        modes.append(state.overlap)
        x, y = _batch(rank, step)
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        maybe_step(opt, state)
        if tuner is not None:
            tuner.after_step()
    thread = state._comm
    out = {"params": [p.detach().clone() for p in ddp.parameters()], "modes": modes,
           "thread_tasks": thread.tasks_run if thread is not None else 0,
           "decision": tuner.decision.mode if tuner is not None and tuner.decision else None,
           "async_s": tuner.decision.async_s if tuner is not None and tuner.decision else None}
    state.close()
    return out


def _rank_main(rank: int, world: int) -> dict:
    # rank 0 alone sees async as much faster, the others slightly slower: the mean decides for all
    faster = {"none": 0.10, "async": 0.02} if rank == 0 else {"none": 0.10, "async": 0.11}
    slower = {"none": 0.10, "async": 0.12}
    out = {}
    for method in ("allreduce", "hitopk"):  # DDP's own async all-reduce, and a method on the thread
        out[method] = {"sync": _train(rank, method, "none", None),
                       "faster": _train(rank, method, "auto", faster),
                       "slower": _train(rank, method, "auto", slower)}
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return from_plain(run_distributed(_rank_main, world_size=4, local_size=2, timeout=300))


def test_auto_equals_sync_bit_for_bit_and_every_rank_chooses_alike(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        for method, runs in out.items():
            where = f"rank {rank} {method}"
            assert runs["faster"]["modes"] == ["none", "none", "async", "none", "async", "async"], where
            assert runs["slower"]["modes"] == ["none", "none", "async", "none", "async", "none"], where
            assert runs["faster"]["decision"] == "async" and runs["slower"]["decision"] == "none", where
            # the mean over the 4 ranks' medians: (0.02 + 3 x 0.11) / 4
            assert round(runs["faster"]["async_s"], 9) == round((0.02 + 3 * 0.11) / 4, 9), where
            assert runs["faster"]["thread_tasks"] > runs["slower"]["thread_tasks"] > 0, where
            for mode in ("faster", "slower"):
                for a, b in zip(runs["sync"]["params"], runs[mode]["params"]):
                    assert torch.equal(a, b), f"{where} {mode}: parameters differ (max {(a - b).abs().max()})"


def _trainer_rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.run import train
    from trainer.train_config import TrainConfig

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = train(TrainConfig.from_dict(cfg_values))
    return {"said": said.getvalue(), "overlap": [e["overlap"] for e in result.epochs]}


def test_trainer_measures_logs_and_records_the_choice(digits_data, tmp_path) -> None:
    out = tmp_path / "run"
    cfg = make_config(data=digits_data["val"], val_data=digits_data["val"], cache=digits_data["cache"],
                      short_side=32, model="small_resnet_cifar", width=4, zero_init_residual=False,
                      resolution="16", batch_size="16", epochs=2, lr=0.05, lr_scaling="none", workers=0,
                      device="cpu", progress=False, seed=3, val_every=0, out=str(out), keep_checkpoints=0,
                      comm="hitopk", density=0.05, steps_per_epoch=10, overlap="auto")
    res = run_distributed(_trainer_rank, world_size=2, local_size=1, args=(cfg.to_dict(),))
    said = res[0]["said"]
    line = next(ln for ln in said.splitlines() if ln.startswith("--overlap auto: "))
    mode = line.split("--overlap auto: ", 1)[1].split(" ", 1)[0]
    assert mode in ("none", "async") and "8 steps each, mean over 2 rank(s)" in line
    # decided at step 19 of 20 (epoch 2), said before that epoch's line
    assert said.index("epoch 1/2") < said.index(line) < said.index("epoch 2/2")
    for r in res:
        assert r["overlap"][-1] == mode  # every rank keeps the same mode, recorded per epoch
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rec = next(r for r in records if r.get("event") == "overlap_auto")
    assert rec["mode"] == mode and rec["steps_per_mode"] == 8 and rec["ranks"] == 2
    assert rec["none_s"] > 0 and rec["async_s"] > 0
