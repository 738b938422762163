"""fp16 AMP + error feedback: residuals are kept UNSCALED, so a loss-scale change between steps does
not re-weight the held-back gradient.

Reference: the same steps without loss scaling (no GradScaler). With a real CPU
``torch.amp.GradScaler`` whose scale changes between steps (1024 -> 2048 -> 512), the gradient the
hooks deliver (divided by that step's scale) and the stored residual must equal the reference's.
Stored in scaled units (the old behaviour) the residual of a step at scale 1024 would be 1024x the
reference, and the next step at 2048 would deliver it at half weight. Real gloo rank, real DDP.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tests.dist_utils import run_distributed
from trainer.comm.comm_config import CommConfig

SCALES = (1024.0, 2048.0, 512.0)  # powers of two, as GradScaler's


def _steps(rank: int, world: int, method: str, amp: bool) -> dict:
    from trainer.comm import register
    from trainer.loop import loss_scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1.0)
    state = register(ddp, CommConfig(method=method, density=0.05, min_numel_for_sparse=0))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALES[0]) if amp else None
    grads, residuals = [], []
    for step in range(1 + len(SCALES)):  # step 0: DDP's dense first-layout step
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        ddp.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        scale = 1.0
        if scaler is not None:
            scaled = scaler.scale(loss)
            state.grad_scale = loss_scale(scaler)
            scale = float(scaler.get_scale())
            assert scale == SCALES[max(0, step - 1)]
            scaled.backward()
            scaler.update(new_scale=SCALES[min(step, len(SCALES) - 1)])  # the scale changes between steps
        else:
            loss.backward()
        state.finish_step(skipped=False)  # no optimizer step: the weights, and so the reference, stay put
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]) / scale)
        residuals.append(torch.cat([state.ef.get(k).flatten() for k in sorted(state.ef.keys())])
                         if len(state.ef) else torch.zeros(0))
    return {"grads": [g.numpy() for g in grads], "residuals": [r.numpy() for r in residuals]}


def _rank_main(rank: int, world: int) -> dict:
    return {(m, amp): _steps(rank, world, m, amp) for m in ("naive_ag", "hitopk") for amp in (False, True)}


def test_residuals_stay_unscaled_when_the_loss_scale_changes() -> None:
    out = run_distributed(_rank_main, world_size=1, local_size=1)[0]
    for method in ("naive_ag", "hitopk"):
        ref, amp = out[(method, False)], out[(method, True)]
        assert any(np.abs(r).sum() > 0 for r in ref["residuals"])  # error feedback really held mass back
        for step, (want, got) in enumerate(zip(ref["residuals"], amp["residuals"])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{method} residual after step {step}")
        for step, (want, got) in enumerate(zip(ref["grads"], amp["grads"])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{method} delivered gradient of step {step}")


def test_flush_brings_an_unscaled_residual_to_the_buckets_loss_scale() -> None:
    from trainer.comm.error_feedback import ErrorFeedback
    from trainer.comm.topology import Topology

    topo = Topology.single_process()
    ef = ErrorFeedback()
    res = ef.residual("b", method="naive_ag", numel=6, topo=topo)
    res.copy_(torch.arange(6, dtype=torch.float32))  # unscaled, averaged units
    flat = torch.ones(6)  # a bucket at loss scale 8
    assert ef.flush_into("b", flat, topo, scale=2.0, grad_scale=torch.tensor(8.0))
    assert torch.equal(flat, 1.0 + 2.0 * 8.0 * torch.arange(6, dtype=torch.float32))
    assert len(ef) == 0
