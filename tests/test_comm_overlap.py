"""``CommConfig(overlap="async")`` on 4 real gloo ranks (2 nodes x 2): every method runs on the
communication thread, the parameters after N optimizer steps equal the synchronous run's bit for
bit (residuals, skip verdicts and AMP loss scale included), backward really goes on while a bucket
communicates, and a failing method fails DDP's future instead of hanging the ranks.
One spawned run; the parent asserts.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from tests.test_comm_algorithms import from_plain
from trainer.comm.comm_config import CommConfig
from trainer.comm.comm_thread import CommThread
from trainer.comm.state import HookState
from trainer.comm.switch import MethodSchedule
from trainer.comm.timing import PhaseTimer

WORLD, LOCAL = 4, 2
CAP_MB = 0.001  # ~260 floats per bucket: one bucket per weight, small ones grouped
STEPS = 4

# (name, CommConfig fields): every method, selector, wire format and the schedule; the sparse
# methods with min_numel_for_sparse between the bucket sizes, so one step mixes sparse and dense
# buckets on the one thread.
CONFIGS: list[tuple[str, dict]] = [
    ("allreduce", {"method": "allreduce"}),
    ("allreduce_fp16", {"method": "allreduce", "fp16": True}),
    ("torus", {"method": "torus"}),
    ("torus_fp16", {"method": "torus", "fp16": True}),
    *[(f"naive_ag_{s}", {"method": "naive_ag", "selector": s}) for s in ("mstopk", "exact", "dgc")],
    *[(f"hitopk_{s}", {"method": "hitopk", "selector": s, "partition_numel": 64})
      for s in ("mstopk", "exact", "dgc")],
    ("hitopk_fp16", {"method": "hitopk", "fp16": True}),
    ("switch", {"schedule": MethodSchedule([(0, "hitopk"), (2, "naive_ag"), (3, "torus")], unit="step")}),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(rank: int, fields: dict, overlap: str, *, nan_step: int = -1, amp: bool = False,
           wrapper: bool = False) -> dict:
    from trainer.comm import maybe_step, register
    from trainer.comm.fp16 import fp16_wrapper
    from trainer.comm.hooks import make_hook

    cfg = CommConfig(density=0.1, min_numel_for_sparse=300, overlap=overlap, **fields)
    state = HookState(cfg)
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    register(ddp, state, fp16_wrapper(make_hook(cfg)) if wrapper else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if amp else None
    stepped, scales = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        if step == nan_step and rank == 3:
            x[0, 0] = float("nan")
        ddp.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        if scaler is not None:
            loss = scaler.scale(loss)
            state.grad_scale = scaler._scale  # what trainer.loop.train_step sets
        loss.backward()
        stepped.append(maybe_step(opt, state, scaler))
        scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)
    thread = state._comm
    out = {"params": [p.detach().clone() for p in ddp.parameters()],
           "residuals": {k: state.ef.get(k).clone() for k in state.ef.keys()},  # noqa: SIM118
           "stepped": stepped, "scales": scales, "skipped": state.skipped_steps,
           "switches": state.switches,
           "thread_tasks": thread.tasks_run if thread is not None else 0}
    state.close()
    out["thread_alive_after_close"] = thread.alive if thread is not None else False
    return out


class _GateTimer(PhaseTimer):
    """Records which thread runs each phase; the first "communicate" phase waits (bounded) for
    ``gate``, which the first layer's gradient sets: only possible when backward goes on while
    the first bucket communicates."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(enabled=True, cuda_sync=False)
        self.gate, self.threads, self.waited = gate, set(), None

    def phase(self, name: str):  # type: ignore[override]
        self.threads.add(threading.current_thread().name)
        if name == "communicate" and self.waited is None:
            self.waited = self.gate.wait(timeout=20.0)
        return super().phase(name)


def _backward_goes_on(rank: int, overlap: str) -> dict:
    from trainer.comm import maybe_step, register

    gate = threading.Event()
    state = HookState(CommConfig(method="hitopk", density=0.1, min_numel_for_sparse=0, overlap=overlap,
                                 dense_first_step=False), timer=None)
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    register(ddp, state)
    state.timer = _GateTimer(gate) if overlap == "async" else None
    first = ddp.module[0].weight  # produced LAST in backward, in the last bucket
    first.register_post_accumulate_grad_hook(lambda p: gate.set())
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    maybe_step(torch.optim.SGD(ddp.parameters(), lr=0.1), state)
    timer = state.timer
    state.close()
    return {"waited": getattr(timer, "waited", None), "threads": sorted(getattr(timer, "threads", ())),
            "backward_thread": threading.current_thread().name}


def _failing(rank: int) -> dict:
    """A method that raises on the comm thread: DDP re-raises it from backward(), the thread is
    poisoned (later buckets fail at once: no collective the other ranks might not match)."""
    from trainer.comm import hooks, register

    state = HookState(CommConfig(method="torus", overlap="async"))
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    register(ddp, state)
    real = hooks.torus_allreduce

    def broken(*a, **k):
        raise RuntimeError("injected failure in torus")

    hooks.torus_allreduce = broken
    try:
        x, y = _batch(rank, 0)
        t0 = time.monotonic()
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
            raised = ""
        except RuntimeError as exc:
            raised = str(exc)
        seconds = time.monotonic() - t0
    finally:
        hooks.torus_allreduce = real
    thread = state._comm
    poisoned = thread is not None and thread._failed is not None
    state.close()
    return {"raised": raised, "seconds": seconds, "poisoned": poisoned}


def _rank_main(rank: int, world: int) -> dict:
    out: dict = {"exact": {}}
    runs = [(name, fields, {}) for name, fields in CONFIGS]
    runs += [("hitopk_nan", {"method": "hitopk"}, {"nan_step": 1}),
             ("torus_nan", {"method": "torus"}, {"nan_step": 1}),
             ("naive_ag_amp_fp16", {"method": "naive_ag", "fp16": True}, {"amp": True}),
             ("allreduce_amp", {"method": "allreduce"}, {"amp": True}),
             ("hitopk_fp16_wrapper", {"method": "hitopk"}, {"wrapper": True})]
    for name, fields, kw in runs:
        out["exact"][name] = (_train(rank, fields, "none", **kw), _train(rank, fields, "async", **kw))
    out["goes_on"] = {m: _backward_goes_on(rank, m) for m in ("async",)}
    out["failing"] = _failing(rank)
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return from_plain(run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL, timeout=300))


def test_async_equals_sync_bit_for_bit(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        for name, (sync, asyn) in out["exact"].items():
            where = f"rank {rank} {name}"
            assert asyn["thread_tasks"] > 0 and sync["thread_tasks"] == 0, where
            assert not asyn["thread_alive_after_close"], where
            for a, b in zip(sync["params"], asyn["params"]):
                assert torch.equal(a, b), f"{where}: parameters differ (max {(a - b).abs().max()})"
            assert sync["residuals"].keys() == asyn["residuals"].keys(), where
            for k, v in sync["residuals"].items():
                assert torch.equal(v, asyn["residuals"][k]), f"{where}: residual {k} differs"
            for field in ("stepped", "scales", "skipped", "switches"):
                assert sync[field] == asyn[field], f"{where}: {field} {sync[field]} != {asyn[field]}"


def test_the_runs_exercise_what_they_claim(ranks: list[dict]) -> None:
    """The exactness above covers skips, AMP back-off, residuals and the switch for real."""
    ex = ranks[0]["exact"]
    for name in ("hitopk_nan", "torus_nan"):
        assert ex[name][1]["stepped"] == [True, False, True, True] and ex[name][1]["skipped"] == 1, name
    assert ex["switch"][1]["switches"] == 2
    assert ex["hitopk_mstopk"][1]["residuals"] and not ex["switch"][1]["residuals"]  # flushed into torus
    assert len(set(ex["allreduce_amp"][1]["scales"])) > 1  # the scaler grew its scale under async too


def test_backward_goes_on_while_a_bucket_communicates(ranks: list[dict]) -> None:
    for out in ranks:
        r = out["goes_on"]["async"]
        # the first bucket's communication waited for the first layer's gradient, and got it
        assert r["waited"] is True, r
        assert r["threads"] == ["datacache-comm"], r
        assert r["backward_thread"] not in r["threads"]


def test_a_failing_method_fails_backward_on_every_rank(ranks: list[dict]) -> None:
    for out in ranks:
        f = out["failing"]
        assert "injected failure in torus" in f["raised"], f
        assert f["poisoned"] and f["seconds"] < 60, f


def test_comm_thread_alone() -> None:
    """Without DDP: FIFO order, results, an exception poisons later tasks, close is idempotent."""
    t = CommThread(name="t")
    order: list[int] = []

    def task(i: int):
        def run() -> torch.Tensor:
            order.append(i)
            return torch.full((2,), float(i))
        return run

    futs = [t.submit(task(i), torch.zeros(1)) for i in range(20)]
    assert [f.wait()[0].item() for f in futs] == list(range(20)) and order == list(range(20))

    def boom() -> torch.Tensor:
        raise ValueError("nope")

    bad = t.submit(boom, torch.zeros(1))
    later = t.submit(task(99), torch.zeros(1))
    with pytest.raises(ValueError, match="nope"):
        bad.wait()
    with pytest.raises(RuntimeError, match="earlier failure"):
        later.wait()
    assert 99 not in order
    t.close()
    t.close()
    assert not t.alive


def test_overlap_choices_are_listed() -> None:
    with pytest.raises(ValueError, match="none, async"):
        CommConfig(overlap="later")
    assert HookState(CommConfig()).comm_thread() is None


def _cuda_async_vs_sync(rank: int, world: int) -> dict:  # pragma: no cover - needs a GPU
    """One NCCL rank: every method and wire format, sync vs async on the side stream, no host sync
    inside backward (the side stream's event edges included), same parameters bit for bit."""
    from trainer.comm import maybe_step, register
    from trainer.comm.names import METHOD_CHOICES

    out = {}
    for method in METHOD_CHOICES:
        for fp16 in (False, True):
            params = []
            for overlap in ("none", "async"):
                cfg = CommConfig(method=method, fp16=fp16, density=0.1, min_numel_for_sparse=0,
                                 overlap=overlap)
                ddp = nn.parallel.DistributedDataParallel(_model().cuda(), bucket_cap_mb=CAP_MB)
                state = register(ddp, cfg)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
                for step in range(STEPS):
                    x, y = (t.cuda() for t in _batch(rank, step))
                    ddp.zero_grad(set_to_none=True)
                    if step >= 2:  # after DDP's bucket rebuild (which may sync)
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        nn.functional.mse_loss(ddp(x), y).backward()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    maybe_step(opt, state)
                state.close()
                params.append([p.detach().cpu() for p in ddp.parameters()])
            out[f"{method}_fp16={fp16}"] = all(torch.equal(a, b) for a, b in zip(*params))
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_async_on_a_cuda_side_stream_equals_sync() -> None:  # pragma: no cover - needs a GPU
    (out,) = run_distributed(_cuda_async_vs_sync, world_size=1, local_size=1, backend="nccl")
    assert all(out.values()), out


def test_trainer_flag_reaches_the_hooks(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.build import comm_config
    from trainer.cli import main
    from trainer.train_config import ConfigError, make_config

    assert comm_config(make_config(overlap="async", comm="0:hitopk,3:torus")).overlap == "async"
    assert comm_config(make_config()).overlap == "none"
    with pytest.raises(ConfigError, match="choose one of none, async, cross, auto"):
        make_config(overlap="later")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--overlap {none,async,cross,auto}" in out and "same results bit for bit" in " ".join(out.split())
    assert "--comm-credit-mb" in out
