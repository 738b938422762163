"""Measurements of the cluster benchmark (:mod:`bench.cluster` runs them side by side and writes the JSON).

Each function measures one thing on real components: a 3-master Redis Cluster of ``redis-server``
processes on loopback, LMDB, the slowfile:// NFS stand-in, ``redis-benchmark``, DALI when installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.loader import CopyCollate, NaivePILDataset, make_loader, time_epoch
from client.augment import AugmentCollate
from client.dataset import CachedImageNet
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant
from datacache.decode import decode_image
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough
from datacache.record import encode_record
from datacache.stores import open_store
from datacache.warm import fill_missing

SIZE = 128
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flush_cluster(cluster: Any) -> None:
    for m in cluster.masters:
        subprocess.run(["redis-cli", "-p", str(m.port), "flushall"], capture_output=True, check=True)


def rate(runs: list[tuple[float, int, float]]) -> float:
    return sum(c for _, c, _ in runs) / sum(dt for dt, _, _ in runs)


# ------------------------------------------------------------------ epochs through DataLoaders
def cold_epoch(root: str, cache: str, batch: int, workers: int) -> dict[str, Any]:
    """One epoch on an empty cache with a fresh (non-persistent) loader: read + decode + write-back,
    worker start-up included (as for :func:`naive_fresh_epoch`)."""
    ds = CachedImageNet(root, cache=cache, short_side=160, t1_dir=None)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                         collate_fn=AugmentCollate(SIZE),
                                         generator=torch.Generator().manual_seed(1))
    t = time.perf_counter()
    n = sum(int(labels.numel()) for _, labels in loader)
    dt = time.perf_counter() - t
    ds.flush(30)
    st = ds.stats()
    return {"samples_per_s": n / dt, "seconds": dt, "decoded": st["decoded"], "hits": st["hits"]}


def naive_fresh_epoch(root: str, batch: int, workers: int) -> dict[str, Any]:
    ds = NaivePILDataset(root)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
    t = time.perf_counter()
    n = sum(int(labels.numel()) for _, labels in loader)
    dt = time.perf_counter() - t
    return {"samples_per_s": n / dt, "seconds": dt}


def warm_rounds(root: str, caches: dict[str, str], batch: int, workers: int, rounds: int, fast: int
                ) -> dict[str, Any]:
    """Interleaved epochs (persistent workers, started before timing): naive, then ``fast`` warm epochs
    per cache, per round. Returns samples/s per pipeline."""
    naive = NaivePILDataset(root)
    n = len(naive)
    loaders = {"naive": make_loader(naive, batch, workers)}
    datasets = {}
    for name, url in caches.items():
        datasets[name] = CachedImageNet(root, cache=url, short_side=160, t1_dir=None)
        loaders[name] = make_loader(datasets[name], batch, workers, AugmentCollate(SIZE))
    loaders["copy_ceiling"] = make_loader(datasets["lmdb"], batch, workers, CopyCollate())
    for ld in loaders.values():
        next(iter(ld))  # start persistent workers outside the timed epochs
    timed: dict[str, list] = {k: [] for k in loaders}
    for r in range(rounds):
        timed["naive"].append(time_epoch(loaders["naive"], n, f"naive {r}"))
        for _ in range(fast):
            for name in [*caches, "copy_ceiling"]:
                timed[name].append(time_epoch(loaders[name], n, f"{name} {r}"))
    out = {k: {"samples_per_s": rate(v), "epochs": len(v), "per_epoch": [c / dt for dt, c, _ in v]}
           for k, v in timed.items()}
    for name, ds in datasets.items():
        out[name]["stats"] = {k: ds.stats()[k] for k in ("hits", "misses", "decoded", "hit_ratio")}
    del loaders
    return out


# ------------------------------------------------------------------ batched reads vs redis-benchmark
def timed_reads(store: Any, keys: list[bytes], batch: int, repeats: int) -> tuple[int, float]:
    """(bytes, seconds) of ``repeats`` passes of ``store.get_many`` over ``keys`` in batches of ``batch``,
    after one untimed batch that connects."""
    store.get_many(keys[:batch])  # connect
    nbytes, t = 0, time.perf_counter()
    for _ in range(repeats):
        for s in range(0, len(keys), batch):
            nbytes += sum(len(v) for v in store.get_many(keys[s:s + batch]) if v is not None)
    return nbytes, time.perf_counter() - t


def benchmark_rps(out: str) -> float:
    """GET requests per second reported by ``redis-benchmark -q`` (its last figure: progress lines are
    separated by carriage returns)."""
    return float(re.findall(r"([\d.]+) requests per second", out.replace("\r", "\n"))[-1])


def batched_read(url: str, root: str, batch: int, repeats: int = 3) -> dict[str, Any]:
    """MB/s of ``RedisClusterStore.get_many`` over every key, in batches of ``batch`` keys, one process."""
    ds = CachedImageNet(root, cache=url, short_side=160, t1_dir=None)
    store = ds.store.tiers[0]
    keys = [ds.key(i) for i in range(len(ds))]
    nbytes, dt = timed_reads(store, keys, batch, repeats)
    return {"MB_per_s": nbytes / dt / 1e6, "bytes": nbytes, "seconds": dt,
            "mean_value": nbytes / (repeats * len(keys)), "fetch_bytes": store.fetch_bytes}


def redis_benchmark(cluster: Any, value_bytes: int, requests: int = 20000) -> dict[str, Any]:
    """``redis-benchmark -P 16 -c 1 GET <key>`` against every master at once (one process each, like the
    store's one connection per master), on a key of ``value_bytes`` that master serves; MB/s summed.
    Hits are checked with the masters' ``keyspace_hits`` (a GET of a missing key would be a tiny reply)."""
    import redis

    from datacache.stores import open_store

    store = open_store(cluster.url)
    procs, clients = [], []
    value = os.urandom(value_bytes)
    for m in cluster.masters:
        key = next(f"bench:{i}" for i in range(100000)
                   if store.master_of([f"bench:{i}".encode()])[0] == m.addr)
        c = redis.Redis(port=m.port)
        c.set(key, value)
        clients.append((c, int(c.info("stats")["keyspace_hits"])))
        cmd = ["redis-benchmark", "-p", str(m.port), "-P", "16", "-c", "1", "-n", str(requests), "-q", "GET",
               key]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rps = []
    for p in procs:
        rps.append(benchmark_rps(p.communicate(timeout=300)[0]))
    hits = sum(int(c.info("stats")["keyspace_hits"]) - before for c, before in clients)
    return {"command": f"redis-benchmark -p PORT -P 16 -c 1 -n {requests} -q GET KEY (x3, concurrently)",
            "get_requests_per_s": rps, "hits": hits, "requests": requests * len(procs),
            "MB_per_s": sum(rps) * value_bytes / 1e6}


def connection_read(url: str, root: str, batch: int, workdir: str, repeats: int = 3,
                    requests: int = 20000) -> dict[str, Any]:
    """One connection, the dataset's own records on one ``redis-server``: MB/s of ``RedisStore.get_many``
    (batches of ``batch`` keys) vs ``redis-benchmark -P 16 -c 1 -r N GET`` over the same N values
    (random keys of the working set, hits checked) -- the client's cost per byte against Redis's
    own C client, on equal terms (one client process, one server, data that does not sit in a
    CPU cache)."""
    import redis

    from datacache.devtools.redis_local import start_server
    from datacache.stores import open_store

    ds = CachedImageNet(root, cache=url, short_side=160, t1_dir=None)
    got = ds.store.tiers[0].get_many([ds.key(i) for i in range(len(ds))])
    values = [bytes(v) for v in got if v is not None]
    srv = start_server(os.path.join(workdir, "standalone"))
    try:
        store = open_store(f"redis://{srv.addr}/0")
        keys = [b"bench:%012d" % i for i in range(len(values))]  # redis-benchmark's __rand_int__ names
        for s in range(0, len(keys), 64):
            store.put_many(list(zip(keys[s:s + 64], values[s:s + 64])), overwrite=True)
        nbytes, dt = timed_reads(store, keys, batch, repeats)
        ours = nbytes / dt / 1e6
        client = redis.Redis(port=srv.port)
        hits0 = int(client.info("stats")["keyspace_hits"])
        cmd = ["redis-benchmark", "-p", str(srv.port), "-P", "16", "-c", "1", "-n", str(requests), "-r",
               str(len(keys)), "-q", "GET", "bench:__rand_int__"]
        rps = benchmark_rps(subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout)
        hits = int(client.info("stats")["keyspace_hits"]) - hits0
        mean = sum(len(v) for v in values) / len(values)
        return {"get_many_MB_per_s": ours, "redis_benchmark_MB_per_s": rps * mean / 1e6,
                "redis_benchmark_hits": hits, "requests": requests, "keys": len(keys), "mean_value": mean,
                "command": " ".join([*cmd[:1], "-p", "PORT", *cmd[3:]])}
    finally:
        srv.stop()


# ------------------------------------------------------------------ daemon fill from the NFS stand-in
def decode_bound(root: str, decoder: Any, n: int = 200) -> float:
    """Single-process decode + encode rate (samples/s) of a backend, bytes already in memory."""
    man = Manifest.build(root)
    base = man.root[len("file://"):]
    datas = []
    for i in np.linspace(0, len(man) - 1, n).astype(int):
        with open(os.path.join(base, man.paths[int(i)]), "rb") as f:
            datas.append(f.read())
    v = Variant(short_side=160)
    if decoder is not None and hasattr(decoder, "prepare"):
        decoder.prepare(datas[:16], v)  # build the pipeline outside the timing
    t = time.perf_counter()
    for s in range(0, len(datas), 16):
        chunk = datas[s:s + 16]
        if decoder is not None and hasattr(decoder, "prepare"):
            decoder.prepare(chunk, v)
        for d in chunk:
            px = (decoder or decode_image)(d, v, name="x")
            encode_record(px, 0, v, key=b"dc:k")
    return len(datas) / (time.perf_counter() - t)


def daemon_fill(root: str, url: str, decoder: Any, workers: int, latency_ms: float, mbps: float
                ) -> dict[str, Any]:
    """The daemon's ingest (``fill_missing`` into the Redis Cluster tier) from ``slowfile://``."""
    src = f"slowfile://{root}?latency_ms={latency_ms:g}&mbps={mbps:g}"
    man = Manifest.build(src)
    spec = parse_cache_url(url)
    reader = ReadThrough(man, Variant(short_side=160), spec, t1_dir=None, writer=True)
    store = open_store(spec.tiers[0])
    rep = fill_missing(reader, range(len(man)), workers=workers, decoder=decoder, progress=False, store=store,
                       store_spec=spec.tiers[0])  # the pool workers write to Redis themselves
    return {"samples": rep.decoded, "seconds": rep.seconds, "samples_per_s": rep.decoded / rep.seconds,
            "mean_file_bytes": float(np.mean(man.sizes)), "bytes_read": rep.bytes_read}


# ------------------------------------------------------------------ sweep runs in new processes
def sweep_run(root: str, url: str, batch: int, workers: int, epochs: int) -> dict[str, Any]:
    """A new interpreter: CachedImageNet over ``url``, ``epochs`` epochs; per-epoch samples/s and stats."""
    code = f"""
import json, time, torch
from bench.loader import make_loader, time_epoch
from client.augment import AugmentCollate
from client.dataset import CachedImageNet
torch.set_num_threads(1)
t = time.perf_counter()
ds = CachedImageNet({root!r}, cache={url!r}, short_side=160, t1_dir=None)
setup = time.perf_counter() - t
loader = make_loader(ds, {batch}, {workers}, AugmentCollate({SIZE}))
out = []
for e in range({epochs}):
    ds.reset_stats()
    dt, n, _ = time_epoch(loader, len(ds), f"epoch {{e}}")
    st = ds.stats()
    out.append({{"samples_per_s": n / dt, "seconds": dt, "decoded": st["decoded"], "hits": st["hits"]}})
ds.flush(60)
print(json.dumps({{"setup_s": setup, "epochs": out}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": REPO})
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def client_url(cluster: Any) -> str:
    """The cluster's URL for this bench's clients: a private cluster, so they write back
    (``?write_back=1``); on a shared one the daemons fill and trainers only read."""
    return cluster.url + ("&" if "?" in cluster.url else "?") + "write_back=1"


# ------------------------------------------------------------------ MinIO vs LRU at 50 % capacity
def policy_hit_ratio(cluster: Any, root: str, policy: str, fraction: float, epochs: int = 3
                     ) -> dict[str, Any]:
    """Random epochs through CachedImageNet on a cluster whose memory holds ``fraction`` of the dataset."""
    import redis

    flush_cluster(cluster)
    short = 64  # small records: the policy, not the bandwidth, is measured here
    ds = CachedImageNet(root, cache=client_url(cluster), short_side=short, t1_dir=None)
    n = len(ds)
    # record size of this variant, measured on a real sample, then Redis's per-key cost (datacache.plan)
    from datacache.plan import redis_bytes_per_key

    sample = ds[0]
    per_key = redis_bytes_per_key(len(encode_record(sample[0].permute(1, 2, 0).numpy(), 0, ds.variant,
                                                    key=ds.key(0))))
    flush_cluster(cluster)
    clients = [redis.Redis(port=m.port) for m in cluster.masters]
    for c in clients:
        base = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory", int(base + fraction * n * per_key / len(clients)))
        c.config_set("maxmemory-policy", policy)
    ds = CachedImageNet(root, cache=client_url(cluster), short_side=short, t1_dir=None)
    ratios = []
    for e in range(epochs):
        ds.reset_stats()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(e)).tolist()
        for s in range(0, n, 128):
            ds.__getitems__(order[s:s + 128])
        ds.flush(30)
        ratios.append(ds.stats()["hit_ratio"])
    cached = sum(int(c.dbsize()) for c in clients)
    for c in clients:
        c.config_set("maxmemory", 0)
        c.config_set("maxmemory-policy", "noeviction")
    later = float(np.mean(ratios[1:]))
    return {"policy": policy, "hit_ratio_per_epoch": ratios, "hit_ratio_epochs_2_3": later,
            "cached_fraction": cached / n, "hit_vs_fraction": later / (cached / n) if cached else 0.0}
