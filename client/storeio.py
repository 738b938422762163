"""Buffer helpers of the client: owning store buffers and the zero-copy CHW tensor view."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

_readonly_warning_silenced = False


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
