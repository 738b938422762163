"""Parallel tensor operator (PTO, Shi et al. 2021 §4.2, eqs. 12-14) for per-layer scalars.

After DDP has averaged the gradients, every rank holds the same parameters and gradients,
so every rank would compute the same per-layer results (LARS/LAMB norms and trust ratios).
PTO splits that work: the layers are assigned to the ranks of a process group (greedy,
largest layer first, to the currently least-loaded rank — balanced by ``numel`` and
deterministic, so every rank derives the same plan without communicating), each rank
computes the scalars of ITS layers only (eq. 13) and ONE collective per step shares them
(eq. 14). Every rank then has all scalars and applies all layers' updates itself.

Collective choice (``collective=``):

* ``"all_gather"`` (default): each rank contributes a vector padded to the largest shard
  (max #layers per rank, ~161/P floats) and one ``all_gather_single`` assembles them; a
  precomputed index vector puts the scalars back in layer order. Gloo's all-gather is a
  ring of P-1 rounds; measured on loopback it is cheaper than the alternative
  (bench/results/NOTES.md#pto-gather).
* ``"all_reduce"``: a zero-filled vector of all layers, each rank writes its entries, one
  SUM all-reduce (x + 0 + ... + 0 is exact). Gloo's all-reduce is reduce-scatter +
  all-gather, i.e. about twice the rounds of the all-gather, which is why it is not the
  default; it is kept for comparison and for backends where it is faster.

Assumption: parameters and gradients are identical on the ranks of the group (gradients
already averaged by DDP or an equivalent all-reduce). PTO does not check this.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from trainer.comm.collectives import all_gather_single

COLLECTIVE_CHOICES = ("all_gather", "all_reduce")


def balanced_assignment(numels: Sequence[int], world_size: int) -> list[int]:
    """Owner rank of every layer: largest layer first, to the least-loaded rank (ties -> lowest rank).

    Deterministic for a given ``numels`` (ties between equal layers are broken by index),
    so all ranks compute the same assignment locally.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(numels)), key=lambda i: (-int(numels[i]), i))
    heap = [(0, r) for r in range(world_size)]  # (load in elements, rank)
    owner = [0] * len(numels)
    for i in order:
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + int(numels[i]), r))
    return owner


@dataclass(frozen=True)
class ShardPlan:
    """Which layers this rank computes and how gathered results map back to layer order."""

    owner: tuple[int, ...]          # owner rank of each layer
    mine: tuple[int, ...]           # layer indices this rank computes (ascending)
    max_count: int                  # largest number of layers owned by one rank (padding width)
    gather_index: tuple[int, ...]   # layer l's position in the [world * max_count] all-gather output


def make_plan(numels: Sequence[int], rank: int, world_size: int) -> ShardPlan:
    """Build the :class:`ShardPlan` of ``rank`` for layers of the given sizes."""
    owner = balanced_assignment(numels, world_size)
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for i, r in enumerate(owner):
        per_rank[r].append(i)
    max_count = max((len(x) for x in per_rank), default=0)
    gather_index = [0] * len(numels)
    for r, layers in enumerate(per_rank):
        for pos, i in enumerate(layers):
            gather_index[i] = r * max_count + pos
    return ShardPlan(tuple(owner), tuple(per_rank[rank]), max_count, tuple(gather_index))


class PTO:
    """Shards a per-layer scalar computation over a process group (``None``: default group)."""

    def __init__(self, group: ProcessGroup | None = None, collective: str = "all_gather") -> None:
        if collective not in COLLECTIVE_CHOICES:
            raise ValueError(f"unknown PTO collective {collective!r}; valid choices: {COLLECTIVE_CHOICES}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "PTO needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) (torchrun sets the env) before "
                "creating the optimizer, or pass pto=False")
        self.group = group
        self.collective = collective
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._plans: dict[tuple[int, ...], ShardPlan] = {}
        self._index: dict[tuple[tuple[int, ...], str], tuple[Tensor, Tensor]] = {}

    @classmethod
    def resolve(cls, pto: bool | ProcessGroup | PTO | None, collective: str = "all_gather") -> PTO | None:
        """Turn an optimizer's ``pto=`` argument into a :class:`PTO` (or ``None`` for no PTO)."""
        if pto is None or pto is False:
            return None
        if isinstance(pto, PTO):
            return pto
        if pto is True:
            return cls(None, collective)
        if isinstance(pto, ProcessGroup):
            return cls(pto, collective)
        raise TypeError(f"pto must be a bool, a ProcessGroup or a PTO, got {type(pto).__name__}")

    def plan(self, numels: Sequence[int]) -> ShardPlan:
        key = tuple(int(n) for n in numels)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(key, self.rank, self.world_size)
            self._plans[key] = plan
        return plan

    def _indices(self, numels: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
        key = (tuple(int(n) for n in numels), str(device))
        if key not in self._index:
            plan = self.plan(numels)
            self._index[key] = (torch.tensor(plan.mine, dtype=torch.long, device=device),
                                torch.tensor(plan.gather_index, dtype=torch.long, device=device))
        return self._index[key]

    def map(self, fn: Callable[[Sequence[int]], Tensor], numels: Sequence[int],
            device: torch.device) -> Tensor:
        """Compute ``fn`` on this rank's layers and return the fp32 results of ALL layers.

        ``fn(indices)`` gets the (ascending) layer indices this rank owns and returns a 1-D
        tensor with one value per index. It is not called when the rank owns no layer.
        """
        n_layers = len(numels)
        plan = self.plan(numels)
        if self.world_size == 1:
            return fn(plan.mine).float() if n_layers else torch.zeros(0, device=device)
        mine_t, gather_t = self._indices(numels, device)
        if self.collective == "all_gather":
            local = torch.zeros(plan.max_count, dtype=torch.float32, device=device)
            if plan.mine:
                local[: len(plan.mine)] = fn(plan.mine).float()
            out = torch.empty(self.world_size * plan.max_count, dtype=torch.float32, device=device)
            # SYNC POINT with the other ranks of the group: blocks until every rank has
            # reached this step's all-gather (one collective per step, never per layer).
            all_gather_single(out, local, group=self.group)
            return out[gather_t]
        full = torch.zeros(n_layers, dtype=torch.float32, device=device)
        if plan.mine:
            full[mine_t] = fn(plan.mine).float()
        # SYNC POINT with the other ranks of the group: one SUM all-reduce per step of a
        # vector where only the owner of each layer wrote a non-zero entry.
        dist.all_reduce(full, group=self.group)
        return full

