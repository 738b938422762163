"""Collective building blocks shared by the algorithms, dispatched on the tensor's device.

* :func:`reduce_scatter_sum` — sum over the group, keep my ``1/size`` chunk.
* :func:`all_gather_packed` — ONE all-gather of a byte packet per rank holding int32 indices,
  optional fp32 "extras" (e.g. the non-finite flag) and the values (fp32 or fp16), instead of
  two calls (values, then indices). Every rank must send the same number of entries (our
  selectors return exactly k entries).
* :func:`all_gather_flat` — equal-size all-gather into one flat tensor (optionally into a
  caller-owned ``out``, e.g. the DDP bucket itself: no extra copy).

Dispatch (:func:`path_for`): a process group may hold one backend per device type
(``init_process_group()`` with no backend gives ``"cpu:gloo,cuda:nccl"``), so the path is
chosen from the backend that serves THIS tensor's device, not from the group's backend name:

* ``"p2p"``: gloo on CPU tensors, groups of 2..``P2P_MAX_GROUP`` ranks: a direct exchange in
  which every rank posts ALL its ``irecv`` before any ``isend`` (send-first ran half duplex
  here), receiving into reused workspace buffers. It beat gloo's own collectives 2-4x on the
  emulated cluster (numbers: docs/comm_hooks.md);
* ``"a2a"``: gloo on CPU tensors, larger groups: ``all_to_all_single`` + a local sum for the
  reduce-scatter (FACTS.md: faster than gloo's reduce_scatter) and gloo's native all-gather (a
  direct exchange would open ``size - 1`` concurrent streams per rank);
* ``"native"``: every other backend/device pair (NCCL on CUDA tensors above all): the backend's
  ``reduce_scatter_tensor`` / ``all_gather_into_tensor``.

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

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
P2P_MAX_GROUP = 8  # gloo groups up to this size use the direct irecv-first exchange


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


def parse_backend_config(config: str, device_type: str) -> str:
    """The backend serving ``device_type`` in a backend config string, lower case.

    ``"gloo"`` (one backend for every device), ``"cpu:gloo,cuda:nccl"`` (one per device type,
    what ``dist.get_backend_config`` returns); ``"none"`` when no backend serves that device.
    """
    per_device: dict[str, str] = {}
    for part in (p.strip() for p in config.split(",")):
        if not part:
            continue
        if ":" not in part:
            return part.lower()
        dev, backend = part.split(":", 1)
        per_device[dev.strip().lower()] = backend.strip().lower()
    return per_device.get(device_type, "none")


def backend_for(group: Any, device: torch.device | str) -> str:
    """The backend ``group`` uses for tensors on ``device`` ("gloo", "nccl", ...; "none" without dist)."""
    if not dist.is_initialized():
        return "none"
    return parse_backend_config(str(dist.get_backend_config(group)), torch.device(device).type)


def path_for(group: Any, device: torch.device | str) -> str:
    """``"local"``, ``"p2p"``, ``"a2a"`` or ``"native"``: how collectives of ``device`` tensors run
    on ``group`` (see the module docstring)."""
    n = group_size(group)
    if n == 1:
        return "local"
    if torch.device(device).type == "cpu" and backend_for(group, device) == "gloo":
        return "p2p" if n <= P2P_MAX_GROUP else "a2a"
    return "native"


def use_p2p(group: Any, device: torch.device | str = "cpu") -> bool:
    """Whether the gloo direct-exchange fast path serves ``device`` tensors on ``group``."""
    return path_for(group, device) == "p2p"


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


def reduce_scatter_sum(flat: Tensor, group: Any, *, out: Tensor | None = None) -> Tensor:
    """Sum ``flat`` over ``group`` and return my ``1/size`` chunk (chunk index = my group rank).

    ``flat.numel()`` must be divisible by the group size (callers pad). ``out`` (chunk-sized,
    optional) receives the result. ``flat`` is only read, except that ``out`` may be my own
    chunk of ``flat`` (in place; it is written after every send completed). Each chunk is summed
    by its owner only, so every rank that later gathers it holds the same bits. Paths
    (:func:`path_for`): p2p = direct exchange (chunk j goes to rank j, irecv first) into
    workspace buffers, then one local sum; a2a = ``all_to_all_single`` + sum; native =
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
        return flat if out is None else out.copy_(flat)
    res = out if out is not None else torch.empty(c, dtype=flat.dtype, device=flat.device)
    chunks = flat.view(n, c)
    path = path_for(group, flat.device)
    if path == "native":
        dist.reduce_scatter_tensor(res, flat, group=group)
    elif path == "p2p":
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
    return res


def all_gather_flat(t: Tensor, group: Any, *, out: Tensor | None = None) -> Tensor:
    """Concatenate every rank's equal-size ``t`` in group-rank order (into ``out`` when given).

    ``t`` may already be my slice of ``out`` (then nothing is copied locally). p2p: direct
    exchange, irecv first; a2a / native: the backend's all-gather.
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
    if path_for(group, t.device) == "p2p":
        _exchange([mine] * n, list(rows), group).wait()
    else:
        all_gather_single(out, t, group=group)
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
    if path_for(group, packet.device) == "p2p":
        rows = out.view(n, -1)
        rows[group_rank(group)].copy_(packet)
        # HAZARD: the isends read `packet`, a fresh buffer owned by the handle until wait().
        work: Any = _exchange([packet] * n, list(rows), group)
        if not async_op:
            work.wait()
    else:
        work = all_gather_single(out, packet, group=group, async_op=async_op)
    return PendingGather(work if async_op else None, out, n, values.numel(), values.dtype, n_extras)


def divided_half(flat: Tensor, divide_by: int) -> Tensor:
    """``flat / divide_by`` as float16 (the dense fp16 wire format), in one pass. Dividing BEFORE
    the cast keeps averaged gradients in fp16's range (|x| <= 65504); whatever still overflows
    becomes inf, and the caller's finiteness check after the reduction flags it on every rank."""
    return torch.div(flat, divide_by, out=torch.empty(flat.numel(), dtype=torch.float16, device=flat.device))


def pad_to_multiple(flat: Tensor, n: int) -> Tensor:
    """``flat`` zero-padded at the end to a multiple of ``n`` (returned as is when it already is)."""
    d = flat.numel()
    rem = d % n
    if rem == 0:
        return flat
    out = torch.zeros(d + n - rem, dtype=flat.dtype, device=flat.device)
    out[:d].copy_(flat)
    return out
