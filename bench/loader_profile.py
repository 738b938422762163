"""Per-stage timing of the loader benchmark's warm path (``results.per_batch_ms`` in loader.json).

A DataLoader worker's time per batch cannot be split into stages from the outside, so
:func:`profile_stages` repeats the same stages in the calling process (one torch thread, as
in the benchmark's workers) on the warm cache and reports the median per stage.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from client.augment import _new_batch, resize_crops, rrc_params_batch
from client.dataset import CachedImageNet
from client.tensor_view import to_chw_tensor
from datacache.record import decode_record


def profile_stages(ds: CachedImageNet, batch: int, size: int,
                   copy_windows: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor],
                   batches: int = 6) -> dict[str, float]:
    """Median milliseconds per batch of each stage of the warm path, in this process, one thread.

    The stages a DataLoader worker runs per batch: keys, the LMDB read (``get_many`` copies
    each record out of the map), ``decode_record`` (header + xxh3 checksum), the tensor views,
    RRC parameters, allocating + first-touching the shared-memory output batch, the resize +
    flip (into an already-touched batch, so page faults are not counted twice) and, for the
    ceiling, the copy of a window per record. ``getitems_total`` is ``ds.__getitems__`` as a
    whole (all hit-path stages plus counters). Not measured here: the DataLoader's hand-over
    of the batch to the main process (a file descriptor per tensor, both pipelines alike).
    """
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(len(ds), generator=gen).tolist()
    store = ds.store
    stages: dict[str, list[float]] = {}
    reuse = _new_batch(batch, size).zero_()

    def lap(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        stages.setdefault(name, []).append((t1 - t0) * 1e3)
        return t1

    numel = batch * 3 * size * size
    for b in range(batches):
        start = (b * batch) % max(1, len(ds) - batch)
        idx = order[start:start + batch]
        t = time.perf_counter()
        keys = [ds.key(i) for i in idx]
        t = lap("keys", t)
        bufs = store.get_many(keys)
        t = lap("lmdb_get_many", t)
        recs = [decode_record(buf, key) for buf, key in zip(bufs, keys)]
        t = lap("decode_record_checksum", t)
        imgs = [to_chw_tensor(rec[0]) for rec in recs if rec is not None]
        t = lap("tensor_views", t)
        ds.__getitems__(idx)
        t = lap("getitems_total", t)
        boxes = rrc_params_batch([(int(im.shape[1]), int(im.shape[2])) for im in imgs], gen)
        flips = (torch.rand(len(imgs), generator=gen) < 0.5).tolist()
        t = lap("rrc_params", t)
        storage = torch.UntypedStorage._new_shared(numel)  # what _new_batch does in a worker
        t = lap("shared_batch_alloc", t)
        torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel,), (1,)).zero_()
        t = lap("shared_batch_first_touch", t)
        del storage
        t = time.perf_counter()
        resize_crops(imgs, boxes, flips, size, out=reuse[:len(imgs)])
        t = lap("resize_flip", t)
        copy_windows(imgs, reuse[:len(imgs)])
        lap("copy_window_ceiling", t)
    return {name: statistics.median(v) for name, v in stages.items()}
