"""Reused batch buffers (client.batch_pool via AugmentCollate): faster, and never a changed pixel.

The reference is the same DataLoader with ``reuse_buffers=0`` (a fresh buffer per batch, torch's own
way), same seeds: every batch must be equal, whatever the consumer keeps -- everything, views only,
numpy arrays only, or nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from client.augment import AugmentCollate
from datacache.config import ConfigError

N, SIZE, BATCH = 96, 24, 8


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (N, 3, 40, 52), dtype=torch.uint8, generator=g)
    return TensorDataset(images, torch.arange(N))


def loader(collate: AugmentCollate, workers: int = 2, **kw) -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate,
                      generator=torch.Generator().manual_seed(1), persistent_workers=workers > 0,
                      prefetch_factor=2 if workers else None, **kw)


def reference(epochs: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dl = loader(AugmentCollate(SIZE, seed=3, reuse_buffers=0))
    return [(x.clone(), y.clone()) for _ in range(epochs) for x, y in dl]


def test_a_consumer_that_drops_batches_gets_reused_buffers_and_the_same_pixels() -> None:
    want = reference()
    collate = AugmentCollate(SIZE, seed=3, reuse_buffers=3)
    dl = loader(collate)
    got = 0
    for _ in range(2):
        for x, y in dl:
            assert torch.equal(x, want[got][0]) and torch.equal(y, want[got][1]), got
            assert type(x) is torch.Tensor and x.is_contiguous(memory_format=torch.channels_last)
            got += 1
    assert got == len(want)
    st = collate.buffer_stats()
    assert st["allocated"] + st["reused"] == got
    assert st["reused"] >= got // 2, st  # the point of it: most batches reuse a buffer


@pytest.mark.parametrize("keep", ["batches", "views", "numpy"])
def test_whatever_the_consumer_keeps_stays_intact(keep: str) -> None:
    want = reference()
    collate = AugmentCollate(SIZE, seed=3, reuse_buffers=2)
    dl = loader(collate)
    kept = []
    for _ in range(2):
        for x, y in dl:
            if keep == "batches":
                kept.append(x)
            elif keep == "views":
                kept.append(x[1:3, :, 2:9])  # a view: the buffer stays referenced through it
            else:
                kept.append(x.numpy())  # an ndarray over the tensor's memory
            del x, y
    for k, (w, _) in enumerate(want):
        if keep == "batches":
            assert torch.equal(kept[k], w), k
        elif keep == "views":
            assert torch.equal(kept[k], w[1:3, :, 2:9]), k
        else:
            assert torch.equal(torch.from_numpy(kept[k]), w), k
    # nothing the consumer held was ever given back, so every batch had a fresh buffer
    assert collate.buffer_stats() == {"allocated": len(want), "reused": 0}
    kept.clear()
    for x, _ in dl:  # once released, the buffers come back into use
        del x
    assert collate.buffer_stats()["reused"] > 0


def test_without_workers_batches_are_private_and_plain_tuples() -> None:
    collate = AugmentCollate(SIZE, seed=3)
    x, y = out = next(iter(loader(collate, workers=0)))
    assert type(out) is list or type(out) is tuple
    assert not x.is_shared() and collate.buffer_stats() == {"allocated": 0, "reused": 0}
    assert x.shape == (BATCH, 3, SIZE, SIZE) and y.shape == (BATCH,)


def test_spawned_workers_reuse_too() -> None:
    want = reference(epochs=1)
    collate = AugmentCollate(SIZE, seed=3, reuse_buffers=2)
    dl = loader(collate, workers=1, multiprocessing_context="spawn")
    got = [x.clone() for x, _ in dl]
    ref = reference_single_worker()
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref) == len(want)
    assert collate.buffer_stats()["reused"] > 0


def reference_single_worker() -> list[torch.Tensor]:
    dl = loader(AugmentCollate(SIZE, seed=3, reuse_buffers=0), workers=1)
    return [x.clone() for x, _ in dl]


def test_reuse_buffers_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="reuse_buffers must be >= 0"):
        AugmentCollate(SIZE, reuse_buffers=-1)


@pytest.mark.parametrize("shape", [(3, 40, 52), (3, 20, 24)])
def test_whole_contiguous_chw_images_resize_like_interpolate(shape: tuple[int, int, int]) -> None:
    # a crop that is the whole of a contiguous CHW image used to trip an internal assert of torch's
    # uint8 resize kernels when writing into a channels_last batch (found by the tests above)
    import torch.nn.functional as F

    from client.augment import resize_crops

    img = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    got = resize_crops([img], [(0, 0, shape[1], shape[2])], [False], SIZE)
    want = F.interpolate(img[None], size=(SIZE, SIZE), mode="bilinear", antialias=shape[1] > SIZE,
                         align_corners=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("keep_all", [False, True])
def test_the_trainers_crop_batches_reuse_buffers_safely_too(keep_all: bool) -> None:
    from client.crop import CropBatch, CropCollate

    def run(reuse: int, keep: bool) -> tuple[list[CropBatch], CropCollate]:
        collate = CropCollate(seed=3, reuse_buffers=reuse)
        dl = DataLoader(dataset(), batch_size=BATCH, shuffle=True, num_workers=2, collate_fn=collate,
                        generator=torch.Generator().manual_seed(1), persistent_workers=True)
        out: list[CropBatch] = []
        for _ in range(2):
            for b in dl:
                assert isinstance(b, CropBatch) and b.ticket is None  # arrived: nothing to give back
                out.append(b if keep else CropBatch(b.pixels.clone(), b.meta.clone(), b.hmax, b.wmax))
                del b
        return out, collate

    want, _ = run(0, False)
    got, collate = run(2, keep_all)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a.pixels, b.pixels) and torch.equal(a.meta, b.meta)
    st = collate.buffer_stats()
    assert st["allocated"] + st["reused"] == len(want), st  # one buffer per batch, counted once
    # how many come back in time to be reused depends on the workers' prefetch and the scheduler
    assert st["reused"] == 0 if keep_all else st["reused"] > 0, st
