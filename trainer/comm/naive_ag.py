"""NaiveAG: sparse aggregation by one flat all-gather over ALL ranks.

Every rank selects the top-k (k = round(density * d)) of its gradient (+ error-feedback
residual), all ranks all-gather the ``(values, int32 indices)`` in one packed call, and every
rank adds the ``world_size`` rows of ``k`` entries into a zero vector, row by row in rank order
(``sparse_ops.add_rows_``: deterministic, so every replica gets the same bits). The
all-gather crosses the slow inter-node links with ``(world-1) * k`` entries per rank, which is
why HiTopKComm exists; this is the baseline of Shi et al. Fig. 7.

Sizes: any ``d >= 1`` works (no padding needed: every rank sends exactly k entries).
``divide_by``: the result is the sum divided by it (the hooks pass the world size, so it is the
average); the division happens before selection and before any cast, and the residual is kept
in the divided units. Non-finite values and fp16 overflow: every packet carries one fp32 flag,
computed from the k sent values only (``wire_and_flag``: NaN/inf are always selected, and an
fp16 overflow shows up after the cast); if any rank's flag is set, every rank returns zeros and
leaves its residual unchanged (the verdict zeroes the small gathered values: no dense pass).
Buffers: the compensated vector lives in a reused workspace buffer; ``inplace=True`` (the DDP
hooks) builds the output inside ``flat`` (no allocation, no copy). No host sync on CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.comm.collectives import all_gather_packed
from trainer.comm.sparse_ops import (
    add_rows_,
    choose_k,
    compensate,
    mask_values_,
    select,
    update_residual,
    wire_and_flag,
)
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology
from trainer.comm.workspace import WORKSPACE


def naive_ag_ex(flat: Tensor, topo: Topology, *, density: float, selector: str = "auto",
                residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
                check_finite: bool = True, inplace: bool = False, divide_by: int = 1
                ) -> tuple[Tensor, Tensor | None]:
    """Like :func:`naive_ag` but also returns the global verdict (0-d bool: skip this step), or
    None when nothing was checked (``check_finite=False`` and fp32 values)."""
    d = flat.numel()
    if residual is not None and residual.numel() != d:
        raise ValueError(f"naive_ag: residual has {residual.numel()} elements, expected {d} (numel of flat)")
    world = dist.group.WORLD if dist.is_initialized() else None
    with maybe_phase(timer, "select"):
        src = flat.float()
        # HAZARD: workspace scratch, reused by the next call of this size on this thread.
        x = src if residual is None and divide_by == 1 else compensate(
            src, residual, divide_by, WORKSPACE.get("naive_ag_x", d, torch.float32, flat.device))
        values, idx = select(x, choose_k(density, d), selector)  # NaN/inf are selected, never raised on
        sent, flag = wire_and_flag(values, fp16, check_finite)
    with maybe_phase(timer, "communicate"):
        g_vals, g_idx, g_extra = all_gather_packed(sent, idx, world, extras=flag).wait()
    with maybe_phase(timer, "decompress"):
        # `flat` was only read above (selection done, packets sent), so it may hold the output.
        out = flat if inplace and flat.dtype == torch.float32 else torch.empty(d, dtype=torch.float32,
                                                                               device=flat.device)
        bad = (g_extra.sum() > 0) if g_extra is not None else None
        # Skipped step: zero the small gathered values, not the d-element output (no host sync).
        vals = mask_values_(g_vals.float(), bad)
        add_rows_(out.zero_(), g_idx, vals)
        if residual is not None:
            update_residual(residual, x, [(idx, values, sent)], bad)
        if inplace and out is not flat:
            flat.copy_(out)
            out = flat
    return out, bad


def naive_ag(flat: Tensor, topo: Topology, *, density: float, selector: str = "auto",
             residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
             check_finite: bool = True, inplace: bool = False, divide_by: int = 1) -> Tensor:
    """Element-wise SUM over ranks of each rank's top-k sparsified ``flat`` (+ ``residual``),
    divided by ``divide_by``.

    ``residual`` (fp32, numel of ``flat``) is updated in place to ``flat / divide_by + residual
    - sent``. ``inplace``: write the result into ``flat`` (the DDP hooks own their bucket buffer).
    """
    return naive_ag_ex(flat, topo, density=density, selector=selector, residual=residual, fp16=fp16,
                       timer=timer, check_finite=check_finite, inplace=inplace, divide_by=divide_by)[0]
