"""Shared helpers for benchmarks: machine description, JSON result files, PNG bar charts.

Every benchmark writes ``bench/results/<name>.json`` with the keys ``machine``, ``config``,
``results`` and a flat ``ratios`` object (name -> number; higher is better unless the
name says otherwise), plus a PNG plot beside it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """Describe the machine the benchmark ran on (printed and stored in the JSON)."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def print_machine(info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    info = dict(info or machine_info())
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    return info


def write_results(
    name: str,
    *,
    machine: Mapping[str, Any],
    config: Mapping[str, Any],
    results: Any,
    ratios: Mapping[str, float | None],
    notes: Sequence[str] = (),
    out_dir: Path | str | None = None,
) -> Path:
    """Write ``<out_dir>/<name>.json`` in the project's benchmark convention and return its path."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    doc = {
        "machine": dict(machine),
        "config": dict(config),
        "results": results,
        "ratios": {k: (None if v is None else float(v)) for k, v in ratios.items()},
        "notes": list(notes),
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")
    for k, v in doc["ratios"].items():
        print(f"  ratio {k} = {v if v is None else round(v, 3)}")
    return path


def save_figure(fig: Any, path: Path | str) -> Path:
    """Save a matplotlib figure as a PNG (tight layout, 110 dpi), close it and say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    print(f"wrote {p}")
    return p


def bar_chart(
    path: Path | str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str,
    ylabel: str,
    annotate: bool = True,
) -> Path:
    """Save a simple labelled bar chart (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    bars = ax.bar(range(len(labels)), values, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if annotate:
        for b, v in zip(bars, values):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    return save_figure(fig, path)


# ------------------------------------------------------------------ /proc readers (no psutil needed)
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int, *, reaped_children: bool = True) -> float:
    """user + system CPU seconds of process ``pid`` from ``/proc/<pid>/stat`` (0.0 when it is gone);
    with ``reaped_children`` also the CPU of its children that exited and were waited for (cutime,
    cstime: e.g. a process pool started and joined during a pass)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / _CLK_TCK


def proc_memory(pid: int) -> dict[str, int]:
    """Resident memory of ``pid`` in bytes from ``/proc/<pid>/status``: ``rss`` (VmRSS), ``peak``
    (VmHWM), ``anon`` (RssAnon), ``file`` (RssFile), ``shmem`` (RssShmem); and from
    ``/proc/<pid>/smaps_rollup`` (when readable) ``uss`` (Private_Clean + Private_Dirty: what this
    process alone holds -- pages shared with its parent after a fork, or shared memory, are not in it)
    and ``pss`` (shared pages divided among their sharers); {} when it is gone."""
    names = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    out[names[key]] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        return {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            roll = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f) if v.strip()
                    and v.split()[0].isdigit()}
        out["uss"] = roll.get("Private_Clean", 0) + roll.get("Private_Dirty", 0)
        out["pss"] = roll.get("Pss", 0)
    except (OSError, ValueError):
        pass
    return out


def child_pids(pid: int) -> list[int]:
    """Live direct children of ``pid`` (from ``/proc/<pid>/task/*/children``)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return kids


def run_epochs(out: str) -> list[dict[str, Any]]:
    """The ``event: epoch`` records of a training run's ``<out>/metrics.jsonl`` (the trainer's format)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["event"] == "epoch"]


def wait_for_ranks(procs: Sequence[Any], logs: Sequence[Any], tag: str, timeout: float) -> None:
    """Wait for every rank process (``subprocess.Popen``) to exit 0. A rank that fails, or ``timeout``
    seconds passing, raises after printing each rank's log tail (``logs``: their open log files, same
    order); the processes started by the caller -- only those, by handle -- are killed if still running
    and the logs closed, whatever happened."""
    import sys

    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"{tag}: rank(s) {failed or 'all'} failed or timed out")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"{tag}: exit codes {[p.returncode for p in procs]}")
    except BaseException:
        for r, log in enumerate(logs):
            log.seek(0)
            print(f"--- rank {r} log tail ---\n{log.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def launch_2x2(module: str, args: list[str], log: str, timeout: float = 1800.0) -> None:
    """``python -m module args`` as a 2-node job on loopback: two ``torchrun --nnodes 2 --nproc-per-node 2``
    agents (LOCAL_WORLD_SIZE = 2, so intra/inter-node groups are real), logs in ``<log>.node{0,1}.log``;
    raises on any failure, and kills an agent still running after ``timeout`` seconds."""
    launch_nodes(module, args, log, timeout, nodes=2, per_node=2)


def launch_nodes(module: str, args: list[str], log: str, timeout: float = 1800.0, *, nodes: int = 2,
                 per_node: int = 2) -> None:
    """:func:`launch_2x2` for ``nodes`` x ``per_node`` ranks (one torchrun agent per emulated node)."""
    import subprocess
    import sys

    from trainer.distenv import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
               str(per_node), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
               "-m", module, *args]
        with open(f"{log}.node{node}.log", "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(codes):
        raise RuntimeError(f"{module}: torchrun exited with {codes}; see {log}.node*.log")
