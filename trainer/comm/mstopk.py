"""MSTopK: exact top-k by magnitude with a fixed number of counting passes (Shi et al. 2021, Alg. 1).

Algorithm 1 bisects a threshold on the VALUE range ``[mean |x|, max |x|]``: after ``N`` probes it
resolves steps of ``(max - mean) / 2**N``, so one outlier 1e9x the rest leaves every other
element in one step and the pick among them is random (recall 0.45 at d = 100k, k = 100).
Here the bisection runs on the order-preserving integer keys of ``|x|`` (``topk_keys.py``): a
fixed number of counting passes (31 for fp32, 15 for fp16/bf16, 63 for fp64) finds ``T``, the
k-th largest key, exactly, for every input. The pick is every entry above ``T`` plus, among the
entries equal to ``T``, the lowest indices: exactly ``k``, deterministic. (Algorithm 1 takes a
random window among the elements between its two thresholds; an exact search leaves only true
ties there, and a fixed rule keeps every run's and every replica's choice reproducible.)
Non-finite values follow the selection policy of ``topk_keys.py``: they rank above every finite
magnitude (as in ``torch.topk``), are always selected, and never raise.

Three paths, one result (the same indices, tested):

* **fused** (CUDA with Triton): :func:`~trainer.comm.radix_select_triton.fused_topk`, the same radix
  select as the device path in Triton kernels: 5 reads of ``x`` and 10 launches at fp32, no host sync.
* **device** (any other non-CPU device, or CUDA without Triton; ``path="device"`` forces it on the CPU):
  keys of the
  whole vector, the radix select :func:`~trainer.comm.radix_select.radix_kth_largest_key` over all
  key bits (2 counting passes at fp32, not 31), then :func:`~trainer.comm.topk_keys.select_exactly_k`.
  No host sync and no data-dependent shape: it runs unchanged on the ``meta`` device and under
  ``torch.cuda.set_sync_debug_mode("error")``.
* **compact** (CPU, ``COMPACT_MIN_NUMEL`` elements or more, ``k <= COMPACT_MAX_DENSITY * n``):
  a strided sample of ``m`` keys brackets ``T`` from below: ``t_lo`` is the sample's
  ``ceil(e + 4 sqrt(e) + 8)``-th largest key, ``e = k m / n`` (binomial error bars: a miss is
  far below 1e-4), and ``t_hi`` (rank ``e - 4 sqrt(e) - 8``) from above. One pass compacts the
  entries with key ``>= t_lo`` (a data-dependent size, free on a CPU); fewer than ``k`` of them
  above ``t_hi`` are surely selected, and the same bisection runs on the band ``[t_lo, t_hi]``
  only, over the bits in which its ends differ (a wrong ``t_hi`` just widens the band to every
  candidate). Fewer than ``k`` candidates means ``t_lo`` was wrong: the device path then runs on
  the whole vector (``path == "fallback"``). Correctness
  never depends on the sample, only speed (``bench/topk.py``; numbers in docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.comm import radix_select_triton
from trainer.comm.radix_select import radix_kth_largest_key
from trainer.comm.topk_keys import (
    check_input,
    compact_at_least,
    host_reads_free,
    key_bits,
    key_dtype,
    key_to_magnitude,
    kth_largest_key,
    magnitude_keys,
    select_exactly_k,
    strided_sample_keys,
    take,
)

SAMPLE_SIZE = 1 << 17  # keys sampled to bracket the threshold (compact path)
COMPACT_MIN_NUMEL = 1 << 15  # below this the device path is as cheap
COMPACT_MAX_DENSITY = 0.2  # above this k / numel compaction would keep most of x anyway
MARGIN_SIGMAS = 4.0  # how far below the sample estimate t_lo is set (binomial std devs)
MARGIN_EXTRA = 8  # plus this many sample ranks (protects tiny expected counts)
PATH_CHOICES = ("auto", "device", "compact")


@dataclass
class MSTopKResult:
    """Selection plus diagnostics (tests, benchmarks)."""

    values: Tensor  # x[indices], x.dtype, [k]
    indices: Tensor  # int32, unique, ascending, [k]
    threshold_key: Tensor  # 0-d: the k-th largest magnitude key (selected: every key above, lowest ties)
    path: str  # "trivial" | "fused" | "device" | "compact" | "fallback"

    @property
    def threshold(self) -> Tensor:
        """The k-th largest magnitude as a value of ``values.dtype`` (0-d)."""
        return key_to_magnitude(self.threshold_key, self.values.dtype)


def sample_ranks(n: int, k: int, m: int) -> tuple[int, int]:
    """Ranks (1-based, from the top) in a sample of ``m`` of ``n`` that bracket the k-th largest
    with high probability: ``e +/- (MARGIN_SIGMAS sqrt(e) + MARGIN_EXTRA)``, ``e = k m / n``.
    The lower bracket (first) is at least 1; the upper one is 0 when there is none."""
    expected = k * m / n
    margin = MARGIN_SIGMAS * math.sqrt(expected) + MARGIN_EXTRA
    return max(1, min(m, math.ceil(expected + margin))), max(0, math.floor(expected - margin))


def _device_path(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Positions (int64, ascending) and the threshold key; no host sync, static shapes."""
    keys = magnitude_keys(x)
    thres, need = radix_kth_largest_key(keys, k, key_bits(x.dtype))
    return select_exactly_k(keys, thres, k, need), thres


def _compact_path(x: Tensor, k: int, t_lo: int | None) -> tuple[Tensor, Tensor] | None:
    """CPU: bracket, compact, search the candidates. None when the bracket left < k candidates."""
    t_hi = None
    if t_lo is None:
        sample = strided_sample_keys(x, SAMPLE_SIZE)
        lo_rank, hi_rank = sample_ranks(x.numel(), k, sample.numel())
        top = torch.topk(sample, lo_rank).values  # descending; CPU: the host reads below are free
        t_lo = int(top[lo_rank - 1])
        t_hi = int(top[hi_rank - 1]) if hi_rank else None
    idx, keys = compact_at_least(x, t_lo)
    if idx.numel() < k:
        return None
    band, kb, hi = keys, k, None
    if t_hi is not None:
        # Entries above t_hi are surely selected when fewer than k of them exist; the search
        # then runs on the band [t_lo, t_hi] only (~5x fewer keys at 25M, k = 1 %).
        above = keys > t_hi
        n_sure = int(torch.count_nonzero(above))
        if n_sure < k:
            band, kb, hi = torch.masked_select(keys, ~above), k - n_sure, t_hi
    if hi is None:  # no t_hi, or a wrong one: the band is every candidate
        hi = int(keys.max())
    nbits = (t_lo ^ hi).bit_length()  # bits above these are common to every key in the band
    thres = kth_largest_key(band, kb, nbits, start=(t_lo >> nbits) << nbits)
    at_least = keys >= thres
    if int(torch.count_nonzero(at_least)) == k:  # no tie to break (the usual case): one compaction
        pos = torch.nonzero(at_least).squeeze(1)
    else:
        pos = select_exactly_k(keys, thres, k)
    return take(idx, pos), thres


def mstopk_with_info(x: Tensor, k: int, *, path: str = "auto",
                     bracket_key: int | None = None) -> MSTopKResult:
    """MSTopK returning the threshold and the path taken (see the module docstring).

    ``path``: ``"auto"`` (compact on large sparse CPU selections, else device), ``"device"`` or
    ``"compact"`` (CPU tensors only). ``bracket_key`` replaces the sampled lower bracket
    ``t_lo`` (a key); tests use it to force wrong brackets, which must not change the result.
    """
    if path not in PATH_CHOICES:
        raise ValueError(f"mstopk: path={path!r}; choose one of {', '.join(PATH_CHOICES)}")
    k = check_input(x, k, "mstopk")
    n = x.numel()
    if k == 0 or k == n:  # nothing to search; still the documented contract (ascending indices)
        idx = torch.arange(k, device=x.device)
        top = 0 if k else (1 << key_bits(x.dtype)) - 1  # k == n: every key is >= 0
        key = torch.full((), top, dtype=key_dtype(x.dtype), device=x.device)
        return MSTopKResult(take(x, idx), idx.to(torch.int32), key, "trivial")
    compact = path == "compact" or (
        path == "auto" and host_reads_free(x) and n >= COMPACT_MIN_NUMEL and k <= COMPACT_MAX_DENSITY * n)
    if compact:
        if x.device.type != "cpu":
            raise ValueError("mstopk: path='compact' needs a CPU tensor (data-dependent sizes); use 'device'")
        found = _compact_path(x, k, bracket_key)
        if found is not None:
            pos, thres = found
            return MSTopKResult(take(x, pos), pos.to(torch.int32), thres, "compact")
    if not compact and radix_select_triton.usable(x):  # CUDA with Triton: the fused kernels
        values, indices, thres = radix_select_triton.fused_topk(x, k)
        return MSTopKResult(values, indices, thres, "fused")
    pos, thres = _device_path(x, k)
    return MSTopKResult(take(x, pos), pos.to(torch.int32), thres, "fallback" if compact else "device")


def mstopk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Exact top-``min(k, numel)`` of ``|x|``: ``(values x[indices], int32 indices ascending)``.

    Ties at the k-th magnitude: lowest indices first. NaN/inf rank above every finite value.
    """
    res = mstopk_with_info(x, k)
    return res.values, res.indices
