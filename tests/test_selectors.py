"""Top-k selectors: exactness on adversarial inputs (vs torch.topk and an independent numpy
reference of the tie rule), the NaN/inf policy on every path, wrong brackets, no host syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.op_audit import SyncAudit
from trainer.comm import topk_keys
from trainer.comm.dgc import dgc_topk_with_info
from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import COMPACT_MIN_NUMEL, mstopk, mstopk_with_info
from trainer.comm.selector_registry import SELECTOR_CHOICES, get_selector

D = 1 << 20  # ~1M
SMALL, LARGE = 5000, 200_000  # device path only / compact path on CPU (>= COMPACT_MIN_NUMEL)
assert SMALL < COMPACT_MIN_NUMEL <= LARGE


def _data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student_t2":  # heavy tails: t(2) = z / sqrt(chi2(2) / 2), chi2(2) = -2 log U
        z = torch.randn(n, generator=g)
        return z / torch.sqrt(-torch.log(torch.rand(n, generator=g).clamp_min(1e-12)))
    if kind == "lognormal8":  # log-normal, sigma = 8: magnitudes over ~30 orders of magnitude
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        return sign * torch.exp(8.0 * torch.randn(n, generator=g))
    if kind.startswith("outlier"):  # one value `scale` times the rest (scale from the name)
        x = torch.randn(n, generator=g)
        x[n // 3] = float(kind.split("_")[1]) * float(x.abs().max())
        return x
    if kind == "ties":  # a few distinct magnitudes: thousands of ties at the threshold
        return torch.randint(-4, 5, (n,), generator=g).float() * 0.5
    if kind == "denormal":  # zeros, denormals (down to 1.4e-45) and -0.0
        bits = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
        x = bits.view(torch.float32) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        x[::7] = 0.0
        x[1::7] = -0.0
        return x
    if kind == "all_equal":
        return torch.full((n,), 0.125)
    if kind == "all_negative":
        return -torch.rand(n, generator=g) - 1e-3
    raise AssertionError(kind)


KINDS = ("normal", "student_t2", "lognormal8", "outlier_1e9", "outlier_1e30", "outlier_1e3", "ties",
         "denormal", "all_equal", "all_negative")


def _reference(x: torch.Tensor, k: int) -> np.ndarray:
    """Independent statement of the rule: sort by (magnitude desc, index asc), take k, as numpy
    computes it (the magnitude order of IEEE floats, NaN above inf, via numpy's own bit view)."""
    a = x.numpy()
    mag = np.abs(a.astype(np.float64))
    mag[np.isnan(a)] = np.inf
    nan_rank = np.isnan(a).astype(np.int8)  # NaN ranks above +inf
    order = np.lexsort((np.arange(a.size), -mag, -nan_rank))
    return np.sort(order[:k])


def _check_contract(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> None:
    assert indices.dtype == torch.int32
    assert values.dtype == x.dtype
    assert indices.shape == (k,) and values.shape == (k,)
    assert torch.unique(indices).numel() == k
    if k:
        assert int(indices.min()) >= 0 and int(indices.max()) < x.numel()
    torch.testing.assert_close(values, x[indices.long()], equal_nan=True, rtol=0, atol=0)


def _same_magnitudes_as_topk(x: torch.Tensor, k: int, values: torch.Tensor) -> None:
    """The selected magnitudes are exactly torch.topk's (as a multiset)."""
    ref = torch.topk(x.abs().double(), k).values
    got = torch.sort(values.abs().double(), descending=True).values
    torch.testing.assert_close(got, torch.sort(ref, descending=True).values, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("kind", KINDS)
def test_mstopk_exact_on_adversarial_inputs(kind: str, n: int) -> None:
    x = _data(kind, n, seed=len(kind))
    for k in (1, 7, n // 1000, n // 100, n // 10, n - 1, n):
        if k < 1:
            continue
        ref = _reference(x, k)
        for path in ("auto", "device"):
            res = mstopk_with_info(x, k, path=path)
            _check_contract(x, k, res.values, res.indices)
            assert np.array_equal(res.indices.numpy(), ref), (kind, n, k, path, res.path)
            _same_magnitudes_as_topk(x, k, res.values)
            if 0 < k < n:  # the threshold is the k-th largest magnitude
                assert float(res.threshold) == float(torch.topk(x.abs(), k).values[-1])
        if n == LARGE and 1 < k <= n // 10 and kind not in ("all_equal", "ties"):
            assert mstopk_with_info(x, k).path == "compact"


@pytest.mark.parametrize("kind", ["normal", "ties", "outlier_1e9", "lognormal8"])
def test_wrong_bracket_still_exact(kind: str) -> None:
    """The sample's bracket only saves work: too high (no candidates), too low (everything) and
    a near miss (a few candidates short) all give the exact result."""
    x = _data(kind, LARGE, seed=3)
    keys = topk_keys.magnitude_keys(x)
    for k in (LARGE // 1000, LARGE // 100):
        ref = _reference(x, k)
        kth = int(torch.topk(keys, k).values[-1])
        for bracket, path in ((int(keys.max()) + 1, "fallback"), (kth + 1, "fallback"), (0, "compact"),
                              (kth, "compact")):
            res = mstopk_with_info(x, k, bracket_key=bracket)
            assert res.path == path, (bracket, res.path)
            assert np.array_equal(res.indices.numpy(), ref), (kind, k, bracket)


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_nan_inf_policy_same_on_every_path(n: int) -> None:
    """NaN ranks above inf above every finite value; selected, never skipped, never raised."""
    x = _data("normal", n, seed=11)
    bad = torch.tensor([n // 2, 3, n - 1, n // 5])
    x[bad[0]], x[bad[1]] = float("nan"), -float("nan")
    x[bad[2]], x[bad[3]] = float("inf"), -float("inf")
    for k in (1, 2, 3, 4, 10, n // 100):
        ref = _reference(x, k)
        paths = ("auto", "device", "compact") if n >= COMPACT_MIN_NUMEL else ("auto", "device")
        for path in paths:
            res = mstopk_with_info(x, k, path=path)
            assert np.array_equal(res.indices.numpy(), ref), (k, path)
        if k >= 4:
            for name in SELECTOR_CHOICES:  # every selector picks every non-finite entry
                idx = set(get_selector(name)(x, k)[1].tolist())
                assert set(bad.tolist()) <= idx, name
    assert set(mstopk(x, 2)[1].tolist()) == {3, n // 2}  # the two NaNs, lowest index rule inside


def test_device_path_has_no_host_sync() -> None:
    """The device path runs on the meta device (no data: any read of a value would fail) and
    under the sync audit on CPU; the compact path does sync (the audit catches it)."""
    for n, k in ((LARGE, 200), (SMALL, 1)):
        for dtype in (torch.float32, torch.float16, torch.float64):
            xm = torch.empty(n, device="meta", dtype=dtype)
            res = mstopk_with_info(xm, k)
            assert res.path == "device" and res.indices.shape == (k,) and res.indices.device.type == "meta"
            assert exact_topk(xm, k)[1].shape == (k,)
    x = _data("ties", LARGE)
    with SyncAudit() as audit:
        mstopk_with_info(x, 2000, path="device")
    assert audit.found == []
    with SyncAudit() as audit:
        mstopk_with_info(x, 2000, path="compact")
    assert "nonzero" in " ".join(audit.found)
    topk_keys.DEVICE_PATH_ON_CPU = True
    try:
        with SyncAudit() as audit:
            res = mstopk_with_info(x, 2000)
            exact_topk(x, 2000)
    finally:
        topk_keys.DEVICE_PATH_ON_CPU = False
    assert res.path == "device" and audit.found == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes_exact(dtype: torch.dtype) -> None:
    x = _data("student_t2", LARGE, seed=2).to(dtype)
    k = 2000
    ref = _reference(x.double(), k) if dtype == torch.float64 else None
    for path in ("auto", "device"):
        res = mstopk_with_info(x, k, path=path)
        _check_contract(x, k, res.values, res.indices)
        _same_magnitudes_as_topk(x, k, res.values)
        if ref is not None:
            assert np.array_equal(res.indices.numpy(), ref)
    for name in SELECTOR_CHOICES:
        values, indices = get_selector(name)(x, k)
        _check_contract(x, k, values, indices)
        _same_magnitudes_as_topk(x, k, values)


@pytest.mark.parametrize("name", SELECTOR_CHOICES)
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_every_selector_exact_on_gradient_like_data(name: str, density: float) -> None:
    select = get_selector(name)
    k = int(D * density)
    for i, kind in enumerate(("normal", "student_t2", "lognormal8", "outlier_1e9")):
        x = _data(kind, D, seed=i)
        values, indices = select(x, k)
        _check_contract(x, k, values, indices)
        _same_magnitudes_as_topk(x, k, values)


@pytest.mark.parametrize("name", SELECTOR_CHOICES)
def test_edge_cases(name: str) -> None:
    select = get_selector(name)
    x = torch.randn(1000)
    for k, expect in ((0, 0), (-3, 0), (1, 1), (999, 999), (1000, 1000), (5000, 1000)):
        values, indices = select(x, k)
        _check_contract(x, expect, values, indices)
    assert int(select(x, 1)[1]) == int(x.abs().argmax())
    empty = torch.empty(0)
    _check_contract(empty, 0, *select(empty, 5))


def test_auto_runs_mstopk_on_the_cpu_and_torch_topk_on_the_device_path() -> None:
    """``auto``: on CPU tensors MSTopK's result bit for bit (its tie rule: lowest indices); on the CUDA
    code path (forced on the CPU) torch.topk's, with no host sync; exact either way (torch.topk's
    magnitudes are the reference)."""
    from trainer.comm.auto_topk import auto_resolves_to, auto_topk

    x = _data("ties", LARGE, seed=3)
    k = LARGE // 100
    want = torch.topk(x.abs(), k).values
    v, i = auto_topk(x, k)
    mv, mi = mstopk(x, k)
    assert torch.equal(i, mi) and torch.equal(v, mv) and auto_resolves_to("cpu") == "mstopk"
    assert torch.equal(v.abs().sort(descending=True).values, want)
    topk_keys.DEVICE_PATH_ON_CPU = True
    try:
        with SyncAudit() as audit:
            dv, di = auto_topk(x, k)
        ref = torch.topk(x.abs(), k, sorted=False).indices.to(torch.int32)
    finally:
        topk_keys.DEVICE_PATH_ON_CPU = False
    assert audit.found == [] and torch.equal(di, ref) and torch.equal(dv, x[di.long()])
    assert auto_resolves_to("cuda") == "exact"
    xm = torch.empty(LARGE, device="meta")
    assert auto_topk(xm, k)[1].shape == (k,)  # the device path runs on the meta device too


def test_determinism_and_tie_rule() -> None:
    x = torch.full((D // 8,), 1.0)  # everything ties: the lowest indices win
    k = D // 800
    assert torch.equal(mstopk(x, k)[1], torch.arange(k, dtype=torch.int32))
    y = _data("ties", D, seed=9)
    a, b = mstopk(y, D // 100), mstopk(y, D // 100)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_dgc_readjustment_exact() -> None:
    x = _data("normal", 200_000, seed=4)
    k = 2000
    ref = set(torch.topk(x.abs(), k).indices.tolist())
    adjusted = []
    for ratio in (0.005, 0.01, 0.02, 0.05):
        values, indices, adj = dgc_topk_with_info(x, k, sample_ratio=ratio)
        _check_contract(x, k, values, indices)
        assert set(indices.tolist()) == ref  # superset then exact top-k: equals exact top-k
        adjusted.append(adj)
    assert max(adjusted) >= 1  # without a safety margin the sample threshold is often too high


def test_sparse_nonzero() -> None:
    g = torch.Generator().manual_seed(0)
    for n, p in ((8, 0.5), (4096, 0.0), (4096, 1.0), (80_000, 0.001), (80_000, 0.3)):
        mask = torch.rand(n, generator=g) < p
        assert torch.equal(topk_keys.sparse_nonzero(mask), torch.nonzero(mask).squeeze(1))


def test_workspace_reused() -> None:
    x = torch.randn(1 << 20)
    mstopk(x, 300)
    k1 = topk_keys.WORKSPACE.get("select_keys", x.numel(), torch.int32, x.device)
    mstopk(x * 2, 300)
    k2 = topk_keys.WORKSPACE.get("select_keys", x.numel(), torch.int32, x.device)
    assert k1.data_ptr() == k2.data_ptr()


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="mstopk, exact, dgc"):
        get_selector("sort")
    with pytest.raises(ValueError, match="1-D"):
        mstopk(torch.randn(4, 4), 2)
    with pytest.raises(ValueError, match="floating"):
        exact_topk(torch.arange(10), 2)
    with pytest.raises(ValueError, match="path"):
        mstopk_with_info(torch.randn(10), 2, path="fast")
    with pytest.raises(ValueError, match="sample_ratio"):
        get_selector("dgc")(torch.randn(10), 2, sample_ratio=0.0)
    with pytest.raises(ValueError, match="CPU tensor"):
        mstopk_with_info(torch.empty(10, device="meta"), 2, path="compact")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_exact_and_sync_free() -> None:  # pragma: no cover - needs a GPU
    for kind in ("student_t2", "ties", "outlier_1e30", "denormal"):
        x = _data(kind, LARGE, seed=1)
        x[5] = float("nan")
        xc = x.cuda()
        for k in (1, LARGE // 1000, LARGE // 100):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                values, indices = mstopk(xc, k)
                ev, _ = exact_topk(xc, k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert values.is_cuda and indices.is_cuda
            assert np.array_equal(indices.cpu().numpy(), _reference(x, k)), (kind, k)
            _same_magnitudes_as_topk(x, k, ev.cpu())
