"""FP16 wire format as a wrapper around any of this package's hooks, like PyTorch's
``fp16_compress_wrapper``::

    ddp.register_comm_hook(state, fp16_wrapper(hitopk_hook))   # or CommConfig(fp16=True)

What travels as float16: the whole payload of ``allreduce`` and ``torus``; the selected values
of ``naive_ag`` and ``hitopk`` (indices stay int32; selection and residuals stay fp32, and the
fp16 rounding error stays in the residual). Unlike ``torch``'s wrapper, which casts and then
divides, the bucket is divided by the world size BEFORE the cast, so an average that fits fp16
is never lost to an overflow of the sum. A value that still overflows (> 65504 after the
division) becomes inf and is flagged AFTER the cast exactly like a NaN: that step is skipped on
every rank, residuals keep their old (finite) values, and the next step runs normally. The
overflow check runs even with ``nan_check=False``: it is part of the wire format.

How: the wrapper marks the call (a context variable read by ``hooks.run_method`` while the hook
body runs; the asynchronous tail of a dense all-reduce captures it at launch), so it composes
with the schedule's switching hook as well. ``CommConfig(fp16=True)`` takes the same path:
``run_method`` reads ``config.fp16 or wire_fp16()``, so ``make_hook`` adds no wrapper for it.
It wraps this package's hooks only: they do the casting at the right point of each algorithm;
use torch's own wrapper for other hooks.
"""

import contextvars
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_WIRE_FP16: contextvars.ContextVar[bool] = contextvars.ContextVar("trainer_comm_wire_fp16", default=False)

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def wire_fp16() -> bool:
    """Whether the hook running now sends float16 (set by :func:`fp16_wrapper`)."""
    return _WIRE_FP16.get()


def checks_finite(nan_check: bool, fp16: bool) -> bool:
    """Whether a result is checked for NaN/inf: when ``nan_check`` asks, and ALWAYS with float16
    on the wire, whose overflow to inf is part of the format (see the module docstring)."""
    return nan_check or fp16


def fp16_wrapper(hook: Hook) -> Hook:
    """``hook`` with float16 values on the wire (see the module docstring)."""
    if not getattr(hook, "comm_hook", False):
        raise TypeError(f"fp16_wrapper wraps trainer.comm hooks (allreduce_hook, torus_hook, naive_ag_hook, "
                        f"hitopk_hook, switch_hook), got {hook!r}; for other hooks use torch's "
                        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_wrapper")

    # Real annotation objects (no postponed evaluation in this file): DDP checks them.
    def fp16_wrapper_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        token = _WIRE_FP16.set(True)
        try:
            return hook(state, bucket)
        finally:
            _WIRE_FP16.reset(token)

    fp16_wrapper_hook.comm_hook = True  # type: ignore[attr-defined]
    fp16_wrapper_hook.__qualname__ = f"fp16_wrapper({getattr(hook, '__name__', 'hook')})"
    return fp16_wrapper_hook
