"""CachedImageNet: a map-style torch Dataset whose samples come from the datacache tiers.

Read path for a batch of indices (``__getitems__``, which DataLoader calls with the whole
batch when the dataset defines it):

1. T2 (the store, LMDB by default): one ``store.get_many`` for all keys of the batch (a
   network store bounds its own round trips by bytes, :mod:`datacache.stores.base`). A record
   that decodes (``decode_record``, checked against the key it was asked for) with the expected
   label is a **hit**: ``torch.from_numpy`` on the record's numpy view, then
   ``.permute(2, 0, 1)`` -- the returned ``uint8 [3, H, W]`` tensor is a *view* of the record.
   Where copies happen: the store's read itself (LMDB's ``get_many`` copies each value out
   of the memory map into a ``bytes``, since a zero-copy view dies with the read
   transaction) and then none until the batch is assembled (``AugmentCollate`` resizes
   straight into the output batch; a ``transform`` may copy). The tensor keeps its
   ``bytes`` alive; treat it as read-only (clone before modifying it in place: for the
   ``memory://`` store the bytes *are* the stored value; a damaged value would fail its
   checksum and be rewritten). A store that returns short-lived ``memoryview`` values is
   copied once into a per-batch arena (:func:`client.storeio.own_values`).
2. Miss (absent key, or a truncated / bit-flipped / mislabelled / foreign-key record, which is
   counted as ``t2_invalid`` and rewritten with ``overwrite=True``): the file bytes come from
   T1/T0 via ``Source.read_many`` (concurrent; T1 entries and lengths checked against the
   manifest's identity of the file), are decoded into the variant, encoded and written back with
   ``put_many`` (``SET NX`` semantics). A store that cannot be read is all misses; a write that
   fails (read-only cache, full disk) is skipped -- both counted (``stats()["t2"]``) and logged
   once, never raised (:mod:`datacache.stores.base`).
3. A file that cannot be read or decoded follows ``on_error``:

   * ``"substitute"`` (default): the sample is **quarantined** -- recorded in
     :attr:`CachedImageNet.quarantined` (relpath -> reason), counted in :meth:`stats`,
     logged once -- and the next index (wrapping) that loads stands in, so batch sizes stay
     equal and the choice is deterministic. A decode failure of complete bytes is also
     remembered in the store, keyed by the file's identity (:mod:`client.fill`), so the next
     run does not re-read a file it knows is bad, and fixing the file clears it; transient
     failures (read errors, short reads, out of memory) are skipped for this run only.
   * ``"raise"``: :class:`DatasetError` naming the file, the cause and what to do.

The cache URL is parsed and checked when the dataset is constructed (in the parent):
a bad URL, or an LMDB directory on a network filesystem, raises ConfigError right there.

Per-process state (fork/spawn boundary): the store and the source are opened lazily in the
process that uses them (pid check), so every DataLoader worker opens its own LMDB
environment after the fork, and pickling the dataset for spawn carries only the manifest
(numpy columns, a few buffers), the parsed cache spec, the config and two small shared-memory
tensors (statistics and quarantine flags, see
:mod:`client.stats`), which torch's ForkingPickler shares rather than copies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from client.fill import fill_one
from client.stats import SharedCounters, format_stats
from client.storeio import (
    manifest_dir_for,
    own_values,
    parse_quarantine,
    quarantine_key,
    quarantine_value,
    shared_store,
    to_chw_tensor,
)
from datacache.cacheurl import parse_cache_url
from datacache.columns import ArrayView, PairsView
from datacache.config import ConfigError, Variant, default_cache_url
from datacache.keys import sample_key
from datacache.manifest import Manifest, check_revalidate
from datacache.record import decode_record
from datacache.source import Source

log = logging.getLogger("client.dataset")

ON_ERROR_CHOICES = ("substitute", "raise")
COUNTERS = (
    "samples", "t2_hits", "t2_misses", "t2_invalid", "t2_bytes", "t2_written", "t2_known_bad",
    "t2_read_errors", "t2_write_errors", "decoded", "errors", "substituted", "t1_hits", "t1_misses",
    "t0_bytes", "t0_retries", "t0_errors",
)
_Q_SOURCE, _Q_DECODE = 1, 2  # quarantine flag codes (shared tensor)
_SOURCE_DELTA = {"t1_hits": "t1_hits", "t1_misses": "t1_misses", "bytes_read": "t0_bytes",
                 "retries": "t0_retries", "errors": "t0_errors"}
_STORE_DELTA = {"read_errors": "t2_read_errors", "write_errors": "t2_write_errors"}


class DatasetError(Exception):
    """A sample could not be loaded and ``on_error="raise"``; the message names the file."""


class CachedImageNet(Dataset):
    """ImageFolder-compatible dataset served from the datacache (see the module docstring).

    Args:
        source: fsspec URL or path of an ImageFolder root or a ``.txt``/``.csv`` file list.
        cache: cache URL (``lmdb:///path``, ``lmdb://~/dir?readonly=1``, ``memory://``, ...);
            default :func:`datacache.config.default_cache_url`. Parsed and checked here.
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

    Items are ``(uint8 tensor [3, H, W], int label)``; sizes differ between samples, so use
    :class:`client.augment.AugmentCollate` (or a ``transform`` producing a fixed size) with
    a DataLoader.
    """

    def __init__(self, source: str, cache: str | None = None, *, short_side: int = 160,
                 variant: Variant | None = None, transform: Callable[[torch.Tensor], Any] | None = None,
                 on_error: str = "substitute", revalidate: str = "dirs", t1_dir: str | None = "default",
                 t1_max_bytes: int | None = None, storage_options: dict | None = None) -> None:
        if on_error not in ON_ERROR_CHOICES:
            raise ConfigError(f"on_error={on_error!r} is not valid; choose one of "
                              f"{', '.join(ON_ERROR_CHOICES)}")
        if t1_max_bytes is not None and int(t1_max_bytes) < 1:
            raise ConfigError(f"t1_max_bytes must be a positive number of bytes or None, "
                              f"got {t1_max_bytes!r}")
        check_revalidate(revalidate)
        self.variant = variant if variant is not None else Variant(short_side=short_side)
        # parsed and checked here, in the parent, never first inside a DataLoader worker
        self.cache_spec = parse_cache_url(cache or default_cache_url(), check=True).store
        self.cache_url = self.cache_spec.url
        self.transform = transform
        self.on_error = on_error
        self.revalidate = revalidate
        self._t1_dir = t1_dir
        self._t1_max_bytes = int(t1_max_bytes) if t1_max_bytes is not None else None
        self._storage_options = storage_options
        self.manifest = Manifest.build(source, storage_options=storage_options,
                                       persist_dir=self.manifest_dir, revalidate=revalidate)
        self._tag = self.variant.tag()
        self._counters = SharedCounters(COUNTERS)
        self._qflags = torch.zeros(len(self.manifest), dtype=torch.uint8).share_memory_()
        self.quarantine_local: dict[str, str] = {}
        self._store: Any = None
        self._source: Source | None = None
        self._pid = -1

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

    # ------------------------------------------------------------ per-process state
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # never ship open handles across the process boundary
        state["_source"] = None
        state["_pid"] = -1
        return state

    def _ensure_open(self) -> None:
        # Process boundary: after fork (DataLoader worker) or spawn the pid differs and the
        # store/source are reopened here, in the process that uses them.
        if self._pid != os.getpid() or self._store is None:
            self._store = shared_store(self.cache_spec)
            v = self.variant  # expected record size seeds a network store's byte-capped chunking
            self._store.hint_value_bytes(v.short_side * min(v.long_cap, (v.short_side * 4) // 3) * 3 + 64)
            self._source = Source(self.manifest.root, t1_dir=self._t1_dir, t1_max_bytes=self._t1_max_bytes,
                                  storage_options=self._storage_options)
            self._pid = os.getpid()

    @property
    def store(self) -> Any:
        self._ensure_open()
        return self._store

    def key(self, index: int) -> bytes:
        return sample_key(self.manifest.fingerprint, self._tag, index)

    def _qkey(self, index: int) -> bytes:
        return quarantine_key(self._tag, self.manifest.paths[index], self.manifest.identity(index))

    # ------------------------------------------------------------ the read path
    def _fail(self, index: int, code: int, reason: str, counts: dict[str, int]) -> str:
        rel = self.manifest.paths[index]
        counts["errors"] += 1
        if rel not in self.quarantine_local:
            self.quarantine_local[rel] = reason
            log.warning("quarantined %s (%s)", rel, reason)
        self._qflags[index] = code
        return reason

    def _load_many(self, indices: Sequence[int], counts: dict[str, int]) -> list[Any]:
        """Per index: ``(tensor, label)`` or a ``str`` failure reason."""
        self._ensure_open()
        man = self.manifest
        out: list[Any] = [None] * len(indices)
        prefix = self.key(0)[:-1]  # b"dc:<fingerprint>:<variant>:" (sample_key's format), built once
        keys = [prefix + b"%d" % i for i in indices]  # ~3x cheaper than one sample_key call per index
        labels = man.labels[list(indices)].tolist()
        bufs = own_values(self._store.get_many(keys))
        miss: list[int] = []  # positions
        invalid: set[int] = set()
        for pos, (key, buf) in enumerate(zip(keys, bufs)):
            if buf is None:
                miss.append(pos)
                continue
            rec = decode_record(buf, key)
            if rec is None or rec[1] != labels[pos]:
                invalid.add(pos)
                miss.append(pos)
                continue
            counts["t2_bytes"] += len(buf)
            out[pos] = (to_chw_tensor(rec[0]), int(rec[1]))
        counts["t2_hits"] += len(indices) - len(miss)
        counts["t2_misses"] += len(miss)
        counts["t2_invalid"] += len(invalid)
        if not miss:
            return out
        # Known-bad files: this process's quarantine first, then decode failures remembered in the store.
        todo: list[int] = []
        for pos in miss:
            rel = man.paths[indices[pos]]
            if rel in self.quarantine_local:
                out[pos] = self.quarantine_local[rel]
                counts["errors"] += 1
            else:
                todo.append(pos)
        if todo:
            known = self._store.get_many([self._qkey(indices[p]) for p in todo])
            rest = []
            for pos, q in zip(todo, known):
                i = indices[pos]
                reason = parse_quarantine(q, man.paths[i], man.identity(i))
                if reason is None:
                    rest.append(pos)
                else:
                    counts["t2_known_bad"] += 1
                    out[pos] = self._fail(i, _Q_DECODE, reason, counts)
            todo = rest
        if todo:
            self._fill_misses(indices, todo, invalid, out, counts)
        return out

    def _fill_misses(self, indices: Sequence[int], todo: list[int], invalid: set[int], out: list[Any],
                     counts: dict[str, int]) -> None:
        man = self.manifest
        src = self._source
        assert src is not None
        before = src.stats()
        datas = src.read_many([man.paths[indices[p]] for p in todo],
                              sizes=[int(man.sizes[indices[p]]) for p in todo],
                              identities=[man.identity(indices[p]) for p in todo])
        after = src.stats()
        for k, name in _SOURCE_DELTA.items():
            counts[name] += int(after.get(k, 0)) - int(before.get(k, 0))
        fresh: list[tuple[bytes, bytes]] = []
        rewrite: list[tuple[bytes, bytes]] = []
        bad: list[tuple[bytes, bytes]] = []
        for pos, data in zip(todo, datas):
            i = indices[pos]
            rel = man.paths[i]
            label = int(man.labels[i])
            got = fill_one(data, rel=rel, size=int(man.sizes[i]), label=label, key=self.key(i),
                           variant=self.variant)
            if got.record is None:
                code = _Q_SOURCE if isinstance(data, BaseException) else _Q_DECODE
                out[pos] = self._fail(i, code, got.reason, counts)
                if got.remember:
                    bad.append((self._qkey(i), quarantine_value(rel, man.identity(i), got.reason)))
                continue
            counts["decoded"] += 1
            (rewrite if pos in invalid else fresh).append((self.key(i), got.record))
            out[pos] = (to_chw_tensor(got.pixels), label)
        # write failures (read-only cache, full disk) are skipped and counted by the store, never raised
        if fresh:
            counts["t2_written"] += self._store.put_many(fresh)
        if rewrite:
            counts["t2_written"] += self._store.put_many(rewrite, overwrite=True)
        if bad:
            self._store.put_many(bad)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, int]]:
        """Load a whole batch with one store round trip (DataLoader calls this per batch)."""
        indices = [self._check_index(i) for i in indices]
        counts = dict.fromkeys(COUNTERS, 0)
        self._ensure_open()
        store_before = self._store.counters()
        try:
            out = self._load_many(indices, counts)
            for pos, item in enumerate(out):
                if isinstance(item, str):
                    rel = self.manifest.paths[indices[pos]]
                    if self.on_error == "raise":
                        raise DatasetError(
                            f"{self.manifest.root}/{rel}: {item}. Fix or remove this file (the manifest is "
                            "re-listed when files change), or use on_error='substitute' to skip bad samples.")
                    out[pos] = self._substitute(indices[pos], counts)
            counts["samples"] += len(indices)
        finally:
            store_after = self._store.counters()
            for k, name in _STORE_DELTA.items():
                counts[name] += store_after.get(k, 0) - store_before.get(k, 0)
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
            if not isinstance(item, str):
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
        result = dict(self.quarantine_local)
        flagged = torch.nonzero(self._qflags).flatten().tolist()
        missing = [i for i in flagged if self.manifest.paths[i] not in result]
        if missing:
            self._ensure_open()
            known = self._store.get_many([self._qkey(i) for i in missing])
            for i, q in zip(missing, known):
                rel = self.manifest.paths[i]
                reason = parse_quarantine(q, rel, self.manifest.identity(i))
                if reason is None:
                    code = int(self._qflags[i])
                    what = "cannot read the file" if code == _Q_SOURCE else "cannot decode"
                    reason = f"{what} (in a DataLoader worker; see its log)"
                result[rel] = reason
        return result

    def stats(self) -> dict[str, Any]:
        """Totals over the main process and all DataLoader workers since creation / reset_stats().

        ``hits``/``misses`` are T2 (store) lookups, ``t2.invalid_rewritten`` counts bad records
        that were rewritten, ``t2.read_errors``/``t2.write_errors`` store failures that were turned
        into misses / skipped writes, ``t1`` is the raw-bytes disk cache (remote sources only),
        ``t0`` the source itself (``bytes_read`` = bytes read from T1/T0 on misses).
        """
        return format_stats(self._counters.totals(), quarantined=int(torch.count_nonzero(self._qflags)),
                            processes=self._counters.active_rows(), store=self.cache_url)

    def reset_stats(self) -> None:
        """Zero the counters (all processes). Quarantine flags are kept."""
        self._counters.reset()
