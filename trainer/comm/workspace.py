"""Per-thread reusable scratch buffers (``WORKSPACE.get(tag, numel, dtype, device)``).

Why: on the CPU a fresh 50-100 MB buffer costs page faults on first touch that doubled some
steps of the sparse methods here, so the collectives' receive buffers, the compensated
gradient of NaiveAG / HiTopK and MSTopK's key and mask buffers are allocated once per size.

HAZARD (buffer reuse): a buffer is overwritten by the next call that asks for the same key on
the same thread. Only scratch that never leaves a call lives here; results handed to callers
are fresh tensors or caller-owned ``out`` buffers. HAZARD (CUDA streams): reuse is safe only
on one stream (kernels run in order); every user here runs on the caller's current stream,
which is where DDP runs its comm hooks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

MAX_ENTRIES = 16  # cached buffers per thread (LRU beyond that)


class Workspace:
    """Buffers keyed by ``(tag, numel, dtype, device)``, per thread, LRU-bounded.

    Thread-local because DDP may run hooks / future callbacks on more than one thread.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._local = threading.local()
        self.max_entries = max_entries

    def get(self, tag: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        """An uninitialised 1-D buffer of ``numel`` elements (contents left from its previous use)."""
        cache: OrderedDict[tuple, Tensor] = getattr(self._local, "cache", None) or OrderedDict()
        self._local.cache = cache
        key = (tag, numel, dtype, torch.device(device))
        buf = cache.pop(key, None)
        if buf is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
        cache[key] = buf
        while len(cache) > self.max_entries:
            cache.popitem(last=False)
        return buf

    def clear(self) -> None:
        """Drop this thread's buffers."""
        self._local.cache = OrderedDict()


WORKSPACE = Workspace()
