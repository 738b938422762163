"""Fill a cache ahead of training (``datacache warm``): resumable, decodes in a process pool.

1. List the source (the manifest is persisted next to the cache, like CachedImageNet does).
2. Ask the store which keys exist (``contains`` in chunks) and skip them: warming is
   resumable, an interrupted run continues where it stopped. Files remembered as undecodable
   (``dcq`` records written by CachedImageNet or an earlier warm) are skipped too.
3. A ``multiprocessing`` pool reads + decodes + encodes records; the parent writes them with
   ``put_many`` (one transaction per chunk; ``SET NX`` so a concurrent job writing the same
   samples is harmless) and shows a progress bar.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from client.storeio import (
    QUARANTINE_PREFIX,
    manifest_dir_for,
    quarantine_value,
    read_failure_reason,
    shared_store,
)
from datacache.config import Variant, default_cache_url
from datacache.decode import DecodeError, decode_image
from datacache.keys import sample_key
from datacache.manifest import Manifest
from datacache.record import encode_record
from datacache.source import Source

log = logging.getLogger("client.warm")

_CHUNK = 16  # samples per pool task: amortises IPC, keeps the progress bar moving


@dataclass
class WarmReport:
    """Outcome of :func:`warm_cache`."""

    total: int = 0
    skipped: int = 0           # already cached (or known bad) before this run
    decoded: int = 0
    written: int = 0
    quarantined: dict[str, str] = field(default_factory=dict)  # relpath -> reason (this run)
    bytes_read: int = 0


# ---------------------------------------------------------------- pool workers
# Process-pool boundary: these globals live in each pool process. The Source (an fsspec
# filesystem) is created here, in the worker, never inherited from the parent; the worker
# never touches the store (only the parent writes), so no LMDB handle crosses the fork.
_W: dict[str, Any] = {}


def _init_worker(root: str, t1_dir: str | None, storage_options: dict | None, variant: Variant) -> None:
    _W["source"] = Source(root, t1_dir=t1_dir, storage_options=storage_options)
    _W["variant"] = variant


Item = tuple[int, str, int, int]  # (index, relpath, label, size)


def _decode_chunk(items: Sequence[Item]) -> tuple[list[tuple[int, bytes | None, str]], int]:
    """Read + decode + encode a chunk; returns ([(index, record or None, error reason)], bytes read)."""
    src: Source = _W["source"]
    variant: Variant = _W["variant"]
    before = int(src.stats().get("bytes_read", 0))
    datas = src.read_many([rel for _, rel, _, _ in items], expect_sizes=[size for *_, size in items])
    out: list[tuple[int, bytes | None, str]] = []
    for (i, rel, label, _), data in zip(items, datas):
        if isinstance(data, BaseException):
            out.append((i, None, read_failure_reason(data)))
            continue
        try:
            pixels = decode_image(data, variant, name=rel)
        except DecodeError as e:
            out.append((i, None, f"cannot decode: {e.reason}"))
            continue
        out.append((i, encode_record(pixels, label, variant), ""))
    return out, int(src.stats().get("bytes_read", 0)) - before


def _chunks(items: list[Item], n: int) -> Iterator[list[Item]]:
    for s in range(0, len(items), n):
        yield items[s:s + n]


def warm_cache(source: str, cache: str | None = None, *, workers: int = 2, short_side: int = 160,
               variant: Variant | None = None, t1_dir: str | None = "default",
               storage_options: dict | None = None, progress: bool = True) -> WarmReport:
    """Decode every sample of ``source`` that ``cache`` does not hold yet and write it there."""
    from tqdm import tqdm

    variant = variant or Variant(short_side=short_side)
    cache = cache or default_cache_url()
    man = Manifest.build(source, storage_options=storage_options, persist_dir=manifest_dir_for(cache))
    tag = variant.tag()
    rep = WarmReport(total=len(man))
    # Process-pool boundary: start the pool *before* the parent opens the LMDB environment so no
    # open environment is inherited by a forked worker (the workers never use the store).
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    workers = max(1, int(workers))
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(man.root, t1_dir, storage_options, variant))
    try:
        store = shared_store(cache)  # one handle per process and cache (LMDB rule)
        todo: list[Item] = []
        step = 4096
        for s in range(0, len(man), step):
            idx = range(s, min(len(man), s + step))
            have = store.contains([sample_key(man.fingerprint, tag, i) for i in idx])
            bad = store.contains([sample_key(man.fingerprint, tag, i, prefix=QUARANTINE_PREFIX) for i in idx])
            for i, h, b in zip(idx, have, bad):
                if h or b:
                    rep.skipped += 1
                else:
                    todo.append((i, man.paths[i], man.targets[i], man.sizes[i]))
        log.info("warm %s -> %s: %d samples, %d already cached, %d to decode with %d processes",
                 man.root, cache, rep.total, rep.skipped, len(todo), workers)
        with tqdm(total=len(todo), desc="warming", unit="img", disable=not progress) as bar:
            for results, nbytes in pool.imap_unordered(_decode_chunk, _chunks(todo, _CHUNK)):
                rep.bytes_read += nbytes
                good = [(sample_key(man.fingerprint, tag, i), rec)
                        for i, rec, _ in results if rec is not None]
                bad_items = []
                for i, rec, reason in results:
                    if rec is None:
                        rep.quarantined[man.paths[i]] = reason
                        log.warning("quarantined %s (%s)", man.paths[i], reason)
                        if reason.startswith("cannot decode"):  # read errors may be transient: not remembered
                            bad_items.append((sample_key(man.fingerprint, tag, i, prefix=QUARANTINE_PREFIX),
                                              quarantine_value(man.paths[i], reason)))
                rep.decoded += len(good)
                rep.written += store.put_many(good)
                store.put_many(bad_items)
                bar.update(len(results))
    finally:
        pool.terminate()
        pool.join()
    return rep
