"""MSTopK: approximate top-k by a threshold binary search (Shi et al. 2021, Algorithm 1).

``mstopk(x, k)`` returns exactly ``k`` entries of ``x`` with (approximately) the largest
magnitudes, without sorting.  Algorithm 1 bisects a threshold between two bounds (``mean``
and ``max`` of ``|x|`` in the paper); after ``iters`` probes it holds ``thres1`` (``k1 <= k``
elements ``>= thres1``) and ``thres2`` (``k2 > k`` elements ``>= thres2``), takes the ``k1``
and a random contiguous window of ``k - k1`` of the ``k2 - k1`` elements in between.
The loop state (``l, r, k1, k2, thres1, thres2``) is 0-d tensors updated with
``torch.where``: no Python branch on a tensor value, no host sync inside the loop.

Candidate compaction (what makes it pay on a CPU).  A systematic sample of ``|x|`` (131 072
entries) brackets the k-th largest magnitude between ``t_lo`` and ``t_hi`` (sample ranks
``e -/+ (4 sqrt(e) + 8)``, ``e = k m / n``: binomial error bars).  ONE pass compacts the
entries with ``|x| >= t_lo`` (host sync, outside the loop); those above ``t_hi`` are taken
outright and Algorithm 1 runs with bounds ``[t_lo, t_hi]`` on the band in between only.
Every probe there counts the same (plus the sure ones) as on the full vector, so the branches
are those of the full-vector search.  A band above 32768 elements (25M at k = 1 %: ~58k) is
bracketed again inside the band, so the 30 passes stay below torch's parallel grain.
Guards: fewer than k candidates -> full-vector search (``path == "fallback"``); more than k
above ``t_hi`` -> the search covers all candidates.  Both are tested.

Measured here (2 cores shared with other jobs, load 7-15, one torch thread, 25M fp32):
- ``torch.topk(|x|)`` 0.35-0.9 s at k = 0.1 %, 0.7-2.4 s at 1 % (FACTS.md: 285/540 ms idle);
  the naive 30-pass Algorithm 1 is no faster (FACTS.md) -> compaction.
- ``abs``/``ge`` into reused buffers ~23 ms together vs 50-130 ms into fresh ones (page
  faults): kept (``_Workspace``).  ``count_nonzero`` 6 ms vs ``bool.sum()`` 120 ms: kept.
- ``torch.nonzero`` of the 25M mask 59-84 ms; reading it as 64-bit words first
  (``sparse_nonzero``) 8-23 ms: kept.  ``index_select`` 3 ms vs ``x[idx]`` 15 ms for 250k
  indices: kept (``take``).  Strided sample 0.2-1 ms vs 2.4-4 ms of random gathers: kept.
- Walking x in L2-sized chunks (256k-4M): no gain with one thread, 2-10x slower with two
  threads on busy cores (a barrier per small op): dropped.  The second bracketing level cut
  the 2-thread time at k = 1 % from ~1.8 s (median; 60 parallel passes) to ~45 ms.
- ``torch.compile`` of the fused ``|x| >= t`` mask: 54 s to compile and 175 ms per call vs
  23 ms eager (CPU inductor): dropped; the remaining passes run on small bands anyway.
Results (bench/results/topk.json, quiet machine): 8.5x / 11x faster than ``torch.topk`` at
25M, k = 0.1 % / 1 %, one thread (12x / 16x with two), recall 1.0.  The floor is the one
abs + compare + nonzero pass (~25-30 ms at 25M); DGC built on the same pass is as fast.

Assumptions: ``x`` is 1-D floating point and finite (the DDP hooks check NaN/Inf first).
An Inf, or a NaN that reaches the full-vector search, raises ``ValueError``; a NaN skipped
by the compact path is never selected.  Indices come in no particular order.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

SAMPLE_SIZE = 1 << 17  # entries of |x| sampled to choose the compaction threshold
COMPACT_MIN_NUMEL = 1 << 15  # below this the full-vector search is cheap enough
COMPACT_MAX_DENSITY = 0.2  # above this k/numel compaction would keep most of x anyway
MARGIN_SIGMAS = 4.0  # how far below the sample estimate t_lo is set (binomial std devs)
MARGIN_EXTRA = 8  # plus this many sample ranks (protects tiny expected counts)
_MAX_CACHED = 8  # workspace entries (distinct bucket sizes) kept per thread
WORKSPACE_MIN_NUMEL = 1 << 16  # smaller vectors use fresh temporaries
# Bands larger than this are bracketed again before the search: ops on fewer elements than
# torch's intra-op grain (32768) run inline, so the 30 passes open no parallel regions.
SEARCH_MAX_NUMEL = 1 << 15
MAX_DEPTH = 2


@dataclass
class MSTopKResult:
    """Selection plus the search state, for tests and diagnostics."""

    values: Tensor  # x[indices], x.dtype, [k]
    indices: Tensor  # int32, unique, [k]
    thres1: Tensor  # 0-d: every element with |x| >= thres1 is selected
    thres2: Tensor  # 0-d: no element with |x| < thres2 is selected
    path: str  # "trivial" | "full" | "compact" | "fallback"
    num_candidates: int  # elements the search ran on


class _Workspace:
    """Reused buffers keyed by ``(numel, dtype, device)``: a value buffer and a bool mask
    (padded to a multiple of 8 with a False tail; use ``mask[:numel]`` to write it).

    Thread-local, so two threads never share a buffer.  CUDA stream hazard: every read of
    these buffers is enqueued before the call's last host sync (``nonzero``), so reusing
    them in a later call, even on another stream, cannot race with a pending kernel.
    """

    _local = threading.local()

    @classmethod
    def get(cls, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        cache: OrderedDict[tuple, tuple[Tensor, Tensor]] | None = getattr(cls._local, "cache", None)
        if cache is None:
            cache = OrderedDict()
            cls._local.cache = cache
        key = (n, dtype, device)
        bufs = cache.get(key)
        if bufs is None:
            # the mask is padded to whole 64-bit words, tail False (see sparse_nonzero)
            bufs = (
                torch.empty(n, dtype=dtype, device=device),
                torch.zeros(-(-n // 8) * 8, dtype=torch.bool, device=device),
            )
            cache[key] = bufs
            while len(cache) > _MAX_CACHED:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return bufs

    @classmethod
    def clear(cls) -> None:
        cls._local.cache = OrderedDict()


def take(t: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]`` for 1-D ``t``: ``index_select`` is 4-5x faster than advanced indexing on the
    CPU (250k of 25M: 3 ms vs 15 ms measured here)."""
    return torch.index_select(t, 0, idx)


def compact_above(x: Tensor, thres: Tensor, reuse: bool = True) -> tuple[Tensor, Tensor]:
    """Indices (int64, ascending) and signed values of the entries with ``|x| >= thres``.

    One pass over the whole vector into the reused |x| and mask buffers (``reuse``: for the
    caller's vector, whose size repeats; not for candidate arrays, whose sizes vary), then
    ``nonzero`` (host sync: data-dependent size).  Walking x in L2-sized chunks was measured too (see
    the module docstring) and not kept.  The values are gathered from ``x``, not from the
    reused buffer, so nothing reads the workspace after the sync (CUDA stream safety).
    """
    n = x.numel()
    if n < WORKSPACE_MIN_NUMEL or not reuse:
        idx = torch.nonzero(x.abs() >= thres).squeeze(1)  # host sync (data-dependent size)
        return idx, take(x, idx)
    a, padded = _Workspace.get(n, x.dtype, x.device)
    torch.abs(x, out=a)
    torch.ge(a, thres, out=padded[:n])
    idx = sparse_nonzero(padded)
    return idx, take(x, idx)


def sparse_nonzero(padded: Tensor) -> Tensor:
    """``nonzero`` of a sparse bool mask whose length is a multiple of 8 (int64, ascending).

    Reads the mask as 64-bit words, finds the non-zero words, then the set bytes inside them:
    the full-length scan handles 8x fewer elements.  At 25M with 0.1 % / 1 % set this took
    8-10 ms / 18-23 ms vs 59-74 ms / 67-84 ms for ``torch.nonzero`` (one thread, busy machine).
    Host sync: ``nonzero`` (data-dependent size), twice.
    """
    words = padded.view(torch.int64)
    wnz = torch.nonzero(words).squeeze(1)
    pos = torch.nonzero(take(words, wnz).view(torch.uint8)).squeeze(1)
    return take(wnz, pos >> 3) * 8 + (pos & 7)


def check_input(x: Tensor, k: int, name: str) -> int:
    """Validate ``x`` (1-D float) and return ``k`` clipped to ``[0, numel]``."""
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(x.shape)}; flatten it first")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.numel() > torch.iinfo(torch.int32).max:
        raise ValueError(f"{name}: {x.numel()} elements do not fit int32 indices; split the bucket")
    return max(0, min(int(k), x.numel()))


def _rand01(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """A uniform 0-d tensor on ``device`` (drawn on the generator's device, then moved)."""
    gdev = generator.device if generator is not None else device
    return torch.rand((), generator=generator, device=gdev).to(device)


def sample_abs(x: Tensor, m: int, generator: torch.Generator | None) -> Tensor:
    """|x| at about ``m`` positions: a systematic sample with a random offset.

    The stride is made coprime with 2, 3, 5 and 7 so that the sample does not lock onto a
    periodic layout (channels, kernel taps) of the gradient; a strided read is ~10x cheaper
    than ``m`` random gathers on the CPU (see the module docstring).  The
    offset is drawn on the generator's device; a CUDA generator makes ``.item()`` a host sync.
    """
    n = x.numel()
    stride = max(1, n // max(1, m))
    while stride > 1 and math.gcd(stride, 210) != 1:
        stride += 1
    gdev = generator.device if generator is not None else torch.device("cpu")
    offset = int(torch.randint(0, stride, (), generator=generator, device=gdev).item())
    return x[offset::stride].abs()


def threshold_search(
    a: Tensor, k: int, lo: Tensor, hi: Tensor, iters: int, mask: Tensor | None = None
) -> tuple[Tensor, ...]:
    """Algorithm 1 lines 4-24 on non-negative ``a``: returns 0-d ``thres1, k1, thres2, k2``.

    Requires ``len(a) > k``.  No host sync: every state variable stays a device tensor and
    is updated with ``torch.where``.  ``thres1`` starts at +inf (nothing above it) rather
    than the paper's 0, so ``k1 = 0`` stays consistent when no probed threshold kept
    ``<= k`` elements.  ``mask`` (bool, like ``a``) is reused for the comparisons.
    """
    dev = a.device
    sdt = torch.float64 if a.dtype == torch.float64 else torch.float32  # search arithmetic
    lo = lo.to(sdt)
    span = hi.to(sdt) - lo
    left = torch.zeros((), dtype=sdt, device=dev)  # Algorithm 1's l
    right = torch.ones((), dtype=sdt, device=dev)  # Algorithm 1's r
    k1 = torch.zeros((), dtype=torch.int64, device=dev)
    k2 = torch.full((), a.numel(), dtype=torch.int64, device=dev)
    thres1 = torch.full((), math.inf, dtype=sdt, device=dev)
    thres2 = torch.zeros((), dtype=sdt, device=dev)
    if mask is None:
        mask = torch.empty(a.shape, dtype=torch.bool, device=dev)
    for _ in range(iters):
        ratio = left + (right - left) * 0.5
        thres = (lo + ratio * span).to(a.dtype).to(sdt)  # round as `a >= thres` will compare
        nnz = torch.count_nonzero(torch.ge(a, thres, out=mask))
        small = nnz <= k
        right = torch.where(small, ratio, right)
        left = torch.where(small, left, ratio)
        # Algorithm 1 also tests nnz > k1 (nnz < k2).  Bisection makes every later "small"
        # probe a lower threshold (count >= k1) and every later "big" one a higher threshold
        # (count <= k2), so the test only differs on equal counts, where both thresholds
        # select the same elements: dropping it saves 4 ops (kernel launches) per pass.
        k1 = torch.where(small, nnz, k1)
        thres1 = torch.where(small, thres, thres1)
        k2 = torch.where(small, k2, nnz)
        thres2 = torch.where(small, thres2, thres)
    return thres1, k1, thres2, k2


def select_between(c: Tensor, k: int, thres1: Tensor, k1: Tensor, k2: Tensor, u: Tensor) -> Tensor:
    """Algorithm 1 lines 25-28: positions (ascending) of exactly ``k`` entries of ``c``.

    ``c`` holds the magnitudes of the ``k2`` entries ``>= thres2``, in index order.  Returns
    all with ``c >= thres1`` (k1 entries) plus the window ``[start, start + k - k1)`` of the
    others, ``start = floor(u * (k2 - k + 1))``.  No host sync.
    """
    above = c >= thres1
    between = ~above
    rank = torch.cumsum(between, 0) - 1
    start = torch.floor(u * (k2 - k + 1).to(u.dtype)).long().clamp(min=0)
    start = torch.minimum(start, k2 - k)
    keep = above | (between & (rank >= start) & (rank < start + (k - k1)))
    # exactly k entries are set by construction, so the size is known without a sync
    return torch.nonzero_static(keep, size=k, fill_value=0).squeeze(1)


def _finite_or_raise(hi: Tensor) -> None:
    # host sync: one scalar read, outside the search loop
    if not bool(torch.isfinite(hi)):
        raise ValueError("mstopk: the input contains NaN or Inf; check gradients before selecting")


def _full_search(x: Tensor, k: int, iters: int, u: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Algorithm 1 on the whole vector (small inputs, dense k, or a failed compaction)."""
    a, padded = _Workspace.get(x.numel(), x.dtype, x.device)
    mask = padded[: x.numel()]
    torch.abs(x, out=a)
    hi = a.max()
    _finite_or_raise(hi)
    lo = a.mean(dtype=torch.float32) if a.dtype != torch.float64 else a.mean()
    # Algorithm 1 searches [mean, max]; when k exceeds the count above the mean (dense k)
    # that interval cannot reach the k-th magnitude, so start from 0 instead (no sync).
    lo = torch.where(torch.count_nonzero(torch.ge(a, lo, out=mask)) > k, lo, torch.zeros_like(lo))
    thres1, k1, thres2, k2 = threshold_search(a, k, lo, hi, iters, mask)
    # last use of the workspace is enqueued before compact_above's host sync (see _Workspace)
    pos, c = compact_above(x, thres2.to(x.dtype))
    sel = select_between(c.abs(), k, thres1, k1, k2, u)
    return take(pos, sel), take(c, sel), thres1, thres2


def sample_ranks(n: int, k: int, m: int) -> tuple[int, int]:
    """Ranks in a sample of ``m`` (of ``n``) bracketing the k-th largest with high probability.

    The sample holds ``e = k m / n`` elements above the k-th largest on average (binomial,
    std ``~sqrt(e)``); ``e +/- (MARGIN_SIGMAS sqrt(e) + MARGIN_EXTRA)`` misses on either side
    with probability well below 1e-4.  The lower rank is 0 when no useful upper bound exists.
    """
    expected = k * m / n
    margin = MARGIN_SIGMAS * math.sqrt(expected) + MARGIN_EXTRA
    return min(m, math.ceil(expected + margin)), max(0, math.floor(expected - margin))


def _compact_search(
    x: Tensor,
    k: int,
    iters: int,
    u: Tensor,
    generator: torch.Generator | None,
    ranks: tuple[int, int] | None,
    depth: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int] | None:
    """Sample -> compact ``|x| >= t_lo`` -> Algorithm 1 on the band ``[t_lo, t_hi]``.

    Returns ``(indices int64, values, thres1, thres2, candidates)`` or None when fewer than ``k``
    candidates survived (the caller falls back to the full search).  Candidates above the
    sample's upper bracket ``t_hi`` are taken outright when there are at most ``k`` of them;
    the search then runs on the band only, for the remaining ``k - n_sure``.  Counting on the
    band plus ``n_sure`` equals counting on the full vector for every probe in
    ``[t_lo, t_hi]``, so the result is the one Algorithm 1 would give with these bounds.
    A band larger than ``SEARCH_MAX_NUMEL`` is bracketed again the same way (recursion, at
    most ``MAX_DEPTH`` levels); if that inner bracket fails, the band is searched directly.
    """
    n = x.numel()
    sample = sample_abs(x, min(SAMPLE_SIZE, n // 4), generator)
    m = sample.numel()
    rank_lo, rank_hi = sample_ranks(n, k, m) if ranks is None else ranks
    rank_lo, rank_hi = min(max(rank_lo, 1), m), min(rank_hi, m)
    top = torch.topk(sample, max(rank_lo, rank_hi)).values  # descending
    t_lo = top[rank_lo - 1]
    # host sync: compaction (data-dependent size), once, before the search loop
    cand, signed = compact_above(x, t_lo, reuse=depth == 0)
    nc = cand.numel()
    if nc < k:
        return None
    vals = signed.abs()
    hi = vals.max()
    _finite_or_raise(hi)
    if nc == k:
        lowest = vals.min()
        return cand, signed, lowest, lowest, nc
    # From here on only the candidate arrays are touched (no gathers from the big x).
    sure = torch.empty(0, dtype=torch.int64, device=x.device)  # positions into cand
    band = torch.arange(nc, device=x.device)
    kb, band_hi = k, hi
    if rank_hi >= 1:
        t_hi = top[rank_hi - 1]
        in_band = vals <= t_hi
        # host syncs: split sizes; small arrays, outside the search loop
        band_pos = torch.nonzero(in_band).squeeze(1)
        n_sure = nc - band_pos.numel()
        # else the bracket failed or is empty: search all candidates.  kb == 0 needs no
        # special case: the search then keeps nothing of the band.
        if 0 < n_sure <= k:
            sure = torch.nonzero(~in_band).squeeze(1)
            band, kb, band_hi = band_pos, k - n_sure, t_hi
    band_vals = take(vals, band) if sure.numel() else vals
    inner = None
    if band_vals.numel() > SEARCH_MAX_NUMEL and kb > 0 and depth < MAX_DEPTH:
        # bracket again inside the band (same algorithm, one level down)
        inner = _compact_search(band_vals, kb, iters, u, generator, None, depth + 1)
    if inner is not None:
        picked, _, thres1, thres2, _ = inner
    else:
        thres1, k1, thres2, k2 = threshold_search(band_vals, kb, t_lo, band_hi, iters)
        p2, c2 = compact_above(band_vals, thres2.to(band_vals.dtype), reuse=False)  # sync: k2
        picked = take(p2, select_between(c2, kb, thres1, k1, k2, u))
    if sure.numel():  # every sure entry is above t_hi >= any band threshold
        thres1 = torch.minimum(thres1, torch.where(in_band, math.inf, vals).min().to(thres1.dtype))
        picked = torch.cat([sure, take(band, picked)])
    return take(cand, picked), take(signed, picked), thres1, thres2, nc


def mstopk_with_info(
    x: Tensor,
    k: int,
    *,
    iters: int = 30,
    generator: torch.Generator | None = None,
    compact: bool = True,
    sample_ranks_override: tuple[int, int] | None = None,
) -> MSTopKResult:
    """MSTopK returning the thresholds and the path taken (see the module docstring).

    ``compact=False`` runs Algorithm 1 on the full vector.  ``sample_ranks_override``
    replaces the (lower, upper) bracket ranks in the sorted sample (tests use it to force
    the fallback and a failed upper bracket; upper 0 = no upper bracket).
    """
    k = check_input(x, k, "mstopk")
    if iters < 1:
        raise ValueError(f"mstopk: iters must be >= 1, got {iters}")
    n = x.numel()
    dev = x.device
    if k == 0 or k == n:
        idx = torch.arange(k, device=dev)
        t = torch.full((), math.inf if k == 0 else 0.0, device=dev)  # k == n: everything >= 0
        return MSTopKResult(take(x, idx), idx.to(torch.int32), t, t, "trivial", 0)
    u = _rand01(generator, dev)
    path = "full"
    if compact and n >= COMPACT_MIN_NUMEL and k <= COMPACT_MAX_DENSITY * n:
        found = _compact_search(x, k, iters, u, generator, sample_ranks_override)
        if found is not None:
            idx, values, thres1, thres2, num_cand = found
            return MSTopKResult(values, idx.to(torch.int32), thres1, thres2, "compact", num_cand)
        path = "fallback"
    idx, values, thres1, thres2 = _full_search(x, k, iters, u)
    return MSTopKResult(values, idx.to(torch.int32), thres1, thres2, path, n)


def mstopk(
    x: Tensor, k: int, *, iters: int = 30, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Approximate top-|x| selection: exactly ``min(k, numel)`` (values, int32 indices).

    Values are ``x[indices]`` (signed), indices are unique.  ``generator`` makes the random
    pick among the between-threshold elements (and the compaction sample) deterministic.
    """
    res = mstopk_with_info(x, k, iters=iters, generator=generator)
    return res.values, res.indices
