"""Switch the communication method by step or epoch (the DAWNBench recipe of Shi et al.:
HiTopKComm for the first epochs at low resolution, 2D-Torus afterwards).

Usage::

    state = HookState(schedule=MethodSchedule([(0, "hitopk"), (13, "torus")], unit="epoch"))
    register(ddp_model, state)            # picks switch_hook because a schedule is set
    for epoch in ...: state.set_epoch(epoch); ...; maybe_step(opt, state)

The counters come from the host (``state.step`` advanced by ``finish_step``/``maybe_step``,
``state.epoch`` set by the loop), so switching costs no device sync. When the schedule moves
from a sparse method to a dense one, each bucket's error-feedback residual is flushed into its
first dense all-reduce (see ``ErrorFeedback.flush_into``), so no held-back gradient is lost.
"""

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from trainer.comm.hooks import HookState

log = logging.getLogger(__name__)

METHOD_CHOICES = ("allreduce", "naive_ag", "torus", "hitopk")
UNIT_CHOICES = ("step", "epoch")


@dataclass(frozen=True)
class MethodSchedule:
    """``phases``: ``(start, method)`` pairs, starts strictly increasing from 0, in ``unit``s."""

    phases: Sequence[tuple[int, str]]
    unit: str = "epoch"

    def __post_init__(self) -> None:
        if self.unit not in UNIT_CHOICES:
            raise ValueError(f"MethodSchedule.unit={self.unit!r}; choose one of {', '.join(UNIT_CHOICES)}")
        phases = tuple((int(s), str(m)) for s, m in self.phases)
        if not phases or phases[0][0] != 0:
            raise ValueError(f"MethodSchedule.phases must start at {self.unit} 0, got {phases!r}")
        for (s0, _), (s1, _) in itertools.pairwise(phases):
            if s1 <= s0:
                raise ValueError(f"MethodSchedule.phases starts must increase strictly, got {phases!r}")
        for _, m in phases:
            if m not in METHOD_CHOICES:
                raise ValueError(f"MethodSchedule: unknown method {m!r}; "
                                 f"choose one of {', '.join(METHOD_CHOICES)}")
        object.__setattr__(self, "phases", phases)

    def method_at(self, step: int, epoch: int) -> str:
        """The method in force at this step/epoch."""
        t = step if self.unit == "step" else epoch
        current = self.phases[0][1]
        for start, method in self.phases:
            if t >= start:
                current = method
        return current


# Real annotation objects (no postponed evaluation in this file): DDP checks them.
def switch_hook(state: "HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that runs the method ``state.schedule`` selects for the current step/epoch."""
    from trainer.comm.hooks import run_method

    if state.schedule is None:
        raise ValueError("switch_hook needs HookState.schedule (a MethodSchedule); none is set")
    method = state.schedule.method_at(state.step, state.epoch)
    if method != state.active_method:
        if state.active_method is not None:
            log.info("comm method switch: %s -> %s at step %d / epoch %d",
                     state.active_method, method, state.step, state.epoch)
            state.switches += 1
        state.active_method = method
    return run_method(state, bucket, method)
