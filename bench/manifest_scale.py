"""Manifest at ImageNet scale: resident bytes, pickle bytes, spawn-worker start, listing time.

Generates an ImageFolder tree of ``--classes`` x ``--per-class`` *sparse* files (1000 x 1280 =
1.28M by default: each file has ImageNet's mean JPEG size, ~110 KB, but no data blocks, so the
tree costs inodes, not disk), then, each in a fresh subprocess so the numbers are not polluted:

* ``listing_local_s``: ``Manifest.build`` of the local tree (``file://``; CPU-bound walk);
* ``resident_bytes``: RSS growth of a fresh process that loads the persisted manifest
  (``nbytes``: what the columns hold) -- what each process keeps;
* ``pickle_bytes``: ``len(pickle.dumps(CachedImageNet(...)))``, what DataLoader sends to every
  spawn worker; ``unpickled_rss_bytes``: RSS growth of a fresh process unpickling it;
* ``spawn8_s``: time until 8 spawn DataLoader workers each returned one batch from a dataset
  holding the full manifest (the worker's work is trivial), beside ``spawn8_tiny_s`` for a
  10-image dataset: the difference is what the manifest costs;
* ``listing_slowfile_s``: the listing through ``slowfile://`` at ``--latency-ms`` per request
  (one latency per directory listing, class folders listed concurrently), and the start-time
  revalidation of the persisted listing (``revalidate_dirs_s``; ``"full"`` costs a listing).

Run ``python -m bench.manifest_scale`` (full, ~10 min on 2 cores) or ``--quick``; ``--python``
runs the measurement with another checkout on PYTHONPATH (``--label before``) to compare.
Writes ``bench/results/manifest.json`` and ``manifest.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import RESULTS_DIR, bar_chart, machine_info, print_machine, write_results

MEAN_JPEG_BYTES = 110_000


def make_sparse_tree(root: str, classes: int, per_class: int) -> None:
    """``root/n%08d/n%08d_%d.JPEG`` sparse files (no data blocks), made once and published atomically
    (built in a temp dir beside ``root`` and renamed, see :func:`datacache.devtools.synth.publish_dir`)."""
    from tqdm import tqdm

    from datacache.devtools.synth import publish_dir

    def build(tmp: str) -> None:
        for c in tqdm(range(classes), desc="sparse tree", unit="class"):
            d = os.path.join(tmp, f"n{c:08d}")
            os.makedirs(d)
            for i in range(per_class):
                fd = os.open(os.path.join(d, f"n{c:08d}_{i}.JPEG"), os.O_CREAT | os.O_WRONLY, 0o644)
                os.ftruncate(fd, MEAN_JPEG_BYTES + (i * 7919) % 40_000)
                os.close(fd)

    publish_dir(root, build)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Probe:
    """Holds the dataset (so it is pickled into every worker) but does no I/O per item."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return len(self.ds) + i


def _first(batch: list) -> list:
    return batch


def _spawn8(ds: Any) -> float:
    from torch.utils.data import DataLoader

    t = time.perf_counter()
    loader = DataLoader(Probe(ds), batch_size=1, num_workers=8, multiprocessing_context="spawn",
                        collate_fn=_first)
    got = [b for b in loader]
    assert len(got) == 8
    return time.perf_counter() - t


def _dataset(source: str, cache_dir: str) -> Any:
    from client.dataset import CachedImageNet

    return CachedImageNet(source, cache=f"lmdb://{cache_dir}", short_side=160, t1_dir=None)


def measure(root: str, tiny: str, workdir: str, latency_ms: float, skip_slow: bool) -> dict[str, Any]:
    """Runs in a fresh interpreter (see main); returns the numbers as a dict."""
    from datacache.manifest import Manifest

    out: dict[str, Any] = {}
    cache = os.path.join(workdir, "cache")
    t = time.perf_counter()
    ds = _dataset(root, cache)  # lists the tree and persists the manifest next to the cache
    out["listing_local_s"] = time.perf_counter() - t
    out["entries"] = len(ds)
    out["manifest_nbytes"] = getattr(ds.manifest, "nbytes", None)
    blob = pickle.dumps(ds)
    out["pickle_bytes"] = len(blob)
    with open(os.path.join(workdir, "ds.pickle"), "wb") as f:
        f.write(blob)
    small = _dataset(tiny, os.path.join(workdir, "tiny-cache"))
    runs = [(_spawn8(small), _spawn8(ds)) for _ in range(2)]  # interleaved; the best of two each
    out["spawn8_tiny_s"] = min(r[0] for r in runs)
    out["spawn8_s"] = min(r[1] for r in runs)
    # RSS growth in a fresh process, measured after the imports (numpy, torch ...) are done
    code = ("import gc, pickle, sys; import client.dataset, datacache.manifest; "
            "from bench.manifest_scale import _rss; gc.collect(); r0 = _rss(); {load}; gc.collect(); "
            "print(_rss() - r0)")
    mdir = os.path.join(cache, "manifests")
    saved = os.path.join(mdir, sorted(os.listdir(mdir))[0])
    loads = {"resident_bytes": f"m = datacache.manifest.Manifest.load({saved!r})",
             "unpickled_rss_bytes": f"ds = pickle.load(open({os.path.join(workdir, 'ds.pickle')!r}, 'rb'))"}
    for key, load in loads.items():
        res = subprocess.run([sys.executable, "-c", code.format(load=load)], capture_output=True, text=True,
                             check=True)
        out[key] = int(res.stdout.strip().splitlines()[-1])
    if not skip_slow:
        url = f"slowfile://{root}?latency_ms={latency_ms:g}&mbps=0"
        pdir = os.path.join(workdir, "persist")
        t = time.perf_counter()
        Manifest.build(url, persist_dir=pdir)
        out["listing_slowfile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            Manifest.build(url, persist_dir=pdir, revalidate="dirs")
        except TypeError:  # pragma: no cover - a checkout without revalidate=
            Manifest.build(url, persist_dir=pdir)
        out["revalidate_dirs_s"] = time.perf_counter() - t
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1280)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "datacache-manifest-scale"))
    p.add_argument("--quick", action="store_true", help="20 x 50 files")
    p.add_argument("--skip-slowfile", action="store_true", help="no slowfile:// listing")
    p.add_argument("--python-path", help="PYTHONPATH of another checkout to measure (e.g. the code before)")
    p.add_argument("--label", default="after", help="name of this measurement in the JSON")
    p.add_argument("--remove-tree", action="store_true", help="delete the generated tree at the end")
    args = p.parse_args(argv)
    if args.quick:
        args.classes, args.per_class = 20, 50
    machine = print_machine(machine_info())
    # "sparse-" names: trees published by rename (a tree left by the old marker scheme is not reused)
    root = os.path.join(args.root, f"sparse-{args.classes}x{args.per_class}")
    make_sparse_tree(root, args.classes, args.per_class)
    tiny = os.path.join(args.root, "sparse-tiny")
    make_sparse_tree(tiny, 2, 5)
    bench_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="manifest-scale-") as work:
        env = {**os.environ, "XDG_CACHE_HOME": work,
               "PYTHONPATH": os.pathsep.join(x for x in (args.python_path, bench_dir) if x)}
        code = (f"import json; from bench.manifest_scale import measure; print(json.dumps(measure("
                f"{root!r}, {tiny!r}, {work!r}, {args.latency_ms!r}, {args.skip_slowfile!r})))")
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        numbers = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(numbers, indent=2))
    name = "manifest_quick" if args.quick else "manifest"
    path = RESULTS_DIR / f"{name}.json"
    previous = json.loads(path.read_text())["results"] if path.exists() else {}
    results = {**previous, args.label: numbers}
    cur = results.get("after", numbers)
    ratios = {"resident_vs_150mb_lower_is_better": cur["resident_bytes"] / 150e6,
              "pickle_vs_100mb_lower_is_better": cur["pickle_bytes"] / 100e6,
              "spawn8_vs_5s_lower_is_better": cur["spawn8_s"] / 5.0}
    if "listing_slowfile_s" in cur:
        ratios["listing_vs_60s_lower_is_better"] = cur["listing_slowfile_s"] / 60.0
    write_results(name, machine=machine, results=results, ratios=ratios,
                  config={"classes": args.classes, "per_class": args.per_class,
                          "latency_ms": args.latency_ms,
                          "files": "sparse (no data blocks), ImageNet-like names and sizes"},
                  notes=["sparse files: listing and manifest costs are real; reading them is not measured",
                         "slowfile:// charges one latency per directory listing (READDIRPLUS, ListObjectsV2)",
                         "spawn8_tiny_s: the same 8 spawn workers for a 10-image dataset (torch import)"])
    labels, values = [], []
    for label, r in results.items():
        for k in ("resident_bytes", "pickle_bytes"):
            labels.append(f"{label} {k[:-6]} MB")
            values.append(r[k] / 1e6)
    bar_chart(RESULTS_DIR / f"{name}.png", labels, values, title=f"manifest of {cur['entries']:,} entries",
              ylabel="MB")
    if args.remove_tree:
        shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
