"""Kernel launches per call on CUDA, counted with the profiler: the evidence behind the launch budgets.

``python -m bench.gpu_kernels`` (GPU only; run by ``python -m bench.gpu`` as the ``kernels`` check)
counts the CUDA kernels (memcpy/memset excluded) of one call of:

* ``torch._foreach_*`` forms over ResNet-50's 161 parameter shapes whose other list holds 0-d tensors
  (a per-layer trust ratio): ``_foreach_addcmul_`` with such a list, ``_foreach_mul``/``_foreach_mul_``
  by it, and, for comparison, ``_foreach_add_`` of matching lists and ``_foreach_mul_`` by one 0-d
  tensor. A form that falls back to one kernel per tensor shows ~161: what ``tests/op_audit.py``'s
  ``ForeachShapeAudit`` keeps out of the optimizers (on the CPU every foreach op is a loop, so the
  difference is only visible here);
* a LARS step (plain and Nesterov, weight decay on) and a LAMB step on ResNet-50's parameters;
* device augmentation (``DeviceAugment``, matmul path, channels-last) of a 256- and a 32-image batch
  of 160-px records to 128 px: the same count for both (the CPU-counted budget is <= 64 aten ops).

Writes ``bench/results/gpu_kernels_gpu.json`` and ``gpu_kernels_gpu.png``; ratios ``<name>_kernels``
and ``foreach_mul_0d_vs_addcmul_0d`` (the fallback's kernels over the fused form's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.common import RESULTS_DIR, bar_chart, machine_info, print_machine, write_results


def kernels(fn: Callable[[], Any], reps: int = 3, timed: int = 20) -> dict[str, Any]:
    """Kernels per call of ``fn`` (profiler, ``reps`` calls after one warm-up) and wall us per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
          and not any(w in e.name.lower() for w in ("memcpy", "memset"))]
    t0 = time.perf_counter()
    for _ in range(timed):
        fn()
    torch.cuda.synchronize()  # host/device sync: the wall time includes the GPU's work
    return {"kernels_per_call": len(ks) / reps, "us_per_call": (time.perf_counter() - t0) / timed * 1e6,
            "kernel_names": sorted({e.name[:80] for e in ks})[:6]}


def measure(dev: torch.device) -> dict[str, dict[str, Any]]:  # pragma: no cover - GPU only
    from bench.augment_memory import dawnbench_batch
    from trainer.device_augment import DeviceAugment
    from trainer.models.resnet import resnet50
    from trainer.optim.lamb import LAMB
    from trainer.optim.lars import LARS

    g = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(p.detach().to(dev)) for p in resnet50().parameters()]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev, generator=g)
    grads = [p.grad for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    trust = torch.rand(len(params), device=dev, generator=g)
    t0d = list(trust.unbind(0))
    out = {
        "addcmul_0d": kernels(lambda: torch._foreach_addcmul_(bufs, grads, t0d)),
        "mul_0d": kernels(lambda: torch._foreach_mul(grads, t0d)),
        "mul_inplace_0d": kernels(lambda: torch._foreach_mul_(bufs, t0d)),
        "add_matching": kernels(lambda: torch._foreach_add_(bufs, grads, alpha=0.1)),
        "mul_one_0d": kernels(lambda: torch._foreach_mul_(bufs, trust[0])),
    }
    for name, opt in (("lars_step", LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-5)),
                      ("lars_nesterov_step", LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-5,
                                                  nesterov=True)),
                      ("lamb_step", LAMB(params, lr=1e-3, weight_decay=0.01))):
        out[name] = kernels(opt.step)
    aug = DeviceAugment(method="matmul", memory_format=torch.channels_last)
    for n in (256, 32):
        batch = dawnbench_batch(n).to(dev)
        out[f"augment_{n}"] = kernels(lambda b=batch: aug(b, 128))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    machine = print_machine(machine_info())
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to count (this benchmark runs on a GPU only)")
        return 2
    res = measure(torch.device("cuda", 0))  # pragma: no cover - GPU only
    ratios = {f"{k}_kernels": v["kernels_per_call"] for k, v in res.items()}
    ratios["foreach_mul_0d_vs_addcmul_0d"] = res["mul_inplace_0d"]["kernels_per_call"] / max(
        1.0, res["addcmul_0d"]["kernels_per_call"])
    notes = [f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; ResNet-50 parameter "
             "shapes (161 tensors); kernels counted with torch.profiler (CUDA activity), "
             "memcpy/memset excluded"]
    write_results("gpu_kernels_gpu", machine=machine, config={"tensors": 161, "augment_size": 128},
                  results=res, ratios=ratios, notes=notes)
    bar_chart(RESULTS_DIR / "gpu_kernels_gpu.png", list(res), [v["kernels_per_call"] for v in res.values()],
              title=f"CUDA kernels per call ({torch.cuda.get_device_name(0)})", ylabel="kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
