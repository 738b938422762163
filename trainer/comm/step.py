"""``maybe_step``: the optimizer step that honours the hooks' verdict, with or without AMP.

Without a scaler: read the step's verdict flags once (the step's one host sync) and call
``optimizer.step()`` unless a bucket was non-finite on some rank.

With a ``torch.amp.GradScaler``: ``maybe_step`` replaces ``scaler.step(opt); scaler.update()``.
The hooks zero a bad bucket's gradient on every rank, so the scaler's own inf check would not
see the problem; instead the hooks' verdict is OR-ed, on the device, into the scaler's found-inf
record of this optimizer before ``scaler.step`` reads it. Then one decision holds everywhere:
the scaler skips the step exactly when the hooks flagged it or its own check found an inf, the
scale backs off once (``scaler.update()``, called once per step here), and the skip is counted
once in ``state.skipped_steps``. The step's only host read is the scaler's own (a fused
optimizer decides on the device; then the found-inf record is read here instead).

HAZARD (torch internals): the merge writes into ``GradScaler``'s per-optimizer found-inf tensors
(``_per_optimizer_states[id(opt)]["found_inf_per_device"]``, present throughout torch 2.x,
pinned by tests/test_amp_step.py). Do not call ``scaler.step``/``scaler.update`` yourself when
using ``maybe_step``; calling ``scaler.unscale_(optimizer)`` first (gradient clipping) is fine.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from trainer.comm.state import HookState


def _merge_verdict(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """OR the hooks' verdict into the scaler's found-inf record of ``optimizer`` (no host sync)."""
    per_opt = scaler._per_optimizer_states[id(optimizer)]
    if per_opt["stage"] is OptState.READY:
        scaler.unscale_(optimizer)  # records found_inf per device (device tensors, no sync)
    for found in per_opt["found_inf_per_device"].values():
        torch.maximum(found, bad.to(device=found.device, dtype=found.dtype), out=found)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the scaler found an inf for ``optimizer`` this step (HOST SYNC: reads it)."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return bool(sum(float(v.item()) for v in found.values()))


def maybe_step(optimizer: torch.optim.Optimizer, state: HookState,
               scaler: torch.amp.GradScaler | None = None) -> bool:
    """Step ``optimizer`` unless this step was flagged (or, with ``scaler``, found inf); returns
    whether it stepped. Call once per iteration after ``backward()``; it also ends the step for
    ``state`` (skip counter, residual pruning, ``state.step``)."""
    if scaler is None or not scaler.is_enabled():
        skipped = state.finish_step()  # the one host read of the step
        if not skipped:
            optimizer.step()
        return not skipped
    bad = state.step_flag()
    if bad is not None:
        _merge_verdict(scaler, optimizer, bad)
    stepped = []
    handle = optimizer.register_step_pre_hook(lambda *_: stepped.append(True))
    try:
        scaler.step(optimizer)  # unscale_ if needed; its own host read decides step or skip
    finally:
        handle.remove()
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        skipped = _found_inf(scaler, optimizer)  # fused optimizers skip on the device: read it here
    else:
        skipped = not stepped
    scaler.update()  # once per step: backs off after a skip, grows after enough good steps
    state.finish_step(skipped=skipped)
    return not skipped
