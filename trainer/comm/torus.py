"""2D-Torus all-reduce (Mikami et al. 2018, §2.2): intra reduce-scatter -> inter all-reduce ->
intra all-gather.

Each rank reduces only ``1/local_size`` of the vector across nodes, so the slow inter-node
links carry ``d/n`` elements per rank instead of ``d``. Padding: a vector whose length is not
a multiple of ``local_size`` is zero-padded at the end for the intra steps and the padding is
cut off before returning (zeros do not change a sum). ``divide_by``: the result is the sum
divided by it (the hooks pass the world size). ``fp16=True`` sends float16 in all three steps
and returns fp32; the input is divided BEFORE the cast (as PyTorch's fp16 hook should), so the
sum of averages stays in range; a value that still overflows becomes inf, which the caller's
check after the reduction sees on every rank. The input is never modified unless
``inplace=True``; then (fp32, no padding: the DDP hook's bucket) the reduce-scatter result is
written into my chunk of ``flat`` and the final all-gather fills the rest of ``flat`` directly,
so no output buffer is allocated or copied. Each chunk is reduced by one owner and gathered,
so every rank ends with the same bits. No host sync on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.collectives import (
    all_gather_flat,
    all_reduce_sum_,
    divided_half,
    group_rank,
    pad_to_multiple,
    reduce_scatter_sum,
)
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology


def torus_allreduce(flat: Tensor, topo: Topology, *, timer: PhaseTimer | None = None,
                    fp16: bool = False, inplace: bool = False, divide_by: int = 1) -> Tensor:
    """Element-wise SUM of ``flat`` over all ranks (divided by ``divide_by``) via the 2-level
    torus (1-D in, fp32 out)."""
    d = flat.numel()
    n = topo.local_size
    if fp16:
        buf = divided_half(flat, divide_by)
    else:
        buf = flat
    padded = pad_to_multiple(buf, n)
    c = padded.numel() // n
    # Output: the caller's tensor itself when allowed and shape/dtype fit (no copy at the end).
    direct = inplace and padded is flat and flat.dtype == torch.float32
    full = flat if direct else torch.empty(n * c, dtype=padded.dtype, device=flat.device)
    me = group_rank(topo.intra)
    with maybe_phase(timer, "communicate"):
        # reduce_scatter_sum only reads `padded`; the result lands in my chunk of `full` (in
        # `flat` itself when direct: that chunk's input was already sent when the call returns).
        part = reduce_scatter_sum(padded, topo.intra, out=full[me * c:(me + 1) * c])
        all_reduce_sum_(part, topo.inter)
        if divide_by != 1 and not fp16:
            part.div_(divide_by)  # my chunk only: the gather spreads the divided values
        all_gather_flat(part, topo.intra, out=full)  # gloo: irecv-first exchange into `full`
    if direct:
        return flat
    out = full[:d]
    if inplace:
        return flat.copy_(out)  # copy_ casts (fp16 wire): no fp32 temporary
    return out if out.dtype == torch.float32 else out.float()
