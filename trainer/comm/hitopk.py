"""HiTopKComm (Shi et al. 2021, Algorithm 2): hierarchical top-k aggregation.

With ``m`` nodes of ``n`` ranks and a d-element gradient:

1. intra-node reduce-scatter: local rank j gets its node's sum of chunk j (``d/n`` elements);
2. top-k selection on that chunk (+ error-feedback residual), ``k = round(density * d / n)``;
3. inter-node all-gather of ``(values, int32 indices)`` among the ranks with local rank j
   (one packed call), then scatter-add of the ``m * k`` entries into a zero chunk;
4. intra-node all-gather of the chunks: every rank holds the same d-element sum.

Padding: ``d`` not divisible by ``n`` is zero-padded to the next multiple (the padded tail is
cut off at the end; a padded zero may be picked only when the chunk has fewer than k
non-zeros, which costs nothing). The residual therefore has ``ceil(d/n)`` elements: the size
of this rank's padded chunk, and it holds the NODE's unsent mass for chunk j.

Partitioning (``partition_numel`` > 0, ByteScheduler-style): the chunk is cut into pieces of
``partition_numel // n`` elements; each piece gets its own top-k (``round(density * len)``)
and its inter-node all-gather is launched with ``async_op=True`` right away, so piece p's
transfer overlaps the selection of piece p+1. All handles are waited before the scatter-add.
Top-k per piece is not the same as top-k of the whole chunk (same total density).

Non-finite values (``check_finite``): the slice flag (NaN/inf in my node's chunk sum) rides in
the first inter packet (one fp32), and the per-chunk verdicts are summed over the node by a
1-element intra all-reduce launched asynchronously alongside the final all-gather (so its
latency hides behind the big transfer, and the gathered buffer stays a plain, copy-free
vector). Any flag set: every rank returns zeros and keeps its residual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.comm.collectives import (
    PendingGather,
    all_gather_flat,
    all_gather_packed,
    group_size,
    pad_to_multiple,
    reduce_scatter_sum,
)
from trainer.comm.sparse_common import (
    choose_k,
    nonfinite_flag,
    sanitize_,
    select,
    update_residual,
    wire_values,
)
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology


def slice_numel(d: int, local_size: int) -> int:
    """Length of each rank's (padded) chunk, i.e. the residual size for a d-element bucket."""
    return -(-d // local_size)


def partition_bounds(c: int, partition_numel: int, local_size: int) -> list[tuple[int, int]]:
    """Half-open ranges cutting a chunk of ``c`` elements into pieces (one piece when off)."""
    step = max(1, partition_numel // local_size) if partition_numel > 0 else c
    return [(a, min(a + step, c)) for a in range(0, c, step)] or [(0, 0)]


def hitopk_ex(flat: Tensor, topo: Topology, *, density: float, selector: str = "mstopk",
              residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
              partition_numel: int = 0, check_finite: bool = True) -> tuple[Tensor, Tensor | None]:
    """Like :func:`hitopk` but also returns the global non-finite flag (0-d bool, or None)."""
    d = flat.numel()
    n = topo.local_size
    c = slice_numel(d, n)
    if residual is not None and residual.numel() != c:
        raise ValueError(f"hitopk: residual has {residual.numel()} elements, expected {c} "
                         f"(= ceil({d} / local_size {n}), this rank's chunk)")
    padded = pad_to_multiple(flat.float(), n)
    with maybe_phase(timer, "communicate"):
        chunk = reduce_scatter_sum(padded, topo.intra)  # step 1 (gloo: all_to_all + local sum)
    with maybe_phase(timer, "select"):
        x = chunk + residual if residual is not None else chunk  # fresh tensor when compensated
        flag = nonfinite_flag(x) if check_finite else None
        if flag is not None:  # `chunk` is scratch unless local_size == 1 (then it may be `flat`)
            x = sanitize_(x, flag, owned=residual is not None or chunk is not flat)
    picks: list[tuple[Tensor, Tensor, Tensor]] = []
    pending: list[PendingGather] = []
    for p, (a, b) in enumerate(partition_bounds(c, partition_numel, n)):
        with maybe_phase(timer, "select"):  # step 2, piece by piece
            values, idx = select(x[a:b], choose_k(density, b - a), selector)
            if a:
                idx = idx + a
            sent = wire_values(values, fp16)
        picks.append((idx, values, sent))
        # Step 3 launched asynchronously: the transfer runs on gloo's threads (NCCL: its own
        # stream) while the next piece is selected. HAZARD: `sent`/`idx` were packed into a
        # new buffer, so they may be reused; the gathered buffer is valid only after wait().
        pending.append(all_gather_packed(sent, idx, topo.inter, extras=flag if p == 0 else None,
                                         async_op=True))
    with maybe_phase(timer, "communicate"):
        gathered = [pg.wait() for pg in pending]
    with maybe_phase(timer, "decompress"):
        out_chunk = torch.zeros(c, dtype=torch.float32, device=flat.device)
        for g_vals, g_idx, _ in gathered:
            out_chunk.index_add_(0, g_idx.reshape(-1).long(), g_vals.reshape(-1).float())
        col_flag = gathered[0][2].sum().reshape(1) if check_finite else None  # over nodes
    with maybe_phase(timer, "communicate"):
        flag_work = None
        if col_flag is not None and group_size(topo.intra) > 1:
            flag_work = dist.all_reduce(col_flag, group=topo.intra, async_op=True)
        full = all_gather_flat(out_chunk, topo.intra)  # step 4
        if flag_work is not None:
            flag_work.wait()
    with maybe_phase(timer, "decompress"):
        out = full[:d]
        bad = (col_flag[0] > 0) if col_flag is not None else None
        if bad is not None:
            out.masked_fill_(bad, 0.0)  # no host sync: the mask is a device tensor
        if residual is not None:
            update_residual(residual, x, picks, bad)
    return out, bad


def hitopk(flat: Tensor, topo: Topology, *, density: float, selector: str = "mstopk",
           residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
           partition_numel: int = 0, check_finite: bool = True) -> Tensor:
    """Element-wise SUM over ranks, aggregated hierarchically with top-k on the inter-node hop.

    ``residual`` (fp32, :func:`slice_numel` elements) is updated in place. ``partition_numel``
    > 0 pipelines selection and inter-node transfer (see the module docstring).
    """
    return hitopk_ex(flat, topo, density=density, selector=selector, residual=residual, fp16=fp16,
                     timer=timer, partition_numel=partition_numel, check_finite=check_finite)[0]
