"""One training step, one epoch, one validation pass.

Host/device syncs per step: ``maybe_step`` reads the hooks' verdict once (the step's one sync);
the loss is summed on the device and read every ``LOSS_EVERY`` steps for the progress bar and
at the epoch's end. On CUDA nothing else waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from trainer.build import Amp
from trainer.comm import HookState, maybe_step
from trainer.comm.cross_barrier import CrossBarrier
from trainer.comm.overlap_auto import OverlapTuner
from trainer.device_augment import DeviceAugment
from trainer.prefetch import Prefetcher
from trainer.schedule import LRSchedule

LOSS_EVERY = 10


@dataclass
class StepContext:
    """What a training step needs (built once per run by :mod:`trainer.run`)."""

    ddp: nn.parallel.DistributedDataParallel | CrossBarrier  # --overlap cross: the engine replaces DDP
    optimizer: torch.optim.Optimizer
    state: HookState
    amp: Amp
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    augment: DeviceAugment
    device: torch.device
    lr_schedule: LRSchedule
    tuner: OverlapTuner | None = None  # --overlap auto: times none vs async on the first steps
    prefetch: str = "inline"  # --prefetch: where the next batch is staged (trainer/prefetch.py)


@dataclass
class EpochStats:
    """Result of :func:`train_epoch` (per rank; ``loss`` is this rank's mean)."""

    epoch: int
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    data_wait_s: float = 0.0
    augment_s: float = 0.0
    loss: float = float("nan")
    lr: float = 0.0
    skipped_steps: int = 0
    step_losses: list[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_wait_fraction(self) -> float:
        return self.data_wait_s / self.seconds if self.seconds > 0 else 0.0


def drain(ctx: StepContext) -> None:
    """Wait until every step so far is applied: ``--overlap cross`` updates pieces after ``backward``
    returned; read parameters (checkpoint, evaluation) only after this. A no-op with DDP."""
    if isinstance(ctx.ddp, CrossBarrier):
        ctx.ddp.synchronize()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def loss_scale(scaler: torch.amp.GradScaler) -> Tensor | None:
    """The scaler's current scale as a device tensor (no host read), or None when it is disabled.
    HAZARD (torch internals): ``GradScaler._scale`` exists once ``scale()`` ran and is updated in
    place by ``update()``; ``get_scale()`` would be the public way but reads it on the host."""
    if not scaler.is_enabled():
        return None
    return scaler._scale


def train_step(ctx: StepContext, x: Tensor, y: Tensor, lr: float) -> tuple[Tensor, bool]:
    """Forward, backward (the hooks communicate), optimizer step unless skipped. Returns the
    detached loss (a device tensor: not read here) and whether the optimizer stepped."""
    set_lr(ctx.optimizer, lr)
    with ctx.amp.autocast():
        loss = ctx.loss_fn(ctx.ddp(x), y)
    if isinstance(ctx.ddp, CrossBarrier):
        # --overlap cross: the engine applies this step piece by piece after backward returns (with this
        # step's lr) and clears the gradients itself; the verdict is its one host read.
        return loss.detach(), ctx.ddp.backward(loss, lr=lr)
    if ctx.amp.scaler is not None:
        scaled = ctx.amp.scaler.scale(loss)
        ctx.state.grad_scale = loss_scale(ctx.amp.scaler)  # the hooks keep residuals unscaled with it
        scaled.backward()
    else:
        loss.backward()
    stepped = maybe_step(ctx.optimizer, ctx.state, ctx.amp.scaler)  # the step's one host sync
    ctx.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), stepped


def train_epoch(ctx: StepContext, loader: Iterable[Any], *, epoch: int, resolution: int, global_batch: int,
                steps_in_epoch: int, start_step: int = 0, progress: bool = False, record_losses: bool = False,
                on_step: Callable[[int], None] | None = None) -> EpochStats:
    """Train over ``loader`` (its remaining batches of ``epoch``, from ``start_step``).

    ``on_step(step)`` runs after each step with the index of the NEXT step (the checkpoint hook).
    ``record_losses`` keeps every step's loss (one host read per step: tests only).
    """
    ctx.ddp.train()
    ctx.state.set_epoch(epoch)
    pre = Prefetcher(loader, ctx.device, ctx.augment, resolution, staging=ctx.prefetch)
    stats = EpochStats(epoch)
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    skipped_before = ctx.state.skipped_steps
    step = start_step
    # epochs are shown 1-based everywhere (this bar, the epoch line); `epoch` is the 0-based index
    bar = tqdm(total=steps_in_epoch, initial=start_step, desc=f"epoch {epoch + 1}", unit="step",
               disable=not progress, leave=False, dynamic_ncols=True)
    t0 = time.perf_counter()
    for x, y in pre:
        lr = ctx.lr_schedule.at(epoch + step / steps_in_epoch, global_batch)
        if ctx.tuner is not None:  # --overlap auto: this step's mode, and its clock (not the data wait)
            ctx.tuner.before_step()
        loss, _ = train_step(ctx, x, y, lr)
        if ctx.tuner is not None:
            ctx.tuner.after_step()  # COLLECTIVE at its last measuring step (same step on every rank)
        total += loss
        stats.lr = lr
        if record_losses:
            stats.step_losses.append(float(loss))
        step += 1
        stats.steps += 1
        if progress and stats.steps % LOSS_EVERY == 0:
            bar.set_postfix(loss=f"{float(total) / stats.steps:.3f}", lr=f"{lr:.3g}")
        bar.update(1)
        if on_step is not None:
            on_step(step)
    drain(ctx)  # --overlap cross: the epoch's last pieces applied (and counted) before it ends
    stats.seconds = time.perf_counter() - t0
    bar.close()
    stats.samples = pre.stats.samples
    stats.data_wait_s = pre.stats.wait_s
    stats.augment_s = pre.stats.augment_s
    stats.loss = float(total) / max(1, stats.steps)
    stats.skipped_steps = ctx.state.skipped_steps - skipped_before
    return stats


@torch.no_grad()
def recalibrate_bn(model: nn.Module, loader: Iterable[Any], augment: DeviceAugment, device: torch.device,
                   resolution: int, amp: Amp, prefetch: str = "inline") -> int:
    """BatchNorm's running statistics recomputed from ``loader``'s batches (all of them), as
    ``torch.optim.swa_utils.update_bn``: reset, then a cumulative average over the batches in training
    mode, no gradients; with a process group, every rank's averages are then averaged over the ranks
    (every rank must call this, with the same number of BatchNorm layers). ``model`` is the plain
    module, not DDP (its forward would broadcast rank 0's buffers). Returns the batches seen here."""
    bns = [m for m in model.modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    momenta = [m.momentum for m in bns]
    was_training = model.training
    seen = 0
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None  # None: the cumulative average of every batch, not an exponential one
        model.train()
        for x, _ in Prefetcher(loader, device, augment, resolution, staging=prefetch):
            with amp.autocast():
                model(x)
            seen += 1
    finally:
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
        model.train(was_training)
    if dist.is_initialized() and bns:
        world = dist.get_world_size()
        for m in bns:
            for buf in (m.running_mean, m.running_var):
                dist.all_reduce(buf)
                buf.div_(world)
    return seen


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable[Any], augment: DeviceAugment, device: torch.device,
             resolution: int, amp: Amp, prefetch: str = "inline") -> dict[str, float]:
    """Top-1 / top-5 accuracy and mean loss over all ranks' shards (one all-reduce of the sums).
    ``model`` is the plain module (not DDP): ranks may see different numbers of batches."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # correct1, correct5, loss, n
    for x, y in Prefetcher(loader, device, augment, resolution, staging=prefetch):
        with amp.autocast():
            logits = model(x)
        logits = logits.float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top.eq(y[:, None])
        sums[0] += hit[:, :1].sum()
        sums[1] += hit.any(dim=1).sum()
        sums[2] += nn.functional.cross_entropy(logits, y, reduction="sum")
        sums[3] += y.numel()
    if dist.is_initialized():
        dist.all_reduce(sums)
    c1, c5, loss, n = sums.tolist()
    model.train()
    if n == 0:
        return {"top1": float("nan"), "top5": float("nan"), "loss": float("nan"), "samples": 0}
    return {"top1": c1 / n, "top5": c5 / n, "loss": loss / n, "samples": int(n)}
