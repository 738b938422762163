"""A dataset bigger than the cluster's memory: MinIO vs the rolling fill, side by side on one machine.

Real components: a 3-master Redis Cluster on loopback with the ACL roles of :mod:`datacache.redis_roles`
(the daemons log in as ``datacache-daemon``, the trainer as ``datacache``, the bench itself as ``admin``
to flush and read ``INFO``), three ``python -m cache_daemon`` processes (one per master, ``ownership =
"cluster"``, ``redis_node`` = its master, one decode process each) and the NFS stand-in ``slowfile://``
(:mod:`datacache.devtools.slowfs`) holding a few thousand small generated JPEGs (decoding is a minor CPU
share; the source's throttle is what limits the fill).

The trainer is one process (``--trainer``, started by the bench with ``sys.executable``) emulating three
ranks on ``node_of_rank = [0, 1, 2]`` in lockstep: a ``CachedImageNet`` over the trainer role's cluster URL
(misses are decoded locally from the same slow source: the three ranks' links, so ``mbps`` x 3 in one
process; no T1 disk cache, no write-back), three :class:`~client.locality_sampler.LocalitySampler` with
the owners of :func:`~client.locality_sampler.owners_from_store`, rank 0's with a
:class:`~client.run_publisher.PlanPublisher`. Each step fetches one batch per rank (``__getitems__``),
sleeps a fixed simulated compute time, and marks the batches trained.

Phases:

1. **all-cached**: daemons without a budget fill everything (unthrottled); the masters' ``used_memory``
   growth per master is the dataset's size there; the trainer's epoch time (epochs 2..) sets the
   all-cached training rate ``R`` (samples/s over the three ranks).
2. **fill rate**: the source throttle (``latency_ms`` + ``mbps`` per process) is set so the three
   daemons' aggregate fill rate ``B`` is 0.6 R and 0.25 R; measured with one daemon filling alone
   (its decoded count over a window, x 3: each daemon has its own link), re-scaled once when off.
3. **f = 0.5, B/R = 0.6 and 0.25**: per setting, MinIO (``rolling_fill = false``) and rolling side by
   side, each from a fresh state (masters flushed, daemons restarted, the MinIO fill run to the memory
   budget = the master's baseline ``used_memory`` + f x its share of the dataset), 4 epochs: per-epoch
   hit ratio (the dataset's counters), epoch time, decodes (daemons' ``decoded`` from ``GET /status`` +
   the trainer's misses), the daemons' CPU seconds / wall, and their ``rolling`` status over time
   (window, lead, hits, misses, evicted, fill_rate).
4. **sweep**: two concurrent trainers (seeds 0 and 1) on the dataset, rolling, f = 0.5, B/R = 0.6.

Expected steady-state hit ratio of the rolling fill: min(1, f + B/R); MinIO's: f.

``python -m bench.bigger`` writes ``bench/results/bigger.json`` + ``bigger.png`` (``--quick``: a smoke
run of 720 images, 2 epochs, ``bigger_quick.*``; tests/test_bench_bigger.py runs it). Every
target is printed with the measured value; a missed one is written to the notes with the reason.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (direction, target); ">=" means higher is better
TARGETS: dict[str, tuple[str, float]] = {
    "rolling_hit_f50_b60": (">=", 0.97),
    "rolling_epoch_vs_allcached_f50_b60": ("<=", 1.05),
    "rolling_vs_minio_speedup_f50_b60": (">=", 1.6),
    "rolling_decodes_vs_minio_f50_b60": ("<=", 1.1),
    "rolling_hit_f50_b25": (">=", 0.72),
    "rolling_first_epoch_hit_f50_b60": (">=", 0.45),
}
FRACTION = 0.5
B_OVER_R = {"b60": 0.6, "b25": 0.25}
LATENCY_MS = 5.0  # per request of the slow source (reads of a chunk overlap; mbps is what limits)
NODES = 3


@dataclass(frozen=True)
class Sizes:
    images: int
    classes: int
    batch: int  # per rank
    compute_s: float  # simulated compute per step
    epochs: int
    allcached_epochs: int
    sweep_epochs: int
    rate_window_s: float
    recalibrate: bool
    short_side: int = 64
    image_size: tuple[int, int] = (96, 72)


# ~12 s all-cached epochs: long against the daemons' step (~2 s), plan check (2 s) and slack (1.5 s)
FULL = Sizes(images=2400, classes=10, batch=32, compute_s=0.45, epochs=4, allcached_epochs=2, sweep_epochs=2,
             rate_window_s=6.0, recalibrate=True)
QUICK = Sizes(images=720, classes=6, batch=24, compute_s=0.03, epochs=2, allcached_epochs=2, sweep_epochs=1,
              rate_window_s=1.0, recalibrate=False)


# ------------------------------------------------------------------ the dataset
def ensure_images(s: Sizes) -> str:
    """Generated small JPEGs (``classes`` folders), made once and published atomically."""
    from datacache.config import user_cache_dir
    from datacache.devtools import synth

    per = s.images // s.classes
    w, h = s.image_size
    root = os.path.join(user_cache_dir(), "datacache", "bench", "published",
                        f"bigger-{s.classes}x{per}-{w}x{h}")
    if not os.path.isdir(root):
        print(f"generating {s.classes * per} JPEGs ({w}x{h} q85) in {root}")
        synth.ensure_imagefolder(root, classes=s.classes, per_class=per, size=(w, h), quality=85)
    return root


def slow_url(root: str, mbps: float, latency_ms: float = LATENCY_MS) -> str:
    """The slow source's URL (``mbps`` 0 = no bandwidth cap)."""
    return f"slowfile://{root}?latency_ms={latency_ms:g}&mbps={mbps:.6g}"


def mean_file_bytes(root: str) -> float:
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]
    return sum(sizes) / len(sizes)


# ------------------------------------------------------------------ which code ran
CODE_FILES = ("cache_daemon/rolling.py", "cache_daemon/ingest.py", "cache_daemon/service.py",
              "datacache/run_plan.py", "client/run_publisher.py", "client/locality_sampler.py",
              "datacache/epoch_plan.py")


def code_state() -> dict[str, Any]:
    """The commit, and the SHA-256 (first 12 hex) of the files the rolling fill runs, with whether each
    differs from the commit: what this run measured (they may be edited between two runs)."""
    import hashlib

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    files = {}
    dirty = set(git("status", "--porcelain", "--", *CODE_FILES).split("\n"))
    for f in CODE_FILES:
        try:
            with open(os.path.join(REPO, f), "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()[:12]
        except OSError:
            digest = None
        files[f] = {"sha256": digest, "modified": any(ln.endswith(" " + f) for ln in dirty)}
    return {"commit": git("rev-parse", "HEAD"), "files": files}


# ------------------------------------------------------------------ HTTP and /proc helpers
def http_json(url: str, timeout: float = 10.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


def dataset_status(port: int) -> dict[str, Any] | None:
    st = http_json(f"http://127.0.0.1:{port}/status")
    return st["datasets"][0] if st and st.get("datasets") else None


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` (its reaped children included) and of its live children (the decode pool)."""
    from bench.common import child_pids, proc_cpu_seconds

    return proc_cpu_seconds(pid) + sum(proc_cpu_seconds(k) for k in child_pids(pid))


# ------------------------------------------------------------------ the cluster and its daemons
class Daemon:
    """One ``sys.executable -m cache_daemon`` with a TOML config written here, in its own process group."""

    def __init__(self, workdir: str, i: int, cache: str, redis_node: str, source: str, *, short_side: int,
                 budget: int, rolling: bool) -> None:
        from datacache.devtools.redis_local import free_port

        self.name, self.port = f"d{i}", free_port()
        self.log = os.path.join(workdir, f"{self.name}.log")
        cfg = os.path.join(workdir, f"{self.name}.toml")
        with open(cfg, "w") as f:
            f.write(f'node = "{self.name}"\ncache = "{cache}"\nredis_node = "{redis_node}"\n'
                    f'ownership = "cluster"\nworkers = 1\nmemory_budget = {int(budget)}\n'
                    f'http_port = {self.port}\npoll_interval = 30.0\nt1_dir = "none"\n'
                    f'rolling_fill = {"true" if rolling else "false"}\n\n'
                    f'[[datasets]]\nsource = "{source}"\nshort_side = {short_side}\n')
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--config", cfg,
                                          "--no-progress"], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, "PYTHONPATH": REPO})

    def dataset(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon {self.name} exited ({self.proc.returncode}); log tail:\n"
                               + log_tail(self.log))
        return dataset_status(self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the daemon and its decode pool
                self.proc.wait(30)


def log_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class Bench:
    """The cluster (with roles), its admin connections and the daemons of the current phase."""

    def __init__(self, workdir: str, s: Sizes, root: str) -> None:
        from datacache.devtools.redis_local import role_url, start_cluster
        from datacache.make_secrets import ensure_passwords
        from datacache.redis_roles import DAEMON, TRAINER

        self.workdir, self.s, self.root = workdir, s, root
        self.secrets_dir = os.path.join(workdir, "secrets")
        self.sec = ensure_passwords(self.secrets_dir)
        self.cluster = start_cluster(os.path.join(workdir, "cluster"), NODES, roles=self.sec.passwords)
        ports = [m.port for m in self.cluster.masters]
        self.masters = [m.addr for m in self.cluster.masters]
        self.daemon_url = role_url(DAEMON, ports, self.secrets_dir)
        self.trainer_url = role_url(TRAINER, ports, self.secrets_dir)
        self.daemons: list[Daemon] = []
        self.phase = 0

    def admin(self, i: int) -> Any:
        import redis

        from datacache.redis_roles import ADMIN

        m = self.cluster.masters[i]
        return redis.Redis(host="127.0.0.1", port=m.port, username=ADMIN, password=self.sec.passwords[ADMIN])

    def flush(self) -> None:
        for i in range(NODES):
            c = self.admin(i)
            c.flushall()
            c.close()

    def used_memory(self) -> list[int]:
        out = []
        for i in range(NODES):
            c = self.admin(i)
            out.append(int(c.info("memory")["used_memory"]))
            c.close()
        return out

    def dbsize(self) -> list[int]:
        out = []
        for i in range(NODES):
            c = self.admin(i)
            out.append(int(c.dbsize()))
            c.close()
        return out

    def start_daemons(self, source: str, budgets: list[int], rolling: bool, nodes: list[int] | None = None
                      ) -> None:
        self.stop_daemons()
        self.phase += 1
        d = os.path.join(self.workdir, f"phase{self.phase}")
        os.makedirs(d, exist_ok=True)
        self.daemons = [Daemon(d, i, self.daemon_url, self.masters[i], source, short_side=self.s.short_side,
                               budget=budgets[i], rolling=rolling)
                        for i in (nodes if nodes is not None else range(NODES))]

    def stop_daemons(self) -> None:
        for d in self.daemons:  # SIGTERM to all first: they drain at the same time
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            d.stop()
        self.daemons = []

    def wait_status(self, ok: tuple[str, ...], timeout: float) -> list[dict[str, Any]]:
        """Until every daemon's dataset status is one of ``ok``; their statuses."""
        deadline = time.monotonic() + timeout
        while True:
            sts = [d.dataset() for d in self.daemons]
            if all(st is not None and st["status"] in ok for st in sts):
                return sts  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemons not {ok} after {timeout:.0f} s: "
                                   f"{[st and (st['status'], st['done'], st['owned']) for st in sts]}")
            time.sleep(0.3)

    def stop(self) -> None:
        self.stop_daemons()
        self.cluster.stop()


class Poller(threading.Thread):
    """``GET /status`` of every daemon about once a second: the time series of the PNG."""

    def __init__(self, daemons: list[Daemon], period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.daemons, self.period = daemons, period
        self.rows: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.time()
            per = []
            for d in self.daemons:
                st = dataset_status(d.port) or {}
                roll = st.get("rolling") or {}
                per.append({"status": st.get("status"), "decoded": st.get("decoded"),
                            **{k: roll.get(k) for k in ("active", "window", "lead", "hits", "misses",
                                                        "evicted", "filled", "fill_rate")}})
            self.rows.append({"t": t, "daemons": per})
            self.halt.wait(self.period)

    def stop(self) -> list[dict[str, Any]]:
        self.halt.set()
        self.join(10)
        return self.rows


# ------------------------------------------------------------------ the trainer (its own process)
TRAINER_CODE = "import sys; from bench.bigger import trainer_main; trainer_main(sys.argv[1])"


def trainer_main(cfg_json: str) -> None:
    """Three ranks in lockstep (module docstring); one JSON line per epoch on stdout."""
    import torch

    from client.dataset import CachedImageNet
    from client.locality_sampler import LocalitySampler, owners_from_store
    from client.run_publisher import PlanPublisher

    cfg = json.loads(cfg_json)
    torch.set_num_threads(1)
    layout = list(range(NODES))
    ds = CachedImageNet(cfg["source"], cache=cfg["cache"], short_side=cfg["short_side"], t1_dir=None)
    n = len(ds)
    # the Redis Cluster tier itself: ds.store is a TieredStore (not ``sharded``) even with one tier, and
    # owners_from_store answers all -1 for a store without shards
    store = ds.store
    store = (getattr(store, "tiers", None) or [store])[-1]
    owners = owners_from_store(store, ds.reader.keys(range(n)), cfg["masters"])
    if (owners < 0).any():
        raise RuntimeError(f"{int((owners < 0).sum())} samples have no owner among {cfg['masters']}")
    pub = PlanPublisher.for_dataset(ds, seed=cfg["seed"], exchange=0.0, drop_last=False, node_of_rank=layout,
                                    masters=cfg["masters"]) if cfg["publish"] else None
    samplers = [LocalitySampler(owners, layout, r, seed=cfg["seed"], exchange=0.0, drop_last=False,
                                publisher=pub if r == 0 else None) for r in range(NODES)]
    ports = cfg["daemon_ports"]

    def daemons_decoded() -> int:
        return sum(int((dataset_status(p) or {}).get("decoded") or 0) for p in ports)

    # set up (imports, listing, owners) while the daemons' MinIO fill runs; start on "go" from the bench
    counts = [int((owners == k).sum()) for k in range(NODES)]
    print(json.dumps({"event": "ready", "samples": n, "owners": counts, "t": time.time()}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    batch = cfg["batch"]
    for epoch in range(cfg["epochs"]):
        for s in samplers:
            s.set_epoch(epoch)
        ds.reset_stats()
        d0 = daemons_decoded()
        its = [iter(s) for s in samplers]
        steps: list[list[float]] = []
        fetch_s = 0.0
        t0 = time.time()
        while True:
            batches = [list(itertools.islice(it, batch)) for it in its]
            if not any(batches):
                break
            tf = time.perf_counter()
            for b in batches:
                if b:
                    ds.__getitems__(b)
            fetch_s += time.perf_counter() - tf
            time.sleep(cfg["compute_s"])
            for s, b in zip(samplers, batches):
                s.mark_trained(len(b))
            st = ds.stats()
            steps.append([round(time.time() - t0, 3), st["hits"], st["misses"]])
        dt = time.time() - t0
        st = ds.stats()
        seen = st["hits"] + st["misses"]
        print(json.dumps({"event": "epoch", "epoch": epoch, "t0": t0, "seconds": dt, "fetch_s": fetch_s,
                          "samples": st["samples"], "hits": st["hits"], "misses": st["misses"],
                          "hit_ratio": st["hits"] / seen if seen else 0.0, "decoded": st["decoded"],
                          "errors": st["errors"], "substituted": st["substituted"],
                          "daemon_decoded": daemons_decoded() - d0, "steps": steps}), flush=True)
    if pub is not None:
        print(json.dumps({"event": "publisher", "published": pub.published, "errors": pub.errors}),
              flush=True)
        pub.close()


def start_trainer(b: Bench, source: str, *, seed: int, epochs: int, log: str) -> subprocess.Popen:
    cfg = {"source": source, "cache": b.trainer_url, "short_side": b.s.short_side, "masters": b.masters,
           "seed": seed, "epochs": epochs, "batch": b.s.batch, "compute_s": b.s.compute_s, "publish": True,
           "daemon_ports": [d.port for d in b.daemons]}
    with open(log, "ab") as err:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-c", TRAINER_CODE, json.dumps(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)


def wait_ready(p: subprocess.Popen, log: str) -> dict[str, Any]:
    """The trainer's ``ready`` line (it has listed the dataset and computed the owners)."""
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith("{"):
        p.wait(30)
        raise RuntimeError(f"trainer did not start (exit {p.returncode}); stderr tail:\n{log_tail(log)}")
    return json.loads(line)


def finish_trainer(p: subprocess.Popen, log: str, timeout: float) -> list[dict[str, Any]]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise RuntimeError(f"trainer timed out after {timeout:.0f} s; stderr tail:\n{log_tail(log)}"
                           ) from None
    if p.returncode != 0:
        raise RuntimeError(f"trainer exited {p.returncode}; stderr tail:\n{log_tail(log)}")
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def start_trainers(b: Bench, source: str, *, seeds: list[int], epochs: int, tag: str
                   ) -> list[tuple[subprocess.Popen, str]]:
    logs = [os.path.join(b.workdir, f"trainer-{tag}-{s}.log") for s in seeds]
    return [(start_trainer(b, source, seed=s, epochs=epochs, log=lg), lg) for s, lg in zip(seeds, logs)]


def kill_trainers(trainers: list[tuple[subprocess.Popen, str]]) -> None:
    for p, _ in trainers:
        if p.poll() is None:
            p.kill()
            p.wait()


def run_training(b: Bench, trainers: list[tuple[subprocess.Popen, str]], seeds: list[int], epochs: int
                 ) -> dict[str, Any]:
    """Trainers (started by :func:`start_trainers`, one per seed, run concurrently) against the running
    daemons; the daemons' CPU and status series over the same wall time."""
    try:
        ready = [wait_ready(p, lg) for p, lg in trainers]
        poller = Poller(b.daemons)
        cpu0 = [tree_cpu(d.proc.pid) for d in b.daemons]
        t0 = time.time()
        poller.start()
        for p, _ in trainers:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        try:
            outs = [finish_trainer(p, lg, timeout=120 + epochs * 200) for p, lg in trainers]
        finally:
            series = poller.stop()
    finally:
        kill_trainers(trainers)
    wall = time.time() - t0
    cpu = [tree_cpu(d.proc.pid) - c for d, c in zip(b.daemons, cpu0)]
    runs = []
    for seed, lines, start in zip(seeds, outs, ready):
        epochs_ = [ln for ln in lines if ln["event"] == "epoch"]
        pub = next((ln for ln in lines if ln["event"] == "publisher"), {})
        runs.append({"seed": seed, "epochs": epochs_, "owners_per_node": start.get("owners"),
                     "publisher": pub})
    for row in series:
        row["t"] = round(row["t"] - t0, 2)
    for r in runs:
        for e in r["epochs"]:
            e["t0"] = round(e["t0"] - t0, 2)
    return {"runs": runs, "wall_s": wall, "daemon_cpu_s": cpu, "daemon_cpu_s_total": sum(cpu),
            "fill_cpu_share_cores": sum(cpu) / wall if wall > 0 else 0.0, "status_series": series}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per-epoch series of one trainer and its averages over epochs 2.. (all epochs when only one); where
    each epoch's misses fell (its first 4 steps, its last 3 steps, the rest)."""
    eps = run["epochs"]
    later = eps[1:] or eps

    def mean(k: str) -> float:
        return sum(e[k] for e in later) / len(later)

    where = []
    for e in eps:
        per_step = [m1 - m0 for (_, _, m0), (_, _, m1) in zip([[0, 0, 0], *e["steps"][:-1]], e["steps"])]
        where.append({"first_4_steps": sum(per_step[:4]), "last_3_steps": sum(per_step[-3:]),
                      "middle": sum(per_step[4:-3]), "steps": len(per_step)})
    return {"hit_ratio": [e["hit_ratio"] for e in eps], "seconds": [e["seconds"] for e in eps],
            "trainer_decoded": [e["decoded"] for e in eps],
            "daemon_decoded": [e["daemon_decoded"] for e in eps],
            "decodes": [e["decoded"] + e["daemon_decoded"] for e in eps], "misses_where": where,
            "hit_ratio_later": mean("hit_ratio"), "seconds_later": mean("seconds"),
            "decodes_later": sum(e["decoded"] + e["daemon_decoded"] for e in later) / len(later),
            "daemon_decodes_later": mean("daemon_decoded"), "misses_later": mean("misses"),
            "first_epoch_hit": eps[0]["hit_ratio"]}


def listing_samples(series: list[dict[str, Any]]) -> list[int]:
    """Per daemon: status samples (about 1 s apart) that said ``listing`` (a pass re-listing the source:
    no fill meanwhile)."""
    return [sum(1 for r in series if (r["daemons"][k].get("status") or "") == "listing")
            for k in range(len(series[0]["daemons"]))] if series else []


# ------------------------------------------------------------------ phases
def phase_allcached(b: Bench) -> dict[str, Any]:
    """Everything cached (no budget, unthrottled fill): per-master dataset bytes and the training rate R."""
    b.stop_daemons()
    b.flush()
    time.sleep(0.5)
    base = b.used_memory()
    b.start_daemons(slow_url(b.root, 0.0, 0.0), [0] * NODES, rolling=False)
    trainers = start_trainers(b, slow_url(b.root, 0.0, 0.0), seeds=[0], epochs=b.s.allcached_epochs,
                              tag="allcached")
    t = time.monotonic()
    try:
        sts = b.wait_status(("full",), timeout=300)
    except BaseException:
        kill_trainers(trainers)
        raise
    fill_s = time.monotonic() - t
    time.sleep(0.5)
    used = b.used_memory()
    keys = b.dbsize()
    delta = [u - a for u, a in zip(used, base)]
    print(f"  all cached: {sum(s['owned'] for s in sts)} samples in {fill_s:.1f} s (daemon start included); "
          f"{sum(delta) / 1e6:.1f} MB on the masters ({[round(d / 1e6, 2) for d in delta]})")
    res = run_training(b, trainers, [0], b.s.allcached_epochs)
    sm = summarize(res["runs"][0])
    n = res["runs"][0]["epochs"][0]["samples"]
    r = n / sm["seconds_later"]
    print(f"  all-cached epochs {[round(x, 2) for x in sm['seconds']]} s, hit "
          f"{[round(x, 3) for x in sm['hit_ratio']]} -> R = {r:.0f} samples/s")
    return {"baseline_used_memory": base, "full_used_memory": used, "dataset_bytes_per_master": delta,
            "keys_per_master": keys, "owned": [s["owned"] for s in sts], "fill_s": fill_s,
            "training": res, "summary": sm, "R": r, "samples_per_epoch": n}


def measure_fill_rate(b: Bench, mbps: float, window: float) -> dict[str, Any]:
    """One daemon (node 0) filling alone from an empty cluster through the throttled source; B = 3 x its
    rate (one link per daemon). The decoded count moves a chunk at a time, so the rate is taken between
    two moves of it: the first one seen and the last one at least ``window`` seconds (and 6 moves) later."""
    b.stop_daemons()
    b.flush()
    b.start_daemons(slow_url(b.root, mbps), [0] * NODES, rolling=False, nodes=[0])
    d = b.daemons[0]
    deadline = time.monotonic() + 180
    moves: list[tuple[float, int]] = []
    st: dict[str, Any] = {}
    while True:
        st = d.dataset() or {}
        dec = int(st.get("decoded") or 0)
        now = time.monotonic()
        if dec > (moves[-1][1] if moves else 0):
            moves.append((now, dec))
        if (len(moves) > 6 and moves[-1][0] - moves[0][0] >= window) or st.get("status") == "full":
            break
        if now > deadline:
            raise TimeoutError(f"daemon d0 did not fill (status {st.get('status')!r}): {log_tail(d.log)}")
        time.sleep(0.1)
    cpu = tree_cpu(d.proc.pid)
    b.stop_daemons()
    if len(moves) < 2:
        raise RuntimeError(f"daemon d0 decoded too little to measure its rate: {moves}")
    (t0, n0), (t1, n1) = moves[0], moves[-1]
    rate = (n1 - n0) / max(1e-6, t1 - t0)
    return {"mbps": mbps, "per_daemon_rate": rate, "B": NODES * rate, "window_s": t1 - t0,
            "decoded_in_window": n1 - n0, "status": st.get("status"), "daemon_cpu_s": cpu}


def calibrate(b: Bench, ratio: float, R: float, file_bytes: float) -> dict[str, Any]:
    """The ``mbps`` per process that gives B = ``ratio`` x R: from the mean file size, measured, re-scaled
    while more than 10 % off (3 tries at most; the closest is kept)."""
    target = ratio * R / NODES  # samples/s per daemon
    mbps = target * file_bytes / 1e6
    tries = []
    for _ in range(3 if b.s.recalibrate else 1):
        m = measure_fill_rate(b, mbps, b.s.rate_window_s)
        m["b_over_r"] = m["B"] / R
        tries.append(m)
        print(f"  mbps {mbps:.4g}: B = {m['B']:.0f} samples/s over {m['window_s']:.1f} s, "
              f"B/R = {m['b_over_r']:.3f} (target {ratio})")
        if abs(m["b_over_r"] - ratio) <= 0.1 * ratio or m["per_daemon_rate"] <= 0:
            break
        mbps *= ratio / m["b_over_r"]
    best = min(tries, key=lambda m: abs(m["b_over_r"] - ratio))
    return {"target_b_over_r": ratio, "mbps": best["mbps"], "B": best["B"], "b_over_r": best["b_over_r"],
            "tries": tries}


def phase_run(b: Bench, budgets: list[int], mbps: float, rolling: bool, tag: str, seeds: list[int],
              epochs: int, prefill_mbps: float) -> dict[str, Any]:
    """Fresh state: masters flushed, the MinIO fill to the budget (the source throttled to
    ``prefill_mbps`` in every scenario: the fill overshoots the budget by its chunks in flight, more so
    the faster it fills, so every scenario starts from the same cached fraction), the daemons restarted
    with the policy and the scenario's throttle (their first pass finds the budget reached), then the
    trainer(s)."""
    b.stop_daemons()
    b.flush()
    t = time.monotonic()
    b.start_daemons(slow_url(b.root, prefill_mbps), budgets, rolling=False)
    b.wait_status(("budget", "full"), timeout=600)
    b.start_daemons(slow_url(b.root, mbps), budgets, rolling=rolling)
    # the trainer's misses: the three ranks' links to the same source (one process here)
    trainers = start_trainers(b, slow_url(b.root, NODES * mbps), seeds=seeds, epochs=epochs, tag=tag)
    try:
        sts = b.wait_status(("budget", "full"), timeout=600)
    except BaseException:
        kill_trainers(trainers)
        raise
    prefill_s = time.monotonic() - t
    keys = b.dbsize()
    owned = sum(s["owned"] for s in sts)
    cached = sum(s["done"] for s in sts)
    print(f"  [{tag}] prefilled {cached}/{owned} samples ({cached / max(1, owned):.3f}) in {prefill_s:.1f} s "
          "(daemons restarted with the policy included)")
    res = run_training(b, trainers, seeds, epochs)
    res.update(prefill_s=prefill_s, prefilled_fraction=cached / max(1, owned), prefill_keys=keys,
               policy="rolling" if rolling else "minio", mbps=mbps, budgets=budgets)
    res["summaries"] = [summarize(r) for r in res["runs"]]
    dec = sum(sum(x["daemon_decoded"]) for x in res["summaries"]) / max(1, len(res["summaries"]))
    res["daemon_decodes"] = dec
    res["cpu_ms_per_daemon_decode"] = 1000 * res["daemon_cpu_s_total"] / dec if dec else None
    res["listing_status_samples"] = listing_samples(res["status_series"])
    last = [d.dataset() or {} for d in b.daemons]
    keep = ("status", "owned", "done", "decoded", "rolling", "write_errors")
    res["daemon_final"] = [{k: st.get(k) for k in keep} for st in last]
    for r, sm in zip(res["runs"], res["summaries"]):
        print(f"  [{tag}] seed {r['seed']}: hit {[round(x, 3) for x in sm['hit_ratio']]}, epoch s "
              f"{[round(x, 2) for x in sm['seconds']]}, decodes {sm['decodes']}")
    print(f"  [{tag}] daemons' CPU {res['daemon_cpu_s_total']:.1f} s over {res['wall_s']:.1f} s "
          f"({res['fill_cpu_share_cores']:.3f} cores)")
    return res


# ------------------------------------------------------------------ ratios, notes, plot
def compute_ratios(res: dict[str, Any]) -> dict[str, float | None]:
    ac = res["allcached"]["summary"]["seconds_later"]
    sc = res["scenarios"]
    out: dict[str, float | None] = {}
    for key in B_OVER_R:
        roll, minio = sc[f"rolling_f50_{key}"]["summaries"][0], sc[f"minio_f50_{key}"]["summaries"][0]
        bor = res["calibration"][key]["b_over_r"]
        out[f"rolling_hit_f50_{key}"] = roll["hit_ratio_later"]
        out[f"minio_hit_f50_{key}"] = minio["hit_ratio_later"]
        out[f"rolling_epoch_vs_allcached_f50_{key}"] = roll["seconds_later"] / ac
        out[f"minio_epoch_vs_allcached_f50_{key}"] = minio["seconds_later"] / ac
        out[f"rolling_vs_minio_speedup_f50_{key}"] = minio["seconds_later"] / roll["seconds_later"]
        out[f"rolling_decodes_vs_minio_f50_{key}"] = (roll["decodes_later"] / minio["decodes_later"]
                                                     if minio["decodes_later"] else None)
        out[f"rolling_first_epoch_hit_f50_{key}"] = roll["first_epoch_hit"]
        out[f"b_over_r_{key}"] = bor
        out[f"cached_fraction_f50_{key}"] = sc[f"rolling_f50_{key}"]["prefilled_fraction"]
        out[f"expected_rolling_hit_f50_{key}"] = min(1.0, FRACTION + bor)
        out[f"expected_rolling_hit_measured_f_f50_{key}"] = min(
            1.0, sc[f"rolling_f50_{key}"]["prefilled_fraction"] + bor)
        for pol in ("rolling", "minio"):
            out[f"fill_cpu_share_{pol}_f50_{key}"] = sc[f"{pol}_f50_{key}"]["fill_cpu_share_cores"]
        out[f"daemon_cpu_ms_per_decode_rolling_f50_{key}"] = \
            sc[f"rolling_f50_{key}"]["cpu_ms_per_daemon_decode"]
    sw = res["sweep"]["summaries"]
    out["sweep_rolling_hit_f50_b60"] = sum(x["hit_ratio_later"] for x in sw) / len(sw)
    out["sweep_epoch_vs_allcached_f50_b60"] = sum(x["seconds_later"] for x in sw) / len(sw) / ac
    return {k: (None if v is None else float(v)) for k, v in out.items()}


def check_targets(ratios: dict[str, float | None], res: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    notes, table = [], {}
    for name, (op, target) in TARGETS.items():
        v = ratios.get(name)
        ok = v is not None and (v >= target if op == ">=" else v <= target)
        table[name] = {"value": v, "target": f"{op} {target}", "met": ok}
        shown = "n/a" if v is None else f"{v:.3f}"
        print(f"  {name:40s} {shown:>8s}  target {op} {target}  {'ok' if ok else 'MISSED'}")
        if not ok:
            notes.append(f"target missed: {name} = {shown} (target {op} {target}); "
                         + why_missed(name, ratios, res))
    return notes, table


def why_missed(name: str, ratios: dict[str, float | None], res: dict[str, Any]) -> str:
    """What was measured around a missed target (figures, not guesses)."""
    key = name.rsplit("_", 1)[-1]
    run = res["scenarios"][f"rolling_f50_{key}"]
    minio = res["scenarios"][f"minio_f50_{key}"]
    sm, mm = run["summaries"][0], minio["summaries"][0]
    bor, f = ratios.get(f"b_over_r_{key}") or 0.0, run["prefilled_fraction"]
    n = res["allcached"]["samples_per_epoch"]
    bits = [f"measured B/R = {bor:.3f}, cached fraction f = {f:.3f} (MinIO fill to the budget overshoots by "
            f"its chunks in flight), min(1, f + B/R) = {min(1.0, f + bor):.3f}",
            f"rolling per-epoch hit {[round(x, 3) for x in sm['hit_ratio']]}, misses per epoch in (first 4 "
            f"steps, middle, last 3 steps): "
            f"{[(w['first_4_steps'], w['middle'], w['last_3_steps']) for w in sm['misses_where']]}"]
    if "epoch" in name or "speedup" in name:
        bits.append(f"epoch seconds rolling {[round(x, 2) for x in sm['seconds']]}, MinIO "
                    f"{[round(x, 2) for x in mm['seconds']]}, all cached "
                    f"{res['allcached']['summary']['seconds_later']:.2f}; a miss is read and decoded in the "
                    f"trainer from the slow source ({sm['misses_later']:.0f} misses per epoch in epochs 2..)")
    if "decodes" in name:
        per_s = sm["daemon_decodes_later"] / sm["seconds_later"]
        rows = run["status_series"]
        evicted = (sum(d.get("evicted") or 0 for d in rows[-1]["daemons"])
                   - sum(d.get("evicted") or 0 for d in rows[0]["daemons"])) if rows else 0
        b_rate = bor * n / res["allcached"]["summary"]["seconds_later"]
        bits.append(f"the daemons decoded {sm['daemon_decodes_later']:.0f} per epoch in epochs 2.. "
                    f"({per_s:.0f}/s, i.e. {per_s / b_rate:.2f} x B) and the trainer "
                    f"{sm['misses_later']:.0f} (its misses), against (1 - f) N = "
                    f"{(1 - f) * n:.0f} uncached samples per epoch; the daemons deleted {evicted} samples "
                    f"over the {len(sm['hit_ratio'])} epochs (each one deleted is decoded again before its "
                    "next use)")
    if "hit" in name:
        bits.append("status samples (about 1 s apart) per daemon that said 'listing' (a pass re-listing the "
                    f"source fills nothing meanwhile): {listing_samples(run['status_series'])}")
    return "; ".join(bits)


def plot(path: str, res: dict[str, Any], ratios: dict[str, float | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common import save_figure

    sc = res["scenarios"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    colors = {"minio_f50_b60": "tab:gray", "rolling_f50_b60": "tab:blue", "minio_f50_b25": "silver",
              "rolling_f50_b25": "tab:cyan"}
    ax = axes[0][0]
    for name, run in sc.items():
        steps_t, steps_h = [], []
        for e in run["runs"][0]["epochs"]:
            prev = (0, 0)
            for t, h, m in e["steps"]:
                dh, dm = h - prev[0], m - prev[1]
                prev = (h, m)
                if dh + dm:
                    steps_t.append(e["t0"] + t)
                    steps_h.append(dh / (dh + dm))
        ax.plot(steps_t, steps_h, ".-", ms=2, lw=0.8, color=colors.get(name), label=name)
    for key in B_OVER_R:
        ax.axhline(ratios.get(f"expected_rolling_hit_f50_{key}") or 0, ls=":", lw=0.8, color="k")
    ax.axhline(FRACTION, ls="--", lw=0.8, color="k")
    ax.set_xlabel("seconds since the trainer started")
    ax.set_ylabel("hit ratio per step (3 ranks)")
    ax.set_title("trainer hit ratio over time (dashed: f; dotted: min(1, f + B/R))", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for name in ("rolling_f50_b60", "rolling_f50_b25"):
        rows = sc[name]["status_series"]
        ax.plot([r["t"] for r in rows], [sum(d.get("lead") or 0 for d in r["daemons"]) for r in rows],
                color=colors[name], label=f"{name} lead")
        ax.plot([r["t"] for r in rows], [sum(d.get("window") or 0 for d in r["daemons"]) for r in rows],
                color=colors[name], ls="--", lw=0.8, label=f"{name} window")
    rows = res["sweep"]["status_series"]
    ax.plot([r["t"] for r in rows], [sum(d.get("lead") or 0 for d in r["daemons"]) for r in rows],
            color="tab:purple", label="sweep (2 runs) lead")
    ax.set_xlabel("seconds since the trainer started")
    ax.set_ylabel("samples (sum over the 3 daemons)")
    ax.set_title("rolling fill: lead (cached in a row ahead of the loaders) and window (cached)", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1][0]
    for name, run in sc.items():
        sm = run["summaries"][0]
        ax.plot(range(1, len(sm["hit_ratio"]) + 1), sm["hit_ratio"], "o-", color=colors.get(name), label=name)
    for k, sm in enumerate(res["sweep"]["summaries"]):
        ax.plot(range(1, len(sm["hit_ratio"]) + 1), sm["hit_ratio"], "s--", color="tab:purple",
                label=f"sweep run {k + 1} (rolling, b60)")
    ax.set_xticks(range(1, max(len(r["summaries"][0]["hit_ratio"]) for r in sc.values()) + 1))
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"per-epoch hit ratio, f = {FRACTION}", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1][1]
    labels = ["all cached", *sc]
    vals = [res["allcached"]["summary"]["seconds_later"],
            *(sc[n]["summaries"][0]["seconds_later"] for n in sc)]
    bars = ax.bar(range(len(vals)), vals, color=["tab:green"] + [colors.get(n, "k") for n in sc])
    for bar, v in zip(bars, vals):
        ax.annotate(f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.set_xticks(range(len(vals)), labels, rotation=15, fontsize=8)
    ax.set_ylabel("epoch seconds (epochs 2..)")
    ax.set_title(f"epoch time; B/R measured: b60 {ratios.get('b_over_r_b60') or 0:.2f}, "
                 f"b25 {ratios.get('b_over_r_b25') or 0:.2f}", fontsize=9)
    save_figure(fig, path)


# ------------------------------------------------------------------ main
def run(s: Sizes, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    from datacache.devtools.redis_local import redis_available

    why = redis_available()
    if why:
        raise SystemExit(f"bench.bigger needs a local Redis: {why}")
    root = ensure_images(s)
    n_files = sum(len(fs) for _, _, fs in os.walk(root))
    file_bytes = mean_file_bytes(root)
    res: dict[str, Any] = {}
    workdir = tempfile.mkdtemp(prefix="datacache-bench-bigger-")
    res["code_at_start"] = code_state()
    t_start = time.monotonic()

    def at() -> str:
        return f"[{time.monotonic() - t_start:5.0f} s]"

    b = Bench(workdir, s, root)
    try:
        print(f"{at()} phase 1: all cached (no budget)")
        ac = res["allcached"] = phase_allcached(b)
        R = ac["R"]
        budgets = [int(base + FRACTION * d) for base, d in zip(ac["baseline_used_memory"],
                                                               ac["dataset_bytes_per_master"])]
        res["budgets"] = budgets
        print(f"{at()} phase 2: source throttle for B/R = {list(B_OVER_R.values())} (one daemon filling "
              f"alone, x {NODES})")
        res["calibration"] = {k: calibrate(b, ratio, R, file_bytes) for k, ratio in B_OVER_R.items()}
        res["scenarios"] = {}
        prefill = res["calibration"]["b60"]["mbps"]
        for key in B_OVER_R:
            mbps = res["calibration"][key]["mbps"]
            for rolling in (False, True):
                tag = f"{'rolling' if rolling else 'minio'}_f50_{key}"
                print(f"{at()} phase 3: {tag} (budget = baseline + {FRACTION} x the master's share, "
                      f"{s.epochs} epochs)")
                res["scenarios"][tag] = phase_run(b, budgets, mbps, rolling, tag, seeds=[0], epochs=s.epochs,
                                                  prefill_mbps=prefill)
        print(f"{at()} phase 4: sweep: two concurrent runs (seeds 0 and 1), rolling, f = 0.5, B/R = 0.6")
        res["sweep"] = phase_run(b, budgets, res["calibration"]["b60"]["mbps"], True, "sweep_f50_b60",
                                 seeds=[0, 1], epochs=s.sweep_epochs, prefill_mbps=prefill)
    except BaseException:
        for d in b.daemons:
            print(f"--- {d.name} log tail ---\n{log_tail(d.log)}", file=sys.stderr)
        raise
    finally:
        b.stop()
        keep = os.environ.get("DATACACHE_BENCH_KEEP")
        if keep:
            print(f"kept {workdir} (DATACACHE_BENCH_KEEP)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    res["bench_seconds"] = time.monotonic() - t_start
    res["code_at_end"] = code_state()
    config = {"images": n_files, "image_size": list(s.image_size), "mean_file_bytes": file_bytes,
              "classes": s.classes, "short_side": s.short_side, "ranks": NODES,
              "node_of_rank": list(range(NODES)),
              "batch_per_rank": s.batch, "compute_s_per_step": s.compute_s, "epochs": s.epochs,
              "allcached_epochs": s.allcached_epochs, "sweep_epochs": s.sweep_epochs, "fraction": FRACTION,
              "b_over_r_targets": B_OVER_R, "latency_ms": LATENCY_MS, "masters": NODES,
              "daemon_workers": 1, "exchange": 0.0, "drop_last": False, "quick": quick,
              "source": "slowfile:// latency_ms per request + mbps per process (each daemon one link; the "
                        "trainer process = 3 ranks' links: mbps x 3)",
              "roles": "daemons: datacache-daemon, trainer: datacache, bench: admin (flush, INFO)"}
    return config, res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Writes bench/results/bigger.json and bigger.png (quick: "
                                        "bigger_quick.*).")
    ap.add_argument("--quick", action="store_true", help="smoke run: 720 images, batch 24, 2 epochs")
    ap.add_argument("--out-dir", default=None, help="where the JSON/PNG go (default bench/results)")
    ap.add_argument("--name", default=None, help="results name (default bigger, quick bigger_quick)")
    args = ap.parse_args(argv)
    from bench.common import RESULTS_DIR, machine_info, print_machine, write_results

    s = QUICK if args.quick else FULL
    machine = print_machine(machine_info())
    config, res = run(s, args.quick)
    ratios = compute_ratios(res)
    print("targets:")
    notes, table = check_targets(ratios, res)
    res["targets"] = table
    changed = [f for f, v in res["code_at_start"]["files"].items() if v != res["code_at_end"]["files"][f]]
    if changed or res["code_at_start"]["commit"] != res["code_at_end"]["commit"]:
        notes.append(f"the code changed during the run ({', '.join(changed) or 'the commit'}): daemons "
                     "started after the change ran the new code; results.code_at_start / code_at_end")
    notes = [f"{os.cpu_count()} cores shared by 3 redis-servers, 3 daemons (1 decode process each), the "
             "trainer process and the bench: absolute times are noisy, the policies are measured side by "
             "side from the same fresh state",
             "hit ratio = the dataset's counters (hits / lookups) per epoch; decodes = the daemons' decoded "
             "(GET /status) + the trainer's local decodes of misses, per epoch",
             "B measured with one daemon filling alone (a MinIO pass), x 3; the rolling fill's own rate is "
             "in each scenario's daemon_final[].rolling.fill_rate",
             *notes]
    name = args.name or ("bigger_quick" if args.quick else "bigger")
    out = args.out_dir or str(RESULTS_DIR)
    write_results(name, machine=machine, config=config, results=res, ratios=ratios, notes=notes, out_dir=out)
    plot(os.path.join(out, name + ".png"), res, ratios)


if __name__ == "__main__":
    main()
