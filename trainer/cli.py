"""``python -m trainer`` / ``datacache-train``: train, sweep, render the digits and Fashion-MNIST datasets.

Exit codes: 0 ok, 2 usage or configuration error (one line, ``datacache-train: error: ...``), 1 any
other error. The training flags are generated from :class:`trainer.train_config.TrainConfig`'s fields
(``--batch-size`` for ``batch_size``, ``--flip/--no-flip`` for booleans), so the help below is the
config's own documentation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from datacache.config import ConfigError
from datacache.options import parse_bool
from trainer.train_config import RECIPES, TrainConfig, make_config

PROG = "datacache-train"
EPILOG = textwrap.dedent("""\
    examples:
      # one node, 8 GPUs, the DAWNBench schedule from a warm cache
      torchrun --nproc-per-node 8 -m trainer --recipe dawnbench \\
          --data /mnt/nfs/imagenet/train --val-data /mnt/nfs/imagenet/val --cache lmdb:///local/cache
      # 2 nodes x 4 GPUs (run on each node with its --node-rank)
      torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr node0 --master-port 29500 \\
          -m trainer --data ... --comm 0:hitopk,13:torus --optimizer lars --pto
      # CPU: a small ResNet on the digits data set
      datacache-train digits /tmp/digits && datacache-train --recipe digits \\
          --data /tmp/digits/train --val-data /tmp/digits/val --cache lmdb:///tmp/digits-cache --device cpu
      # CPU: Fashion-MNIST (Debian's dataset-fashion-mnist), 2 nodes x 2 ranks' worth on one machine
      datacache-train fashion /tmp/fashion && torchrun --nproc-per-node 4 -m trainer --recipe fashion \
          --data /tmp/fashion/train --val-data /tmp/fashion/val --cache lmdb:///tmp/fashion-cache --device cpu
      # a sweep on one warm cache: runs one after another, each prints its first-epoch data rate
      datacache-train sweep --grid lr=0.1,0.2,0.4 --recipe digits --data /tmp/digits/train ...
    """)


def _field_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field; defaults are SUPPRESSed so only explicit flags override a recipe."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        group = groups.setdefault(f.metadata["group"], p.add_argument_group(f.metadata["group"]))
        default = getattr(defaults, f.name)
        help_text = f"{f.metadata['help']} (default: {default!r})"
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text, "dest": f.name}
        if isinstance(default, bool):
            group.add_argument(_field_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
            continue
        if f.metadata["choices"]:
            kw["choices"] = f.metadata["choices"]
        group.add_argument(_field_flag(f.name), type=type(default), **kw)


def _convert(name: str, text: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    key = name.replace("-", "_")
    if key not in fields:
        raise ConfigError(f"--grid {name}: not a training option; valid: {', '.join(sorted(fields))}")
    kind = type(getattr(TrainConfig(), key))
    if kind is bool:
        return parse_bool(text, f"--grid {name}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"--grid {name}={text}: expected a {kind.__name__}") from None


def grid_configs(base: dict[str, Any], grid: Sequence[str]) -> list[tuple[str, TrainConfig]]:
    """``--grid KEY=V1,V2`` (repeatable) -> the product of the value lists, one config each, with
    ``out`` set to ``<out>/<i>-<key>=<value>...``."""
    axes: list[tuple[str, list[Any]]] = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,... such as lr=0.1,0.2,0.4")
        axes.append((key.replace("-", "_"), [_convert(key, v) for v in values.split(",")]))
    runs = []
    out = base.get("out", TrainConfig().out)
    for i, combo in enumerate(itertools.product(*(vals for _, vals in axes))):
        over = dict(zip((k for k, _ in axes), combo))
        label = "-".join(f"{k}={v}" for k, v in over.items())
        runs.append((label, make_config(**{**base, **over, "out": os.path.join(out, f"{i:02d}-{label}")})))
    return runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Train on CachedImageNet with DDP, the comm hooks "
                                "and LARS/LAMB/SGD; run under torchrun (or alone: one rank).", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    sub = p.add_subparsers(dest="command", metavar="{train,sweep,digits,fashion}")
    tr = sub.add_parser("train", help="train one configuration (the default command)",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_train_flags(tr)
    sw = sub.add_parser("sweep", help="train several configurations one after another on the same cache",
                        description="Runs the product of the --grid value lists one after another in the "
                        "same processes (under torchrun too) and prints each run's first-epoch data rate: "
                        "run 1 fills the cache, runs 2..N read it warm.")
    sw.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                    help="a training option and its values (repeat for a product), e.g. lr=0.1,0.2,0.4")
    add_train_flags(sw)
    dg = sub.add_parser("digits", help="render scikit-learn's digits as train/val ImageFolders")
    dg.add_argument("out", help="output directory (gets train/ and val/)")
    dg.add_argument("--scale", type=int, default=4, help="nearest-neighbour enlargement of the 8x8 images "
                    "(default 4: 32x32)")
    dg.add_argument("--val-fraction", type=float, default=0.2,
                    help="held-out fraction per class (default 0.2)")
    dg.add_argument("--seed", type=int, default=0, help="seed of the hold-out (default 0)")
    dg.add_argument("--format", choices=("png", "jpeg"), default="png", help="file format (default png)")
    fa = sub.add_parser("fashion", help="render Zalando's Fashion-MNIST IDX files as train/val ImageFolders",
                        description="Reads the four IDX files of Fashion-MNIST (Debian's "
                        "dataset-fashion-mnist package, or --from DIR; gzip or not), checks them, and writes "
                        "OUT/train/<class>/<i>.png (60,000) and OUT/val/<class>/<i>.png (the official "
                        "10,000-image test split) atomically; a completed OUT is reused.")
    fa.add_argument("out", help="output directory (gets train/ and val/)")
    fa.add_argument("--from", dest="source", default=None, metavar="DIR",
                    help="directory of the IDX files (default: the Debian package's)")
    fa.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _explicit(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def _train(args: argparse.Namespace) -> None:
    values = _explicit(args)
    cfg = make_config(values.pop("recipe", "none"), **values)  # a usage error is told before torch loads
    from trainer.run import train

    train(cfg)


def _sweep(args: argparse.Namespace) -> None:
    values = _explicit(args)
    recipe = values.pop("recipe", "none")
    runs = grid_configs({**RECIPES[recipe], **values, "recipe": recipe}, args.grid)
    from trainer.distenv import init_distributed
    from trainer.run import train

    info = init_distributed(runs[0][1].device)
    rows = []
    for i, (label, cfg) in enumerate(runs):
        if info.is_main:
            print(f"sweep run {i + 1}/{len(runs)}: {label} -> {cfg.out}", flush=True)
        first = train(cfg, info).epochs[0]
        rows.append((label, first))
        if info.is_main:
            print(f"sweep run {i + 1}/{len(runs)} {label}: first epoch {first['samples_per_s']:.0f} "
                  f"samples/s, data-wait {100 * first['data_wait_fraction']:.1f}%, cache "
                  f"{first['cache_hits']} hits / {first['cache_misses']} misses", flush=True)
    if info.is_main:
        print("\nsweep summary (first epoch of each run)")
        print(f"{'run':<32} {'samples/s':>10} {'data-wait':>10} {'hits':>8} {'misses':>8} {'val top1':>9}")
        for label, r in rows:
            top1 = r.get("val_top1")
            print(f"{label:<32} {r['samples_per_s']:>10.0f} {100 * r['data_wait_fraction']:>9.1f}% "
                  f"{r['cache_hits']:>8} {r['cache_misses']:>8} "
                  f"{'-' if top1 is None else f'{100 * top1:.2f}%':>9}")


def _digits(args: argparse.Namespace) -> None:
    from trainer.digits import render

    split = render(args.out, scale=args.scale, val_fraction=args.val_fraction, seed=args.seed,
                   fmt=args.format)
    print(f"wrote {split.n_train} training images to {split.train} and {split.n_val} validation images to "
          f"{split.val}")


def _fashion(args: argparse.Namespace) -> None:
    from trainer.fashion import DEFAULT_DIR, render

    split = render(args.out, source=args.source or DEFAULT_DIR, progress=args.progress)
    how = "reused the completed tree" if split.reused else "wrote"
    print(f"{how}: {split.n_train} training images in {split.train}, {split.n_val} test images in "
          f"{split.val}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = 0
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    rest = argv[lead:]
    if rest and rest[0] not in ("train", "sweep", "digits", "fashion", "-h", "--help"):
        argv = [*argv[:lead], "train", *rest]  # train is the default command
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from datacache.redact import install_scrub_filter, redact_text

    install_scrub_filter()  # URL passwords and secrets read from files masked in every log line
    try:
        {"train": _train, "sweep": _sweep, "digits": _digits, "fashion": _fashion}[args.command](args)
    except ConfigError as e:
        if args.verbose:
            raise
        print(f"{PROG}: error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.verbose:
            raise
        print(f"{PROG}: error: {type(e).__name__}: {redact_text(str(e))} (run with -v for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        dist = sys.modules.get("torch.distributed")  # never imported: no group to destroy, no torch to load
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
