"""Fill a cache ahead of training: ``datacache warm`` and the daemon's ingest share :func:`fill_missing`.

1. The caller picks the indices (all of them for ``warm``; the daemon's own share for a daemon) and
   :meth:`ReadThrough.missing` drops what is cached already or remembered as undecodable: filling
   is **resumable**, an interrupted run continues where it stopped.
2. A process pool (sized to the cores) reads (through T1) + decodes + encodes chunks of samples.
   At most ``inflight`` chunks are queued at once (**backpressure**: a slow store or a slow
   source never piles up decoded samples in memory).
3. The parent writes each finished chunk with one batched ``put_many`` (``SET NX``: a concurrent
   job writing the same samples is harmless; a write is acknowledged only once the store took it),
   remembers undecodable files, and reports progress (a tqdm bar on a terminal, a callback).
4. ``stop`` (a ``threading.Event``, set by the daemon's SIGTERM handler) stops submitting new
   chunks; the chunks in flight are finished and written (**drain**), then it returns.

Process-pool boundary: the pool is started before the parent opens the store, so no LMDB
environment or Redis connection is inherited by a forked worker; workers never touch the store.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from datacache.cacheurl import parse_cache_url
from datacache.config import Variant, default_cache_url
from datacache.fill import Decoder, fill_one
from datacache.manifest import Manifest
from datacache.readthrough import ReadThrough, manifest_dir_for

log = logging.getLogger("datacache.warm")

CHUNK = 16  # samples per pool task: amortises IPC, keeps the progress bar moving


@dataclass
class WarmReport:
    """Outcome of :func:`fill_missing` / :func:`warm_cache`."""

    total: int = 0
    skipped: int = 0           # already cached (or known bad) before this run
    decoded: int = 0
    written: int = 0
    quarantined: dict[str, str] = field(default_factory=dict)  # relpath -> reason (this run)
    bytes_read: int = 0
    write_errors: int = 0      # samples the store could not write (read-only cache, full disk, OOM)
    stopped: bool = False      # stop was set: the rest was left for the next run
    seconds: float = 0.0


# ---------------------------------------------------------------- pool workers
# Process-pool boundary: these globals live in each pool process. The reader's Source (an fsspec
# filesystem) is opened here, in the worker; the worker never opens the store.
_W: dict[str, Any] = {}


def _init_worker(reader: ReadThrough, decoder: Decoder | None) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent drains; a worker just dies with the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _W["reader"] = reader
    _W["decoder"] = decoder


Result = tuple[int, bytes | None, str, bool]  # (index, record or None, error reason, remember the failure)


def _decode_chunk(indices: Sequence[int]) -> tuple[list[Result], int]:
    """Read + decode + encode a chunk; returns ([(index, record, reason, remember)], bytes read)."""
    reader: ReadThrough = _W["reader"]
    man = reader.manifest
    src = reader.source  # opens the source in this worker (never the store: see the module docstring)
    before = int(src.stats().get("bytes_read", 0))
    datas = src.read_many([man.paths[i] for i in indices], sizes=[int(man.sizes[i]) for i in indices],
                          identities=[man.identity(i) for i in indices])
    decoder = _W["decoder"]
    if hasattr(decoder, "prepare"):  # a batch backend (DALI) decodes the whole chunk at once
        decoder.prepare(datas, reader.variant)
    kw = {"decoder": decoder} if decoder is not None else {}
    out: list[Result] = []
    for i, data in zip(indices, datas):
        got = fill_one(data, rel=man.paths[i], size=int(man.sizes[i]), label=int(man.labels[i]),
                       key=reader.key(i), variant=reader.variant, **kw)
        out.append((i, got.record, got.reason, got.remember))
    return out, int(src.stats().get("bytes_read", 0)) - before


def fill_missing(reader: ReadThrough, indices: Sequence[int], *, workers: int | None = None,
                 decoder: Decoder | None = None, progress: bool = True, stop: threading.Event | None = None,
                 on_chunk: Callable[[WarmReport], None] | None = None, inflight: int | None = None,
                 store: Any = None, desc: str = "warming") -> WarmReport:
    """Decode and write every sample of ``indices`` that the cache does not hold (module docstring).
    ``store`` overrides where records are written (the daemon writes to its Redis tier directly)."""
    from tqdm import tqdm

    t0 = time.monotonic()
    rep = WarmReport(total=len(indices))
    workers = max(1, int(workers or os.cpu_count() or 1))
    inflight = inflight or 4 * workers
    # Process-pool boundary: start the pool *before* the parent opens the store (see the docstring).
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(reader, decoder))
    try:
        store = store if store is not None else reader.store
        todo = missing_in(reader, store, indices)
        rep.skipped = len(indices) - len(todo)
        log.info("fill %s -> %s: %d samples, %d already cached, %d to decode with %d processes",
                 reader.manifest.root, store.url, rep.total, rep.skipped, len(todo), workers)
        errors_before = store.counters().get("write_errors", 0)
        done: queue.Queue = queue.Queue()
        chunks = [todo[s:s + CHUNK] for s in range(0, len(todo), CHUNK)]
        submitted = finished = 0
        with tqdm(total=len(todo), desc=desc, unit="img", disable=not progress) as bar:
            def stopping() -> bool:
                return stop is not None and stop.is_set()

            while finished < submitted or (submitted < len(chunks) and not stopping()):
                while submitted < len(chunks) and submitted - finished < inflight and not stopping():
                    pool.apply_async(_decode_chunk, (chunks[submitted],), callback=done.put,
                                     error_callback=done.put)
                    submitted += 1
                got = done.get()
                finished += 1
                if isinstance(got, BaseException):
                    raise got
                _write_chunk(reader, store, got, rep)
                bar.update(len(got[0]))
                if on_chunk is not None:
                    on_chunk(rep)
        rep.stopped = submitted < len(chunks)
        rep.write_errors = store.counters().get("write_errors", 0) - errors_before
    finally:
        pool.terminate()
        pool.join()
    rep.seconds = time.monotonic() - t0
    return rep


def missing_in(reader: ReadThrough, store: Any, indices: Sequence[int], step: int = 4096) -> list[int]:
    """Those of ``indices`` that ``store`` holds neither as a sample nor as a remembered bad file
    (asked in chunks of ``step`` keys)."""
    out: list[int] = []
    for s in range(0, len(indices), step):
        part = list(indices[s:s + step])
        have = store.contains(reader.keys(part))
        todo = [i for i, h in zip(part, have) if not h]
        bad = store.contains([reader.qkey(i) for i in todo]) if todo else []
        out.extend(i for i, b in zip(todo, bad) if not b)
    return out


def _write_chunk(reader: ReadThrough, store: Any, got: tuple[list[Result], int], rep: WarmReport) -> None:
    results, nbytes = got
    man = reader.manifest
    rep.bytes_read += nbytes
    good = [(reader.key(i), rec) for i, rec, _, _ in results if rec is not None]
    bad_items = []
    for i, rec, reason, remember in results:
        if rec is None:
            rep.quarantined[man.paths[i]] = reason
            log.warning("quarantined %s (%s)", man.paths[i], reason)
            if remember:  # transient failures (read errors, short reads) are not remembered
                bad_items.append(reader.remember_bad(i, reason))
    rep.decoded += len(good)
    rep.written += store.put_many(good)
    store.put_many(bad_items)


def warm_cache(source: str, cache: str | None = None, *, workers: int = 2, short_side: int = 160,
               variant: Variant | None = None, revalidate: str = "dirs", t1_dir: str | None = "default",
               t1_max_bytes: int | None = None, storage_options: dict | None = None,
               progress: bool = True) -> WarmReport:
    """Decode every sample of ``source`` that ``cache`` does not hold yet and write it there."""
    variant = variant or Variant(short_side=short_side)
    spec = parse_cache_url(cache or default_cache_url(), check=True)
    man = Manifest.build(source, storage_options=storage_options, persist_dir=manifest_dir_for(spec),
                         revalidate=revalidate)
    reader = ReadThrough(man, variant, spec, t1_dir=t1_dir, t1_max_bytes=t1_max_bytes,
                         storage_options=storage_options)
    rep = fill_missing(reader, range(len(man)), workers=workers, progress=progress)
    flush = getattr(reader.store, "flush", None)
    if flush is not None:
        flush()
    return rep
