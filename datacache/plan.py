"""``datacache plan``: will the dataset fit the cluster's memory, and in which encoding?

For a source it reports, per sample and in total:

* **raw** records (the default encoding: decoded uint8 pixels + a small header) *as Redis holds
  them*: each value is rounded up to jemalloc's size class and a fixed per-key cost is added
  (:func:`redis_bytes_per_key`);
* **jpeg** records (``encoding="jpeg"``: the resized sample re-encoded at q90, decoded on every hit);
* the **raw files** (what the source holds; what a cache of the original JPEGs would need).

Sizes per sample come from decoding an evenly spaced sample of the files (``--sample``, default 64)
to the variant; file sizes are exact (from the listing). A cluster "fits" a layout when the total is
at most :data:`USABLE_FRACTION` of ``nodes x memory_per_node`` (the rest is headroom for
fragmentation, client buffers and replication). The recommendation is the first layout that fits,
raw before jpeg; when none does, the MinIO policy caches the fraction that fits (hit ratio = that
fraction) and a smaller short side is suggested.

Redis per-key overhead, measured (provenance of :data:`REDIS_FIXED_PER_KEY`): on this project's
machine, Redis 7.0.15 with jemalloc 5.3.0, ``INFO memory`` ``used_memory`` before and after writing
1,000-2,000 keys named like sample keys with random values of 1 KB, 11 KB, 48 KiB, 77 KB, 102 KB and
150 KB: each key cost its value rounded up to jemalloc's size class (of value + 17 bytes of string
header) plus 121-169 bytes (key string, dict entry, object header, amortised hash-table growth); we
use 150. ``--measure-redis`` (or ``tests/test_plan.py``) measures it again against a started
``redis-server`` for the dataset's real record size.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from datacache.config import Variant
from datacache.decode import DecodeError, decode_image
from datacache.manifest import Manifest
from datacache.record import encode_record
from datacache.source import Source

REDIS_FIXED_PER_KEY = 150
REDIS_SDS_HEADER = 17  # sds header + NUL of a large string value
USABLE_FRACTION = 0.9


def jemalloc_class(n: int) -> int:
    """Size class jemalloc rounds an ``n``-byte allocation up to (4 classes per power of two)."""
    if n <= 8:
        return 8
    if n <= 128:
        return -(-n // 16) * 16
    k = (n - 1).bit_length() - 1  # 2**k < n <= 2**(k+1)
    spacing = 1 << (k - 2)
    return -(-n // spacing) * spacing


def redis_bytes_per_key(value_bytes: float) -> float:
    """Memory one key holding ``value_bytes`` costs in Redis (see the module docstring); the key string
    itself is part of the measured fixed cost."""
    return jemalloc_class(math.ceil(value_bytes) + REDIS_SDS_HEADER) + REDIS_FIXED_PER_KEY


def measure_redis_overhead(value_bytes: int, n: int = 500) -> dict[str, float]:
    """Start a throwaway ``redis-server``, write ``n`` keys of ``value_bytes`` and measure ``used_memory``."""
    import redis

    from datacache.devtools.redis_local import start_server

    with tempfile.TemporaryDirectory(prefix="datacache-plan-") as tmp:
        srv = start_server(tmp)
        try:
            r = redis.Redis(port=srv.port)
            before = int(r.info("memory")["used_memory"])
            pipe = r.pipeline(transaction=False)
            for i in range(n):
                key = b"dc:0123456789abcdef:s160m320bilinear-raw:%d" % (10**6 + i)
                pipe.set(key, os.urandom(value_bytes))
                if i % 50 == 49:
                    pipe.execute()
            pipe.execute()
            after = int(r.info("memory")["used_memory"])
            version = r.info("server").get("redis_version", "?")
        finally:
            srv.stop()
    per_key = (after - before) / n
    return {"value_bytes": value_bytes, "per_key": per_key, "model": redis_bytes_per_key(value_bytes),
            "overhead": per_key - value_bytes, "redis_version": version, "keys": n}


@dataclass
class Layout:
    name: str
    per_sample: float
    total: float
    fits: bool
    note: str


def plan(source: str, *, nodes: int, memory_per_node: int, short_side: int = 160, sample: int = 64,
         storage_options: dict | None = None, measure_redis: bool = False, train_rate: float | None = None,
         fill_rate: float | None = None, fill_workers: int = 8) -> dict[str, Any]:
    """The numbers behind ``datacache plan`` (see the module docstring).

    ``train_rate`` (samples/s of the training job) and ``fill_rate`` (samples/s the daemons fill, all
    nodes together; default: this machine's measured decode rate per process x ``fill_workers`` x
    ``nodes``) give the hit ratio to expect when raw records do not all fit: MinIO (no run plan) keeps a
    fixed fraction f, the rolling fill (a live run plan) reaches min(1, f + B/R) (docs/cluster.md)."""
    import time
    man = Manifest.build(source, storage_options=storage_options)
    n = len(man)
    if n == 0:
        raise ValueError(f"{source}: no images listed")
    raw_v, jpeg_v = Variant(short_side=short_side), Variant(short_side=short_side, encoding="jpeg")
    picks = np.unique(np.linspace(0, n - 1, num=min(sample, n)).round().astype(int)).tolist()
    src = Source(man.root, t1_dir=None, storage_options=storage_options)
    datas = src.read_many([man.paths[i] for i in picks], sizes=[int(man.sizes[i]) for i in picks])
    raw_sizes, jpeg_sizes = [], []
    decode_s = 0.0
    for i, data in zip(picks, datas):
        if isinstance(data, BaseException):
            continue
        t0 = time.perf_counter()
        try:
            px = decode_image(data, raw_v, name=man.paths[i])
        except DecodeError:
            continue
        decode_s += time.perf_counter() - t0
        key = b"dc:0123456789abcdef:%s:%d" % (raw_v.tag().encode(), i)
        raw_sizes.append(len(encode_record(px, int(man.labels[i]), raw_v, key=key)))
        jpeg_sizes.append(len(encode_record(px, int(man.labels[i]), jpeg_v, key=key)))
    if not raw_sizes:
        raise ValueError(f"{source}: none of the {len(picks)} sampled files could be decoded")
    capacity = nodes * memory_per_node * USABLE_FRACTION
    raw_mean, jpeg_mean = float(np.mean(raw_sizes)), float(np.mean(jpeg_sizes))
    measured = measure_redis_overhead(int(raw_mean)) if measure_redis else None
    raw_key = measured["per_key"] if measured else redis_bytes_per_key(raw_mean)
    jpeg_key = redis_bytes_per_key(jpeg_mean)
    files_total = float(np.sum(man.sizes))
    layouts = [
        Layout("raw", raw_key, raw_key * n, raw_key * n <= capacity,
               f"{raw_v.tag()}: decoded pixels, no decode on a hit"),
        Layout("jpeg", jpeg_key, jpeg_key * n, jpeg_key * n <= capacity,
               f"{jpeg_v.tag()}: ~{raw_mean / jpeg_mean:.1f}x smaller, one JPEG decode per hit"),
        Layout("files", files_total / n + REDIS_FIXED_PER_KEY, files_total + REDIS_FIXED_PER_KEY * n,
               files_total + REDIS_FIXED_PER_KEY * n <= capacity,
               "the original files: full decode every epoch"),
    ]
    fit = next((lay for lay in layouts[:2] if lay.fits), None)
    if fit is not None:
        rec = (f"encoding={fit.name!r} at short side {short_side}: {human(fit.total)} of {human(capacity)} "
               f"usable ({USABLE_FRACTION:.0%} of {nodes} x {human(memory_per_node)})")
        if fit.name == "raw" and fit.total > 0.5 * capacity:
            rec += "; keep maxmemory-policy noeviction (MinIO) so growth never thrashes"
    else:
        frac = capacity / layouts[1].total
        smaller = max(32, int(short_side * math.sqrt(capacity / layouts[0].total)) // 8 * 8)
        rec = (f"nothing fits: with the MinIO policy (noeviction) {frac:.0%} of the jpeg records stay cached "
               f"and the hit ratio is ~{frac:.0%}; or use a smaller short side (~{smaller} px raw fits)")
    f = min(1.0, capacity / layouts[0].total)  # of the raw records (a jpeg fallback aside)
    per_process = len(raw_sizes) / decode_s if decode_s > 0 else 0.0
    b = fill_rate if fill_rate is not None else per_process * fill_workers * nodes
    hit = {"cached_fraction": f, "minio": f, "fill_rate": b, "fill_rate_measured": fill_rate is None,
           "decode_rate_per_process": per_process, "train_rate": train_rate,
           "rolling": min(1.0, f + b / train_rate) if train_rate else None}
    return {"source": man.root, "samples": n, "sampled": len(raw_sizes), "short_side": short_side,
            "nodes": nodes, "memory_per_node": memory_per_node, "capacity": capacity,
            "layouts": [lay.__dict__ for lay in layouts], "redis_measured": measured, "recommendation": rec,
            "hit_ratio": hit}


def human(n: float) -> str:
    """``123.4 MiB`` style (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_plan(p: dict[str, Any]) -> str:
    lines = [f"{p['source']}: {p['samples']:,} samples ({p['sampled']} decoded to measure), short side "
             f"{p['short_side']}, {p['nodes']} nodes x {human(p['memory_per_node'])} "
             f"({human(p['capacity'])} usable)",
             f"  {'layout':<6} {'per sample':>12} {'total':>12}  fits  what"]
    for lay in p["layouts"]:
        lines.append(f"  {lay['name']:<6} {human(lay['per_sample']):>12} {human(lay['total']):>12}  "
                     f"{'yes ' if lay['fits'] else 'no  '}  {lay['note']}")
    if p["redis_measured"]:
        m = p["redis_measured"]
        lines.append(f"  raw per key measured on redis {m['redis_version']}: {m['per_key']:.0f} B "
                     f"(model {m['model']:.0f} B)")
    lines.append("  Redis per-key cost included (jemalloc size class + ~150 B, measured: datacache/plan.py)")
    lines.append(f"recommendation: {p['recommendation']}")
    h = p["hit_ratio"]
    if h["cached_fraction"] < 1.0:
        how = (f"{h['decode_rate_per_process']:.0f}/s per decode process measured here x workers x nodes"
               if h["fill_rate_measured"] else "--fill-rate")
        line = (f"hit ratio (raw records, {h['cached_fraction']:.0%} cached): MinIO (no run plan) "
                f"~{h['minio']:.2f}; ")
        if h["rolling"] is not None:
            line += (f"rolling fill (a live run plan) min(1, f + B/R) = {h['rolling']:.2f} with B = "
                     f"{h['fill_rate']:.0f} samples/s ({how}), R = {h['train_rate']:.0f} samples/s")
        else:
            line += "pass --train-rate (the job's samples/s) for the rolling fill's min(1, f + B/R)"
        lines.append(line)
    return "\n".join(lines)
