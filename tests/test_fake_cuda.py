"""CUDA device placement checked without a GPU.

On the CPU-only torch, ``FakeTensorMode`` makes ``device="cuda"`` tensors (no memory, no kernels)
and raises ``FakeTensorDeviceMismatchError`` when a CPU tensor meets a CUDA one, exactly the bug a
GPU run would hit. Every CUDA path below needs no real kernel: error-feedback load/flush, a
checkpoint resumed into CUDA buckets, the selectors' device branch, ``DeviceAugment``'s matmul
path (with ``CropBatch.padded``) and the ``Prefetcher``'s device moves (its synchronous path: the
side-stream path needs real streams and is tested on a GPU only). Moves name the device with its
index (``cuda:0``, as ``pick_device`` does): a bare ``"cuda"`` would ask for the current device,
which needs a real CUDA runtime. Python slicing of a fake CUDA
tensor is not supported here ("not linked with support for cuda devices"), so these code paths
use ``narrow``/``select``/``index_select``. Tests that need real kernels skip without CUDA.

Before the fix, ``ErrorFeedback.flush_into`` added a CPU residual (as loaded from a checkpoint)
into a CUDA bucket: ``test_flush_of_a_loaded_residual_into_a_cuda_bucket`` fails on that code.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from client.crop import CropBatch, CropCollate
from trainer import checkpoint
from trainer.comm.error_feedback import ErrorFeedback
from trainer.comm.state import HookState
from trainer.comm.topology import Topology
from trainer.device_augment import DeviceAugment, resize_interpolate
from trainer.distenv import cuda_index
from trainer.prefetch import Prefetcher, to_device

CUDA = torch.device("cuda", 0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: real kernels/streams (fake tensors have none)")


def fake() -> FakeTensorMode:
    # allow_non_fake_inputs: real CPU tensors (a loaded checkpoint) may enter; they stay CPU tensors,
    # so any CPU/CUDA mix raises FakeTensorDeviceMismatchError
    return FakeTensorMode(allow_non_fake_inputs=True)


def _ef_with(method: str, numel: int, topo: Topology) -> dict:
    ef = ErrorFeedback()
    ef.residual("bucket", method=method, numel=numel, topo=topo).copy_(torch.arange(
        ErrorFeedback().residual("x", method=method, numel=numel, topo=topo).numel(), dtype=torch.float32))
    return ef.state_dict()


def test_fake_mode_catches_a_device_mix() -> None:  # the premise of this file
    # torch 2.13 raises FakeTensorDeviceMismatchError (a RuntimeError); 2.11 (the GPU image) a plain
    # RuntimeError ("... found two different devices cuda:0, cpu"): both name the devices
    with fake(), pytest.raises(RuntimeError, match=r"devices.*cuda:0.*cpu"):
        torch.zeros(4, device="cuda").add_(torch.ones(4))


@pytest.mark.parametrize("method", ["naive_ag", "hitopk"])
def test_flush_of_a_loaded_residual_into_a_cuda_bucket(method: str) -> None:
    topo = Topology.single_process()
    state = _ef_with(method, 64, topo)
    with fake():
        ef = ErrorFeedback()
        ef.load_state_dict(state, topo)  # CPU tensors, as a checkpoint holds them
        flat = torch.zeros(64, device="cuda", dtype=torch.float16)
        assert ef.flush_into("bucket", flat, topo, scale=2.0, grad_scale=torch.ones((), device="cuda"))
        assert flat.device == CUDA and flat.dtype == torch.float16 and len(ef) == 0


def test_checkpoint_resumed_into_cuda_buckets(tmp_path) -> None:
    """A real checkpoint on disk (CPU tensors) -> HookState -> residuals used by CUDA buckets."""
    topo = Topology.single_process()
    hs = HookState(step=7)
    hs.ef.load_state_dict(_ef_with("naive_ag", 64, topo))
    model = torch.nn.Linear(2, 2)
    d = checkpoint.save(str(tmp_path), rank=0, pos=checkpoint.Position(1, 0, 7), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=None,
                        comm_state=hs.state_dict(), schedules={}, config_json="{}", world_size=1)
    loaded = checkpoint.load(d, rank=0, world_size=1)
    with fake():
        state = HookState(topo=topo)
        state.load_state_dict(loaded.comm)
        bucket = torch.randn(64, device="cuda")
        res = state.ef.residual("bucket", method="naive_ag", numel=64, topo=topo, device=bucket.device)
        assert res.device == CUDA and res.dtype == torch.float32
        bucket.add_(res)  # what the sparse hooks do with it: no device mix
        state2 = HookState(topo=topo)
        state2.load_state_dict(loaded.comm)
        assert state2.ef.flush_into("bucket", bucket, topo, scale=1.0)  # sparse -> dense switch


@pytest.mark.parametrize("name", ["mstopk", "exact"])
def test_selectors_device_branch_stays_on_cuda(name: str) -> None:
    from trainer.comm.mstopk import mstopk_with_info
    from trainer.comm.selector_registry import get_selector

    with fake():
        x = torch.randn(50_000, device="cuda")
        values, idx = get_selector(name)(x, 500)
        assert values.device == CUDA and idx.device == CUDA and idx.dtype == torch.int32
        assert tuple(values.shape) == (500,) and tuple(idx.shape) == (500,)
        if name == "mstopk":
            r = mstopk_with_info(x, 500, path="device")
            assert r.values.device == CUDA and r.indices.device == CUDA


def _crop_batch(n: int = 6) -> CropBatch:
    g = torch.Generator().manual_seed(0)
    hs, ws = torch.randint(20, 40, (n,), generator=g), torch.randint(20, 50, (n,), generator=g)
    images = [torch.randint(0, 256, (3, int(h), int(w)), dtype=torch.uint8, generator=g)
              for h, w in zip(hs, ws)]
    return CropCollate(seed=1)([(im, k) for k, im in enumerate(images)])


def test_device_augment_matmul_path_and_padded_on_cuda() -> None:
    batch = _crop_batch()
    with fake():
        dev = batch.to(CUDA)
        pad = dev.padded(chunk=100)  # a device batch: the row gather (chunk applies to the CPU path only)
        assert pad.device == CUDA and pad.dtype == torch.uint8
        aug = DeviceAugment(memory_format=torch.channels_last)
        assert aug.method_for(dev) == "matmul"  # auto picks it on a device batch
        x, y = aug(dev, 16)
        assert x.device == CUDA and y.device == CUDA and tuple(x.shape) == (6, 3, 16, 16)
        assert x.dtype == torch.float32


def test_interpolate_is_refused_on_a_device_batch_with_one_line() -> None:
    batch = _crop_batch()
    with fake():
        dev = batch.to(CUDA)
        with pytest.raises(ValueError, match=r"CPU batches only.*matmul") as err:
            DeviceAugment(method="interpolate")(dev, 16)
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError, match="CPU batches only"):
            resize_interpolate(dev, 16)


def test_prefetcher_moves_batches_to_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # fake tensors have no streams: the synchronous path, also on a machine with a real GPU (whose
    # stream path tests/test_prefetch.py checks with real tensors)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    batches = [_crop_batch(4), _crop_batch(3)]
    with fake():
        moved = to_device(batches[0], CUDA)
        assert moved.pixels.device == CUDA and moved.meta.device == CUDA
        pre = Prefetcher(batches, CUDA, DeviceAugment(), 12)
        assert not pre.use_streams  # the synchronous path, same device moves
        out = list(pre)
        assert [tuple(x.shape) for x, _ in out] == [(4, 3, 12, 12), (3, 3, 12, 12)]
        assert all(x.device == CUDA and y.device == CUDA for x, y in out)


def test_pick_device_index_honours_visible_devices() -> None:
    assert cuda_index(3, 8) == 3          # every GPU visible: the rank's own
    assert cuda_index(3, 1) == 0          # one visible GPU per process: cuda:0
    assert cuda_index(5, 4) == 1
    from datacache.config import ConfigError

    with pytest.raises(ConfigError, match="no visible CUDA device"):
        cuda_index(0, 0)


@needs_cuda
def test_real_cuda_flush_and_interpolate_refusal() -> None:  # pragma: no cover - GPU only
    topo = Topology.single_process()
    ef = ErrorFeedback()
    ef.load_state_dict(_ef_with("naive_ag", 64, topo), topo)
    flat = torch.zeros(64, device="cuda")
    assert ef.flush_into("bucket", flat, topo)
    assert torch.equal(flat.cpu(), torch.arange(64, dtype=torch.float32))
    dev = _crop_batch().to("cuda")
    assert torch.equal(dev.padded().cpu(), _crop_batch().padded())
    x, _ = DeviceAugment()(dev, 16)
    assert x.is_cuda and torch.isfinite(x).all()


@needs_cuda
def test_real_cuda_pick_device_under_one_visible_gpu() -> None:  # pragma: no cover - GPU only
    from trainer.distenv import pick_device

    os.environ["LOCAL_RANK"] = "5"
    try:
        assert pick_device("cuda").index == 5 % torch.cuda.device_count()
    finally:
        del os.environ["LOCAL_RANK"]
