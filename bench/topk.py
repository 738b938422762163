"""Top-k selector benchmark: exact (torch.topk) vs DGC vs MSTopK.

For d in (1M, 8M, 25M) and k in (0.1 %, 1 %) of d, times every selector on the same
normal vector, interleaving the methods rep by rep so that noise from other processes hits
them alike, and reports median and minimum wall time after one warm-up call, once with one
torch thread and once with torch's default thread count. Recall vs the exact top-k (as a
multiset of magnitudes, so ties cannot blur it) is measured on a normal vector, a heavy-tailed
one (Student-t, 2 degrees of freedom), a log-normal one (sigma = 8) and one with a single
outlier 1e9x the rest. On a CUDA device (when present) it also times the selectors with CUDA
events and writes bench/results/topk_gpu.json (device named in ``machine.cuda``).

Writes bench/results/topk.json and topk.png.  ``--quick`` (d = 1M only, 2 reps) writes
topk_quick.json / topk_quick.png instead, so a smoke run never overwrites the real results.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from bench.common import RESULTS_DIR, print_machine, write_results
from trainer.comm.names import SELECTOR_ALGORITHMS
from trainer.comm.selector_registry import get_selector

DENSITIES = (0.001, 0.01)
METHODS = ("exact", "dgc", "mstopk")
assert set(METHODS) == set(SELECTOR_ALGORITHMS)  # "auto" runs one of them


def recall_data(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The vectors recall is measured on (generated; nothing is stored)."""
    z = torch.randn(n, generator=g)
    outlier = torch.randn(n, generator=g)
    outlier[n // 3] = 1e9 * float(outlier.abs().max())
    return {
        "student_t2": z / torch.sqrt(-torch.log(torch.rand(n, generator=g).clamp_min(1e-12))),
        "lognormal8": torch.exp(8.0 * torch.randn(n, generator=g)) * torch.sign(torch.randn(n, generator=g)),
        "outlier_1e9": outlier,
    }


def recall(x: torch.Tensor, k: int, values: torch.Tensor) -> float:
    """Fraction of the exact top-k magnitudes (a multiset, so ties cannot blur it) selected."""
    ref = torch.sort(torch.topk(x.abs(), k, sorted=False).values).values
    got = torch.sort(values.abs()).values
    # the i-th smallest selected magnitude is >= the i-th smallest exact one; count the exact ones
    return float((got >= ref).sum()) / k


def _time_cpu(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _time_cuda(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()  # host sync: only to read the timing
    return start.elapsed_time(end) / 1e3


def time_methods(x: torch.Tensor, k: int, reps: int) -> dict[str, dict[str, float]]:
    """Median/min seconds per method, methods interleaved within each rep."""
    timer = _time_cuda if x.is_cuda else _time_cpu
    calls = {m: (lambda m=m: get_selector(m)(x, k)) for m in METHODS}
    for fn in calls.values():  # warm-up: workspace buffers, allocator, caches
        fn()
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(reps):
        for m, fn in calls.items():
            samples[m].append(timer(fn))
    return {m: {"median_s": statistics.median(v), "min_s": min(v)} for m, v in samples.items()}


def run(sizes: list[int], reps: int, thread_settings: list[int]
        ) -> tuple[list[dict], dict[str, dict[str, float]]]:
    """Rows of timings (per device, thread count, d, density) and the minimum recall per device
    and method."""
    rows: list[dict] = []
    recalls: dict[str, dict[str, float]] = {"cpu": {}, "cuda": {}}
    g = torch.Generator().manual_seed(0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    # CPU: every thread setting; CUDA: once (host threads do not matter there)
    jobs = [
        (dev, th, d, rho)
        for dev in devices
        for th in (thread_settings if dev == "cpu" else thread_settings[:1])
        for d in sizes
        for rho in DENSITIES
    ]
    data: dict[int, torch.Tensor] = {}
    for dev, threads, d, rho in tqdm(jobs, desc="topk"):
        torch.set_num_threads(threads)
        if d not in data:
            data[d] = torch.randn(d, generator=g)
        x = data[d].to(dev)
        k = max(1, int(d * rho))
        times = time_methods(x, k, reps)
        row = {"device": dev, "threads": threads, "d": d, "density": rho, "k": k, "times": times}
        if threads == thread_settings[0]:  # recall does not depend on the thread count
            vectors = {"normal": x, **{name: v.to(dev) for name, v in recall_data(d, g).items()}}
            row["recall"] = {m: {name: recall(v, k, get_selector(m)(v, k)[0]) for name, v in vectors.items()}
                             for m in METHODS}
            for m in METHODS:
                recalls[dev][m] = min(recalls[dev].get(m, 1.0), *row["recall"][m].values())
            del vectors
        rows.append(row)
        tqdm.write(
            f"{dev} threads={threads} d={d} k={k}: "
            + ", ".join(f"{m} {1e3 * t['median_s']:.1f} ms" for m, t in times.items())
        )
    return rows, recalls


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DENSITIES), figsize=(11, 4.2), sharey=True)
    colors = {"exact": "tab:red", "dgc": "tab:green", "mstopk": "tab:blue"}
    series = sorted({(r["device"], r["threads"]) for r in rows})
    for ax, rho in zip(axes, DENSITIES):
        for dev, th in series:
            style = ":" if dev != "cpu" else ("-" if th == 1 else "--")
            label = dev if dev != "cpu" else f"cpu {th} thread(s)"
            for m in METHODS:
                pts = sorted(
                    (r["d"], r["times"][m]["median_s"] * 1e3)
                    for r in rows
                    if r["density"] == rho and (r["device"], r["threads"]) == (dev, th)
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        marker="o",
                        color=colors[m],
                        label=f"{m}, {label}",
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("d (elements)")
        ax.set_title(f"k = {rho:.1%} of d (median of interleaved reps)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time per selection (ms)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: d = 1M, 2 reps")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per method and config")
    ap.add_argument("--sizes", type=int, nargs="*", default=[1_000_000, 8_000_000, 25_000_000])
    args = ap.parse_args()
    sizes, reps = ([1_000_000], 2) if args.quick else (args.sizes, args.reps)
    default_threads = torch.get_num_threads()
    thread_settings = [1] if default_threads == 1 else [1, default_threads]
    machine = print_machine()
    rows, recalls = run(sizes, reps, thread_settings)
    torch.set_num_threads(default_threads)

    cpu_rows = [r for r in rows if r["device"] == "cpu"]
    gpu_rows = [r for r in rows if r["device"] == "cuda"]
    big = max(sizes)
    tag = f"{big // 1_000_000}M"
    name = "topk_quick" if args.quick else "topk"  # a smoke run never overwrites the real results
    config = {"sizes": sizes, "densities": list(DENSITIES), "reps": reps, "threads": thread_settings}
    ratios = _ratios(cpu_rows, big, tag, thread_settings, recalls["cpu"])
    notes = [
        "ratios without a suffix: one torch thread, median of interleaved reps; "
        f"'_default_threads': torch default ({default_threads} threads).",
        "ratio = torch.topk time / selector time (both include |x| and the int32 cast); higher is better.",
        "recall = share of the exact top-k magnitudes selected, minimum over normal, Student-t(2), "
        "log-normal (sigma 8) and one-outlier-1e9x vectors; MSTopK is exact by construction (tested).",
        "Machine shared with other jobs while measuring: absolute times are noisy, "
        "the per-rep interleaving keeps the ratios comparable; min_s is in results.",
        "dgc here re-adjusts to exactly k via an exact top-k of its candidates (so its recall is 1.0) "
        "and shares MSTopK's compaction primitives (reused buffers, word-wise nonzero); on the CPU both "
        "are bound by the same full-vector passes, hence mstopk_vs_dgc ~ 1.",
    ]
    if big == 25_000_000:
        worst = min(v or 0.0 for k, v in ratios.items() if k.startswith("mstopk_vs_topk_"))
        ok = worst >= 5.0 and (ratios["mstopk_recall_min"] or 0.0) == 1.0
        notes.append("CPU target mstopk >= 5x torch.topk at 25M, k = 0.1 % and 1 %, one thread and default "
                     f"threads, exact: {'met' if ok else 'MISSED'} (worst {worst:.1f}x).")
    if not gpu_rows:
        notes.append("No CUDA device here: the GPU target (exact and >= 2x torch.topk on an H100) was not "
                     "measured; topk_gpu.json is written only where a GPU exists.")
    write_results(name, machine=machine, config=config, results=cpu_rows, ratios=ratios, notes=notes)
    plot(cpu_rows, str(RESULTS_DIR / f"{name}.png"))
    if gpu_rows:
        gpu_ratios = _ratios(gpu_rows, big, tag, thread_settings[:1], recalls["cuda"], dev="cuda")
        worst = min(v or 0.0 for k, v in gpu_ratios.items() if k.startswith("mstopk_vs_topk_"))
        gpu_notes = [f"device: {machine.get('cuda')}; CUDA-event timing, median of interleaved reps.",
                     f"GPU target exact and >= 2x torch.topk at 25M: "
                     f"{'met' if worst >= 2.0 and gpu_ratios['mstopk_recall_min'] == 1.0 else 'MISSED'} "
                     f"(worst {worst:.1f}x)."]
        if not args.quick:
            fused, info = fused_rows(reps)
            gpu_ratios.update(fused)
            gpu_notes.append(
                "issue 37 targets (MSTopK's fused Triton select): mstopk_vs_topk_25M_k0.1pct and _k1pct "
                ">= 2.8, mstopk_vs_topk_1M_k0.1pct >= 3, mstopk_read_passes_25M (MSTopK / one x.abs().sum()) "
                f"<= 7; MSTopK's path on CUDA: {info['path']}, sync-free under set_sync_debug_mode('error'): "
                f"{info['sync_free']}.")
        write_results(f"{name}_gpu", machine=machine, config=config, results=gpu_rows, ratios=gpu_ratios,
                      notes=gpu_notes)
        plot(gpu_rows, str(RESULTS_DIR / f"{name}_gpu.png"))


def fused_rows(reps: int) -> tuple[dict[str, float | None], dict[str, object]]:
    """CUDA only: MSTopK (its fused path where Triton is present) against ``torch.topk`` at 1M and 25M in
    fp32, fp16 and bf16, its time in reads of x (one ``x.abs().sum()``, same run), and whether it runs
    under ``torch.cuda.set_sync_debug_mode("error")``."""
    from trainer.comm.mstopk import mstopk_with_info

    out: dict[str, float | None] = {}
    info: dict[str, object] = {}
    g = torch.Generator().manual_seed(1)
    for dtype, suffix in ((torch.float32, ""), (torch.float16, "_fp16"), (torch.bfloat16, "_bf16")):
        for d in (1_000_000, 25_000_000):
            x = torch.randn(d, generator=g).to(dtype).cuda()
            for rho, name in ((0.001, "k0.1pct"), (0.01, "k1pct")):
                k = int(d * rho)
                t = time_methods(x, k, reps)
                out[f"mstopk_vs_topk_{d // 1_000_000}M_{name}{suffix}"] = (
                    t["exact"]["median_s"] / t["mstopk"]["median_s"])
                if d == 25_000_000 and rho == 0.01 and not suffix:
                    read = statistics.median(_time_cuda(lambda v=x: v.abs().sum()) for _ in range(reps))
                    out["mstopk_read_passes_25M"] = t["mstopk"]["median_s"] / read
                    out["mstopk_ms_25M"] = 1e3 * t["mstopk"]["median_s"]
            del x
    x = torch.randn(25_000_000, generator=g).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        info["path"] = mstopk_with_info(x, 25_000).path
        info["sync_free"] = True
    except RuntimeError:
        info["sync_free"] = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out, info


def _ratios(rows: list[dict], big: int, tag: str, threads: list[int], recalls: dict[str, float],
            dev: str = "cpu") -> dict[str, float | None]:
    def ratio(d: int, rho: float, a: str, b: str, th: int) -> float | None:
        for r in rows:
            if (r["device"], r["threads"], r["d"], r["density"]) == (dev, th, d, rho):
                return r["times"][a]["median_s"] / r["times"][b]["median_s"]
        return None

    out: dict[str, float | None] = {}
    for rho, name in ((0.001, "k0.1pct"), (0.01, "k1pct")):
        out[f"mstopk_vs_topk_{tag}_{name}"] = ratio(big, rho, "exact", "mstopk", threads[0])
        if len(threads) > 1:
            dflt = ratio(big, rho, "exact", "mstopk", threads[-1])
            out[f"mstopk_vs_topk_{tag}_{name}_default_threads"] = dflt
        out[f"dgc_vs_topk_{tag}_{name}"] = ratio(big, rho, "exact", "dgc", threads[0])
        out[f"mstopk_vs_dgc_{tag}_{name}"] = ratio(big, rho, "dgc", "mstopk", threads[0])
    out["mstopk_recall_min"] = recalls.get("mstopk")
    out["dgc_recall_min"] = recalls.get("dgc")
    return out


if __name__ == "__main__":
    main()
