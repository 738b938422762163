"""FP16 wire format as a wrapper around any DDP comm hook (this package's, or a plain one), like PyTorch's
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
Any other DDP comm hook (a plain PyTorch one such as torch's ``allreduce_hook``, or your own) is
wrapped the way PyTorch's ``fp16_compress_wrapper`` does it, by delegating to it: the bucket is cast
to float16 before the hook runs and the result is copied back into the fp32 gradients. That hook
does its own averaging, so here the sum is taken in float16 (the cast cannot be moved before a
division the wrapper does not control): values whose sum exceeds 65504 overflow to inf, which the
DDP NaN/inf handling of this package does not see -- prefer this package's hooks for fp16.
A hook that already casts to a 16-bit wire format (torch's ``fp16_compress_hook`` /
``bf16_compress_hook``, anything ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` or this
wrapper returned) is refused with a ValueError: a second cast would only lose precision.
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


# Names of hooks that already put 16-bit values on the wire: torch's own compress hooks and the
# functions its wrappers (and this one) return.
_CASTING_HOOKS = frozenset({"fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper_hook",
                            "bf16_compress_wrapper_hook", "fp16_wrapper_hook"})


def fp16_wrapper(hook: Hook) -> Hook:
    """``hook`` with float16 values on the wire (see the module docstring): this package's hooks
    cast at the right point of their algorithm; any other hook gets PyTorch's cast-around wrapper.

    Raises TypeError for a non-callable and ValueError for a hook that already casts."""
    if not callable(hook):
        raise TypeError(f"fp16_wrapper needs a DDP comm hook (a callable (state, bucket) -> Future), "
                        f"got {type(hook).__name__}")
    name = getattr(hook, "__name__", "")
    if getattr(hook, "wire_fp16", False) or name in _CASTING_HOOKS:
        raise ValueError(f"fp16_wrapper: hook {name or hook!r} already sends 16-bit values; a second cast "
                         "would only lose precision -- register it without fp16_wrapper")
    if not getattr(hook, "comm_hook", False):
        # A foreign hook: only the bucket's dtype can be changed around it (see the module docstring).
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

        return fp16_compress_wrapper(hook)

    # Real annotation objects (no postponed evaluation in this file): DDP checks them.
    def fp16_wrapper_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        token = _WIRE_FP16.set(True)
        try:
            return hook(state, bucket)
        finally:
            _WIRE_FP16.reset(token)

    fp16_wrapper_hook.comm_hook = True  # type: ignore[attr-defined]
    fp16_wrapper_hook.wire_fp16 = True  # type: ignore[attr-defined]
    fp16_wrapper_hook.__qualname__ = f"fp16_wrapper({getattr(hook, '__name__', 'hook')})"
    return fp16_wrapper_hook
