"""Pieces shared by the sparse algorithms (NaiveAG, HiTopKComm): k, selection, flags, residuals."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.selectors import get_selector


def choose_k(density: float, numel: int) -> int:
    """Entries to send for ``density`` of ``numel``: ``round(density * numel)``, at least 1, at most numel."""
    if not (0.0 < density <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if numel <= 0:
        return 0
    return min(numel, max(1, round(density * numel)))


def select(x: Tensor, k: int, selector: str) -> tuple[Tensor, Tensor]:
    """Top-k of ``|x|`` by the named selector: ``(values x.dtype [k], indices int32 [k])``."""
    values, indices = get_selector(selector)(x, k)
    if indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    return values, indices


def wire_values(values: Tensor, fp16: bool) -> Tensor:
    """The values as they travel (float16 when ``fp16``)."""
    return values.to(torch.float16) if fp16 else values


def nonfinite_flag(x: Tensor) -> Tensor:
    """1-element fp32 tensor: 1.0 if ``x`` holds a NaN/inf, else 0.0. No host sync.

    One read pass (``sum``): a NaN or inf anywhere makes the sum non-finite. A sum of finite
    values that overflows fp32 (|sum| > 3.4e38) is also flagged, which is the right call:
    such a gradient would overflow the update anyway.
    """
    return (~torch.isfinite(x.sum(dtype=torch.float32))).to(torch.float32).reshape(1)


def flag_is_set(flag: Tensor) -> bool | None:
    """Host value of a 0-d / 1-element flag WHEN reading it is free, else None.

    CPU-ONLY SPECIALISATION: on CPU a tensor read is not a host/device sync, so callers may
    branch in Python and skip whole dense passes. On CUDA this returns None (reading would be
    a host sync inside the hook) and callers use device-side masks instead.
    """
    if flag.device.type == "cpu":
        return bool(flag.reshape(-1)[0].item())
    return None


def sanitize_(x: Tensor, flag: Tensor, *, owned: bool) -> Tensor:
    """Zero ``x`` when ``flag`` (1-element, 1.0 = non-finite) is set, so selectors never see NaN/inf.

    Selectors may reject or mis-order non-finite input (MSTopK raises), and the step will be
    skipped anyway, so the values do not matter. In place when ``owned`` (``x`` is our scratch
    tensor), else on a copy (never touch the caller's gradient). CPU: a Python branch, so the
    common finite case costs nothing; CUDA: a device-side masked fill (no host sync).
    """
    on_host = flag_is_set(flag)
    if on_host is not None:  # CPU branch: reading the flag is free
        if not on_host:
            return x
        return x.zero_() if owned else torch.zeros_like(x)
    mask = flag.reshape(()).bool()
    return x.masked_fill_(mask, 0.0) if owned else x.masked_fill(mask, 0.0)


def mask_values_(values: Tensor, bad: Tensor | None) -> Tensor:
    """Zero gathered ``values`` when the global verdict ``bad`` (0-d bool) is set.

    Applied to the SMALL gathered values before the scatter-add, this makes the decompressed
    output zero without a dense pass over it (no host sync: a device-side masked fill).
    """
    if bad is None:
        return values
    on_host = flag_is_set(bad)
    if on_host is not None:  # CPU branch: reading the flag is free
        return values.zero_() if on_host else values
    return values.masked_fill_(bad, 0.0)


def update_residual(residual: Tensor, x: Tensor, picks: list[tuple[Tensor, Tensor, Tensor]],
                    bad: Tensor | None) -> None:
    """Error feedback: ``residual <- x - sent`` (unchanged when the step is skipped).

    ``x`` is the compensated vector (gradient + old residual) and may be overwritten; ``picks``
    lists ``(indices int32, selected values, values as sent)``. With fp16 on the wire the
    rounding error ``value - float(fp16(value))`` stays in the residual, so nothing is lost.
    ``bad`` is the global non-finite flag (0-d bool); when set the old residual is kept:
    a skipped step drops that step's gradient on every rank.
    """
    for idx, values, sent in picks:
        if sent.dtype == values.dtype:  # fp32 wire: what was sent is exactly the value
            x.index_fill_(0, idx.long(), 0.0)
        else:
            x.index_put_((idx.long(),), values.float() - sent.float())
    on_host = None if bad is None else flag_is_set(bad)
    if bad is None or on_host is False:
        residual.copy_(x)
    elif on_host is None:  # CUDA: device-side select, written in place (no host sync)
        torch.where(bad, residual, x, out=residual)
    # on_host is True: skipped step, keep the old residual
