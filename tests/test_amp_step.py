"""AMP: ``maybe_step(optimizer, state, scaler)`` with a CPU ``torch.amp.GradScaler`` on 2 real
gloo ranks. The hooks' verdict and the scaler's inf check agree, the scale is updated exactly
once per step (checked against a re-statement of GradScaler's rule), a skip is counted once.

The fused case uses Adam: torch 2.13's fused CPU SGD leaves its momentum buffer uninitialised
when the very first step is skipped (seen here as garbage parameters after the first real step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from trainer.comm.comm_config import CommConfig

WORLD, LOCAL = 2, 1
GROWTH_INTERVAL = 2


def _scale_rule(init: float, skipped: list[bool]) -> list[float]:
    """GradScaler's documented update: x0.5 after a skipped step (tracker reset), x2 after
    ``growth_interval`` consecutive good steps."""
    scale, tracker, out = init, 0, []
    for s in skipped:
        if s:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = scale * 2.0, 0
        out.append(scale)
    return out


def _run(rank: int, cfg: CommConfig, init_scale: float, steps: int, *, inf_at: int | None = None,
         fused: bool = False) -> dict:
    from trainer.comm import maybe_step, register

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = register(ddp, cfg)
    if fused:  # decides skips on the device (GradScaler hands it found_inf); Adam: its state starts at zero
        opt: torch.optim.Optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    hook_flags, returned, moved, scales, finite = [], [], [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if inf_at == step and rank == 1:
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in ddp.parameters()]
        ddp.zero_grad(set_to_none=True)
        scaler.scale(nn.functional.mse_loss(ddp(x), y)).backward()
        hook_flags.append(state.step_was_skipped())  # read here for the test only
        returned.append(maybe_step(opt, state, scaler))
        moved.append(not all(torch.equal(a, p) for a, p in zip(before, ddp.parameters())))
        scales.append(float(scaler.get_scale()))
        finite.append(all(bool(torch.isfinite(p).all()) for p in ddp.parameters()))
    return {"hook_flags": hook_flags, "stepped": returned, "moved": moved, "scales": scales,
            "finite": finite, "skipped": state.skipped_steps, "step": state.step}


def _rank_main(rank: int, world: int) -> dict:
    out = {}
    # fp16 wire + a scale far too large: the hooks see fp16 overflow until the scaler backs off
    for method in ("allreduce", "hitopk"):
        cfg = CommConfig(method=method, fp16=True, density=0.1, min_numel_for_sparse=0)
        out[f"fp16_{method}"] = _run(rank, cfg, 2.0**26, 12)
    cfg = CommConfig(method="naive_ag", fp16=True, density=0.1, min_numel_for_sparse=0)
    out["fp16_fused"] = _run(rank, cfg, 2.0**26, 12, fused=True)
    # no hook check at all (fp32, nan_check=False): the scaler alone finds the inf
    out["scaler_only"] = _run(rank, CommConfig(method="allreduce", nan_check=False), 2.0**10, 5, inf_at=2)
    # both see it (the hooks zero the bucket, the verdict still reaches the scaler): counted once
    out["both"] = _run(rank, CommConfig(method="hitopk", density=0.1, min_numel_for_sparse=0), 2.0**10, 5,
                       inf_at=2)
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL, timeout=180)


def test_scaler_and_hooks_agree(ranks: list[dict]) -> None:
    for out in ranks:
        for key in ("fp16_allreduce", "fp16_hitopk", "fp16_fused"):
            r = out[key]
            skipped = [not s for s in r["stepped"]]
            assert 2 <= sum(skipped) < len(skipped), (key, skipped)  # it backed off, then trained
            assert skipped == r["hook_flags"], key  # a flagged step is exactly a skipped step
            assert r["moved"] == r["stepped"], key
            assert r["scales"] == _scale_rule(2.0**26, skipped), key  # one update per step
            assert r["skipped"] == sum(skipped) and r["step"] == len(skipped), key
            assert all(r["finite"]), key
        assert ranks[0][key]["scales"] == out[key]["scales"]  # every rank decided alike


def test_skip_counted_once_whoever_finds_it(ranks: list[dict]) -> None:
    for out in ranks:
        only = out["scaler_only"]
        assert only["hook_flags"] == [False] * 5  # the hooks checked nothing
        assert only["stepped"] == [True, True, False, True, True]
        assert only["scales"] == _scale_rule(2.0**10, [False, False, True, False, False])
        assert only["skipped"] == 1
        both = out["both"]
        assert both["hook_flags"] == [False, False, True, False, False]
        assert both["stepped"] == [True, True, False, True, True] and both["skipped"] == 1
        assert both["scales"] == _scale_rule(2.0**10, [False, False, True, False, False])
        assert all(both["finite"])
