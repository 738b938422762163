"""Per-batch budgets of the GPU code paths, counted on a machine without a GPU (issue 23 item 2).

Device augmentation (``trainer.device_augment.DeviceAugment`` on a ``client.crop.CropBatch``, the
``"matmul"`` method a CUDA batch takes) runs right after the step's host sync while the GPU idles:
every kernel launch is latency on the step, and one host sync would stall the pipeline. Budgets:

* a 256-image batch of random-resized-crop windows (DAWNBench records, short side 160) to 128 px,
  channels_last, end to end (padding, weights, resize, flip, normalisation, memory format):
  <= 64 launching aten ops (``tests.op_audit.OpCount``), the same for 32 images, and no host sync
  (``tests.op_audit.SyncAudit``). The previous code (``CropBatch.padded`` scattering in ~50
  chunks of ~14 ops, the GEMMs in 8 groups) launched 713 ops (897 aten ops in all) on this batch;
* no host sync for training (whole windows), validation (fractional boxes) and pad-crop batches.

How the CUDA path runs here: ``FakeTensorMode`` makes ``cuda`` tensors on the CPU-only torch (no
data, no kernels; the op counts come from it: the code picks its path by ``device.type``), and
``client.crop.DEVICE_PATH_ON_CPU`` runs the same device code on real CPU tensors, where the values
are compared with the CPU path and ``SyncAudit`` sees every op (under fake CUDA an op that reads
data raises instead). The device path's results equal the CPU path's within float rounding
(the GEMMs sum in another order) and ``padded`` equals a per-window copy exactly.

Comm hooks: ``test_comm_safety.py`` audits the hooks' CUDA path (forced on CPU, 4 gloo ranks) for
allreduce / torus / naive_ag / hitopk with the ``mstopk`` and ``exact`` selectors, fp16 on; here
its helpers run every method with fp16 off and on through the config (``make_hook``), and the
``dgc`` selector, which syncs by design (the audit must see it where it samples). One spawn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.augment_memory import dawnbench_batch
from client import crop
from client.crop import (
    _FLIP,
    _H,
    _LABEL,
    _LEFT,
    _OFF,
    _TOP,
    _W,
    _XEXT,
    _YEXT,
    META_COLUMNS,
    CenterCropCollate,
    CropBatch,
    CropCollate,
    PadCropCollate,
    pack_windows,
)
from tests.op_audit import ForeachShapeAudit, OpCount, SyncAudit
from trainer.device_augment import DeviceAugment, axis_weights, resize_matmul

CUDA = torch.device("cuda", 0)
LAUNCH_BUDGET = 64  # launching aten ops per device augmentation of a batch, whatever its size


def fake() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


class device_path_on_cpu:
    """Run the device code path on CPU tensors inside the ``with`` block."""

    def __enter__(self) -> None:
        crop.DEVICE_PATH_ON_CPU = True

    def __exit__(self, *exc: object) -> None:
        crop.DEVICE_PATH_ON_CPU = False


def _images(sizes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # HWC memory viewed as CHW, like CachedImageNet's records
    return [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).permute(2, 0, 1)
            for h, w in sizes]


def _manual_batch(windows: list[tuple[int, int, int, int]], flips: list[bool], seed: int = 0) -> CropBatch:
    """Whole-window boxes cut at ``(top, left, h, w)`` of 40 x 50 images (empty windows allowed)."""
    images = _images([(40, 50)] * len(windows), seed)
    pixels, offsets = pack_windows(images, windows)
    meta = np.zeros((len(windows), len(META_COLUMNS)))
    for k, ((top, left, h, w), flip) in enumerate(zip(windows, flips)):
        cols = [_H, _W, _TOP, _LEFT, _YEXT, _XEXT, _FLIP, _LABEL, _OFF]
        meta[k, cols] = h, w, top, left, h, w, flip, k, offsets[k]
    return CropBatch(pixels, torch.from_numpy(meta), max(w[2] for w in windows), max(w[3] for w in windows))


def _cases() -> dict[str, CropBatch]:
    g = torch.Generator().manual_seed(7)
    sizes = [tuple(s) for s in torch.randint(6, 90, (23, 2), generator=g).tolist()]
    rrc = CropCollate(seed=3)([(im, k) for k, im in enumerate(_images(sizes, 1))])
    odd = _manual_batch([(0, 0, 33, 47), (3, 5, 17, 9), (1, 1, 39, 49), (10, 20, 5, 29)],
                        [True, False, True, True])
    empty = _manual_batch([(0, 0, 0, 7), (2, 3, 11, 13), (5, 5, 6, 0), (0, 0, 1, 1), (4, 4, 0, 0)],
                          [False, True, True, False, True])
    small = [(im, k) for k, im in enumerate(_images([(28, 28)] * 9 + [(20, 31)] * 3, 2))]
    return {
        "rrc": rrc,
        "one": CropCollate(seed=4)([(_images([(37, 61)], 3)[0], 0)]),
        "odd_maxima": odd,
        "empty_windows": empty,
        "validation": CenterCropCollate(24)([(im, k) for k, im in enumerate(_images(sizes[:9], 5))]),
        "padcrop": PadCropCollate(24, 4, seed=6)(small),
    }


CASES = _cases()


def _padded_reference(batch: CropBatch) -> torch.Tensor:
    """Each window copied into a zero batch, from ``meta``'s numbers alone (independent of padded())."""
    out = torch.zeros((len(batch), batch.hmax, batch.wmax, 3), dtype=torch.uint8)
    for k, row in enumerate(batch.meta.tolist()):
        h, w, off = int(row[_H]), int(row[_W]), int(row[_OFF])
        out[k, :h, :w] = batch.pixels[off:off + h * w * 3].reshape(h, w, 3)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_padded_device_path_equals_a_per_window_copy(name: str) -> None:
    batch = CASES[name]
    if name == "odd_maxima":
        assert batch.hmax % 2 == 1 and batch.wmax % 2 == 1
    ref = _padded_reference(batch)
    with device_path_on_cpu():
        got = batch.padded()
    assert got.shape == ref.shape and got.dtype == torch.uint8
    assert torch.equal(got, ref)
    assert torch.equal(batch.padded(), ref)  # the CPU path (scatter in chunks), unchanged
    assert torch.equal(batch.padded(chunk=997), ref)


def _reversed_rows_axis_weights(start, extent, window, n_out: int, n_in: int, flip=None) -> torch.Tensor:
    """``axis_weights`` as it was before the flip moved into the output positions: weights for
    every row, then the flipped samples' rows reversed (the CPU path's old numbers, for equality)."""
    start = start.to(torch.float32)
    scale = extent.to(torch.float32) / n_out
    fs = scale.clamp(min=1.0)
    out_pos = torch.arange(n_out, dtype=torch.float32) + 0.5
    centre = start.unsqueeze(1) + out_pos * scale.unsqueeze(1)
    pos = (torch.arange(n_in, dtype=torch.float32) + 0.5).view(1, 1, n_in)
    w = (1.0 - (pos - centre.unsqueeze(2)).abs() / fs.view(-1, 1, 1)).clamp_(min=0.0)
    w.mul_(pos < window.to(torch.float32).view(-1, 1, 1))
    w.div_(w.sum(dim=2, keepdim=True).clamp_(min=1e-12))
    if flip is not None:
        w = torch.where(flip.view(-1, 1, 1), w.flip(1), w)
    return w


@pytest.mark.parametrize("name", list(CASES))
def test_axis_weights_equal_the_reversed_rows_and_both_axes_at_once(name: str) -> None:
    batch = CASES[name]
    b, win, n, hp, wp = batch.boxes, batch.windows, len(batch), batch.hmax, batch.wmax
    for size in (16, 37):
        wy = axis_weights(b.select(1, 0), b.select(1, 1), win.select(1, 0), size, hp)
        wx = axis_weights(b.select(1, 2), b.select(1, 3), win.select(1, 1), size, wp, flip=batch.flips)
        assert torch.equal(wy, _reversed_rows_axis_weights(b.select(1, 0), b.select(1, 1), win.select(1, 0),
                                                           size, hp))
        assert torch.equal(wx, _reversed_rows_axis_weights(b.select(1, 2), b.select(1, 3), win.select(1, 1),
                                                           size, wp, flip=batch.flips))
        # the device path's single call over [B, 2] (n_in = max(hp, wp)), narrowed: the same numbers
        box = b.to(torch.float32).view(n, 2, 2)
        flips2 = torch.stack([torch.zeros_like(batch.flips), batch.flips], 1)
        both = axis_weights(box.select(2, 0), box.select(2, 1), win, size, max(hp, wp), flip=flips2)
        assert torch.equal(both.select(1, 0).narrow(2, 0, hp), wy)
        assert torch.equal(both.select(1, 1).narrow(2, 0, wp), wx)
        assert not both.select(1, 0).narrow(2, hp, max(hp, wp) - hp).any()  # past every window: weight 0


def _sizes(batch: CropBatch) -> tuple[int, ...]:
    return (batch.size,) if batch.size else (16, 37, 128)


@pytest.mark.parametrize("name", list(CASES))
def test_device_resize_and_augment_equal_the_cpu_path(name: str) -> None:
    batch = CASES[name]
    if name in ("rrc", "odd_maxima", "empty_windows", "padcrop"):
        assert 0 < int(batch.flips.sum()) < len(batch)  # both orientations in the batch
    for size in _sizes(batch):
        cpu = resize_matmul(batch, size)
        with device_path_on_cpu():
            dev = resize_matmul(batch, size)
        assert dev.shape == cpu.shape == (len(batch), 3, size, size) and dev.dtype == torch.float32
        # the same products summed in another order by the GEMMs: equal within float rounding (pixel units)
        assert float((dev - cpu).abs().max()) <= 1e-3, (name, size)
        for fmt in (torch.channels_last, torch.contiguous_format):
            for dtype in (torch.float32, torch.bfloat16):
                aug = DeviceAugment(method="matmul", memory_format=fmt, dtype=dtype)
                x_cpu, y_cpu = aug(batch, size)
                with device_path_on_cpu():
                    x_dev, y_dev = aug(batch, size)
                assert x_dev.dtype == dtype and x_dev.is_contiguous(memory_format=fmt)
                assert x_cpu.is_contiguous(memory_format=fmt) and torch.equal(y_dev, y_cpu)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                close = torch.allclose(x_dev.float(), x_cpu.float(), rtol=0, atol=tol)
                assert close, (name, size, fmt, dtype)


def _launches(aug: DeviceAugment, batch: CropBatch, size: int) -> OpCount:
    with OpCount() as count:
        x, _ = aug(batch, size)
    assert tuple(x.shape) == (len(batch), 3, size, size)
    assert x.is_contiguous(memory_format=torch.channels_last)
    return count


def test_device_augmentation_of_a_256_image_batch_launches_at_most_64_ops() -> None:
    counts = {}
    for n in (256, 32):
        batch = dawnbench_batch(n)  # CropCollate windows of 160-px records, as the trainer's loader cuts them
        with fake():
            dev = batch.to(CUDA)
            aug = DeviceAugment(method="matmul", memory_format=torch.channels_last)
            first = _launches(aug, dev, 128)  # includes the two constants' one-off upload
            counts[n] = _launches(aug, dev, 128)
            with OpCount() as pad:
                dev.padded()
        assert first.launching <= LAUNCH_BUDGET, first.summary()
        assert pad.launching <= 16, pad.summary()
    assert counts[256].launching == counts[32].launching, (counts[256].summary(), counts[32].summary())
    assert counts[256].by_op["bmm.out"] == 2  # the horizontal pass in DEVICE_MATMUL_GROUPS groups
    # the switch runs the very same ops on CPU tensors (so the sync audit below sees the CUDA path)
    small = dawnbench_batch(32)
    aug = DeviceAugment(method="matmul", memory_format=torch.channels_last)
    with device_path_on_cpu():
        aug(small, 128)
        on_cpu = _launches(aug, small, 128)
    assert on_cpu.launching == counts[32].launching and on_cpu.total == counts[32].total, on_cpu.summary()


@pytest.mark.parametrize("name", ["rrc", "one", "validation", "padcrop", "empty_windows", "dawnbench"])
def test_device_augmentation_runs_no_host_sync(name: str) -> None:
    batch = dawnbench_batch(16) if name == "dawnbench" else CASES[name]
    size = batch.size or 64
    aug = DeviceAugment(method="matmul", memory_format=torch.channels_last)
    aug(batch, size)  # the constants (a one-off upload on a GPU) exist before the audit
    with device_path_on_cpu(), SyncAudit() as audit:
        aug(batch, size)
    assert audit.found == [], audit.found
    with fake():  # and on fake CUDA tensors (any read of their data would raise): auto picks matmul
        dev = batch.to(CUDA)
        aug = DeviceAugment(memory_format=torch.channels_last)
        assert aug.method_for(dev) == "matmul"
        x, y = aug(dev, size)
        assert x.device == CUDA and y.device == CUDA


def test_op_count_counts_launches_not_views() -> None:
    """The premise of the budgets: views, reshapes-as-views and allocations are free, conversions
    and fills are launches, and the counts are the same on fake CUDA as on the CPU."""
    def work(dev: torch.device) -> None:
        x = torch.zeros(4, 6, device=dev)                    # launch (fill)
        y = x.view(24).narrow(0, 2, 8).unsqueeze(0).t()     # views
        y.to(torch.float32)                                  # same dtype: nothing dispatched
        y.to(torch.float16)                                  # launch (conversion)
        torch.empty(3, device=dev)                           # allocation only
        x.permute(1, 0).reshape(24)                          # launch: reshape of a permuted view copies
    with OpCount() as cpu:
        work(torch.device("cpu"))
    with fake(), OpCount() as cuda:
        work(CUDA)
    for c in (cpu, cuda):
        assert c.launching == 3, c.summary()
        assert c.by_op["_to_copy.default"] == 1 and c.by_op["clone.default"] == 1, c.summary()
    assert cpu.total == cuda.total


# ---- comm hooks: fp16 off and the dgc selector, on test_comm_safety.py's harness ------------------

def _hook_syncs(rank: int, world: int) -> dict:
    """Every method's hook (each selector for the sparse ones), fp16 off and on, the CUDA code path
    forced on CPU tensors, each hook call under the sync audit: ``{config: [found per call]}``."""
    from torch import nn

    from tests.test_comm_safety import CAP_MB, _loss, _model
    from trainer.comm import make_hook, register, topk_keys
    from trainer.comm.comm_config import CommConfig
    from trainer.comm.names import METHOD_CHOICES, SELECTOR_CHOICES, SPARSE_METHODS

    found: dict[str, list[str]] = {}
    topk_keys.DEVICE_PATH_ON_CPU = True
    try:
        for method in METHOD_CHOICES:
            for selector in SELECTOR_CHOICES if method in SPARSE_METHODS else ("mstopk",):
                for fp16 in (False, True):
                    cfg = CommConfig(method=method, selector=selector, density=0.05, fp16=fp16,
                                     min_numel_for_sparse=0, dense_first_step=False)
                    calls = found[f"{method}/{selector}/fp16={fp16}"] = []
                    hook = make_hook(cfg)

                    def audited(state, bucket, _hook=hook, _calls=calls):  # no annotations: DDP checks
                        with SyncAudit() as audit:
                            fut = _hook(state, bucket)
                        _calls.append(",".join(audit.found))
                        return fut

                    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
                    state = register(ddp, cfg, hook=audited)
                    for step in range(2):
                        _loss(ddp, rank, step).backward()
                        state.finish_step()
    finally:
        topk_keys.DEVICE_PATH_ON_CPU = False
    return found


def test_every_hook_runs_no_host_sync_with_fp16_on_and_off() -> None:
    """allreduce / torus (dense), naive_ag / hitopk with auto, mstopk and exact: no host sync in any
    bucket's hook call, fp16 on or off. dgc syncs by design (a data-dependent count per threshold
    adjustment, trainer/comm/dgc.py) on buckets large enough to sample: the audit sees it there
    (naive_ag's whole buckets); hitopk's per-rank pieces are below its sampling size."""
    from tests.dist_utils import run_distributed
    from trainer.comm.names import SELECTOR_CHOICES

    for found in run_distributed(_hook_syncs, world_size=4, local_size=2):
        assert len(found) == 2 * 2 + 2 * len(SELECTOR_CHOICES) * 2
        for key, calls in found.items():
            assert calls, key  # the hook ran
            if "/dgc/" not in key:
                assert not any(calls), (key, calls)
        assert all(any(found[f"naive_ag/dgc/fp16={f}"]) for f in (False, True)), found


def _step_syncs(rank: int, world: int) -> dict:
    """Host syncs of whole training steps (trainer.loop.train_step: forward, backward through the hooks,
    maybe_step, zero_grad) per optimizer x scaler x fp16 wire, and of the optimizers' own step."""
    from torch import nn

    from trainer.build import Amp
    from trainer.comm import register, topk_keys
    from trainer.comm.comm_config import CommConfig
    from trainer.loop import StepContext, train_step
    from trainer.optim.lamb import LAMB
    from trainer.optim.lars import LARS

    def optimizers(params: list) -> dict:
        return {"sgd": torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4),
                "lars": LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4),
                "pto_lars": LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4, pto=True),
                "lamb": LAMB(params, lr=0.01, weight_decay=1e-4)}

    out: dict[str, list[str]] = {}
    topk_keys.DEVICE_PATH_ON_CPU = True
    try:
        for name in ("sgd", "lars", "pto_lars", "lamb"):
            for scaled in (False, True):
                for method, fp16 in (("allreduce", False), ("hitopk", False), ("hitopk", True)):
                    torch.manual_seed(0)
                    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
                    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
                    cfg = CommConfig(method=method, density=0.05, fp16=fp16, min_numel_for_sparse=0,
                                     dense_first_step=False)
                    state = register(ddp, cfg)
                    opt = optimizers(list(ddp.parameters()))[name]
                    # a CPU GradScaler (the CUDA one behaves the same: one found-inf read in step())
                    amp = Amp(None, "cpu", torch.amp.GradScaler("cpu", init_scale=128.0) if scaled else None)
                    ctx = StepContext(ddp, opt, state, amp, nn.CrossEntropyLoss(), DeviceAugment(),
                                      torch.device("cpu"), None)  # type: ignore[arg-type]
                    key = f"{name}/scaler={scaled}/{method}/fp16={fp16}"
                    for step in range(3):
                        g = torch.Generator().manual_seed(100 * rank + step)
                        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
                        with SyncAudit() as audit:
                            train_step(ctx, x, y, lr=0.1)
                        out.setdefault(key, []).append(",".join(audit.found))
                    for p in ddp.parameters():  # the optimizer's step alone (after a real step: state exists)
                        p.grad = torch.ones_like(p)
                    with SyncAudit() as audit:
                        opt.step()
                    out[f"{name}/optimizer.step"] = [",".join(audit.found)]
    finally:
        topk_keys.DEVICE_PATH_ON_CPU = False
    return out


def test_a_training_step_reads_the_device_once_and_optimizers_never() -> None:
    """Exactly one host sync per training step -- the step's verdict (the hooks' non-finite flag, or
    GradScaler's found-inf read, which maybe_step merges into one) -- for SGD, LARS, PTO-LARS and LAMB,
    with and without a GradScaler, dense and sparse hooks, fp16 wire on and off; none in any optimizer
    step. On 2 gloo ranks (PTO's collective runs)."""
    from tests.dist_utils import run_distributed

    for found in run_distributed(_step_syncs, world_size=2, local_size=1):
        for key, calls in found.items():
            if key.endswith("optimizer.step"):
                assert calls == [""], (key, calls)
            else:
                assert all(len(c.split(",")) == 1 and c for c in calls), (key, calls)


@pytest.mark.parametrize("kind", ["lars", "lars_nesterov", "lamb"])
def test_optimizer_steps_keep_every_foreach_call_fused_on_cuda(kind: str) -> None:
    """LARS/LAMB scale each layer by a 0-d trust-ratio tensor: every ``_foreach_*`` call must keep its
    lists' shapes matched (or be an addcmul with a 0-d scale list), or CUDA runs it as one kernel per
    layer. Counted on ResNet-50's parameter shapes (161 tensors), weight decay on (its path scales too)."""
    from trainer.models.resnet import resnet50
    from trainer.optim.lamb import LAMB
    from trainer.optim.lars import LARS

    g = torch.Generator().manual_seed(0)
    params = list(resnet50().parameters())
    assert len(params) == 161
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = (LAMB(params, lr=1e-3, weight_decay=0.01) if kind == "lamb" else
           LARS(params, lr=0.1, momentum=0.9, weight_decay=5e-5, nesterov=kind == "lars_nesterov"))
    for _ in range(2):  # the first step creates the state; both must be fused
        with ForeachShapeAudit() as audit:
            opt.step()
        assert audit.calls >= 3 and audit.slow == [], audit.slow
