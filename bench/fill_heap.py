"""Fill with the freed heap kept against glibc as it is: ``datacache warm``, side by side.

``datacache warm`` asks glibc to keep the memory a fill frees between batches (``datacache.heap``:
blocks up to 32 MiB from the heap, up to 64 MiB of freed heap top kept); ``DATACACHE_KEEP_FREED_HEAP=0``
leaves glibc as it is. This runs the real command on ``bench.loader``'s generated ImageNet-like JPEGs
(500x375 q90 + shipped photos) into a fresh LMDB each time, both ways, interleaved (the order alternates
between rounds), and measures each run from outside: wall time, the CPU seconds and minor page faults
of the command and its decode pool (``getrusage`` of the waited-for children).

Ratios (``bench/results/fill_heap.json`` + ``fill_heap.png``; each the median of per-round ratios):
``fill_kept_vs_plain`` (plain wall / kept wall: > 1 = faster), ``fill_cpu_kept_vs_plain`` (CPU seconds,
user + system), ``fill_faults_plain_per_kept`` (minor faults). ``--quick`` is the smoke run that
``tests/test_bench_fill_heap.py`` makes (the JSON's shape; no timing assert).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import RESULTS_DIR, print_machine, save_figure, write_results
from bench.loader import ensure_dataset

MODES = ("kept", "plain")


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["DATACACHE_KEEP_FREED_HEAP"] = "1" if mode == "kept" else "0"
    return env


def fill_once(root: str, cache_dir: str, mode: str, workers: int, short_side: int) -> dict[str, Any]:
    """One ``datacache warm`` into an empty LMDB, measured from outside."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "datacache.cli", "warm", root, "--cache", f"lmdb://{cache_dir}",
                          "--short-side", str(short_side), "--workers", str(workers), "--no-progress"],
                         env=_env(mode), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"datacache warm ({mode}) failed with exit code {res.returncode}: "
                           f"{res.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": wall, "user_s": after.ru_utime - before.ru_utime,
            "sys_s": after.ru_stime - before.ru_stime, "minor_faults": after.ru_minflt - before.ru_minflt,
            "said": res.stdout.strip().splitlines()[-1]}


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    root = ensure_dataset(args.images)
    n = sum(len(files) for _, _, files in os.walk(root))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="fill-heap-") as work:
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                cache_dir = os.path.join(work, f"{mode}-{r}")
                out = fill_once(root, cache_dir, mode, args.workers, args.short_side)
                shutil.rmtree(cache_dir)
                out["samples_per_s"] = n / out["seconds"]
                runs[mode].append(out)
                print(f"round {r + 1}/{args.rounds} {mode:5s}: {out['seconds']:.2f} s, "
                      f"{out['samples_per_s']:.0f} samples/s, cpu {out['user_s'] + out['sys_s']:.2f} s "
                      f"(sys {out['sys_s']:.2f}), {out['minor_faults']} minor faults")

    def per_round(fn: Any) -> list[float]:
        return [fn(p) / fn(k) for k, p in zip(runs["kept"], runs["plain"])]

    pairs = {"fill_kept_vs_plain": per_round(lambda o: o["seconds"]),
             "fill_cpu_kept_vs_plain": per_round(lambda o: o["user_s"] + o["sys_s"]),
             "fill_faults_plain_per_kept": per_round(lambda o: max(1, o["minor_faults"]))}
    ratios = {k: statistics.median(v) for k, v in pairs.items()}
    results = {"runs": runs, "pair_ratios": pairs, "files": n,
               "median": {m: {k: statistics.median(o[k] for o in runs[m])
                              for k in ("seconds", "samples_per_s", "user_s", "sys_s", "minor_faults")}
                          for m in MODES}}
    config = {"images": n, "rounds": args.rounds, "workers": args.workers, "short_side": args.short_side,
              "source_size": "500x375 q90 (+ shipped photos)", "quick": args.quick,
              "command": "python -m datacache.cli warm ROOT --cache lmdb://FRESH --short-side S --workers W",
              "plain": "DATACACHE_KEEP_FREED_HEAP=0 (glibc as it is; MALLOC_* and GLIBC_TUNABLES unset "
                       "in both)"}
    return config, results, ratios


def _plot(path: str, results: dict[str, Any], config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    med = results["median"]
    labels = ["freed heap kept\n(default)", "glibc as it is\n(KEEP_FREED_HEAP=0)"]
    for k, (metric, unit) in enumerate((("samples_per_s", "samples/s"), ("sys_s", "system CPU s"))):
        axis = ax if k == 0 else bx
        vals = [med[m][metric] for m in MODES]
        bars = axis.bar(range(2), vals, color=["tab:blue", "tab:gray"])
        for b, v in zip(bars, vals):
            axis.annotate(f"{v:.2f}" if v < 100 else f"{v:.0f}",
                          (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
        axis.set_xticks(range(2), labels, fontsize=8)
        axis.set_ylabel(unit + " (median)")
    ax.set_title(f"datacache warm: {config['images']} JPEGs 500x375 -> short side {config['short_side']}, "
                 f"{config['workers']} workers", fontsize=8)
    bx.set_title(f"{config['rounds']} interleaved rounds", fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 images, 1 round")
    ap.add_argument("--images", type=int, default=None, help="generated JPEGs (default 2000, quick 100)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 1)")
    ap.add_argument("--workers", type=int, default=2, help="decode processes of each fill (default 2)")
    ap.add_argument("--short-side", type=int, default=256,
                    help="cached short side (default 256: the drop-in's)")
    ap.add_argument("--name", default=None, help="results name (default fill_heap, quick fill_heap_quick)")
    ap.add_argument("--out-dir", default=None, help=f"where the JSON/PNG go (default {RESULTS_DIR})")
    args = ap.parse_args(argv)
    if args.images is None:
        args.images = 100 if args.quick else 2000
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.images < 1 or args.rounds < 1 or args.workers < 1 or args.short_side < 16:
        ap.error("--images, --rounds and --workers must be >= 1, --short-side >= 16")
    name = args.name or ("fill_heap_quick" if args.quick else "fill_heap")
    machine = print_machine()
    config, results, ratios = run(args)
    out_dir = args.out_dir or str(RESULTS_DIR)
    notes = [f"{os.cpu_count()} cores; the JPEGs sit in the OS page cache (CPU against CPU); each fill "
             "into a fresh LMDB on the local disk, listing included; ratios are medians of per-round "
             "ratios (results.pair_ratios)"]
    write_results(name, machine=machine, config=config, results=results, ratios=ratios, notes=notes,
                  out_dir=out_dir)
    _plot(os.path.join(out_dir, name + ".png"), results, config)


if __name__ == "__main__":
    main()
