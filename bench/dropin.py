"""Drop-in benchmark: ``CachedImageNet`` against torchvision's own ``ImageFolder``, on users' own code.

All pipelines read the same generated ImageNet-like dataset (``bench.loader.ensure_dataset``: 500x375 q90
JPEGs plus the photos installed packages ship) through a ``DataLoader`` with the same batch size, number of
workers (2: this machine has 2 cores) and seed (``generator=``: every pipeline visits the same order and its
workers get the same seeds), side by side in one run:

* ``imagefolder``: ``torchvision.datasets.ImageFolder(root, train_tf)`` with PyTorch's ImageNet example's
  exact train pipeline ``train_tf`` = ``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``,
  ``ToTensor()``, ``Normalize(mean, std)``; the default collate (``float32 [B, 3, 224, 224]``). Every epoch
  decodes every JPEG.
* ``dropin``: ``CachedImageNet(root, train_tf, cache=...)`` -- only the class name changed. The stored short
  side is derived from the transform (``RandomResizedCrop(224)`` -> 256, :mod:`client.transform_size`); the
  transform receives a PIL image over the cached pixels. ``dropin_warm``: later epochs (all hits);
  ``dropin_cold``: the FIRST epoch on an empty LMDB (read + decode + store in the workers).
* ``fastpath``: the documented fast path: ``CachedImageNet(root, cache=..., short_side=<the same>,
  output="tensor")`` (uint8 tensors, the same records as ``dropin``), ``collate_fn=AugmentCollate(224)``
  (random-resized-crop + flip batched in the workers, a ``uint8 [B, 3, 224, 224]`` channels_last batch),
  then :class:`Normalize` where the batch is used (on this CPU-only machine: the main process):
  ``x.float().sub_(mean).div_(std)`` with the constants times 255 in the batch's shape and memory format --
  ``(x / 255 - mean) / std`` in two in-place passes.

Timing. Each of ``--rounds`` rounds runs one *cold pair* -- an ``imagefolder`` epoch on a fresh DataLoader
(worker start-up included) and a ``dropin_cold`` epoch on a fresh DataLoader over a fresh, empty
``lmdb://<tmp>/cold-<round>`` (start-up included; the order alternates between rounds) -- then
``--warm-epochs`` *warm triples*: one epoch each of ``imagefolder``, ``dropin_warm`` and ``fastpath`` with
persistent workers (started, and the warm cache filled, before the timed part), the order rotating from
triple to triple. Load from other jobs on this shared machine therefore hits every pipeline alike, and each
ratio is the **median of per-pair ratios** (an epoch over the ``imagefolder`` epoch of its own pair/triple);
the ratios of totals and the per-CPU-second rates (main + worker processes; other jobs' load does not change
them) are in ``results`` too. Construction (listing) is timed apart from the epochs, for both classes.

After the timed part :func:`bench.dropin_profile.profile_stages` times every stage of the three pipelines per
sample in this process, one thread (``results.per_sample_ms``): where the time goes.

``python -m bench.dropin`` (full) or ``--quick`` (300 images, batch 32, 1 round: a smoke run) writes
``bench/results/<name>.json`` (``machine``, ``config``, ``results``, ``ratios``, ``notes``) and a PNG,
first in a temporary directory, then moved into place (an interrupted run leaves no half-written file).
torchvision comes from :mod:`datacache.devtools.torchvision_shim` (its pure-Python modules, without the
package ``__init__`` whose compiled operators do not load on CPU torch); workers are forked (the shim is not
inherited by spawned workers).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from bench.common import (
    RESULTS_DIR,
    machine_info,
    print_machine,
    proc_cpu_seconds,
    save_figure,
    write_results,
)
from bench.loader import ensure_dataset, worker_init
from client.augment import AugmentCollate
from client.dataset import CachedImageNet

SIZE = 224
MEAN = (0.485, 0.456, 0.406)  # the ImageNet example's Normalize
STD = (0.229, 0.224, 0.225)
TARGETS = {"dropin_warm_vs_imagefolder": 1.5, "dropin_fastpath_vs_imagefolder": 2.5,
           "dropin_cold_vs_imagefolder": 0.95}
NORMALIZE_RECIPE = ("x.float().sub_(mean).div_(std) (mean, std: 255 x the ImageNet constants, expanded to "
                    "[1, 3, 224, 224] channels_last)")


def torchvision_modules() -> tuple[Any, Any]:
    """``(torchvision.datasets, torchvision.transforms)`` through the dev shim; SystemExit(2) naming why
    torchvision cannot be used here."""
    from datacache.devtools.torchvision_shim import ShimUnavailable, install

    try:
        install()
    except ShimUnavailable as e:
        raise SystemExit(f"bench.dropin: {e}") from None
    import torchvision.datasets as datasets
    import torchvision.transforms as transforms

    return datasets, transforms


def imagenet_train_transform(transforms: Any) -> Any:
    """PyTorch's ImageNet example (``imagenet/main.py``): the training transform, verbatim."""
    normalize = transforms.Normalize(mean=list(MEAN), std=list(STD))
    return transforms.Compose([transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), normalize])


class Normalize:
    """The fast path's normalisation of a ``uint8 [B, 3, size, size]`` channels_last batch (what
    ``AugmentCollate(size)`` yields) where it is used -- the README's recipe:
    ``x.float().sub_(mean).div_(std)`` with ``mean``/``std`` the ImageNet constants times 255, i.e.
    ``(x / 255 - mean) / std`` as two in-place passes over one float copy. The constants are expanded to
    ``[1, 3, size, size]`` in the batch's memory format, so both passes run over memory in order; broadcasting
    ``[1, 3, 1, 1]`` over a channels_last batch (channel innermost) does not vectorise on the CPU. The literal
    expression allocates four float32 batches. Per-sample costs: ``results.per_sample_ms.fastpath_normalize``
    and ``fastpath_normalize_literal``."""

    def __init__(self, device: torch.device, size: int = SIZE) -> None:
        def full(v: tuple[float, ...]) -> torch.Tensor:
            t = torch.tensor(v, device=device).view(1, 3, 1, 1) * 255
            return t.expand(1, 3, size, size).contiguous(memory_format=torch.channels_last)

        self.mean, self.std = full(MEAN), full(STD)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().sub_(self.mean).div_(self.std)


# ------------------------------------------------------------------ loaders and epochs
def make_loader(ds: Dataset, args: argparse.Namespace, *, persistent: bool,
                collate: Any = None) -> DataLoader:
    """The one DataLoader configuration every pipeline uses (same batch, workers, seed)."""
    return DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                      collate_fn=collate, persistent_workers=persistent and args.workers > 0,
                      worker_init_fn=worker_init if args.workers > 0 else None,
                      generator=torch.Generator().manual_seed(args.seed))


def _worker_pids(it: Any) -> list[int]:
    return [w.pid for w in getattr(it, "_workers", []) if w.pid is not None]  # torch-internal, best effort


def time_epoch(loader: DataLoader, n: int, desc: str,
               post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """One epoch: samples/s, seconds, samples and CPU seconds of the main + worker processes. Each batch goes
    through ``post`` (the fast path's normalisation, in this process) and is checked:
    ``float32 [B, 3, 224, 224]``, what a model would receive.

    CPU: this process's own and its reaped children's (a fresh loader's workers are joined, hence reaped,
    when the epoch ends) plus the live workers' (a persistent loader's), each as a delta over the epoch."""
    me = os.getpid()
    t = time.perf_counter()
    main0 = proc_cpu_seconds(me)
    it = iter(loader)  # a fresh loader forks its workers here: their start-up is inside the epoch
    cpu0 = {pid: proc_cpu_seconds(pid, reaped_children=False) for pid in _worker_pids(it)}
    count = 0
    with tqdm(total=n, desc=desc, unit="img", leave=False, file=sys.stdout) as bar:
        for images, labels in it:
            if post is not None:
                images = post(images)
            if images.dtype != torch.float32 or tuple(images.shape[1:]) != (3, SIZE, SIZE):
                raise RuntimeError(f"{desc}: got a {images.dtype} {tuple(images.shape)} batch, expected "
                                   f"float32 [B, 3, {SIZE}, {SIZE}]")
            count += int(labels.numel())
            bar.update(int(labels.numel()))
    dt = time.perf_counter() - t
    del it  # a fresh loader's workers are joined (reaped) by now; a persistent loader keeps its workers
    alive = set(_worker_pids(getattr(loader, "_iterator", None)))
    cpu = proc_cpu_seconds(me) - main0
    for pid, c0 in cpu0.items():  # a reaped worker's whole CPU is in the main's reaped-children count
        cpu += proc_cpu_seconds(pid, reaped_children=False) - c0 if pid in alive else -c0
    return {"samples_per_s": count / dt, "seconds": dt, "samples": count, "cpu_seconds": cpu,
            "samples_per_cpu_s": count / cpu if cpu > 0 else float("nan")}


def _cache_counts(ds: CachedImageNet) -> dict[str, int]:
    st = ds.stats()
    return {k: int(st[k]) for k in ("hits", "misses", "decoded")}


# ------------------------------------------------------------------ the run
def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The timed part (module docstring): returns ``(config, results, notes)``."""
    from bench.dropin_profile import profile_stages

    datasets, transforms = torchvision_modules()
    train_tf = imagenet_train_transform(transforms)
    norm = Normalize(torch.device("cpu"))
    root = ensure_dataset(args.images)
    torch.set_num_threads(1)  # the main process: receives batches (and normalises the fast path's)
    work = tempfile.mkdtemp(prefix="datacache-bench-dropin-")  # removed at the end: only what we made
    results: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        folder_ds = datasets.ImageFolder(root, train_tf)
        results["construct_s"] = {"imagefolder": time.perf_counter() - t}
        n = len(folder_ds)
        t = time.perf_counter()
        dropin = CachedImageNet(root, train_tf, cache=f"lmdb://{work}/warm", short_side=args.short_side,
                                t1_dir=None)
        results["construct_s"]["dropin_empty_cache"] = time.perf_counter() - t
        short_side = dropin.variant.short_side
        fast_ds = CachedImageNet(root, cache=f"lmdb://{work}/warm", short_side=short_side, output="tensor",
                                 t1_dir=None)
        if [tuple(s) for s in dropin.samples] != [tuple(s) for s in folder_ds.samples]:
            raise RuntimeError("CachedImageNet and ImageFolder list different samples; not comparable")
        folder_loader = make_loader(folder_ds, args, persistent=True)
        dropin_loader = make_loader(dropin, args, persistent=True)
        fast_loader = make_loader(fast_ds, args, persistent=True, collate=AugmentCollate(SIZE))
        load_before = os.getloadavg()
        # untimed warm-up: the persistent workers start and the warm cache is filled (the drop-in's epoch 1)
        dropin.reset_stats()
        results["dropin_fill_epoch"] = {**time_epoch(dropin_loader, n, "fill warm cache"),
                                        **_cache_counts(dropin)}
        for loader, what in ((folder_loader, "imagefolder"), (fast_loader, "fastpath")):
            time_epoch(loader, n, f"warm-up {what}", norm if loader is fast_loader else None)

        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in
                                                 ("imagefolder_fresh", "dropin_cold", "imagefolder",
                                                  "dropin_warm", "fastpath")}
        pairs: dict[str, list[float]] = {"dropin_cold_vs_imagefolder": [], "dropin_warm_vs_imagefolder": [],
                                         "dropin_fastpath_vs_imagefolder": []}
        for r in range(args.rounds):
            # the cold pair: both on fresh loaders (worker start-up in both), order alternating by round
            cold_pair: dict[str, dict[str, Any]] = {}
            for what in (("folder", "cold") if r % 2 == 0 else ("cold", "folder")):
                if what == "folder":
                    cold_pair[what] = time_epoch(make_loader(folder_ds, args, persistent=False), n,
                                                 f"round {r + 1} imagefolder (fresh loader)")
                    continue
                t = time.perf_counter()
                cold_ds = CachedImageNet(root, train_tf, cache=f"lmdb://{work}/cold-{r}",
                                         short_side=args.short_side, t1_dir=None)
                construct = time.perf_counter() - t
                ep = time_epoch(make_loader(cold_ds, args, persistent=False), n,
                                f"round {r + 1} dropin cold")
                cold_pair[what] = {**ep, "construct_s": construct, **_cache_counts(cold_ds)}
                del cold_ds
                shutil.rmtree(os.path.join(work, f"cold-{r}"), ignore_errors=True)
            runs["imagefolder_fresh"].append(cold_pair["folder"])
            runs["dropin_cold"].append(cold_pair["cold"])
            pairs["dropin_cold_vs_imagefolder"].append(
                cold_pair["cold"]["samples_per_s"] / cold_pair["folder"]["samples_per_s"])
            # warm triples, persistent workers; the order rotates so no pipeline always runs first
            for e in range(args.warm_epochs):
                trio = [("imagefolder", folder_loader, None, None),
                        ("dropin_warm", dropin_loader, None, dropin),
                        ("fastpath", fast_loader, norm, fast_ds)]
                k = (r * args.warm_epochs + e) % 3
                got: dict[str, dict[str, Any]] = {}
                for name, loader, post, cds in trio[k:] + trio[:k]:
                    if cds is not None:
                        cds.reset_stats()
                    got[name] = time_epoch(loader, n, f"round {r + 1} {name}", post)
                    if cds is not None:
                        got[name].update(_cache_counts(cds))
                for name in ("imagefolder", "dropin_warm", "fastpath"):
                    runs[name].append(got[name])
                base = got["imagefolder"]["samples_per_s"]
                pairs["dropin_warm_vs_imagefolder"].append(got["dropin_warm"]["samples_per_s"] / base)
                pairs["dropin_fastpath_vs_imagefolder"].append(got["fastpath"]["samples_per_s"] / base)
            last = {k: statistics.median(v[-args.warm_epochs:]) for k, v in pairs.items()}
            print(f"round {r + 1}/{args.rounds} (x imagefolder): cold pair "
                  f"{pairs['dropin_cold_vs_imagefolder'][-1]:.2f}, warm "
                  f"{last['dropin_warm_vs_imagefolder']:.2f}, fast path "
                  f"{last['dropin_fastpath_vs_imagefolder']:.2f}")
        load_after = os.getloadavg()
        del folder_loader, dropin_loader, fast_loader  # stops the persistent workers
        for name, eps in runs.items():
            secs = sum(x["seconds"] for x in eps)
            cnt = sum(x["samples"] for x in eps)
            cpu = sum(x["cpu_seconds"] for x in eps)
            results[name] = {"samples_per_s": cnt / secs, "samples_per_cpu_s": cnt / cpu if cpu > 0 else None,
                             "per_epoch": [x["samples_per_s"] for x in eps], "epochs": eps}
        results["pair_ratios"] = pairs
        results["ratio_of_totals"] = {
            "dropin_cold_vs_imagefolder": results["dropin_cold"]["samples_per_s"]
            / results["imagefolder_fresh"]["samples_per_s"],
            "dropin_warm_vs_imagefolder": results["dropin_warm"]["samples_per_s"]
            / results["imagefolder"]["samples_per_s"],
            "dropin_fastpath_vs_imagefolder": results["fastpath"]["samples_per_s"]
            / results["imagefolder"]["samples_per_s"]}
        results["per_cpu_second_ratios"] = _cpu_ratios(results)
        results["load_average"] = {"before": load_before, "after": load_after}
        print("profiling the stages (this process, one thread)")
        results["per_sample_ms"] = profile_stages(root, train_tf, f"lmdb://{work}/profile", short_side,
                                                  samples=args.profile_samples, batch=args.batch_size)
        config = {"images": n, "batch_size": args.batch_size, "workers": args.workers, "rounds": args.rounds,
                  "warm_epochs_per_round": args.warm_epochs, "seed": args.seed,
                  "image_size": SIZE, "source_size": "500x375 q90 (+ shipped photos)", "quick": args.quick,
                  "short_side": short_side, "short_side_given": args.short_side,
                  "variant": dropin.variant.tag(),
                  "train_transform": repr(train_tf),
                  "fastpath": f"output='tensor', AugmentCollate({SIZE}) in the workers, then "
                              f"{NORMALIZE_RECIPE} in the main process (CPU)",
                  "decode_backend": dropin.stats()["decode_backend"],
                  "torchvision": getattr(sys.modules.get("torchvision"), "__version__", "?"),
                  "main_process_torch_threads": torch.get_num_threads()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    notes = _notes(results, args)
    return config, results, notes


def _cpu_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    def rate(name: str) -> float | None:
        return results[name]["samples_per_cpu_s"]

    out: dict[str, float | None] = {}
    for ratio, (a, b) in {"dropin_cold_vs_imagefolder": ("dropin_cold", "imagefolder_fresh"),
                          "dropin_warm_vs_imagefolder": ("dropin_warm", "imagefolder"),
                          "dropin_fastpath_vs_imagefolder": ("fastpath", "imagefolder")}.items():
        ra, rb = rate(a), rate(b)
        out[ratio] = ra / rb if ra and rb else None
    return out


def _notes(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    load = results["load_average"]
    notes = [f"{os.cpu_count()} cores shared with other jobs; 1-min load average {load['before'][0]:.1f} "
             f"before / {load['after'][0]:.1f} after the timed part. Ratios are medians of per-pair ratios "
             f"({args.rounds} cold pairs, {args.rounds * args.warm_epochs} warm triples, interleaved); "
             "ratios of totals and per-CPU-second ratios in results",
             "cold pair: an ImageFolder epoch and a CachedImageNet epoch on an empty LMDB, each on a fresh "
             "DataLoader (worker start-up in both); construction (listing) is timed apart "
             "(results.construct_s, results.dropin_cold.epochs[].construct_s)",
             f"fast path normalisation runs where the batch is used (here: the CPU, main process, "
             f"{torch.get_num_threads()} torch thread): {NORMALIZE_RECIPE}",
             "the JPEGs sit on a local disk and in the OS page cache, so ImageFolder's reads cost no I/O: "
             "the comparison is CPU against CPU (on networked storage ImageFolder pays the read every epoch)"]
    for name, target in TARGETS.items():
        v = statistics.median(results["pair_ratios"][name])
        if v < target:
            notes.append(f"target missed: {name} = {v:.2f} < {target} (per-stage costs: "
                         "results.per_sample_ms)")
    return notes


def _plot(path: str, results: dict[str, Any], ratios: dict[str, float], config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    names = ["imagefolder_fresh", "dropin_cold", "imagefolder", "dropin_warm", "fastpath"]
    labels = ["ImageFolder\n(fresh loader)", "CachedImageNet\ncold epoch", "ImageFolder\n(later epochs)",
              "CachedImageNet\nwarm (drop-in)", "fast path\n(AugmentCollate)"]
    values = [results[k]["samples_per_s"] for k in names]
    colours = ["tab:gray", "tab:orange", "tab:gray", "tab:blue", "tab:green"]
    bars = ax.bar(range(len(names)), values, color=colours)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_title(f"{config['images']} JPEGs 500x375, batch {config['batch_size']}, {config['workers']} "
                 f"workers, short side {config['short_side']}", fontsize=9)
    for k, (name, target) in enumerate(TARGETS.items()):
        pts = results["pair_ratios"][name]
        bx.scatter([k] * len(pts), pts, s=14, alpha=0.6)
        bx.plot([k - 0.3, k + 0.3], [ratios[name]] * 2, color="black")
        bx.plot([k - 0.3, k + 0.3], [target] * 2, color="red", linestyle="--")
    short = {"dropin_warm_vs_imagefolder": "warm\n(drop-in)", "dropin_fastpath_vs_imagefolder": "fast path",
             "dropin_cold_vs_imagefolder": "cold\n(first epoch)"}
    bx.set_xticks(range(len(TARGETS)), [short[name] for name in TARGETS])
    bx.set_ylabel("x ImageFolder (per pair; line: median, red: target)")
    bx.set_title("per-pair ratios", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 images, batch 32, 1 round")
    ap.add_argument("--images", type=int, default=None, help="generated JPEGs (default 2000, quick 300)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 128 (quick 32)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers of every pipeline (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 6, quick 1)")
    ap.add_argument("--warm-epochs", type=int, default=None, help="warm triples a round (default 2, quick 1)")
    ap.add_argument("--seed", type=int, default=0, help="DataLoader generator seed of every pipeline")
    ap.add_argument("--short-side", type=int, default=None,
                    help="cached short side (default: derived from the transform, 256; an exploration knob)")
    ap.add_argument("--profile-samples", type=int, default=None,
                    help="samples of the stage profile (default 256, quick 32)")
    ap.add_argument("--name", default=None, help="results name (default dropin, quick dropin_quick)")
    ap.add_argument("--out-dir", default=None, help=f"where the JSON/PNG go (default {RESULTS_DIR})")
    args = ap.parse_args(argv)
    defaults = {"images": (2000, 300), "batch_size": (128, 32), "rounds": (6, 1), "warm_epochs": (2, 1),
                "profile_samples": (256, 32)}
    for flag, (full, quick) in defaults.items():
        if getattr(args, flag) is None:  # (0 is not "unset": it is refused below)
            setattr(args, flag, quick if args.quick else full)
    for flag in ("images", "batch_size", "rounds", "warm_epochs", "profile_samples", "short_side"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.workers < 0:
        ap.error(f"--workers must be >= 0, got {args.workers}")
    name = args.name or ("dropin_quick" if args.quick else "dropin")
    out_dir = os.path.abspath(args.out_dir) if args.out_dir else str(RESULTS_DIR)
    machine = print_machine(machine_info())
    config, results, notes = run(args)
    ratios = {k: statistics.median(v) for k, v in results["pair_ratios"].items()}
    ratios = {k: ratios[k] for k in TARGETS}
    if not all(math.isfinite(v) for v in ratios.values()):
        raise RuntimeError(f"non-finite ratios: {ratios}")
    for k, v in results["per_sample_ms"].items():
        if isinstance(v, float) and not math.isfinite(v):
            raise RuntimeError(f"non-finite stage time {k}: {v}")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # write, then move: never half-written
        write_results(name, machine=machine, config=config, results=results, ratios=ratios, notes=notes,
                      out_dir=tmp)
        _plot(os.path.join(tmp, name + ".png"), results, ratios, config)
        for ext in (".json", ".png"):
            os.replace(os.path.join(tmp, name + ext), os.path.join(out_dir, name + ext))
    print(f"moved {name}.json / {name}.png into {out_dir}")
    for k, target in TARGETS.items():
        print(f"{k:34s} {ratios[k]:5.2f}  (target >= {target})")
    ms = results["per_sample_ms"]
    names = ("imagefolder", "dropin_cold", "dropin_warm", "fastpath")
    print("per sample, one core (ms): " + ", ".join(f"{k} {ms[k + '_total']:.2f}" for k in names))


if __name__ == "__main__":
    main()
