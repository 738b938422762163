"""GPU part of the training benchmark (run by ``python -m bench.train`` when CUDA is available).

ResNet-50 at 128 px (channels_last, fp16 AMP + GradScaler, SGD) from a warm cache of short side
160, one GPU, batch 256: the same loader with and without the prefetcher. GPU busy fraction =
the summed span of each step's work on the compute stream (CUDA events recorded before the
forward and after the optimizer step) over the wall time of the timed steps -- a gap in which
the GPU waits for the host inside a step counts as busy, so it is an upper bound; the gaps
between steps (the loader, a synchronous copy) are what the prefetcher removes. Writes
``bench/results/train_gpu.json`` (ratios ``gpu_busy_fraction`` (target >= 0.95) and
``prefetch_vs_no_prefetch``). Not run on the development machine (no GPU there).
"""

from __future__ import annotations

import time
from typing import Any

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
    results: dict[str, Any] = {}

    def endless(make: Any) -> Any:
        epoch = 1
        while True:
            sampler.set_epoch(epoch, BATCH)
            yield from make()
            epoch += 1

    results["prefetch"] = _run(ctx, endless(lambda: Prefetcher(warm, dev, aug, SIZE)), STEPS)
    plain = train_loader(ds, sampler, workers=8, seed=0, pin_memory=False)
    results["no_prefetch"] = _run(ctx, endless(lambda: _synchronous(plain, aug, dev)), STEPS)
    pre, plain_res = results["prefetch"], results["no_prefetch"]
    ratios = {"gpu_busy_fraction": pre["gpu_busy_fraction"],
              "prefetch_vs_no_prefetch": pre["samples_per_s"] / plain_res["samples_per_s"]}
    notes = [] if ratios["gpu_busy_fraction"] >= 0.95 else [
        f"target missed: gpu_busy_fraction = {ratios['gpu_busy_fraction']:.3f} (>= 0.95)"]
    config = {"model": "resnet50", "image_size": SIZE, "batch": BATCH, "steps": STEPS, "amp": "fp16",
              "workers": 8}
    write_results("train_gpu", machine=machine, config=config, results=results, ratios=ratios, notes=notes)
