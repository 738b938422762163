"""The Triton kernels of the fused radix select (:mod:`trainer.comm.radix_select_triton` says what each does
and launches them). A module of their own: importing Triton costs a quarter of a second, paid only by a
process that selects on a device with it. Module globals, because Triton's interpreter resolves a kernel's
names there."""

# (no ``from __future__ import annotations``: the kernels' ``tl.constexpr`` annotations stay objects)
import triton
import triton.language as tl


@triton.jit
def _key(bits_ptr, offs, inb, KEY_MASK: tl.constexpr, WIDEN: tl.constexpr):
    bits = tl.load(bits_ptr + offs, mask=inb, other=0)
    if WIDEN:  # 16-bit keys (fp16/bf16): shifts and compares in int32 (the masked key is >= 0)
        bits = bits.to(tl.int32)
    return bits & KEY_MASK


@triton.jit
def histogram(bits_ptr, n, state_ptr, hist_ptr, tiles, KEY_MASK: tl.constexpr, WIDEN: tl.constexpr,
              SHIFT: tl.constexpr, WIDTH: tl.constexpr, BINS: tl.constexpr, FIRST: tl.constexpr,
              TILE: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    lanes = tl.arange(0, TILE)
    bins = tl.arange(0, BINS)
    acc = tl.zeros((BINS,), dtype=tl.int32)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(state_ptr)  # the bucket chosen so far (written by the previous pick)
    for t in range(pid, tiles, step):
        offs = t * TILE + lanes  # int32: n + TILE < 2**31 is checked by fused_topk
        inb = offs < n
        key = _key(bits_ptr, offs, inb, KEY_MASK, WIDEN)
        if FIRST:
            inside = inb  # every key is in the first bucket
        else:
            inside = inb & ((key >> (SHIFT + WIDTH)) == prefix)
        digit = tl.where(inside, (key >> SHIFT) & (BINS - 1), 0).to(tl.int32)
        # keys outside the bucket were counted in bin 0: taken out again (histogram's mask argument
        # is missing from older Triton releases)
        outside = TILE - tl.sum(inside.to(tl.int32), axis=0)
        acc += tl.histogram(digit, BINS) - tl.where(bins == 0, outside, 0)
    tl.atomic_add(hist_ptr + bins, acc, mask=acc > 0)


@triton.jit
def pick(hist_ptr, state_ptr, k, WIDTH: tl.constexpr, BINS: tl.constexpr, FIRST: tl.constexpr):
    bins = tl.arange(0, BINS)
    h = tl.load(hist_ptr + bins)
    at_least = tl.cumsum(h, axis=0, reverse=True)  # keys of the bucket with digit >= d
    if FIRST:
        rank = k.to(tl.int64)
        prefix = rank * 0
    else:
        prefix = tl.load(state_ptr)
        rank = tl.load(state_ptr + 1)
    # the k-th largest is in the highest digit d with at_least[d] >= rank (at_least falls with d)
    d = tl.sum((at_least >= rank).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins == d, at_least - h, 0), axis=0)
    tl.store(state_ptr, (prefix << WIDTH) | d.to(tl.int64))
    tl.store(state_ptr + 1, rank - above.to(tl.int64))


@triton.jit
def count(bits_ptr, n, state_ptr, counts_ptr, tiles, KEY_MASK: tl.constexpr, WIDEN: tl.constexpr,
          TILE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    inb = offs < n
    key = _key(bits_ptr, offs, inb, KEY_MASK, WIDEN)
    thres = tl.load(state_ptr)
    tl.store(counts_ptr + pid, tl.sum((inb & (key > thres)).to(tl.int32), axis=0))
    tl.store(counts_ptr + tiles + pid, tl.sum((inb & (key == thres)).to(tl.int32), axis=0))


@triton.jit
def write(bits_ptr, x_ptr, n, state_ptr, counts_ptr, incl_ptr, tiles, idx_ptr, val_ptr,
          KEY_MASK: tl.constexpr, WIDEN: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * TILE + tl.arange(0, TILE)
    inb = offs < n
    key = _key(bits_ptr, offs, inb, KEY_MASK, WIDEN)
    thres = tl.load(state_ptr)
    need = tl.load(state_ptr + 1)
    above = inb & (key > thres)
    eq = inb & (key == thres)
    above_before = tl.load(incl_ptr + pid) - tl.load(counts_ptr + pid)  # exclusive scans
    eq_before = tl.load(incl_ptr + tiles + pid) - tl.load(counts_ptr + tiles + pid)
    eqi = eq.to(tl.int32)
    eq_rank = eq_before + tl.cumsum(eqi, axis=0) - eqi  # ties taken lowest index first
    sel = above | (eq & (eq_rank < need))
    seli = sel.to(tl.int32)
    pos = above_before + tl.minimum(eq_before.to(tl.int64), need) + (tl.cumsum(seli, axis=0) - seli)
    tl.store(idx_ptr + pos, offs.to(tl.int32), mask=sel)
    tl.store(val_ptr + pos, tl.load(x_ptr + offs, mask=sel), mask=sel)
