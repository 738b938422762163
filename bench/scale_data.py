"""Generator of the scale rehearsal's synthetic ImageFolder (ImageNet's shape, tiny real JPEGs).

``ensure_scale_dataset(n)`` returns the root of an ImageFolder with ``classes`` class folders
(``n%08d``, as ImageNet's synsets) and ``n`` files spread over them (ImageNet: 1,000 classes,
1,281,167 files). Every file is a small real JPEG (64x48 by default, ~1.5-2.5 KB) so that 1.28M of
them fit this machine's disk and can be decoded by its 2 cores in minutes:

* ``VARIANTS`` textured base images (:func:`datacache.devtools.synth.synth_image`) are encoded once; each file
  is one of them with a JPEG COM segment holding the file's index and a random nonce inserted after
  SOI, so every file's bytes differ (distinct identities and checksums) while writing costs only a
  ``write()`` per file;
* ``corrupt_every`` (100 by default): every 100th file (index % 100 == 37) is garbage with a
  ``.JPEG`` name (1 % of the files, 12,812 at full size) -- the fault rehearsal's quarantined files.
  :func:`is_corrupt` says which.

Atomic and reusable: the tree is built in ``<root>.tmp-<pid>`` and renamed to ``<root>`` only when
complete, then a ``<root>.complete`` marker (beside the tree: a file inside it would be listed as a
stray file) is written with ``os.replace``. Two generators started at once serialise on an ``fcntl``
lock (``<root>.lock``): the second waits, sees the marker and reuses the tree. A generator killed
mid-build leaves only its ``.tmp-<pid>`` directory, which the next generator removes (under the lock;
only directories of that exact name pattern, which only this module creates).

``python -m bench.scale_data N [--dir DIR]`` generates one size ahead of the benchmark.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import io
import multiprocessing as mp
import os
import shutil
import struct
import time
from collections.abc import Sequence

import numpy as np

IMAGENET_FILES = 1_281_167
IMAGENET_CLASSES = 1000
SIZE = (64, 48)  # width, height of every generated JPEG
VARIANTS = 64
QUALITY = 85
CORRUPT_EVERY = 100
CORRUPT_AT = 37  # index % CORRUPT_EVERY == CORRUPT_AT -> a corrupt file

_BASE: list[bytes] = []  # pre-encoded JPEG variants, set in the parent before the pool forks


def default_dir() -> str:
    from datacache.config import user_cache_dir

    return os.path.join(user_cache_dir(), "datacache", "bench", "scale")


def per_class_counts(n: int, classes: int) -> list[int]:
    """Files per class: ``n`` spread as evenly as possible (the first ``n % classes`` get one more)."""
    if n < 1 or classes < 1:
        raise ValueError(f"need n >= 1 files and classes >= 1, got n={n}, classes={classes}")
    classes = min(classes, n)
    return [n // classes + (1 if c < n % classes else 0) for c in range(classes)]


def is_corrupt(index: int, corrupt_every: int = CORRUPT_EVERY) -> bool:
    """Whether the file with this global generation index is one of the deliberately corrupt ones."""
    return corrupt_every > 0 and index % corrupt_every == CORRUPT_AT % corrupt_every


def base_jpegs(variants: int = VARIANTS, size: tuple[int, int] = SIZE, quality: int = QUALITY) -> list[bytes]:
    """``variants`` textured JPEGs of ``size`` (deterministic)."""
    from datacache.devtools.synth import synth_image

    out = []
    for v in range(variants):
        rng = np.random.default_rng((7, v))
        img = synth_image(rng, size, rng.integers(-40, 40, size=3))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def with_comment(jpeg: bytes, payload: bytes) -> bytes:
    """``jpeg`` with a COM segment (FF FE, big-endian length) holding ``payload`` right after SOI."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no SOI marker)")
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def _write_class(job: tuple[str, int, int, int, int, int]) -> int:
    """Write one class folder (runs in a pool worker); returns the number of files written."""
    tmp, c, first, count, seed, corrupt_every = job
    name = f"n{c:08d}"
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng((seed, c))
    nonces = rng.integers(0, 2**63, size=count, dtype=np.int64)
    for j in range(count):
        g = first + j
        if is_corrupt(g, corrupt_every):
            data = b"NOT A JPEG " + rng.bytes(1000)
        else:
            data = with_comment(_BASE[g % len(_BASE)], struct.pack(">qq", g, int(nonces[j])))
        with open(os.path.join(d, f"{name}_{j}.JPEG"), "wb") as f:
            f.write(data)
    return count


def _init_pool(base: list[bytes]) -> None:
    # Process-pool boundary: each worker gets the pre-encoded variants once (initializer), then
    # only small job tuples cross the pipe.
    global _BASE
    _BASE = base


def dataset_root(n: int, base_dir: str | None = None, classes: int = IMAGENET_CLASSES,
                 corrupt_every: int = CORRUPT_EVERY) -> str:
    w, h = SIZE
    return os.path.join(base_dir or default_dir(), f"imagefolder-{classes}c-{n}-{w}x{h}-bad{corrupt_every}")


def ensure_scale_dataset(n: int, base_dir: str | None = None, *, classes: int = IMAGENET_CLASSES,
                         corrupt_every: int = CORRUPT_EVERY, workers: int | None = None, seed: int = 0,
                         progress: bool = True) -> str:
    """The root of the ``n``-file tree, generated once (see the module docstring); safe to call from
    several processes at once."""
    per_class_counts(n, classes)  # bad sizes: a ValueError before anything is created
    root = dataset_root(n, base_dir, classes, corrupt_every)
    marker = root + ".complete"
    if os.path.exists(marker):
        return root
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with open(root + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second generator waits here, then finds the marker
        if os.path.exists(marker):
            return root
        for stale in glob.glob(glob.escape(root) + ".tmp-*"):  # left by a killed generator (ours)
            shutil.rmtree(stale, ignore_errors=True)
        if not os.path.isdir(root):  # a root without its marker was renamed complete: only write the marker
            _build(root, n, classes, corrupt_every, workers, seed, progress)
        tmp_marker = marker + f".tmp-{os.getpid()}"
        with open(tmp_marker, "w") as f:
            f.write(f"{n} files, {classes} classes, {SIZE[0]}x{SIZE[1]}, corrupt every {corrupt_every}\n")
        os.replace(tmp_marker, marker)
    return root


def _build(root: str, n: int, classes: int, corrupt_every: int, workers: int | None, seed: int,
           progress: bool) -> None:
    tmp = root + f".tmp-{os.getpid()}"
    os.makedirs(tmp)
    counts = per_class_counts(n, classes)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    jobs = [(tmp, c, int(firsts[c]), counts[c], seed, corrupt_every) for c in range(len(counts))]
    base = base_jpegs()
    t = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    if progress:
        print(f"generating {n:,} JPEGs ({SIZE[0]}x{SIZE[1]}, {len(counts)} classes, 1 in {corrupt_every} "
              f"corrupt) in {root} with {workers} processes")
    done = 0
    if workers == 1:
        _init_pool(base)
        for job in jobs:
            done += _write_class(job)
    else:
        # fork: the workers only run this module's pure-Python writer (no threads, sockets or torch state)
        with mp.get_context("fork").Pool(workers, initializer=_init_pool, initargs=(base,)) as pool:
            for k, got in enumerate(pool.imap_unordered(_write_class, jobs, chunksize=4)):
                done += got
                if progress and (k + 1) % max(1, len(jobs) // 10) == 0:
                    print(f"  {done:,}/{n:,} files ({time.perf_counter() - t:.0f} s)", flush=True)
    if done != n:
        raise RuntimeError(f"generator wrote {done} files instead of {n} into {tmp}")
    os.rename(tmp, root)  # atomic: the tree appears complete or not at all
    if progress:
        print(f"generated {n:,} files in {time.perf_counter() - t:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="generate the scale rehearsal's synthetic ImageFolder")
    ap.add_argument("n", type=int, help=f"number of files (ImageNet: {IMAGENET_FILES:,})")
    ap.add_argument("--dir", default=None, help=f"parent directory (default {default_dir()})")
    ap.add_argument("--classes", type=int, default=IMAGENET_CLASSES)
    ap.add_argument("--corrupt-every", type=int, default=CORRUPT_EVERY, help="1 corrupt file in N (0: none)")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        root = ensure_scale_dataset(args.n, args.dir, classes=args.classes, corrupt_every=args.corrupt_every,
                                    workers=args.workers)
    except ValueError as e:
        ap.error(str(e))
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
