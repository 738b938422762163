"""GPU part of the training benchmark (run by ``python -m bench.train`` when CUDA is available).

ResNet-50 at 128 px (channels_last, fp16 AMP + GradScaler, SGD) from a warm cache of short side
160, one GPU, batch 256: the same loader with and without the prefetcher. GPU busy fraction =
the summed span of each step's work on the compute stream (CUDA events recorded before the
forward and after the optimizer step) over the wall time of the timed steps -- a gap in which
the GPU waits for the host inside a step counts as busy, so it is an upper bound; the gaps
between steps (the loader, a synchronous copy) are what the prefetcher removes. Writes
``bench/results/train_gpu.json`` (ratios ``gpu_busy_fraction`` (target >= 0.95) and
``prefetch_vs_no_prefetch``). Not run on the development machine (no GPU there).

Where a miss comes from (the first H100 run measured 0.80 with and without the prefetcher), side by
side in the same run: ``gpu_only`` -- the same training step on one batch already on the GPU, over
and over (the GPU's ceiling with this host; its busy fraction shows the host's launch gaps),
``loader_only`` -- the loader alone, batches taken and dropped (the host pipeline's ceiling), and the
prefetcher's own counters (mean time a step waited for the loader). Ratios ``prefetch_vs_gpu_only``
and ``loader_vs_gpu_only`` (below 1: the loader cannot feed this GPU), and ``data_wait_fraction``.

The third H100 run (busy 0.94) traced the rest of the gap to the prefetcher's inline staging: the
next batch is taken from the loader, copied and its augmentation enqueued between the step's host
sync and the next forward. ``prefetch_thread`` is the same loop with ``Prefetcher(staging="thread")``
(a staging thread one batch ahead), timed in the same run: ratios ``gpu_busy_fraction_thread`` and
``prefetch_thread_vs_inline`` (samples/s); the trainer's default (``--prefetch inline``) changes only
once this pays on a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.common import write_results
from client.dataset import CachedImageNet
from trainer.build import make_amp, make_ddp, make_model, make_optimizer
from trainer.data import DistributedBatchSampler, train_loader
from trainer.device_augment import DeviceAugment
from trainer.loop import StepContext, train_step
from trainer.prefetch import Prefetcher
from trainer.train_config import make_config

SIZE, BATCH, STEPS, WARMUP = 128, 256, 60, 10
# The 2,000-image set is 7 batches: a DataLoader epoch that short restarts its iterator (and waits for a
# worker to make the first batch) every 7 steps, which an ImageNet epoch (5,000 steps) does not. The
# timed passes therefore use epochs of PASSES passes over the images, as long as the timed steps.
PASSES = 12


def _run(ctx: StepContext, batches: Any, steps: int) -> dict[str, float]:
    """Time ``steps`` training steps after ``WARMUP``; returns samples/s and the busy fraction."""
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    it = iter(batches)
    t0 = 0.0
    for k in range(WARMUP + steps):
        if k == WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = next(it)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        train_step(ctx, x, y, 0.1)  # the trainer's own step (its one host sync is in maybe_step)
        end.record()
        if k >= WARMUP:
            spans.append((start, end))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy = sum(s.elapsed_time(e) for s, e in spans) / 1000.0
    return {"samples_per_s": steps * BATCH / wall, "gpu_busy_fraction": min(1.0, busy / wall), "wall_s": wall}


def _repeat(x: torch.Tensor, y: torch.Tensor) -> Any:
    """The same device batch for ever: the step without any input pipeline."""
    while True:
        yield x, y


def _loader_rate(batches: Any, steps: int) -> dict[str, float]:
    """Samples/s of the loader alone: ``steps`` batches after ``WARMUP``, taken and dropped."""
    it = iter(batches)
    for _ in range(WARMUP):
        next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        n += len(next(it))
    return {"samples_per_s": n / (time.perf_counter() - t0)}


def _synchronous(loader: Any, aug: DeviceAugment, device: torch.device) -> Any:
    """No prefetcher: each batch is copied (blocking) and augmented on the compute stream when asked for."""
    for batch in loader:
        yield aug(batch.to(device), SIZE)


def gpu_part(url: str, cache: str, storage_options: dict[str, Any],
             machine: dict[str, Any]) -> None:  # pragma: no cover - GPU only
    from trainer.distenv import init_distributed

    info = init_distributed("cuda")
    ds = CachedImageNet(url, cache=cache, short_side=160, t1_dir=None, storage_options=storage_options)
    cfg = make_config(model="resnet50", resolution=str(SIZE), batch_size=str(BATCH), amp="fp16",
                      device="cuda", channels_last="on", epochs=100, progress=False)
    dev = info.device
    model = make_model(cfg, len(ds.classes), dev)
    ddp, state = make_ddp(model, cfg, dev)
    aug = DeviceAugment(memory_format=torch.channels_last)
    ctx = StepContext(ddp, make_optimizer(cfg, model), state, make_amp(cfg, dev), nn.CrossEntropyLoss(), aug,
                      dev, cfg.lr_schedule)
    sampler = DistributedBatchSampler(list(range(len(ds))), 1, 0, seed=0)
    sampler.set_epoch(0, BATCH)
    warm = train_loader(ds, sampler, workers=8, seed=0, pin_memory=True)
    for _ in warm:  # fill the 160-px variant (cold epoch)
        pass
    # the loader asks its batch sampler for each epoch's plan: from here on an epoch is PASSES passes
    sampler.indices = np.tile(sampler.indices, PASSES)
    results: dict[str, Any] = {"epoch_steps": len(sampler.indices) // BATCH}

    def endless(make: Any) -> Any:
        epoch = 1
        while True:
            sampler.set_epoch(epoch, BATCH)
            yield from make()
            epoch += 1

    # the ceilings first (see the module docstring): the GPU alone on one resident batch ...
    x0, y0 = aug(next(iter(warm)).to(dev), SIZE)
    results["gpu_only"] = _run(ctx, _repeat(x0, y0), STEPS)
    # ... and the loader alone (its persistent workers are the ones the prefetcher uses next)
    results["loader_only"] = _loader_rate(endless(lambda: iter(warm)), STEPS)
    for name, staging in (("prefetch", "inline"), ("prefetch_thread", "thread")):
        made: list[Prefetcher] = []

        def prefetched(staging: str = staging, made: list[Prefetcher] = made) -> Any:
            made.append(Prefetcher(warm, dev, aug, SIZE, staging=staging))
            return made[-1]

        batches = endless(prefetched)
        results[name] = _run(ctx, batches, STEPS)
        batches.close()  # the last pass's staging thread joined before the next measurement
        waits = [w for p in made for w in p.stats.waits]
        results[name]["data_wait_s_per_step"] = sum(waits) / max(1, len(waits))
        # the wait at each epoch's start (a fresh loader iterator), apart from the mid-epoch ones
        results[name]["first_wait_s"] = [p.stats.waits[0] for p in made if p.stats.waits]
        # steady state: the waits after each pass's first batch
        rest = [w for p in made for w in p.stats.waits[1:]]
        results[name]["steady_wait_s_per_step"] = sum(rest) / max(1, len(rest))
    plain = train_loader(ds, sampler, workers=8, seed=0, pin_memory=False)
    results["no_prefetch"] = _run(ctx, endless(lambda: _synchronous(plain, aug, dev)), STEPS)
    pre, plain_res = results["prefetch"], results["no_prefetch"]
    ceiling = results["gpu_only"]["samples_per_s"]
    ratios = {"gpu_busy_fraction": pre["gpu_busy_fraction"],
              "prefetch_vs_no_prefetch": pre["samples_per_s"] / plain_res["samples_per_s"],
              "prefetch_vs_gpu_only": pre["samples_per_s"] / ceiling,
              "loader_vs_gpu_only": results["loader_only"]["samples_per_s"] / ceiling,
              "gpu_only_busy_fraction": results["gpu_only"]["gpu_busy_fraction"],
              "data_wait_fraction": pre["data_wait_s_per_step"] * pre["samples_per_s"] / BATCH,
              "gpu_busy_fraction_thread": results["prefetch_thread"]["gpu_busy_fraction"],
              "prefetch_thread_vs_inline": results["prefetch_thread"]["samples_per_s"] / pre["samples_per_s"]}
    notes = [] if ratios["gpu_busy_fraction"] >= 0.95 else [
        f"target missed: gpu_busy_fraction = {ratios['gpu_busy_fraction']:.3f} (>= 0.95; --prefetch inline, "
        f"the default); with --prefetch thread {ratios['gpu_busy_fraction_thread']:.3f}"]
    config = {"model": "resnet50", "image_size": SIZE, "batch": BATCH, "steps": STEPS, "amp": "fp16",
              "workers": 8}
    write_results("train_gpu", machine=machine, config=config, results=results, ratios=ratios, notes=notes)
