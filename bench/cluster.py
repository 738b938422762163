"""Cluster benchmark: a 3-master Redis Cluster on loopback, measured side by side in one run.

* **warm epochs** through ``CachedImageNet`` (128-px random-resized-crop + flip uint8 batches of 256,
  2 workers) from the Redis Cluster and from LMDB, the naive PIL loader, the copy-only ceiling, and
  the DALI CPU pipeline (``bench.loader.run_dali``) -- interleaved rounds, persistent workers;
  ``cluster_warm_vs_naive`` (target >= 5);
* **cold epochs** (empty cache: read + decode + write-back) on LMDB and on the cluster vs a naive
  epoch, each with a fresh loader (worker start-up in all three): ``cold_vs_naive`` (>= 1.0) is the
  smaller of the two, ``cold_vs_naive_lmdb`` / ``cold_vs_naive_cluster`` both;
* **batched reads**, on equal terms: one connection to one ``redis-server`` holding the dataset's
  records, ``RedisStore.get_many`` (batches of 256) vs ``redis-benchmark -P 16 -c 1 -r N GET`` over
  the same N values (random keys, hits checked): ``read_vs_redis_benchmark`` (>= 0.7). Also, for
  context, the cluster: one process reading all masters in parallel vs three ``redis-benchmark``
  processes, one per master, each repeating one hot key (its value stays in a CPU cache):
  ``cluster_read_vs_redis_benchmark_x3_hot_key``;
* **daemon fill** from the NFS stand-in (``slowfile://``, 5 ms per request, 50 MB/s per process) with
  Pillow and with DALI, vs min(bandwidth bound, decode bound): ``fill_vs_bound`` (>= 0.9; Pillow's,
  ``fill_vs_bound_dali`` for DALI). Bandwidth bound = 50 MB/s / mean file size (the daemon reads in
  one process, so through one stand-in link); decode bound = pool processes x one process's decode +
  encode rate of that backend on bytes in memory, measured in the same run;
* **sweep**: run 1 (a new process, empty cluster: its first epoch is cold) and run 2 (another new
  process): ``run2_vs_warm`` = run 2's first epoch / run 1's warm epochs (>= 0.9), ``run2_vs_run1`` =
  run 2's first epoch / run 1's first epoch (>= 10); ``run2_vs_run1_tiered``: the same sweep with a
  node-local LMDB tier chained in front of the cluster (``lmdb:///...::redis+cluster://...``);
* **memory below the dataset**: 3 random epochs with the cluster's memory holding ~50 % of the
  samples, MinIO (``noeviction``) vs ``allkeys-lru``: ``minio_hit_vs_fraction`` = hit ratio of epochs
  2-3 / cached fraction (>= 0.95), ``lru_hit_vs_fraction`` for comparison.

The dataset is ``bench.loader``'s generator (500x375 q90 JPEGs + shipped photos), 6,000 images by
default. ``python -m bench.cluster`` (``--quick``: 300 images, batch 64) writes ``bench/results/cluster.json``
and ``cluster.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import torch

from bench import cluster_parts as P
from bench.common import RESULTS_DIR, machine_info, print_machine, write_results
from bench.loader import ensure_dataset, run_dali
from datacache.config import user_cache_dir
from datacache.devtools.redis_local import start_cluster

TARGETS = {"cluster_warm_vs_naive": 5.0, "read_vs_redis_benchmark": 0.7, "fill_vs_bound": 0.9,
           "run2_vs_warm": 0.9, "run2_vs_run1": 10.0, "cold_vs_naive": 1.0, "minio_hit_vs_fraction": 0.95}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (300 images, batch 64)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--images", type=int, default=6000, help="generated JPEGs (default 6000; quick 300)")
    args = ap.parse_args(argv)
    # 6,000 images: an epoch long enough (~1 s warm) that worker start-up does not dominate run 2's epoch 1
    n_images, batch = (300, 64) if args.quick else (args.images, 256)
    machine = print_machine(machine_info())
    root = ensure_dataset(n_images)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="datacache-bench-cluster-")
    lmdb_dir = os.path.join(user_cache_dir(), "datacache", "bench", "cluster-lmdb")
    shutil.rmtree(lmdb_dir, ignore_errors=True)
    cluster = start_cluster(os.path.join(tmp, "cluster"), 3)
    # the bench's own cluster, private to it: its clients write back (?write_back=1), so a cold epoch
    # fills it as the sweep's run 1; on a shared cluster the daemons fill (trainers read, daemons write)
    url, lmdb = P.client_url(cluster), "lmdb://" + lmdb_dir
    res: dict[str, Any] = {"cluster": url}
    notes = [f"{os.cpu_count()} cores shared by the 3 redis-servers, the loader workers and other jobs on "
             "this machine: absolute numbers are noisy, ratios are measured side by side"]
    try:
        print("cold epochs (fresh loaders, worker start-up included in all three)")
        res["naive_fresh"] = P.naive_fresh_epoch(root, batch, args.workers)
        res["cold_lmdb"] = P.cold_epoch(root, lmdb, batch, args.workers)
        res["sweep_run1"] = P.sweep_run(root, url, batch, args.workers, epochs=4)  # cold cluster epoch first
        res["sweep_run2"] = P.sweep_run(root, url, batch, args.workers, epochs=1)
        res["cold_cluster"] = res["sweep_run1"]["epochs"][0]
        # the same sweep with a node-local LMDB tier in front of the cluster (lmdb:///...::redis+cluster://)
        P.flush_cluster(cluster)
        tiered = f"lmdb://{lmdb_dir}-tier::{url}"
        shutil.rmtree(lmdb_dir + "-tier", ignore_errors=True)
        res["tiered_run1"] = P.sweep_run(root, tiered, batch, args.workers, epochs=2)
        res["tiered_run2"] = P.sweep_run(root, tiered, batch, args.workers, epochs=1)
        shutil.rmtree(lmdb_dir + "-tier", ignore_errors=True)
        for k in ("naive_fresh", "cold_lmdb", "cold_cluster"):
            print(f"  {k:14s} {res[k]['samples_per_s']:8.0f} samples/s")
        print("warm epochs, interleaved")
        res["warm"] = P.warm_rounds(root, {"cluster": url, "lmdb": lmdb}, batch, args.workers, rounds=3,
                                    fast=2)
        for k, v in res["warm"].items():
            print(f"  {k:14s} {v['samples_per_s']:8.0f} samples/s")
        res["dali_cpu"] = run_dali(root, batch, epochs=2)
        print(f"  dali_cpu       {res['dali_cpu'].get('samples_per_s', float('nan')):8.0f} samples/s")
        print("batched reads vs redis-benchmark")
        res["batched_read"] = P.batched_read(url, root, batch)
        res["redis_benchmark"] = P.redis_benchmark(cluster, int(res["batched_read"]["mean_value"]))
        print(f"  cluster: get_many {res['batched_read']['MB_per_s']:.0f} MB/s (1 process), redis-benchmark "
              f"{res['redis_benchmark']['MB_per_s']:.0f} MB/s (3 processes, one hot key each)")
        res["connection_read"] = P.connection_read(url, root, batch, tmp)
        c = res["connection_read"]
        print(f"  one connection: get_many {c['get_many_MB_per_s']:.0f} MB/s, redis-benchmark -r "
              f"{c['redis_benchmark_MB_per_s']:.0f} MB/s")
        res["fill"] = fill_part(root, url, cluster, args.workers)
        print("MinIO vs LRU at 50 % capacity")
        res["policy"] = {p: P.policy_hit_ratio(cluster, root, p, 0.5) for p in ("noeviction", "allkeys-lru")}
        for p, v in res["policy"].items():
            print(f"  {p:12s} hit {v['hit_ratio_epochs_2_3']:.3f} cached {v['cached_fraction']:.3f}")
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    run1, run2 = res["sweep_run1"]["epochs"], res["sweep_run2"]["epochs"]
    run1_warm = sum(e["samples_per_s"] * e["seconds"] for e in run1[1:]) / sum(e["seconds"] for e in run1[1:])
    naive = res["naive_fresh"]["samples_per_s"]
    fill = res["fill"]
    warm = {k: v["samples_per_s"] for k, v in res["warm"].items()}
    ratios = {
        "cluster_warm_vs_naive": warm["cluster"] / warm["naive"],
        "read_vs_redis_benchmark": (res["connection_read"]["get_many_MB_per_s"]
                                    / res["connection_read"]["redis_benchmark_MB_per_s"]),
        "cluster_read_vs_redis_benchmark_x3_hot_key": (res["batched_read"]["MB_per_s"]
                                                       / res["redis_benchmark"]["MB_per_s"]),
        "fill_vs_bound": fill["pillow"]["samples_per_s"] / fill["pillow"]["bound"],
        "fill_vs_bound_dali": (fill["dali"]["samples_per_s"] / fill["dali"]["bound"]
                               if "dali" in fill else None),
        "run2_vs_warm": run2[0]["samples_per_s"] / run1_warm,
        "run2_vs_run1": run2[0]["samples_per_s"] / run1[0]["samples_per_s"],
        "run2_vs_run1_tiered": (res["tiered_run2"]["epochs"][0]["samples_per_s"]
                                / res["tiered_run1"]["epochs"][0]["samples_per_s"]),
        "cold_vs_naive_lmdb": res["cold_lmdb"]["samples_per_s"] / naive,
        "cold_vs_naive_cluster": res["cold_cluster"]["samples_per_s"] / naive,
        "minio_hit_vs_fraction": res["policy"]["noeviction"]["hit_vs_fraction"],
        "lru_hit_vs_fraction": res["policy"]["allkeys-lru"]["hit_vs_fraction"],
        "lmdb_warm_vs_naive": warm["lmdb"] / warm["naive"],
        "cluster_warm_vs_lmdb_warm": warm["cluster"] / warm["lmdb"],
        "cluster_warm_vs_dali": (warm["cluster"] / res["dali_cpu"]["samples_per_s"]
                                 if res["dali_cpu"].get("available") else None),
    }
    ratios["cold_vs_naive"] = min(ratios["cold_vs_naive_lmdb"], ratios["cold_vs_naive_cluster"])
    ratios = {k: ratios[k] for k in [*TARGETS, *[k for k in ratios if k not in TARGETS]]}
    for name, target in TARGETS.items():
        if ratios[name] is not None and ratios[name] < target:
            notes.append(f"target missed: {name} = {ratios[name]:.2f} < {target}")
    config = {"images": n_images, "batch_size": batch, "workers": args.workers,
              "image_size": P.SIZE, "short_side": 160, "masters": 3, "quick": args.quick,
              "nfs_stand_in": "slowfile:// latency 5 ms per request, 50 MB/s per process"}
    name = "cluster_quick" if args.quick else "cluster"
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR) as out:
        write_results(name, machine=machine, config=config, results=res, ratios=ratios, notes=notes,
                      out_dir=out)
        plot(os.path.join(out, name + ".png"), res, run1_warm)
        for ext in (".json", ".png"):
            os.replace(os.path.join(out, name + ext), RESULTS_DIR / (name + ext))


def fill_part(root: str, url: str, cluster: Any, workers: int) -> dict[str, Any]:
    from cache_daemon.decoders import DaliDecoder, dali_available

    out: dict[str, Any] = {}
    backends: dict[str, Any] = {"pillow": None}
    if dali_available() is None:
        backends["dali"] = DaliDecoder(device="cpu")
    for name, dec in backends.items():
        P.flush_cluster(cluster)
        one = P.decode_bound(root, dec)
        got = P.daemon_fill(root, url, dec, workers, latency_ms=5, mbps=50)
        bw = 50e6 / got["mean_file_bytes"]  # one reading process (the daemon's parent), one 50 MB/s link
        got.update(decode_bound_one_process=one, decode_bound=workers * one, bandwidth_bound=bw,
                   bound=min(bw, workers * one))
        out[name] = got
        print(f"  fill {name:6s} {got['samples_per_s']:7.0f} samples/s; bound {got['bound']:.0f} "
              f"(bandwidth {bw:.0f}, decode {workers * one:.0f})")
    return out


def plot(path: str, res: dict[str, Any], run1_warm: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    w = res["warm"]
    labels = ["naive PIL", "DALI CPU", "cold LMDB", "cold cluster", "warm LMDB", "warm cluster",
              "copy ceiling"]
    vals = [w["naive"]["samples_per_s"], res["dali_cpu"].get("samples_per_s", 0.0),
            res["cold_lmdb"]["samples_per_s"], res["cold_cluster"]["samples_per_s"],
            w["lmdb"]["samples_per_s"], w["cluster"]["samples_per_s"], w["copy_ceiling"]["samples_per_s"]]
    axes[0].bar(range(len(vals)), vals)
    axes[0].set_xticks(range(len(vals)), labels, rotation=30, ha="right")
    axes[0].set_title("epochs: samples/s (128 px RRC+flip, 2 workers)")
    run1, run2 = res["sweep_run1"]["epochs"], res["sweep_run2"]["epochs"]
    axes[1].bar(["run 1 epoch 1", "run 1 warm", "run 2 epoch 1"],
                [run1[0]["samples_per_s"], run1_warm, run2[0]["samples_per_s"]], color="tab:green")
    axes[1].set_title("sweep: samples/s")
    fill = res["fill"]
    names = list(fill)
    axes[2].bar([f"{n} fill" for n in names] + [f"{n} bound" for n in names],
                [fill[n]["samples_per_s"] for n in names] + [fill[n]["bound"] for n in names],
                color="tab:orange")
    axes[2].set_title("daemon fill from slowfile:// (5 ms, 50 MB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
