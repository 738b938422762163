"""The one read-through path: keys -> tiers -> fill (source -> decode -> encode -> write-back).

:class:`ReadThrough` is what ``CachedImageNet`` (a thin torch face over it), ``datacache warm`` and
the cache daemon use, so there is one rule for hits, misses, bad records and bad files:

1. **Keys -> tiers.** One ``store.get_many`` for the batch (the store -- one tier or a
   :class:`~datacache.tiered.TieredStore` -- bounds its own round trips by bytes). A record that
   passes :func:`~datacache.record.decode_record` for the key it was asked for and this variant
   (encoding, RGB, the variant's geometry), with the manifest's label -- and, with a record key
   (``record_key_file``), the right keyed MAC -- is a hit (a zero-copy numpy view of the returned
   buffer). Anything else (absent, truncated, bit-flipped, poisoned, forged, under another key) is a
   miss; a bad record is counted ``t2_invalid`` and rewritten with ``overwrite=True`` (by a writer).
   Values are never unpickled, and decoding a value never raises.
2. **Known-bad files**: this process's quarantine first, then the decode failures remembered in
   the store (:mod:`datacache.quarantine`; with a record key only entries with its MAC count). An
   entry that is present but invalid is replaced (``overwrite=True``) if the file really is bad.
3. **Fill**: the file bytes come from T1/T0 (``Source.read_many``: concurrent), are decoded to the
   variant (:func:`~datacache.fill.fill_one`; with ``threads > 1`` several decodes run at once --
   Pillow releases the GIL), encoded, and written back **once per batch** to every writable tier: one
   ``put_many`` of the fresh records (``SET NX``), one of the rewritten ones, one of the newly
   remembered bad files. No lock is held across a decode; LMDB's write transaction covers only the
   batch write.

**Trainers read, daemons write.** A reader (``writer=False``: ``CachedImageNet``) opens every shared
(remote) tier read-only (:func:`~datacache.stores.open_store` ``reader=True``) unless the tier's URL says
``?write_back=1``: its misses are decoded locally and served, written back only to local tiers (the
embedded LMDB), and it trusts the store's quarantine entries (only writers can make them). A writer
(``writer=True``: the daemon, ``datacache warm``) writes samples and quarantine entries, and in a
shared cache never trusts a quarantine entry it did not verify itself: an entry found in the store is
counted as done only once this process has failed to decode that file too
(:attr:`ReadThrough.verified_bad`), so a forged or stale entry costs one decode and never leaves a good
file unfilled. (A local LMDB's only writers are this user's processes: its entries are trusted.)
4. Failures come back as :class:`Failure` (reason + whether it was a read or a decode failure);
   the caller applies its policy (substitute or raise).

Per-process state (fork/spawn boundary): the store and the source are opened lazily in the process
that uses them (pid check); pickling ships only the manifest, the cache spec and the config.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from datacache.cacheurl import MAX_TIERS, CacheSpec, StoreSpec, parse_cache_url
from datacache.config import Variant, user_cache_dir
from datacache.fill import Decoder, Filled, fill_one
from datacache.keys import sample_key
from datacache.manifest import Manifest
from datacache.quarantine import parse_quarantine, quarantine_key, quarantine_value
from datacache.record import RecordKey, decode_record, load_record_key
from datacache.source import Source, SourceError
from datacache.stores import open_store

COUNTERS = (
    "samples", "t2_hits", "t2_misses", "t2_invalid", "t2_bytes", "t2_written", "t2_known_bad",
    "t2_read_errors", "t2_write_errors", "t2_unavailable", "decoded", "errors", "substituted", "t1_hits",
    "t1_misses", "t0_bytes", "t0_retries", "t0_errors", "writeback_dropped", "t2_queued",
    "t2_writeback_present", "t2_writeback_errors",
    *(f"tier{i}_{what}" for i in range(MAX_TIERS) for what in ("hits", "misses", "bytes")),
)
_TIER_COUNTERS = COUNTERS[-3 * MAX_TIERS:]
SOURCE_FAILURE, DECODE_FAILURE = 1, 2
_SOURCE_DELTA = {"t1_hits": "t1_hits", "t1_misses": "t1_misses", "bytes_read": "t0_bytes",
                 "retries": "t0_retries", "errors": "t0_errors"}
_STORES: dict[tuple[int, str], Any] = {}


@dataclass(frozen=True)
class Failure:
    """A sample that could not be loaded: why, and whether reading (1) or decoding (2) failed."""

    reason: str
    code: int


def manifest_dir_for(cache: str | CacheSpec | StoreSpec) -> str:
    """Where manifests are persisted for a cache: inside the nearest tier's LMDB directory
    (``<dir>/manifests``; LMDB ignores extra files there), else under the user cache dir."""
    spec = cache if isinstance(cache, StoreSpec) else parse_cache_url(cache).store
    if spec.scheme == "lmdb":
        return os.path.join(spec.location, "manifests")
    return os.path.join(user_cache_dir(), "datacache", "manifests")


def shared_store(cache: str | CacheSpec | StoreSpec, *, reader: bool = False) -> Any:
    """One store object per (process, cache URL): LMDB refuses to open the same environment twice in
    one process, so datasets that share a cache (train + val, two sweeps in one process) share the
    handle. Per pid, so a forked child never reuses its parent's entry. ``reader=True``: shared tiers
    read-only (trainers read, daemons write; :func:`~datacache.stores.open_store`)."""
    spec = cache if isinstance(cache, (StoreSpec, CacheSpec)) else parse_cache_url(cache)
    key = (os.getpid(), spec.secret_url, reader)
    st = _STORES.get(key)
    if st is None:
        # a remote lone tier behind the background write-back queue: a miss never waits on the network
        st = _STORES[key] = open_store(spec, background_writes=isinstance(spec, CacheSpec), reader=reader)
    return st


def record_bytes_hint(variant: Variant) -> int:
    """Expected size of one raw record of ``variant`` (4:3 images): seeds byte-capped chunking."""
    return variant.short_side * min(variant.long_cap, (variant.short_side * 4) // 3) * 3 + 64


SHARED_SCHEMES = ("redis", "rediss", "redis+cluster")


def shared(cache: CacheSpec | StoreSpec) -> bool:
    """Whether ``cache`` has a shared (network) tier that other users' processes may write."""
    tiers = cache.tiers if isinstance(cache, CacheSpec) else (cache,)
    return any(t.scheme in SHARED_SCHEMES for t in tiers)


def writable(store: Any) -> bool:
    """Whether ``store`` (one tier or a TieredStore) has a tier this process may try to write: not every
    tier was opened read-only by the reader policy (a tier the user opened ``?readonly=1`` still counts,
    so its refused writes are counted and explained as ever)."""
    return any(not getattr(t, "reader_only", False) for t in getattr(store, "tiers", [store]))


class ReadThrough:
    """Keys -> tiers -> fill for one dataset and variant (see the module docstring)."""

    def __init__(self, manifest: Manifest, variant: Variant, cache: CacheSpec, *,
                 t1_dir: str | None = "default",
                 t1_max_bytes: int | None = None, storage_options: dict | None = None,
                 record_key_file: str | None = None, confine: Sequence[str] | None = None,
                 writer: bool = False, verified_bad: set[bytes] | None = None) -> None:
        self.manifest = manifest
        self.writer = bool(writer)
        # writers of a shared cache: the quarantine keys this process itself found undecodable (the daemon
        # passes one set that lives across its passes); readers, and writers of a local cache (LMDB: this
        # user's own processes are its only writers): None = the store's entries are trusted
        self.verified_bad: set[bytes] | None = (
            (verified_bad if verified_bad is not None else set()) if self.writer and shared(cache) else None)
        self._confine = None if confine is None else tuple(confine)  # Source(confine=): allowed prefixes
        self.variant = variant
        self.cache = cache
        self.tag = variant.tag()
        self._t1_dir = t1_dir
        self._t1_max_bytes = t1_max_bytes
        self._storage_options = storage_options
        self.quarantine_local: dict[str, str] = {}  # relpath -> reason, this process
        # read (and checked: ConfigError naming the file) here, in the constructing process; pickles as its
        # path and key id only (RecordKey.__reduce__): a spawned worker reads the file itself
        self.record_key: RecordKey | None = load_record_key(record_key_file) if record_key_file else None
        self._prefix = sample_key(manifest.fingerprint, self.tag, 0)[:-1]  # b"dc:<fp>:<variant>:"
        self._reset()

    def _reset(self) -> None:
        self._store: Any = None
        self._told_readonly = False
        self._source: Source | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_store", "_source", "_pool", "_pid", "_told_readonly")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked or unpickled: nothing of another process's handles is used
            self._reset()
            self._pid = os.getpid()

    @property
    def store(self) -> Any:
        """This process's store (opened on first use; a decode-pool worker never opens it)."""
        self._check_pid()
        if self._store is None:
            self._store = shared_store(self.cache, reader=not self.writer)
            self._store.hint_value_bytes(record_bytes_hint(self.variant))
        return self._store

    @property
    def source(self) -> Source:
        self._check_pid()
        if self._source is None:
            self._source = Source(self.manifest.root, t1_dir=self._t1_dir, t1_max_bytes=self._t1_max_bytes,
                                  storage_options=self._storage_options, confine=self._confine)
        return self._source

    def key(self, index: int) -> bytes:
        return self._prefix + b"%d" % index

    @property
    def prefix(self) -> bytes:
        """What every sample key of this dataset and variant starts with (``b"dc:<fp>:<variant>:"``)."""
        return self._prefix

    def keys(self, indices: Sequence[int]) -> list[bytes]:
        p = self._prefix
        return [p + b"%d" % i for i in indices]  # ~3x cheaper than one sample_key call per index

    def qkey(self, index: int) -> bytes:
        return quarantine_key(self.tag, self.manifest.paths[index], self.manifest.identity(index))

    # ------------------------------------------------------------ the read path
    def load_many(self, indices: Sequence[int], counts: dict[str, int], *, threads: int = 1,
                  on_ack: Callable[[int, int, int], None] | None = None
                  ) -> list[tuple[np.ndarray, int] | Failure]:
        """Per index: ``(HWC uint8 pixels, label)`` or a :class:`Failure`; counts into ``counts``
        (keys of :data:`COUNTERS`). ``threads`` > 1 decodes misses concurrently.

        Write-backs: with a local writable tier, ``t2_written`` counts what it stored. With only remote
        tiers the writes are queued (``t2_queued``) and acknowledged later by the writer thread:
        ``on_ack(written, present, errors)`` receives what the server answered (the caller adds it to
        its persistent counters as ``t2_written``/``t2_writeback_*``), so ``written`` is never a count
        of what was merely queued."""
        store = self.store
        before = store.counters()
        try:
            return self._load(indices, counts, threads, before, on_ack)
        finally:
            after = store.counters()
            for name in ("read_errors", "write_errors", "unavailable"):
                counts[f"t2_{name}"] += after.get(name, 0) - before.get(name, 0)
            dropped = after.get("writeback_dropped", 0) - before.get("writeback_dropped", 0)
            counts["writeback_dropped"] += dropped

    def _load(self, indices: Sequence[int], counts: dict[str, int], threads: int,
              before: dict[str, int], on_ack: Callable[[int, int, int], None] | None = None) -> list[Any]:
        man = self.manifest
        out: list[Any] = [None] * len(indices)
        keys = self.keys(indices)
        labels = man.labels[list(indices)].tolist()
        bufs = self._store.get_many(keys)
        if _TIER_COUNTERS[0] in before:  # a TieredStore: per-tier figures of the sample lookups only
            after = self._store.counters()
            for name in _TIER_COUNTERS:
                if name in after:
                    counts[name] += after[name] - before.get(name, 0)
        miss: list[int] = []  # positions
        invalid: set[int] = set()
        for pos, (key, buf) in enumerate(zip(keys, bufs)):
            if buf is None:
                miss.append(pos)
                continue
            rec = decode_record(buf, key, self.variant, record_key=self.record_key)
            if rec is None or rec[1] != labels[pos]:
                invalid.add(pos)
                miss.append(pos)
                continue
            counts["t2_bytes"] += len(buf)
            out[pos] = (rec[0], int(rec[1]))
        counts["t2_hits"] += len(indices) - len(miss)
        counts["t2_misses"] += len(miss)
        counts["t2_invalid"] += len(invalid)
        todo = self._skip_known_bad(indices, miss, out, counts)
        if todo:
            self._fill(indices, todo, invalid, out, counts, threads, on_ack)
        return out

    def _skip_known_bad(self, indices: Sequence[int], miss: list[int], out: list[Any],
                        counts: dict[str, int]) -> list[int]:
        """Known-bad files: this process's quarantine, then decode failures remembered in the store."""
        man = self.manifest
        todo: list[int] = []
        for pos in miss:
            reason = self.quarantine_local.get(man.paths[indices[pos]])
            if reason is None:
                todo.append(pos)
            else:
                out[pos] = Failure(reason, DECODE_FAILURE)
                counts["errors"] += 1
        if not todo:
            return todo
        known = self._store.get_many([self.qkey(indices[p]) for p in todo])
        rest = []
        for pos, q in zip(todo, known):
            i = indices[pos]
            reason = self.parse_known_bad(i, q)
            if reason is None:
                rest.append(pos)
            else:
                counts["t2_known_bad"] += 1
                out[pos] = self._fail(i, Failure(reason, DECODE_FAILURE), counts)
        return rest

    def _fail(self, index: int, failure: Failure, counts: dict[str, int]) -> Failure:
        import logging

        rel = self.manifest.paths[index]
        counts["errors"] += 1
        if rel not in self.quarantine_local:
            self.quarantine_local[rel] = failure.reason
            logging.getLogger("datacache.readthrough").warning("quarantined %s (%s)", rel, failure.reason)
        return failure

    def _fill(self, indices: Sequence[int], todo: list[int], invalid: set[int], out: list[Any],
              counts: dict[str, int], threads: int,
              on_ack: Callable[[int, int, int], None] | None = None) -> None:
        src = self.source
        before = src.stats()
        idx = [indices[p] for p in todo]
        datas = self.read_files(idx)
        after = src.stats()
        for k, name in _SOURCE_DELTA.items():
            counts[name] += int(after.get(k, 0)) - int(before.get(k, 0))
        filled = self.fill_many(idx, datas, threads=threads)
        fresh: list[tuple[bytes, bytes]] = []
        rewrite: list[tuple[bytes, bytes]] = []
        bad: list[tuple[bytes, bytes]] = []
        for pos, i, data, got in zip(todo, idx, datas, filled):
            if got.record is None:
                code = SOURCE_FAILURE if isinstance(data, BaseException) else DECODE_FAILURE
                out[pos] = self._fail(i, Failure(got.reason, code), counts)
                if got.remember:
                    bad.append(self.remember_bad(i, got.reason))
                continue
            counts["decoded"] += 1
            (rewrite if pos in invalid else fresh).append((self.key(i), got.record))
            out[pos] = (got.pixels, int(self.manifest.labels[i]))
        if not writable(self._store):  # a reader of a shared cache: served, not written
            if not self._told_readonly:
                self._told_readonly = True
                import logging

                logging.getLogger("datacache.readthrough").info(
                    "%s: misses are decoded and served, not written: trainers read, daemons write (run a "
                    "datacache-daemon per node, or `datacache warm` with the daemons' credential; "
                    "?write_back=1 only for a Redis that is yours alone)", self._store.url)
            return
        # one batched write per kind; failures (read-only cache, full disk) are counted, never raised
        queued = getattr(self._store, "remote_only", False)  # put_many returns what was queued, not stored
        kw = {"on_ack": on_ack} if queued else {}
        written = "t2_queued" if queued else "t2_written"
        if fresh:
            counts[written] += self._store.put_many(fresh, **kw)
        if rewrite:
            counts[written] += self._store.put_many(rewrite, overwrite=True, **kw)
        if bad:  # overwrite: an entry present but invalid (forged, another key) is replaced by a real one
            self._store.put_many(bad, overwrite=True)

    # ------------------------------------------------------------ the fill, shared with warm and the daemon
    def read_files(self, indices: Sequence[int]) -> list[bytes | SourceError]:
        """The files of ``indices`` through T1/T0 (``Source.read_many``: concurrent): bytes, or the
        SourceError of a file that could not be read."""
        man = self.manifest
        src = self.source
        return src.read_many([man.paths[i] for i in indices], sizes=[int(man.sizes[i]) for i in indices],
                             identities=[man.identity(i) for i in indices])

    def fill_many(self, indices: Sequence[int], datas: Sequence[bytes | BaseException], *,
                  decoder: Decoder | None = None, threads: int = 1) -> list[Filled]:
        """:func:`~datacache.fill.fill_one` for each sample of ``indices`` and its bytes (or read error);
        ``threads`` > 1 decodes concurrently (Pillow releases the GIL)."""
        man = self.manifest

        def one(arg: tuple[int, bytes | BaseException]) -> Filled:
            i, data = arg
            return fill_one(data, rel=man.paths[i], size=int(man.sizes[i]), label=int(man.labels[i]),
                            key=self.key(i), variant=self.variant, decoder=decoder,
                            record_key=self.record_key)

        args = list(zip(indices, datas))
        if threads <= 1 or len(args) < 2:
            return [one(a) for a in args]
        if self._pool is None:  # threads of THIS process (dropped by the pid check after a fork)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="datacache-decode")
        return list(self._pool.map(one, args))

    def remember_bad(self, index: int, reason: str) -> tuple[bytes, bytes]:
        """The quarantine record for an undecodable file (written by the caller in its batch)."""
        qkey = self.qkey(index)
        return qkey, quarantine_value(self.manifest.paths[index], self.manifest.identity(index), reason,
                                      qkey=qkey, record_key=self.record_key)

    def trusted_bad(self, index: int, value: Any) -> bool:
        """Whether a quarantine entry read from the store lets a fill skip ``index``: valid for this
        reader, and -- for a writer -- for a file this process failed to decode itself (module docstring)."""
        if value is None or self.parse_known_bad(index, value) is None:
            return False
        return self.verified_bad is None or self.qkey(index) in self.verified_bad

    def parse_known_bad(self, index: int, value: Any) -> str | None:
        """The reason of a valid quarantine entry for ``index`` (MAC'd with this reader's record key if it
        has one), else None."""
        return parse_quarantine(value, self.manifest.paths[index], self.manifest.identity(index),
                                qkey=self.qkey(index), record_key=self.record_key)
