"""Per-stage timing of the drop-in benchmark's pipelines (``results.per_sample_ms`` in dropin.json).

A DataLoader worker's time cannot be split into stages from the outside, so :func:`profile_stages` runs
the same stages in this process (one torch thread, as in the workers) over ``samples`` files and reports
milliseconds per sample, the median of 3 repeats of each stage's mean (wall clock):

* ``imagefolder_*``: torchvision's ``pil_loader`` (open + decode + ``convert("RGB")``: what ImageFolder
  pays per sample), then each step of the user's transform on the full-size image, then ``default_collate``;
* ``cold_*``: the drop-in's miss path: the source read (:meth:`ReadThrough.read_files`), ``decode_image``
  to the variant as a whole and, from a Pillow replica of its steps, the decode at Pillow's draft scale
  and the resize to the variant apart; ``encode_record``; the LMDB write of a batch (``put_many``, one
  transaction and commit per batch, on a fresh LMDB; ``_nosync``: the same on a ``?sync=0`` LMDB, i.e.
  without the commit's fsync); the PIL image built over the pixels; each transform step on the variant;
* ``warm_*``: the LMDB read (``get_many``), ``decode_record`` (header + checksum) and
  ``CachedImageNet.__getitems__`` as a whole (read + PIL + the transform);
* ``fastpath_*``: ``__getitems__`` of the tensor dataset (hits: tensor views), ``AugmentCollate`` and the
  normalisation, on the CPU (``_literal``: ``(x.float() / 255 - mean) / std`` instead, for comparison).

``*_total`` sum a pipeline's stages (one core's CPU per sample when nothing waits); ``predicted_*`` are
``imagefolder_total`` over another total: what the benchmark's ratios would be on a CPU-bound machine.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import default_collate

from client.augment import AugmentCollate
from client.dataset import CachedImageNet
from client.folder_api import pil_image
from datacache.cacheurl import parse_cache_url
from datacache.decode import decode_image, target_size
from datacache.fill import fill_one
from datacache.record import decode_record, encode_record
from datacache.stores import open_store

REPEATS = 3


def _per_sample(fn: Callable[[], Any], count: int) -> float:
    """Milliseconds per sample of ``fn()`` (which processes ``count`` samples): median of REPEATS runs."""
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3 / count)
    return statistics.median(times)


def _step_name(step: Any) -> str:
    return type(step).__name__


def _replica_split(data: bytes, short_side_variant: Any) -> tuple[Image.Image, tuple[int, int]]:
    """decode_image's Pillow steps for a plain JPEG up to (not including) the resize: open, draft to the
    target, load, RGB. Returns the decoded image and the variant's size."""
    im = Image.open(io.BytesIO(data))
    size = target_size(im.width, im.height, short_side_variant)
    if im.format in ("JPEG", "MPO"):
        im.draft("RGB", size)
    im.load()
    return (im if im.mode == "RGB" else im.convert("RGB")), size


def _chunks(seq: Sequence[int], n: int) -> list[Sequence[int]]:
    return [seq[k:k + n] for k in range(0, len(seq), n)]


def profile_stages(root: str, train_tf: Any, cache: str, short_side: int, *, samples: int = 256,
                   batch: int = 128) -> dict[str, float]:
    """Milliseconds per sample of every stage (module docstring); ``cache`` must be an empty LMDB URL."""
    import torchvision.datasets.folder as tv_folder  # the dev shim is installed by the caller

    from bench.dropin import MEAN, STD, Normalize  # (bench.dropin imports this module lazily: no cycle)

    torch.set_num_threads(1)
    ds = CachedImageNet(root, train_tf, cache=cache, short_side=short_side, t1_dir=None)
    fast = CachedImageNet(root, cache=cache, short_side=short_side, output="tensor", t1_dir=None)
    reader, variant = ds.reader, ds.variant
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()[:samples]
    n = len(order)
    paths = [ds.samples[i][0] for i in order]
    labels = [int(ds.manifest.labels[i]) for i in order]
    steps = list(getattr(train_tf, "transforms", [train_tf]))
    out: dict[str, float] = {"samples": float(n)}

    # ImageFolder: torchvision's loader, each transform step on the full-size image, the default collate
    out["imagefolder_pil_loader"] = _per_sample(lambda: [tv_folder.pil_loader(p) for p in paths], n)
    imgs = [tv_folder.pil_loader(p) for p in paths]
    for step in steps:
        out[f"imagefolder_{_step_name(step)}"] = _per_sample(lambda f=step, xs=imgs: [f(x) for x in xs], n)
        imgs = [step(x) for x in imgs]
    items = list(zip(imgs, labels))
    out["imagefolder_default_collate"] = _per_sample(
        lambda: [default_collate(items[k:k + batch]) for k in range(0, n, batch)], n)

    # the drop-in's cold (miss) path, stage by stage
    datas = reader.read_files(order)
    out["cold_source_read"] = _per_sample(lambda: reader.read_files(order), n)
    good = [k for k, d in enumerate(datas) if isinstance(d, bytes)]
    out["cold_decode_image"] = _per_sample(lambda: [decode_image(datas[k], variant) for k in good], len(good))
    jpegs = [datas[k] for k in good if datas[k][:2] == b"\xff\xd8"]
    if jpegs:
        out["cold_replica_decode_at_draft"] = _per_sample(lambda: [_replica_split(d, variant) for d in jpegs],
                                                          len(jpegs))
        decoded = [_replica_split(d, variant) for d in jpegs]
        out["cold_replica_resize_to_variant"] = _per_sample(
            lambda: [im.resize(size, Image.Resampling.BILINEAR, reducing_gap=3.0) for im, size in decoded],
            len(jpegs))
    pixels = [decode_image(datas[k], variant) for k in good]
    keys = [reader.key(order[k]) for k in good]

    def encode_all() -> list[bytes]:
        return [encode_record(p, labels[k], variant, key=key) for p, k, key in zip(pixels, good, keys)]

    def fill_all() -> None:  # decode + geometry check + encode: what a worker runs per missed sample
        for k, key in zip(good, keys):
            fill_one(datas[k], rel="x", size=len(datas[k]), label=labels[k], key=key, variant=variant)

    out["cold_encode_record"] = _per_sample(encode_all, len(good))
    out["cold_fill_one"] = _per_sample(fill_all, len(good))
    records = encode_all()
    store = reader.store
    rep = iter(range(2 * REPEATS + 2))

    def write_all(into: Any) -> None:  # fresh keys each repeat (SET NX skips present ones); a commit a batch
        tag = b"profile-%d:" % next(rep)
        for part in _chunks(range(len(records)), batch):
            into.put_many([(tag + keys[k], records[k]) for k in part])

    out["cold_lmdb_put_many_commit"] = _per_sample(lambda: write_all(store), len(good))
    # the same writes without the commit's fsync (a second LMDB, ?sync=0): what the fsync itself costs
    nosync = open_store(parse_cache_url(cache.rstrip("/") + "-nosync?sync=0", check=True))
    out["cold_lmdb_put_many_nosync"] = _per_sample(lambda: write_all(nosync), len(good))
    out["cold_pil_image"] = _per_sample(lambda: [pil_image(p) for p in pixels], len(pixels))
    vimgs = [pil_image(p) for p in pixels]
    for step in steps:
        out[f"variant_{_step_name(step)}"] = _per_sample(lambda f=step, xs=vimgs: [f(x) for x in xs],
                                                         len(vimgs))
        vimgs = [step(x) for x in vimgs]

    # warm: fill the profile cache through the dataset itself, then time the hit path
    for part in _chunks(list(range(n)), batch):
        ds.__getitems__([order[k] for k in part])
    all_keys = [reader.key(i) for i in order]
    out["warm_lmdb_get_many"] = _per_sample(
        lambda: [store.get_many([all_keys[k] for k in part]) for part in _chunks(range(n), batch)], n)
    bufs = store.get_many(all_keys)
    out["warm_decode_record"] = _per_sample(
        lambda: [decode_record(b, key, variant) for b, key in zip(bufs, all_keys)], n)
    out["warm_getitems_total"] = _per_sample(
        lambda: [ds.__getitems__([order[k] for k in part]) for part in _chunks(range(n), batch)], n)

    # the fast path: tensor views, AugmentCollate in the worker, the normalisation where the batch is used
    collate = AugmentCollate(224, reuse_buffers=0)
    out["fastpath_getitems"] = _per_sample(
        lambda: [fast.__getitems__([order[k] for k in part]) for part in _chunks(range(n), batch)], n)
    batches = [fast.__getitems__([order[k] for k in part]) for part in _chunks(range(n), batch)]
    out["fastpath_augment_collate"] = _per_sample(lambda: [collate(b) for b in batches], n)
    crops = [collate(b)[0] for b in batches]
    normalize = Normalize(torch.device("cpu"))
    out["fastpath_normalize"] = _per_sample(lambda: [normalize(x) for x in crops], n)
    # the literal expression, for comparison: four float32 batches allocated (and page-faulted) per batch
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    out["fastpath_normalize_literal"] = _per_sample(lambda: [(x.float() / 255 - mean) / std for x in crops],
                                                    n)

    tf_full = sum(out[f"imagefolder_{_step_name(s)}"] for s in steps)
    tf_var = sum(out[f"variant_{_step_name(s)}"] for s in steps)
    collate_ms = out["imagefolder_default_collate"]
    out["imagefolder_total"] = out["imagefolder_pil_loader"] + tf_full + collate_ms
    out["dropin_cold_total"] = (out["cold_source_read"] + out["cold_fill_one"]
                                + out["cold_lmdb_put_many_commit"] + out["cold_pil_image"]
                                + tf_var + collate_ms)
    out["dropin_warm_total"] = out["warm_getitems_total"] + collate_ms
    out["fastpath_total"] = (out["fastpath_getitems"] + out["fastpath_augment_collate"]
                             + out["fastpath_normalize"])
    for name in ("dropin_cold", "dropin_warm", "fastpath"):
        out[f"predicted_{name}_vs_imagefolder"] = out["imagefolder_total"] / out[f"{name}_total"]
    return {k: round(float(v), 4) for k, v in out.items()}
