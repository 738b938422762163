"""Does the GPU wait for data? ResNet-50 at 224 px fed by datacache beside torchvision's ImageFolder
(issue 38).

On one GPU box (a ``bench.gpu`` check, first in its order) it builds an ImageNet-like folder (100 classes x
120 JPEGs of 500x375 at q90, ~60-150 KB like ImageNet's, plus the photos installed packages ship; written by
every core at once, ``datacache.devtools.synth``), then trains the same model -- ResNet-50, channels_last,
fp16 AMP, SGD, batch 256, ``cudnn.benchmark`` -- fed five ways, one after the other in one process:

* ``gpu_alone``: one batch already on the GPU, over and over (the ceiling);
* ``imagefolder``: torchvision's ``ImageFolder`` + the ImageNet example's train transform
  (``RandomResizedCrop(224)``, flip, ``ToTensor``, ``Normalize``) in a ``DataLoader`` with pinned memory,
  ``num_workers`` the best of a few (each timed, the best reported);
* ``cold``: ``CachedImageNet`` with the same transform on an empty LMDB cache -- its first epoch, decoding
  and filling while it trains;
* ``warm_transforms``: the same dataset's next epoch (every sample from the cache, the same transform);
* ``warm_fast``: the documented fast path on the same cache -- uint8 tensors, batched crop windows
  (``trainer.data.train_loader``), the trainer's prefetcher (side stream) and device augmentation.

Per variant: images/s over ``STEPS`` steps after ``WARMUP``, the GPU busy fraction (CUDA events before and
after each training step, summed, over wall time; the host-to-device copy of a loader's batch counts as
busy), the data-wait fraction (time the host blocked on the next batch, over wall time) and the timeline
between steps (the device's idle gap from one step's end event to the next one's start: mean, p90, max).
Ratios (``_224``): ``input_warm_fast_vs_imagefolder`` (target >= 2.0 where ImageFolder is input-bound, i.e.
``imagefolder_vs_gpu_alone`` < 0.95), ``gpu_busy_warm_fast`` (>= 0.97), ``gpu_busy_warm_transforms``
(reported), ``input_cold_vs_imagefolder`` (>= 0.9). Writes ``bench/results/gpu_input_gpu.json`` and a PNG.

``--smoke`` runs the same code on the CPU in seconds (4 classes x 8 images, 64 px, batch 8, the trainer's
small CIFAR ResNet, 3 steps; torchvision through the dev shim) and writes ``gpu_input_smoke.json``: CI runs
it (``tests/test_bench_gpu_input.py``), so the GPU run has no untried code path but the CUDA events.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.common import RESULTS_DIR, print_machine, write_results
from bench.dropin import imagenet_train_transform, torchvision_modules
from client.dataset import CachedImageNet
from datacache.config import user_cache_dir
from datacache.devtools import synth
from trainer.build import make_amp, make_ddp, make_model, make_optimizer
from trainer.data import DistributedBatchSampler, train_loader
from trainer.device_augment import DeviceAugment
from trainer.loop import StepContext, train_step
from trainer.prefetch import Prefetcher
from trainer.train_config import make_config

TARGETS = {"input_warm_fast_vs_imagefolder": 2.0, "gpu_busy_warm_fast": 0.97,
           "input_cold_vs_imagefolder": 0.9}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One mode of the benchmark: the GPU run or the CPU smoke run."""

    name: str  # results file stem
    device: str
    size: int  # training resolution
    batch: int
    steps: int  # timed steps per variant
    warmup: int  # untimed steps first (cudnn.benchmark's search, worker start-up)
    classes: int
    per_class: int
    model: dict[str, Any]  # make_config's model arguments
    amp: str
    worker_choices: tuple[int, ...]  # ImageFolder's DataLoader: each timed, the best reported


# 12,000 images: 46 batches of 256 an epoch (the cold run times 36 of its first epoch's); generated in ~30 s
GPU = Setup("gpu_input_gpu", "cuda", 224, 256, 30, 6, 100, 120, {"model": "resnet50"}, "fp16", (8, 16))
SMOKE = Setup("gpu_input_smoke", "cpu", 64, 8, 3, 1, 4, 8,
              {"model": "small_resnet_cifar", "width": 4, "zero_init_residual": False}, "off", (0, 2))


def ensure_folder(setup: Setup) -> str:
    """The generated ImageNet-like folder, made once per machine (published atomically) by every core."""
    root = os.path.join(user_cache_dir(), "datacache", "bench", "published",
                        f"gpu-input-{setup.classes}x{setup.per_class}-500x375")
    if not os.path.isdir(root):
        t = time.perf_counter()
        synth.ensure_imagefolder(root, classes=setup.classes, per_class=setup.per_class, size=(500, 375),
                                 quality=90, include_real_photos=True, progress=True,
                                 workers=os.cpu_count() or 1)
        print(f"generated {root} in {time.perf_counter() - t:.0f} s")
    return root


class Clock:
    """Spans of training steps: CUDA events on a GPU (read after the run: no sync per step), wall time on
    the CPU (where a step is synchronous)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: list[Any] = []

    def time(self, fn: Callable[[], object]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.spans.append((start, end))
        else:
            t = time.perf_counter()
            fn()
            self.spans.append((time.perf_counter() - t, t))  # (duration, start)

    def busy_s(self) -> float:
        if self.cuda:
            return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3
        return float(sum(s for s, _ in self.spans))

    def gaps_ms(self) -> list[float]:
        """The timeline between steps: how long the device sat idle from one step's end to the next one's
        start (on a GPU from the events; where the busy fraction is lost when the steps themselves are
        dense)."""
        if self.cuda:
            return [e.elapsed_time(s) for (_, e), (s, _) in zip(self.spans, self.spans[1:])]
        return [1e3 * (b[1] - (a[1] + a[0])) for a, b in zip(self.spans, self.spans[1:])]


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()  # host sync: only at the edges of a timed run


def timed(step: Callable[[Any], object], batches: Iterator[Any], setup: Setup) -> dict[str, float]:
    """``setup.steps`` steps after ``setup.warmup``: images/s, GPU busy fraction, data-wait fraction."""
    cuda = setup.device == "cuda"
    clock, wait, t0 = Clock(cuda), 0.0, 0.0
    for k in range(setup.warmup + setup.steps):
        if k == setup.warmup:
            sync(cuda)
            clock.spans.clear()
            wait, t0 = 0.0, time.perf_counter()
        t = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - t
        clock.time(lambda b=batch: step(b))
    sync(cuda)
    wall = time.perf_counter() - t0
    close = getattr(batches, "close", None)
    if close is not None:  # a forever() generator: its loader and workers go now, not during the next run
        close()
    gaps = sorted(clock.gaps_ms())
    return {"images_per_s": setup.steps * setup.batch / wall,
            "gpu_busy_fraction": min(1.0, clock.busy_s() / wall), "data_wait_fraction": wait / wall,
            "wall_s": wall, "idle_gap_ms": {"mean": sum(gaps) / max(1, len(gaps)),
                                            "p90": gaps[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
                                            "max": gaps[-1] if gaps else 0.0}}


def forever(make: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """Epoch after epoch of ``make()`` (a fresh iterator each time)."""
    while True:
        yield from make()


def run(setup: Setup, workdir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The five variants (module docstring); returns ``(config, results)``."""
    from trainer.distenv import init_distributed

    datasets, transforms = torchvision_modules()
    train_tf = imagenet_train_transform(transforms)
    if setup.size != 224:  # (the smoke run: the same transform at its size)
        train_tf.transforms[0] = transforms.RandomResizedCrop(setup.size)
    # HAZARD (fork): the generator forks its writers -- so before CUDA is initialised below
    root = ensure_folder(setup)
    info = init_distributed(setup.device)
    dev = info.device
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    # channels_last on the GPU only: on the CPU (the smoke run) torch 2.13's backward of this model in
    # channels_last hung or crashed (SIGSEGV) in 4 of 4 tries here, and the smoke run times nothing
    fmt = torch.channels_last if cuda else torch.contiguous_format
    folder = datasets.ImageFolder(root, train_tf)
    cfg = make_config(**setup.model, resolution=str(setup.size), batch_size=str(setup.batch), amp=setup.amp,
                      device=setup.device, channels_last="on" if cuda else "off", epochs=100, progress=False)
    model = make_model(cfg, len(folder.classes), dev)
    ddp, state = make_ddp(model, cfg, dev)
    aug = DeviceAugment(memory_format=fmt)
    ctx = StepContext(ddp, make_optimizer(cfg, model), state, make_amp(cfg, dev), nn.CrossEntropyLoss(), aug,
                      dev, cfg.lr_schedule)

    def step_on_host_batch(batch: Any) -> None:  # a loader's float batch: copied, then the training step
        x, y = batch
        x = x.to(dev, non_blocking=True).contiguous(memory_format=fmt)
        train_step(ctx, x, y.to(dev, non_blocking=True), 0.1)

    def step_on_device_batch(batch: Any) -> None:
        train_step(ctx, batch[0], batch[1], 0.1)

    def loader(ds: Any, workers: int) -> DataLoader:
        return DataLoader(ds, batch_size=setup.batch, shuffle=True, num_workers=workers, pin_memory=cuda,
                          drop_last=True, persistent_workers=workers > 0,
                          generator=torch.Generator().manual_seed(0))

    results: dict[str, Any] = {"images": len(folder)}
    # 1. the GPU alone on one resident batch
    x0, y0 = next(iter(loader(folder, 0)))
    resident = (x0.to(dev).contiguous(memory_format=fmt), y0.to(dev))
    results["gpu_alone"] = timed(step_on_device_batch, forever(lambda: [resident]), setup)
    # 2. ImageFolder: each worker count timed, the best kept
    tried = {}
    for w in setup.worker_choices:
        tried[w] = timed(step_on_host_batch, forever(lambda w=w: loader(folder, w)), setup)
        print(f"imagefolder, {w} workers: {tried[w]['images_per_s']:.0f} images/s")
    best = max(tried, key=lambda w: tried[w]["images_per_s"])
    results["imagefolder"] = {**tried[best], "num_workers": best,
                              "tried": {str(w): r["images_per_s"] for w, r in tried.items()}}
    # 3-4. datacache with the same transform: the cold first epoch, then a warm one
    cache = f"lmdb://{workdir}/cache"
    dropin = CachedImageNet(root, train_tf, cache=cache, t1_dir=None)
    cold_loader = loader(dropin, best)
    cold_iter = iter(cold_loader)
    results["cold"] = timed(step_on_host_batch, cold_iter, setup)
    for _ in cold_iter:  # the rest of the first epoch (untimed): every sample cached
        pass
    results["cold"]["cache"] = dropin.stats()
    results["warm_transforms"] = timed(step_on_host_batch, forever(lambda loader=cold_loader: loader), setup)
    del cold_iter, cold_loader  # (its persistent workers end here)
    # 5. the fast path on the same records
    fast = CachedImageNet(root, cache=cache, short_side=dropin.variant.short_side, output="tensor",
                          t1_dir=None)
    sampler = DistributedBatchSampler(list(range(len(fast))), 1, 0, seed=0)
    fast_loader = train_loader(fast, sampler, workers=best, seed=0, pin_memory=cuda)
    epoch = [0]

    def prefetched() -> Iterable[Any]:
        sampler.set_epoch(epoch[0], setup.batch)
        epoch[0] += 1
        return Prefetcher(fast_loader, dev, aug, setup.size)

    results["warm_fast"] = timed(step_on_device_batch, forever(prefetched), setup)
    results["warm_fast"]["cache"] = fast.stats()
    config = {"model": setup.model["model"], "image_size": setup.size, "batch": setup.batch,
              "steps": setup.steps, "warmup": setup.warmup, "amp": setup.amp, "channels_last": cuda,
              "images": len(folder),
              "source": "500x375 q90 generated (+ shipped photos)", "short_side": dropin.variant.short_side,
              "cpu_cores": os.cpu_count()}
    return config, results


def ratios_of(results: dict[str, Any], size: int) -> dict[str, float]:
    rate = {k: v["images_per_s"] for k, v in results.items() if isinstance(v, dict) and "images_per_s" in v}
    out = {
        "input_warm_fast_vs_imagefolder": rate["warm_fast"] / rate["imagefolder"],
        "input_warm_transforms_vs_imagefolder": rate["warm_transforms"] / rate["imagefolder"],
        "input_cold_vs_imagefolder": rate["cold"] / rate["imagefolder"],
        "imagefolder_vs_gpu_alone": rate["imagefolder"] / rate["gpu_alone"],
        "warm_fast_vs_gpu_alone": rate["warm_fast"] / rate["gpu_alone"],
        "gpu_busy_warm_fast": results["warm_fast"]["gpu_busy_fraction"],
        "gpu_busy_warm_transforms": results["warm_transforms"]["gpu_busy_fraction"],
        "gpu_busy_imagefolder": results["imagefolder"]["gpu_busy_fraction"],
        "gpu_busy_gpu_alone": results["gpu_alone"]["gpu_busy_fraction"],
    }
    return {f"{k}_{size}": v for k, v in out.items()}


def notes_of(ratios: dict[str, float], size: int) -> list[str]:
    notes = []
    bound = ratios[f"imagefolder_vs_gpu_alone_{size}"] < 0.95
    for name, target in TARGETS.items():
        got = ratios[f"{name}_{size}"]
        if name == "input_warm_fast_vs_imagefolder" and not bound:
            notes.append(f"{name}_{size} = {got:.2f}: ImageFolder was not input-bound here (it reached "
                         f"{ratios[f'imagefolder_vs_gpu_alone_{size}']:.2f} of the GPU-alone ceiling)")
            continue
        verdict = "met" if got >= target else "MISSED"
        notes.append(f"{name}_{size} = {got:.3f} (target >= {target}): {verdict}")
    return notes


def plot(path: str, results: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["gpu_alone", "imagefolder", "cold", "warm_transforms", "warm_fast"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(names, [results[n]["images_per_s"] for n in names], color="tab:blue")
    a.set_ylabel("images/s")
    b.bar(names, [results[n]["gpu_busy_fraction"] for n in names], color="tab:green")
    b.set_ylabel("GPU busy fraction")
    b.set_ylim(0, 1.05)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="ResNet-50 at 224 px on one GPU fed by datacache beside "
                                 "torchvision's ImageFolder: images/s, GPU busy and data-wait fractions (see "
                                 "the module docstring); --smoke: the same code on the CPU in seconds")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke run (tiny data and model): writes gpu_input_smoke.json")
    ap.add_argument("--out", default=str(RESULTS_DIR),
                    help="folder for the JSON and PNG (default bench/results)")
    args = ap.parse_args(argv)
    setup = SMOKE if args.smoke else GPU
    if setup.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gpu_input: no CUDA device here; --smoke runs the CPU smoke mode")
    machine = print_machine()
    work = tempfile.mkdtemp(prefix="datacache-bench-gpu-input-")  # removed at the end: only what we made
    try:
        config, results = run(setup, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = ratios_of(results, setup.size)
    notes = notes_of(ratios, setup.size)
    if torch.cuda.is_available():
        notes.insert(0, f"device: {torch.cuda.get_device_name(0)}")
    for line in notes:
        print(line)
    write_results(setup.name, machine=machine, config=config, results=results, ratios=ratios, notes=notes,
                  out_dir=args.out)
    plot(os.path.join(args.out, f"{setup.name}.png"), results,
         f"{config['model']} {setup.size} px, batch {setup.batch}, {config['images']} images, "
         f"{config['cpu_cores']} cores")


if __name__ == "__main__":
    main()
