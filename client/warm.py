"""Fill a cache ahead of training (``datacache warm``): resumable, decodes in a process pool.

1. List the source (the manifest is persisted next to the cache, like CachedImageNet does).
2. Ask the store which keys exist (``contains`` in chunks) and skip them: warming is
   resumable, an interrupted run continues where it stopped. Files remembered as undecodable
   (records keyed by the file's identity, written by CachedImageNet or an earlier warm) are
   skipped too; transient failures (read errors, short reads) are reported, not remembered.
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

from client.fill import fill_one
from client.storeio import manifest_dir_for, quarantine_key, quarantine_value, shared_store
from datacache.cacheurl import parse_cache_url
from datacache.config import Variant, default_cache_url
from datacache.keys import sample_key
from datacache.manifest import Manifest
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
    write_errors: int = 0      # batches the store could not write (read-only cache, full disk): not cached


# ---------------------------------------------------------------- pool workers
# Process-pool boundary: these globals live in each pool process. The Source (an fsspec
# filesystem) is created here, in the worker, never inherited from the parent; the worker
# never touches the store (only the parent writes), so no LMDB handle crosses the fork.
_W: dict[str, Any] = {}


def _init_worker(root: str, t1_dir: str | None, t1_max_bytes: int | None, storage_options: dict | None,
                 variant: Variant) -> None:
    _W["source"] = Source(root, t1_dir=t1_dir, t1_max_bytes=t1_max_bytes, storage_options=storage_options)
    _W["variant"] = variant


Item = tuple[int, str, int, int, str, bytes]  # (index, relpath, label, size, identity, key)
Result = tuple[int, bytes | None, str, bool]  # (index, record or None, error reason, remember the failure)


def _decode_chunk(items: Sequence[Item]) -> tuple[list[Result], int]:
    """Read + decode + encode a chunk; returns ([(index, record, reason, remember)], bytes read)."""
    src: Source = _W["source"]
    before = int(src.stats().get("bytes_read", 0))
    datas = src.read_many([it[1] for it in items], sizes=[it[3] for it in items],
                          identities=[it[4] for it in items])
    out: list[Result] = []
    for (i, rel, label, size, _, key), data in zip(items, datas):
        got = fill_one(data, rel=rel, size=size, label=label, key=key, variant=_W["variant"])
        out.append((i, got.record, got.reason, got.remember))
    return out, int(src.stats().get("bytes_read", 0)) - before


def _chunks(items: list[Item], n: int) -> Iterator[list[Item]]:
    for s in range(0, len(items), n):
        yield items[s:s + n]


def warm_cache(source: str, cache: str | None = None, *, workers: int = 2, short_side: int = 160,
               variant: Variant | None = None, revalidate: str = "dirs", t1_dir: str | None = "default",
               t1_max_bytes: int | None = None, storage_options: dict | None = None,
               progress: bool = True) -> WarmReport:
    """Decode every sample of ``source`` that ``cache`` does not hold yet and write it there."""
    from tqdm import tqdm

    variant = variant or Variant(short_side=short_side)
    spec = parse_cache_url(cache or default_cache_url(), check=True).store
    man = Manifest.build(source, storage_options=storage_options, persist_dir=manifest_dir_for(spec),
                         revalidate=revalidate)
    tag = variant.tag()
    rep = WarmReport(total=len(man))
    # Process-pool boundary: start the pool *before* the parent opens the LMDB environment so no
    # open environment is inherited by a forked worker (the workers never use the store).
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    workers = max(1, int(workers))
    pool = ctx.Pool(workers, initializer=_init_worker,
                    initargs=(man.root, t1_dir, t1_max_bytes, storage_options, variant))
    try:
        store = shared_store(spec)  # one handle per process and cache (LMDB rule)
        todo: list[Item] = []
        step = 4096
        for s in range(0, len(man), step):
            idx = range(s, min(len(man), s + step))
            keys = [sample_key(man.fingerprint, tag, i) for i in idx]
            have = store.contains(keys)
            bad = store.contains([quarantine_key(tag, man.paths[i], man.identity(i)) for i in idx])
            for i, key, h, b in zip(idx, keys, have, bad):
                if h or b:
                    rep.skipped += 1
                else:
                    todo.append((i, man.paths[i], int(man.labels[i]), int(man.sizes[i]), man.identity(i),
                                 key))
        log.info("warm %s -> %s: %d samples, %d already cached, %d to decode with %d processes",
                 man.root, spec.url, rep.total, rep.skipped, len(todo), workers)
        errors_before = store.counters().get("write_errors", 0)
        with tqdm(total=len(todo), desc="warming", unit="img", disable=not progress) as bar:
            for results, nbytes in pool.imap_unordered(_decode_chunk, _chunks(todo, _CHUNK)):
                rep.bytes_read += nbytes
                good = [(sample_key(man.fingerprint, tag, i), rec)
                        for i, rec, _, _ in results if rec is not None]
                bad_items = []
                for i, rec, reason, remember in results:
                    if rec is None:
                        rep.quarantined[man.paths[i]] = reason
                        log.warning("quarantined %s (%s)", man.paths[i], reason)
                        if remember:  # transient failures (read errors, short reads) are not remembered
                            bad_items.append((quarantine_key(tag, man.paths[i], man.identity(i)),
                                              quarantine_value(man.paths[i], man.identity(i), reason)))
                rep.decoded += len(good)
                rep.written += store.put_many(good)
                store.put_many(bad_items)
                bar.update(len(results))
        rep.write_errors = store.counters().get("write_errors", 0) - errors_before
    finally:
        pool.terminate()
        pool.join()
    return rep
