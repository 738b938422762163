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

The pool (:class:`~datacache.decodepool.DecodePool`: signals, bounded shutdown, lost workers) is the
caller's when it passes one -- the daemon keeps one for its whole life, shared by every pass of every
dataset -- or the fill's own, forked before the parent opens the store or the source and closed at the
end (``datacache warm``). A fill with nothing to decode starts no process at all. Workers get what
they need with each task and never use anything they inherited (see ``_decode_chunk``).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datacache.cacheurl import StoreSpec, parse_cache_url
from datacache.config import Variant, default_cache_url
from datacache.decodepool import DecodePool
from datacache.fill import Decoder, fill_one
from datacache.manifest import Manifest
from datacache.quarantine_summary import QuarantineSummary
from datacache.readthrough import ReadThrough, manifest_dir_for
from datacache.record import RecordKey, resolve_record_key_file
from datacache.stores import open_store

log = logging.getLogger("datacache.warm")

CHUNK = 16  # samples per pool task: amortises IPC, keeps the progress bar moving
LOG_QUARANTINED = 20  # quarantined files logged one by one per fill; the rest in one summary line


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
    pillow_fallbacks: int = 0  # batch backend (DALI): plain JPEGs it refused, decoded by Pillow (by rule)
    decoder_unavailable: int = 0  # batch backend: samples left unfilled, its pipeline could not run
    seconds: float = 0.0


# ---------------------------------------------------------------- pool workers
# Process-pool boundary: these globals live in each pool process (the pool may outlive a fill: the
# daemon's serves every pass of every dataset). A task brings what it needs -- the samples' paths,
# sizes, labels and keys, and a small context (variant, decoder, where to write) -- and the worker keeps
# the context's live objects (a DALI pipeline, its own Redis connection) under the context's digest,
# so they are built once per worker, not once per task. The worker never uses the store it inherited.
_CTX: dict[bytes, tuple[Variant, Decoder | None, Any, RecordKey | None]] = {}
_CTX_MAX = 8  # contexts kept per worker (datasets x variants); the oldest is dropped (its store closed)

Item = tuple[int, str, int, int, bytes]  # (index, relpath, size, label, key)
# (variant, decoder or None, StoreSpec of a remote store or None, record key or None). The record key
# pickles as its file's path and key id (RecordKey.__reduce__): a worker reads the key file itself (once
# per process) and refuses a file that now holds another key, so every record a worker encodes is MAC'd
# with the fill's key and the key bytes never travel through the pool's pipes.
Context = tuple[Variant, Any, Any, Any]


def _context(digest: bytes, ctx: Context) -> tuple[Variant, Decoder | None, Any, RecordKey | None]:
    got = _CTX.get(digest)
    if got is None:
        variant, decoder, spec, record_key = ctx
        got = (variant, decoder, open_store(spec) if spec is not None else None, record_key)
        if len(_CTX) >= _CTX_MAX:
            old = _CTX.pop(next(iter(_CTX)))[2]
            if old is not None:
                old.close()
        _CTX[digest] = got
    return got


Result = tuple[int, bytes | None, str, bool]  # (index, record or None, error reason, remember the failure)


# results, written by the worker, write errors, the backend's counters (DaliDecoder.take_counts)
Chunk = tuple[list[Result], int | None, int, dict[str, int]]


def _decode_chunk(digest: bytes, ctx: Context, items: Sequence[Item], datas: list[Any]) -> Chunk:
    """Decode + encode a chunk (in a pool worker) and, for a remote store, write it; the records of
    written samples come back as ``b""`` (decoded, written here)."""
    variant, decoder, store, record_key = _context(digest, ctx)
    if hasattr(decoder, "prepare"):  # a batch backend (DALI) decodes the whole chunk at once
        decoder.prepare(datas, variant)
    out: list[Result] = []
    for (i, rel, size, label, key), data in zip(items, datas):
        got = fill_one(data, rel=rel, size=size, label=label, key=key, variant=variant, decoder=decoder,
                       record_key=record_key)
        out.append((i, got.record, got.reason, got.remember))
    counts = decoder.take_counts() if hasattr(decoder, "take_counts") else {}
    if store is None:
        return out, None, 0, counts
    errors = store.counters().get("write_errors", 0)
    keys = {i: key for i, _, _, _, key in items}
    written = store.put_many([(keys[i], rec) for i, rec, _, _ in out if rec is not None])
    errors = store.counters().get("write_errors", 0) - errors
    return [(i, b"" if rec is not None else None, r, m) for i, rec, r, m in out], written, errors, counts


def fill_missing(reader: ReadThrough, indices: Sequence[int], *, workers: int | None = None,
                 decoder: Decoder | None = None, progress: bool = True, stop: threading.Event | None = None,
                 on_chunk: Callable[[WarmReport], None] | None = None, inflight: int | None = None,
                 store: Any = None, store_spec: StoreSpec | None = None, pool: DecodePool | None = None,
                 desc: str = "warming", quiet: bool = False) -> WarmReport:
    """Decode and write every sample of ``indices`` that the cache does not hold (module docstring).

    ``store`` overrides where records are written (the daemon writes to its Redis tier directly); when it
    is remote and ``store_spec`` names it, the pool workers write to it over their own connections.
    ``pool``: a long-lived :class:`~datacache.decodepool.DecodePool` to use (the daemon's); without it
    the fill forks its own and closes it at the end. Nothing to decode = no process is created.
    ``quiet``: the start of the fill is logged at debug level (the rolling fill's steps).
    Raises :class:`~datacache.decodepool.WorkerLost` when a worker died mid-fill (its chunk is lost)."""
    from tqdm import tqdm

    t0 = time.monotonic()
    rep = WarmReport(total=len(indices))
    own = pool is None
    if own:
        # Process-pool boundary: a fill's own pool is forked *before* the parent opens the store (LMDB)
        # or the source, so the workers inherit neither (the daemon's long-lived pool: decodepool).
        pool = DecodePool(workers)
        pool.get()
    assert pool is not None
    workers = pool.workers
    inflight = inflight or 4 * workers
    halt = threading.Event()  # ends this fill's reader threads whatever happens to it
    try:
        store = store if store is not None else reader.store
        todo = missing_in(reader, store, indices)
        rep.skipped = len(indices) - len(todo)
        if len(todo) == 0:
            rep.seconds = time.monotonic() - t0
            return rep
        remote = store_spec if getattr(store, "remote", False) else None  # workers write to Redis themselves
        ctx: Context = (reader.variant, decoder, remote, reader.record_key)
        digest = hashlib.sha256(pickle.dumps(ctx)).digest()  # our own objects (never a cache value)
        # quiet: the rolling fill's many small steps log at debug level (the daemon logs the session)
        log.log(logging.DEBUG if quiet else logging.INFO,
                "fill %s -> %s: %d samples, %d already cached, %d to decode with %d processes",
                 reader.manifest.root, store.url, rep.total, rep.skipped, len(todo), workers)
        errors_before = store.counters().get("write_errors", 0)
        # Bytes read: the Source's counter over the whole fill. The reader threads share the Source, so
        # a per-chunk before/after of the counter would also count the other thread's reads.
        bytes_before = _bytes_read(reader)
        done: queue.Queue = queue.Queue()
        chunks = [todo[s:s + CHUNK] for s in range(0, len(todo), CHUNK)]
        feeder = _Feeder(reader, pool.get(), chunks, done, inflight, _AnyStop(stop, halt), digest, ctx)
        finished = 0
        with tqdm(total=len(todo), desc=desc, unit="img", disable=not progress) as bar:
            while not (feeder.finished and finished == feeder.submitted):
                try:
                    got = done.get(timeout=0.5)
                except queue.Empty:
                    pool.check()  # a dead worker took its chunk with it: fail instead of waiting forever
                    continue
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
        if len(rep.quarantined) > LOG_QUARANTINED:
            kinds = QuarantineSummary()
            kinds.add(rep.quarantined)
            log.warning("... and %d more files quarantined in this fill (%d in all; by reason: %s); the "
                        "daemon's GET /status and CachedImageNet.quarantined list them",
                        len(rep.quarantined) - LOG_QUARANTINED, len(rep.quarantined), kinds.by_reason)
        rep.bytes_read = _bytes_read(reader) - bytes_before
        rep.write_errors = store.counters().get("write_errors", 0) - errors_before + rep.worker_write_errors
    except BaseException:
        if own:
            pool.kill()  # interrupted or failed: nothing to drain
        raise
    finally:
        halt.set()
        if own:
            pool.close(timeout=30.0)  # after a normal end the workers are idle: they exit at once
    rep.seconds = time.monotonic() - t0
    return rep


class _AnyStop:
    """Set when either event is (the caller's stop, or the fill's own end)."""

    def __init__(self, *events: Any) -> None:
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def _bytes_read(reader: ReadThrough) -> int:
    return int(reader.source.stats().get("bytes_read", 0))


def missing_in(reader: ReadThrough, store: Any, indices: Sequence[int], step: int = 4096) -> np.ndarray:
    """Those of ``indices`` that ``store`` holds neither as a sample nor as a remembered bad file
    (asked in chunks of ``step`` keys), as an int64 array in the order given.

    An array, not a list: a list of a third of ImageNet's indices is 427k Python ints (~15 MB of small
    objects) alive through the whole fill; the few small objects that outlive the fill (e.g. the
    quarantine's entries) land among them and kept ~20 MB of a daemon's heap from going back to the OS
    (bench/results/NOTES.md#daemon-memory)."""
    out: list[np.ndarray] = []
    for s in range(0, len(indices), step):
        sl = indices[s:s + step]
        part = sl.tolist() if hasattr(sl, "tolist") else list(sl)  # numpy indices -> Python ints
        have = store.contains(reader.keys(part))
        todo = [i for i, h in zip(part, have) if not h]
        # quarantine entries are read and checked, not just tested for presence: an entry that is not
        # valid for this reader (forged, another record key, junk) must not stop the fill of a good file
        entries = store.get_many([reader.qkey(i) for i in todo]) if todo else []
        # and a writer trusts only entries of files it failed to decode itself (ReadThrough.trusted_bad)
        bad = [reader.trusted_bad(i, q) for i, q in zip(todo, entries)]
        out.append(np.fromiter((i for i, b in zip(todo, bad) if not b), dtype=np.int64))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


_FEED_DONE = object()


class _Feeder:
    """Parent threads (``READERS``): read chunks (at most ``inflight`` not yet written) and hand the bytes
    to the decode pool; the pool's results (and finally ``_FEED_DONE``) go to ``done``. Two chunks are
    read at once, so one chunk's request latency overlaps the other's transfer and the link to the
    source stays busy. Stops submitting when ``stop`` is set (drain: what was submitted is still
    decoded and written)."""

    READERS = 2

    def __init__(self, reader: ReadThrough, pool: Any, chunks: list[np.ndarray], done: queue.Queue,
                 inflight: int, stop: Any, digest: bytes, ctx: Context) -> None:
        self.reader, self.pool, self.done, self.stop = reader, pool, done, stop
        self.digest, self.ctx = digest, ctx
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

    def _next(self) -> np.ndarray | None:
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
            while (part := self._next()) is not None:
                chunk: list[int] = part.tolist()  # Python ints for this chunk only (see missing_in)
                datas = self.reader.read_files(chunk)
                man = self.reader.manifest
                items = [(i, man.paths[i], int(man.sizes[i]), int(man.labels[i]), self.reader.key(i))
                         for i in chunk]
                with self.lock:
                    self.pool.apply_async(_decode_chunk, (self.digest, self.ctx, items, datas),
                                          callback=self.done.put,
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
    results, written, worker_errors, counts = got
    rep.pillow_fallbacks += counts.get("pillow_fallbacks", 0)
    rep.decoder_unavailable += counts.get("unavailable", 0)
    man = reader.manifest
    good = [(reader.key(i), rec) for i, rec, _, _ in results if rec is not None]
    bad_items = []
    for i, rec, reason, remember in results:
        if rec is None:
            rep.quarantined[man.paths[i]] = reason
            if len(rep.quarantined) <= LOG_QUARANTINED:  # the rest: one summary line at the end
                log.warning("quarantined %s (%s)", man.paths[i], reason)
            if remember:  # transient failures (read errors, short reads) are not remembered
                bad_items.append(reader.remember_bad(i, reason))
                if reader.verified_bad is not None:  # decoded and failed here: this entry is ours
                    reader.verified_bad.add(bad_items[-1][0])
    rep.decoded += len(good)
    if written is None:
        rep.written += store.put_many(good)
    else:
        rep.written += written
        rep.worker_write_errors += worker_errors
    store.put_many(bad_items, overwrite=True)  # replaces an invalid entry (one that did not stop the fill)


def warm_cache(source: str, cache: str | None = None, *, workers: int = 2, short_side: int = 160,
               variant: Variant | None = None, revalidate: str = "dirs", t1_dir: str | None = "default",
               t1_max_bytes: int | None = None, storage_options: dict | None = None,
               progress: bool = True, record_key_file: str | None = None) -> WarmReport:
    """Decode every sample of ``source`` that ``cache`` does not hold yet and write it there.
    ``record_key_file``: MAC every record and quarantine entry with that key (None: the file named by
    ``$DATACACHE_RECORD_KEY_FILE`` if set; "": no key)."""
    variant = variant or Variant(short_side=short_side)
    spec = parse_cache_url(cache or default_cache_url(), check=True)
    man = Manifest.build(source, storage_options=storage_options, persist_dir=manifest_dir_for(spec),
                         revalidate=revalidate)
    reader = ReadThrough(man, variant, spec, t1_dir=t1_dir, t1_max_bytes=t1_max_bytes,
                         storage_options=storage_options,
                         record_key_file=resolve_record_key_file(record_key_file), writer=True)
    # a lone remote tier is written directly (synchronous, acknowledged writes from the pool workers)
    lone = open_store(spec.tiers[0]) if len(spec.tiers) == 1 else None
    direct = lone if getattr(lone, "remote", False) else None
    rep = fill_missing(reader, range(len(man)), workers=workers, progress=progress, store=direct,
                       store_spec=spec.tiers[0] if direct is not None else None)
    flush = getattr(reader.store, "flush", None)
    if flush is not None:
        flush()
    return rep
