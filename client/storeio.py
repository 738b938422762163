"""Store-side helpers of the client: one store handle per process, owning store buffers,
where manifests are persisted, and the quarantine records.

Quarantine records remember files that could not be *decoded* although their bytes were
complete (length equal to the manifest's size), so a later run or ``datacache warm`` does not
re-read them. They are keyed by the variant and the file's identity (path + size + mtime +
version, :meth:`datacache.manifest.Manifest.identity`), not by the dataset fingerprint: adding
an unrelated file keeps them, and fixing the file (a new size or mtime) clears the verdict.
Transient failures (read errors, short reads, out of memory) are never remembered. The value is
a small msgpack map ``{path, id, reason}``, untrusted input like any cache value: parsed with
msgpack only, type-checked, and it must name the same path and identity.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import msgpack
import numpy as np
import xxhash

from datacache.cacheurl import CacheSpec, StoreSpec, parse_cache_url
from datacache.config import user_cache_dir
from datacache.source import SourceError

QUARANTINE_PREFIX = "dcq"
_STORES: dict[tuple[int, str], Any] = {}
_readonly_warning_silenced = False


def read_failure_reason(err: BaseException) -> str:
    """Quarantine reason for a file the source could not read (names the underlying cause)."""
    cause = err.cause if isinstance(err, SourceError) else err
    return f"cannot read the file: {cause}"


def quarantine_key(variant_tag: str, path: str, identity: str) -> bytes:
    """Key of the remembered verdict for one version of one file (see the module docstring)."""
    digest = xxhash.xxh3_128_hexdigest(f"{path}\x1f{identity}".encode("utf-8", "surrogateescape"))
    return f"{QUARANTINE_PREFIX}:{variant_tag}:{digest}".encode("ascii")


def quarantine_value(path: str, identity: str, reason: str) -> bytes:
    """The record for an undecodable file."""
    return msgpack.packb({"path": path, "id": identity, "reason": reason})


def parse_quarantine(value: Any, path: str, identity: str) -> str | None:
    """Reason text from a quarantine record written for this path and identity, else None."""
    if value is None:
        return None
    try:
        d = msgpack.unpackb(bytes(value), raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if (isinstance(d, dict) and isinstance(d.get("reason"), str) and d.get("path") == path
            and d.get("id") == identity):
        return d["reason"]
    return None


def manifest_dir_for(cache: str | CacheSpec | StoreSpec) -> str:
    """Where manifests are persisted for a cache: inside an LMDB cache directory
    (``<dir>/manifests``; LMDB ignores extra files there), else under the user cache dir."""
    spec = cache if isinstance(cache, StoreSpec) else parse_cache_url(cache).store
    if spec.scheme == "lmdb":
        return os.path.join(spec.location, "manifests")
    return os.path.join(user_cache_dir(), "datacache", "manifests")


def shared_store(cache: str | CacheSpec | StoreSpec) -> Any:
    """One store object per (process, cache): LMDB refuses to open the same environment twice in
    one process, so datasets that share a cache (train + val, two sweeps in one process) share
    the handle. Per pid, so a forked child never reuses its parent's entry."""
    spec = cache if isinstance(cache, StoreSpec) else parse_cache_url(cache).store
    key = (os.getpid(), spec.url)
    st = _STORES.get(key)
    if st is None:
        st = _STORES[key] = spec.open()
    return st


def own_values(bufs: list[Any]) -> list[Any]:
    """Make store values safe to keep: ``bytes`` are kept as they are (zero copy: the tensors
    hold a reference). A ``memoryview`` (LMDB's zero-copy read, valid only until the next read
    on that store) is copied once into a per-batch arena, one allocation for the batch; the
    returned tensors are views of the arena and keep it alive."""
    views = [i for i, b in enumerate(bufs) if isinstance(b, memoryview)]
    if not views:
        return bufs
    total = sum(bufs[i].nbytes for i in views)
    arena = np.empty(total, dtype=np.uint8)
    out = list(bufs)
    off = 0
    for i in views:
        n = bufs[i].nbytes
        arena[off:off + n] = np.frombuffer(bufs[i], dtype=np.uint8)  # the one copy of a hit
        out[i] = memoryview(arena[off:off + n])
        off += n
    return out


def to_chw_tensor(pixels: np.ndarray) -> Any:
    """HWC uint8 numpy (possibly a read-only view of a store buffer) -> CHW tensor *view*."""
    import torch  # here, not at module import: `datacache warm` never needs torch

    global _readonly_warning_silenced
    if not pixels.flags.writeable and not _readonly_warning_silenced:
        # torch warns once per process about read-only arrays; the view is documented read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(pixels)
        _readonly_warning_silenced = True
    else:
        t = torch.from_numpy(pixels)
    return t.permute(2, 0, 1)
