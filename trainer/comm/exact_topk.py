"""Exact top-k by magnitude: ``torch.topk`` on ``|x|`` (the reference the paper compares to)."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.mstopk import WORKSPACE_MIN_NUMEL, _Workspace, check_input, take


def exact_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exactly ``min(k, numel)`` entries with the largest ``|x|``: (values ``x[idx]``, int32 idx).

    Ties at the k-th magnitude are broken by ``torch.topk``.  On the CPU the ``|x|`` buffer is
    reused between calls of the same size (a fresh 25M buffer costs ~50 ms of page faults).
    Indices are unique, in no particular order.
    """
    k = check_input(x, k, "exact_topk")
    if k == 0:
        idx = torch.empty(0, dtype=torch.int64, device=x.device)
        return take(x, idx), idx.to(torch.int32)
    if k == x.numel():
        idx = torch.arange(k, device=x.device)
        return x.clone(), idx.to(torch.int32)
    if x.device.type == "cpu" and x.numel() >= WORKSPACE_MIN_NUMEL:
        a, _ = _Workspace.get(x.numel(), x.dtype, x.device)
        torch.abs(x, out=a)
    else:
        # CUDA stream hazard: nothing here syncs, so a reused buffer could be overwritten by
        # a later call on another stream while topk still reads it; the caching allocator
        # already avoids the CPU's page-fault cost, so take a fresh buffer (small x: too).
        a = x.abs()
    idx = torch.topk(a, k, sorted=False).indices  # no host sync
    return take(x, idx), idx.to(torch.int32)
