"""A reading job for tests/test_emulated_faults.py, started inside a node's namespace (EmuCluster.run_on).

Reads every sample of ``--source`` once per epoch through ``CachedImageNet`` + a ``DataLoader`` with 2
workers (in order), and compares each sample's pixels to an independent reference: the file's bytes read
from ``--root`` (the same files, a plain path) decoded by ``datacache.decode.decode_image`` with the same
Variant. After ``--pause-after`` batches of epoch 0 it prints ``{"event": "mid"}`` and waits (bounded) for
the file ``--go`` to exist, so the test can inject a fault mid-epoch. Prints one JSON line per epoch and
exits 0 when it finished (mismatches are reported in the JSON, not raised).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from client.dataset import CachedImageNet
from datacache.decode import decode_image


def keep(batch: list[Any]) -> list[Any]:
    """Collate: keep the variable-size samples as a list (module level: picklable for workers)."""
    return batch


def reference(root: str, rel: str, ds: CachedImageNet) -> np.ndarray:
    with open(os.path.join(root, rel), "rb") as f:
        return decode_image(f.read(), ds.variant, name=rel)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--root", required=True, help="the same dataset as a plain path (reference reads)")
    ap.add_argument("--short-side", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pause-after", type=int, default=-1, help="batches of epoch 0 before the pause")
    ap.add_argument("--go", default="", help="file whose existence ends the pause")
    ap.add_argument("--pause-timeout", type=float, default=60.0)
    a = ap.parse_args()
    ds = CachedImageNet(a.source, cache=a.cache, short_side=a.short_side, t1_dir=None, on_error="raise")
    refs = [reference(a.root, ds.manifest.paths[i], ds) for i in range(len(ds))]
    # workers are forked (Linux default): each opens its own store connections on first use
    dl = DataLoader(ds, batch_size=a.batch, shuffle=False, num_workers=2, collate_fn=keep)
    for epoch in range(a.epochs):
        t0 = time.monotonic()
        seen, bad = 0, []
        for b, batch in enumerate(dl):
            for img, label in batch:
                i = seen
                ref = refs[i]
                got = img.permute(1, 2, 0).numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
                if label != ds.targets[i] or got.shape != ref.shape or not np.array_equal(got, ref):
                    bad.append(i)
                seen += 1
            if epoch == 0 and b + 1 == a.pause_after:
                print(json.dumps({"event": "mid", "seen": seen}), flush=True)
                deadline = time.monotonic() + a.pause_timeout
                while not os.path.exists(a.go) and time.monotonic() < deadline:
                    time.sleep(0.05)
        print(json.dumps({"event": "epoch", "epoch": epoch, "seen": seen, "n": len(ds), "bad": bad,
                          "seconds": round(time.monotonic() - t0, 2), "stats": ds.stats()}, default=str),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
