"""2D-Torus all-reduce (Mikami et al. 2018, §2.2): intra reduce-scatter -> inter all-reduce ->
intra all-gather.

Each rank reduces only ``1/local_size`` of the vector across nodes, so the slow inter-node
links carry ``d/n`` elements per rank instead of ``d``. Padding: a vector whose length is not
a multiple of ``local_size`` is zero-padded at the end for the intra steps and the padding is
cut off before returning (zeros do not change a sum). ``fp16=True`` casts the payload to
float16 for all three steps and returns fp32. The input is never modified unless
``inplace=True`` (then the result is also written back into ``flat``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.collectives import all_gather_flat, all_reduce_sum_, pad_to_multiple, reduce_scatter_sum
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology


def torus_allreduce(flat: Tensor, topo: Topology, *, timer: PhaseTimer | None = None,
                    fp16: bool = False, inplace: bool = False) -> Tensor:
    """Element-wise SUM of ``flat`` over all ranks via the 2-level torus (1-D in, fp32 out)."""
    d = flat.numel()
    n = topo.local_size
    buf = flat.to(torch.float16) if fp16 else flat
    padded = pad_to_multiple(buf, n)
    with maybe_phase(timer, "communicate"):
        # reduce_scatter_sum never writes into its input, so `flat` stays untouched here.
        part = reduce_scatter_sum(padded, topo.intra)
        if part is padded:  # local_size == 1: no intra step, do not alias the caller's tensor
            part = padded.clone()
        all_reduce_sum_(part, topo.inter)
        full = all_gather_flat(part, topo.intra)
    out = full[:d]
    if out.dtype != torch.float32:
        out = out.float()
    if inplace:
        flat.copy_(out)
        return flat
    return out
