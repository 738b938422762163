"""The fused radix select (trainer/comm/radix_select_triton.py): MSTopK's path on CUDA with Triton.

On a machine without CUDA the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set for the session by tests/conftest.py); with CUDA they run compiled on the GPU. Against an independent
statement of the rule (a stable sort of the magnitude keys: descending key, ascending index) and bit for
bit against MSTopK's pure-torch device path, on the adversarial inputs of tests/test_selectors.py in every
float width, several tiles and a grid-stride loop; launches (10 at fp32) and reads of x (5) counted by
wrapping the launcher; no host sync; ``mstopk`` takes this path where it is usable.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from tests.op_audit import OpCount, SyncAudit
from tests.test_radix_select import adversarial
from tests.test_selectors import KINDS, _data
from trainer.comm import radix_select_triton as rst
from trainer.comm import topk_keys
from trainer.comm.mstopk import mstopk_with_info
from trainer.comm.topk_keys import magnitude_keys

if not rst.HAVE_TRITON:
    pytest.skip("triton is not installed on this platform (the test extras install it where it has a wheel)",
                allow_module_level=True)

DEV = "cpu" if rst.interpreting() else "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the top k of |x| by a stable sort of the keys (ties: lowest index first)."""
    order = torch.sort(magnitude_keys(x).long(), descending=True, stable=True).indices
    return torch.sort(order[:k]).values.to(torch.int32)


def check(x: torch.Tensor, k: int, **kw) -> None:
    vals, idx, thres = rst.fused_topk(x.to(DEV), k, **kw)
    vals, idx, thres = vals.cpu(), idx.cpu(), thres.cpu()
    want = reference(x, k)
    assert idx.dtype == torch.int32 and torch.equal(idx, want), (x.dtype, x.numel(), k)
    dev = mstopk_with_info(x, k, path="device")  # the pure-torch radix select: same bits
    assert dev.path == "device"
    assert torch.equal(vals.view(magnitude_keys(vals).dtype), dev.values.view(magnitude_keys(vals).dtype))
    assert thres.dtype == dev.threshold_key.dtype and int(thres) == int(dev.threshold_key)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_inputs_every_width(dtype: torch.dtype) -> None:
    for kind in (*KINDS, "nonfinite"):
        for n in (37, 20_000):
            x = adversarial(kind, n, dtype)
            for k in sorted({1, n // 100 or 1, n // 3, n - 1}):
                # 20,000 in tiles of 2,048 (10 tiles: ties and the scan cross tile edges), 3 histogram
                # programs looping over them
                check(x, k, **({"tile": 2048, "programs": 3} if n > 2048 else {}))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_million_elements(dtype: torch.dtype) -> None:
    x = _data("lognormal8", 1 << 20, seed=7).to(dtype)
    x[12345] = float("nan")
    for k in (1000, 10_000):  # 0.1 % and 1 %
        check(x, k)


def test_digit_boundaries_and_many_ties() -> None:
    # keys that differ only in the low digit, only in the high digit, and straddle 2**10 / 2**11 / 2**21
    for base in (0, (1 << 10) - 3, (1 << 11) - 3, (1 << 21) - 2, (1 << 31) - 5):
        keys = torch.tensor([base, base + 1, base + 2, base + 2, base + 1, base] * 50, dtype=torch.int32)
        x = keys.view(torch.float32)
        for k in (1, 2, 3, 99, 100, 101, 299):
            check(x, k, tile=64, programs=2)


def test_launches_reads_and_no_host_sync() -> None:
    def kernel_launch(names: list[str]):
        def launch(kernel, grid, *args, **meta):
            names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
            # the interpreter copies each argument in and out with aten ops of its own (a compiled launch
            # dispatches none): the audits below look at the torch ops around the kernels only
            with _disable_current_modes():
                rst._launch(kernel, grid, *args, **meta)
        return launch

    budgets = ((torch.float32, 10, 3), (torch.float16, 8, 2), (torch.float64, 16, 6))
    for dtype, launches_at_most, passes in budgets:
        x = _data("normal", 50_000, seed=1).to(dtype).to(DEV)
        kernels: list[str] = []
        with OpCount() as ops:
            rst.fused_topk(x, 500, launch=kernel_launch(kernels))
        # torch's own launches: the zeroed bins and the scan of the tile counts
        assert ops.launching == 2 and set(ops.by_op) == {"zeros.default", "cumsum.default"}, ops.summary()
        assert len(kernels) + ops.launching <= launches_at_most, (dtype, kernels, ops.summary())
        reads = [k for k in kernels if k in ("histogram", "count", "write")]  # the kernels that read all of x
        assert kernels.count("histogram") == kernels.count("pick") == passes and len(reads) == passes + 2
    if DEV == "cpu":  # (on a GPU the sync check is torch.cuda.set_sync_debug_mode, in bench.gpu)
        with SyncAudit() as audit:
            rst.fused_topk(_data("normal", 50_000, seed=2), 500, launch=kernel_launch([]))
        assert audit.found == []


def test_mstopk_takes_the_fused_path_where_usable(monkeypatch) -> None:
    x = _data("student_t2", 100_000, seed=4)
    if DEV == "cpu":
        assert not rst.usable(x)  # by default a CPU tensor takes MSTopK's CPU paths
        monkeypatch.setattr(rst, "FUSED_ON_CPU", True)
        monkeypatch.setattr(topk_keys, "DEVICE_PATH_ON_CPU", True)  # CUDA's choices (no compact path)
    res = mstopk_with_info(x.to(DEV), 1000)
    assert res.path == "fused" and torch.equal(res.indices.cpu(), reference(x, 1000))
    assert not rst.usable(torch.empty(10, device="meta"))  # meta: the pure-torch radix select


def test_bad_arguments_are_clear_errors() -> None:
    x = torch.randn(100)
    for k in (0, 100):
        with pytest.raises(ValueError, match="mstopk handles 0 and n"):
            rst.fused_topk(x.to(DEV), k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the compiled kernels, "
                    "torch.cuda.set_sync_debug_mode and CUDA graph capture")
def test_compiled_on_cuda_exact_sync_free_and_graph_capturable() -> None:
    for dtype in DTYPES:
        for kind in ("normal", "ties", "outlier_1e9", "denormal"):
            x = adversarial(kind, 3_000_000, dtype)
            xc = x.cuda()
            torch.cuda.set_sync_debug_mode("error")
            try:
                vals, idx, _ = rst.fused_topk(xc, 3000)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(idx.cpu(), reference(x, 3000)), (dtype, kind)
            assert torch.equal(vals.cpu(), x[idx.cpu().long()])
    x = _data("normal", 1 << 20, seed=9).cuda()
    rst.fused_topk(x, 1000)  # compiled and warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, idx, _ = rst.fused_topk(x, 1000)
    x.copy_(_data("student_t2", 1 << 20, seed=10).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(idx.cpu(), reference(x.cpu(), 1000))
