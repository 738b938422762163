"""Training benchmark: end-to-end CPU training at 64 px from an NFS stand-in, naive loader vs warm cache,
and the warm loader alone (host crop) vs today's CPU resize vs the copy-only ceiling.

Data: the generated ImageNet-like dataset of ``bench.loader`` (2,003 JPEGs, 500x375 q90, 20
classes + shipped photos) served through ``slowfile://`` with 5 ms per request and a 50 MB/s link
per process (the documented NFS stand-in, :mod:`datacache.devtools.slowfs`). Everything runs in one
process group of one rank on this machine's cores, 2 loader workers per pipeline.

Part 1 -- end-to-end training (``trainer.loop.train_epoch``: prefetcher, device augmentation,
DDP + comm hook, SGD), ``small_resnet`` width 32 at 64 px, batch 128, pipelines interleaved
epoch by epoch over ``ROUNDS`` rounds so other jobs' load drifts over all alike:

* ``naive``: a torchvision-style per-sample pipeline in the workers: read the JPEG through
  ``slowfile://`` (5 ms + transfer), PIL decode, RandomResizedCrop + resize to 64 + flip in PIL,
  uint8 batch; the device only normalises. Every epoch reads and decodes every file.
* ``warm_cpu_resize``: ``CachedImageNet`` hits, RRC + resize in the workers (``AugmentCollate``,
  the path before this benchmark's issue).
* ``warm``: ``CachedImageNet`` hits, workers cut crop windows only (``CropCollate``), the
  "device" (the CPU here) resizes, flips and normalises the batch (``DeviceAugment``).

``train_warm_vs_naive`` = warm / naive training samples/s (target >= 2); ``data_wait_fraction``
= the time the warm loop waited for its loader over its step time (target < 0.05).

Part 2 -- the warm loader alone (no training), batch 256, 3 rounds of 5 epochs per loader,
alternating loaders epoch by epoch: ``crop`` (host crop, CropCollate),
``cpu_resize`` (AugmentCollate at 64 px) and ``copy_ceiling`` (a collate that only copies a
64x64 window of each record into the batch: the least work that yields a batch);
``loader_vs_copy_ceiling`` = crop / copy_ceiling (target >= 0.85).

The cache holds the variant a 64-px run would cache (short side 80; ``--short-side``). A GPU part
(ResNet-50 at 128 px, GPU busy fraction with and without the prefetcher) runs only where CUDA
is available and writes ``train_gpu.json``. ``python -m bench.train [--quick]``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import time
from typing import Any

import fsspec
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.common import RESULTS_DIR, machine_info, print_machine, save_figure, write_results
from bench.loader import ensure_dataset, pil_rrc_flip
from client.augment import AugmentCollate, untag
from client.crop import TaggedDataset, pack_windows
from client.dataset import CachedImageNet
from datacache.config import user_cache_dir
from datacache.manifest import Manifest
from trainer.build import make_amp, make_ddp, make_model, make_optimizer
from trainer.data import DistributedBatchSampler, train_loader, worker_kwargs
from trainer.device_augment import DeviceAugment
from trainer.distenv import init_distributed
from trainer.loop import StepContext, train_epoch
from trainer.train_config import make_config

SIZE = 64
ROUNDS = 2
LATENCY_MS, MBPS = 5.0, 50.0


class NaiveSlowDataset:
    """Per-sample torchvision-style pipeline reading through ``slowfile://`` (see the docstring)."""

    def __init__(self, root: str) -> None:
        man = Manifest.build(root)
        self.base = man.root[len("file://"):]
        self.paths = list(man.paths)
        self.labels = man.labels
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._fs is None:  # per process (fork boundary): each worker has its own 50 MB/s link
            self._fs = fsspec.filesystem("slowfile", latency_ms=LATENCY_MS, mbps=MBPS)
        data = self._fs.cat_file(os.path.join(self.base, self.paths[i]))
        return pil_rrc_flip(io.BytesIO(data), SIZE), int(self.labels[i])


def _stack(data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _, samples = untag(data)
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples], dtype=torch.int64)


class CopyWindowCollate:
    """Copy-only ceiling: the top-left SIZE x SIZE window of each record into one uint8 batch, with
    the same copy routine as the host crop (``pack_windows``): what any loader must at least do."""

    def __call__(self, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _, batch = untag(data)
        windows = [(0, 0, min(SIZE, int(img.shape[1])), min(SIZE, int(img.shape[2]))) for img, _ in batch]
        pixels = pack_windows([img for img, _ in batch], windows)
        return pixels, torch.tensor([lab for _, lab in batch], dtype=torch.int64)


def _loader(ds: Any, sampler: Any, collate: Any, workers: int) -> DataLoader:
    # workers start like the trainer's (a forkserver: this process is multithreaded by then)
    return DataLoader(TaggedDataset(ds), batch_sampler=sampler, num_workers=workers, collate_fn=collate,
                      prefetch_factor=4, **worker_kwargs(workers))


def _loader_rate(loader: DataLoader, sampler: DistributedBatchSampler, epoch: int,
                 batch: int) -> tuple[float, int]:
    sampler.set_epoch(epoch, batch)
    n = 0
    t = time.perf_counter()
    for out in loader:
        n += len(out) if not isinstance(out, tuple) else int(out[1].shape[0])
    return n / (time.perf_counter() - t), n


def loader_part(ds: CachedImageNet, workers: int, batch: int, rounds: int, epochs: int) -> dict[str, Any]:
    """Each round: ``epochs`` epochs of every loader, alternating loader by loader epoch by epoch
    (one epoch of 2,003 samples lasts ~0.1 s: a single one is mostly start-up noise)."""
    idx = list(range(len(ds)))
    samplers = {k: DistributedBatchSampler(idx, 1, 0, seed=1) for k in ("crop", "cpu_resize", "copy_ceiling")}
    for s in samplers.values():
        s.set_epoch(0, batch)
    loaders = {"crop": train_loader(ds, samplers["crop"], workers=workers, seed=1),
               "cpu_resize": _loader(ds, samplers["cpu_resize"], AugmentCollate(SIZE, seed=1), workers),
               "copy_ceiling": _loader(ds, samplers["copy_ceiling"], CopyWindowCollate(), workers)}
    for name, ld in loaders.items():  # start the persistent workers outside the timed epochs
        _loader_rate(ld, samplers[name], 0, batch)
    spent = {k: [0.0, 0] for k in loaders}
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    for r in range(rounds):
        for name in loaders:
            spent[name] = [0.0, 0]
        for e in range(epochs):
            for name, ld in loaders.items():
                rate, n = _loader_rate(ld, samplers[name], 1 + r * epochs + e, batch)
                spent[name][0] += n / rate
                spent[name][1] += n
        for name in loaders:
            rates[name].append(spent[name][1] / spent[name][0])
            print(f"loader {name:<13} round {r + 1}: {rates[name][-1]:8.0f} samples/s")
    return {k: {"samples_per_s": float(np.mean(v)), "per_round": v} for k, v in rates.items()}


def training_part(ds: CachedImageNet, root: str, workers: int, batch: int, rounds: int, width: int,
                  quick: bool) -> dict[str, Any]:
    init_distributed("cpu")
    cfg = make_config(model="small_resnet", width=width, resolution=str(SIZE), batch_size=str(batch),
                      optimizer="sgd", lr=0.1, lr_scaling="none", epochs=100, device="cpu", progress=False)
    dev = torch.device("cpu")
    model = make_model(cfg, len(ds.classes), dev)
    ddp, state = make_ddp(model, cfg, dev)
    ctx = StepContext(ddp, make_optimizer(cfg, model), state, make_amp(cfg, dev), nn.CrossEntropyLoss(),
                      DeviceAugment(), dev, cfg.lr_schedule)
    idx = list(range(len(ds)))
    samplers = {k: DistributedBatchSampler(idx, 1, 0, seed=2) for k in ("naive", "warm_cpu_resize", "warm")}
    cpu_resize = AugmentCollate(SIZE, seed=2)
    loaders = {"naive": _loader(NaiveSlowDataset(root), samplers["naive"], _stack, workers),
               "warm_cpu_resize": _loader(ds, samplers["warm_cpu_resize"], cpu_resize, workers),
               "warm": train_loader(ds, samplers["warm"], workers=workers, seed=2)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in loaders}
    epoch = 0
    for r in range(rounds + 1):  # round 0 starts the persistent workers and is not counted
        for name, ld in loaders.items():
            s = samplers[name]
            s.set_epoch(epoch, batch, max_steps=3 if r == 0 or quick else 0)
            st = train_epoch(ctx, ld, epoch=epoch, resolution=SIZE, global_batch=batch,
                             steps_in_epoch=s.steps_in_epoch())
            epoch += 1
            if r == 0:
                continue
            runs[name].append({"samples_per_s": st.samples_per_s, "data_wait_fraction": st.data_wait_fraction,
                               "seconds": st.seconds, "samples": st.samples, "augment_s": st.augment_s,
                               "loss": st.loss})
            print(f"train {name:<16} round {r}: {st.samples_per_s:7.0f} samples/s, data-wait "
                  f"{100 * st.data_wait_fraction:5.1f}%, device augment {st.augment_s:.2f} s of "
                  f"{st.seconds:.1f} s")
    out = {}
    for name, eps in runs.items():
        secs = sum(e["seconds"] for e in eps)
        out[name] = {"samples_per_s": sum(e["samples"] for e in eps) / secs,
                     "data_wait_fraction": sum(e["data_wait_fraction"] * e["seconds"] for e in eps) / secs,
                     "epochs": eps}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (300 images, 3 steps per epoch)")
    ap.add_argument("--images", type=int, default=None, help="generated JPEGs (default 2000, quick 300)")
    ap.add_argument("--workers", type=int, default=2, help="loader workers per pipeline (default 2)")
    ap.add_argument("--short-side", type=int, default=80, help="cached variant's short side (default 80)")
    ap.add_argument("--width", type=int, default=32, help="small_resnet width (default 32)")
    args = ap.parse_args(argv)
    n_images = args.images or (300 if args.quick else 2000)
    machine = print_machine(machine_info())
    root = ensure_dataset(n_images)
    cache_dir = os.path.join(user_cache_dir(), "datacache", "bench", "train-lmdb")
    shutil.rmtree(cache_dir, ignore_errors=True)
    url = f"slowfile://{root}"
    ds = CachedImageNet(url, cache="lmdb://" + cache_dir, short_side=args.short_side, t1_dir=None,
                        storage_options={"latency_ms": LATENCY_MS, "mbps": MBPS})
    # cold epoch: fill the cache through the NFS stand-in (the loader's workers decode and write back)
    cold_sampler = DistributedBatchSampler(list(range(len(ds))), 1, 0, seed=0)
    cold_loader = train_loader(ds, cold_sampler, workers=args.workers, seed=0)
    cold_rate, _ = _loader_rate(cold_loader, cold_sampler, 0, 128)
    print(f"cold fill through slowfile:// ({LATENCY_MS:g} ms, {MBPS:g} MB/s): {cold_rate:.0f} samples/s")
    for k in range(0, len(ds), 256):  # the samples the cold epoch's last, dropped, partial batch left out
        ds.__getitems__(list(range(k, min(k + 256, len(ds)))))
    ds.reset_stats()
    results: dict[str, Any] = {"cold_fill_samples_per_s": cold_rate}
    rounds = 1 if args.quick else ROUNDS
    results["train"] = training_part(ds, root, args.workers, 128, rounds, args.width, args.quick)
    results["loader"] = loader_part(ds, args.workers, 256, 1 if args.quick else 3, 1 if args.quick else 5)
    st = ds.stats()
    results["warm_cache"] = {"hits": st["hits"], "misses": st["misses"], "decoded": st["decoded"]}
    tr, ld = results["train"], results["loader"]
    ratios = {
        "train_warm_vs_naive": tr["warm"]["samples_per_s"] / tr["naive"]["samples_per_s"],
        "data_wait_fraction": tr["warm"]["data_wait_fraction"],
        "loader_vs_copy_ceiling": ld["crop"]["samples_per_s"] / ld["copy_ceiling"]["samples_per_s"],
        "cpu_resize_loader_vs_copy_ceiling": (ld["cpu_resize"]["samples_per_s"]
                                              / ld["copy_ceiling"]["samples_per_s"]),
        "train_warm_vs_warm_cpu_resize": tr["warm"]["samples_per_s"] / tr["warm_cpu_resize"]["samples_per_s"],
        "naive_data_wait_fraction": tr["naive"]["data_wait_fraction"],
    }
    notes = [f"{os.cpu_count()} cores shared by the training process and its loader workers (and other "
             "jobs): absolute rates are noisy; pipelines ran interleaved epoch by epoch",
             f"NFS stand-in: slowfile:// with {LATENCY_MS:g} ms per request and {MBPS:g} MB/s per process",
             "no GPU here: the device augmentation and the model run on the same CPU cores as the loader, "
             "train_gpu.json (ResNet-50 at 128 px) is only written where CUDA is available"]
    targets = {"train_warm_vs_naive": (2.0, "min"), "data_wait_fraction": (0.05, "max"),
               "loader_vs_copy_ceiling": (0.85, "min")}
    for name, (target, kind) in targets.items():
        v = ratios[name]
        if (kind == "min" and v < target) or (kind == "max" and v >= target):
            notes.append(f"target missed: {name} = {v:.3f} ({'>=' if kind == 'min' else '<'} {target})")
    config = {"images": len(ds), "image_size": SIZE, "short_side": args.short_side, "workers": args.workers,
              "model": f"small_resnet width {args.width}", "train_batch": 128, "loader_batch": 256,
              "rounds": ROUNDS, "latency_ms": LATENCY_MS, "mbps": MBPS, "quick": args.quick,
              "threads": torch.get_num_threads()}
    name = "train" if not args.quick else "train_quick"
    write_results(name, machine=machine, config=config, results=results, ratios=ratios, notes=notes)
    _plot(RESULTS_DIR / f"{name}.png", results)
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        from bench.train_gpu import gpu_part

        gpu_part(url, "lmdb://" + cache_dir, {"latency_ms": LATENCY_MS, "mbps": MBPS}, machine)


def _plot(path: Any, results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tr, ld = results["train"], results["loader"]
    # blue: host crop + device resize; orange: resize in the loader workers; gray: the references
    panels = ((axes[0], ["naive", "warm_cpu_resize", "warm"], tr, "training at 64 px (samples/s)",
               ["tab:gray", "tab:orange", "tab:blue"]),
              (axes[1], ["crop", "cpu_resize", "copy_ceiling"], ld, "warm loader alone (samples/s)",
               ["tab:blue", "tab:orange", "tab:gray"]))
    for ax, keys, res, title, colors in panels:
        vals = [res[k]["samples_per_s"] for k in keys]
        bars = ax.bar(range(len(keys)), vals, color=colors)
        ax.set_xticks(range(len(keys)), keys)
        ax.set_title(title)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
