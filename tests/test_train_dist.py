"""The trainer on real gloo process groups: one training step per comm method on 4 ranks (2 nodes
x 2) against an independent reference update, PTO-LARS against LARS, and a mid-epoch resume on 2
ranks that reproduces the uninterrupted run bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from trainer.train_config import make_config

WORLD, LOCAL = 4, 2
PER_RANK = 6
LR = 0.05
# (method, density): at density 1 the sparse methods send everything and must equal dense
METHODS = (("allreduce", 1.0), ("torus", 1.0), ("naive_ag", 1.0), ("hitopk", 1.0),
           ("naive_ag", 0.01), ("hitopk", 0.01))


def _cfg(**kw):
    base = dict(model="small_resnet_cifar", width=4, zero_init_residual=False, optimizer="sgd", lr=LR,
                lr_scaling="none", momentum=0.9, weight_decay=1e-4, device="cpu", progress=False,
                selector="exact")
    return make_config(**{**base, **kw})


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(PER_RANK, 3, 12, 12, generator=g), torch.randint(0, 10, (PER_RANK,), generator=g)


def _steps(cfg, rank: int, steps: int) -> list[list[np.ndarray]]:
    """The parameters after each of ``steps`` trainer steps on this rank."""
    from trainer.build import make_amp, make_ddp, make_model, make_optimizer
    from trainer.device_augment import DeviceAugment
    from trainer.loop import StepContext, train_step

    dev = torch.device("cpu")
    model = make_model(cfg, 10, dev)
    ddp, state = make_ddp(model, cfg, dev)
    ctx = StepContext(ddp, make_optimizer(cfg, model), state, make_amp(cfg, dev), nn.CrossEntropyLoss(),
                      DeviceAugment(), dev, cfg.lr_schedule)
    after = []
    for step in range(steps):
        train_step(ctx, *_batch(step, rank), LR)
        after.append([p.detach().numpy().copy() for p in model.parameters()])
    assert state.active_method is None and state.config.method == cfg.comm  # the flagged method's hook
    return after


def _methods_rank(rank: int, world: int) -> dict:
    out = {f"{m}@{d}": _steps(_cfg(comm=m, density=d), rank, 2) for m, d in METHODS}
    for pto in (False, True):
        out[f"lars pto={pto}"] = _steps(_cfg(optimizer="lars", pto=pto, trust_coefficient=0.02), rank, 2)
    return out


def _reference(cfg, steps: int) -> list[np.ndarray]:
    """Independent re-statement of a DDP step: each rank's forward/backward on its shard with the
    same weights, gradients averaged over ranks, then torch's SGD (weight decay on weights only)."""
    from trainer.build import make_model

    model = make_model(cfg, 10, torch.device("cpu"))
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                           {"params": rest, "weight_decay": 0.0}], lr=LR, momentum=cfg.momentum)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(WORLD):
            model.zero_grad()
            x, y = _batch(step, r)
            nn.functional.cross_entropy(model(x), y).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / WORLD
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.slow
def test_one_step_per_comm_method_on_4_ranks() -> None:
    results = run_distributed(_methods_rank, world_size=WORLD, local_size=LOCAL)
    for key in results[0]:  # replicas stay bit-identical whatever the method
        for res in results[1:]:
            for a, b in zip(res[key][-1], results[0][key][-1]):
                assert np.array_equal(a, b), key
    ref = [_reference(_cfg(), 1), _reference(_cfg(), 2)]
    for m, d in METHODS:
        got = results[0][f"{m}@{d}"]
        # step 1 is DDP's dense layout warm-up for every method: the averaged-gradient update
        for a, b in zip(got[0], ref[0]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{m}@{d} step 1")
        if d == 1.0:  # dense, 2D-Torus and top-k of everything stay equal to it
            for a, b in zip(got[1], ref[1]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{m}@{d} step 2")
        else:  # step 2 sends 1 % of each bucket: it must differ from the dense update
            assert any(not np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got[1], ref[1])), m
    for a, b in zip(results[0]["lars pto=True"][-1], results[0]["lars pto=False"][-1]):
        assert np.array_equal(a, b)  # PTO only splits who computes the trust ratios: identical updates


def _train_rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.run import train
    from trainer.train_config import TrainConfig

    res = train(TrainConfig.from_dict(cfg_values), record_losses=True)
    assert res.model is not None
    return {"losses": res.step_losses, "epochs": res.epochs,
            "state": {k: v.detach().numpy().copy() for k, v in res.model.state_dict().items()}}


@pytest.mark.slow
def test_resume_mid_epoch_reproduces_the_run_bit_for_bit(digits_data: dict, tmp_path) -> None:
    # sparse NaiveAG with error feedback (MSTopK) switching to dense all-reduce at epoch 1, LARS
    # with PTO, a loader worker per rank: the checkpoint at step 7 is mid-epoch 0
    cfg = make_config(
        data=digits_data["train"], val_data=digits_data["val"], cache=digits_data["cache"], short_side=32,
        model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16", batch_size="32",
        epochs=2, steps_per_epoch=10, comm="0:naive_ag,1:allreduce", selector="mstopk", density=0.05,
        optimizer="lars", pto=True, lr=0.5, lr_scaling="none", warmup_epochs=0.5, label_smoothing=0.1,
        checkpoint_every=7, keep_checkpoints=0, workers=1, device="cpu", progress=False, seed=3,
        out=str(tmp_path / "a"))
    full = run_distributed(_train_rank, world_size=2, local_size=1, args=(cfg.to_dict(),))
    ckpt = tmp_path / "a" / "checkpoints" / "step00000007"
    assert (ckpt / "train.pt").exists() and (ckpt / "comm_rank1.pt").exists()
    resumed_cfg = {**cfg.to_dict(), "resume": str(ckpt), "out": str(tmp_path / "b")}
    resumed = run_distributed(_train_rank, world_size=2, local_size=1, args=(resumed_cfg,))
    for rank in range(2):
        a, b = full[rank], resumed[rank]
        assert len(a["losses"]) == 20 and len(b["losses"]) == 13
        assert a["losses"][7:] == b["losses"]  # the same remaining batches and the same steps, exactly
        for k, v in a["state"].items():
            assert np.array_equal(v, b["state"][k]), k
    # the method switch happened in both, and validation after the last epoch agrees
    assert [e["comm_method"] for e in full[0]["epochs"]] == ["naive_ag", "allreduce"]
    assert resumed[0]["epochs"][-1]["val_top1"] == full[0]["epochs"][-1]["val_top1"]
    # --overlap async (the comm thread) resumed from the same checkpoint: the same run, bit for bit,
    # through the rest of the sparse epoch, the switch to dense and LARS/PTO
    overlapped = run_distributed(_train_rank, world_size=2, local_size=1,
                                 args=({**resumed_cfg, "overlap": "async", "out": str(tmp_path / "c")},))
    for rank in range(2):
        a, c = full[rank], overlapped[rank]
        assert a["losses"][7:] == c["losses"]
        for k, v in a["state"].items():
            assert np.array_equal(v, c["state"][k]), k


def _cuda_amp_rank(rank: int, world: int) -> dict:  # pragma: no cover - GPU only
    from trainer.build import make_amp, make_ddp, make_model, make_optimizer
    from trainer.device_augment import DeviceAugment
    from trainer.loop import StepContext, train_step

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = _cfg(comm="hitopk", density=0.05, amp="fp16", channels_last="auto", device="cuda")
    model = make_model(cfg, 10, dev)
    ddp, state = make_ddp(model, cfg, dev)
    amp = make_amp(cfg, dev)
    ctx = StepContext(ddp, make_optimizer(cfg, model), state, amp, nn.CrossEntropyLoss(),
                      DeviceAugment(memory_format=torch.channels_last), dev, cfg.lr_schedule)
    losses = []
    for step in range(3):
        x, y = _batch(step, rank)
        loss, _ = train_step(ctx, x.to(dev).contiguous(memory_format=torch.channels_last), y.to(dev), LR)
        losses.append(float(loss))
    return {"losses": losses, "scale": float(amp.scaler.get_scale()),
            "channels_last": model.conv1.weight.is_contiguous(memory_format=torch.channels_last)}


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="fp16 AMP with GradScaler needs a CUDA device")
def test_fp16_amp_with_grad_scaler_on_cuda() -> None:  # pragma: no cover - GPU only
    res = run_distributed(_cuda_amp_rank, world_size=1, local_size=1, backend="nccl")[0]
    assert all(np.isfinite(res["losses"])) and res["scale"] > 0 and res["channels_last"]
