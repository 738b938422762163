"""DGC-style sampled top-k (Lin et al., Deep Gradient Compression), exactly k entries.

1. Estimate the threshold from the exact top-``k_s`` of a ~``sample_ratio`` strided sample of the
   magnitude keys (``selection.strided_sample_keys``), ``k_s = ceil(k * m / n)``, with no safety
   margin, as DGC does.
2. Select the entries whose key is at least that threshold (``selection.compact_at_least``, the
   primitive MSTopK's CPU path uses too, so the comparison is fair).
3. Hierarchical re-adjustment to exactly k: too many pass -> exact top-k among them (a small
   ``torch.topk`` on their keys); too few -> go deeper into the sorted sample (``k_s`` doubled,
   up to ``max_adjust`` times); if even the sample minimum keeps fewer than k, exact top-k of
   the whole vector.

Because step 3 takes the exact top-k of a superset of the true top-k, the result equals the
exact top-k whenever it returns (ties aside). NaN/inf follow ``topk_keys.py``'s policy (keys).
HOST SYNCS: every adjustment reads a data-dependent count (``nonzero``), so on CUDA DGC syncs
once or more per call. It is the comparison baseline; the sync-free choices are ``mstopk`` and
``exact``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.comm.exact_topk import exact_topk
from trainer.comm.topk_keys import check_input, compact_at_least, strided_sample_keys, take


def dgc_topk(x: Tensor, k: int, *, sample_ratio: float = 0.01, max_adjust: int = 4) -> tuple[Tensor, Tensor]:
    """Exactly ``min(k, numel)`` (values ``x[idx]``, unique int32 idx) chosen as described above."""
    values, indices, _ = dgc_topk_with_info(x, k, sample_ratio=sample_ratio, max_adjust=max_adjust)
    return values, indices


def dgc_topk_with_info(x: Tensor, k: int, *, sample_ratio: float = 0.01, max_adjust: int = 4
                       ) -> tuple[Tensor, Tensor, int]:
    """``dgc_topk`` plus the number of threshold adjustments (-1: fell back to exact top-k)."""
    k = check_input(x, k, "dgc_topk")
    if not 0.0 < sample_ratio <= 1.0:
        raise ValueError(f"dgc_topk: sample_ratio must be in (0, 1], got {sample_ratio}")
    n = x.numel()
    m = math.ceil(n * sample_ratio)
    if k == 0 or k == n or m >= n or m < 64:
        return (*exact_topk(x, k), 0)  # tiny or trivial: sampling buys nothing
    sample = strided_sample_keys(x, m)
    m = sample.numel()
    ks = max(1, math.ceil(k * m / n))
    for adjust in range(max_adjust + 1):
        ks = min(ks, m)
        thres = int(torch.topk(sample, ks, sorted=False).values.min())
        cand, keys = compact_at_least(x, thres)
        if cand.numel() >= k:
            if cand.numel() > k:
                cand = take(cand, torch.topk(keys, k, sorted=False).indices)
            return take(x, cand), cand.to(torch.int32), adjust
        if ks == m:
            break
        ks *= 2
    return (*exact_topk(x, k), -1)
