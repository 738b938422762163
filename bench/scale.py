"""Scale rehearsal: the whole path at 1 %, 10 % and 100 % of ImageNet's file count, side by side.

For each size (12,812 / 128,117 / 1,281,167 files in 1,000 class folders, generated once by
:mod:`bench.scale_data`: 64x48 JPEGs, 1 % of them corrupt) it measures, on real components:

* ``listing``: ``Manifest.build`` of the tree in a fresh process (time, peak RSS, manifest bytes);
* ``fill``: three real daemons (``sys.executable -m cache_daemon``, one per master, ownership
  ``cluster``, 1 decode process each) filling a fresh 3-master Redis Cluster with the short-side-32
  variant, until every ``/status`` says ``full`` (daemon start-up and listing included); the daemons'
  resident memory when full;
* ``wait_warm``: ``CachedImageNet(...).wait_warm()`` once the fill is done (construction separately:
  ``open``, which revalidates the persisted listing);
* ``status`` / ``metrics``: ``GET /status`` and ``GET /metrics`` (time, bytes) on a full dataset with
  its quarantined files;
* ``idle_pass``: one fill pass of a daemon over the full dataset, woken with ``POST /datasets`` (the
  already-configured dataset: nothing new is registered): CPU seconds of the daemon from
  ``/proc/<pid>/stat`` (utime + stime + reaped children: the pass's process pool);
* ``plan``: :func:`datacache.plan.plan` (what ``datacache plan`` prints) vs the masters' measured
  ``used_memory`` growth: ``plan_memory_error`` (relative error, a fraction);
* ``epoch1`` / ``epoch2``: full training-order epochs through ``CachedImageNet`` with
  ``DistributedSampler`` -- 2 rank processes (each ``DistributedSampler(num_replicas=2, rank=r)``, no
  process group), 2 DataLoader workers each, batch 256, ``AugmentCollate(32)``; wall time = the slower
  rank; resident memory of every DataLoader worker;
* ``kill_epoch``: a third epoch during which one master is killed (SIGKILL) at ~30 %: it must complete
  (misses are decoded from the source);
* ``refill``: that master restarted empty; its daemon (woken) refills it; time until its key count is
  back.

Cost per sample = phase seconds / files (the idle pass: CPU seconds / files). ``ratios``:
``scale_cost_ratio_<phase>`` = cost per sample at the largest size / at the smallest (lower is better,
target <= 1.5), ``..._rss`` for the memory of the phases that hold one; ``status_bytes_growth`` /
``metrics_bytes_growth`` (largest / smallest, target ~1); ``daemon_rss_growth_vs_manifest`` (growth of a
daemon's resident memory once its dataset is full, from the smallest to the largest size / the largest
manifest's bytes, target <= 1: "the manifest plus a constant"), with ``daemon_peak_growth_vs_manifest``
(the same for its peak, VmHWM: the listing and the fill included) reported beside it; for a loader
worker, whose RSS also counts pages it shares (the manifest's
shared-memory columns, mapped once per rank; heap pages inherited from the rank at fork),
``worker_private_growth_vs_manifest`` (growth of its private memory, USS from ``smaps_rollup``, per byte
of manifest growth, target <= 0.1: no per-worker copy of anything per sample; with three sizes or more
measured between the two largest, because per-process caches capped at a fixed size -- the Redis reply
arena -- fill over the first few hundred batches; ``..._from_smallest`` kept beside it) and
``shared_per_rank_growth_vs_manifest`` (growth of
the shared-memory pages it maps, target <= 1.1: the manifest plus the 1 byte per sample of shared
quarantine flags), with ``worker_rss_growth_vs_manifest`` reported beside them (no target);
``idle_pass_cpu_s`` (target <= 1 at 1.28M); ``plan_memory_error`` (target <= 0.1);
``first_epoch_vs_ffcv_convert`` (FFCV's ``DatasetWriter`` + first epoch from ``slowfile://`` vs our cold
first epoch from ``slowfile://``, at 128k, when FFCV is installed; target >= 1.5).

``python -m bench.scale`` (all three sizes; ``--sizes`` to choose), ``--quick`` (two tiny sizes,
20 classes: a smoke run of every phase in well under a minute). Writes ``bench/results/scale.json``
and ``scale.png`` (``scale_quick.*`` for ``--quick``; ``--out-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from bench.common import (
    RESULTS_DIR,
    child_pids,
    machine_info,
    print_machine,
    proc_cpu_seconds,
    proc_memory,
    save_figure,
    write_results,
)
from bench.scale_data import IMAGENET_FILES, ensure_scale_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_SIZES = (round(IMAGENET_FILES / 100), round(IMAGENET_FILES / 10), IMAGENET_FILES)
QUICK_SIZES = (600, 2400)
SHORT = 32  # short side of the cached variant (64x48 sources -> 42x32 records)
CROP = 32  # AugmentCollate output size
BATCH = 256
TARGET_RATIO = 1.5
PER_SAMPLE_PHASES = ("listing", "fill", "open", "wait_warm", "idle_pass", "plan", "epoch1", "epoch2",
                     "kill_epoch", "refill")


# ------------------------------------------------------------------ small helpers
def http_get(url: str, timeout: float = 60.0) -> tuple[int, bytes, float]:
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body, code = r.read(), r.status
    except urllib.error.HTTPError as e:
        body, code = e.read(), e.code
    return code, body, time.perf_counter() - t


def http_post_json(url: str, obj: Any, timeout: float = 30.0, token: str = "") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def tree_memory(pid: int) -> dict[str, int]:
    """Resident memory of ``pid`` and of its live children (a daemon's decode pool)."""
    main = proc_memory(pid)
    kids = [proc_memory(k) for k in child_pids(pid)]
    return {"main_rss": main.get("rss", 0), "main_peak": main.get("peak", 0),
            "children_rss": sum(k.get("rss", 0) for k in kids), "children": len(kids)}


class Daemon:
    """One ``python -m cache_daemon`` process with a TOML config written here."""

    def __init__(self, workdir: str, name: str, cache: str, redis_node: str, root: str, poll: float) -> None:
        from datacache.devtools.redis_local import free_port

        self.name, self.port, self.root = name, free_port(), root
        # POST /datasets (the wake-up below) needs a token and the dataset under allowed_sources
        self.token = secrets.token_urlsafe(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(workdir, f"{name}.log")
        cfg = os.path.join(workdir, f"{name}.toml")
        with open(cfg, "w") as f:
            f.write(f'node = "{name}"\ncache = "{cache}"\nredis_node = "{redis_node}"\n'
                    'ownership = "cluster"\n'
                    f'workers = 1\nhttp_port = {self.port}\npoll_interval = {poll}\nt1_dir = "none"\n'
                    f'api_token = "{self.token}"\nallowed_sources = ["{os.path.dirname(root)}"]\n\n'
                    f'[[datasets]]\nsource = "{root}"\nshort_side = {SHORT}\n')
        self.cmd = [sys.executable, "-m", "cache_daemon", "--config", cfg, "--no-progress"]
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as out:
            # own session: the daemon and its decode pool are one process group we can signal
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "PYTHONPATH": REPO})

    def status(self) -> dict[str, Any] | None:
        try:
            code, body, _ = http_get(self.base + "/status", timeout=30)
        except OSError:
            return None
        return json.loads(body) if code == 200 else None

    def dataset(self) -> dict[str, Any] | None:
        st = self.status()
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon {self.name} exited ({self.proc.returncode}); log: {self.log}")
        return st["datasets"][0] if st and st.get("datasets") else None

    def wake(self) -> bool:
        """Start a pass now: re-register the configured dataset (POST /datasets sets the daemon's wake
        event; the dataset is the same one, so nothing new is registered). False if refused."""
        try:
            code, _ = http_post_json(self.base + "/datasets", {"source": self.root, "short_side": SHORT},
                                     token=self.token)
        except OSError:
            return False
        return code in (200, 201)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def wait_for(cond: Any, timeout: float, what: str, poll: float = 0.5) -> float:
    t = time.perf_counter()
    while True:
        if cond():
            return time.perf_counter() - t
        if time.perf_counter() - t > timeout:
            raise TimeoutError(f"{what}: not done after {timeout:.0f} s")
        time.sleep(poll)


def dbsize(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True, timeout=30)
    try:
        return int(out.stdout.strip())
    except ValueError:
        return -1


def used_memory(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "memory"], capture_output=True, text=True,
                         timeout=30).stdout
    for line in out.splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":")[1])
    return 0


# ------------------------------------------------------------------ rank processes
RANK_CODE = "import sys; from bench.scale import rank_main; rank_main(sys.argv[1])"


def rank_main(cfg_json: str) -> None:
    """One training rank (run in its own interpreter by :func:`run_ranks`): epochs through
    ``CachedImageNet`` with ``DistributedSampler(num_replicas, rank)``; one JSON line per epoch on stdout,
    ``PROGRESS <epoch> <fraction>`` lines as batches arrive (the parent kills a master on one)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.loader import worker_init
    from client.augment import AugmentCollate
    from client.dataset import CachedImageNet

    cfg = json.loads(cfg_json)
    torch.set_num_threads(1)
    t = time.perf_counter()
    ds = CachedImageNet(cfg["root"], cache=cfg["cache"], short_side=SHORT, t1_dir=None)
    open_s = time.perf_counter() - t
    sampler = DistributedSampler(ds, num_replicas=cfg["world"], rank=cfg["rank"], shuffle=True, seed=0)
    # worker-process boundary: the manifest columns are in shared memory (CachedImageNet), each worker
    # opens its own store connections after fork
    loader = DataLoader(ds, batch_size=cfg["batch"], sampler=sampler, num_workers=cfg["workers"],
                        collate_fn=AugmentCollate(CROP), persistent_workers=True, worker_init_fn=worker_init,
                        prefetch_factor=2)
    print(json.dumps({"open_s": open_s, "samples": len(ds), "manifest_bytes": ds.manifest.nbytes}),
          flush=True)
    nb = len(loader)
    for e in range(cfg["epochs"]):
        sampler.set_epoch(e)
        # epoch barrier without a process group: say READY, start when the parent says GO (it does once
        # every rank is ready), so the ranks' epochs overlap as in DDP and a fault lands in one epoch
        print(f"READY {e}", flush=True)
        if sys.stdin.readline().strip() != "GO":
            raise SystemExit(f"rank {cfg['rank']}: parent went away before epoch {e}")
        ds.reset_stats()
        n, t = 0, time.perf_counter()
        for b, (images, labels) in enumerate(loader):
            assert images.dtype == torch.uint8
            n += int(labels.numel())
            print(f"PROGRESS {e} {(b + 1) / nb:.4f}", flush=True)
        dt = time.perf_counter() - t
        it = getattr(loader, "_iterator", None)  # torch-internal: the persistent workers
        workers = [proc_memory(w.pid) for w in getattr(it, "_workers", [])]
        st = ds.stats()
        print(json.dumps({"epoch": e, "seconds": dt, "samples": n, "workers_mem": workers,
                          "main_mem": proc_memory(os.getpid()), "hits": st["hits"], "misses": st["misses"],
                          "decoded": st["decoded"], "quarantined": st.get("quarantined"),
                          "substituted": st.get("substituted")}), flush=True)
    ds.flush(60)


def run_ranks(root: str, cache: str, epochs: int, *, world: int = 2, workers: int = 2, batch: int = BATCH,
              on_progress: Any = None, timeout: float = 3600) -> list[dict[str, Any]]:
    """``world`` rank processes at once; returns per epoch {seconds (slowest rank), per-rank records}.
    ``on_progress(epoch, fraction)`` is called (from a reader thread) for rank 0's progress lines."""
    procs, outs = [], []
    for r in range(world):
        cfg = json.dumps({"root": root, "cache": cache, "epochs": epochs, "world": world, "rank": r,
                          "workers": workers, "batch": batch})
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_CODE, cfg], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONPATH": REPO}))
        outs.append([])
    errs: list[str] = ["" for _ in procs]
    ready: dict[int, int] = {}
    lock = threading.Lock()

    def go(e: int) -> None:  # called under ``lock`` by the reader that saw the last READY of epoch e
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write("GO\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]

    def reader(r: int) -> None:
        for line in procs[r].stdout:  # type: ignore[union-attr]
            if line.startswith("READY"):
                e = int(line.split()[1])
                with lock:
                    ready[e] = ready.get(e, 0) + 1
                    if ready[e] == world:
                        go(e)
            elif line.startswith("PROGRESS"):
                _, e, f = line.split()
                if r == 0 and on_progress is not None:
                    on_progress(int(e), float(f))
            elif line.startswith("{"):
                outs[r].append(json.loads(line))

    def err_reader(r: int) -> None:
        errs[r] = procs[r].stderr.read()[-4000:]  # type: ignore[union-attr]

    threads = [threading.Thread(target=f, args=(r,), daemon=True)
               for r in range(world) for f in (reader, err_reader)]
    for th in threads:
        th.start()
    try:
        for p in procs:
            p.wait(timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    for th in threads:
        th.join(30)
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{errs[r]}")
    heads = [o[0] for o in outs]
    res = []
    for e in range(epochs):
        recs = [o[1 + e] for o in outs]
        res.append({"seconds": max(x["seconds"] for x in recs), "samples": sum(x["samples"] for x in recs),
                    "worker_rss_max": max(w.get("rss", 0) for x in recs for w in x["workers_mem"]),
                    # private to one worker (smaps_rollup USS) vs shared (the manifest's shared-memory
                    # columns, mapped by the rank and all its workers: counted once per rank)
                    "worker_uss_max": max(w.get("uss", 0) for x in recs for w in x["workers_mem"]),
                    "worker_shmem_max": max(w.get("shmem", 0) for x in recs for w in x["workers_mem"]),
                    "rank_rss_max": max(x["main_mem"].get("rss", 0) for x in recs), "ranks": recs,
                    "open_s": max(h["open_s"] for h in heads)})
    return res


# ------------------------------------------------------------------ phases of one size
def listing_phase(root: str, workdir: str) -> dict[str, Any]:
    code = ("import json, resource, sys, time\nfrom datacache.manifest import Manifest\n"
            "t = time.perf_counter()\nm = Manifest.build(sys.argv[1], persist_dir=sys.argv[2])\n"
            "dt = time.perf_counter() - t\n"
            # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of this (large) benchmark
            # process would report the parent's size
            "hwm = [int(x.split()[1]) * 1024 for x in open('/proc/self/status') if x.startswith('VmHWM:')]\n"
            "print(json.dumps({'seconds': dt, 'files': len(m), 'manifest_bytes': m.nbytes, "
            "'peak_rss': hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")
    out = subprocess.run([sys.executable, "-c", code, root, os.path.join(workdir, "listing-manifests")],
                         capture_output=True, text=True, timeout=3600, env={**os.environ, "PYTHONPATH": REPO})
    if out.returncode != 0:
        raise RuntimeError(f"listing failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def idle_pass_cpu(daemons: list[Daemon], timeout: float) -> dict[str, Any]:
    """Wake every (full) daemon once and measure the CPU seconds of the pass it runs."""
    before = {}
    for d in daemons:
        ds = d.dataset()
        if ds is None:
            raise RuntimeError(f"daemon {d.name} has no dataset status")
        before[d.name] = (ds["passes"], proc_cpu_seconds(d.proc.pid))
    t = time.perf_counter()
    if not all(d.wake() for d in daemons):
        raise RuntimeError("POST /datasets was refused: cannot wake the daemons for an idle pass")
    out: dict[str, Any] = {}
    polls = 0
    pending = list(daemons)
    while pending:
        time.sleep(1.0)  # few /status calls: they cost the daemon CPU and run in its HTTP thread
        for d in list(pending):
            ds = d.dataset()
            polls += 1
            if ds and ds["passes"] > before[d.name][0] and ds["status"] in ("full", "budget"):
                out[d.name] = {"cpu_s": proc_cpu_seconds(d.proc.pid) - before[d.name][1],
                               "wall_s": time.perf_counter() - t}
                pending.remove(d)
        if time.perf_counter() - t > timeout:
            raise TimeoutError(f"idle pass not finished after {timeout:.0f} s: "
                               + "; ".join(stuck_detail(d) for d in pending))
    cpu = [v["cpu_s"] for v in out.values()]
    return {"per_daemon": out, "cpu_s_max": max(cpu), "cpu_s_mean": sum(cpu) / len(cpu),
            "seconds": max(v["wall_s"] for v in out.values()), "status_polls": polls}


def stuck_detail(d: Daemon) -> str:
    """What a daemon that does not finish a pass is doing: its status and, from /proc, each thread's
    wait channel and the children it has (a fill pass forks a process pool and joins it)."""
    st = d.dataset() or {}
    threads = []
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{d.proc.pid}/task")):
            with contextlib.suppress(OSError), open(f"/proc/{d.proc.pid}/task/{tid}/wchan") as f:
                threads.append(f.read().strip() or "running")
    return (f"daemon {d.name}: status {st.get('status')!r}, passes {st.get('passes')}, "
            f"error {st.get('error')!r}, thread wait channels {threads}, "
            f"live children {child_pids(d.proc.pid)}")


def run_size(n: int, root: str, workdir: str, *, kill: bool, timeout: float, batch: int = BATCH
             ) -> dict[str, Any]:
    import redis

    from datacache.devtools.redis_local import start_cluster
    from datacache.plan import plan

    res: dict[str, Any] = {"files": n, "root": root}
    print(f"[{n:,}] listing")
    res["listing"] = listing_phase(root, workdir)
    print(f"  {res['listing']['seconds']:.1f} s, manifest {res['listing']['manifest_bytes'] / 1e6:.1f} MB")
    cluster = start_cluster(os.path.join(workdir, "cluster"), 3)
    daemons: list[Daemon] = []
    try:
        base_used = sum(used_memory(m.port) for m in cluster.masters)
        print(f"[{n:,}] fill by 3 daemons")
        t = time.perf_counter()
        daemons = [Daemon(workdir, f"d{i}", cluster.url, m.addr, root, poll=3600)
                   for i, m in enumerate(cluster.masters)]

        def all_full() -> bool:
            sts = [d.dataset() for d in daemons]
            return all(s is not None and s["status"] == "full" for s in sts)

        wait_for(all_full, timeout, "daemon fill", poll=0.5)
        fill_s = time.perf_counter() - t
        dsts = [d.dataset() or {} for d in daemons]
        res["fill"] = {"seconds": fill_s, "decoded": sum(s.get("decoded", 0) for s in dsts),
                       "quarantined": sum(s.get("quarantined_count", 0) for s in dsts),
                       "owned": [s.get("owned", 0) for s in dsts],
                       "daemon_mem": {d.name: tree_memory(d.proc.pid) for d in daemons}}
        # peak resident memory (VmHWM) of each daemon's main process since it started: the fill pass included
        res["fill"]["daemon_rss_max"] = max(m["main_peak"] for m in res["fill"]["daemon_mem"].values())
        # resident now that the dataset is full (what a daemon holds for the rest of its life)
        res["fill"]["daemon_rss_full"] = max(m["main_rss"] for m in res["fill"]["daemon_mem"].values())
        print(f"  {fill_s:.1f} s ({n / fill_s:.0f} files/s), quarantined {res['fill']['quarantined']}, "
              f"daemon peak RSS max {res['fill']['daemon_rss_max'] / 1e6:.0f} MB")
        used = sum(used_memory(m.port) for m in cluster.masters) - base_used
        keys = sum(dbsize(m.port) for m in cluster.masters)
        res["redis"] = {"used_memory_growth": used, "keys": keys}

        from client.dataset import CachedImageNet

        t = time.perf_counter()
        ds = CachedImageNet(root, cache=cluster.url, short_side=SHORT, t1_dir=None)
        res["open"] = {"seconds": time.perf_counter() - t}
        t = time.perf_counter()
        report = ds.wait_warm(timeout=timeout)
        res["wait_warm"] = {"seconds": time.perf_counter() - t, "full": bool(report.get("full"))}
        del ds
        for ep in ("status", "metrics"):
            runs = [http_get(daemons[0].base + "/" + ep) for _ in range(5)]
            if any(c != 200 for c, _, _ in runs):
                raise RuntimeError(f"GET /{ep} answered {[c for c, _, _ in runs]}")
            res[ep] = {"seconds": sorted(dt for _, _, dt in runs)[2], "bytes": len(runs[-1][1])}
        print(f"  /status {res['status']['bytes']} B {res['status']['seconds'] * 1e3:.1f} ms, /metrics "
              f"{res['metrics']['bytes']} B {res['metrics']['seconds'] * 1e3:.1f} ms")

        print(f"[{n:,}] idle pass")
        try:
            res["idle_pass"] = idle_pass_cpu(daemons, min(timeout, 300.0))  # a hung pass: give up sooner
            res["idle_pass"]["daemon_mem_after"] = {d.name: tree_memory(d.proc.pid) for d in daemons}
            print(f"  CPU {res['idle_pass']['cpu_s_max']:.2f} s (max of 3 daemons), wall "
                  f"{res['idle_pass']['seconds']:.1f} s")
        except (RuntimeError, TimeoutError) as e:  # a daemon requiring a credential, or a hung pass
            res["idle_pass"] = {"error": str(e)}
            print(f"  not measured: {e}")

        print(f"[{n:,}] plan")
        t = time.perf_counter()
        p = plan(root, nodes=3, memory_per_node=64 << 30, short_side=SHORT)
        raw = next(lay for lay in p["layouts"] if lay["name"] == "raw")
        res["plan"] = {"seconds": time.perf_counter() - t, "predicted_bytes": raw["total"],
                       "per_key": raw["per_sample"], "measured_bytes": used,
                       "error": abs(raw["total"] - used) / used if used else None}
        print(f"  predicted {raw['total'] / 1e6:.1f} MB vs measured {used / 1e6:.1f} MB "
              f"(error {res['plan']['error']:.3f})")

        print(f"[{n:,}] epochs (2 ranks x 2 workers)")
        # one pair of rank processes runs epochs 1 and 2 and, with ``kill``, a third epoch during which one
        # master is SIGKILLed when rank 0 is 30 % through it (one interpreter start-up per size, not two)
        killed = 2
        victim = cluster.masters[killed]
        before_keys = dbsize(victim.port)
        when: dict[str, float] = {}

        def on_progress(epoch: int, frac: float) -> None:
            if kill and epoch == 2 and frac >= 0.3 and "t" not in when:
                when["t"] = time.perf_counter()
                victim.kill()  # SIGKILL: the node dies with its memory

        if kill:
            print(f"  (epoch 3: master {victim.addr} killed at 30 %)")
        epochs = run_ranks(root, cluster.url, 3 if kill else 2, batch=batch, on_progress=on_progress,
                           timeout=timeout)
        for i, e in enumerate(epochs[:2]):
            res[f"epoch{i + 1}"] = e
            print(f"  epoch {i + 1}: {e['seconds']:.1f} s ({e['samples'] / e['seconds']:.0f} samples/s), "
                  f"worker RSS max {e['worker_rss_max'] / 1e6:.0f} MB")
        if kill:
            ke = epochs[2]
            ke["master_killed"] = "t" in when
            ke["master"] = victim.addr
            res["kill_epoch"] = ke
            print(f"  epoch 3 completed: {ke['samples']} samples in {ke['seconds']:.1f} s, master killed: "
                  f"{ke['master_killed']}, decoded {sum(r['decoded'] for r in ke['ranks'])}")
            print(f"[{n:,}] restart the master empty and refill it")
            cluster.restart_empty(killed)
            d = daemons[killed]
            passes0 = (d.dataset() or {}).get("passes", 0)
            t = time.perf_counter()
            woke = d.wake()
            if not woke:  # cannot wake it: restart it (its first pass refills), start-up included
                print("  POST /datasets refused: restarting the daemon instead")
                d.stop()
                d.start()
                passes0 = 0

            def refilled() -> bool:
                st = d.dataset()
                return bool(st and st["passes"] > passes0 and st["status"] == "full")

            try:
                wait_for(refilled, timeout, "refill", poll=0.5)
                res["refill"] = {"seconds": time.perf_counter() - t, "keys_before_kill": before_keys,
                                 "keys_after": dbsize(victim.port), "owned": (d.dataset() or {}).get("owned"),
                                 "woken": woke}
            except TimeoutError as e:  # recorded, not fatal: the other phases' numbers still count
                res["refill"] = {"error": f"{e}: master {victim.addr} holds {dbsize(victim.port)} of "
                                          f"{before_keys} keys; {stuck_detail(d)}"}
                print(f"  {res['refill']['error']}")
            if "seconds" in res["refill"]:
                print(f"  {res['refill']['keys_after']} of {before_keys} keys back in "
                      f"{res['refill']['seconds']:.1f} s")
        with contextlib.suppress(Exception):
            c = redis.Redis(port=cluster.masters[0].port)
            res["redis"]["maxmemory_policy"] = c.config_get("maxmemory-policy")
    finally:
        for d in daemons:
            d.stop()
        cluster.stop()
    return res


# ------------------------------------------------------------------ FFCV side by side (first epoch)
def ffcv_first_epoch(root: str, workdir: str, latency_ms: float, mbps: float) -> dict[str, Any]:
    """From ``slowfile://`` to the end of the first epoch: FFCV (``DatasetWriter`` + JIT-compiling first
    epoch) vs ours (cold ``CachedImageNet`` epoch, no conversion). Skipped with the reason when FFCV is
    not installed (``python -m bench.loader --install-peers`` installs it)."""
    from bench.loader import ffcv_available, ffcv_first_epoch_from_slowfile, ours_first_epoch_from_slowfile

    why = ffcv_available()
    if why is not None:
        return {"available": False, "reason": why}
    src = f"slowfile://{root}?latency_ms={latency_ms:g}&mbps={mbps:g}"
    ours = ours_first_epoch_from_slowfile(src, os.path.join(workdir, "ffcv-ours-lmdb"), CROP, BATCH)
    theirs = ffcv_first_epoch_from_slowfile(src, os.path.join(workdir, "ffcv.beton"), CROP, BATCH)
    return {"available": True, "source": src, "ours": ours, "ffcv": theirs,
            "first_epoch_vs_ffcv_convert": theirs["seconds"] / ours["seconds"]}


# ------------------------------------------------------------------ ratios, plot, main
def per_sample(res: dict[str, Any], phase: str) -> float | None:
    v = res.get(phase)
    key = "cpu_s_max" if phase == "idle_pass" else "seconds"  # the idle pass: its CPU, not its wall time
    if not v or key not in v:
        return None
    return v[key] / res["files"]


def compute_ratios(sizes: list[dict[str, Any]]) -> tuple[dict[str, float | None], list[str]]:
    small, big = sizes[0], sizes[-1]
    ratios: dict[str, float | None] = {}
    notes: list[str] = []
    for ph in PER_SAMPLE_PHASES:
        a, b = per_sample(small, ph), per_sample(big, ph)
        ratios[f"scale_cost_ratio_{ph}"] = b / a if a and b is not None else None
    mem = {"listing": ("listing", "peak_rss"), "fill": ("fill", "daemon_rss_max"),
           "epoch1": ("epoch1", "worker_rss_max"), "epoch2": ("epoch2", "worker_rss_max")}
    for ph, (k, f) in mem.items():
        a, b = small.get(k, {}).get(f), big.get(k, {}).get(f)
        ratios[f"scale_cost_ratio_{ph}_rss"] = (b / big["files"]) / (a / small["files"]) if a and b else None
    for ep in ("status", "metrics"):
        ratios[f"{ep}_bytes_growth"] = big[ep]["bytes"] / small[ep]["bytes"]
        ratios[f"{ep}_time_growth"] = big[ep]["seconds"] / small[ep]["seconds"]
    # "bounded by the manifest plus a constant": RSS growth from the smallest to the largest size, in units of
    # the largest manifest's bytes (<= 1: a process grows by at most one manifest)
    mbytes = big["listing"]["manifest_bytes"]
    grow = {"worker_rss": ("epoch2", "worker_rss_max"), "daemon_rss": ("fill", "daemon_rss_full"),
            "daemon_peak": ("fill", "daemon_rss_max"),
            "worker_private": ("epoch2", "worker_uss_max"), "shared_per_rank": ("epoch2", "worker_shmem_max")}
    for who, (k, f) in grow.items():
        a, b = small.get(k, {}).get(f), big.get(k, {}).get(f)
        ratios[f"{who}_growth_vs_manifest"] = (b - a) / mbytes if a is not None and b is not None else None
    if len(sizes) >= 3:
        # A worker's private memory also holds per-process caches that fill with the number of batches it
        # has served, up to a fixed cap (the Redis reply arena: <= 64 MB, datacache/stores/resp.py) -- an
        # epoch at the smallest size is too short to fill them. Growth with the *samples* is measured
        # between the two largest sizes (10x the samples, both past that warm-up); the growth from the
        # smallest size is kept beside it.
        mid = sizes[-2]
        key = "worker_private_growth_vs_manifest"
        ratios[key + "_from_smallest"] = ratios[key]
        a, b = mid.get("epoch2", {}).get("worker_uss_max"), big.get("epoch2", {}).get("worker_uss_max")
        grown = mbytes - mid["listing"]["manifest_bytes"]
        ratios[key] = (b - a) / grown if a is not None and b is not None else None
    ratios["idle_pass_cpu_s"] = big["idle_pass"].get("cpu_s_max")
    ratios["plan_memory_error"] = big["plan"]["error"]
    targets = {**{k: TARGET_RATIO for k in ratios if k.startswith("scale_cost_ratio_")},
               "status_bytes_growth": TARGET_RATIO, "metrics_bytes_growth": TARGET_RATIO,
               "worker_private_growth_vs_manifest": 0.1, "shared_per_rank_growth_vs_manifest": 1.1,
               "daemon_rss_growth_vs_manifest": 1.0,
               "idle_pass_cpu_s": 1.0, "plan_memory_error": 0.1}
    for k, target in targets.items():
        v = ratios.get(k)
        if v is not None and v > target:
            notes.append(f"target missed: {k} = {v:.3g} > {target}")
    return ratios, notes


def plot(path: str, sizes: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ns = [s["files"] for s in sizes]
    for ph in PER_SAMPLE_PHASES:
        ys = [per_sample(s, ph) for s in sizes]
        if all(y is not None for y in ys):
            axes[0].plot(ns, [y * 1e6 for y in ys], marker="o", label=ph)  # type: ignore[operator]
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("files in the dataset")
    axes[0].set_ylabel("µs per sample")
    axes[0].set_title("cost per sample vs dataset size (flat = scales)")
    axes[0].legend(fontsize=7, ncol=2)
    mems = {"listing peak": ("listing", "peak_rss"), "daemon peak": ("fill", "daemon_rss_max"),
            "daemon (full)": ("fill", "daemon_rss_full"),
            "loader worker": ("epoch2", "worker_rss_max"), "manifest": ("listing", "manifest_bytes")}
    for label, (k, f) in mems.items():
        ys = [s.get(k, {}).get(f) for s in sizes]
        if all(ys):
            axes[1].plot(ns, [y / 1e6 for y in ys], marker="o", label=label)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("files in the dataset")
    axes[1].set_ylabel("resident MB")
    axes[1].set_title("resident memory per process")
    axes[1].legend(fontsize=8)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"smoke run: sizes {QUICK_SIZES}, 20 classes")
    ap.add_argument("--sizes", default=None, help="comma-separated file counts (default: 1 %%, 10 %%, 100 %% "
                                                  "of ImageNet's 1,281,167)")
    ap.add_argument("--classes", type=int, default=None, help="class folders (default 1000; quick 20)")
    ap.add_argument("--data-dir", default=None, help="where generated datasets live (default: user cache)")
    ap.add_argument("--out-dir", default=None, help=f"where the JSON/PNG go (default {RESULTS_DIR})")
    ap.add_argument("--batch-size", type=int, default=None, help=f"per rank (default {BATCH}; quick 32)")
    ap.add_argument("--no-kill", action="store_true", help="skip the master-kill epoch and the refill")
    ap.add_argument("--ffcv-size", type=int, default=None,
                    help="size of the FFCV first-epoch comparison (default 128,117; quick: the largest; "
                         "0 = off)")
    ap.add_argument("--name", default=None, help="result file name (default scale, quick: scale_quick)")
    ap.add_argument("--install-peers", action="store_true", help="install FFCV when missing (else skipped)")
    ap.add_argument("--timeout", type=float, default=3600, help="per-phase limit in seconds")
    args = ap.parse_args(argv)
    if args.sizes:
        try:
            sizes = sorted(int(x.replace("_", "")) for x in args.sizes.split(","))
        except ValueError:
            ap.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
        if len(sizes) < 2 or sizes[0] < 1:
            ap.error(f"--sizes needs at least two positive sizes to compare, got {args.sizes!r}")
    else:
        sizes = list(QUICK_SIZES if args.quick else FULL_SIZES)
    name = args.name or ("scale_quick" if args.quick else "scale")
    if not name.replace("_", "").replace("-", "").isalnum():
        ap.error(f"--name must be letters, digits, '_' or '-', got {name!r}")
    classes = args.classes or (20 if args.quick else 1000)
    batch = args.batch_size or (32 if args.quick else BATCH)
    ffcv_size = args.ffcv_size if args.ffcv_size is not None else (sizes[-1] if args.quick else FULL_SIZES[1])
    machine = print_machine(machine_info())
    if args.install_peers and ffcv_size:
        from bench.loader import install_peers

        why = install_peers()
        if why:
            print(f"FFCV not installed: {why}")
    workdir = tempfile.mkdtemp(prefix="datacache-bench-scale-")
    results: dict[str, Any] = {"sizes": []}
    notes = [f"{os.cpu_count()} cores shared by 3 redis-servers, 3 daemons, 2 ranks x 2 loader workers and "
             "other "
             "jobs: absolute numbers are noisy; every size ran in this one process, one after the other",
             "1 % of the files are corrupt (quarantined by the daemons, substituted by the loader)",
             "daemons: poll_interval 3600 s, woken by POST /datasets for the idle pass and the refill"]
    t_all = time.perf_counter()
    try:
        for n in sizes:
            t = time.perf_counter()
            root = ensure_scale_dataset(n, args.data_dir, classes=classes)
            gen_s = time.perf_counter() - t
            sub = os.path.join(workdir, f"n{n}")
            os.makedirs(sub)
            res = run_size(n, root, sub, kill=not args.no_kill, timeout=args.timeout, batch=batch)
            res["generate_s_if_not_reused"] = gen_s
            if n == ffcv_size:
                print(f"[{n:,}] FFCV vs ours, first epoch from slowfile://")
                res["ffcv_first_epoch"] = ffcv_first_epoch(root, sub, latency_ms=2, mbps=200)
                shown = {k: v for k, v in res["ffcv_first_epoch"].items() if k != "source"}
                print(f"  {json.dumps(shown)[:400]}")
            results["sizes"].append(res)
            shutil.rmtree(sub, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["total_seconds"] = time.perf_counter() - t_all
    ratios, missed = compute_ratios(results["sizes"])
    ff = [s["ffcv_first_epoch"] for s in results["sizes"] if "ffcv_first_epoch" in s]
    if ff and ff[0].get("available"):
        ratios["first_epoch_vs_ffcv_convert"] = ff[0]["first_epoch_vs_ffcv_convert"]
        if ratios["first_epoch_vs_ffcv_convert"] < 1.5:
            missed.append(f"target missed: first_epoch_vs_ffcv_convert = "
                          f"{ratios['first_epoch_vs_ffcv_convert']:.2f} < 1.5")
    elif ff:
        ratios["first_epoch_vs_ffcv_convert"] = None
        notes.append(f"FFCV not measured: {ff[0]['reason']}")
    config = {"sizes": sizes, "classes": classes, "source_jpeg": "64x48 q85, 1 % corrupt",
              "short_side": SHORT,
              "crop": CROP, "batch_size": batch, "ranks": 2, "workers_per_rank": 2, "masters": 3,
              "daemon_workers": 1, "quick": args.quick, "kill_epoch": not args.no_kill,
              "ffcv_size": ffcv_size}

    out_dir = args.out_dir or str(RESULTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # written, then moved: never half-written
        write_results(name, machine=machine, config=config, results=results, ratios=ratios,
                      notes=notes + missed, out_dir=tmp)
        plot(os.path.join(tmp, name + ".png"), results["sizes"])
        for ext in (".json", ".png"):
            os.replace(os.path.join(tmp, name + ext), os.path.join(out_dir, name + ext))
    print(f"done in {results['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
