"""``--overlap cross`` (trainer/comm/cross_barrier.py) on real gloo process groups.

The reference is the synchronous path: DDP with the comm hook (``overlap="none"``) and one
``optimizer.step()`` through ``maybe_step``. DDP rebuilds its buckets after the first step in the
order gradients arrive; the reference records that layout and the cross run uses exactly those pieces
("with the same pieces"). The first step is the dense warm-up in both (two ranks: a + b is exact in
any order, so the different first-step layout cannot matter). Then the parameters after N steps must
be equal bit for bit, for every method, with a step skipped for a NaN on one rank in between.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from trainer.comm.comm_config import CommConfig
from trainer.comm.cross_barrier import CrossBarrier, CrossBarrierError, default_layout
from trainer.comm.state import HookState

METHODS = ("allreduce", "torus", "naive_ag", "hitopk")
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48),
                         nn.ReLU(), nn.Linear(48, 10))


def _batches(rank: int, nan_at: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        if step == nan_at and rank == 1:
            x[0, 0] = float("nan")  # one rank's gradient goes non-finite: every rank skips the step
        out.append((x, torch.randint(0, 10, (8,), generator=g)))
    return out


def _opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _config(method: str) -> CommConfig:
    return CommConfig(method=method, selector="exact", density=0.1, nan_check=True, min_numel_for_sparse=1)


def _sync_reference(method: str, nan_at: int | None, rank: int) -> tuple[dict, list[list[str]], int]:
    from trainer.comm import maybe_step, register
    from trainer.comm.hooks import make_hook

    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    layout: list[list[str]] = []
    cfg = _config(method)
    hook = make_hook(cfg)

    def recording(state, bucket):  # type: ignore[no-untyped-def]
        layout.append([names[id(p)] for p in bucket.parameters()])
        return hook(state, bucket)

    recording.comm_hook = True  # type: ignore[attr-defined]
    recording.__annotations__ = hook.__annotations__
    state = register(ddp, cfg, recording)
    opt = _opt(list(model.parameters()))
    for x, y in _batches(rank, nan_at):
        layout.clear()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        maybe_step(opt, state)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, layout, state.skipped_steps


def _both(rank: int, world: int, method: str, nan_at: int | None) -> dict:
    ref, layout, ref_skipped = _sync_reference(method, nan_at, rank)
    model = _model()
    by_name = dict(model.named_parameters())
    state = HookState(_config(method))
    engine = CrossBarrier(model, _opt, state, layout=[[by_name[n] for n in piece] for piece in layout],
                          credit_mb=0.002)
    engine.trace = []
    applied = []
    for x, y in _batches(rank, nan_at):
        applied.append(engine.backward(nn.functional.cross_entropy(engine(x), y)))
    engine.synchronize()
    engine.close()
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"equal": {n: bool(torch.equal(ref[n], got[n])) for n in ref}, "pieces": len(layout),
            "skipped": (ref_skipped, state.skipped_steps), "applied": applied, "rounds": engine.rounds,
            "moved": bool(any(not torch.equal(_model().state_dict()[n], got[n]) for n in got)),
            "trace_steps": sorted({t["step"] for t in engine.trace})}


@pytest.mark.parametrize("method", METHODS)
def test_cross_equals_the_synchronous_ddp_run_bit_for_bit(method: str) -> None:
    for r in run_distributed(_both, world_size=2, local_size=1, args=(method, None)):
        assert r["pieces"] > 2, r  # several pieces, so priority and credit have something to order
        assert all(r["equal"].values()), r["equal"]
        assert r["moved"] and r["applied"] == [True] * STEPS and r["skipped"] == (0, 0)
        assert r["trace_steps"] == list(range(STEPS)) and r["rounds"] >= STEPS


def test_a_nan_on_one_rank_skips_that_step_everywhere_like_the_synchronous_run() -> None:
    for r in run_distributed(_both, world_size=2, local_size=1, args=("hitopk", 2)):
        assert all(r["equal"].values()), r["equal"]
        assert r["applied"] == [True, True, False, True, True] and r["skipped"] == (1, 1)


def test_default_layout_groups_backward_order_by_size() -> None:
    model = _model()
    pieces = default_layout(model, piece_mb=0.01)  # 10,485 bytes: about 2,600 floats a piece
    flat = [p for piece in pieces for p in piece]
    assert [id(p) for p in flat] == [id(p) for p in reversed(list(model.parameters()))]
    assert all(sum(p.numel() * 4 for p in piece) <= 10485 or len(piece) == 1 for piece in pieces)
    assert len(default_layout(model, piece_mb=1000)) == 1


def test_refusals_name_the_reason_and_the_alternative() -> None:
    model = _model()
    with pytest.raises(CrossBarrierError, match=r"fp16 wire.*--overlap async"):
        CrossBarrier(model, _opt, HookState(CommConfig(fp16=True)))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(CrossBarrierError, match=r"parameter 1.weight is shared with 0.weight"):
        CrossBarrier(tied, _opt, HookState(CommConfig()))
    with pytest.raises(CrossBarrierError, match="every trainable parameter once"):
        CrossBarrier(model, _opt, HookState(CommConfig()), layout=[list(model.parameters())[:2]])
    with pytest.raises(CrossBarrierError, match="must be > 0 MB"):
        CrossBarrier(model, _opt, HookState(CommConfig()), credit_mb=0)


def _held_round(rank: int, world: int) -> list[int]:
    model = _model()
    engine = CrossBarrier(model, _opt, HookState(_config("allreduce")), piece_mb=0.005, credit_mb=100)
    engine.trace = []
    for step, (x, y) in enumerate(_batches(rank, None)[:3]):
        loss = nn.functional.cross_entropy(engine(x), y)
        if step == 1:
            # The thread cannot take its lock while backward runs: every piece is queued before the
            # round, which then holds all of them (RLock: the hooks on this thread still queue).
            with engine._cv:
                engine.backward(loss)
        else:
            engine.backward(loss)
    engine.close()
    return [t["priority"] for t in sorted(engine.trace, key=lambda t: t["start"]) if t["step"] == 1]


def test_a_round_starts_the_front_layers_first() -> None:
    """Pieces come out of backward last layer first; a round starts them front layer first."""
    for prios in run_distributed(_held_round, world_size=2, local_size=1):
        assert len(prios) > 2 and prios == sorted(prios), prios


# ------------------------------------------------------------------ the trainer: --overlap cross


def _train_rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.run import train
    from trainer.train_config import TrainConfig

    res = train(TrainConfig.from_dict(cfg_values), record_losses=True)
    return {"losses": res.step_losses, "val": [e.get("val_top1") for e in res.epochs],
            "params": {k: v.detach().numpy().copy() for k, v in res.model.named_parameters()},
            "skipped": [e["skipped_steps"] for e in res.epochs]}


@pytest.mark.slow
def test_trainer_cross_equals_overlap_none_and_resumes_mid_epoch(digits_data: dict, tmp_path) -> None:
    """``--overlap cross`` through trainer.run: dense all-reduce on 2 ranks (a + b is exact in any
    order, so DDP's bucket layout cannot matter) with LARS, an LR warm-up (each piece gets its own
    step's lr), a checkpoint mid-epoch and validation: the same losses and parameters as
    ``--overlap none`` bit for bit, and a resume from the step-7 checkpoint continues the cross run
    exactly."""
    from trainer.train_config import make_config

    cfg = make_config(
        data=digits_data["train"], val_data=digits_data["val"], cache=digits_data["cache"], short_side=32,
        model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16", batch_size="32",
        epochs=2, steps_per_epoch=10, comm="allreduce", optimizer="lars", lr=0.5, lr_scaling="none",
        warmup_epochs=0.5, checkpoint_every=7, keep_checkpoints=0, workers=0, device="cpu",
        progress=False, seed=3, bucket_cap_mb=0.05, comm_credit_mb=0.1, out=str(tmp_path / "none"))
    ref = run_distributed(_train_rank, world_size=2, local_size=1, args=(cfg.to_dict(),))
    cross_cfg = {**cfg.to_dict(), "overlap": "cross", "out": str(tmp_path / "cross")}
    cross = run_distributed(_train_rank, world_size=2, local_size=1, args=(cross_cfg,))
    ckpt = tmp_path / "cross" / "checkpoints" / "step00000007"
    resumed = run_distributed(_train_rank, world_size=2, local_size=1,
                              args=({**cross_cfg, "resume": str(ckpt), "out": str(tmp_path / "resumed")},))
    for rank in range(2):
        a, b, c = ref[rank], cross[rank], resumed[rank]
        assert len(a["losses"]) == 20 and a["losses"] == b["losses"] and b["losses"][7:] == c["losses"]
        assert a["val"] == b["val"] == c["val"] and a["skipped"] == b["skipped"] == [0, 0]
        for k, v in a["params"].items():
            assert np.array_equal(v, b["params"][k]) and np.array_equal(v, c["params"][k]), k


def test_trainer_config_refuses_what_cross_cannot_do() -> None:
    from datacache.config import ConfigError
    from trainer.train_config import make_config

    for extra, word in (({"pto": True, "optimizer": "lars"}, "--pto"), ({"fp16_comm": True}, "--fp16-comm")):
        with pytest.raises(ConfigError, match=f"--overlap cross cannot run with {word}.*--overlap async"):
            make_config(overlap="cross", **extra)
    with pytest.raises(ConfigError, match="comm_credit_mb"):
        make_config(overlap="cross", comm_credit_mb=0)
    with pytest.raises(ValueError, match="CrossBarrier"):
        from trainer.comm import CommConfig, register

        register(nn.Linear(2, 2), CommConfig(overlap="cross"))  # type: ignore[arg-type]
