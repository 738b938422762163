"""``auto``: the faster exact selector for the tensor's device, chosen from metadata alone.

Measured side by side (``bench/topk.py``; ``bench/results/topk.json`` and ``topk_gpu.json``): on the CPU
MSTopK's fixed-pass threshold search beats ``torch.topk`` many times over, while on an H100 CUDA's
radix-select ``torch.topk`` beats MSTopK's dozens of full-vector passes by about as much. Both are exact
(the same magnitudes; ties may go to other indices) and sync-free on CUDA, so ``auto`` takes MSTopK
where host reads are free (CPU tensors) and ``torch.topk`` elsewhere (CUDA, or the CUDA code path forced
on the CPU by ``topk_keys.DEVICE_PATH_ON_CPU``). The choice reads ``x.device`` only: no host sync.
"""

from __future__ import annotations

from torch import Tensor

from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import mstopk
from trainer.comm.topk_keys import host_reads_free


def auto_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``mstopk(x, k)`` on the CPU, ``exact_topk(x, k)`` on a device (see the module docstring)."""
    return mstopk(x, k) if host_reads_free(x) else exact_topk(x, k)


def auto_resolves_to(device_type: str) -> str:
    """The selector ``auto`` runs on tensors of ``device_type`` (the trainer's ``start`` record says it)."""
    return "mstopk" if device_type == "cpu" else "exact"
