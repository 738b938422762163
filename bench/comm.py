"""Benchmark: dense ring vs 2D-Torus vs NaiveAG vs HiTopKComm on an emulated 2-node x 2-rank cluster.

Two network namespaces joined by a tbf-shaped veth (bench/netns.py) play two nodes: ranks 0,1 in
namespace A, ranks 2,3 in B (``ip netns exec``), gloo over the veth addresses. Per inter-node
bandwidth (1, 10 and 0.2 Gbit/s) it measures, side by side in one run:

1. each link (intra: 0<->1 and 2<->3 at once over loopback; inter: 0<->2 across the veth): raw
   full-duplex exchanges (``fit_link``) and trainer/comm/collectives.py's all_reduce / all_gather /
   reduce_scatter on a few sizes (``fit_collective`` -> the model's ``LinkProfile``);
2. per-element compute on all 4 ranks at once: select ops, dense decompression passes, index_add_;
3. the four methods at d = 25M fp32, density rho = 1 %, with PhaseTimer's phase split (Fig. 8);

and puts the cost model's prediction (from 1 and 2 only) beside each measurement. Writes
bench/results/comm.json (+ comm.png). Needs root. ``--quick``: small d, fewer iterations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.comm.names import METHOD_CHOICES as METHODS
from trainer.comm.names import PHASES
from trainer.comm.probe import fit_compute, fit_profile
from trainer.comm.probe import measure_compute as _measure_compute
from trainer.comm.probe import timed as _timed

ROOT = Path(__file__).resolve().parents[1]
LABELS = {"allreduce": "dense ring", "torus": "2D-Torus", "naive_ag": "NaiveAG", "hitopk": "HiTopKComm"}


# =============================================================== worker (inside a namespace)
def _measure_links(topo: Any, all_sizes: list[int], reps: int, inter_max: int) -> dict[str, Any]:
    """Raw p2p exchanges and the comm helper's three collectives on each link, per size.

    intra: every node's group at once (as in torus/hitopk: loopback on shared cores, so concurrency
    matters); inter: only local rank 0's group (one stream; the model splits the NIC among concurrent
    streams itself). Collective sizes: the buffer for all_reduce / reduce_scatter, each rank's share
    for all_gather; outputs go to buffers allocated once per size, as in the methods (which write
    into the caller's bucket / reused chunk buffers).
    """
    import torch
    import torch.distributed as dist

    from trainer.comm.collectives import all_gather_flat, all_reduce_sum_, reduce_scatter_sum

    out: dict[str, Any] = {}
    for link in ("intra", "inter"):
        group = topo.intra if link == "intra" else topo.inter
        sizes = [s for s in all_sizes if link == "intra" or s <= inter_max]
        active = link == "intra" or topo.local_rank == 0
        peer = (topo.rank ^ 1) if link == "intra" else (topo.rank + topo.local_size) % topo.world_size

        def exchange(x: Any, o: Any = None, peer: int = peer) -> None:  # full duplex; irecv first:
            recv = torch.empty_like(x)                     # isend-first ran half duplex here (2x slower)
            for w in [dist.irecv(recv, peer), dist.isend(x, peer)]:
                w.wait()

        p = dist.get_world_size(group)
        fns = {"": exchange, "_all_reduce": lambda x, o, g=group: all_reduce_sum_(x, g),
               "_all_gather": lambda x, o, g=group: all_gather_flat(x, g, out=o),
               "_reduce_scatter": lambda x, o, g=group, p=p: reduce_scatter_sum(x, g, out=o[:x.numel() // p])}
        for suffix, fn in fns.items():
            times = []
            for nb in sizes:
                x, o = torch.ones(nb // 4), torch.empty(p * nb // 4)
                times.append(_timed(lambda fn=fn, x=x, o=o: fn(x, o), reps, active, mean=not suffix))
            out[link + suffix] = {"sizes_bytes": sizes, "times_s": times}
    return out


def _run_method(name: str, flat: Any, topo: Any, rho: float, residual: Any, timer: Any) -> Any:
    """One aggregation of ``flat``, in place and averaged as the DDP hooks run it (``flat`` is the
    scratch bucket)."""
    from trainer.comm import allreduce, hitopk, naive_ag, torus

    kw = {"timer": timer, "inplace": True, "divide_by": topo.world_size}
    if name in ("allreduce", "torus"):
        fn = allreduce.allreduce_dense if name == "allreduce" else torus.torus_allreduce
        return fn(flat, topo, **kw)
    fn = naive_ag.naive_ag if name == "naive_ag" else hitopk.hitopk
    return fn(flat, topo, density=rho, selector="mstopk", residual=residual, **kw)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.netns import check_target
    from trainer.comm.timing import PhaseTimer
    from trainer.comm.topology import Topology

    # Refuse anything but the namespace veth addresses / loopback before opening a socket.
    check_target(os.environ["MASTER_ADDR"], os.environ["DC_ALLOWED_ADDRS"].split(","))
    torch.set_num_threads(1)  # 4 ranks share 2 cores: one thread each
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    topo = Topology.from_env()
    rank, world = topo.rank, topo.world_size
    if topo.local_size != 2 or topo.num_nodes != 2:
        raise SystemExit(f"bench.comm worker expects 2 nodes x 2 ranks, got {topo.describe()}")
    res: dict[str, Any] = {"methods": {}}
    res["links"] = _measure_links(topo, [int(s) for s in a.link_sizes], a.link_reps, a.inter_max_bytes)
    res["compute"] = _measure_compute(a.d, a.rho, world, a.compute_reps)

    flat = torch.randn(a.d, generator=torch.Generator().manual_seed(100 + rank))
    bucket = torch.empty_like(flat)  # the hooks' bucket buffer: refilled (untimed) every iteration
    from tqdm import tqdm

    bar = tqdm(total=len(METHODS) * (a.warmup + a.iters), desc=f"comm {a.tag}", file=sys.stderr,
               disable=rank != 0)
    for name in METHODS:
        # error-feedback residuals: naive_ag's spans d, hitopk's this rank's (padded) 1/local_size chunk
        residual = {"naive_ag": a.d, "hitopk": math.ceil(a.d / topo.local_size)}.get(name)
        residual = None if residual is None else torch.zeros(residual)
        e2e, phases = [], []
        for it in range(a.warmup + a.iters):
            timer = PhaseTimer()
            bucket.copy_(flat)  # backward's fresh gradient (not timed; methods write in place)
            dist.barrier()
            t0 = time.perf_counter()
            _run_method(name, bucket, topo, a.rho, residual, timer)
            t = time.perf_counter() - t0
            if it >= a.warmup:
                e2e.append(t)
                phases.append([timer.totals()[p] for p in PHASES])
            bar.update(1)
        dist.all_reduce(e2e_t := torch.tensor(e2e, dtype=torch.float64), op=dist.ReduceOp.MAX)  # slowest rank
        dist.all_reduce(ph := torch.tensor(phases, dtype=torch.float64))
        ph /= world                                      # phase split: mean over ranks
        res["methods"][name] = {"e2e_s": e2e_t.tolist(),
                                "phases_s": dict(zip(PHASES, ph.mean(dim=0).tolist()))}
    bar.close()
    if rank == 0:
        Path(a.result).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# =============================================================== parent (host namespace)
def _launch(pair: Any, a: argparse.Namespace, tag: str, port: int, rate: float) -> dict[str, Any]:
    """Start ranks 0,1 in namespace A and 2,3 in B; return rank 0's measurements."""
    from bench.common import wait_for_ranks

    master = pair.check_target(pair.addrs[0])
    with tempfile.TemporaryDirectory(prefix="dc-comm-") as tmp:
        result = Path(tmp) / "rank0.json"
        procs, logs = [], []
        for rank in range(4):
            side = rank // 2
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR=master, MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=pair.ifs[side], DC_ALLOWED_ADDRS=",".join(pair.addrs),
                       OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            argv = [sys.executable, "-m", "bench.comm", "--worker", "--tag", tag, "--result", str(result),
                    "--d", str(a.d), "--rho", str(a.rho), "--iters", str(a.iters), "--warmup", str(a.warmup),
                    "--link-reps", str(a.link_reps), "--compute-reps", str(a.compute_reps),
                    # below 1 Gbit/s the largest inter sizes would take seconds each: cap them
                    "--inter-max-bytes", str(max(2**22, int(min(1.0, rate) * max(a.link_sizes)))),
                    "--link-sizes", *map(str, a.link_sizes)]
            logs.append(log := open(Path(tmp) / f"rank{rank}.log", "w+"))  # noqa: SIM115 (closed below)
            procs.append(subprocess.Popen(pair.exec_argv(side, argv), cwd=ROOT, env=env, stdout=log,
                                          stderr=None if rank == 0 else log))
        wait_for_ranks(procs, logs, tag, a.timeout)
        return json.loads(result.read_text())


def _analyse(raw: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    from trainer.comm import cost_model as cm
    from trainer.comm.hitopk import choose_final_gather

    L = raw["links"]
    raw_links = {k: cm.fit_link(L[k]["sizes_bytes"], L[k]["times_s"]) for k in ("intra", "inter")}
    profiles = {k: fit_profile({c: L[f"{k}_{c}"] for c in cm.COLLECTIVES}, 2) for k in ("intra", "inter")}
    # reduce_s_per_elem stays 0: the fitted all_reduce / reduce_scatter times already hold the local sums.
    compute = fit_compute(raw["compute"])
    out: dict[str, Any] = {"links": {k: asdict(v) for k, v in profiles.items()},
                           "raw_links_exchange": {k: asdict(v) for k, v in raw_links.items()},
                           "compute": asdict(compute), "raw": raw, "methods": {}}
    c2 = math.ceil(a.d / 2)  # the model follows hitopk's own choice of final gather (dense / eq. 10)
    fg = choose_final_gather(c2, max(1, round(a.rho * c2)), 2, False)
    for name in METHODS:
        meas, kw = raw["methods"][name], {"final_gather": fg}
        pred = cm.predict(name, a.d, a.rho, 2, 2, profiles["intra"], profiles["inter"], compute, **kw)
        e2e = statistics.median(meas["e2e_s"])
        out["methods"][name] = {"measured_s": e2e, "measured_phases_s": meas["phases_s"],
                                "predicted": pred, "model_error": abs(pred["total"] - e2e) / e2e}
    out["model_recommends"] = min(METHODS, key=lambda m: out["methods"][m]["predicted"]["total"])
    out["measured_best"] = min(METHODS, key=lambda m: out["methods"][m]["measured_s"])
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = list(results)
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
    colors = {"select": "tab:orange", "communicate": "tab:blue", "decompress": "tab:green"}
    for ax, rate in zip(axes[0], rates):
        r = results[rate]["methods"]
        xs = range(len(METHODS))
        bottom = [0.0] * len(METHODS)
        for ph in PHASES:
            vals = [r[m]["measured_phases_s"][ph] for m in METHODS]
            ax.bar(xs, vals, bottom=bottom, color=colors[ph], label=f"{ph} (measured)")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r[m]["measured_s"] for m in METHODS], marker="_", s=600, color="black",
                   label="end to end (measured)", zorder=3)
        ax.scatter(xs, [r[m]["predicted"]["total"] for m in METHODS], marker="D", color="red",
                   label="cost model", zorder=4)
        ax.set_xticks(list(xs), [LABELS[m] for m in METHODS], rotation=15)
        ax.set_title(f"inter link {rate}"), ax.set_ylabel("seconds per aggregation")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("2 nodes x 2 ranks (netns + veth/tbf), mean-rank phase split, max-rank end to end")
    fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (d=2M, few iterations)")
    for flag, typ, default in (("--d", int, 25_000_000), ("--rho", float, 0.01), ("--iters", int, 5),
                               ("--warmup", int, 2), ("--link-reps", int, 3), ("--compute-reps", int, 5)):
        ap.add_argument(flag, type=typ, default=default)
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0, 0.2],
                    help="inter link Gbit/s (0.2: where the crossover to sparse methods shows here)")
    ap.add_argument("--link-sizes", type=float, nargs="+",
                    default=[2**16, 2**18, 2**20, 2**22, 2**24, 2**26],
                    help="message sizes for the link fits, bytes (up to the methods' 50-100 MB buffers)")
    ap.add_argument("--inter-max-bytes", type=int, default=2**26, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--tag", "--result"):
        ap.add_argument(flag, default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.quick:
        a.d, a.iters, a.warmup, a.link_reps, a.compute_reps = 2_000_000, 2, 1, 2, 2
        a.link_sizes = [2**16, 2**18, 2**20, 2**22]
    from bench.common import print_machine, write_results
    from bench.netns import NetnsPair

    machine = print_machine()
    results: dict[str, Any] = {}
    with NetnsPair(a.rates[0]) as pair:
        print("network:", pair.describe())
        for i, rate in enumerate(a.rates):
            pair.set_rate(rate)
            tag = f"{rate:g}gbit"
            raw = _launch(pair, a, tag, port=29500 + i, rate=rate)
            results[tag] = _analyse(raw, a)
            for m in METHODS:
                r = results[tag]["methods"][m]
                print(f"{tag} {LABELS[m]:>11}: measured {r['measured_s'] * 1e3:8.1f} ms  "
                      f"model {r['predicted']['total'] * 1e3:8.1f} ms  phases " +
                      " ".join(f"{p}={v * 1e3:.1f}" for p, v in r["measured_phases_s"].items()))
            print(f"{tag}: model recommends {results[tag]['model_recommends']}, measured best "
                  f"{results[tag]['measured_best']}")
    ratios: dict[str, float] = {}
    for tag, r in results.items():
        meas = {m: r["methods"][m]["measured_s"] for m in METHODS}
        for other, key in (("allreduce", "dense"), ("torus", "torus"), ("naive_ag", "naiveag")):
            ratios[f"hitopk_vs_{key}_{tag}"] = meas[other] / meas["hitopk"]
        err = max(r["methods"][m]["model_error"] for m in METHODS)
        ratios["model_error_max" if tag == "1gbit" else f"model_error_max_{tag}"] = err
    first = next(iter(results.values()))
    model_params = {"m": 2, "n": 2, "intra": first["links"]["intra"], "compute": first["compute"],
                    "inter": {tag: r["links"]["inter"] for tag, r in results.items()}}
    notes = [
        "4 ranks (2 namespaces x 2) share the CPU cores with each other and other jobs (1 torch thread per"
        " rank): compute (select, decompress, local sums) is inflated vs one GPU per rank.",
        "Intra link = loopback TCP in a namespace (no NVLink, ~1-2 GB/s); inter = veth shaped by tbf on each"
        " egress, no netem. Model inputs (alpha/beta per collective and link, compute per element) are"
        " measured before and apart from the method timings; nothing is fitted to the methods' timings.",
        "All methods run in place on a scratch bucket refilled (untimed) each iteration, as the DDP hooks run"
        " them; gloo groups of <= 8 ranks use collectives.py's irecv-first direct exchange."]
    missed = [f"{k} = {ratios[k]:.2f} < {t}" for k, t in (("hitopk_vs_dense_1gbit", 3.0),
              ("hitopk_vs_torus_1gbit", 2.0), ("hitopk_vs_naiveag_1gbit", 2.0)) if ratios.get(k, t) < t]
    if missed and "1gbit" in results:
        h, g = ({p: f"{1e3 * v:.0f}" for p, v in results["1gbit"]["methods"][m]["measured_phases_s"].items()}
                for m in ("hitopk", "naive_ag"))
        notes.append(
            f"targets missed: {'; '.join(missed)}. Why: with 2 nodes NaiveAG's all-gather spans 4 ranks only"
            f" ({g['communicate']} ms), so it is compute-bound (select {g['select']}, decompress"
            f" {g['decompress']} ms); HiTopKComm's floor: its dense intra reduce-scatter (+ last gather) over"
            f" loopback on shared cores ({h['communicate']} ms communicating; select {h['select']},"
            f" decompress {h['decompress']} ms): loopback is ~5-10x a 1 Gbit/s link here, NVLink ~30x 25GbE.")
    for tag, r in results.items():  # the model target (25 %) is checked at every bandwidth
        worst = max(METHODS, key=lambda m: r["methods"][m]["model_error"])
        w = r["methods"][worst]
        why = ("the 4-rank gloo ring is CPU-bound on 2 shared cores; the model charges max(intra, inter) per"
               " step" if worst == "allreduce" else "compute on shared cores varies between runs")
        if w["model_error"] > 0.25:
            notes.append(f"model error {w['model_error']:.2f} > 0.25 at {tag}: {worst} predicted "
                         f"{1e3 * w['predicted']['total']:.0f} ms, measured {1e3 * w['measured_s']:.0f} ms"
                         f" ({why})")
    out_dir = Path(a.out_dir) if a.out_dir else ROOT / "bench" / "results"
    config = {"d": a.d, "rho": a.rho, "iters": a.iters, "warmup": a.warmup, "rates_gbit": a.rates,
              "nodes": 2, "ranks_per_node": 2, "selector": "mstopk", "quick": a.quick,
              "error_feedback": True, "link_sizes": a.link_sizes}
    write_results("comm", machine=machine, config=config,
                  results={"model_params": model_params, "per_rate": results}, ratios=ratios,
                  notes=notes, out_dir=out_dir)
    _plot(results, out_dir / "comm.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
