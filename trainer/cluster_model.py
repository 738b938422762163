"""The paper's cluster on paper: what 16 nodes x 8 GPUs at the DAWNBench rates need from each component.

``python -m trainer.cluster_model`` prints, with every assumption, for each phase of Table 4 of Shi et
al. (MLSys 2021; 13 epochs at 96 px, 11 at 128, 3 at 224, 1 at 288):

* per node: samples/s, the cached variant's record size, **cache traffic on the node's link** for a
  global shuffle (``(M-1)/M`` of the sample bytes come from other nodes' shards) and for the
  locality-aware sampler (:mod:`client.locality_sampler`: only the exchange fraction ``Q`` crosses,
  ``Q (M-1)/M`` of it lands on another node), next to the **gradient traffic** of dense 2D-Torus
  all-reduce and of HiTopKComm, and whether their sum fits the NIC;
* per master: keys/s and bytes/s it must serve, and the client cores per GPU needed to parse replies at
  a measured per-core rate;
* the capacity side: Redis memory per node for each variant (jemalloc size class + per-key overhead, as
  :mod:`datacache.plan` predicts), and the daemons' fill time from an NFS of a given bandwidth with a
  given decode rate per core.

Gradient bytes per node and step on the inter-node link (``d`` parameters, ``m`` nodes, ``n`` GPUs a
node, density ``rho``): 2D-Torus all-reduces ``d/n`` per GPU across the ``m`` nodes, ``n`` streams per
NIC: ``2 (m-1)/m * 4 d``; HiTopKComm all-gathers ``rho d/n`` (value, int32 index) pairs per GPU across the
nodes: ``(m-1) * rho * d * (4 + 4)`` received (fp32 values; 6 bytes a pair with fp16). Both are the
minimum these algorithms move; latency terms are ignored (see :mod:`trainer.comm.cost_model` for times).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from datacache.options import parse_bool
from datacache.plan import redis_bytes_per_key

RECORD_HEADER_BYTES = 96  # msgpack header of a raw record (datacache.record), ~80-100 bytes


@dataclass(frozen=True)
class Phase:
    """One row of Table 4: epochs, input resolution, per-GPU batch, 128-GPU samples/s, cached short side."""

    epochs: int
    input_px: int
    batch_per_gpu: int
    samples_per_s: float
    short_side: int


PAPER_PHASES = (  # Shi et al. 2021, Table 4; short side: 110 for the 96-px phase, 160 for the rest
    Phase(13, 96, 256, 366_208, 110),
    Phase(11, 128, 256, 269_696, 160),
    Phase(3, 224, 256, 131_712, 160),
    Phase(1, 288, 128, 72_960, 160),
)


@dataclass(frozen=True)
class ClusterAssumptions:
    nodes: int = 16
    gpus_per_node: int = 8
    nic_gbit: float = 25.0
    params: int = 25_557_032  # ResNet-50
    density: float = 0.01
    fp16_values: bool = False
    exchange: float = 0.1  # Q of the locality-aware sampler
    samples: int = 1_281_167
    mean_aspect: float = 1.21  # ImageNet train's mean long/short side (~469 x 387)
    jpeg_bytes_total: float = 140e9  # ImageNet train's JPEGs (~110 KB a file)
    nfs_gbit: float = 10.0  # the shared NFS's bandwidth, all nodes together
    cpu_cores_per_node: int = 64  # cores a daemon's decode pool may use
    decode_per_core: float = 900.0  # JPEG decodes + resizes per core per second (FACTS.md: 900-1000)
    parse_mb_per_core: float = 2215.0  # client reply parsing MB/s per core (bench/results/cluster.json)
    phases: tuple[Phase, ...] = field(default=PAPER_PHASES)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "params", "samples", "cpu_cores_per_node"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("nic_gbit", "mean_aspect", "jpeg_bytes_total", "nfs_gbit", "decode_per_core",
                     "parse_mb_per_core"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v}")
        if not 0 < self.density <= 1 or not 0 <= self.exchange <= 1:
            raise ValueError(f"density must be in (0, 1] and exchange in [0, 1], got {self.density}, "
                             f"{self.exchange}")


def record_bytes(short_side: int, mean_aspect: float) -> float:
    """Bytes of one raw RGB record whose shorter side is ``short_side`` (header included)."""
    return short_side * round(short_side * mean_aspect) * 3 + RECORD_HEADER_BYTES


def cache_remote_fraction(sampler: str, nodes: int, exchange: float) -> float:
    """Expected fraction of a node's sample reads served by another node's shard."""
    if sampler == "global":
        return (nodes - 1) / nodes
    if sampler == "local":
        return exchange * (nodes - 1) / nodes
    raise ValueError(f"sampler must be 'global' or 'local', got {sampler!r}")


def gradient_bytes_per_node(method: str, d: int, m: int, density: float, fp16_values: bool = False) -> float:
    """Bytes one node receives on the inter-node link per step (module docstring)."""
    if method == "torus":
        return 2 * (m - 1) / m * 4 * d
    if method == "hitopk":
        return (m - 1) * density * d * ((2 if fp16_values else 4) + 4)
    raise ValueError(f"method must be 'torus' or 'hitopk', got {method!r}")


def model(a: ClusterAssumptions) -> dict[str, Any]:
    """Every figure of the module docstring, per phase and per variant."""
    gpus = a.nodes * a.gpus_per_node
    phases = []
    for ph in a.phases:
        per_node = ph.samples_per_s / a.nodes
        rec = record_bytes(ph.short_side, a.mean_aspect)
        steps = ph.samples_per_s / (ph.batch_per_gpu * gpus)
        grad = {meth: gradient_bytes_per_node(meth, a.params, a.nodes, a.density, a.fp16_values)
                * steps * 8 / 1e9 for meth in ("torus", "hitopk")}
        cache = {s: per_node * rec * cache_remote_fraction(s, a.nodes, a.exchange) * 8 / 1e9
                 for s in ("global", "local")}
        phases.append({
            **asdict(ph), "steps_per_s": steps, "samples_per_s_per_node": per_node, "record_bytes": rec,
            "cache_gbit_per_node": cache, "gradient_gbit_per_node": grad,
            "link_gbit": {f"{s}+{meth}": cache[s] + grad[meth] for s in cache for meth in grad},
            "fits_nic": {f"{s}+{meth}": cache[s] + grad[meth] <= a.nic_gbit for s in cache for meth in grad},
            "master_keys_per_s": per_node,  # a master serves its shard's share of every rank's reads
            "master_mb_per_s": per_node * rec / 1e6,
            "client_cores_per_gpu": ph.samples_per_s / gpus * rec / 1e6 / a.parse_mb_per_core,
        })
    variants = []
    for side in sorted({ph.short_side for ph in a.phases}):
        rec = record_bytes(side, a.mean_aspect)
        per_node = a.samples / a.nodes * redis_bytes_per_key(rec)
        variants.append({"short_side": side, "record_bytes": rec, "redis_bytes_per_node": per_node,
                         "redis_bytes_total": per_node * a.nodes})
    nfs_s = a.jpeg_bytes_total * 8 / (a.nfs_gbit * 1e9)
    decode_s = a.samples / (a.nodes * a.cpu_cores_per_node * a.decode_per_core)
    return {"assumptions": {k: v for k, v in asdict(a).items() if k != "phases"}, "phases": phases,
            "variants": variants,
            "fill": {"nfs_bound_s": nfs_s, "decode_bound_s": decode_s, "fill_s": max(nfs_s, decode_s),
                     "bound": "nfs" if nfs_s >= decode_s else "decode"}}


def format_model(r: dict[str, Any]) -> str:
    a = r["assumptions"]
    lines = ["assumptions: " + ", ".join(f"{k}={v}" for k, v in a.items()), ""]
    lines.append(f"{'phase':>8} {'samples/s':>10} {'/node':>7} {'rec KB':>7} {'cache global':>12} "
                 f"{'cache local':>11} {'torus':>6} {'hitopk':>6}  "
                 f"link Gbit/s (fits {a['nic_gbit']:g} GbE?)")
    for p in r["phases"]:
        c, g = p["cache_gbit_per_node"], p["gradient_gbit_per_node"]
        fits = "  ".join(f"{k} {v:.1f}{'' if p['fits_nic'][k] else ' (NO)'}"
                         for k, v in p["link_gbit"].items())
        lines.append(f"{p['input_px']:>6}px {p['samples_per_s']:>10,.0f} "
                     f"{p['samples_per_s_per_node']:>7,.0f} "
                     f"{p['record_bytes'] / 1e3:>7.1f} {c['global']:>12.2f} {c['local']:>11.2f} "
                     f"{g['torus']:>6.2f} {g['hitopk']:>6.2f}  {fits}")
    lines.append("")
    for p in r["phases"]:
        lines.append(f"{p['input_px']:>6}px: each master serves {p['master_keys_per_s']:,.0f} keys/s = "
                     f"{p['master_mb_per_s']:,.0f} MB/s; clients need {p['client_cores_per_gpu']:.2f} "
                     "cores per GPU to parse replies")
    for v in r["variants"]:
        lines.append(f"short side {v['short_side']}: {v['record_bytes'] / 1e3:.1f} KB a record, Redis "
                     f"{v['redis_bytes_per_node'] / 2**30:.1f} GiB per node "
                     f"({v['redis_bytes_total'] / 2**30:.0f} GiB in all)")
    f = r["fill"]
    lines.append(f"fill: {f['fill_s']:,.0f} s ({f['bound']}-bound; reading the JPEGs from the NFS "
                 f"{f['nfs_bound_s']:,.0f} s, decoding them on all nodes {f['decode_bound_s']:,.0f} s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.cluster_model",
                                 description=__doc__.split("\n\n")[0],
                                 epilog="Every assumption is a flag; the defaults are the paper's cluster.")
    defaults = ClusterAssumptions()
    for name, value in asdict(defaults).items():
        if name == "phases":
            continue
        kind = type(value)
        ap.add_argument("--" + name.replace("_", "-"), type=(lambda s, n=name: parse_bool(s, "--" + n))
                        if kind is bool else kind, default=value, help=f"default {value}")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = vars(ap.parse_args(argv))
    out = args.pop("json")
    try:
        r = model(ClusterAssumptions(**args))
    except ValueError as e:
        ap.error(str(e))
    print(format_model(r))
    if out:
        out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
