"""Radix select of the k-th largest magnitude key, in pure torch: the device path of MSTopK where no
fused kernel runs (meta, any device, a CUDA torch without Triton).

The one-bit bisection (:func:`~trainer.comm.topk_keys.kth_largest_key`) counts once per key bit: 31
full-length compare-and-count passes for fp32, and on CUDA each ``count_nonzero`` of a bool mask first
widens it to int64. A radix select resolves ``RADIX_BITS`` bits per pass instead (AIR Top-K, Zhang et al.
SC'23; RAFT's ``select_k``): a histogram of the next digit over the keys still in the candidate bucket,
then the digit holding the k-th largest is found from the histogram's suffix sums -- on the device, so
there is no host sync -- and the rank left to find inside it carried to the next pass. fp32 (31-bit
keys): 2 passes of 16 and 15 bits; fp16/bf16 (15 bits): 1; fp64 (63): 4.

Each pass is a handful of elementwise ops and one ``index_add_`` of int32 ones into ``2**bits + 1``
int32 bins (the last bin takes the keys outside the bucket), so every count is an int32 (``n < 2**31``
is checked by the callers). Static shapes and no ``nonzero``/``.item()``: the code runs on ``meta``
and under ``torch.cuda.set_sync_debug_mode("error")``.

The pass also yields how many of the keys equal to the threshold belong in the top k (``need``): the
selection (:func:`~trainer.comm.topk_keys.select_exactly_k`) takes it instead of counting again.
"""

from __future__ import annotations

import torch
from torch import Tensor

RADIX_BITS = 16  # bits resolved per pass: 65,537 int32 bins (256 KiB), the whole search in 2 passes at fp32


def digit_widths(nbits: int, radix_bits: int = RADIX_BITS) -> list[int]:
    """``nbits`` split into the fewest passes of at most ``radix_bits``, the wider ones first."""
    if nbits <= 0:
        return []
    passes = -(-nbits // radix_bits)
    base, extra = divmod(nbits, passes)
    return [base + 1] * extra + [base] * (passes - extra)


def radix_kth_largest_key(keys: Tensor, k: int, nbits: int, start: int = 0,
                          radix_bits: int = RADIX_BITS) -> tuple[Tensor, Tensor]:
    """``(thres, need)``: the k-th largest of ``keys`` (0-d, ``keys.dtype``) and how many keys equal
    to it the top k takes (0-d int64, ``1 <= need``; ``k - need`` keys are larger).

    Same contract as :func:`~trainer.comm.topk_keys.kth_largest_key`: ``1 <= k <= len(keys)``, every
    key in ``[start, start + 2**nbits)``, the low ``nbits`` bits of ``start`` zero. No host sync.
    """
    # index_add_ takes int32 or int64 indices: 16-bit keys (fp16/bf16) are widened once
    work = keys if keys.dtype in (torch.int32, torch.int64) else keys.to(torch.int32)
    dev = keys.device
    high = start >> nbits  # the bits every key shares (0 for a search over all key bits)
    prefix = torch.full((), high, dtype=work.dtype, device=dev)
    rank = torch.full((), k, dtype=torch.int64, device=dev)  # the rank still to find, inside the bucket
    below = nbits
    for i, width in enumerate(digit_widths(nbits, radix_bits)):
        below -= width
        bins = 1 << width
        shifted = work >> below if below else work
        if i == 0:
            # every key is in the first bucket (the contract): the digit is the shifted key minus the
            # common high bits, no mask needed
            digit = shifted - (high << width) if high else shifted
        else:
            inside = (shifted >> width) == prefix
            digit = torch.where(inside, shifted & (bins - 1), bins)  # outside: the spare last bin
        hist = torch.zeros(bins + 1, dtype=torch.int32, device=dev)
        ones = torch.ones(1, dtype=torch.int32, device=dev).expand(digit.numel())
        hist.index_add_(0, digit.reshape(-1), ones)
        # at_least[d]: keys of the bucket whose digit is >= d (a suffix sum over 2**width bins)
        # (narrow, not hist[:bins]: basic slicing fails on fake CUDA tensors in a CPU-only torch)
        at_least = torch.cumsum(hist.narrow(0, 0, bins).flip(0), 0, dtype=torch.int64).flip(0)
        # the k-th largest is in the highest digit d with at_least[d] >= rank (at_least falls with d)
        d = (at_least >= rank).sum() - 1
        above = torch.cat([at_least, at_least.new_zeros(1)]).index_select(0, (d + 1).reshape(1)).reshape(())
        rank = rank - above
        prefix = (prefix << width) | d.to(work.dtype)
    return prefix.to(keys.dtype), rank
