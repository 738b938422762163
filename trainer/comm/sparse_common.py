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


def sanitize_(x: Tensor, flag: Tensor, *, owned: bool) -> Tensor:
    """Zero ``x`` when ``flag`` (1-element, 1.0 = non-finite) is set, so selectors never see NaN/inf.

    Selectors may reject or mis-order non-finite input (MSTopK raises), and the step will be
    skipped anyway, so the values do not matter. No host sync: a device-side masked fill.
    In place when ``owned`` (``x`` is our scratch tensor), else on a copy (never touch the
    caller's gradient).
    """
    mask = flag.reshape(()).bool()
    return x.masked_fill_(mask, 0.0) if owned else x.masked_fill(mask, 0.0)


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
        x.index_put_((idx.long(),), values.float() - sent.float())
    if bad is None:
        residual.copy_(x)
    else:
        residual.copy_(torch.where(bad, residual, x))
