"""Communication overlap: step time of the comm methods with synchronous hooks vs ``--overlap async/cross``.

On the emulated cluster (:mod:`bench.emucluster`: 3 network namespaces, one gloo rank each, links
shaped to each ``--rates`` value in Gbit/s, ``fast`` = unshaped veths), every rank trains the same
model for ``--iters`` timed blocks of ``--block`` consecutive steps (after ``--warmup`` blocks) per
method in each mode, side by side in one run: the compute-only block and each mode's block alternate,
so drift on this shared machine hits all of them alike (a mode's step = its block's time / block;
``cross`` drains at the end of each block, so no two modes' collectives ever run at once):

* models: ``r50stack`` -- a stack of residual blocks whose parameter sizes follow ResNet-50's
  layers (trainer.models.resnet50, each weight's size / ``--scale``; a block ``x + relu(x W1) W2``
  holding that many parameters), so DDP's buckets have ResNet-50's size profile; ``small_resnet`` --
  the trainer's CIFAR-stem ResNet (``--width``) on 32x32 inputs;
* methods (``--methods``): ``allreduce`` (dense), ``torus``, ``naive_ag`` (MSTopK), ``hitopk``;
  sparse at ``--density`` with error feedback; DDP buckets of ``--bucket-mb``;
* modes: ``none`` (the hooks run inside backward; the plain dense all-reduce is already
  asynchronous there), ``async`` (trainer/comm/comm_thread.py) and ``cross`` (no DDP: pieces of
  ``--bucket-mb`` started front layers first under ``--credit-mb`` per round, each applied as it
  arrives while the next forward runs; trainer/comm/cross_barrier.py).

A step = zero_grad, forward, backward (the hooks communicate), ``maybe_step``; its time is the
slowest rank's (all-reduce MAX), median over the timed steps. The bound ``max(compute, comm)`` is
measured in the same run: ``compute`` = the same step without DDP (no communication), ``comm`` =
the seconds the communication thread was busy per step in the async mode. CPU seconds per step
(every rank's process, all threads) are recorded beside: on a 2-core machine three ranks, their
backward and their communication threads share the same cores, so ``cpu floor`` = those seconds /
the cores is a third bound (``overlap_vs_machine_bound_<method>``).

Ratios (``bench/results/overlap.json``): ``overlap_<method>_vs_sync`` = sync step / the better
overlap mode's step at 1 Gbit/s (other rates suffixed, e.g. ``overlap_hitopk_vs_sync_0.2gbit``,
``_fast``), each mode's own as ``overlap_<method>_<mode>_vs_sync``, and ``overlap_vs_bound_<method>`` =
bound / the better mode's step at 1 Gbit/s. Beside them the cost model's ideal for each row
(:func:`trainer.comm.cost_model.overlapped_step` with the row's measured compute, forward share,
communication and bucket count): ``overlap_<method>_model_ceiling`` = sync step / the model's best
overlapped step (what no mode can beat on these measurements) and ``overlap_<method>_async_vs_model`` =
the model's async step / the measured one. Plus a timeline PNG of one step
per mode (per bucket: gradient ready, communication start and end, next forward of its layer).

``python -m bench.overlap [--rates 1,0.2,fast] [--quick]`` (root: network namespaces).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, machine_info, print_machine, save_figure, wait_for_ranks, write_results

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("allreduce", "torus", "naive_ag", "hitopk")
MODES = ("none", "async", "cross")
OVERLAP_MODES = ("async", "cross")
MODELS = ("r50stack", "small_resnet")
TARGET_VS_SYNC = 1.3
TARGET_VS_BOUND = 0.85


# ================================================================ models (worker side)
def r50_profile(scale: float) -> list[int]:
    """ResNet-50's weight sizes (conv and fc, in order), each divided by ``scale``."""
    from trainer.models import resnet50

    return [max(1, round(p.numel() / scale)) for name, p in resnet50().named_parameters()
            if name.endswith("weight") and p.dim() > 1]


def r50_stack(scale: float, hidden: int) -> Any:
    """Residual blocks ``x + relu(x W1^T) W2^T`` of ResNet-50's parameter profile (see the docstring)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inner: int) -> None:
            super().__init__()
            self.a = nn.Linear(hidden, inner, bias=False)
            self.b = nn.Linear(inner, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            return x + self.b(self.a(x).relu())

    blocks = [Block(max(1, math.ceil(n / (2 * hidden)))) for n in r50_profile(scale)]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))


def _model_and_batch(name: str, a: argparse.Namespace, rank: int) -> tuple[Any, Any, Any]:
    import torch

    from trainer.models import build_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    if name == "r50stack":
        model = r50_stack(a.scale, a.hidden)
        x = torch.randn(a.batch, a.hidden, generator=g)
    else:
        model = build_model("small_resnet_cifar", 10, width=a.width)
        x = torch.randn(a.batch, 3, 32, 32, generator=g)
    return model, x, torch.randint(0, 10, (a.batch,), generator=g)


# ================================================================ worker
def _over_ranks(values: list[float], op: str) -> list[float]:
    """Element-wise ``"max"`` (the slowest rank's step) or ``"sum"`` (every rank's CPU seconds) over ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def _traced(hook: Any, log: list[dict[str, Any]], names: dict[int, str]) -> Any:
    """The hook, recording per bucket: when DDP handed it over and when its future completed."""
    import torch

    def traced_hook(state: Any, bucket: Any) -> Any:
        rec = {"bucket": bucket.index(), "ready": time.perf_counter(), "numel": bucket.buffer().numel(),
               "layer": min((names.get(id(p), "?") for p in bucket.parameters()), key=_layer_order)}
        log.append(rec)
        fut = hook(state, bucket)

        def done(f: Any) -> Any:
            rec["done"] = time.perf_counter()
            return f.value()
        return fut.then(done)

    traced_hook.comm_hook = True  # type: ignore[attr-defined]
    traced_hook.__annotations__ = {"state": Any, "bucket": torch.distributed.GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}
    return traced_hook


def _layer_order(name: str) -> tuple[int, str]:
    head = name.split(".", 1)[0]
    return (int(head), name) if head.isdigit() else (10**9, name)


class _Runner:
    """One model trained in one mode: ``method=None`` = compute only (no DDP, no communication)."""

    def __init__(self, a: argparse.Namespace, model_name: str, method: str | None, mode: str,
                 rank: int) -> None:
        import torch
        from torch import nn

        from trainer.comm import CommConfig, register
        from trainer.comm.hooks import make_hook

        self.a, self.method = a, method
        self.model, self.x, self.y = _model_and_batch(model_name, a, rank)
        self.loss_fn = nn.CrossEntropyLoss()
        self.state: Any = None
        self.trace: list[dict[str, Any]] = []
        self.forwards: list[tuple[str, float]] = []
        self.net: Any = self.model
        self.engine: Any = None
        if method is not None and mode == "cross":
            from trainer.comm.cross_barrier import CrossBarrier
            from trainer.comm.state import HookState

            self.state = HookState(CommConfig(method=method, selector="mstopk", density=a.density))
            self.engine = CrossBarrier(self.model, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                                       self.state, piece_mb=a.bucket_mb, credit_mb=a.credit_mb)
            self.engine.trace = []
            self.net = self.engine
        elif method is not None:
            cfg = CommConfig(method=method, selector="mstopk", density=a.density, overlap=mode)
            self.net = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=a.bucket_mb)
            names = {id(p): n for n, p in self.model.named_parameters()}
            self.state = register(self.net, cfg, _traced(make_hook(cfg), self.trace, names))
            if mode == "async":
                self.state.comm_thread().trace = []
        if method is not None:
            stamp = self.forwards.append
            for name, mod in self.model.named_children():  # "next forward of its layer" (timeline)
                mod.register_forward_pre_hook(lambda m, i, n=name: stamp((n, time.perf_counter())))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.steps: list[float] = []
        self.fwd: list[float] = []  # compute-only runner: seconds of forward per step (backward's share)
        self._fwd = 0.0
        self.cpu: list[float] = []
        self.busy: list[float] = []
        self.inline: list[float] = []
        self.timeline: dict[str, Any] = {}

    def _one_step(self) -> None:
        from trainer.comm import maybe_step

        if self.engine is not None:  # no zero_grad / optimizer here: the engine owns both
            self.engine.backward(self.loss_fn(self.engine(self.x), self.y))
            return
        self.net.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss = self.loss_fn(self.net(self.x), self.y)
        self._fwd += time.perf_counter() - t
        loss.backward()
        if self.state is not None:
            maybe_step(self.opt, self.state)
        else:
            self.opt.step()

    def step(self, timed: bool, keep_timeline: bool) -> None:
        """``--block`` consecutive steps, timed together (cross overlaps a step's communication with the
        next step's forward: only consecutive steps show it); the engine drains at the block's end, so
        no collective of this mode runs while another mode's block runs."""
        import torch

        thread = self.state._comm if self.state is not None else None
        self.trace.clear()
        self.forwards.clear()
        if thread is not None and thread.trace is not None:
            thread.trace.clear()
        if self.engine is not None:
            self.engine.trace.clear()
        torch.distributed.barrier()  # every rank starts the block together (untimed)
        self._fwd = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        ends = []
        for _ in range(self.a.block):
            self._one_step()
            ends.append(time.perf_counter())
        if self.engine is not None:
            self.engine.synchronize()
        t1 = time.perf_counter()
        if not timed:
            return
        k = self.a.block
        self.steps.append((t1 - t0) / k)
        self.fwd.append(self._fwd / k)
        self.cpu.append((time.process_time() - c0) / k)
        if thread is not None and thread.trace is not None:
            self.busy.append(sum(end - start for _, start, end in thread.trace) / k)
        elif self.engine is not None:
            self.busy.append(sum(t["comm_end"] - t["start"] for t in self.engine.trace) / k)
        elif self.method is not None:  # synchronous hooks: a bucket communicates from hand-over to done
            self.inline.append(sum(r.get("done", r["ready"]) - r["ready"] for r in self.trace) / k)
        if keep_timeline and self.method is not None:
            self.timeline = self._timeline(t0, ends, thread)

    def _timeline(self, t0: float, ends: list[float], thread: Any) -> dict[str, Any]:
        """The block's second-to-last step: its pieces, and the next step's forward of each layer."""
        s0 = ends[-3] if len(ends) > 2 else t0  # that step's start
        s1 = ends[-2] if len(ends) > 1 else ends[-1]
        starts: dict[str, float] = {}
        for n, t in self.forwards:
            if t > s1:
                starts.setdefault(n, t)
        if self.engine is not None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            step = self.engine.step - 2
            pieces = [{"bucket": t["piece"], "ready": t["ready"], "start": t["start"], "done": t["applied"],
                       "comm_end": t["comm_end"], "numel": t["numel"],
                       "layer": min((names[id(p)] for p in self.engine.pieces[t["piece"]].params),
                                    key=_layer_order)}
                      for t in self.engine.trace if t["step"] == step]
            return {"t0": s0, "step_end": s1, "buckets": pieces, "thread": [], "next_forward": starts}
        n_buckets = len(self.trace) // self.a.block
        mine = self.trace[-2 * n_buckets:-n_buckets] if len(ends) > 1 else self.trace[-n_buckets:]
        threads = list(thread.trace) if thread is not None and thread.trace else []
        threads = threads[-2 * n_buckets:-n_buckets] if threads and len(ends) > 1 else threads
        return {"t0": s0, "step_end": s1, "buckets": [dict(r) for r in mine], "thread": threads,
                "next_forward": starts}

    def result(self) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.close()
        elif self.state is not None:
            self.state.close()
        return {"step_s": _over_ranks(self.steps, "max"), "fwd_s": self.fwd, "cpu_s": self.cpu,
                "cpu_all_ranks_s": _over_ranks(self.cpu, "sum"),
                "comm_busy_s": self.busy, "comm_inline_s": self.inline, "timeline": self.timeline}


def _time_method(a: argparse.Namespace, model_name: str, method: str, rank: int) -> dict[str, Any]:
    """Compute only, synchronous hooks and async, INTERLEAVED step by step (drift hits all three)."""
    runners = {"compute": _Runner(a, model_name, None, "none", rank),
               **{mode: _Runner(a, model_name, method, mode, rank) for mode in MODES}}
    total = a.warmup + a.iters
    for it in range(total):
        for r in runners.values():
            r.step(timed=it >= a.warmup, keep_timeline=it == total - 1)
    return {k: r.result() for k, r in runners.items()}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.netns import check_target

    check_target(os.environ["MASTER_ADDR"], os.environ["DC_ALLOWED_ADDRS"].split(","))
    torch.set_num_threads(1)  # 3 ranks on 2 cores: one intra-op thread each
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    for model_name in a.models:
        res[model_name] = {}
        for method in a.methods:
            runs = _time_method(a, model_name, method, rank)
            res[model_name][f"compute/{method}"] = runs.pop("compute")
            for mode, r in runs.items():
                res[model_name][f"{method}/{mode}"] = r
                if rank == 0:
                    print(f"[{a.tag}] {model_name} {method:9s} {mode:5s} step "
                          f"{statistics.median(r['step_s']) * 1e3:8.1f} ms", file=sys.stderr, flush=True)
    if rank == 0:
        Path(a.result).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ================================================================ parent
def _launch(c: Any, a: argparse.Namespace, tag: str, port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dc-overlap-") as tmp:
        result = Path(tmp) / "rank0.json"
        procs, logs = [], []
        n = a.nodes  # one rank on each of the first n nodes (the cluster has at least 3: Redis needs them)
        for rank in range(n):
            env = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_PORT": str(port), "DC_ALLOWED_ADDRS": ",".join(c.addrs), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}
            argv = [sys.executable, "-m", "bench.overlap", "--worker", "--tag", tag, "--result", str(result),
                    *_worker_args(a)]
            logs.append(log := open(Path(tmp) / f"rank{rank}.log", "w+"))  # noqa: SIM115 (closed below)
            procs.append(c.run_on(rank, argv, env=env, cwd=ROOT, stdout=log,
                                  stderr=None if rank == 0 else log))
        wait_for_ranks(procs, logs, tag, a.timeout)
        return json.loads(result.read_text())


def _worker_args(a: argparse.Namespace) -> list[str]:
    return ["--iters", str(a.iters), "--warmup", str(a.warmup), "--block", str(a.block),
            "--credit-mb", str(a.credit_mb), "--density", str(a.density),
            "--bucket-mb", str(a.bucket_mb), "--scale", str(a.scale), "--hidden", str(a.hidden),
            "--width", str(a.width), "--batch", str(a.batch), "--methods", ",".join(a.methods),
            "--models", ",".join(a.models)]


def _rate_suffix(rate: str) -> str:
    return "" if rate == "1" else ("_fast" if rate == "fast" else f"_{rate}gbit")


def analyse(raw: dict[str, dict[str, Any]], methods: list[str], models: list[str],
            cores: int) -> tuple[dict, dict]:
    """Per rate/model/method: median step per mode, the bound, CPU; ratios on the first model."""
    table: dict[str, Any] = {}
    ratios: dict[str, float | None] = {}
    for rate, by_model in raw.items():
        for model, res in by_model.items():
            for method in methods:
                compute = statistics.median(res[f"compute/{method}"]["step_s"])
                row = {}
                for mode in MODES:
                    r = res[f"{method}/{mode}"]
                    busy = statistics.median(r["comm_busy_s"]) if r["comm_busy_s"] else None
                    inline = statistics.median(r["comm_inline_s"]) if r.get("comm_inline_s") else None
                    row[mode] = {"step_s": statistics.median(r["step_s"]),
                                 "cpu_s": statistics.median(r["cpu_s"]), "comm_busy_s": busy,
                                 "comm_inline_s": inline,
                                 "cpu_all_ranks_s": statistics.median(r["cpu_all_ranks_s"])}
                comm = row["async"]["comm_busy_s"] or 0.0
                bound = max(compute, comm)
                row["compute_s"], row["comm_s"], row["bound_s"] = compute, comm, bound
                row.update(_model_row(res, method, compute, comm, row["none"]["step_s"]))
                row["comm_share"] = comm / row["none"]["step_s"] if row["none"]["step_s"] else None
                best = min(OVERLAP_MODES, key=lambda m: row[m]["step_s"])
                row["best_mode"] = best
                for mode in OVERLAP_MODES:
                    step = row[mode]["step_s"]
                    row[f"{mode}_vs_sync"] = row["none"]["step_s"] / step
                    row[f"{mode}_vs_bound"] = bound / step
                    # The machine's own floor: every rank's CPU seconds of the step over the cores.
                    floor = row[mode]["cpu_all_ranks_s"] / cores
                    row[f"{mode}_vs_machine_bound"] = max(bound, floor) / step
                row["cpu_floor_s"] = row[best]["cpu_all_ranks_s"] / cores
                table.setdefault(rate, {}).setdefault(model, {})[method] = row
                if model == models[0]:
                    sfx = _rate_suffix(rate)
                    ratios[f"overlap_{method}_vs_sync{sfx}"] = row[f"{best}_vs_sync"]  # the best mode
                    for mode in OVERLAP_MODES:
                        ratios[f"overlap_{method}_{mode}_vs_sync{sfx}"] = row[f"{mode}_vs_sync"]
                    # the cost model's ideal (no contention) with this row's compute and communication:
                    # what overlap could give here at best, and how close async comes to its prediction
                    ratios[f"overlap_{method}_model_ceiling{sfx}"] = row["model_ceiling"]
                    model_async = row["model"]["async"]
                    ratios[f"overlap_{method}_async_vs_model{sfx}"] = model_async / row["async"]["step_s"]
                    if rate == "1":
                        ratios[f"overlap_vs_bound_{method}"] = row[f"{best}_vs_bound"]
                        ratios[f"overlap_vs_machine_bound_{method}"] = row[f"{best}_vs_machine_bound"]
    return table, ratios


def _model_row(res: dict[str, Any], method: str, compute: float, comm: float, sync: float) -> dict[str, Any]:
    """The cost model's steps (:func:`trainer.comm.cost_model.overlapped_step`, no contention) for this
    row's measured compute-only step (its forward share measured beside), the async thread's busy
    seconds as the communication, and the sync run's bucket count as the pieces; ``model_ceiling`` =
    the measured sync step / the model's best overlap (async, or cross's lower bound): no mode can beat
    it on these measurements."""
    from trainer.comm.cost_model import overlapped_step

    fwds = res[f"compute/{method}"].get("fwd_s") or []  # absent: the model's default share
    share = min(1.0, max(0.0, 1.0 - statistics.median(fwds) / compute)) if fwds and compute > 0 else 2 / 3
    tl = res[f"{method}/none"].get("timeline") or {}
    pieces = max(1, len(tl.get("buckets") or []))
    model = overlapped_step(compute, comm, pieces=pieces, backward_share=share,
                            dense_hook=method == "allreduce")
    best = min(model["async"], model["cross_bound"])
    return {"model": model, "model_pieces": pieces, "backward_share": share,
            "model_ceiling": sync / best if best > 0 else None}


def _raw_steps(raw: dict[str, Any]) -> dict[str, Any]:
    """Every timed step (slowest rank) per rate / model / method-mode, for the JSON."""
    return {r: {m: {k: v["step_s"] for k, v in res.items()} for m, res in by.items()}
            for r, by in raw.items()}


def plot_timeline(raw: dict[str, Any], rate: str, model: str, method: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(MODES), 1, figsize=(10, 2.2 + 1.4 * len(MODES)), sharex=True)
    for ax, mode in zip(axes, MODES):
        tl = raw[rate][model][f"{method}/{mode}"]["timeline"]
        if not tl:
            continue
        t0 = tl["t0"]
        thread = tl["thread"]
        for i, b in enumerate(tl["buckets"]):
            ready, done = b["ready"] - t0, b.get("done", b["ready"]) - t0
            if "start" in b:  # cross: the engine's own times (communicated, then applied)
                start, comm_end = b["start"] - t0, b["comm_end"] - t0
            else:
                start = thread[i][1] - t0 if mode == "async" and i < len(thread) else ready
                comm_end = done
            ax.barh(i, start - ready, left=ready, color="0.8", height=0.6)
            ax.barh(i, comm_end - start, left=start, color="tab:blue", height=0.6)
            if done > comm_end:
                ax.barh(i, done - comm_end, left=comm_end, color="tab:green", height=0.6)
            fwd = tl["next_forward"].get(b["layer"].split(".", 1)[0])
            if fwd is not None:
                ax.plot([fwd - t0], [i], "r|", markersize=12)
        ax.axvline(tl["step_end"] - t0, color="k", lw=0.8, ls="--")
        ax.set_ylabel(f"{mode}\nbucket")
        ax.set_title(f"{model}, {method}, {rate} Gbit/s: grey = ready->start, blue = communicating, green = "
                     "waiting for the verdict + update, | = next forward of its first layer, -- = backward "
                     "end", fontsize=8)
    axes[-1].set_xlabel("seconds since the step started (rank 0)")
    save_figure(fig, path)


def plot_ratios(table: dict[str, Any], model: str, path: Path, nodes: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(table)
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(rates))
    methods = list(next(iter(table.values()))[model])
    for k, rate in enumerate(rates):
        vals = [table[rate][model][m][f"{table[rate][model][m]['best_mode']}_vs_sync"] for m in methods]
        bars = ax.bar([i + k * width for i in range(len(methods))], vals, width, label=f"{rate} Gbit/s")
        for bar, m in zip(bars, methods):
            ax.annotate(table[rate][model][m]["best_mode"],
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(TARGET_VS_SYNC, color="r", lw=0.8, ls="--", label=f"goal {TARGET_VS_SYNC}")
    ax.set_xticks([i + width * (len(rates) - 1) / 2 for i in range(len(methods))], methods)
    ax.set_ylabel("sync step / best overlap mode's step")
    ax.set_title(f"best of --overlap async / cross vs synchronous hooks ({model}, {nodes} emulated nodes x "
                 "1 rank)", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,0.2,fast",
                    help="link rates in Gbit/s, comma-separated; 'fast' = unshaped (default 1,0.2,fast)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {', '.join(METHODS)}")
    ap.add_argument("--models", default=",".join(MODELS), help=f"subset of {', '.join(MODELS)}")
    ap.add_argument("--iters", type=int, default=8, help="timed blocks per method x mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed blocks first (DDP's layout step too)")
    ap.add_argument("--block", type=int, default=3,
                    help="consecutive steps timed together (cross overlaps one step's communication with "
                         "the next forward); a mode's step time = its block's time / this")
    ap.add_argument("--credit-mb", type=float, default=8.0,
                    help="cross: bytes a negotiation round may start (ByteScheduler's credit)")
    ap.add_argument("--density", type=float, default=0.01, help="sparse methods' density")
    ap.add_argument("--bucket-mb", type=float, default=2.0, help="DDP bucket_cap_mb")
    ap.add_argument("--scale", type=float, default=8.0, help="r50stack: ResNet-50's sizes divided by this")
    ap.add_argument("--hidden", type=int, default=256, help="r50stack: activation width")
    ap.add_argument("--width", type=int, default=16, help="small_resnet: width")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument("--quick", action="store_true",
                    help="smoke: 1 Gbit/s and unshaped, the first model made tiny, 2 timed steps, "
                         "overlap_quick.json")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR), help="where overlap(_quick).json and PNGs go")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per rate")
    ap.add_argument("--nodes", type=int, default=3,
                    help="nodes with one rank each (default 3; 2 leaves a core per rank on a 2-core "
                         "machine, so the link rather than the CPU can bind; the emulated cluster keeps 3)")
    ap.add_argument("--name", default="",
                    help="result name (default overlap, or overlap_quick with --quick): "
                         "bench/results/NAME.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.methods = [m for m in a.methods.split(",") if m]
    a.models = [m for m in a.models.split(",") if m]
    for m in a.methods:
        if m not in METHODS:
            ap.error(f"--methods: {m!r}; choose from {', '.join(METHODS)}")
    for m in a.models:
        if m not in MODELS:
            ap.error(f"--models: {m!r}; choose from {', '.join(MODELS)}")
    if a.nodes < 2:
        ap.error(f"--nodes {a.nodes}: needs at least 2 (one rank per node)")
    if a.name and not re.fullmatch(r"[a-z0-9_]+", a.name):
        ap.error(f"--name {a.name!r}: lower-case letters, digits and _ only (it names files)")
    if a.quick and not a.worker:
        # 1 Gbit/s then unshaped: the ratio names of both kinds, and the switch to unshaped links
        a.rates, a.iters, a.warmup, a.scale, a.hidden, a.width, a.batch = "1,fast", 2, 1, 256.0, 32, 4, 8
        a.bucket_mb, a.block = 0.02, 2  # several buckets even for the tiny model
        a.models = a.models[:1]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    from bench.emucluster import EmuCluster, EmuConfig, why_unavailable

    why = why_unavailable()
    if why:
        print(f"bench.overlap needs the emulated cluster: {why}", file=sys.stderr)
        return 2
    machine = print_machine(machine_info())
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    raw: dict[str, Any] = {}
    first = None if rates[0] == "fast" else float(rates[0])
    with tempfile.TemporaryDirectory(prefix="dc-overlap-emu-") as d, \
            EmuCluster(EmuConfig(nodes=max(3, a.nodes), rate_gbit=first, state_dir=d, timeout=120.0)) as c:
        for k, rate in enumerate(rates):
            if k:
                c.set_rate(None if rate == "fast" else float(rate))
            print(f"rate {rate}: {len(a.methods)} methods x {len(MODES)} modes x {len(a.models)} models",
                  file=sys.stderr, flush=True)
            raw[rate] = _launch(c, a, f"{rate}", 29500 + k)
    table, ratios = analyse(raw, a.methods, a.models, os.cpu_count() or 1)
    name = a.name or ("overlap_quick" if a.quick else "overlap")
    out = Path(a.results_dir)
    notes = [f"bound = max(compute, comm): compute = the step without DDP, comm = the communication thread's "
             f"busy seconds per step (async mode); goals: vs_sync >= {TARGET_VS_SYNC} where comm >= 30 % "
             f"of the step, vs_bound >= {TARGET_VS_BOUND}",
             "cores shared by the ranks: backward and the communication threads compete for them; "
             "cpu_floor_s = every rank's CPU seconds per async step / the machine's cores, and "
             "overlap_vs_machine_bound_<method> = max(compute, comm, cpu floor) / async step",
             "comm_inline_s (sync mode): seconds from DDP's hand-over of each bucket to its result, "
             "summed over the step's buckets; comm_busy_s (async): the thread's busy seconds"]
    write_results(name, machine=machine, config={k: v for k, v in vars(a).items()
                                                   if k not in ("worker", "tag", "result")},
                  results={"table": table, "raw_steps": _raw_steps(raw)},
                  ratios=ratios, notes=notes, out_dir=out)
    model = a.models[0]
    rate = "1" if "1" in raw else rates[0]
    method = "hitopk" if "hitopk" in a.methods else a.methods[0]
    plot_timeline(raw, rate, model, method, out / f"{name}_timeline.png")
    plot_ratios(table, model, out / f"{name}.png", a.nodes)
    for r, by in table.items():
        for m, rows in by.items():
            for meth, row in rows.items():
                print(f"{r:>5} {m:12s} {meth:9s} sync {row['none']['step_s'] * 1e3:7.1f} ms  async "
                      f"{row['async']['step_s'] * 1e3:7.1f} ms  x{row['async_vs_sync']:.2f}  cross "
                      f"{row['cross']['step_s'] * 1e3:7.1f} ms  x{row['cross_vs_sync']:.2f}  bound "
                      f"{row['bound_s'] * 1e3:7.1f} ms  cpu floor {row['cpu_floor_s'] * 1e3:6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
