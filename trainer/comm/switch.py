"""``MethodSchedule``: switch the communication method by step or epoch (the DAWNBench recipe of
Shi et al.: HiTopKComm for the first epochs at low resolution, 2D-Torus afterwards).

Usage::

    config = CommConfig(schedule=MethodSchedule([(0, "hitopk"), (13, "torus")], unit="epoch"))
    state = register(ddp_model, config)   # the hook asks the schedule at every bucket
    for epoch in ...: state.set_epoch(epoch); ...; maybe_step(opt, state)

The counters come from the host (``state.step`` advanced by ``maybe_step``/``finish_step``,
``state.epoch`` set by the loop), so switching costs no device sync. When the schedule moves
from a sparse method to a dense one, each bucket's error-feedback residual is flushed into its
first dense all-reduce (see ``ErrorFeedback.flush_into``), so no held-back gradient is lost.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.comm.names import METHOD_CHOICES, UNIT_CHOICES, check_choice


@dataclass(frozen=True)
class MethodSchedule:
    """``phases``: ``(start, method)`` pairs, starts strictly increasing from 0, in ``unit``s."""

    phases: Sequence[tuple[int, str]]
    unit: str = "epoch"

    def __post_init__(self) -> None:
        check_choice("MethodSchedule.unit", self.unit, UNIT_CHOICES)
        phases = tuple((int(s), str(m)) for s, m in self.phases)
        if not phases or phases[0][0] != 0:
            raise ValueError(f"MethodSchedule.phases must start at {self.unit} 0, got {phases!r}")
        for (s0, _), (s1, _) in itertools.pairwise(phases):
            if s1 <= s0:
                raise ValueError(f"MethodSchedule.phases starts must increase strictly, got {phases!r}")
        for _, m in phases:
            check_choice("MethodSchedule method", m, METHOD_CHOICES)
        object.__setattr__(self, "phases", phases)

    def method_at(self, step: int, epoch: int) -> str:
        """The method in force at this step/epoch."""
        t = step if self.unit == "step" else epoch
        current = self.phases[0][1]
        for start, method in self.phases:
            if t >= start:
                current = method
        return current
