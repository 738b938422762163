"""A mid-epoch resume on any world size or rank layout: the rest of the epoch, exactly once.

A checkpoint taken at step ``s`` of epoch ``e`` on ``N`` ranks says, with the sampler's saved state,
which samples the first ``s`` steps trained: the saved world's plan is rebuilt (the same seed, the
same owners snapshot and rank layout for ``--sampler local``, the same earlier re-planned parts) and
its first ``s`` batches of every rank marked trained (:meth:`DistributedBatchSampler.trained_mask`).

* Same world size and (for ``local``) the same node of every rank: the saved plan simply continues,
  bit for bit.
* Anything else (``N`` -> ``M`` ranks, nodes added or gone, another number of ranks per node): the
  samples NOT yet trained this epoch become part ``k + 1`` of the epoch (an
  :class:`~trainer.data.EpochRest`), planned over the ``M`` ranks -- for ``local`` from the owners
  snapshot taken at resume time, so each node reads its own master's samples first. Every
  remaining sample is trained once more this epoch at most, none twice (the padding to a multiple
  of ``M`` and the incomplete last batch of each rank aside, as in any epoch). The global batch is
  kept: ``M`` must divide it (per-rank batch ``G / M``), otherwise the resume is refused in one
  line listing the world sizes that divide it. The next epoch is the new world's ordinary plan.

A second change in the same epoch chains: the saved rest records the flags of everything trained
before it, so parts compose. The rest's state is saved with every mid-epoch checkpoint.
"""

from __future__ import annotations

from typing import Any

from datacache.config import ConfigError
from trainer.data import DistributedBatchSampler, EpochRest
from trainer.locality import LocalityBatchSampler, describe_layout


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


def divisors(n: int, limit: int = 64) -> list[int]:
    """The world sizes up to ``limit`` that split ``n`` evenly."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def saved_sampler(sampler: DistributedBatchSampler, state: dict[str, Any] | None,
                  saved_world: int) -> DistributedBatchSampler:
    """The sampler the checkpoint's run used (its world, layout, owners and earlier re-planned rest),
    over the same indices and seed as ``sampler``; ConfigError when the state cannot say."""
    if isinstance(sampler, LocalityBatchSampler):
        if state is None or state.get("node_of_rank") is None or "owners" not in state:
            raise ConfigError("the checkpoint's locality sampler state predates the rank-layout record, so "
                              "its epoch cannot be re-planned: resume from an epoch-end checkpoint")
        layout = [int(n) for n in state["node_of_rank"]]
        if len(layout) != saved_world:
            raise ConfigError(f"the checkpoint's sampler layout names {len(layout)} ranks, its run had "
                              f"{saved_world}: damaged sampler state")
        old: DistributedBatchSampler = LocalityBatchSampler(sampler.indices, state["owners"], layout, 0,
                                                            sampler.seed, sampler.exchange)
    else:
        old = DistributedBatchSampler(sampler.indices, saved_world, 0, sampler.seed)
    if state is not None:
        old.load_state_dict(state)  # checks seed (and exchange, owners digest); restores the rest
    return old


def same_plan(sampler: DistributedBatchSampler, state: dict[str, Any] | None, saved_world: int) -> bool:
    """True when the saved epoch's plan is valid as it is on this sampler's ranks."""
    if saved_world != sampler.world_size:
        return False
    if isinstance(sampler, LocalityBatchSampler):
        layout = (state or {}).get("node_of_rank")
        return layout is None or [int(n) for n in layout] == sampler.node_of_rank  # None: refused later
    return True


def continue_epoch(sampler: DistributedBatchSampler, state: dict[str, Any] | None, *, saved_world: int,
                   global_batch: int, epoch: int, step: int) -> str:
    """Make ``sampler`` continue saved ``epoch`` at ``step`` (the next step to run); ``global_batch``
    is the checkpoint's. Returns ``""`` when the saved plan continues, else a note on the re-plan.
    Changes only the sampler; every refusal is a one-line ConfigError."""
    if same_plan(sampler, state, saved_world):
        if state is not None:
            sampler.load_state_dict(state)
        return ""
    if global_batch % sampler.world_size:
        choices = ", ".join(map(str, divisors(global_batch)))
        raise ConfigError(f"saved mid-epoch with global batch {global_batch} on {saved_world} ranks; it "
                          f"does not split over {sampler.world_size} ranks, so the rest of the epoch "
                          f"cannot keep it: resume on {choices} ranks, or from an epoch-end checkpoint")
    old = saved_sampler(sampler, state, saved_world)
    before = old.rest_for(epoch)
    old.set_epoch(epoch, before.batch if before is not None else global_batch // saved_world,
                  before.start_step if before is not None else 0)
    if not 0 < step <= old.steps_in_epoch():
        raise ConfigError(f"the checkpoint's step {step} is outside its epoch's {old.steps_in_epoch()} "
                          "steps: damaged position or sampler state")
    trained = old.trained_mask(step)
    part = (before.part if before is not None else 0) + 1
    batch = global_batch // sampler.world_size
    sampler.rest = EpochRest(epoch=epoch, part=part, start_step=step, batch=batch, trained=trained)
    left = int((~trained).sum())
    if isinstance(sampler, LocalityBatchSampler) and isinstance(old, LocalityBatchSampler):
        was, now = describe_layout(old.node_of_rank), describe_layout(sampler.node_of_rank)
    else:
        was, now = _ranks(saved_world), _ranks(sampler.world_size)
    return (f"; epoch {epoch + 1} was planned for {was}: its {left} untrained samples re-planned over {now}, "
            f"{global_batch // sampler.world_size} per rank (global batch {global_batch} kept)")
