"""GPU settings of the trainer, checked on the CPU (issue 23, item 3).

* A resumed run's layout warm-up (``trainer.build.layout_warmup``) runs under the training step's
  autocast: it saves the activations training saves (bf16 here, the CPU's autocast type; fp16 on a
  GPU), not fp32's twice as many -- a batch size tuned with AMP must not run out of memory only on
  resume. Measured by the bytes autograd saves for backward (``saved_tensors_hooks``) on a one-rank
  gloo group; the warm-up still leaves no trace (buffers, gradients, the hook state's step).
* ``cudnn.benchmark`` is set on CUDA only.
* The CUDA caching allocator gets expandable segments unless the user configured it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.build import layout_warmup, tune_cudnn
from trainer.comm.comm_config import CommConfig
from trainer.comm.hooks import wrap


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _saved_bytes(ddp, state, batch, autocast) -> int:  # type: ignore[no-untyped-def]
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layout_warmup(ddp, state, batch, nn.CrossEntropyLoss(), autocast)
    return total[0]


def test_warmup_saves_what_the_amp_step_saves_and_leaves_no_trace(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        ddp, state = wrap(_net(), CommConfig(method="allreduce"))
        x = torch.randn(4, 3, 32, 32)
        batch = (x, torch.zeros(4, dtype=torch.long))
        buffers = {k: v.clone() for k, v in ddp.module.named_buffers()}
        step = state.step
        fp32 = _saved_bytes(ddp, state, batch, None)
        bf16 = _saved_bytes(ddp, state, batch, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        assert bf16 < 0.75 * fp32, (bf16, fp32)  # convolutions save bf16 inputs: about half
        assert state.step == step and all(p.grad is None for p in ddp.module.parameters())
        for k, v in ddp.module.named_buffers():
            assert torch.equal(v, buffers[k]), k
    finally:
        dist.destroy_process_group()


def test_cudnn_benchmark_only_on_cuda() -> None:
    before = torch.backends.cudnn.benchmark
    try:
        assert tune_cudnn(torch.device("cpu")) is False and torch.backends.cudnn.benchmark == before
        assert tune_cudnn(torch.device("cuda", 0)) is True and torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before


def test_cuda_allocator_defaults_keep_the_users_setting() -> None:
    from trainer.distenv import ALLOC_CONF, cuda_allocator_defaults

    env: dict[str, str] = {}
    assert cuda_allocator_defaults(env) == ALLOC_CONF == env["PYTORCH_CUDA_ALLOC_CONF"]
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert cuda_allocator_defaults(mine) == "max_split_size_mb:128"  # the user's value wins
