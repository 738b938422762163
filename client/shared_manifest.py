"""The manifest's columns in shared memory, so spawn/forkserver DataLoader workers map them.

A DataLoader worker started by ``spawn`` or ``forkserver`` receives the dataset pickled. ImageNet's
manifest is ~83 MB of numpy columns (:mod:`datacache.manifest`); pickled by value it is copied
into every worker through a pipe (8 workers: ~11 s of the start-up on 2 cores) and held once per
worker. :func:`share_manifest` copies the columns once into torch shared-memory tensors and returns
a :class:`SharedManifest` whose numpy columns are views of them. Pickled by the
``multiprocessing`` ForkingPickler -- what DataLoader uses to start workers -- each tensor travels
as a file descriptor (torch's reductions), so a worker maps the parent's pages: no copy, no
per-worker resident cost. A plain ``pickle.dumps`` still copies the values (a detached copy).
Forked workers inherit the mapping as before.

Process boundary: the shared segments live as long as any process holds a tensor of them; the
parent keeps them in ``SharedManifest._shm``. Where shared memory cannot be had (a small
``/dev/shm`` in a container), the plain manifest is kept and one line is logged.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from datacache.columns import PackedStrings
from datacache.manifest import COLUMNS, Manifest

log = logging.getLogger("client.shared_manifest")


class SharedManifest(Manifest):
    """A :class:`~datacache.manifest.Manifest` whose columns are views of shared-memory tensors."""

    _shm: dict[str, torch.Tensor]

    def __reduce__(self) -> tuple[Any, ...]:
        state = {k: v for k, v in self.__dict__.items() if k not in (*COLUMNS, "packed", "_shm")}
        return (_rebuild, (self._shm, state))


def _view(t: torch.Tensor, n: int, dtype: Any) -> np.ndarray:
    a = t.numpy()[:n].view(dtype)  # a view of the shared pages: no copy
    a.flags.writeable = False
    return a


def _rebuild(shm: dict[str, tuple[torch.Tensor, int, str]], state: dict[str, Any]) -> SharedManifest:
    m = SharedManifest.__new__(SharedManifest)
    m.__dict__.update(state)
    cols = {name: _view(t, n, np.dtype(dt)) for name, (t, n, dt) in shm.items()}
    for name in COLUMNS:
        setattr(m, name, cols[name])
    m.packed = PackedStrings(cols["blob"], cols["offsets"])
    m._shm = shm
    return m


def _to_shared(a: np.ndarray) -> tuple[torch.Tensor, int, str]:
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    t = torch.empty(max(1, raw.size), dtype=torch.uint8).share_memory_()  # 0 bytes cannot be mapped
    t.numpy()[: raw.size] = raw  # copy through numpy: the source columns are read-only views
    return t, raw.size, a.dtype.str


def share_manifest(man: Manifest) -> Manifest:
    """``man`` with its columns in shared memory (see the module docstring), or ``man`` itself when
    shared memory is not available."""
    if isinstance(man, SharedManifest):
        return man
    arrays = {name: getattr(man, name) for name in COLUMNS}
    arrays.update(blob=man.packed.blob, offsets=man.packed.offsets)
    try:
        shm = {name: _to_shared(a) for name, a in arrays.items()}
    except (RuntimeError, OSError) as e:  # e.g. /dev/shm too small for the columns
        log.warning("manifest of %d entries stays in private memory (shared memory failed: %s); spawn "
                    "workers receive a copy each", len(man), e)
        return man
    state = {k: v for k, v in man.__dict__.items() if k not in (*COLUMNS, "packed")}
    return _rebuild(shm, state)
