"""The pipeline users have today, as the reference of ``bench.fashion``'s parity row.

torchvision's ``ImageFolder`` over the same PNG files, its transforms (``RandomCrop(28, padding=4)``,
``RandomHorizontalFlip``, ``ToTensor``, ``Normalize``), a plain ``DataLoader`` with a
``DistributedSampler``, and plain ``DistributedDataParallel`` (no comm hook: its built-in all-reduce).
Only the data path differs from the cache-fed run: the model, its initialisation, the optimizer, the LR
schedule (per step), the loss, the global batch and the seeds are the trainer's own
(:func:`trainer.build.make_model`, :func:`~trainer.build.make_optimizer`, ``TrainConfig.lr_schedule``) from
the same ``--recipe`` and flags. Validation: every rank evaluates its shard of the test split with rank 0's
BatchNorm statistics (as the trainer does), top-1 summed over ranks.

Run one process per rank under ``torchrun`` (``bench.fashion`` launches 2 nodes x 2 ranks on loopback)::

    torchrun --nproc-per-node 4 -m bench.fashion_reference --recipe fashion \\
        --data DIR/train --val-data DIR/val --seed 0 --out runs/reference

Writes ``<out>/metrics.jsonl`` in the trainer's format (``event: epoch`` records with ``val_top1``,
``samples_per_s``, ``data_wait_fraction``, ``seconds``). torchvision's compiled operators do not load on a
CPU-only torch; its pure-Python dataset and transforms are imported through
:mod:`datacache.devtools.torchvision_shim` (fork loader workers, which inherit it). Dev/benchmark only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from datacache.devtools.torchvision_shim import install
from trainer.build import make_model, make_optimizer
from trainer.loop import set_lr
from trainer.metrics import MetricsLog
from trainer.train_config import make_config


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="fashion", help="the trainer recipe whose model/optimizer/schedule "
                    "to use (default fashion)")
    ap.add_argument("--data", required=True, help="training ImageFolder")
    ap.add_argument("--val-data", required=True, help="validation ImageFolder")
    ap.add_argument("--out", required=True, help="directory for metrics.jsonl")
    ap.add_argument("--seed", type=int, default=0, help="model init, sample order and augmentation seed")
    ap.add_argument("--epochs", type=int, default=0, help="epochs (0: the recipe's)")
    ap.add_argument("--steps-per-epoch", type=int, default=0, help="stop each epoch after N steps (0: all)")
    ap.add_argument("--width", type=int, default=0, help="model width (0: the recipe's)")
    ap.add_argument("--workers", type=int, default=-1, help="loader workers per rank (-1: the recipe's)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    given = (("epochs", args.epochs), ("width", args.width), ("steps_per_epoch", args.steps_per_epoch))
    over = {k: v for k, v in given if v > 0}
    if args.workers >= 0:
        over["workers"] = args.workers
    cfg = make_config(args.recipe, data=args.data, val_data=args.val_data, seed=args.seed, device="cpu",
                      out=args.out, **over)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    install()  # torchvision's pure-Python datasets/transforms (see the module docstring)
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    size = cfg.resolution_schedule.at(0)
    mean, std = cfg.normalization
    train_tf = T.Compose([T.RandomCrop(size, padding=cfg.pad), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize(mean, std)])
    val_tf = T.Compose([T.Resize(int(size / cfg.val_crop_fraction)), T.CenterCrop(size), T.ToTensor(),
                        T.Normalize(mean, std)])
    train = datasets.ImageFolder(cfg.data, transform=train_tf)
    val = datasets.ImageFolder(cfg.val_data, transform=val_tf)
    gbs = cfg.global_batch(0, world)
    per_rank = gbs // world
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    torch.manual_seed(cfg.seed + rank)  # the loader's worker seeds (augmentation) derive from it
    loader = DataLoader(train, batch_size=per_rank, sampler=sampler, num_workers=cfg.workers, drop_last=True,
                        persistent_workers=cfg.workers > 0)
    val_idx = list(range(len(val)))[rank::world]
    val_loader = DataLoader(torch.utils.data.Subset(val, val_idx), batch_size=per_rank,
                            num_workers=cfg.workers)
    device = torch.device("cpu")
    model = make_model(cfg, len(train.classes), device)
    ddp = DistributedDataParallel(model)
    optimizer = make_optimizer(cfg, model)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    steps = len(loader) if cfg.steps_per_epoch == 0 else min(len(loader), cfg.steps_per_epoch)
    logger = MetricsLog(cfg.out, enabled=rank == 0)
    logger.write("start", config=cfg.to_dict(), world_size=world, pipeline="torchvision reference",
                 train_samples=len(train), val_samples=len(val))
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        wait = 0.0
        loss_sum = torch.zeros((), dtype=torch.float64)
        it = iter(loader)
        for step in range(steps):
            w0 = time.perf_counter()
            x, y = next(it)
            wait += time.perf_counter() - w0
            set_lr(optimizer, cfg.lr_schedule.at(epoch + step / steps, gbs))
            loss = loss_fn(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        del it
        seconds = time.perf_counter() - t0
        for buf in model.buffers():  # every rank evaluates rank 0's BatchNorm statistics
            dist.broadcast(buf, 0)
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64)  # correct, loss, n
        with torch.no_grad():
            for x, y in val_loader:
                logits = model(x)
                sums[0] += (logits.argmax(1) == y).sum()
                sums[1] += nn.functional.cross_entropy(logits, y, reduction="sum")
                sums[2] += y.numel()
        dist.all_reduce(sums)
        stats = torch.tensor([wait / seconds / world, float(loss_sum) / steps / world], dtype=torch.float64)
        dist.all_reduce(stats)
        rec = {"epoch": epoch, "steps": steps, "global_batch": gbs, "seconds": seconds,
               "samples_per_s": steps * gbs / seconds, "data_wait_fraction": float(stats[0]),
               "loss": float(stats[1]), "val_top1": float(sums[0] / sums[2]),
               "val_loss": float(sums[1] / sums[2]),
               "val_samples": int(sums[2]), "lr": optimizer.param_groups[0]["lr"]}
        logger.write("epoch", **rec)
        logger.say(f"reference epoch {epoch + 1}/{cfg.epochs}  loss {rec['loss']:.4f}  "
                   f"{rec['samples_per_s']:.0f} samples/s  data-wait {100 * rec['data_wait_fraction']:.1f}%  "
                   f"val top1 {100 * rec['val_top1']:.2f}%")
    logger.write("end", epochs=cfg.epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
