"""Two-level (node x local rank) process-group topology built once from torchrun's environment.

``node = rank // local_size`` and ``local_rank = rank % local_size``: the hooks assume ranks are
numbered node by node with the same ``local_size`` on every node (what torchrun does).
:meth:`Topology.from_env` checks that assumption once, at start-up: it gathers every rank's host
name, ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` (one all-gather of a fixed 256-byte record per
rank, no pickling: :func:`_gather_layout`) and raises a clear ``ValueError`` -- on every rank
alike, since all decide from the same gathered list -- when a node's ranks sit on different
hosts, local sizes differ, or ``LOCAL_RANK`` disagrees with the numbering. One host may hold
several nodes (emulated nodes: tests, the netns benchmark); that is logged. Two families of groups:

* ``intra``: the ``local_size`` ranks of my node (fast links: NVLink / PCIe / shared memory);
* ``inter``: the ``num_nodes`` ranks that share my local rank, one per node (the slow network).

``dist.new_group`` is a *collective* call: every rank must create every group, in the same
order, even the groups it is not a member of. :meth:`Topology.from_env` does that and caches
the result per (default group, local size), so calling it again returns the same groups
instead of creating new ones in an order that could differ between ranks.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from trainer.comm.collectives import all_gather_single, backend_for

log = logging.getLogger(__name__)

# (world size, local size) -> (the default group object it was built under, topology). The group
# object is kept (not its id) so a destroyed-and-reinitialised default group never matches.
_CACHE: dict[tuple[int, int], tuple[object, Topology]] = {}


_HOST_BYTES = 240  # host names are at most 253 bytes (DNS); longer ones are cut (compared cut)


def _gather_layout(host: str, local_size: int, local_rank: int) -> list[tuple[str, int, int]]:
    """COLLECTIVE: ``(host, local_size, local_rank)`` of every rank, in rank order.

    One all-gather of a fixed 256-byte record per rank (no pickling), on the CPU when the
    default group has a CPU backend, else on the current CUDA device (NCCL-only groups).
    """
    record = torch.zeros(_HOST_BYTES + 16, dtype=torch.uint8)
    name = host.encode("utf-8", "replace")[:_HOST_BYTES]
    record[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    record[_HOST_BYTES:].view(torch.int64).copy_(torch.tensor([local_size, local_rank]))
    device = "cpu" if backend_for(None, "cpu") != "none" else f"cuda:{torch.cuda.current_device()}"
    out = torch.empty(dist.get_world_size() * record.numel(), dtype=torch.uint8, device=device)
    all_gather_single(out, record.to(device))
    rows = out.cpu().view(-1, record.numel())
    layout = []
    for row in rows:
        ints = row[_HOST_BYTES:].clone().view(torch.int64).tolist()
        layout.append((bytes(row[:_HOST_BYTES].tolist()).rstrip(b"\0").decode("utf-8", "replace"),
                       int(ints[0]), int(ints[1])))
    return layout


def check_layout(hosts: list[str], local_sizes: list[int], local_ranks: list[int], local_size: int) -> int:
    """Validate the gathered per-rank layout against the node-contiguous numbering; returns the
    number of hosts. ``local_ranks[r]`` is -1 where ``LOCAL_RANK`` was not set. Raises
    ``ValueError`` naming the ranks and hosts and what to do."""
    world = len(hosts)
    if len(set(local_sizes)) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(local_sizes))
        raise ValueError(f"Topology: LOCAL_WORLD_SIZE differs between ranks ({detail}); launch the same "
                         "number of processes on every node (torchrun --nproc-per-node N)")
    if local_size < 1 or world % local_size != 0:
        raise ValueError(
            f"Topology: world_size={world} is not divisible by local_size={local_size} "
            "(LOCAL_WORLD_SIZE from torchrun, or the local_size argument); launch the same "
            "number of processes on every node or pass local_size explicitly")
    for node in range(world // local_size):
        ranks = range(node * local_size, (node + 1) * local_size)
        on = sorted({hosts[r] for r in ranks})
        if len(on) > 1:
            where = ", ".join(f"rank {r} on {hosts[r]!r}" for r in ranks)
            raise ValueError(
                f"Topology: node {node} (ranks {ranks.start}..{ranks.stop - 1}, local_size={local_size}) "
                f"spans hosts {on}: {where}. The hooks assume ranks numbered node by node with the same "
                "number per host (torchrun's numbering); relaunch with torchrun, or set LOCAL_WORLD_SIZE "
                "to the number of processes per host")
    for r, lr in enumerate(local_ranks):
        if lr >= 0 and lr != r % local_size:
            raise ValueError(f"Topology: rank {r} has LOCAL_RANK={lr} but the node-by-node numbering gives "
                             f"local rank {r % local_size} (local_size={local_size}); launch with torchrun "
                             "or number ranks node by node")
    return len(set(hosts))


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in an ``num_nodes x local_size`` grid, with its two process groups.

    ``intra``/``inter`` are ``None`` only when torch.distributed is not initialised (a single
    process); the collectives in :mod:`trainer.comm.collectives` treat a ``None`` group of
    size 1 as the identity.
    """

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: int
    num_nodes: int
    intra: ProcessGroup | None = field(default=None, repr=False, compare=False)
    inter: ProcessGroup | None = field(default=None, repr=False, compare=False)

    @property
    def intra_ranks(self) -> list[int]:
        """Global ranks of my node, in local-rank order."""
        return [self.node * self.local_size + j for j in range(self.local_size)]

    @property
    def inter_ranks(self) -> list[int]:
        """Global ranks with my local rank, one per node, in node order."""
        return [i * self.local_size + self.local_rank for i in range(self.num_nodes)]

    @property
    def backend(self) -> str:
        """The default group's backend name (``"gloo"``, ``"nccl"``), ``"none"`` without dist."""
        return str(dist.get_backend()) if dist.is_initialized() else "none"

    def describe(self) -> dict[str, Any]:
        """Plain-data description (for checkpoints and logs)."""
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "local_size": self.local_size, "node": self.node, "num_nodes": self.num_nodes}

    @classmethod
    def single_process(cls) -> Topology:
        """A 1 x 1 topology with no groups (no torch.distributed)."""
        return cls(rank=0, world_size=1, local_rank=0, local_size=1, node=0, num_nodes=1)

    @classmethod
    def from_env(cls, local_size: int | None = None, *, host: str | None = None) -> Topology:
        """Build (once) the intra- and inter-node groups. COLLECTIVE: call it on every rank.

        ``local_size`` defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun), else to the world
        size (one node). ``host`` replaces this machine's host name (tests; such a call is never
        cached, because a cache hit must be the same on every rank or the gather below would
        not be matched). The layout is
        checked against the host names first (:func:`check_layout`; ``ValueError`` on every
        rank if it does not fit). With an NCCL-only default group, call
        ``torch.cuda.set_device(local_rank)`` first (the gather uses the current device).
        """
        if not dist.is_initialized():
            return cls.single_process()
        world = dist.get_world_size()
        rank = dist.get_rank()
        if local_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            local_size = int(env) if env else world
        key = (world, local_size)
        cached = _CACHE.get(key) if host is None else None
        if cached is not None and cached[0] is dist.group.WORLD:
            return cached[1]
        local_rank_env = int(os.environ.get("LOCAL_RANK", -1))
        layout = _gather_layout(host or socket.gethostname(), local_size, local_rank_env)
        num_hosts = check_layout([h for h, _, _ in layout], [s for _, s, _ in layout],
                                 [lr for _, _, lr in layout], local_size)
        num_nodes = world // local_size
        if num_hosts < num_nodes and rank == 0:
            log.warning("Topology: %d nodes of %d ranks on %d host(s): several nodes share a host "
                        "(emulated nodes; on a real cluster set LOCAL_WORLD_SIZE to the processes per host)",
                        num_nodes, local_size, num_hosts)
        node, local_rank = divmod(rank, local_size)
        intra: ProcessGroup | None = None
        inter: ProcessGroup | None = None
        # Collective: every rank creates every group in the same order (intra groups node by
        # node, then inter groups local rank by local rank) and keeps only its own.
        for i in range(num_nodes):
            g = dist.new_group([i * local_size + j for j in range(local_size)])
            if i == node:
                intra = g
        for j in range(local_size):
            g = dist.new_group([i * local_size + j for i in range(num_nodes)])
            if j == local_rank:
                inter = g
        topo = cls(rank=rank, world_size=world, local_rank=local_rank, local_size=local_size,
                   node=node, num_nodes=num_nodes, intra=intra, inter=inter)
        if host is None:
            _CACHE[key] = (dist.group.WORLD, topo)
        return topo
