"""Peak memory of ``CropBatch.padded()`` (the device-side padding of a crop batch) at the DAWNBench shape.

What is measured: the peak of LIVE TENSOR BYTES while a function runs, counted by a
``TorchDispatchMode`` (:class:`TensorBytesMeter`): every tensor an operator returns is looked up by
its storage; a storage seen for the first time adds its ``nbytes`` and a ``weakref.finalize`` on
the storage subtracts them when it is freed. Views share their storage (counted once); the inputs,
created before the meter starts, are not counted. This is allocator-free (what the caching
allocator of a GPU would have to hold at least, not its fragmentation) and runs on a CPU; the
same ops on CUDA allocate the same tensors. ``tracemalloc`` does not see torch's allocations and
RSS mixes in the allocator's caching, which is why neither is used.

Shape (DAWNBench, Shi et al. 2021 section 5.6): 256 samples per GPU, records of the default
variant (short side 160, ImageNet's 4:3 / 3:4 aspect: 160x213 or 213x160), torchvision
RandomResizedCrop windows (scale 0.08..1, ratio 3/4..4/3) cut by ``CropCollate``. The output is
the padded uint8 batch ``[256, hmax, wmax, 3]``.

Compared side by side in one run:

* ``unchunked``: the previous implementation (one scatter over every packed byte, five int64
  index arrays the size of the pixel buffer), kept here as the baseline;
* ``chunked``: today's ``CropBatch.padded()`` (the same scatter over chunks of output/128 bytes);
* ``resize_matmul``: the whole matmul resize to 96 px that consumes it (padding, weights, float
  copies; both passes run per group of samples: ``trainer.device_augment.MATMUL_GROUPS``).

Ratios (lower is better): ``padded_peak_vs_output`` (today; the target is <= 2),
``unchunked_peak_vs_output`` (before). ``padded_peak_reduction`` = before / today (higher is
better); ``resize_matmul_peak_vs_output`` (lower is better; 9.2 before the passes were grouped).
Run: ``python -m bench.augment_memory`` (``--quick``: 32 samples).
"""

from __future__ import annotations

import argparse
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.common import RESULTS_DIR, bar_chart, machine_info, print_machine, write_results
from client.crop import _H, _OFF, _W, CropBatch, CropCollate


class TensorBytesMeter(TorchDispatchMode):
    """Current and peak bytes of tensors allocated under this mode (see the module docstring).
    HAZARD (threads): dispatch modes are thread-local; run the measured function on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.live:
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Peak live bytes of the tensors ``fn()`` allocates (its result included while it runs)."""
    meter = TensorBytesMeter()
    with meter:
        result = fn()
    del result
    return meter.peak


def padded_unchunked(batch: CropBatch) -> torch.Tensor:
    """The previous ``CropBatch.padded()``: one scatter over all bytes (the baseline)."""
    n, hp, wp = len(batch), batch.hmax, batch.wmax
    dev = batch.pixels.device
    h, w, off = (batch.meta.select(1, c).to(torch.int64) for c in (_H, _W, _OFF))
    total = batch.pixels.numel()
    sample = torch.repeat_interleave(torch.arange(n, device=dev), h * w * 3, output_size=total)
    pos = torch.arange(total, device=dev) - off[sample]
    row_len = (w * 3)[sample]
    row = torch.div(pos, row_len, rounding_mode="floor")
    dst = sample * (hp * wp * 3) + row * (wp * 3) + pos % row_len
    out = torch.zeros(n * hp * wp * 3, dtype=torch.uint8, device=dev)
    out[dst] = batch.pixels
    return out.view(n, hp, wp, 3)


def dawnbench_batch(n: int, seed: int = 0, short: int = 160) -> CropBatch:
    g = torch.Generator().manual_seed(seed)
    long = round(short * 4 / 3)
    images = []
    for k in range(n):
        h, w = (short, long) if k % 4 else (long, short)  # mostly landscape, as ImageNet
        images.append(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1))
    return CropCollate(seed=seed)([(im, k % 1000) for k, im in enumerate(images)])


def _time(fn: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    from trainer.device_augment import resize_matmul

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32 samples instead of 256")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results directory")
    args = p.parse_args(argv)
    machine = print_machine(machine_info())
    n = 32 if args.quick else 256
    batch = dawnbench_batch(n)
    out_bytes = n * batch.hmax * batch.wmax * 3
    assert torch.equal(padded_unchunked(batch), batch.padded())  # same batch, two implementations
    runs = {
        "unchunked": lambda: padded_unchunked(batch),
        "chunked": batch.padded,
        "resize_matmul_96px": lambda: resize_matmul(batch, 96),
    }
    results: dict[str, Any] = {"output_bytes": out_bytes, "packed_bytes": int(batch.pixels.numel())}
    for name, fn in runs.items():
        peak = peak_tensor_bytes(fn)
        results[name] = {"peak_bytes": peak, "peak_vs_output": peak / out_bytes, "seconds": _time(fn)}
        print(f"{name:>20}: peak {peak / 2**20:8.1f} MiB = {peak / out_bytes:5.2f}x the padded output "
              f"({out_bytes / 2**20:.1f} MiB), {1000 * results[name]['seconds']:.1f} ms")
    ratios = {"padded_peak_vs_output": results["chunked"]["peak_vs_output"],
              "unchunked_peak_vs_output": results["unchunked"]["peak_vs_output"],
              "padded_peak_reduction": results["unchunked"]["peak_bytes"] / results["chunked"]["peak_bytes"],
              "resize_matmul_peak_vs_output": results["resize_matmul_96px"]["peak_vs_output"]}
    config = {"samples": n, "record_short_side": 160, "record_long_side": round(160 * 4 / 3),
              "crop_scale": [0.08, 1.0], "hmax": batch.hmax, "wmax": batch.wmax,
              "method": "peak live tensor bytes via a TorchDispatchMode (see bench/augment_memory.py)"}
    name = "augment_memory_quick" if args.quick else "augment_memory"
    write_results(name, machine=machine, config=config, results=results, ratios=ratios, out_dir=args.out,
                  notes=["peak includes the output batch; inputs (packed pixels, meta) excluded",
                         "seconds: best of 3 on the CPU, informational only (a shared machine is noisy); "
                         "the byte counts are deterministic"])
    bar_chart(f"{args.out}/{name}.png", list(runs), [results[k]["peak_vs_output"] for k in runs],
              title=f"peak tensor bytes / padded output, {n} DAWNBench crops", ylabel="x output bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
