"""NaiveAG: sparse aggregation by one flat all-gather over ALL ranks.

Every rank selects the top-k (k = round(density * d)) of its gradient (+ error-feedback
residual), all ranks all-gather the ``(values, int32 indices)`` in one packed call, and every
rank scatter-adds (``index_add_``) the ``world_size * k`` entries into a zero vector. The
all-gather crosses the slow inter-node links with ``(world-1) * k`` entries per rank, which is
why HiTopKComm exists; this is the baseline of Shi et al. Fig. 7.

Sizes: any ``d >= 1`` works (no padding needed: every rank sends exactly k entries).
Non-finite values: with ``check_finite`` every packet carries one fp32 flag; if any rank's
input holds NaN/inf, every rank returns zeros and leaves its residual unchanged (the verdict
zeroes the small gathered values, so no dense masking pass over the output is needed).
Buffers: the compensated vector lives in a reused workspace buffer; ``inplace=True`` (the
DDP hooks) builds the output inside ``flat`` (no allocation, no copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.comm.collectives import all_gather_packed
from trainer.comm.sparse_common import (
    choose_k,
    mask_values_,
    nonfinite_flag,
    sanitize_,
    select,
    update_residual,
    wire_values,
)
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology
from trainer.comm.workspace import WORKSPACE


def naive_ag_ex(flat: Tensor, topo: Topology, *, density: float, selector: str = "mstopk",
                residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
                check_finite: bool = True, inplace: bool = False) -> tuple[Tensor, Tensor | None]:
    """Like :func:`naive_ag` but also returns the global non-finite flag (0-d bool, or None)."""
    d = flat.numel()
    if residual is not None and residual.numel() != d:
        raise ValueError(f"naive_ag: residual has {residual.numel()} elements, expected {d} (numel of flat)")
    world = dist.group.WORLD if dist.is_initialized() else None
    with maybe_phase(timer, "select"):
        src = flat.float()
        if residual is not None:
            # HAZARD: workspace scratch, reused by the next call of this size on this thread.
            x = torch.add(src, residual, out=WORKSPACE.get("naive_ag_x", d, torch.float32, flat.device))
        else:
            x = src
        flag = nonfinite_flag(x) if check_finite else None
        if flag is not None:
            x = sanitize_(x, flag, owned=residual is not None)
        values, idx = select(x, choose_k(density, d), selector)
        sent = wire_values(values, fp16)
    with maybe_phase(timer, "communicate"):
        g_vals, g_idx, g_extra = all_gather_packed(sent, idx, world, extras=flag).wait()
    with maybe_phase(timer, "decompress"):
        # `flat` was only read above (selection done, packets sent), so it may hold the output.
        out = flat if inplace and flat.dtype == torch.float32 else torch.empty(d, dtype=torch.float32,
                                                                               device=flat.device)
        out.zero_()
        bad = (g_extra.sum() > 0) if g_extra is not None else None
        # Skipped step: zero the small gathered values, not the d-element output (no host sync).
        vals = mask_values_(g_vals.reshape(-1).float(), bad)
        out.index_add_(0, g_idx.reshape(-1).long(), vals)
        if residual is not None:
            update_residual(residual, x, [(idx, values, sent)], bad)
        if inplace and out is not flat:
            flat.copy_(out)
            out = flat
    return out, bad


def naive_ag(flat: Tensor, topo: Topology, *, density: float, selector: str = "mstopk",
             residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
             check_finite: bool = True, inplace: bool = False) -> Tensor:
    """Element-wise SUM over ranks of each rank's top-k sparsified ``flat`` (+ ``residual``).

    ``residual`` (fp32, numel of ``flat``) is updated in place to ``flat + residual - sent``.
    ``inplace``: write the result into ``flat`` (the DDP hooks own their bucket buffer).
    """
    return naive_ag_ex(flat, topo, density=density, selector=selector, residual=residual, fp16=fp16,
                       timer=timer, check_finite=check_finite, inplace=inplace)[0]
