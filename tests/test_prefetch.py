"""Prefetcher (trainer.prefetch): the same batches with and without it, data-wait accounting, and the
CUDA-stream path where a GPU exists."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader

from client.crop import BatchRequest, CropCollate, TaggedDataset
from client.dataset import CachedImageNet
from trainer.device_augment import DeviceAugment
from trainer.prefetch import Prefetcher


def _loader(root: str, cache: str, pin: bool = False, workers: int = 2) -> DataLoader:
    ds = CachedImageNet(root, cache=cache, short_side=40)
    requests = [BatchRequest(tuple(range(k, k + 5)), epoch=0, step=k // 5) for k in range(0, 20, 5)]
    return DataLoader(TaggedDataset(ds), batch_sampler=requests, num_workers=workers,
                      collate_fn=CropCollate(seed=3), pin_memory=pin)


def test_same_batches_with_and_without_prefetcher(small_imagefolder: str, tmp_path) -> None:
    loader = _loader(small_imagefolder, "lmdb://" + str(tmp_path / "c"))
    aug = DeviceAugment()
    plain = [aug(b, 24) for b in loader]
    pre = Prefetcher(loader, "cpu", aug, 24)
    fetched = list(pre)
    assert len(fetched) == len(plain) == 4
    for (x1, y1), (x2, y2) in zip(plain, fetched):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and x2.shape == (5, 3, 24, 24)
    st = pre.stats
    assert st.steps == 4 and st.samples == 20 and len(st.waits) == 4 and st.wait_s >= 0 and st.augment_s > 0


class _SlowLoader:
    """Yields ready uint8 batches after a fixed host-side delay (a starving loader)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for k in range(self.n):
            time.sleep(self.delay)
            yield torch.full((2, 3, 4, 4), k, dtype=torch.uint8), torch.tensor([k, k])


def test_data_wait_is_the_time_blocked_on_the_loader() -> None:
    pre = Prefetcher(_SlowLoader(3, 0.05), "cpu", DeviceAugment(), 4)
    labels = [int(y[0]) for _, y in pre]
    assert labels == [0, 1, 2] and pre.stats.steps == 3
    assert all(w >= 0.045 for w in pre.stats.waits) and pre.stats.wait_s >= 0.135


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream path needs a CUDA device")
@pytest.mark.parametrize("staging", ["inline", "thread"])
def test_cuda_stream_prefetch_matches_cpu(small_imagefolder: str, tmp_path,
                                          staging: str) -> None:  # pragma: no cover - GPU
    loader = _loader(small_imagefolder, "lmdb://" + str(tmp_path / "c"), pin=True)
    aug = DeviceAugment(method="matmul")
    ref = [aug(b, 24) for b in _loader(small_imagefolder, "lmdb://" + str(tmp_path / "c"))]
    pre = Prefetcher(loader, "cuda", aug, 24, staging=staging)
    assert pre.use_streams
    assert len(list(zip(ref, pre))) == len(ref) == 4  # every batch, in a first pass
    for (x_ref, y_ref), (x, y) in zip(ref, pre):
        x = x * 2  # compute on the default stream right away: it must see the finished batch
        assert x.device.type == "cuda"
        torch.testing.assert_close(x.cpu(), x_ref * 2, atol=1e-4, rtol=1e-5)
        assert torch.equal(y.cpu(), y_ref)
