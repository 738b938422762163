"""Accuracy on real data: Zalando's Fashion-MNIST through the whole stack, beside the pipeline users have
today and beside the published numbers; the comm methods on a task that can tell them apart.

Data: ``python -m trainer fashion`` (Debian's ``dataset-fashion-mnist``: 60,000 training and the official
10,000 test images, 28x28 grayscale) served from one warm LMDB cache. Every row is one ``--recipe
fashion`` run (the CIFAR-stem ResNet at width 8, 78,002 parameters; pad-crop + flip; 20 epochs; global
batch 256) launched like a 2-node job: two ``torchrun --nnodes 2 --nproc-per-node 2`` agents on loopback
(LOCAL_WORLD_SIZE = 2, so HiTopKComm's intra/inter-node groups are real). Top-1 on the official test
split after the last epoch. Rows (``--rows GROUP,...``, default all; each group merges into the existing
``bench/results/fashion.json``, so the table can be measured in parts):

* ``parity``: ``dense_s0``, ``dense_s1`` (cache-fed, ``--comm allreduce``, seeds 0 and 1) and
  ``reference_s0``, ``reference_s1``: :mod:`bench.fashion_reference`, torchvision's ``ImageFolder`` +
  transforms + ``DistributedSampler`` + plain DDP with the same model, optimizer, schedule, batch and
  seeds. ``parity_minus_reference_pp`` = mean top-1 of the dense rows minus the reference's
  (target |value| <= 0.3 pp; per-seed spread beside it); samples/s of both loaders;
* ``comm`` (seed 0): ``torus`` (2D-Torus all-reduce) and, at density 1 % and 0.1 % with error feedback,
  ``topk`` (exact: torch.topk, NaiveAG), ``mstopk`` (MSTopK, NaiveAG), ``hitopk`` (HiTopKComm over
  MSTopK), ``dgc`` (DGC's sampled threshold, NaiveAG). Targets: every sparse row within 0.5 pp of
  ``dense_s0`` at 1 %, within 1.0 pp at 0.1 %; MSTopK not below TopK;
* ``warmup``: ``<method>_0.1pct_warm2_s0`` for every sparse method, the 0.1 % miss worked on: 2 dense
  epochs (``--comm 0:allreduce,2:naive_ag``, or ``2:hitopk``), then the method at 0.1 % with error
  feedback; ``sparse_worst_warm2_minus_dense_pp_0.1pct`` once all four are measured;
* ``seed1``: ``topk_1pct_s1`` and ``mstopk_1pct_s1``, the 1 % TopK/MSTopK pair again at seed 1 (beside
  ``dense_s1``): ``mstopk_minus_topk_pp_1pct`` is the mean over the seeds measured for both (per seed in
  ``extra``), since one seed's difference is within the seed-to-seed spread;
* ``wide``: ``dense_w16_s0``, the same recipe at ``--width 16`` (308,826 parameters);
* ``elastic``: ``elastic_s0``, ``dense_s0``'s run with two world-size changes mid-epoch: 2 x 2 ranks
  stopped after global step 1,521 (epoch 7, step 117 of 234; ``--stop-at-step``), resumed on one node
  of 2 ranks (``--resume auto``: the rest of the epoch re-planned, 128 per rank) and stopped after
  step 3,102 (epoch 14, step 60), resumed on 2 x 2 to the end. Target: ``elastic_minus_dense_pp``
  within 0.3 pp (the same seed; a resume on another world changes the order of the rest of its
  epoch, so the runs differ like two orders do);
* ``sampler`` (root: network namespaces): on the emulated cluster (:mod:`bench.emucluster`, 4 nodes x 1
  gloo rank, 64 per rank as above, 1 Gbit/s shaped links, the cache a Redis Cluster of one master per
  node filled by the nodes' daemons): ``sampler_global_s0`` vs ``sampler_local_s0`` (``--sampler local``,
  the default exchange Q). Target: ``local_minus_global_pp`` within 0.3 pp.

``--quick``: a smoke run (CI): 1 epoch of 40 steps per row, rows ``dense_s0``, ``reference_s0``,
``hitopk_1pct_s0`` and ``elastic_s0`` (stops after steps 13 and 27), the trainer's rows validated after
``--bn-recalibrate 8`` (BatchNorm statistics recomputed from training images: a 40-step network's running
averages lag its weights), written to ``fashion_quick.json`` (``--results-dir`` elsewhere). Published rows
(Zalando's benchmark table, the dataset's README) are in the JSON beside ours.
``python -m bench.fashion [--rows parity,comm,warmup,seed1,wide,elastic,sampler] [--only ROW,...] [--quick]
[--epochs N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    launch_2x2,
    launch_nodes,
    machine_info,
    print_machine,
    run_epochs,
    save_figure,
)
from datacache.config import user_cache_dir

# Zalando's benchmark table (github.com/zalandoresearch/fashion-mnist README), test-split accuracy
PUBLISHED = {
    "2 conv layers < 100K parameters, no augmentation": 0.925,
    "2 conv layers, 113K parameters, normalisation": 0.922,
    "ResNet18, normalisation, flips, translation, rotation": 0.949,
    "MobileNet, augmentation (flips)": 0.950,
    "DenseNet-BC, 768K parameters, mean/std, random crops + flips": 0.954,
    "WRN-28-10, standard preprocessing + random crops + flips": 0.959,
    "human performance": 0.835,
}
SPARSE = {"topk": ["--comm", "naive_ag", "--selector", "exact"],
          "mstopk": ["--comm", "naive_ag", "--selector", "mstopk"],
          "hitopk": ["--comm", "hitopk", "--selector", "mstopk"],
          "dgc": ["--comm", "naive_ag", "--selector", "dgc"]}
DENSITIES = {"1pct": "0.01", "0.1pct": "0.001"}
GROUPS = ("parity", "comm", "warmup", "seed1", "wide", "elastic", "sampler")
ELASTIC_STOPS = (1521, 3102)  # global steps: epoch 7 step 117 and epoch 14 step 60 of 234 a epoch
ELASTIC_STOPS_QUICK = (13, 27)  # --quick: steps 13 and 27 of its one 40-step epoch
TARGETS = {"dense_top1_pct": ">= 92.5", "parity_minus_reference_pp": "|x| <= 0.3",
           "sparse_worst_minus_dense_pp_1pct": ">= -0.5", "sparse_worst_minus_dense_pp_0.1pct": ">= -1.0",
           "local_minus_global_pp": "|x| <= 0.3", "elastic_minus_dense_pp": "|x| <= 0.3",
           "mstopk_minus_topk_pp_1pct": ">= 0",
           "mstopk_minus_topk_pp_0.1pct": ">= 0"}


def rows_of(group: str, quick: bool) -> dict[str, tuple[str, list[str]]]:
    """``{row: (launcher, extra args)}``; launcher ``trainer``, ``reference`` or ``emu``."""
    if quick:
        if group == "elastic":
            return {"elastic_s0": ("elastic", ["--comm", "allreduce", "--seed", "0"])}
        return {"dense_s0": ("trainer", ["--comm", "allreduce", "--seed", "0"]),
                "reference_s0": ("reference", ["--seed", "0"]),
                "hitopk_1pct_s0": ("trainer", [*SPARSE["hitopk"], "--density", "0.01", "--seed", "0"])
                } if group == "parity" else {}
    if group == "parity":
        out: dict[str, tuple[str, list[str]]] = {}
        for s in (0, 1):
            out[f"dense_s{s}"] = ("trainer", ["--comm", "allreduce", "--seed", str(s)])
            out[f"reference_s{s}"] = ("reference", ["--seed", str(s)])
        return out
    if group == "comm":
        out = {"torus_s0": ("trainer", ["--comm", "torus", "--seed", "0"])}
        for d, rho in DENSITIES.items():
            for m, extra in SPARSE.items():
                out[f"{m}_{d}_s0"] = ("trainer", [*extra, "--density", rho, "--error-feedback",
                                                  "--seed", "0"])
        return out
    if group == "warmup":  # the 0.1 % miss worked on: 2 dense epochs, then each sparse method
        # each SPARSE entry is ["--comm", METHOD, "--selector", SELECTOR]: METHOD runs from epoch 2 on
        tail = ["--density", "0.001", "--error-feedback", "--seed", "0"]
        return {f"{m}_0.1pct_warm2_s0": ("trainer", ["--comm", f"0:allreduce,2:{ex[1]}", *ex[2:], *tail])
                for m, ex in SPARSE.items()}
    if group == "seed1":  # the 1 % TopK/MSTopK pair at a second seed (mstopk_minus_topk_pp_1pct)
        return {f"{m}_1pct_s1": ("trainer", [*SPARSE[m], "--density", DENSITIES["1pct"], "--error-feedback",
                                              "--seed", "1"]) for m in ("topk", "mstopk")}
    if group == "wide":
        return {"dense_w16_s0": ("trainer", ["--comm", "allreduce", "--width", "16", "--seed", "0"])}
    if group == "elastic":
        return {"elastic_s0": ("elastic", ["--comm", "allreduce", "--seed", "0"])}
    if group == "sampler":
        return {"sampler_global_s0": ("emu", ["--sampler", "global", "--seed", "0"]),
                "sampler_local_s0": ("emu", ["--sampler", "local", "--seed", "0"])}
    raise SystemExit(f"bench.fashion: unknown row group {group!r}; choose from {', '.join(GROUPS)}")


def summarize(launcher: str, extra: list[str], eps: list[dict[str, Any]], seconds: float,
              machine: dict[str, Any]) -> dict[str, Any]:
    rates = [e["samples_per_s"] for e in eps]
    return {"top1": eps[-1]["val_top1"], "curve": [e["val_top1"] for e in eps],
            "loss_curve": [e["loss"] for e in eps], "epochs": len(eps), "seconds": round(seconds, 1),
            "samples_per_s_median": statistics.median(rates),
            "data_wait_fraction_median": statistics.median(e.get("data_wait_fraction", 0.0) for e in eps),
            "pipeline": "torchvision reference" if launcher == "reference" else "datacache",
            "args": extra, "measured_utc": machine.get("date_utc"), "host": machine.get("hostname"),
            "comm_method": eps[-1].get("comm_method"),
            "local_bytes": sum(e.get("local_bytes", 0) for e in eps),
            "remote_bytes": sum(e.get("remote_bytes", 0) for e in eps)}


def ratios_of(rows: dict[str, dict[str, Any]]) -> tuple[dict[str, float | None], dict[str, Any], list[str]]:
    """The issue's ratio names from whatever rows exist; a missing row gives None and a note."""
    top = {k: 100 * r["top1"] for k, r in rows.items()}
    ratios: dict[str, float | None] = {}
    extra: dict[str, Any] = {}
    notes: list[str] = []
    dense = [top[k] for k in ("dense_s0", "dense_s1") if k in top]
    ref = [top[k] for k in ("reference_s0", "reference_s1") if k in top]
    ratios["dense_top1_pct"] = statistics.mean(dense) if dense else None
    ratios["parity_minus_reference_pp"] = (statistics.mean(dense) - statistics.mean(ref)) if dense and ref \
        else None
    extra["parity_per_seed_pp"] = {f"s{s}": top[f"dense_s{s}"] - top[f"reference_s{s}"] for s in (0, 1)
                                   if f"dense_s{s}" in top and f"reference_s{s}" in top}
    extra["dense_spread_pp"] = max(dense) - min(dense) if len(dense) > 1 else None
    extra["reference_spread_pp"] = max(ref) - min(ref) if len(ref) > 1 else None
    base = top.get("dense_s0")
    for d in DENSITIES:
        diffs = {}
        for m in SPARSE:
            k = f"{m}_{d}_s0"
            value = top[k] - base if k in top and base is not None else None
            ratios[f"{m}_{d}_minus_dense_pp"] = value
            if value is not None:
                diffs[m] = value
        complete = len(diffs) == len(SPARSE)
        ratios[f"sparse_worst_minus_dense_pp_{d}"] = min(diffs.values()) if complete else None
        if not complete and diffs:
            notes.append(f"sparse_worst_minus_dense_pp_{d}: only {sorted(diffs)} measured so far")
        pairs = {f"s{s}": top[f"mstopk_{d}_s{s}"] - top[f"topk_{d}_s{s}"] for s in (0, 1)
                 if f"mstopk_{d}_s{s}" in top and f"topk_{d}_s{s}" in top}
        ratios[f"mstopk_minus_topk_pp_{d}"] = statistics.mean(pairs.values()) if pairs else None
        if len(pairs) > 1:
            extra[f"mstopk_minus_topk_per_seed_pp_{d}"] = pairs
    ratios["torus_minus_dense_pp"] = (top["torus_s0"] - base) if "torus_s0" in top and base is not None \
        else None
    warm = {m: top[f"{m}_0.1pct_warm2_s0"] - base for m in SPARSE
            if f"{m}_0.1pct_warm2_s0" in top and base is not None}
    for m, value in warm.items():
        ratios[f"{m}_0.1pct_warm2_minus_dense_pp"] = value
    if len(warm) == len(SPARSE):
        ratios["sparse_worst_warm2_minus_dense_pp_0.1pct"] = min(warm.values())
    elastic = top.get("elastic_s0")
    ratios["elastic_minus_dense_pp"] = elastic - base if elastic is not None and base is not None else None
    g, loc = top.get("sampler_global_s0"), top.get("sampler_local_s0")
    ratios["local_minus_global_pp"] = loc - g if g is not None and loc is not None else None
    if "dense_w16_s0" in top:
        ratios["wide_w16_top1_pct"] = top["dense_w16_s0"]
    rate = {p: [r["samples_per_s_median"] for k, r in rows.items() if k.startswith(p)]
            for p in ("dense_s", "reference_s")}
    if rate["dense_s"] and rate["reference_s"]:
        ratios["cache_vs_reference_samples_per_s"] = statistics.mean(rate["dense_s"]) / statistics.mean(
            rate["reference_s"])
    missing = [k for k, v in ratios.items() if v is None]
    if missing:
        notes.append(f"not measured yet (no row): {', '.join(missing)}")
    return ratios, extra, notes


def _check_targets(ratios: dict[str, float | None]) -> list[str]:
    notes = []
    checks = {"dense_top1_pct": lambda v: v >= 92.5, "parity_minus_reference_pp": lambda v: abs(v) <= 0.3,
              "sparse_worst_minus_dense_pp_1pct": lambda v: v >= -0.5,
              "sparse_worst_minus_dense_pp_0.1pct": lambda v: v >= -1.0,
              "local_minus_global_pp": lambda v: abs(v) <= 0.3, "mstopk_minus_topk_pp_1pct": lambda v: v >= 0,
              "elastic_minus_dense_pp": lambda v: abs(v) <= 0.3,
              "mstopk_minus_topk_pp_0.1pct": lambda v: v >= 0}
    for k, ok in checks.items():
        v = ratios.get(k)
        if v is not None and not ok(v):
            notes.append(f"target missed: {k} = {v:.2f} (target {TARGETS[k]})")
    return notes


def prepare(base: str) -> tuple[str, str, str]:
    """Render the data (reused when complete) and warm one LMDB cache of both splits."""
    from client.dataset import CachedImageNet
    from trainer.fashion import render

    split = render(os.path.join(base, "data"))
    cache = "lmdb://" + os.path.join(base, "cache")
    for root in (split.train, split.val):
        ds = CachedImageNet(root, cache=cache, short_side=28)
        for k in range(0, len(ds), 4096):
            ds.__getitems__(list(range(k, min(len(ds), k + 4096))))
    return split.train, split.val, cache


def run_emu(rows: dict[str, tuple[str, list[str]]], train: str, val: str, common: list[str], runs: str,
            timeout: float) -> dict[str, tuple[str, float]]:
    """The sampler rows on the emulated cluster (4 nodes x 1 rank); ``{row: (out dir, seconds)}``."""
    import shutil
    import tempfile

    from bench.e2e import run_job, wait_full
    from bench.emucluster import EmuCluster, EmuConfig, why_unavailable

    why = why_unavailable()
    if why:
        raise SystemExit(f"bench.fashion --rows sampler: cannot build the emulated cluster: {why}")
    work = tempfile.mkdtemp(prefix="datacache-fashion-")
    c = EmuCluster(EmuConfig(state_dir=os.path.join(work, "cluster"), nodes=4, rate_gbit=1.0, short_side=28,
                             maxmemory="512mb", datasets=(train, val), timeout=120.0))
    done = {}
    try:
        c.up()
        wait_full(c, 1800.0)
        for k, (name, (_, extra)) in enumerate(rows.items()):
            out = os.path.join(runs, name)
            shutil.rmtree(out, ignore_errors=True)  # this benchmark's own run directory
            os.makedirs(out)
            t = time.perf_counter()
            args = [*common, "--cache", c.cache_url(), *extra, "--out", out]
            run_job(c, name, ["-m", "trainer", *args], out, timeout=timeout, port=29450 + k)
            done[name] = (out, time.perf_counter() - t)
    finally:
        c.down()
    shutil.rmtree(work, ignore_errors=True)
    return done


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(GROUPS), help=f"row groups to run: {', '.join(GROUPS)} "
                    "(default all); results merge into the existing JSON")
    ap.add_argument("--only", default="", help="only these rows of the chosen groups, e.g. hitopk_1pct_s0 "
                    "(comma-separated; the table can be measured a row at a time)")
    ap.add_argument("--quick", action="store_true", help="smoke: 1 epoch of 40 steps, 3 rows, "
                    "fashion_quick.json")
    ap.add_argument("--epochs", type=int, default=0, help="epochs per run (default: the recipe's 20)")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR), help="where fashion(_quick).json and "
                    "its PNG go")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    args = ap.parse_args(argv)
    groups = [g.strip() for g in args.rows.split(",") if g.strip()]
    known = [row for g in groups for row in rows_of(g, args.quick)]
    unknown = sorted(set(filter(None, args.only.split(","))) - set(known))
    if unknown:
        raise SystemExit(f"bench.fashion: --only {','.join(unknown)}: not a row of --rows {args.rows}; "
                         f"rows: {', '.join(known)}")
    machine = print_machine(machine_info())
    base = os.path.join(user_cache_dir(), "datacache", "bench", "fashion")
    t0 = time.perf_counter()
    train, val, cache = prepare(base)
    prepare_s = time.perf_counter() - t0
    runs = os.path.join(base, "runs")
    os.makedirs(runs, exist_ok=True)
    common = ["--recipe", "fashion", "--data", train, "--val-data", val, "--device", "cpu", "--threads", "1",
              "--no-progress", "--overwrite", "--keep-checkpoints", "1"]
    ref_common = ["--recipe", "fashion", "--data", train, "--val-data", val, "--threads", "1"]
    if args.quick:
        # --bn-recalibrate: a 40-step network's BatchNorm running averages lag its weights (measured: the
        # hitopk row's own weights score 61 % on held-out images in training mode, 10.5 % -- one class
        # -- with its running averages); the held-out check is about the weights the row trained
        common += ["--epochs", "1", "--steps-per-epoch", "40", "--bn-recalibrate", "8"]
        ref_common += ["--epochs", "1", "--steps-per-epoch", "40"]
    elif args.epochs:
        common += ["--epochs", str(args.epochs)]
        ref_common += ["--epochs", str(args.epochs)]
    name = "fashion_quick" if args.quick else "fashion"
    path = Path(args.results_dir) / f"{name}.json"
    doc = _load(path)
    rows: dict[str, dict[str, Any]] = doc.get("results", {}).get("rows", {})
    for group in groups:
        todo = rows_of(group, args.quick)
        if args.only:
            todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
        if not todo:
            continue  # nothing of this group was asked for (--quick has no sampler rows): build nothing
        if group == "sampler":
            for row, (out, seconds) in run_emu(todo, train, val, common, runs, args.timeout).items():
                rows[row] = summarize("emu", todo[row][1], run_epochs(out), seconds, machine)
                _report(row, rows[row])
            save(path, rows, machine, quick=args.quick, prepare_s=prepare_s)
            continue
        for row, (launcher, extra) in todo.items():
            out = os.path.join(runs, row)
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                os.remove(os.path.join(out, "metrics.jsonl"))  # this benchmark's own file
            t = time.perf_counter()
            if launcher == "reference":
                launch_2x2("bench.fashion_reference", [*ref_common, *extra, "--out", out], out, args.timeout)
            elif launcher == "elastic":
                run_elastic(common, cache, extra, out, args.timeout,
                            ELASTIC_STOPS_QUICK if args.quick else ELASTIC_STOPS)
            else:
                launch_2x2("trainer", [*common, "--cache", cache, *extra, "--out", out], out, args.timeout)
            rows[row] = summarize(launcher, extra, run_epochs(out), time.perf_counter() - t, machine)
            _report(row, rows[row])
            save(path, rows, machine, quick=args.quick, prepare_s=prepare_s)
    save(path, rows, machine, quick=args.quick, prepare_s=prepare_s, say=True)


def run_elastic(common: list[str], cache: str, extra: list[str], out: str, timeout: float,
                stops: tuple[int, int]) -> None:
    """The ``elastic`` row: 2 x 2 ranks, then 1 x 2, then 2 x 2 again, each phase ended by
    ``--stop-at-step`` (a checkpoint there) and the next one started with ``--resume auto``."""
    resumed = [a for a in common if a != "--overwrite"]  # a resume keeps the run's checkpoints
    phases = [(2, 2, [*common, "--stop-at-step", str(stops[0])]),
              (1, 2, [*resumed, "--resume", "auto", "--stop-at-step", str(stops[1])]),
              (2, 2, [*resumed, "--resume", "auto"])]
    for k, (nodes, per_node, flags) in enumerate(phases):
        launch_nodes("trainer", [*flags, "--cache", cache, *extra, "--out", out], f"{out}.phase{k}", timeout,
                     nodes=nodes, per_node=per_node)


def save(path: Path, rows: dict[str, dict[str, Any]], machine: dict[str, Any], *, quick: bool,
         prepare_s: float, say: bool = False) -> None:
    """Write the JSON (and with ``say`` the PNG and a summary) from the rows measured so far: called after
    every row, so an interrupted table keeps what it measured."""
    ratios, extra, notes = ratios_of(rows)
    notes += _check_targets(ratios) if not quick else ["quick: a smoke run of 40 steps; no target applies"]
    total = sum(r["seconds"] for r in rows.values())
    notes.append(f"wall time of the rows in this file: {total / 3600:.2f} h (sum of the runs; the data and "
                 f"cache preparation took {prepare_s:.0f} s in the last invocation)")
    out_doc = {"machine": machine, "config": {
        "recipe": "fashion", "model": "small_resnet_cifar width 8 (78,002 parameters)",
        "world": "2 nodes x 2 gloo ranks on loopback (sampler rows: 4 emulated nodes x 1; elastic_s0: "
                 "2 x 2, then 1 x 2, then 2 x 2)",
        "global_batch": 256, "quick": quick, "train_images": 60000, "test_images": 10000},
        "published": PUBLISHED, "targets": TARGETS,
        "accuracy": {k: r["top1"] for k, r in rows.items()},
        "results": {"rows": rows, **extra}, "ratios": ratios, "notes": notes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out_doc, indent=2) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    if not say:
        return
    print(f"wrote {path}")
    for k, v in ratios.items():
        print(f"  ratio {k} = {v if v is None else round(v, 3)}")
    for n in notes:
        print(f"  note: {n}")
    _plot(path.with_suffix(".png"), rows)


def _report(row: str, r: dict[str, Any]) -> None:
    print(f"{row:>20}: top-1 {100 * r['top1']:.2f}% after {r['epochs']} epochs ({r['seconds']:.0f} s, "
          f"{r['samples_per_s_median']:.0f} samples/s)", flush=True)


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _plot(path: Path, rows: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for name, r in sorted(rows.items()):
        style = {"ls": "--"} if name.startswith("reference") else {}
        ax.plot(range(1, len(r["curve"]) + 1), [100 * y for y in r["curve"]], marker="o", ms=2, label=name,
                **style)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test top-1 (%)")
    lowest = min((100 * y for r in rows.values() for y in r["curve"]), default=80.0)
    ax.set_ylim(min(80.0, lowest - 1), 95)
    ax.set_title("Fashion-MNIST, ResNet 78K params, 2 nodes x 2 gloo ranks")
    ax.legend(fontsize=7, ncol=2)
    bars = {**{k: 100 * r["top1"] for k, r in sorted(rows.items())},
            **{f"published: {k[:28]}": 100 * v for k, v in PUBLISHED.items() if v > 0.9}}
    ax2.barh(list(bars), list(bars.values()), color=["C0" if not k.startswith("published") else "C7"
                                                       for k in bars])
    ax2.set_xlim(min(90.0, min(bars.values()) - 1), 96.5)
    for y, v in enumerate(bars.values()):
        ax2.text(v, y, f" {v:.2f}", va="center", fontsize=7)
    ax2.tick_params(axis="y", labelsize=7)
    ax2.set_xlabel("test top-1 (%)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
