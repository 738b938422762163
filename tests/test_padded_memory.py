"""``CropBatch.padded()`` scatters in chunks (bounded temporaries): every chunk size gives the same
batch as a per-window reference copy, and its peak of temporaries stays bounded."""

from __future__ import annotations

import pytest
import torch

from client.crop import CropBatch, CropCollate


def _batch(n: int, seed: int) -> CropBatch:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randint(5, 40, (n,), generator=g).tolist()
    ws = torch.randint(5, 60, (n,), generator=g).tolist()
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in zip(hs, ws)]
    return CropCollate(seed=seed)([(im, k) for k, im in enumerate(images)])


def _reference(batch: CropBatch) -> torch.Tensor:
    out = torch.zeros((len(batch), batch.hmax, batch.wmax, 3), dtype=torch.uint8)
    for k, view in enumerate(batch.views()):
        out[k, :view.shape[0], :view.shape[1]] = view
    return out


@pytest.mark.parametrize("chunk", [0, 1, 7, 97, 1000, 10**9])
def test_every_chunk_size_gives_the_reference_batch(chunk: int) -> None:
    for seed, n in ((0, 1), (1, 9), (2, 33)):
        batch = _batch(n, seed)
        assert torch.equal(batch.padded(chunk=chunk), _reference(batch)), (chunk, seed)


def test_temporaries_stay_under_the_output_size() -> None:
    """Peak live bytes of tensors allocated by padded() (counted by bench/augment_memory.py's
    dispatch-mode meter): <= 2x the output batch, the bound the trainer promises."""
    from bench.augment_memory import peak_tensor_bytes

    batch = _batch(64, 3)
    out_bytes = len(batch) * batch.hmax * batch.wmax * 3
    peak = peak_tensor_bytes(batch.padded)
    assert out_bytes <= peak <= 2 * out_bytes


def test_matmul_resize_peak_stays_bounded() -> None:
    """resize_matmul converts and multiplies per group of samples: at the DAWNBench shape (crops of
    160-px records to 96 px) its peak of live tensor bytes (padding, weights, float copies) stays
    a few times the padded batch (over 9x when it did both passes for the whole batch at once)."""
    from bench.augment_memory import dawnbench_batch, peak_tensor_bytes
    from trainer.device_augment import resize_matmul

    batch = dawnbench_batch(32)
    out_bytes = len(batch) * batch.hmax * batch.wmax * 3
    assert peak_tensor_bytes(lambda: resize_matmul(batch, 96)) <= 6 * out_bytes
