"""HiTopKComm with tensor partitioning on vs. off (ByteScheduler-style pipelining).

4 gloo ranks on loopback as 2 "nodes" x 2, one d-element gradient (default d = 25M, the size
of ResNet-50), density 1 %, error feedback on. "off" runs Algorithm 2 on the whole bucket;
"on" cuts each rank's chunk into pieces of ``partition_numel / local_size`` and launches each
piece's inter-node all-gather asynchronously while the next piece is selected. Configurations
are interleaved step by step (this machine is shared and noisy); the time of a step is the
slowest rank's. Writes bench/results/partition.json and partition.png.

    python -m bench.partition            # the real run (d = 25M)
    python -m bench.partition --quick    # smoke run (d = 1M, few steps)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import RESULTS_DIR, bar_chart, machine_info, print_machine, write_results
from trainer.distenv import free_port


def _worker(rank: int, world: int, local: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    # spawn boundary: a fresh interpreter per rank; only plain data goes back through `queue`.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local),
                       "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        from trainer.comm.hitopk import hitopk, slice_numel
        from trainer.comm.timing import PhaseTimer
        from trainer.comm.topology import Topology

        dist.init_process_group("gloo", rank=rank, world_size=world)
        topo = Topology.from_env()
        d = cfg["d"]
        grad = torch.randn(d, generator=torch.Generator().manual_seed(rank))
        names = list(cfg["partitions"])
        residuals = {n: torch.zeros(slice_numel(d, local)) for n in names}
        timers = {n: PhaseTimer() for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        steps = cfg["warmup"] + cfg["steps"]
        bar = None
        if rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=steps * len(names), desc="partition bench", unit="step")
        for s in range(steps):
            for n in names:  # interleaved: every configuration sees the same machine noise
                dist.barrier()
                if s == cfg["warmup"]:
                    timers[n].reset()
                t0 = time.perf_counter()
                hitopk(grad, topo, density=cfg["density"], selector=cfg["selector"], residual=residuals[n],
                       partition_numel=cfg["partitions"][n], timer=timers[n])
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                if s >= cfg["warmup"]:
                    times[n].append(float(dt))
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        queue.put((rank, True, {"times": times, "phases": {n: timers[n].totals() for n in names}}))
    except BaseException as e:  # report, never hang the parent
        queue.put((rank, False, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(cfg: dict[str, Any], world: int = 4, local: int = 2, timeout: float = 3600.0) -> dict[str, Any]:
    """Spawn ``world`` ranks, run the measurement, return rank 0's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, local, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed: {payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (d = 1M, 2 steps)")
    ap.add_argument("--d", type=int, default=None, help="gradient elements (default 25M, quick 1M)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--selector", default="mstopk")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    d = args.d or (1_000_000 if args.quick else 25_000_000)
    cfg = {"d": d, "density": args.density, "selector": args.selector, "world": 4, "local_size": 2,
           "warmup": 1, "steps": args.steps or (2 if args.quick else 6),
           "partitions": {"off": 0, "on_3_pieces": -(-d // 3), "on_12_pieces": -(-d // 12)}}
    machine = print_machine(machine_info())
    print(f"config: {cfg}")
    res = run_ranks(cfg)
    summary: dict[str, Any] = {}
    for name, ts in res["times"].items():
        summary[name] = {"median_s": statistics.median(ts), "mean_s": statistics.fmean(ts),
                         "min_s": min(ts), "max_s": max(ts), "times_s": ts,
                         "partition_numel": cfg["partitions"][name],
                         "phases_s_total": res["phases"][name]}
        print(f"{name:>6}: median {summary[name]['median_s']:.3f} s/step  phases {res['phases'][name]}")
    off = summary["off"]["median_s"]
    ratios = {f"partition_{n}_speedup_vs_off": off / summary[n]["median_s"] for n in summary if n != "off"}
    notes = [
        "4 gloo ranks share this machine's CPU cores (2 cores, shared with other jobs; medians of "
        "interleaved steps, spread in times_s): the async inter-node all-gather runs on gloo threads "
        "that compete with the selection for the same cores, so the overlap partitioning buys on a GPU "
        "cluster (selection on the GPU, transfer on the NIC) is only partly available here.",
        "loopback has no slow inter-node link: the transfer being hidden is short. Smaller pieces also "
        "make each top-k and index_add_ work on cache-friendlier sizes, which helps on CPU independently "
        "of any overlap.",
    ]
    if max(ratios.values()) < 1.0:
        notes.append("partitioning did not pay off in this run; it stays off by default "
                     "(HookState.partition_numel = 0).")
    write_results("partition", machine=machine, config=cfg, results=summary, ratios=ratios, notes=notes,
                  out_dir=args.out_dir)
    bar_chart(Path(args.out_dir) / "partition.png", list(summary), [summary[n]["median_s"] for n in summary],
              title=f"HiTopKComm step, d={d / 1e6:.0f}M, rho={args.density}, 2x2 gloo ranks",
              ylabel="seconds per step (median, slowest rank)")


if __name__ == "__main__":
    main()
