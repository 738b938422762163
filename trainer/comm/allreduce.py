"""Dense all-reduce baseline: one ``all_reduce`` (SUM) of the whole flat gradient over the world.

``divide_by``: the result is the sum divided by it (the hooks pass the world size).
``fp16=True`` sends float16 (half the bytes; the backend accumulates in fp16, so expect ~1e-3
relative error) and returns fp32. The input is divided BEFORE the cast, so the sum of averages
stays in range; a value that still overflows becomes inf, which the caller's check after the
reduction sees on every rank. The input is not modified unless ``inplace=True``: callers that
own the buffer (the DDP hooks, bench/comm.py's scratch bucket) pass it and skip the copy.
No host sync on CUDA.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from trainer.comm.collectives import all_reduce_sum_, divided_half
from trainer.comm.timing import PhaseTimer, maybe_phase
from trainer.comm.topology import Topology


def allreduce_dense(flat: Tensor, topo: Topology, *, timer: PhaseTimer | None = None,
                    fp16: bool = False, inplace: bool = False, divide_by: int = 1) -> Tensor:
    """Element-wise SUM of ``flat`` over all ranks, divided by ``divide_by`` (1-D float in, fp32 out)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if fp16:
        buf = divided_half(flat, divide_by)
    else:
        buf = flat if inplace else flat.clone()
    with maybe_phase(timer, "communicate"):
        all_reduce_sum_(buf, world)
    if not fp16:
        return buf.div_(divide_by) if divide_by != 1 else buf
    if inplace:
        return flat.copy_(buf)
    return buf.float()
