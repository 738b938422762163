"""fp16_wrapper around hooks that are not this package's (a plain PyTorch DDP comm hook) on real
gloo DDP, and its refusal of hooks that already cast to a 16-bit wire format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.dist_utils import run_distributed
from trainer.comm import HOOKS, fp16_wrapper

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _grads(rank: int, hook: object | None) -> list[np.ndarray]:
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.detach().clone().numpy() for p in ddp.module.parameters()]


def _rank_main(rank: int, world: int) -> dict:
    return {"plain": _grads(rank, None),
            "wrapped": _grads(rank, fp16_wrapper(default_hooks.allreduce_hook))}


def test_fp16_wrapper_composes_with_a_plain_torch_hook() -> None:
    results = run_distributed(_rank_main, world_size=WORLD, local_size=WORLD)
    for r in results:
        for plain, wrapped in zip(r["plain"], r["wrapped"], strict=True):
            assert wrapped.dtype == np.float32  # the fp32 gradients were written back
            # the average went over the wire as float16: every value is exactly a float16 value ...
            np.testing.assert_array_equal(wrapped, wrapped.astype(np.float16).astype(np.float32))
            # ... and equals the fp32 average up to float16 rounding
            np.testing.assert_allclose(wrapped, plain, rtol=2e-3, atol=2e-4)
        # the fp32 path is not float16-exact, so the check above really tells the two apart
        assert any(not np.array_equal(p, p.astype(np.float16).astype(np.float32)) for p in r["plain"])
    np.testing.assert_array_equal(results[0]["wrapped"][0], results[1]["wrapped"][0])


@pytest.mark.parametrize("hook", [
    default_hooks.fp16_compress_hook,
    default_hooks.bf16_compress_hook,
    default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
    fp16_wrapper(default_hooks.allreduce_hook),
    fp16_wrapper(HOOKS["hitopk"]),
], ids=["fp16_compress_hook", "bf16_compress_hook", "torch_fp16_wrapper", "torch_bf16_wrapper",
        "ours_around_torch", "ours_around_ours"])
def test_fp16_wrapper_refuses_a_hook_that_already_casts(hook: object) -> None:
    with pytest.raises(ValueError, match="already sends 16-bit values") as exc:
        fp16_wrapper(hook)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_fp16_wrapper_refuses_a_non_callable() -> None:
    with pytest.raises(TypeError, match=r"needs a DDP comm hook.*got str"):
        fp16_wrapper("allreduce")  # type: ignore[arg-type]


def test_fp16_wrapper_keeps_our_hooks_on_the_in_algorithm_path() -> None:
    wrapped = fp16_wrapper(HOOKS["allreduce"])
    assert getattr(wrapped, "comm_hook", False) and getattr(wrapped, "wire_fp16", False)
