"""HiTopKComm (Shi et al. 2021, Algorithm 2): hierarchical top-k aggregation.

With ``m`` nodes of ``n`` ranks and a d-element gradient:

1. intra-node reduce-scatter: local rank j gets its node's sum of chunk j (``d/n`` elements);
2. top-k selection on that chunk (+ error-feedback residual), ``k = round(density * d / n)``;
3. inter-node all-gather of ``(values, int32 indices)`` among the ranks with local rank j
   (one packed call), then the ``m`` rows of ``k`` entries are added into a zero chunk;
4. intra-node all-gather: every rank holds the same d-element sum. Either of the dense d/n
   chunks (after step 3's adds), or, as in eq. 10, of the ``m * k`` gathered pairs, which
   every rank then adds into a zeroed d-vector; ``final_gather="auto"`` takes the sparse form
   when its packet is at most half the dense chunk's bytes (ρ < 1/(4m) in fp32).

Determinism: gathered rows are added one row at a time in node order (``add_rows_``), never
with one ``index_add_`` over duplicate indices (CUDA atomics would order the sums by chance).
Both forms of step 4 therefore give every rank the same bits, and the same bits as each other.

Padding: ``d`` not divisible by ``n`` is zero-padded to the next multiple (the padded tail is
cut off at the end; a padded zero may be picked only when the chunk has fewer than k
non-zeros, which costs nothing). The residual therefore has ``ceil(d/n)`` elements: the size
of this rank's padded chunk, and it holds the NODE's unsent mass for chunk j.

``divide_by``: the result is the sum divided by it (the hooks pass the world size). The node
sum of my chunk is divided before the residual is added and before any cast, so fp16 values
stay in range and the residual is kept in the divided units.

Partitioning (``partition_numel`` > 0, ByteScheduler-style): the chunk is cut into pieces of
``partition_numel // n`` elements; each piece gets its own top-k (``round(density * len)``)
and its inter-node all-gather is launched with ``async_op=True`` right away, so piece p's
transfer overlaps the selection of piece p+1. All handles are waited before step 3's adds.
Top-k per piece is not the same as top-k of the whole chunk (same total density).

Verdict (skip the step): every inter packet carries one fp32 flag when anything is checked
(``check_finite`` or ``fp16``), computed from that piece's sent values (``wire_and_flag``: a
NaN/inf in the piece is always selected, an fp16 overflow shows up after the cast). The column
verdicts ride in the sparse final packet, or (dense final gather) are summed over the node by a
1-element intra all-reduce right after the inter gather. The verdict zeroes the small gathered
values before the adds, so a skipped step yields zeros everywhere without a dense masking
pass. Any flag set: every rank returns zeros and keeps its residual.

Buffers: the compensated chunk lives in a reused workspace buffer, and with ``inplace=True``
(the DDP hooks) my output chunk is built inside ``flat`` and the final all-gather fills the
rest of ``flat`` directly: no output allocation and no copy. No host sync on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.collectives import (
    PendingGather,
    all_gather_flat,
    all_gather_packed,
    all_reduce_sum_,
    group_rank,
    pad_to_multiple,
    reduce_scatter_sum,
)
from trainer.comm.names import FINAL_GATHER_CHOICES, check_choice
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


def slice_numel(d: int, local_size: int) -> int:
    """Length of each rank's (padded) chunk, i.e. the residual size for a d-element bucket."""
    return -(-d // local_size)


def partition_bounds(c: int, partition_numel: int, local_size: int) -> list[tuple[int, int]]:
    """Half-open ranges cutting a chunk of ``c`` elements into pieces (one piece when off)."""
    step = max(1, partition_numel // local_size) if partition_numel > 0 else c
    return [(a, min(a + step, c)) for a in range(0, c, step)] or [(0, 0)]


def choose_final_gather(c: int, k: int, m: int, fp16: bool, final_gather: str = "auto") -> str:
    """Step 4's form for a chunk of ``c`` elements with ``k`` picks per node: "dense" or "sparse".

    ``"auto"`` picks "sparse" (eq. 10: the ``m * k`` value/index pairs) when that packet is at
    most half the dense chunk's bytes; the margin pays for sparse decompression's extra work
    (zero-filling all d elements and adding ``n * m * k`` pairs instead of ``m * k``).
    """
    check_choice("final_gather", final_gather, FINAL_GATHER_CHOICES)
    if final_gather != "auto":
        return final_gather
    pair_bytes = (2 if fp16 else 4) + 4
    return "sparse" if 2 * m * k * pair_bytes <= 4 * c else "dense"


def hitopk_ex(flat: Tensor, topo: Topology, *, density: float, selector: str = "auto",
              residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
              partition_numel: int = 0, check_finite: bool = True, inplace: bool = False,
              final_gather: str = "auto", divide_by: int = 1) -> tuple[Tensor, Tensor | None]:
    """Like :func:`hitopk` but also returns the global verdict (0-d bool: skip this step), or
    None when nothing was checked (``check_finite=False`` and fp32 values)."""
    d = flat.numel()
    n = topo.local_size
    me = group_rank(topo.intra)
    c = slice_numel(d, n)
    if residual is not None and residual.numel() != c:
        raise ValueError(f"hitopk: residual has {residual.numel()} elements, expected {c} "
                         f"(= ceil({d} / local_size {n}), this rank's chunk)")
    bounds = partition_bounds(c, partition_numel, n)
    # Validated before any communication (a bad value raises on every rank, no hang).
    mode = choose_final_gather(c, sum(choose_k(density, b - a) for a, b in bounds), topo.num_nodes, fp16,
                               final_gather)
    src = flat.float()
    padded = src if d == n * c else pad_to_multiple(src, n)
    # Output buffer: the caller's fp32 tensor itself when it may be overwritten and needs no
    # padding (the DDP hook's bucket: no copy at the end), else a fresh one.
    direct = inplace and padded is flat
    full = flat if direct else torch.empty(n * c, dtype=torch.float32, device=flat.device)
    # Scratch for the compensated chunk x (HAZARD: workspace, reused by the next call).
    x = WORKSPACE.get("hitopk_x", c, torch.float32, flat.device)
    with maybe_phase(timer, "communicate"):
        # Step 1. reduce_scatter_sum only reads `padded`, so `flat` is intact until step 4 writes it.
        reduce_scatter_sum(padded, topo.intra, out=x)
    with maybe_phase(timer, "select"):
        compensate(x, residual, divide_by, out=x)
    picks: list[tuple[Tensor, Tensor, Tensor]] = []
    pending: list[PendingGather] = []
    for a, b in bounds:
        with maybe_phase(timer, "select"):  # step 2, piece by piece
            values, idx = select(x[a:b], choose_k(density, b - a), selector)
            if a:
                idx = idx + a
            sent, flag = wire_and_flag(values, fp16, check_finite)  # this piece's verdict
        picks.append((idx, values, sent))
        # Step 3 launched asynchronously: the transfer runs on gloo's threads (NCCL: its own
        # stream) while the next piece is selected. HAZARD: `sent`/`idx` were packed into a
        # new buffer, so they may be reused; the gathered buffer is valid only after wait().
        pending.append(all_gather_packed(sent, idx, topo.inter, extras=flag, async_op=True))
    with maybe_phase(timer, "communicate"):
        gathered = [pg.wait() for pg in pending]
        # Node-major rows: row p = node p's picks over all pieces (pieces have disjoint indices).
        g_vals = torch.cat([g[0] for g in gathered], dim=1)
        g_idx = torch.cat([g[1] for g in gathered], dim=1)
        col_flag = sum(g[2].sum() for g in gathered).reshape(1) if gathered[0][2] is not None else None
    if mode == "sparse":  # eq. 10: gather the m*k pairs of every column, add them into d
        with maybe_phase(timer, "communicate"):
            # The column verdicts ride in the same packet: no separate flag all-reduce.
            f_vals, f_idx, f_extra = all_gather_packed(g_vals.reshape(-1), g_idx.reshape(-1), topo.intra,
                                                       extras=col_flag).wait()
            bad = (f_extra.sum() > 0) if f_extra is not None else None
        with maybe_phase(timer, "decompress"):
            m, kk = g_idx.shape
            offsets = torch.arange(n, device=flat.device, dtype=torch.long).view(n, 1, 1) * c
            # rows = nodes, in node order; a row holds every column's picks of that node (disjoint)
            rows_idx = (f_idx.view(n, m, kk).long() + offsets).transpose(0, 1).reshape(m, n * kk)
            rows_val = mask_values_(f_vals.float(), bad).view(n, m, kk).transpose(0, 1).reshape(m, n * kk)
            add_rows_(full.zero_(), rows_idx, rows_val)  # skipped: all zeros
    else:  # dense chunk: add my column's rows, then all-gather the d/n chunks
        bad = None
        if col_flag is not None:
            # Verdict over the node's columns: a 1-element intra all-reduce BEFORE decompressing,
            # so the mask hits the small gathered values instead of the d-element output.
            with maybe_phase(timer, "communicate"):
                all_reduce_sum_(col_flag, topo.intra)
                bad = col_flag[0] > 0
        with maybe_phase(timer, "decompress"):
            out_chunk = full[me * c:(me + 1) * c]  # my chunk of the output, written in place
            add_rows_(out_chunk.zero_(), g_idx, mask_values_(g_vals.float(), bad))  # skipped: zeros
        with maybe_phase(timer, "communicate"):
            all_gather_flat(out_chunk, topo.intra, out=full)  # step 4 (gloo: irecv-first exchange)
    with maybe_phase(timer, "decompress"):
        if residual is not None:
            update_residual(residual, x, picks, bad)
        if direct:
            return flat, bad
        out = full[:d]
        if inplace:
            flat.copy_(out)
            return flat, bad
    return out, bad


def hitopk(flat: Tensor, topo: Topology, *, density: float, selector: str = "auto",
           residual: Tensor | None = None, fp16: bool = False, timer: PhaseTimer | None = None,
           partition_numel: int = 0, check_finite: bool = True, inplace: bool = False,
           final_gather: str = "auto", divide_by: int = 1) -> Tensor:
    """Element-wise SUM over ranks (divided by ``divide_by``), aggregated hierarchically with
    top-k on the inter-node hop.

    ``residual`` (fp32, :func:`slice_numel` elements) is updated in place. ``partition_numel``
    > 0 pipelines selection and inter-node transfer (see the module docstring). ``inplace``:
    the result is written into ``flat`` (fp32; the DDP hooks own their bucket buffer), which
    saves an output allocation; otherwise ``flat`` is left untouched. ``final_gather``: step 4
    as a dense chunk all-gather or eq. 10's sparse one (:func:`choose_final_gather`).
    """
    return hitopk_ex(flat, topo, density=density, selector=selector, residual=residual, fp16=fp16,
                     timer=timer, partition_numel=partition_numel, check_finite=check_finite,
                     inplace=inplace, final_gather=final_gather, divide_by=divide_by)[0]
