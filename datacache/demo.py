"""``datacache demo``: cold -> warm epochs through a plain DataLoader, with numbers.

With no arguments it generates a small ImageNet-like ImageFolder (synthetic textured JPEGs
at 500x375 q90 plus the real photos installed packages ship; generated once and reused,
under the user cache dir), clears its own LMDB cache, and runs ``--epochs`` epochs of
``CachedImageNet`` + ``AugmentCollate`` (random-resized-crop + flip to ``--image-size``,
uint8 batches) through ``torch.utils.data.DataLoader``. Epoch 1 reads and decodes every JPEG
and writes the cache; later epochs are served from the cache. Per epoch it prints
samples/s, the hit ratio of each tier, how many images were decoded, and the speed-up of
the warm epochs over the first -- only when the first epoch really was cold: against a cache
that was filled before the run (the cluster's daemons, ``--keep-cache``, another demo running on
the same cache) it says how warm epoch 1 already was and shows no speed-up.

Concurrent demos on one machine are safe: the generated dataset is published atomically
(:func:`datacache.devtools.synth.publish_dir`), and the demo's own LMDB cache is cleared only under an
exclusive ``flock`` that no other running demo holds (each holds a shared one while it runs).

This module imports the client package lazily (inside functions): the core must not import
upward at import time.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from datacache.config import user_cache_dir

log = logging.getLogger("datacache.demo")


@dataclass
class DemoConfig:
    """Options of ``datacache demo`` (see ``datacache demo --help``)."""

    source: str | None = None         # None -> generated dataset
    cache: str | None = None          # None -> the demo's own LMDB dir (cleared unless keep_cache)
    epochs: int = 3
    batch_size: int = 64
    workers: int = 2
    image_size: int = 128
    short_side: int = 160
    keep_cache: bool = False
    images: int = 1000                # size of the generated dataset (classes x per_class)
    classes: int = 10
    gen_size: tuple[int, int] = (500, 375)
    start_method: str | None = None   # DataLoader multiprocessing context (None: platform default)
    progress: bool = True
    seed: int = 0
    revalidate: str = "dirs"          # how a saved listing is checked (see datacache.manifest)
    t1_dir: str | None = "default"    # raw-bytes disk cache for remote sources
    t1_max_bytes: int | None = None   # T1 size cap (LRU trim)
    record_key_file: str | None = None  # record key (None: $DATACACHE_RECORD_KEY_FILE if set)


@dataclass
class EpochResult:
    epoch: int
    seconds: float
    samples: int
    samples_per_s: float
    stats: dict[str, Any] = field(default_factory=dict)


def demo_root() -> str:
    return os.path.join(user_cache_dir(), "datacache", "demo")


def ensure_dataset(cfg: DemoConfig) -> str:
    """Generate the demo ImageFolder once and return its path.

    The tree is built in a temp directory and renamed into place
    (:func:`datacache.devtools.synth.ensure_imagefolder`), so its existence means it is complete: two
    demos started at once both build, one rename wins and both use the winner's tree; neither deletes
    anything but its own temp directory."""
    from datacache.devtools import synth

    per_class = max(1, cfg.images // cfg.classes)
    w, h = cfg.gen_size
    root = os.path.join(demo_root(), "datasets", f"imagefolder-{cfg.classes}x{per_class}-{w}x{h}")
    if os.path.isdir(root):
        log.info("reusing generated dataset %s", root)
        return root
    print(f"generating {cfg.classes * per_class} JPEGs ({w}x{h}, q90) + shipped photos under {root} (once)")
    if not synth.ensure_imagefolder(root, classes=cfg.classes, per_class=per_class, size=(w, h), quality=90,
                                    seed=cfg.seed, include_real_photos=True, progress=cfg.progress):
        print(f"another run published {root} first: using it")
    return root


# Epoch 1 counts as cold when at most this fraction of its reads hit the cache.
COLD_MAX_HIT = 0.01


def open_own_cache(keep_cache: bool) -> tuple[str, int]:
    """The demo's own LMDB directory, cleared unless ``keep_cache`` or another demo is using it, and an
    open lock file (a shared ``flock`` held until the caller closes it).

    Clearing takes the exclusive lock without waiting: if another running demo holds its shared lock,
    the cache is left alone (deleting an LMDB environment under a running reader breaks it)."""
    os.makedirs(demo_root(), exist_ok=True)
    cache_dir = os.path.join(demo_root(), "lmdb")
    # Process boundary: the DataLoader workers forked later inherit this descriptor and with it the
    # shared lock; it is released when the demo closes it and its workers have exited.
    fd = os.open(cache_dir + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    if not keep_cache:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"the demo cache {cache_dir} is in use by another running demo: not clearing it")
        else:
            if os.path.isdir(cache_dir):
                shutil.rmtree(cache_dir)
                log.info("cleared the demo cache %s (use --keep-cache to keep it)", cache_dir)
    fcntl.flock(fd, fcntl.LOCK_SH)  # converts the exclusive lock; waits while another demo clears
    return cache_dir, fd


def _worker_init(_: int) -> None:
    import torch

    # Worker-process boundary: the DataLoader workers are the parallelism (one per core);
    # torch's intra-op threads inside each would only oversubscribe the cores.
    torch.set_num_threads(1)


def run_demo(cfg: DemoConfig) -> list[EpochResult]:
    """Run the demo and return one :class:`EpochResult` per epoch (also printed)."""
    source = cfg.source or ensure_dataset(cfg)
    lock_fd = -1
    if cfg.cache:
        cache = cfg.cache
    else:
        cache_dir, lock_fd = open_own_cache(cfg.keep_cache)
        cache = "lmdb://" + cache_dir
    try:
        return _run(cfg, source, cache)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


def _run(cfg: DemoConfig, source: str, cache: str) -> list[EpochResult]:
    import torch
    from tqdm import tqdm

    from client.augment import AugmentCollate
    from client.dataset import CachedImageNet

    t = time.perf_counter()
    ds = CachedImageNet(source, cache=cache, short_side=cfg.short_side, revalidate=cfg.revalidate,
                        t1_dir=cfg.t1_dir, t1_max_bytes=cfg.t1_max_bytes, record_key_file=cfg.record_key_file)
    print(f"dataset: {len(ds)} images, {len(ds.classes)} classes from {ds.root} "
          f"(listed in {time.perf_counter() - t:.2f} s)")
    print(f"cache:   {cache}  variant {ds.variant.tag()}  decoder {ds.stats()['decode_backend']}")
    print(f"loader:  DataLoader(batch_size={cfg.batch_size}, num_workers={cfg.workers}, shuffle=True), "
          f"random-resized-crop+flip to {cfg.image_size}px uint8 in the workers")
    gen = torch.Generator().manual_seed(cfg.seed)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
        collate_fn=AugmentCollate(cfg.image_size), generator=gen,
        persistent_workers=cfg.workers > 0, worker_init_fn=_worker_init if cfg.workers > 0 else None,
        multiprocessing_context=cfg.start_method if cfg.workers > 0 else None)
    results: list[EpochResult] = []
    for epoch in range(1, cfg.epochs + 1):
        ds.reset_stats()
        n = 0
        t = time.perf_counter()
        with tqdm(total=len(ds), desc=f"epoch {epoch}", unit="img", disable=not cfg.progress,
                  leave=False) as bar:
            for images, labels in loader:
                assert images.dtype == torch.uint8 and images.shape[1:] == (3, cfg.image_size, cfg.image_size)
                n += int(labels.numel())
                bar.update(int(labels.numel()))
        dt = time.perf_counter() - t
        st = ds.stats()
        res = EpochResult(epoch, dt, n, n / dt if dt > 0 else 0.0, st)
        results.append(res)
        t1 = st["t1"]["hit_ratio"]
        t1_text = "n/a (local source)" if t1 is None else f"{t1:.0%}"
        cold = results[0].stats["hit_ratio"] <= COLD_MAX_HIT
        speed = f" = {res.samples_per_s / results[0].samples_per_s:.1f}x epoch 1" if epoch > 1 and cold else \
            ""
        if epoch == 1 and cfg.workers > 0:
            speed = f" (incl. starting {cfg.workers} workers)"
        print(f"epoch {epoch}: {res.samples_per_s:8.0f} samples/s{speed} ({n} in {dt:.2f} s)  "
              f"T2 hit {st['hit_ratio']:.0%}  T1 hit {t1_text}  decoded {st['decoded']}  "
              f"source MB {st['bytes_read'] / 1e6:.1f}  quarantined {st['quarantined']}")
    del loader  # shuts the persistent workers down
    first_hit = results[0].stats["hit_ratio"] if results else 0.0
    if first_hit > COLD_MAX_HIT:
        print(f"epoch 1 was not cold: {first_hit:.0%} of its samples were already cached before this run "
              f"(filled by the cluster's daemons, a kept cache or another run), so there is no cold epoch "
              f"to compare with and no speed-up is shown")
    if len(results) > 1:
        warm = results[1:]
        warm_rate = sum(r.samples for r in warm) / sum(r.seconds for r in warm)
        if first_hit > COLD_MAX_HIT:
            print(f"warm epochs: {warm_rate:.0f} samples/s")
        else:
            print(f"warm epochs: {warm_rate:.0f} samples/s = {warm_rate / results[0].samples_per_s:.1f}x "
                  f"the first (cold) epoch")
    if ds.quarantined:
        print(f"quarantined files (substituted): {ds.quarantined}")
    return results
