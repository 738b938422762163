"""Collective building blocks shared by the algorithms, with gloo workarounds measured here.

* :func:`reduce_scatter_sum` — sum over the group, keep my ``1/size`` chunk.
* :func:`all_gather_packed` — ONE all-gather of a byte packet per rank holding int32 indices,
  optional fp32 "extras" (e.g. the non-finite flag) and the values (fp32 or fp16), instead of
  two calls (values, then indices). Every rank must send the same number of entries (our
  selectors return exactly k entries).
* :func:`all_gather_flat` — equal-size all-gather into one flat tensor (optionally into a
  caller-owned ``out``, e.g. the DDP bucket itself: no extra copy).

gloo fast path (groups of 2..``P2P_MAX_GROUP`` ranks): a direct exchange in which every rank
posts ALL its ``irecv`` before any ``isend`` (send-first ran half duplex here), receiving
into reused workspace buffers (fresh 50-100 MB buffers cost page faults: ~2x on this VM).
Measured (2 netns "nodes" x 2 ranks, 4 ranks on 2 shared cores, torch 2.13 CPU, gloo/TCP;
/tmp micro-benchmark, median of 4, ms; intra = loopback pair, inter = veth at 1 Gbit/s):

=====================================  ==========  ==========
operation                              25M fp32    2.5M fp32
=====================================  ==========  ==========
intra reduce-scatter, all_to_all+sum    400-476        17
  ... reduce_scatter_tensor (native)      599          --
  ... all_reduce + slice (reused buf)   217-250        17
  ... p2p irecv-first (reused buf)         97          11
intra all-gather (12.5M per rank):
  ... all_gather_into_tensor (native)   560-712        13
  ... all_reduce of zero-filled buffer  166-197        27
  ... p2p irecv-first (reused buf)        163           9
inter all-gather, 1 MiB/rank (two runs):
  ... native 17-29 ms, all_reduce-based 31-34 ms, p2p irecv-first 14-15 ms
  (4 MiB: native 71-80, p2p 65-69 ms: the link dominates there)
=====================================  ==========  ==========

Through this module's functions in a later run: reduce-scatter 80 ms vs 270 ms for
all_to_all_single + sum, all-gather 75 ms vs 313 ms native (same 25M fp32, intra).
(FACTS.md's "all_to_all_single beats gloo's reduce_scatter" holds; p2p beats both.) Larger
gloo groups (e.g. the world group of many nodes) use all_to_all_single + sum and gloo's
native all-gather: a direct exchange opens ``size - 1`` concurrent streams per rank. NCCL
uses its native collectives.

A ``group`` of size 1 (or no torch.distributed at all) short-circuits: no communication.
``group=None`` means the default (world) group, as in torch.distributed.

HAZARD (buffer reuse): receive buffers come from ``trainer.comm.workspace.WORKSPACE`` and are
overwritten by the next call that asks for the same key on the same thread; results handed to
callers are fresh tensors or caller-owned ``out`` buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.comm.workspace import WORKSPACE

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
P2P_MAX_GROUP = 8  # gloo groups up to this size use the direct irecv-first exchange
P2P_MIN_BYTES = 0  # measured: p2p wins at every size tried (10 MiB .. 100 MiB, 1 MiB inter)


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


def use_p2p(group: Any, nbytes: int = 0) -> bool:
    """Whether the gloo direct-exchange fast path applies to ``group`` (see module docstring)."""
    n = group_size(group)
    return (1 < n <= P2P_MAX_GROUP and nbytes >= P2P_MIN_BYTES
            and str(dist.get_backend(group)) == "gloo")


class _Works:
    """Several p2p handles waited as one (irecv handles first, then the isends)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def _exchange(sends: list[Tensor | None], recvs: list[Tensor | None], group: Any) -> _Works:
    """Start a direct exchange: ``sends[j]`` goes to group rank j, ``recvs[j]`` is filled by it.

    Every ``irecv`` is posted before any ``isend`` (send-first measured half duplex on gloo).
    Entries for my own rank are ignored. Both sides issue their ops in group-rank order, and
    messages between a pair arrive in order, so concurrent exchanges on a group match up.
    """
    me = group_rank(group)
    peers = [j for j in range(len(recvs)) if j != me]
    glob = [dist.get_global_rank(group, j) if group is not None else j for j in range(len(recvs))]
    works = [dist.irecv(recvs[j], src=glob[j], group=group) for j in peers if recvs[j] is not None]
    works += [dist.isend(sends[j], dst=glob[j], group=group) for j in peers if sends[j] is not None]
    return _Works(works)


def all_reduce_sum_(t: Tensor, group: Any) -> Tensor:
    """In-place sum over ``group``; returns ``t``."""
    if group_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def reduce_scatter_sum(flat: Tensor, group: Any, *, out: Tensor | None = None,
                       add: Tensor | None = None) -> Tensor:
    """Sum ``flat`` over ``group`` and return my ``1/size`` chunk (chunk index = my group rank).

    ``flat.numel()`` must be divisible by the group size (callers pad). ``out`` (chunk-sized,
    optional) receives the result; ``add`` (chunk-sized, optional) is added to it in the same
    pass (HiTopK's error-feedback residual). ``flat`` is only read, except that ``out`` may be
    my own chunk of ``flat`` (in-place; it is written after every send completed). gloo: direct exchange
    (chunk j goes to rank j, irecv first) into workspace buffers, then one local sum; NCCL:
    ``reduce_scatter_tensor``.
    """
    n = group_size(group)
    if flat.numel() % n != 0:
        raise ValueError(f"reduce_scatter_sum: numel {flat.numel()} not divisible by group size {n}; "
                         "pad the tensor to a multiple of the group size first")
    flat = flat.contiguous().view(-1)
    c = flat.numel() // n
    me = group_rank(group)
    if n == 1:
        if out is None and add is None:
            return flat
        res = out if out is not None else torch.empty_like(flat)
        return torch.add(flat, add, out=res) if add is not None else res.copy_(flat)
    res = out if out is not None else torch.empty(c, dtype=flat.dtype, device=flat.device)
    chunks = flat.view(n, c)
    if is_nccl(group):
        dist.reduce_scatter_tensor(res, flat, group=group)
    elif use_p2p(group, flat.numel() * flat.element_size()):
        rbuf = WORKSPACE.get("rs_recv", (n - 1) * c, flat.dtype, flat.device).view(n - 1, c)
        recvs: list[Tensor | None] = [None] * n
        for j, row in zip([j for j in range(n) if j != me], rbuf):
            recvs[j] = row
        _exchange(list(chunks), recvs, group).wait()
        torch.add(chunks[me], rbuf[0], out=res)
        for row in rbuf[1:]:
            res.add_(row)
    else:  # large gloo group: all_to_all_single + local sum (FACTS.md: beats gloo's reduce_scatter)
        recv = WORKSPACE.get("rs_a2a", flat.numel(), flat.dtype, flat.device)
        dist.all_to_all_single(recv, flat, group=group)
        torch.sum(recv.view(n, c), dim=0, out=res)
    if add is not None:
        res.add_(add)
    return res


def all_gather_flat(t: Tensor, group: Any, *, out: Tensor | None = None) -> Tensor:
    """Concatenate every rank's equal-size ``t`` in group-rank order (into ``out`` when given).

    ``t`` may already be my slice of ``out`` (then nothing is copied locally). gloo: direct
    exchange, irecv first; NCCL / large groups: one native all-gather.
    """
    n = group_size(group)
    t = t.contiguous().view(-1)
    c = t.numel()
    if out is None:
        if n == 1:
            return t
        out = torch.empty(n * c, dtype=t.dtype, device=t.device)
    elif out.numel() != n * c:
        raise ValueError(f"all_gather_flat: out has {out.numel()} elements, expected {n} x {c}")
    rows = out.view(n, c)
    mine = rows[group_rank(group)]
    if not (mine.data_ptr() == t.data_ptr() and mine.dtype == t.dtype):
        mine.copy_(t)
    if n == 1:
        return out
    if not is_nccl(group) and use_p2p(group, c * t.element_size()):
        _exchange([mine] * n, list(rows), group).wait()
    else:
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
    if not is_nccl(group) and use_p2p(group, packet.numel()):
        rows = out.view(n, -1)
        rows[group_rank(group)].copy_(packet)
        # HAZARD: the isends read `packet`, a fresh buffer owned by the handle until wait().
        work: Any = _exchange([packet] * n, list(rows), group)
        if not async_op:
            work.wait()
    else:
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
