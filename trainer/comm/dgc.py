"""DGC-style sampled top-k (Lin et al., Deep Gradient Compression), exactly k entries.

1. Estimate the threshold from the exact top-``k_s`` of a ~``sample_ratio`` sample of ``|x|``
   (systematic with a random offset: ``mstopk.sample_abs``), ``k_s = ceil(k * m / n)``,
   with no safety margin, as DGC does.
2. Select the indices with ``|x| >= thres`` (``mstopk.compact_above``: one chunked pass +
   ``nonzero``, a host sync; the same primitive MSTopK uses, so the comparison is fair).
3. Hierarchical re-adjustment so the result has exactly k entries: too many pass -> exact
   top-k among them (a small ``torch.topk``); too few -> lower the threshold by going
   deeper into the sorted sample (``k_s`` doubled, up to ``max_adjust`` times), and if even
   the sample minimum keeps fewer than k, fall back to exact top-k of the whole vector.

Because step 3 takes the exact top-k of a superset of the true top-k, the result equals the
exact top-k whenever it returns (ties aside); its cost is the sample, one pass per
adjustment and a small top-k.  Every adjustment is a host sync (DGC is not sync-free).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import check_input, compact_above, sample_abs, take


def dgc_topk(
    x: Tensor,
    k: int,
    *,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    max_adjust: int = 4,
) -> tuple[Tensor, Tensor]:
    """Exactly ``min(k, numel)`` (values ``x[idx]``, unique int32 idx) chosen as described above."""
    values, indices, _ = dgc_topk_with_info(
        x, k, sample_ratio=sample_ratio, generator=generator, max_adjust=max_adjust
    )
    return values, indices


def dgc_topk_with_info(
    x: Tensor,
    k: int,
    *,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    max_adjust: int = 4,
) -> tuple[Tensor, Tensor, int]:
    """``dgc_topk`` plus the number of threshold adjustments (-1: fell back to exact top-k)."""
    k = check_input(x, k, "dgc_topk")
    if not 0.0 < sample_ratio <= 1.0:
        raise ValueError(f"dgc_topk: sample_ratio must be in (0, 1], got {sample_ratio}")
    n = x.numel()
    m = math.ceil(n * sample_ratio)
    if k == 0 or k == n or m >= n or m < 64:
        return (*exact_topk(x, k), 0)  # tiny or trivial: sampling buys nothing
    sample = sample_abs(x, m, generator)
    m = sample.numel()
    ks = max(1, math.ceil(k * m / n))
    for adjust in range(max_adjust + 1):
        ks = min(ks, m)
        thres = torch.topk(sample, ks, sorted=False).values.min()
        # host sync inside compact_above: data-dependent count, once per adjustment
        cand, vals = compact_above(x, thres)
        if cand.numel() >= k:
            if cand.numel() > k:
                keep = torch.topk(vals.abs(), k, sorted=False).indices
                cand, vals = take(cand, keep), take(vals, keep)
            return vals, cand.to(torch.int32), adjust
        if ks == m:
            break
        ks *= 2
    return (*exact_topk(x, k), -1)
