"""Two-level (node x local rank) process-group topology built once from torchrun's environment.

``node = rank // local_size`` and ``local_rank = rank % local_size``. Two families of groups:

* ``intra``: the ``local_size`` ranks of my node (fast links: NVLink / PCIe / shared memory);
* ``inter``: the ``num_nodes`` ranks that share my local rank, one per node (the slow network).

``dist.new_group`` is a *collective* call: every rank must create every group, in the same
order, even the groups it is not a member of. :meth:`Topology.from_env` does that and caches
the result per (default group, local size), so calling it again returns the same groups
instead of creating new ones in an order that could differ between ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

# (world size, local size) -> (the default group object it was built under, topology). The group
# object is kept (not its id) so a destroyed-and-reinitialised default group never matches.
_CACHE: dict[tuple[int, int], tuple[object, Topology]] = {}


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
    def from_env(cls, local_size: int | None = None) -> Topology:
        """Build (once) the intra- and inter-node groups. COLLECTIVE: call it on every rank.

        ``local_size`` defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun), else to the world
        size (one node). Raises ``ValueError`` if the world size is not divisible by it.
        """
        if not dist.is_initialized():
            return cls.single_process()
        world = dist.get_world_size()
        rank = dist.get_rank()
        if local_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            local_size = int(env) if env else world
        if local_size < 1 or world % local_size != 0:
            raise ValueError(
                f"Topology: world_size={world} is not divisible by local_size={local_size} "
                "(LOCAL_WORLD_SIZE from torchrun, or the local_size argument); launch the same "
                "number of processes on every node or pass local_size explicitly")
        key = (world, local_size)
        cached = _CACHE.get(key)
        if cached is not None and cached[0] is dist.group.WORLD:
            return cached[1]
        num_nodes = world // local_size
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
        _CACHE[key] = (dist.group.WORLD, topo)
        return topo
