"""CachedImageNet: a map-style torch Dataset, a thin torch face over the core's read-through path.

Everything about where a sample comes from -- keys, tiers, bad records, the fill from T1/T0,
write-back and remembered bad files -- is :class:`datacache.readthrough.ReadThrough`, shared with
``datacache warm`` and the cache daemon. This class adds what torch needs:

* ``__getitems__`` (DataLoader calls it with the whole batch): one ``ReadThrough.load_many`` per
  batch, hits turned into ``uint8 [3, H, W]`` tensor *views* of the records (``torch.from_numpy``
  + ``permute``; treat them as read-only, clone before modifying in place);
* the failure policy ``on_error``: ``"substitute"`` (default) quarantines the file -- recorded in
  :attr:`CachedImageNet.quarantined` (relpath -> reason), counted, logged once -- and the next
  index (wrapping) that loads stands in, so batch sizes stay equal; ``"raise"`` raises
  :class:`DatasetError` naming the file, the cause and what to do;
* statistics of every DataLoader worker in one shared-memory table (:mod:`client.stats`), with the
  hit ratio per tier for a chained cache (``lmdb:///local::redis+cluster://...``);
* :meth:`CachedImageNet.wait_warm`: block until the cache daemons report the dataset full.

The cache URL is parsed and checked when the dataset is constructed (in the parent): a bad URL, an
LMDB directory on a network filesystem, or a wrong Redis password raises ConfigError right there.

Per-process state (fork/spawn boundary): the read-through opens its store and source lazily in the
process that uses them (pid check), so every DataLoader worker opens its own LMDB environment and
Redis connections after the fork. Pickling the dataset for spawn carries the parsed cache spec,
the config and shared-memory tensors -- the manifest's columns (:mod:`client.shared_manifest`),
statistics and quarantine flags -- which torch's ForkingPickler passes as file descriptors rather
than copies. In the main process (``num_workers=0``) misses of a batch are decoded by a few
threads at once; in a worker, one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from client.shared_manifest import share_manifest
from client.stats import PLACEMENT, PLACEMENT_COUNTERS, SharedCounters, format_stats
from client.tensor_view import to_chw_tensor
from datacache.cacheurl import parse_cache_url
from datacache.columns import ArrayView, PairsView
from datacache.config import ConfigError, Variant, default_cache_url
from datacache.fillstatus import sample_missing, wait_until_warm
from datacache.manifest import Manifest, check_revalidate
from datacache.options import choice
from datacache.readthrough import COUNTERS, SOURCE_FAILURE, Failure, ReadThrough, manifest_dir_for
from datacache.record import load_record_key, resolve_record_key_file

log = logging.getLogger("client.dataset")

ON_ERROR_CHOICES = ("substitute", "raise")
_DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))  # main process only: a worker decodes in one thread


class DatasetError(Exception):
    """A sample could not be loaded and ``on_error="raise"``; the message names the file."""


class CachedImageNet(Dataset):
    """ImageFolder-compatible dataset served from the datacache (see the module docstring).

    Args:
        source: fsspec URL or path of an ImageFolder root or a ``.txt``/``.csv`` file list.
        cache: cache URL (``lmdb:///path``, ``lmdb://~/dir?readonly=1``, ``memory://``,
            ``redis://host:6379``, ``redis+cluster://h1:7000,h2:7000``, or tiers chained with ``::``
            such as ``lmdb:///local::redis+cluster://h1:7000``); default
            :func:`datacache.config.default_cache_url`. Parsed and checked here.
        short_side: short side of the cached variant (ignored when ``variant`` is given).
        variant: full :class:`~datacache.config.Variant`.
        transform: callable applied to each ``uint8 [3, H, W]`` tensor.
        on_error: ``"substitute"`` or ``"raise"`` (see the module docstring).
        revalidate: how a persisted listing is checked at start: ``"dirs"`` (default; detects
            added, removed and atomically replaced files), ``"full"`` (re-list: also detects files
            rewritten in place) or ``"none"`` (see :mod:`datacache.manifest`).
        t1_dir: T1 raw-bytes cache dir for remote sources (``"default"``, a path, or None).
        t1_max_bytes: size cap of T1 (LRU trim); None = no cap.
        storage_options: fsspec options for the source.
        record_key_file: file holding the cache's record key (the daemons' ``record_key_file``): records
            and quarantine entries must carry its keyed MAC, anything else is a miss (see
            :mod:`datacache.record`). None: ``$DATACACHE_RECORD_KEY_FILE`` if set; ``""``: no key.
            Read here (ConfigError naming the file); workers get the path, never the key bytes.

    Items are ``(uint8 tensor [3, H, W], int label)``; sizes differ between samples, so use
    :class:`client.augment.AugmentCollate` (or a ``transform`` producing a fixed size) with
    a DataLoader.
    """

    def __init__(self, source: str, cache: str | None = None, *, short_side: int = 160,
                 variant: Variant | None = None, transform: Callable[[torch.Tensor], Any] | None = None,
                 on_error: str = "substitute", revalidate: str = "dirs", t1_dir: str | None = "default",
                 t1_max_bytes: int | None = None, storage_options: dict | None = None,
                 record_key_file: str | None = None) -> None:
        choice("on_error", on_error, ON_ERROR_CHOICES)
        if t1_max_bytes is not None and int(t1_max_bytes) < 1:
            raise ConfigError(f"t1_max_bytes must be a positive number of bytes or None, "
                              f"got {t1_max_bytes!r}")
        check_revalidate(revalidate)
        key_file = resolve_record_key_file(record_key_file)
        if key_file:
            load_record_key(key_file)  # a bad key file fails here, before the listing (read once per process)
        self.variant = variant if variant is not None else Variant(short_side=short_side)
        # parsed and checked here, in the parent, never first inside a DataLoader worker
        self.cache_spec = parse_cache_url(cache or default_cache_url(), check=True)
        self.cache_url = self.cache_spec.url
        self.transform = transform
        self.on_error = on_error
        self.revalidate = revalidate
        # columns in shared memory: spawn/forkserver workers map them instead of receiving a copy
        self.manifest = share_manifest(Manifest.build(source, storage_options=storage_options,
                                                      persist_dir=self.manifest_dir, revalidate=revalidate))
        self.reader = ReadThrough(self.manifest, self.variant, self.cache_spec, t1_dir=t1_dir,
                                  t1_max_bytes=int(t1_max_bytes) if t1_max_bytes is not None else None,
                                  storage_options=storage_options,
                                  record_key_file=key_file)
        self._tag = self.variant.tag()
        self._counters = SharedCounters((*COUNTERS, *PLACEMENT_COUNTERS))
        self._qflags = torch.zeros(len(self.manifest), dtype=torch.uint8).share_memory_()

    # ------------------------------------------------------------ ImageFolder face
    @property
    def manifest_dir(self) -> str:
        return manifest_dir_for(self.cache_spec)

    @property
    def root(self) -> str:
        return self.manifest.root

    @property
    def classes(self) -> list[str]:
        return self.manifest.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.manifest.class_to_idx

    @property
    def targets(self) -> ArrayView:
        """Labels, a read-only sequence view of the manifest's int32 column (no list is built)."""
        return self.manifest.targets

    @property
    def samples(self) -> PairsView:
        """``(path, label)`` pairs like torchvision's ImageFolder (plain paths for local sources),
        a read-only view built on access."""
        root = self.manifest.root
        base = root[len("file://"):] if root.startswith("file://") else root
        return PairsView(base.rstrip("/") + "/", self.manifest.paths, self.manifest.labels)

    imgs = samples

    def __len__(self) -> int:
        return len(self.manifest)

    def __repr__(self) -> str:
        return (f"CachedImageNet(root={self.root!r}, n={len(self)}, classes={len(self.classes)}, "
                f"cache={self.cache_url!r}, variant={self._tag!r}, on_error={self.on_error!r})")

    @property
    def quarantine_local(self) -> dict[str, str]:
        """Files quarantined in *this* process (see :attr:`quarantined` for all workers)."""
        return self.reader.quarantine_local

    @property
    def store(self) -> Any:
        """This process's store (one tier, or a TieredStore), opened on first use."""
        return self.reader.store

    def key(self, index: int) -> bytes:
        return self.reader.key(index)

    # ------------------------------------------------------------ the read path
    def _placement_tiers(self) -> list[tuple[int, Any]]:
        """``(tier number, store)`` of the tiers that count where their bytes came from (a Redis
        Cluster: local / remote master); this process's stores."""
        store = self.reader.store
        tiers = list(getattr(store, "tiers", None) or [store])
        return [(i, t) for i, t in enumerate(tiers) if "local_bytes" in t.counters()]

    def _load_many(self, indices: Sequence[int], counts: dict[str, int]) -> list[Any]:
        """Per index: ``(tensor, label)`` or a :class:`~datacache.readthrough.Failure`."""
        in_worker = torch.utils.data.get_worker_info() is not None
        placed = self._placement_tiers()
        before = [t.counters() for _, t in placed]
        try:
            out: list[Any] = self.reader.load_many(indices, counts,
                                                   threads=1 if in_worker else _DECODE_THREADS,
                                                   on_ack=self._on_writeback_ack)
        finally:  # the tiers' local/remote counters are per process: add this batch's deltas
            for (i, t), old in zip(placed, before):
                new = t.counters()
                for what in PLACEMENT:
                    counts[f"tier{i}_{what}"] += new.get(what, 0) - old.get(what, 0)
        for pos, item in enumerate(out):
            if isinstance(item, Failure):
                self._qflags[indices[pos]] = item.code
            else:
                out[pos] = (to_chw_tensor(item[0]), item[1])
        return out

    def _on_writeback_ack(self, written: int, present: int, errors: int) -> None:
        """A queued write-back batch was answered by the remote tier (writer thread of this process):
        count what the server acknowledged (``stats()['t2']['written']``), found present, or refused."""
        self._counters.add({"t2_written": written, "t2_writeback_present": present,
                            "t2_writeback_errors": errors})

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, int]]:
        """Load a whole batch with one store round trip (DataLoader calls this per batch)."""
        indices = [self._check_index(i) for i in indices]
        counts = dict.fromkeys(self._counters.names, 0)
        try:
            out = self._load_many(indices, counts)
            for pos, item in enumerate(out):
                if isinstance(item, Failure):
                    rel = self.manifest.paths[indices[pos]]
                    if self.on_error == "raise":
                        raise DatasetError(
                            f"{self.manifest.root}/{rel}: {item.reason}. Fix or remove this file (the "
                            "manifest is re-listed when files change), or use on_error='substitute' to skip "
                            "bad samples.")
                    out[pos] = self._substitute(indices[pos], counts)
            counts["samples"] += len(indices)
        finally:
            self._counters.add(counts)
        if self.transform is not None:
            out = [(self.transform(img), label) for img, label in out]
        return out

    def _substitute(self, index: int, counts: dict[str, int]) -> tuple[torch.Tensor, int]:
        """The next index (wrapping) that loads stands in for a quarantined one."""
        n = len(self)
        for step in range(1, min(n, 1 + 256)):
            j = (index + step) % n
            item = self._load_many([j], counts)[0]
            if not isinstance(item, Failure):
                counts["substituted"] += 1
                return item
        raise DatasetError(f"{self.manifest.root}: sample {self.manifest.paths[index]} failed and none "
                           "of the next 256 samples could be loaded either; check the source "
                           "(see ds.quarantined)")

    def _check_index(self, i: int) -> int:
        i = int(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} samples")
        return i

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.__getitems__([index])[0]

    # ------------------------------------------------------------ reporting
    @property
    def quarantined(self) -> dict[str, str]:
        """relpath -> reason for every sample quarantined so far, in this process or any worker."""
        result = dict(self.reader.quarantine_local)
        flagged = torch.nonzero(self._qflags).flatten().tolist()
        missing = [i for i in flagged if self.manifest.paths[i] not in result]
        if missing:
            known = self.reader.store.get_many([self.reader.qkey(i) for i in missing])
            for i, q in zip(missing, known):
                reason = self.reader.parse_known_bad(i, q)
                if reason is None:
                    code = int(self._qflags[i])
                    what = "cannot read the file" if code == SOURCE_FAILURE else "cannot decode"
                    reason = f"{what} (in a DataLoader worker; see its log)"
                result[self.manifest.paths[i]] = reason
        return result

    def stats(self) -> dict[str, Any]:
        """Totals over the main process and all DataLoader workers since creation / reset_stats().

        ``hits``/``misses`` are cache lookups (any tier), ``tiers`` the hits, misses, bytes and hit
        ratio of each tier of a chained cache (nearest first) with ``local_hits``/``local_bytes`` and
        ``remote_hits``/``remote_bytes`` -- what the master on this node served and what crossed to
        another node, counted by a ``redis+cluster://...?local=host:port`` tier (0 for the others) and
        summed over the tiers at the top level, ``t2.invalid_rewritten`` counts bad
        records that were rewritten, ``t2.read_errors``/``t2.write_errors``/``t2.unavailable`` store
        failures that were turned into misses / skipped writes, ``t1`` is the raw-bytes disk cache
        (remote sources only), ``t0`` the source itself (``bytes_read`` = bytes read from T1/T0).
        """
        return format_stats(self._counters.totals(), quarantined=int(torch.count_nonzero(self._qflags)),
                            processes=self._counters.active_rows(), store=self.cache_url,
                            tier_urls=[t.url for t in self.cache_spec.tiers])

    def reset_stats(self) -> None:
        """Zero the counters (all processes). Quarantine flags are kept."""
        self._counters.reset()

    def wait_warm(self, timeout: float | None = None, *, poll: float = 0.5) -> dict[str, Any]:
        """Block until the cache daemons report this dataset and variant fully ingested (their fill
        reports in Redis, :mod:`datacache.fillstatus`); returns the last report. Raises TimeoutError
        after ``timeout`` seconds (None: wait forever) and ConfigError when the cache has no Redis
        tier for daemons to report in. Reports that say "full" are checked against the cache itself
        (``EXISTS`` of 256 random samples, :func:`~datacache.fillstatus.sample_missing`): a node restarted
        empty makes this wait again until its keys are refilled."""
        reader = self.reader

        def verify() -> dict[str, int]:
            return sample_missing(reader.store, len(self), reader.keys,
                                  lambda idx: [reader.qkey(i) for i in idx], reader.parse_known_bad)

        return wait_until_warm(reader.store, self.manifest.fingerprint, self._tag, len(self),
                               timeout=timeout, poll=poll, verify=verify)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this process's queued write-backs to remote tiers are written (also done at exit
        and when a DataLoader worker exits); True when nothing is left queued."""
        flush = getattr(self.reader.store, "flush", None)
        return True if flush is None else bool(flush(timeout))
