"""Top-k selectors: exact k, int32 unique indices, signed values, recall, edge cases, fallback."""

from __future__ import annotations

import pytest
import torch

from trainer.comm import mstopk as mstopk_mod
from trainer.comm.dgc import dgc_topk_with_info
from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import mstopk, mstopk_with_info
from trainer.comm.selectors import SELECTOR_CHOICES, get_selector

D = 1 << 20  # ~1M


def _data(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g)
    if kind == "student_t2":  # heavy tails: t(2) = z / sqrt(chi2(2) / 2), chi2(2) = -2 log U
        z = torch.randn(n, generator=g)
        u = torch.rand(n, generator=g).clamp_min(1e-12)
        return z / torch.sqrt(-torch.log(u))
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g)
    if kind == "lognormal_scaled":  # per-element scales spanning orders of magnitude
        return torch.randn(n, generator=g) * torch.exp(2.0 * torch.randn(n, generator=g))
    raise AssertionError(kind)


def _check_contract(x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> None:
    assert indices.dtype == torch.int32
    assert values.dtype == x.dtype
    assert indices.shape == (k,) and values.shape == (k,)
    assert torch.unique(indices).numel() == k
    if k:
        assert int(indices.min()) >= 0 and int(indices.max()) < x.numel()
    assert torch.equal(values, x[indices.long()])


def _recall(x: torch.Tensor, k: int, indices: torch.Tensor) -> float:
    ref = torch.topk(x.abs(), k).indices
    hit = torch.zeros(x.numel(), dtype=torch.bool)
    hit[ref] = True
    return float(hit[indices.long()].sum()) / k


@pytest.fixture(scope="module")
def datasets() -> dict[str, torch.Tensor]:
    kinds = ("normal", "student_t2", "lognormal_scaled")
    return {kind: _data(kind, D, seed=i) for i, kind in enumerate(kinds)}


@pytest.mark.parametrize("name", SELECTOR_CHOICES)
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_contract_and_recall(datasets: dict[str, torch.Tensor], name: str, density: float) -> None:
    select = get_selector(name)
    k = int(D * density)
    for kind, x in datasets.items():
        values, indices = select(x, k)
        _check_contract(x, k, values, indices)
        rec = _recall(x, k, indices)
        assert rec >= 0.999, (name, kind, density, rec)


def test_cauchy_recall_and_path() -> None:
    x = _data("cauchy", D, seed=7)
    for k in (D // 1000, D // 100):
        res = mstopk_with_info(x, k, generator=torch.Generator().manual_seed(1))
        assert res.path == "compact"
        assert k < res.num_candidates < 4 * k  # compaction really shrank the search
        _check_contract(x, k, res.values, res.indices)
        assert _recall(x, k, res.indices) >= 0.999


@pytest.mark.parametrize("compact", [True, False])
def test_mstopk_thresholds(compact: bool) -> None:
    x = _data("student_t2", D, seed=3)
    k = D // 500
    res = mstopk_with_info(x, k, compact=compact)
    assert res.path == ("compact" if compact else "full")
    a = x.abs()
    chosen = torch.zeros(D, dtype=torch.bool)
    chosen[res.indices.long()] = True
    t1, t2 = float(res.thres1), float(res.thres2)
    assert t2 < t1
    # every element strictly above the upper threshold (indeed >= it) is selected ...
    assert bool(chosen[a > t1].all()) and bool(chosen[a >= t1].all())
    # ... and nothing below the lower threshold is
    assert not bool(chosen[a < t2].any())
    assert int((a >= t1).sum()) <= k < int((a >= t2).sum())


def test_fallback_when_candidates_too_few() -> None:
    x = _data("normal", D, seed=5)
    k = D // 100
    # rank 1 = the sample maximum: only a handful of elements of x lie above it, far fewer than k
    res = mstopk_with_info(x, k, sample_ranks_override=(1, 0), generator=torch.Generator().manual_seed(0))
    assert res.path == "fallback"
    assert res.num_candidates == D
    _check_contract(x, k, res.values, res.indices)
    assert _recall(x, k, res.indices) >= 0.999
    # the full path finds the same thresholds as the compact path would have needed
    ok = mstopk_with_info(x, k, generator=torch.Generator().manual_seed(0))
    assert ok.path == "compact"
    assert _recall(x, k, ok.indices) >= 0.999
    # a failed upper bracket (t_hi = sample median: far more than k "sure" entries) is
    # detected and the search runs on all candidates instead
    m = 1 << 17
    bad = mstopk_with_info(x, k, sample_ranks_override=(k * m // D + 400, m // 2))
    assert bad.path == "compact"
    _check_contract(x, k, bad.values, bad.indices)
    assert _recall(x, k, bad.indices) >= 0.999
    # no upper bracket at all: same answer as with it
    plain = mstopk_with_info(x, k, sample_ranks_override=(k * m // D + 400, 0))
    assert _recall(x, k, plain.indices) >= 0.999


def test_nested_bracketing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands above SEARCH_MAX_NUMEL (at 25M, k = 1 %) are bracketed again; force it at 1M."""
    monkeypatch.setattr(mstopk_mod, "SEARCH_MAX_NUMEL", 256)
    depths: list[int] = []
    inner = mstopk_mod._compact_search

    def counting(*args: object, **kwargs: object) -> object:
        depths.append(int(args[6]) if len(args) > 6 else int(kwargs.get("depth", 0)))  # type: ignore[arg-type]
        return inner(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mstopk_mod, "_compact_search", counting)
    for kind, density in (("normal", 0.01), ("student_t2", 0.001), ("lognormal_scaled", 0.01)):
        x = _data(kind, D, seed=8)
        k = int(D * density)
        depths.clear()
        res = mstopk_with_info(x, k, generator=torch.Generator().manual_seed(2))
        assert res.path == "compact" and max(depths) >= 1, depths
        _check_contract(x, k, res.values, res.indices)
        assert _recall(x, k, res.indices) >= 0.999
        a = x.abs()
        chosen = torch.zeros(D, dtype=torch.bool)
        chosen[res.indices.long()] = True
        assert bool(chosen[a >= float(res.thres1)].all())
        assert not bool(chosen[a < float(res.thres2)].any())


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
    for n in (1000, 100_000):  # full path and compact path
        for x in (torch.zeros(n), torch.full((n,), -2.5), torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)):
            k = n // 100
            values, indices = select(x, k)
            _check_contract(x, k, values, indices)
    # heavy ties at the threshold: few distinct magnitudes, still exactly k
    g = torch.Generator().manual_seed(0)
    for n in (5000, 100_000):
        x = torch.randint(-4, 5, (n,), generator=g).float()
        for k in (1, n // 100, n // 3, n - 1):
            values, indices = select(x, k)
            _check_contract(x, k, values, indices)
            kth = torch.topk(x.abs(), k).values.min()
            assert bool((values.abs() >= kth).all()) or name == "mstopk"
            if name == "mstopk":  # all strictly larger magnitudes are in
                assert int((values.abs() > kth).sum()) == int((x.abs() > kth).sum())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes(dtype: torch.dtype) -> None:
    x = _data("normal", 300_000, seed=2).to(dtype)
    k = 3000
    for name in SELECTOR_CHOICES:
        values, indices = get_selector(name)(x, k)
        _check_contract(x, k, values, indices)
        kth = torch.topk(x.abs().float(), k).values.min()
        assert int((x.abs().float()[indices.long()] < kth).sum()) <= k // 100, name


def test_determinism_with_generator() -> None:
    x = torch.full((D // 8,), 1.0)  # everything ties: the pick is the random window
    k = D // 800
    runs = [mstopk(x, k, generator=torch.Generator().manual_seed(s))[1] for s in (11, 11, 12)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    # the window is contiguous in the list of between-threshold indices (here: all of them)
    idx = runs[0].long()
    assert int(idx.max() - idx.min()) == k - 1
    y = _data("normal", D, seed=9)
    a = mstopk(y, k, generator=torch.Generator().manual_seed(3))
    b = mstopk(y, k, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_dgc_readjustment_exact() -> None:
    x = _data("normal", 200_000, seed=4)
    k = 2000
    ref = set(torch.topk(x.abs(), k).indices.tolist())
    adjusted = 0
    for seed in range(6):
        values, indices, adj = dgc_topk_with_info(x, k, generator=torch.Generator().manual_seed(seed))
        _check_contract(x, k, values, indices)
        assert set(indices.tolist()) == ref  # superset then exact top-k: equals exact top-k
        adjusted += adj > 0
    assert adjusted >= 1  # without a safety margin the sample threshold is often too high


def test_sparse_nonzero() -> None:
    g = torch.Generator().manual_seed(0)
    for n, p in ((8, 0.5), (4096, 0.0), (4096, 1.0), (80_000, 0.001), (80_000, 0.3)):
        mask = torch.rand(n, generator=g) < p
        assert torch.equal(mstopk_mod.sparse_nonzero(mask), torch.nonzero(mask).squeeze(1))


def test_workspace_reused() -> None:
    x = torch.randn(1 << 20)
    mstopk(x, 300)
    a1, m1 = mstopk_mod._Workspace.get(x.numel(), x.dtype, x.device)
    mstopk(x * 2, 300)
    a2, m2 = mstopk_mod._Workspace.get(x.numel(), x.dtype, x.device)
    assert a1.data_ptr() == a2.data_ptr() and m1.data_ptr() == m2.data_ptr()


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="mstopk, exact, dgc"):
        get_selector("sort")
    with pytest.raises(ValueError, match="1-D"):
        mstopk(torch.randn(4, 4), 2)
    with pytest.raises(ValueError, match="floating"):
        exact_topk(torch.arange(10), 2)
    with pytest.raises(ValueError, match="iters"):
        mstopk(torch.randn(10), 2, iters=0)
    with pytest.raises(ValueError, match="sample_ratio"):
        get_selector("dgc")(torch.randn(10), 2, sample_ratio=0.0)
    x = torch.randn(1000)
    x[17] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        mstopk(x, 10)
    x = torch.randn(300_000)
    x[5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        mstopk(x, 100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_contract() -> None:
    x = _data("student_t2", D, seed=1).cuda()
    k = D // 100
    for name in SELECTOR_CHOICES:
        values, indices = get_selector(name)(x, k)
        assert values.is_cuda and indices.is_cuda
        _check_contract(x.cpu(), k, values.cpu(), indices.cpu())
        assert _recall(x.cpu(), k, indices.cpu()) >= 0.999
    g = torch.Generator(device="cuda").manual_seed(0)
    a = mstopk(x, k, generator=g)[1]
    g.manual_seed(0)
    assert torch.equal(a, mstopk(x, k, generator=g)[1])
