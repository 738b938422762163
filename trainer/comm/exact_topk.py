"""Exact top-k by magnitude with ``torch.topk`` on ``|x|`` (the reference the paper compares to)."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.topk_keys import WORKSPACE_MIN_NUMEL, check_input, host_reads_free, take
from trainer.comm.workspace import WORKSPACE


def exact_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exactly ``min(k, numel)`` entries with the largest ``|x|``: (values ``x[idx]``, int32 idx).

    Ties at the k-th magnitude are broken by ``torch.topk`` (unspecified order); NaN/inf rank
    above every finite value (``torch.topk``'s order, the policy of ``topk_keys.py``). Indices are
    unique, in no particular order. No host sync (``torch.topk`` has a static output size).
    """
    k = check_input(x, k, "exact_topk")
    if k == 0 or k == x.numel():
        idx = torch.arange(k, device=x.device)
        return take(x, idx), idx.to(torch.int32)
    if host_reads_free(x) and x.numel() >= WORKSPACE_MIN_NUMEL:
        # CPU: reuse the |x| buffer (fresh large buffers cost page faults; bench/results/NOTES.md).
        a = torch.abs(x, out=WORKSPACE.get("exact_abs", x.numel(), x.dtype, x.device))
    else:
        # CUDA: the caching allocator has no page-fault cost, and a fresh buffer cannot be
        # overwritten by a later call on another stream while topk still reads it.
        a = x.abs()
    idx = torch.topk(a, k, sorted=False).indices
    return take(x, idx), idx.to(torch.int32)
