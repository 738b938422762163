"""``CommConfig``: what the DDP comm hooks do (a small frozen, validated dataclass).

Run state (residuals, counters, flags) lives apart, in :class:`trainer.comm.state.HookState`.
Every invalid value raises ``ValueError`` naming the field and the valid choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.comm.names import (
    FINAL_GATHER_CHOICES,
    METHOD_CHOICES,
    OVERLAP_CHOICES,
    SELECTOR_CHOICES,
    check_choice,
)
from trainer.comm.switch import MethodSchedule


@dataclass(frozen=True)
class CommConfig:
    """Options of the comm hooks (see docs/comm_hooks.md for each one's trade-off).

    method: one of ``METHOD_CHOICES`` (ignored when ``schedule`` is set); selector: one of
    ``SELECTOR_CHOICES``; density: fraction of a bucket the sparse methods send, in (0, 1];
    fp16: float16 values on the wire (= registering ``fp16_wrapper(hook)``); error_feedback:
    keep residuals of what top-k did not send; nan_check: skip the step on every rank when any
    rank's bucket holds NaN/inf (fp16 overflow is always checked); min_numel_for_sparse:
    smaller buckets go dense; partition_numel: HiTopK pipelining piece size (0 = off);
    final_gather: HiTopK's last intra-node step ("auto", "dense", "sparse"); dense_first_step:
    reduce the first step after ``register`` densely (DDP rebuilds its buckets after it);
    schedule: a ``MethodSchedule`` switching the method by step or epoch; overlap: one of
    ``OVERLAP_CHOICES``: "none" runs each bucket's method inside DDP's hook (backward waits for
    it, except the plain dense all-reduce), "async" on a communication thread / CUDA side stream
    in bucket order, same results bit for bit (trainer/comm/comm_thread.py); "auto" times both on the
    first steps and keeps the faster (trainer/comm/overlap_auto.py); "cross" is not a DDP hook mode:
    :class:`~trainer.comm.cross_barrier.CrossBarrier` replaces DDP (``register`` refuses it).
    """

    method: str = "allreduce"
    selector: str = "auto"
    density: float = 0.01
    fp16: bool = False
    error_feedback: bool = True
    nan_check: bool = True
    min_numel_for_sparse: int = 4096
    partition_numel: int = 0
    final_gather: str = "auto"
    dense_first_step: bool = True
    schedule: MethodSchedule | None = None
    overlap: str = "none"

    def __post_init__(self) -> None:
        check_choice("CommConfig.method", self.method, METHOD_CHOICES)
        check_choice("CommConfig.selector", self.selector, SELECTOR_CHOICES)
        check_choice("CommConfig.final_gather", self.final_gather, FINAL_GATHER_CHOICES)
        check_choice("CommConfig.overlap", self.overlap, OVERLAP_CHOICES)
        if not isinstance(self.density, (int, float)) or not (0.0 < float(self.density) <= 1.0):
            raise ValueError(f"CommConfig.density={self.density!r}; must be in (0, 1], e.g. 0.01 for 1 %")
        for name in ("min_numel_for_sparse", "partition_numel"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"CommConfig.{name}={v!r}; must be an int >= 0")
        if self.schedule is not None and not isinstance(self.schedule, MethodSchedule):
            raise ValueError("CommConfig.schedule must be a trainer.comm.switch.MethodSchedule or None")

    def method_at(self, step: int, epoch: int) -> str:
        """The method in force (the schedule's, else ``method``)."""
        return self.schedule.method_at(step, epoch) if self.schedule is not None else self.method
