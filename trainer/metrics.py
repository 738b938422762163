"""Metrics out of a run: one JSON object per line in ``<out>/metrics.jsonl`` and one line per epoch on
stdout (rank 0 only). Records: ``{"event": "start", ...}``, ``{"event": "epoch", ...}`` (training
and validation numbers, cache hits/misses of the epoch, data-wait fraction), ``{"event": "end"}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN
    return v


class MetricsLog:
    """Append-only JSONL log + stdout summary lines; a no-op on ranks other than 0."""

    def __init__(self, out: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.path = os.path.join(out, "metrics.jsonl")
        self.stream = stream or sys.stdout
        if enabled:
            os.makedirs(out, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        rec = {"event": event, "time": round(time.time(), 3), **{k: _clean(v) for k, v in fields.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, sort_keys=False) + "\n")

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)


def _hit_ratio(rec: dict[str, Any]) -> str:
    r = rec.get("cache_hit_ratio")
    return f" (hit ratio {r:.3f})" if r is not None else ""


def epoch_line(rec: dict[str, Any], epochs: int) -> str:
    """``epoch 3/12  32px  batch 128  hitopk  lr 0.19  loss 0.534  812 samples/s  data-wait 1.2%
    cache 1437 hits / 0 misses (hit ratio 1.000)  [read 5.1 MB local / 0.6 MB remote (89% local)]  val top1
    97.22% top5 99.72%``."""
    parts = [f"epoch {rec['epoch'] + 1}/{epochs}", f"{rec['resolution']}px", f"batch {rec['global_batch']}",
             rec["comm_method"], f"lr {rec['lr']:.4g}", f"loss {rec['loss']:.4f}",
             f"{rec['samples_per_s']:.0f} samples/s", f"data-wait {100 * rec['data_wait_fraction']:.1f}%",
             f"cache {rec['cache_hits']} hits / {rec['cache_misses']} misses" + _hit_ratio(rec)]
    local, remote = rec.get("local_bytes", 0), rec.get("remote_bytes", 0)
    if local + remote:  # a Redis Cluster tier that knows each rank's local master
        parts.append(f"read {local / 1e6:.1f} MB local / {remote / 1e6:.1f} MB remote "
                     f"({100 * local / (local + remote):.0f}% local)")
    if rec.get("val_top1") is not None:
        parts.append(f"val top1 {100 * rec['val_top1']:.2f}% top5 {100 * rec['val_top5']:.2f}%")
    return "  ".join(parts)
