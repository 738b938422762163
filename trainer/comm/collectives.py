"""Collective building blocks shared by the algorithms, with the gloo workarounds of FACTS.md.

* :func:`reduce_scatter_sum` — on gloo, ``reduce_scatter`` is 2-3.5x slower than
  ``all_to_all_single`` followed by a local sum over the received chunks, so that is what we
  do there; on NCCL the native ``reduce_scatter_tensor`` is used.
* :func:`all_gather_packed` — ONE all-gather of a byte packet per rank holding int32 indices,
  optional fp32 "extras" (e.g. the non-finite flag) and the values (fp32 or fp16), instead of
  two calls (values, then indices). Every rank must send the same number of entries (gloo's
  all-gather needs equal sizes; our selectors return exactly k entries).
* :func:`all_gather_flat` — equal-size all-gather into one flat tensor.

A ``group`` of size 1 (or no torch.distributed at all) short-circuits: no communication.
``group=None`` means the default (world) group, as in torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Any) -> int:
    """Number of ranks in ``group`` (1 without torch.distributed)."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """My rank inside ``group`` (0 without torch.distributed)."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def is_nccl(group: Any) -> bool:
    return dist.is_initialized() and str(dist.get_backend(group)) == "nccl"


def all_reduce_sum_(t: Tensor, group: Any) -> Tensor:
    """In-place sum over ``group``; returns ``t``."""
    if group_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def reduce_scatter_sum(flat: Tensor, group: Any) -> Tensor:
    """Sum ``flat`` over ``group`` and return my ``1/size`` chunk (chunk index = my group rank).

    ``flat.numel()`` must be divisible by the group size (callers pad). gloo path:
    ``all_to_all_single`` sends my chunk j to group rank j; I receive every rank's copy of my
    chunk, stacked ``[size, chunk]``, and sum them locally.
    """
    n = group_size(group)
    if n == 1:
        return flat
    if flat.numel() % n != 0:
        raise ValueError(f"reduce_scatter_sum: numel {flat.numel()} not divisible by group size {n}; "
                         "pad the tensor to a multiple of the group size first")
    flat = flat.contiguous()
    if is_nccl(group):
        out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=group)
        return out
    recv = torch.empty_like(flat)
    dist.all_to_all_single(recv, flat, group=group)
    return recv.view(n, -1).sum(dim=0)


def all_gather_flat(t: Tensor, group: Any) -> Tensor:
    """Concatenate every rank's equal-size ``t`` in group-rank order (one all-gather call)."""
    n = group_size(group)
    if n == 1:
        return t.reshape(-1)
    t = t.contiguous().view(-1)
    out = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t, group=group)
    return out


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def pack(values: Tensor, indices: Tensor, extras: Tensor | None = None) -> Tensor:
    """Pack int32 indices, fp32 extras and values into one uint8 packet (bit-cast, no conversion)."""
    if indices.dtype != torch.int32:
        raise TypeError(f"pack: indices must be int32, got {indices.dtype}")
    if values.numel() != indices.numel():
        raise ValueError(f"pack: {values.numel()} values but {indices.numel()} indices")
    parts = [_as_bytes(indices)]
    if extras is not None:
        parts.append(_as_bytes(extras.to(torch.float32)))
    parts.append(_as_bytes(values))
    return torch.cat(parts)


def unpack(packets: Tensor, k: int, value_dtype: torch.dtype, n_extras: int = 0
           ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inverse of :func:`pack` for ``[ranks, bytes]`` packets: ``(values, indices, extras)``."""
    ranks = packets.shape[0]
    vsize = torch.empty((), dtype=value_dtype).element_size()
    a, b = 4 * k, 4 * k + 4 * n_extras
    if packets.shape[1] != b + vsize * k:
        raise ValueError(f"unpack: packet of {packets.shape[1]} bytes does not hold k={k} entries")
    # reshape(-1) gives a flat, stride-1 byte run (a copy for several rows), which can then be
    # bit-cast; every part starts at a multiple of 4 bytes, so the cast offsets are aligned.
    indices = packets[:, :a].reshape(-1).view(torch.int32).view(ranks, k)
    extras = packets[:, a:b].reshape(-1).view(torch.float32).view(ranks, n_extras) if n_extras else None
    values = packets[:, b:].reshape(-1).view(value_dtype).view(ranks, k)
    return values, indices, extras


@dataclass
class PendingGather:
    """An in-flight (or finished) packed all-gather; :meth:`wait` returns the unpacked parts."""

    work: Any
    out: Tensor
    ranks: int
    k: int
    value_dtype: torch.dtype
    n_extras: int

    def wait(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Block until the gather is done; ``(values [ranks,k], indices int32 [ranks,k], extras)``."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return unpack(self.out.view(self.ranks, -1), self.k, self.value_dtype, self.n_extras)


def all_gather_packed(values: Tensor, indices: Tensor, group: Any, *, extras: Tensor | None = None,
                      async_op: bool = False) -> PendingGather:
    """All-gather ``(values, int32 indices[, fp32 extras])`` from every rank of ``group`` in ONE call.

    With ``async_op=True`` the call returns immediately (the transfer runs on the backend's
    threads / stream); call ``.wait()`` before touching the result.
    """
    packet = pack(values, indices, extras)
    n = group_size(group)
    n_extras = 0 if extras is None else extras.numel()
    if n == 1:
        return PendingGather(None, packet, 1, values.numel(), values.dtype, n_extras)
    out = torch.empty(n * packet.numel(), dtype=torch.uint8, device=packet.device)
    work = _all_gather_single(out, packet, group=group, async_op=async_op)
    return PendingGather(work if async_op else None, out, n, values.numel(), values.dtype, n_extras)


def pad_to_multiple(flat: Tensor, n: int) -> Tensor:
    """``flat`` zero-padded at the end to a multiple of ``n`` (returned as is when it already is)."""
    d = flat.numel()
    rem = d % n
    if rem == 0:
        return flat
    out = torch.zeros(d + n - rem, dtype=flat.dtype, device=flat.device)
    out[:d].copy_(flat)
    return out
