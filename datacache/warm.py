"""Fill a cache ahead of training: ``datacache warm`` and the daemon's ingest share :func:`fill_missing`.

1. The caller picks the indices (all of them for ``warm``; the daemon's own share for a daemon) and
   :meth:`ReadThrough.missing` drops what is cached already or remembered as undecodable: filling
   is **resumable**, an interrupted run continues where it stopped.
2. A reader thread of the parent reads chunks of files (through T1; ``Source.read_many`` overlaps
   the requests of a chunk), so the node's link to the source is one process's, and a process
   pool (sized to the cores) decodes + encodes them while the next chunks are being read. At most
   ``inflight`` chunks are read, decoding or waiting to be written at once (**backpressure**: a
   slow store or a slow source never piles up samples in memory).
3. Each finished chunk is written with one batched ``put_many`` (``SET NX``: a concurrent job
   writing the same samples is harmless; a write is acknowledged only once the store took it) --
   by the pool worker itself for a remote store (Redis: its own connection, so ~100 KB records do
   not travel through the parent), by the parent for a local one (LMDB: one writer process); the
   parent remembers undecodable files and reports progress (a tqdm bar on a terminal, a callback).
4. ``stop`` (a ``threading.Event``, set by the daemon's SIGTERM handler) stops submitting new
   chunks; the chunks in flight are finished and written (**drain**), then it returns.

Process-pool boundary: the pool is started before the parent opens the store or the source, so no
LMDB environment, Redis connection or reader thread is inherited by a forked worker; workers only
decode bytes they are sent and never touch the store.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from datacache.cacheurl import parse_cache_url
from datacache.config import Variant, default_cache_url
from datacache.fill import Decoder
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
    worker_write_errors: int = 0  # of write_errors: failed writes of pool workers (remote stores)
    seconds: float = 0.0


# ---------------------------------------------------------------- pool workers
# Process-pool boundary: these globals live in each pool process. The reader's Source (an fsspec
# filesystem) is opened here, in the worker; the worker never opens the store.
_W: dict[str, Any] = {}


def _init_worker(reader: ReadThrough, decoder: Decoder | None, store: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent drains; a worker just dies with the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Fork boundary: a parent that ran torch ops has a live OpenMP pool that the child inherited
        # without its threads; the next parallel region in the child (decode's torch shrink) would hang.
        # One intra-op thread per worker (what DataLoader workers do) never enters that pool.
        torch.set_num_threads(1)
    _W["reader"] = reader
    _W["decoder"] = decoder
    _W["store"] = store  # a remote store the worker writes to itself (its own connection), or None


Result = tuple[int, bytes | None, str, bool]  # (index, record or None, error reason, remember the failure)


Chunk = tuple[list[Result], int | None, int]  # results, written by the worker, write errors


def _decode_chunk(indices: Sequence[int], datas: list[Any]) -> Chunk:
    """Decode + encode a chunk (in a pool worker) and, for a remote store, write it; the records of
    written samples come back as ``b""`` (decoded, written here)."""
    reader: ReadThrough = _W["reader"]
    decoder = _W["decoder"]
    if hasattr(decoder, "prepare"):  # a batch backend (DALI) decodes the whole chunk at once
        decoder.prepare(datas, reader.variant)
    out: list[Result] = [(i, got.record, got.reason, got.remember)
                         for i, got in zip(indices, reader.fill_many(indices, datas, decoder=decoder))]
    store = _W["store"]
    if store is None:
        return out, None, 0
    errors = store.counters().get("write_errors", 0)
    written = store.put_many([(reader.key(i), rec) for i, rec, _, _ in out if rec is not None])
    errors = store.counters().get("write_errors", 0) - errors
    return [(i, b"" if rec is not None else None, r, m) for i, rec, r, m in out], written, errors


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
    remote = store if getattr(store, "remote", False) else None  # workers write to Redis themselves
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(reader, decoder, remote))
    try:
        store = store if store is not None else reader.store
        todo = missing_in(reader, store, indices)
        rep.skipped = len(indices) - len(todo)
        log.info("fill %s -> %s: %d samples, %d already cached, %d to decode with %d processes",
                 reader.manifest.root, store.url, rep.total, rep.skipped, len(todo), workers)
        errors_before = store.counters().get("write_errors", 0)
        # Bytes read: the Source's counter over the whole fill. The reader threads share the Source, so
        # a per-chunk before/after of the counter would also count the other thread's reads.
        bytes_before = _bytes_read(reader)
        done: queue.Queue = queue.Queue()
        chunks = [todo[s:s + CHUNK] for s in range(0, len(todo), CHUNK)]
        feeder = _Feeder(reader, pool, chunks, done, inflight, stop)
        finished = 0
        with tqdm(total=len(todo), desc=desc, unit="img", disable=not progress) as bar:
            while not (feeder.finished and finished == feeder.submitted):
                got = done.get()
                if got is _FEED_DONE:
                    continue
                if isinstance(got, BaseException):
                    raise got
                finished += 1
                _write_chunk(reader, store, got, rep)
                rep.bytes_read = _bytes_read(reader) - bytes_before
                feeder.slots.release()  # written: the feeder may read one more chunk
                bar.update(len(got[0]))
                if on_chunk is not None:
                    on_chunk(rep)
        rep.stopped = feeder.submitted < len(chunks)
        rep.bytes_read = _bytes_read(reader) - bytes_before
        rep.write_errors = store.counters().get("write_errors", 0) - errors_before + rep.worker_write_errors
    finally:
        pool.terminate()
        pool.join()
    rep.seconds = time.monotonic() - t0
    return rep


def _bytes_read(reader: ReadThrough) -> int:
    return int(reader.source.stats().get("bytes_read", 0))


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


_FEED_DONE = object()


class _Feeder:
    """Parent threads (``READERS``): read chunks (at most ``inflight`` not yet written) and hand the bytes
    to the decode pool; the pool's results (and finally ``_FEED_DONE``) go to ``done``. Two chunks are
    read at once, so one chunk's request latency overlaps the other's transfer and the link to the
    source stays busy. Stops submitting when ``stop`` is set (drain: what was submitted is still
    decoded and written)."""

    READERS = 2

    def __init__(self, reader: ReadThrough, pool: Any, chunks: list[list[int]], done: queue.Queue,
                 inflight: int, stop: Any) -> None:
        self.reader, self.pool, self.done, self.stop = reader, pool, done, stop
        self.chunks = iter(chunks)
        self.slots = threading.Semaphore(inflight)
        self.lock = threading.Lock()
        self.submitted = 0
        self.running = self.READERS
        self.finished = False
        reader.source  # noqa: B018  (open the source once, before the threads share it)
        for n in range(self.READERS):
            threading.Thread(target=self._run, name=f"datacache-fill-reader-{n}", daemon=True).start()

    def _stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _next(self) -> list[int] | None:
        while not self.slots.acquire(timeout=0.2):  # backpressure; wakes up to notice a stop
            if self._stopping():
                return None
        with self.lock:
            chunk = None if self._stopping() else next(self.chunks, None)
        if chunk is None:
            self.slots.release()
        return chunk

    def _run(self) -> None:
        try:
            while (chunk := self._next()) is not None:
                datas = self.reader.read_files(chunk)
                with self.lock:
                    self.pool.apply_async(_decode_chunk, (chunk, datas), callback=self.done.put,
                                          error_callback=self.done.put)
                    self.submitted += 1
        except BaseException as e:  # a reader failure ends the fill with that error (in the caller)
            self.done.put(e)
        finally:
            with self.lock:
                self.running -= 1
                last = self.running == 0
                self.finished = last
            if last:
                self.done.put(_FEED_DONE)


def _write_chunk(reader: ReadThrough, store: Any, got: Chunk, rep: WarmReport) -> None:
    results, written, worker_errors = got
    man = reader.manifest
    good = [(reader.key(i), rec) for i, rec, _, _ in results if rec is not None]
    bad_items = []
    for i, rec, reason, remember in results:
        if rec is None:
            rep.quarantined[man.paths[i]] = reason
            log.warning("quarantined %s (%s)", man.paths[i], reason)
            if remember:  # transient failures (read errors, short reads) are not remembered
                bad_items.append(reader.remember_bad(i, reason))
    rep.decoded += len(good)
    if written is None:
        rep.written += store.put_many(good)
    else:
        rep.written += written
        rep.worker_write_errors += worker_errors
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
    # a lone remote tier is written directly (synchronous, acknowledged writes from the pool workers)
    lone = spec.tiers[0].open() if len(spec.tiers) == 1 else None
    direct = lone if getattr(lone, "remote", False) else None
    rep = fill_missing(reader, range(len(man)), workers=workers, progress=progress, store=direct)
    flush = getattr(reader.store, "flush", None)
    if flush is not None:
        flush()
    return rep
