"""The pure-torch radix select (trainer/comm/radix_select.py), MSTopK's device path: the k-th largest
key and the ties to take, against a sort (an independent statement) and the one-bit bisection it
replaces, on adversarial inputs in every float width; a narrowed key range; no host sync; and the
full-length ops per call, counted on the meta device (the bisection ran 71 of them at fp32)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.op_audit import SyncAudit, launches
from tests.test_selectors import KINDS, _data
from trainer.comm.mstopk import mstopk_with_info
from trainer.comm.radix_select import digit_widths, radix_kth_largest_key
from trainer.comm.topk_keys import key_bits, kth_largest_key, magnitude_keys

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def sorted_kth(keys: torch.Tensor, k: int) -> tuple[int, int]:
    """The k-th largest key and how many keys equal to it are among the top k, from a full sort."""
    desc = torch.sort(keys.long(), descending=True).values
    t = int(desc[k - 1])
    return t, k - int((desc > t).sum())


def adversarial(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` values of one of tests/test_selectors.py's KINDS, or ``"nonfinite"`` (NaN and inf of both
    signs among normals: the keys' top end), in ``dtype``."""
    if kind == "nonfinite":
        x = _data("normal", n, seed=n)
        x[::5] = float("nan")
        x[1::7] = float("inf")
        x[2::11] = -float("inf")
    else:
        x = _data(kind, n, seed=n + len(kind))
    return x.to(dtype)


def test_digit_widths() -> None:
    assert digit_widths(31) == [16, 15] and digit_widths(15) == [15] and digit_widths(63) == [16, 16, 16, 15]
    assert digit_widths(0) == [] and digit_widths(1) == [1] and digit_widths(32, 11) == [11, 11, 10]
    for n in range(1, 70):
        for r in (1, 4, 11, 16):
            w = digit_widths(n, r)
            assert sum(w) == n and max(w) <= r and len(w) == -(-n // r) and w == sorted(w, reverse=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", (*KINDS, "nonfinite"))
def test_equals_a_sort_and_the_bisection(kind: str, dtype: torch.dtype) -> None:
    for n in (1, 2, 37, 5000, 70_000):
        x = adversarial(kind, n, dtype)
        keys = magnitude_keys(x)
        for k in sorted({1, 2, n // 100, n // 3, n - 1, n} - {0} - set(range(n + 1, n + 3))):
            t, need = radix_kth_largest_key(keys, k, key_bits(dtype))
            assert t.dtype == keys.dtype and t.shape == () and need.shape == ()
            assert (int(t), int(need)) == sorted_kth(keys, k), (kind, dtype, n, k)
            if n <= 5000:  # (the bisection: one pass per key bit)
                assert int(t) == int(kth_largest_key(keys, k, key_bits(dtype)))


def test_a_million_keys_and_every_digit_boundary() -> None:
    x = _data("lognormal8", 1 << 20, seed=3)
    keys = magnitude_keys(x)
    for k in (1, 1000, 10_000, 1 << 19, (1 << 20) - 1):
        t, need = radix_kth_largest_key(keys, k, 31)
        assert (int(t), int(need)) == sorted_kth(keys, k)
    # keys that differ only in the low digit, in the high digit, and straddle 2**15 / 2**16
    for base in (0, (1 << 15) - 3, (1 << 16) - 3, (1 << 30) - 2, (1 << 31) - 5):
        keys = torch.tensor([base, base + 1, base + 2, base + 2, base + 1, base], dtype=torch.int32)
        for k in range(1, 7):
            assert tuple(map(int, radix_kth_largest_key(keys, k, 31))) == sorted_kth(keys, k), (base, k)


def test_a_narrowed_key_range_and_narrow_digits() -> None:
    # the contract the compact path uses: keys in [start, start + 2**nbits), start's low bits zero
    g = torch.Generator().manual_seed(0)
    start, nbits = 0x3F000000, 20
    keys = (start + torch.randint(0, 1 << nbits, (20_000,), generator=g)).to(torch.int32)
    for k in (1, 17, 10_000, 20_000):
        for radix in (16, 11, 4, 1):  # 1 bit per pass: the bisection's schedule
            got = radix_kth_largest_key(keys, k, nbits, start=start, radix_bits=radix)
            assert tuple(map(int, got)) == sorted_kth(keys, k), (k, radix)


class FullLengthOps(TorchDispatchMode):
    """Counts the aten ops that read or write a tensor of ``n`` elements (a pass over the vector)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.ops = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,)))
                   if isinstance(a, torch.Tensor)]
        if any(t.numel() >= self.n for t in tensors) and launches(func):
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize(("dtype", "most"), [(torch.float32, 16), (torch.float16, 11), (torch.float64, 28)])
def test_full_length_ops_per_call_on_meta(dtype: torch.dtype, most: int) -> None:
    """The device path's passes over the vector, counted on meta (no data, so no value can be read):
    fp32 16 or fewer where the bisection ran 71 (31 compares + 32 counts + 8)."""
    n = 1 << 20
    x = torch.empty(n, device="meta", dtype=dtype)
    with FullLengthOps(n) as count:
        res = mstopk_with_info(x, 1000, path="device")
    assert res.path == "device" and res.indices.shape == (1000,)
    assert len(count.ops) <= most, count.ops
    assert "count_nonzero" not in " ".join(count.ops)


def test_no_host_sync() -> None:
    x = _data("ties", 200_000)
    for dtype in DTYPES:
        with SyncAudit() as audit:
            radix_kth_largest_key(magnitude_keys(x.to(dtype)), 2000, key_bits(dtype))
        assert audit.found == [], dtype
