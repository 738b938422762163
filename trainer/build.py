"""Building a run's pieces from a :class:`~trainer.train_config.TrainConfig`: model, optimizer, DDP with
the comm hooks, AMP, and the DDP layout warm-up a resumed run needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from datacache.config import ConfigError
from trainer.comm import CommConfig, HookState, MethodSchedule, wrap
from trainer.comm.cross_barrier import CrossBarrier, piece_optimizers
from trainer.models import build_model
from trainer.optim import LAMB, LARS
from trainer.scratch_pass import leaves_no_trace
from trainer.train_config import TrainConfig


def make_model(cfg: TrainConfig, num_classes: int, device: torch.device) -> nn.Module:
    """The network, initialised from ``cfg.seed`` (the same weights on every rank and run), on
    ``device``; channels_last on CUDA unless ``--channels-last off``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, num_classes, width=cfg.width,
                            zero_init_residual=cfg.zero_init_residual)
    model = model.to(device)
    if channels_last(cfg, device):
        if device.type == "cpu":
            _refuse_cpu_channels_last_bug(model)
        model = model.to(memory_format=torch.channels_last)
    return model


def _refuse_cpu_channels_last_bug(model: nn.Module) -> None:
    """torch 2.13's CPU backward of a 1x1 stride-2 convolution with fewer than 8 input channels in
    channels_last crashes (SIGSEGV, "double free or corruption") or hangs: reproduced with
    ``Conv2d(4, 8, 1, stride=2)`` alone (also 2, 5 and 6 input channels; 8 and more, and stride 1, are fine).
    A small ResNet below width 8 has such a projection shortcut: refused with what to do instead."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride != (1, 1) and m.in_channels < 8:
            raise ConfigError(f"--channels-last on with --device cpu: layer {name} (a 1x1 stride-"
                              f"{m.stride[0]} convolution of {m.in_channels} input channels) crashes torch's "
                              "CPU backward in channels_last; use --channels-last off (or auto) on the CPU, "
                              "or --width 8 or more")


def channels_last(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.channels_last == "on" or (cfg.channels_last == "auto" and device.type == "cuda")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weights only: biases and BatchNorm parameters (ndim <= 1) get none."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (momentum), LARS or LAMB; LARS/LAMB exclude biases and BatchNorm from adaptation and
    decay themselves, and compute trust ratios with PTO when ``cfg.pto``. The LR set here is
    overwritten every step by the schedule."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(param_groups(model, cfg.weight_decay), lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov)
    if cfg.optimizer == "lars":
        return LARS(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    trust_coefficient=cfg.trust_coefficient, eps=cfg.lars_eps, nesterov=cfg.nesterov,
                    pto=cfg.pto)
    return LAMB(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, pto=cfg.pto)


def comm_config(cfg: TrainConfig) -> CommConfig:
    """The hooks' config: one method, or a by-epoch :class:`MethodSchedule` (e.g. HiTopK -> torus)."""
    phases = cfg.comm_schedule.phases
    schedule = MethodSchedule(phases, unit="epoch") if len(phases) > 1 else None
    return CommConfig(method=phases[0][1], selector=cfg.selector, density=cfg.density, fp16=cfg.fp16_comm,
                      error_feedback=cfg.error_feedback, schedule=schedule, overlap=cfg.overlap)


DDP = nn.parallel.DistributedDataParallel


def make_ddp(model: nn.Module, cfg: TrainConfig, device: torch.device,
             optimizer: torch.optim.Optimizer | None = None) -> tuple[DDP | CrossBarrier, HookState]:
    """DDP with the comm hook registered, or for ``--overlap cross`` the :class:`CrossBarrier` that
    replaces DDP and steps ``optimizer`` piece by piece (COLLECTIVE: every rank, same order)."""
    if cfg.overlap == "cross":
        if optimizer is None:
            raise ValueError("make_ddp: --overlap cross needs the optimizer (it steps it piece by piece)")
        state = HookState(comm_config(cfg))
        engine = CrossBarrier(model, piece_optimizers(optimizer), state, piece_mb=cfg.bucket_cap_mb,
                              credit_mb=cfg.comm_credit_mb, timeout=cfg.dist_timeout)
        return engine, state
    kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
    return wrap(model, comm_config(cfg), bucket_cap_mb=cfg.bucket_cap_mb, **kwargs)


def tune_cudnn(device: torch.device) -> bool:
    """On CUDA, let cuDNN time its convolution algorithms for each input shape and keep the fastest
    (``cudnn.benchmark``); True when set. Training has one input shape per phase (the resolution schedule
    changes it between epochs, ``drop_last`` keeps the batch size), so each shape is timed once per
    phase; validation's last, smaller batch adds one more. The chosen algorithms may differ between runs,
    so results are not bitwise repeatable on a GPU (a CPU run is unaffected)."""
    if device.type != "cuda":
        return False
    torch.backends.cudnn.benchmark = True
    return True


@dataclass
class Amp:
    """Autocast settings and the GradScaler (fp16 on CUDA only)."""

    dtype: torch.dtype | None
    device_type: str
    scaler: torch.amp.GradScaler | None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


def make_amp(cfg: TrainConfig, device: torch.device) -> Amp:
    mode = cfg.amp
    if mode == "auto":
        mode = "fp16" if device.type == "cuda" else "off"
    if mode == "fp16" and device.type != "cuda":
        raise ConfigError("amp=fp16 needs CUDA (fp16 autocast + GradScaler); on a CPU use --amp bf16 or off")
    if mode == "off":
        return Amp(None, device.type, None)
    if mode == "bf16":
        return Amp(torch.bfloat16, device.type, None)  # bf16 keeps fp32's range: no loss scaling
    return Amp(torch.float16, "cuda", torch.amp.GradScaler("cuda"))


def layout_warmup(ddp: nn.parallel.DistributedDataParallel, state: HookState, batch: tuple[torch.Tensor, ...],
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  autocast: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
    """Run DDP's first (layout) iteration on ``batch`` without changing any training state.

    A fresh DDP reduces its first backward with a provisional bucket layout and rebuilds the
    buckets after it; the hooks therefore reduce the first step after ``register`` densely
    (``CommConfig.dense_first_step``). A run resumed mid-training must not get that extra dense
    step -- the uninterrupted run was sparse there. So after loading a checkpoint, one forward /
    backward is run here with the hooks in their warm-up, and then undone: BatchNorm buffers are
    restored, gradients dropped, the optimizer is not stepped, and the hook state's step counter
    is put back (the residuals were untouched: the warm-up reduction is dense and keeps them).
    The next real step uses the rebuilt layout, as the uninterrupted run did. COLLECTIVE.

    ``autocast``: the training step's (``Amp.autocast``). The forward runs under it, so the warm-up saves
    the activations training saves (fp16/bf16: about half of fp32's) -- a batch size tuned with AMP
    must not run out of memory only when a run resumes.
    """
    step = state.step
    x, y = batch
    with leaves_no_trace(ddp.module):  # BatchNorm buffers restored, gradients dropped
        with (autocast or contextlib.nullcontext)():
            loss = loss_fn(ddp(x), y)
        loss.backward()
        state.finish_step(skipped=False)  # leaves the warm-up (fresh -> False), keeps all residuals
        state.step = step
