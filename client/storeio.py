"""Store-side helpers of the client: one store handle per process, owning store buffers,
where manifests are persisted, and the quarantine records.

Quarantine records (``dcq`` key prefix, same fingerprint/variant/index as the sample key)
remember files that could not be *decoded*, as a small msgpack map ``{path, reason}``, so a
later run or ``datacache warm`` does not re-read them. They are untrusted input like any
cache value: parsed with msgpack only and type-checked.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import msgpack
import numpy as np

from datacache.config import user_cache_dir
from datacache.source import SourceError
from datacache.stores import open_store

QUARANTINE_PREFIX = "dcq"
_STORES: dict[tuple[int, str], Any] = {}
_readonly_warning_silenced = False


def read_failure_reason(err: BaseException) -> str:
    """Quarantine reason for a file the source could not read (names the underlying cause)."""
    cause = err.cause if isinstance(err, SourceError) else err
    return f"cannot read the file: {cause}"


def quarantine_value(path: str, reason: str) -> bytes:
    """The ``dcq`` record for an undecodable file."""
    return msgpack.packb({"path": path, "reason": reason})


def manifest_dir_for(cache_url: str) -> str:
    """Where manifests are persisted for ``cache_url``: inside an LMDB cache directory
    (``<dir>/manifests``; LMDB ignores extra files there), else under the user cache dir."""
    scheme, _, rest = cache_url.partition("://")
    if scheme == "lmdb" and rest:
        path = rest if os.path.isabs(rest) else os.path.abspath(rest)
        return os.path.join(path, "manifests")
    return os.path.join(user_cache_dir(), "datacache", "manifests")


def shared_store(url: str) -> Any:
    """One store object per (process, URL): LMDB refuses to open the same environment twice in
    one process, so datasets that share a cache (train + val, two sweeps in one process) share
    the handle. Per pid, so a forked child never reuses its parent's entry."""
    key = (os.getpid(), url)
    st = _STORES.get(key)
    if st is None:
        st = _STORES[key] = open_store(url)
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


def parse_quarantine(value: Any) -> str | None:
    """Reason text from a ``dcq`` record, or None. The value is untrusted: msgpack only, checked."""
    if value is None:
        return None
    try:
        d = msgpack.unpackb(bytes(value), raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if isinstance(d, dict) and isinstance(d.get("reason"), str):
        return d["reason"]
    return None


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
