"""Pieces shared by the sparse algorithms (NaiveAG, HiTopKComm): k, compensation, selection, the
wire cast with its overflow flag, deterministic decompression, residuals.

Host/device syncs: none here. Flags stay device tensors; on a CPU (where reading a tensor is
free, ``topk_keys.host_reads_free``) a few helpers branch in Python to skip whole passes, and on
CUDA they use device-side masks instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.comm.fp16 import checks_finite
from trainer.comm.selector_registry import get_selector
from trainer.comm.topk_keys import host_reads_free


def choose_k(density: float, numel: int) -> int:
    """Entries to send for ``density`` of ``numel``: ``round(density * numel)``, at least 1, at most numel."""
    if not (0.0 < density <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if numel <= 0:
        return 0
    return min(numel, max(1, round(density * numel)))


def compensate(src: Tensor, residual: Tensor | None, divide_by: int, out: Tensor) -> Tensor:
    """``residual + src / divide_by`` into ``out`` (``out`` may be ``src``): the vector top-k
    selects from. Dividing here, before any cast, is what keeps fp16 values in range."""
    if residual is not None:
        return torch.add(residual, src, alpha=1.0 / divide_by, out=out)
    if divide_by != 1:
        return torch.mul(src, 1.0 / divide_by, out=out)
    return src if out is src else out.copy_(src)


def select(x: Tensor, k: int, selector: str) -> tuple[Tensor, Tensor]:
    """Top-k of ``|x|`` by the named selector: ``(values x.dtype [k], indices int32 [k])``."""
    values, indices = get_selector(selector)(x, k)
    if indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    return values, indices


def nonfinite_flag(x: Tensor) -> Tensor:
    """1-element fp32 tensor: 1.0 if ``x`` holds a NaN/inf, else 0.0. No host sync.

    One read pass (``sum``): a NaN or inf anywhere makes the sum non-finite (a sum of finite
    values beyond fp32's range is flagged too: such a gradient would overflow the update anyway).
    """
    return (~torch.isfinite(x.sum(dtype=torch.float32))).to(torch.float32).reshape(1)


def wire_and_flag(values: Tensor, fp16: bool, check: bool) -> tuple[Tensor, Tensor | None]:
    """The selected values as they travel (float16 when ``fp16``) and the packet's verdict flag
    (None when nothing is checked: ``check`` off and fp32).

    The flag only needs the k SENT values, never a pass over the whole vector: every selector
    ranks NaN/inf above all finite magnitudes (``topk_keys.py``), so a non-finite entry anywhere
    in the compensated vector is among the selected ones. With ``fp16`` the same check, made
    AFTER the cast, catches a value above 65504 that became inf: an overflow is flagged exactly
    like a NaN, so the step is skipped on every rank instead of sending an unflagged inf.
    """
    sent = values.to(torch.float16) if fp16 else values
    return sent, (nonfinite_flag(sent) if checks_finite(check, fp16) else None)


def flag_is_set(flag: Tensor) -> bool | None:
    """Host value of a 0-d / 1-element flag WHEN reading it is free (CPU), else None (CUDA:
    reading would be a host sync inside the hook; callers use device-side masks instead)."""
    if host_reads_free(flag):
        return bool(flag.reshape(-1)[0].item())
    return None


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


def add_rows_(out: Tensor, idx: Tensor, vals: Tensor) -> Tensor:
    """``out[idx[r]] += vals[r]`` for the rows ``r = 0, 1, ...`` IN THIS ORDER; returns ``out``.

    Deterministic decompression. Each row's indices must be unique (one rank's top-k, or the
    disjoint pieces of one rank); an index that several rows share is summed in row order. One
    ``index_add_`` per row means no two additions of one call hit the same element, so CUDA's
    atomics never race and the float sum has a fixed order: every rank that decompresses the
    same gathered rows gets the same bits (one ``index_add_`` over all rows would let the
    atomics' scheduling order the duplicates, and replicas would drift apart).
    """
    for r in range(idx.shape[0]):
        out.index_add_(0, idx[r].long(), vals[r])
    return out


def update_residual(residual: Tensor, x: Tensor, picks: list[tuple[Tensor, Tensor, Tensor]],
                    bad: Tensor | None) -> None:
    """Error feedback: ``residual <- x - sent`` (unchanged when the step is skipped).

    ``x`` is the compensated vector (:func:`compensate`) and may be overwritten; ``picks`` lists
    ``(indices int32, selected values, values as sent)``. With fp16 on the wire the rounding
    error ``value - float(fp16(value))`` stays in the residual, so nothing is lost. ``bad`` is
    the global verdict (0-d bool); when set the old residual is kept (a skipped step drops that
    step's gradient on every rank), so a NaN or an fp16 overflow never reaches a residual.
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
