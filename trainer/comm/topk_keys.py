"""Shared top-k selection helpers: magnitude keys, input checks, gathers, CPU compaction, and the
sync-free threshold search + exact-k pick that MSTopK (and its tests) build on.

Magnitude keys. Clearing the sign bit of an IEEE-754 value's bit pattern gives a non-negative
integer (int32 for fp32, int16 for fp16/bf16, int64 for fp64) that orders magnitudes EXACTLY:
``|a| < |b|  <=>  key(a) < key(b)`` for all finite values, denormals and ``-0.0 == +0.0``
included. A threshold search on keys therefore resolves every distinct magnitude (a search on
the value range only resolves steps of ``(max - min) / 2**iters``, which one outlier ruins).

NaN / inf policy (every selector, every path): a non-finite value counts as a LARGER magnitude
than every finite one, NaN above +inf -- the order ``torch.topk`` gives ``|x|``. So non-finite
entries are always selected (up to k of them), never skipped and never an error: a selector
never raises because of the values it is given (a rank that raised inside a collective section
would hang the others). The DDP hooks check finiteness on their own and skip the step on every
rank. In key space this policy needs no code: NaN keys are above the +inf key, which is above
every finite key.

Host/device syncs. :func:`kth_largest_key` and :func:`select_exactly_k` use only fixed-size ops
(no ``nonzero``, ``.item()`` or Python branch on a tensor value): they never sync on CUDA and
run on the ``meta`` device, which is how the tests prove it on a machine without a GPU.
:func:`compact_at_least` and :func:`sparse_nonzero` have data-dependent sizes (``nonzero``): free
on a CPU, a host sync on CUDA, so only the CPU path and the DGC baseline use them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.comm.workspace import WORKSPACE

WORKSPACE_MIN_NUMEL = 1 << 16  # smaller vectors use fresh temporaries (no page-fault cost to save)

# Debug switch: run the sync-free device code path on CPU tensors too (tests use it to exercise,
# on a machine without a GPU, the exact code the hooks and selectors run on CUDA).
DEVICE_PATH_ON_CPU = False

_KEY_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_reads_free(t: Tensor) -> bool:
    """True when reading ``t`` on the host costs no device sync (a CPU tensor), so callers may
    branch in Python on its value; False on CUDA (and on CPU under ``DEVICE_PATH_ON_CPU``)."""
    return t.device.type == "cpu" and not DEVICE_PATH_ON_CPU


def check_input(x: Tensor, k: int, name: str) -> int:
    """Validate ``x`` (1-D floating point) and return ``k`` clipped to ``[0, numel]``."""
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}; flatten it first")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.numel() > torch.iinfo(torch.int32).max:
        raise ValueError(f"{name}: {x.numel()} elements do not fit int32 indices; split the bucket")
    return max(0, min(int(k), x.numel()))


def take(t: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]`` for 1-D ``t``: ``index_select``, measured faster than advanced indexing on the CPU."""
    return torch.index_select(t, 0, idx)


def key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer type of the same width as float ``dtype`` (the key type)."""
    return _KEY_DTYPES[dtype.itemsize]


def key_bits(dtype: torch.dtype) -> int:
    """Bits of a magnitude key of float ``dtype`` (31 for fp32): keys lie in ``[0, 2**bits)``."""
    return 8 * dtype.itemsize - 1


def magnitude_keys(x: Tensor, out: Tensor | None = None) -> Tensor:
    """The order-preserving integer keys of ``|x|``: the bit pattern with the sign bit cleared.

    One elementwise pass, no host sync. ``out`` (same length, :func:`key_dtype`) is reused.
    """
    kdt = key_dtype(x.dtype)
    mask = (1 << key_bits(x.dtype)) - 1
    if out is None:
        return torch.bitwise_and(x.view(kdt), mask)
    return torch.bitwise_and(x.view(kdt), mask, out=out)


def key_to_magnitude(key: Tensor, dtype: torch.dtype) -> Tensor:
    """The magnitude (non-negative ``dtype`` value) whose key is ``key`` (0-d; a bit-cast, no sync)."""
    return key.to(key_dtype(dtype)).reshape(1).view(dtype).reshape(())


def strided_sample_keys(x: Tensor, m: int) -> Tensor:
    """Keys of about ``m`` entries of ``x``: every ``stride``-th one from a fixed offset.

    The stride is made coprime with 2, 3, 5 and 7 so the sample does not lock onto a periodic
    layout (channels, kernel taps) of a gradient; a strided read is ~10x cheaper than ``m``
    random gathers on the CPU. Deterministic: the selection result never depends on the sample
    (it only brackets the search), so there is nothing to randomise.
    """
    n = x.numel()
    stride = max(1, n // max(1, m))
    while stride > 1 and math.gcd(stride, 210) != 1:
        stride += 1
    return magnitude_keys(x[stride // 2::stride].contiguous())


def kth_largest_key(keys: Tensor, k: int, nbits: int, start: int = 0) -> Tensor:
    """The k-th largest of ``keys`` (0-d tensor), by bisection: ``nbits`` counting passes.

    Bit by bit from the top: ``T <- T | 2**b`` whenever at least ``k`` keys are ``>= T | 2**b``.
    Requires ``1 <= k <= len(keys)``, every key ``>= start`` and ``< start + 2**nbits``, and the
    low ``nbits`` bits of ``start`` zero (``start = 0, nbits = key_bits`` covers every key).
    Invariant: ``count(keys >= T) >= k``; after the last pass also ``count(keys >= T + 1) < k``,
    so ``T`` is exactly the k-th largest key. No host sync: ``T`` stays a device tensor updated
    with ``torch.where``, and the loop length depends only on ``nbits`` (a CUDA graph can hold it).
    """
    t = torch.full((), start, dtype=keys.dtype, device=keys.device)
    mask = torch.empty(keys.shape, dtype=torch.bool, device=keys.device)
    for b in reversed(range(nbits)):
        probe = t | (1 << b)
        count = torch.count_nonzero(torch.ge(keys, probe, out=mask))
        t = torch.where(count >= k, probe, t)
    return t


def select_exactly_k(keys: Tensor, thres: Tensor, k: int, need: Tensor | None = None) -> Tensor:
    """Positions (int64, ascending) of exactly ``k`` keys: every key ``> thres`` plus, among the
    keys ``== thres``, the ones at the lowest positions (the tie rule).

    ``thres`` must be the k-th largest key (:func:`kth_largest_key`), so that fewer than ``k``
    keys are above it and at least ``k`` are at or above it. ``need``: how many keys equal to
    ``thres`` to take, when the search already knows it (the radix select does); else counted here
    (in int32: no int64 copy of the mask). No host sync: ``need`` stays a device tensor and the
    compaction has the static size ``k`` (``nonzero_static``).
    """
    above = keys > thres
    if need is None:
        need = k - torch.sum(above, dtype=torch.int32)  # 1 .. number of ties, on the device
    ties = keys == thres
    rank = torch.cumsum(ties, 0, dtype=torch.int32 if keys.numel() < 2**31 else torch.int64)
    keep = above | (ties & (rank <= need))
    return torch.nonzero_static(keep, size=k, fill_value=0).squeeze(1)


def sparse_nonzero(padded: Tensor) -> Tensor:
    """``nonzero`` of a sparse bool mask whose length is a multiple of 8 (int64, ascending). CPU.

    Reads the mask as 64-bit words, finds the non-zero words, then the set bytes inside them:
    the full-length scan handles 8x fewer elements than ``torch.nonzero`` (measured faster on
    sparse masks: bench/results/NOTES.md#topk-cpu). HOST SYNC on CUDA (data-dependent size, twice).
    """
    words = padded.view(torch.int64)
    wnz = torch.nonzero(words).squeeze(1)
    pos = torch.nonzero(take(words, wnz).view(torch.uint8)).squeeze(1)
    return take(wnz, pos >> 3) * 8 + (pos & 7)


def compact_at_least(x: Tensor, thres: int) -> tuple[Tensor, Tensor]:
    """Ascending indices (int64) and keys of the entries whose key is ``>= thres``.

    One pass writes the keys and one the mask, both into reused workspace buffers for large
    ``x`` (fresh large buffers cost page faults: bench/results/NOTES.md#topk-cpu), then
    :func:`sparse_nonzero`.
    Data-dependent size: free on a CPU, a HOST SYNC on CUDA (never on MSTopK's device path).
    """
    n = x.numel()
    if n < WORKSPACE_MIN_NUMEL or x.device.type != "cpu":  # CUDA: fresh buffers (stream-safe)
        keys = magnitude_keys(x)
        idx = torch.nonzero(keys >= thres).squeeze(1)
        return idx, take(keys, idx)
    keys = magnitude_keys(x, out=WORKSPACE.get("select_keys", n, key_dtype(x.dtype), x.device))
    padded = WORKSPACE.get("select_mask", -(-n // 8) * 8, torch.bool, x.device)
    padded[n:] = False  # sparse_nonzero reads whole 64-bit words: the tail must be clear
    torch.ge(keys, thres, out=padded[:n])
    idx = sparse_nonzero(padded)
    return idx, take(keys, idx)
