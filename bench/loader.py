"""Loader benchmark: naive PIL pipeline vs DALI-CPU vs datacache (cold/warm) vs the copy-only ceiling.

All pipelines read the same generated ImageNet-like dataset (>= 2,000 JPEGs at 500x375 q90 via
datacache.devtools.synth, plus the photos installed packages ship) and produce uint8 batches
``[256, 3, 128, 128]`` (random-resized-crop to 128 + horizontal flip) with 2 worker
processes, measured side by side in one run:

* ``naive``: the torchvision-style per-sample pipeline in a DataLoader: PIL open -> RGB ->
  RandomResizedCrop(128) (crop + antialiased bilinear resize in PIL) -> flip -> uint8 tensor,
  default collate. Every epoch decodes every JPEG.
* ``dali_cpu``: NVIDIA DALI CPU pipeline, 2 threads (``fn.external_source`` fed with the file
  bytes, ``fn.decoders.image(device="cpu")``, ``fn.random_resized_crop``, ``fn.flip``,
  ``device_id=None``) when ``nvidia-dali-cuda120`` is installed; otherwise reported as not
  installed with ``warm_vs_dali = null``.
* ``datacache_cold``: CachedImageNet epoch 1 on an empty LMDB cache (read + decode + write).
* ``datacache_warm``: epochs 2-3 (LMDB hits + batched RRC/flip in the workers, each batch built in a
  shared buffer the worker reuses once the main process has dropped it: :mod:`client.batch_pool`;
  the copy ceilings below reuse theirs the same way).
* ``copy_ceiling``: the same DataLoader over the warm cache, but the collate only copies a
  128x128 window of each cached record into the same ``[256, 3, 128, 128]`` batch (no resize,
  no flip): the strict data-path ceiling that ``warm_vs_copy_ceiling`` compares with.
  ``copy_records`` (reported as ``warm_vs_copy_records``) copies every whole record into one
  packed batch instead (~2x the bytes of the window).

Steady-state epochs are timed (persistent workers, started before the timed epochs), so
worker start-up is excluded except in the cold epoch, where it is part of the cost. The
naive, warm and copy epochs run interleaved (``ROUNDS`` rounds; in each round one naive epoch,
then ``FAST_EPOCHS`` epochs each of warm / copy / copy-records, alternating epoch by epoch), so
load from other jobs on this shared machine drifts over all of them alike; a warm epoch of
2,000 samples lasts only ~0.2 s, so many of them are needed for a stable ratio. Rates are
total samples / total seconds over all of a pipeline's timed epochs. FFCV's epochs run right after
each of our warm epochs; ``warm_vs_ffcv_*`` are the **median of the per-pair ratios** (our epoch k / the
FFCV epoch that followed it), which a burst of load from other jobs moves far less than a ratio of
totals (both are in the JSON: ``results.ffcv.<mode>.ratio_of_totals``).

Before the timed part, :func:`profile_stages` times the warm path's stages for a few batches in
the main process (one thread, the same work a worker does per batch) and stores the medians
in ``results.per_batch_ms``. Results are written to a temporary directory and then moved
into ``bench/results`` (``os.replace``), so an interrupted run never leaves a half-written file.
Run ``python -m bench.loader`` (full) or ``--quick``.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from bench.common import RESULTS_DIR, bar_chart, machine_info, print_machine, write_results
from bench.loader_profile import profile_stages
from client.augment import AugmentCollate, batch_view, rrc_params
from client.batch_pool import BatchPool, PooledBatch
from client.dataset import CachedImageNet
from datacache.config import user_cache_dir
from datacache.devtools import synth
from datacache.manifest import Manifest

SIZE = 128
ROUNDS = 3  # interleaved rounds (one naive epoch each)
FAST_EPOCHS = 8  # warm / copy / copy-records (/ FFCV) epochs per round (each lasts ~0.1-0.4 s)


def worker_init(_: int) -> None:
    # Worker-process boundary: 2 DataLoader workers on 2 cores are the parallelism; torch's own
    # intra-op threads inside each worker would only oversubscribe the cores.
    torch.set_num_threads(1)


class NaivePILDataset(Dataset):
    """The standard per-sample pipeline: decode with PIL every time, RRC + flip in PIL."""

    def __init__(self, root: str) -> None:
        man = Manifest.build(root)
        base = man.root[len("file://"):]
        self.files = [os.path.join(base, p) for p in man.paths]
        self.targets = man.targets

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return pil_rrc_flip(self.files[i], SIZE), self.targets[i]


def pil_rrc_flip(src: Any, size: int) -> torch.Tensor:
    """Decode ``src`` (a path or a file object) with PIL, random-resized-crop to ``size`` and flip
    in PIL, as torchvision's per-sample transforms do: a contiguous uint8 CHW tensor."""
    with Image.open(src) as im:
        im = im.convert("RGB")
        top, left, h, w = rrc_params(im.height, im.width)  # torchvision's parameter sampling
        im = im.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if torch.rand(1).item() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(im)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def copy_windows(images: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy the top-left SIZE x SIZE window of each image into its slot of ``out``."""
    for k, img in enumerate(images):
        h, w = min(SIZE, int(img.shape[1])), min(SIZE, int(img.shape[2]))  # capped panoramas are smaller
        out[k, :, :h, :w] = img[:, :h, :w]
    return out


class CopyCollate:
    """Copy-only ceiling: a SIZE x SIZE window of every cached record straight into the batch
    (the same shared-memory channels_last batch as AugmentCollate, reused the same way -- a ceiling must
    not pay costs the measured pipeline does not -- no resize, no flip)."""

    def __init__(self, reuse_buffers: int = 4) -> None:
        self.pool = BatchPool(reuse_buffers)

    def __call__(self, batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        flat, ticket = self.pool.take(len(batch) * 3 * SIZE * SIZE)
        out = copy_windows([img for img, _ in batch], batch_view(flat, len(batch), SIZE))
        return PooledBatch((out, torch.tensor([lab for _, lab in batch], dtype=torch.int64)), ticket)


class CopyRecordsCollate:
    """Looser ceiling: every whole cached record copied back to back into one packed uint8 batch
    (shared memory in a worker) plus its shapes; returned as ``(flat uint8, shapes [B, 3], labels)``."""

    def __init__(self, reuse_buffers: int = 4) -> None:
        self.pool = BatchPool(reuse_buffers)  # reused like AugmentCollate's (a fair ceiling)

    def __call__(self, batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, ...]:
        total = sum(int(img.numel()) for img, _ in batch)
        flat, ticket = self.pool.take(total)
        off = 0
        for img, _ in batch:
            n = int(img.numel())
            flat[off:off + n].view(img.shape[1], img.shape[2], 3).copy_(img.permute(1, 2, 0))
            off += n
        shapes = torch.tensor([[int(img.shape[1]), int(img.shape[2]), 3] for img, _ in batch])
        return PooledBatch((flat, shapes, torch.tensor([lab for _, lab in batch], dtype=torch.int64)), ticket)


def ensure_dataset(n_images: int, classes: int = 20) -> str:
    """The benchmark's generated ImageFolder, made once and published atomically (concurrent runs are
    safe: each builds in its own temp dir, the first rename wins, see :func:`synth.publish_dir`)."""
    per_class = max(1, n_images // classes)
    root = os.path.join(user_cache_dir(), "datacache", "bench", "published",
                        f"loader-{classes}x{per_class}-500x375")
    if not os.path.isdir(root):
        print(f"generating {classes * per_class} JPEGs (500x375 q90) + shipped photos in {root}")
        synth.ensure_imagefolder(root, classes=classes, per_class=per_class, size=(500, 375), quality=90,
                                 include_real_photos=True, progress=True)
    return root


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (from /proc; 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def _loader_pids(loader: Any) -> list[int]:
    """The main process and the loader's (persistent) worker processes."""
    it = getattr(loader, "_iterator", None)  # torch-internal, present for persistent workers
    return [os.getpid()] + [w.pid for w in getattr(it, "_workers", [])]


def time_epoch(loader: Any, n: int, desc: str) -> tuple[float, int, float]:
    """One epoch: (wall seconds, samples, CPU seconds of the main + worker processes).

    CPU seconds do not depend on how much of the machine other jobs take, so samples per
    CPU-second is the contention-robust companion of samples/s on this shared machine.
    """
    before = {pid: _cpu_seconds(pid) for pid in _loader_pids(loader)}
    count = 0
    t = time.perf_counter()
    with tqdm(total=n, desc=desc, unit="img", leave=False) as bar:
        for out in loader:
            images, labels = out[0], out[-1]
            packed = len(out) == 3  # CopyRecordsCollate: (flat, shapes, labels)
            assert images.dtype == torch.uint8 and (packed or tuple(images.shape[1:]) == (3, SIZE, SIZE))
            count += int(labels.numel())
            bar.update(int(labels.numel()))
    dt = time.perf_counter() - t
    cpu = sum(_cpu_seconds(pid) - before.get(pid, 0.0) for pid in _loader_pids(loader))
    return dt, count, cpu


def make_loader(ds: Dataset, batch: int, workers: int, collate: Any = None) -> DataLoader:
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate,
                      persistent_workers=workers > 0, worker_init_fn=worker_init if workers > 0 else None,
                      prefetch_factor=2 if workers > 0 else None, generator=torch.Generator().manual_seed(0))


def run_dali(root: str, batch: int, epochs: int) -> dict[str, Any]:
    """DALI CPU pipeline (2 threads); returns {"available": False, ...} when DALI is not installed."""
    try:
        from nvidia.dali import fn, pipeline_def, types  # type: ignore[import-not-found]
    except ImportError as e:
        return {"available": False, "reason": f"nvidia-dali-cuda120 is not installed ({e})"}
    man = Manifest.build(root)
    base = man.root[len("file://"):]
    files = [os.path.join(base, p) for p in man.paths]
    labels = np.asarray(man.targets, dtype=np.int32)
    n = len(files)

    class Feed:  # external_source callable: one batch of (file bytes, label) per call
        def __init__(self) -> None:
            self.order = np.random.default_rng(0).permutation(n)
            self.pos = 0

        def __call__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
            if self.pos >= n:
                self.pos = 0
                self.order = np.random.default_rng(self.pos + n).permutation(n)
                raise StopIteration
            idx = self.order[self.pos:self.pos + batch]
            self.pos += batch
            data = [np.fromfile(files[i], dtype=np.uint8) for i in idx]
            return data, [labels[i:i + 1] for i in idx]

    @pipeline_def(batch_size=batch, num_threads=2, device_id=None)
    def pipe():  # type: ignore[no-untyped-def]
        jpegs, labs = fn.external_source(source=Feed(), num_outputs=2, batch=True)
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=(SIZE, SIZE), random_area=(0.08, 1.0),
                                        random_aspect_ratio=(3 / 4, 4 / 3))
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labs

    p = pipe()
    p.build()
    rates = []
    for e in range(epochs):
        count = 0
        t = time.perf_counter()
        try:
            while True:
                images, _ = p.run()
                count += len(images)
        except StopIteration:
            p.reset()
        dt = time.perf_counter() - t
        if e > 0 or epochs == 1:
            rates.append(count / dt)
    return {"available": True, "samples_per_s": max(rates)}


# ------------------------------------------------------------------ FFCV, the peer a user would pick instead
FFCV_APT = ("libturbojpeg0-dev", "libopencv-dev", "pkg-config")


def ffcv_available() -> str | None:
    """Why FFCV cannot be measured here, or None when ``import ffcv`` works."""
    try:
        import ffcv  # type: ignore[import-not-found]  # noqa: F401
    except Exception as e:  # ImportError, or a broken native build (OSError, numba errors)
        return (f"ffcv is not importable ({type(e).__name__}: {e}); run with --install-peers, or: apt-get "
                f"install -y {' '.join(FFCV_APT)} && {sys.executable} -m pip install ffcv")
    return None


def install_peers() -> str | None:
    """Install FFCV (its native build needs the apt packages ``FFCV_APT``) into this interpreter's
    environment; returns None on success, else the reason (one line)."""
    if ffcv_available() is None:
        return None
    if shutil.which("apt-get") and os.geteuid() == 0:
        print(f"installing {' '.join(FFCV_APT)} (apt-get)")
        got = subprocess.run(["apt-get", "install", "-y", *FFCV_APT], capture_output=True, text=True)
        if got.returncode != 0:
            return f"apt-get install {' '.join(FFCV_APT)} failed: {got.stderr.strip().splitlines()[-1:]}"
    print("installing ffcv (pip; it compiles, ~2 min)")
    got = subprocess.run([sys.executable, "-m", "pip", "install", "ffcv"], capture_output=True, text=True)
    if got.returncode != 0:
        return f"pip install ffcv failed: {got.stderr.strip().splitlines()[-1:]}"
    return ffcv_available()


class PILFiles:
    """An indexable of ``(PIL RGB image, label)`` for FFCV's ``DatasetWriter``, reading through fsspec (a
    local path or ``slowfile://``). An undecodable file becomes a black image of ``fallback`` size (FFCV
    has no skip: its user must put something there); ``bad`` counts them in the process that read them.

    Pickled into DatasetWriter's worker processes: the fsspec filesystem is opened lazily per process."""

    def __init__(self, source: str, fallback: tuple[int, int] = (64, 48)) -> None:
        man = Manifest.build(source)
        self.root, self.paths, self.labels = man.root, list(man.paths), [int(t) for t in man.targets]
        self.fallback = fallback
        self._fs: Any = None
        self.bad = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        import fsspec

        if self._fs is None:  # per process: never reuse a parent's open filesystem after fork
            self._fs, self._base = fsspec.core.url_to_fs(self.root)
        data = self._fs.cat_file(self._base.rstrip("/") + "/" + self.paths[i])
        try:
            with Image.open(io.BytesIO(data)) as im:
                img = im.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError):
            self.bad += 1
            img = Image.new("RGB", self.fallback)
        return img, self.labels[i]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}


def ffcv_write(dataset: Any, path: str, mode: str, max_resolution: int, workers: int) -> float:
    """Write ``dataset`` as an FFCV ``.beton`` (``raw`` or ``jpg`` image mode); returns seconds."""
    from ffcv.fields import IntField, RGBImageField  # type: ignore[import-not-found]
    from ffcv.writer import DatasetWriter  # type: ignore[import-not-found]

    t = time.perf_counter()
    writer = DatasetWriter(path, {"image": RGBImageField(write_mode=mode, max_resolution=max_resolution),
                                  "label": IntField()}, num_workers=workers)
    writer.from_indexed_dataset(dataset)
    return time.perf_counter() - t


def ffcv_loader(path: str, size: int, batch: int, workers: int) -> Any:
    """FFCV loader producing the same batches as ours: uint8 NCHW, random-resized-crop to ``size`` + flip,
    random order, page cache (``os_cache=True``), the last partial batch kept."""
    from ffcv.fields.basics import IntDecoder  # type: ignore[import-not-found]
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder  # type: ignore[import-not-found]
    from ffcv.loader import Loader, OrderOption  # type: ignore[import-not-found]
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage  # type: ignore[import-not-found]

    pipelines = {"image": [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip(), ToTensor(),
                           ToTorchImage(channels_last=False)],
                 "label": [IntDecoder(), ToTensor()]}
    return Loader(path, batch_size=batch, num_workers=workers, os_cache=True, order=OrderOption.RANDOM,
                  drop_last=False, pipelines=pipelines, seed=0)


def ffcv_epoch(loader: Any, size: int) -> tuple[float, int]:
    """One FFCV epoch: (seconds, samples); checks the batches' dtype and shape."""
    n, t = 0, time.perf_counter()
    for images, labels in loader:
        assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, size, size), images.shape
        n += int(labels.shape[0])
    return time.perf_counter() - t, n


def ffcv_first_epoch_from_slowfile(source: str, beton: str, size: int, batch: int, *, workers: int = 2,
                                   max_resolution: int = 43) -> dict[str, Any]:
    """A user switching to FFCV: list + convert the JPEG folder to a raw ``.beton`` (reading ``source``),
    then the first epoch (numba JIT included). Seconds from nothing to the end of that epoch."""
    t = time.perf_counter()
    files = PILFiles(source)
    list_s = time.perf_counter() - t
    write_s = ffcv_write(files, beton, "raw", max_resolution, workers)
    epoch_s, n = ffcv_epoch(ffcv_loader(beton, size, batch, workers), size)
    return {"seconds": time.perf_counter() - t, "list_s": list_s, "convert_s": write_s, "epoch_s": epoch_s,
            "samples": n, "beton_bytes": os.path.getsize(beton), "write_mode": "raw",
            "max_resolution": max_resolution, "undecodable_written_as_black": "yes (FFCV has no skip)"}


def ours_first_epoch_from_slowfile(source: str, lmdb_dir: str, size: int, batch: int, *, workers: int = 2,
                                   short_side: int = 32) -> dict[str, Any]:
    """Ours from the same folder: ``CachedImageNet`` on an empty LMDB cache, one cold epoch (read + decode +
    write-back in the DataLoader workers), no conversion step. Seconds from nothing to its end."""
    t = time.perf_counter()
    ds = CachedImageNet(source, cache="lmdb://" + lmdb_dir, short_side=short_side, t1_dir=None)
    list_s = time.perf_counter() - t
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                        collate_fn=AugmentCollate(size), worker_init_fn=worker_init,
                        generator=torch.Generator().manual_seed(0))
    n = sum(int(labels.numel()) for _, labels in loader)
    ds.flush(60)
    st = ds.stats()
    return {"seconds": time.perf_counter() - t, "list_s": list_s, "samples": n, "decoded": st["decoded"],
            "quarantined": st.get("quarantined")}


def run_ffcv_peer(root: str, workdir: str, batch: int, workers: int, max_resolution: int = 213
                  ) -> dict[str, Any]:
    """Write the loader dataset as ``.beton`` in raw and jpg mode and build both loaders; runs each
    loader's first (JIT-compiling) epoch untimed. Returns {"available": False, "reason"} without FFCV."""
    why = ffcv_available()
    if why is not None:
        return {"available": False, "reason": why}
    files = PILFiles(root)
    out: dict[str, Any] = {"available": True, "max_resolution": max_resolution, "loaders": {}}
    for mode in ("raw", "jpg"):
        path = os.path.join(workdir, f"loader-{mode}.beton")
        write_s = ffcv_write(files, path, mode, max_resolution, workers)
        loader = ffcv_loader(path, SIZE, batch, workers)
        jit_s, _ = ffcv_epoch(loader, SIZE)  # numba compiles the pipeline in this first epoch
        out[mode] = {"write_s": write_s, "beton_bytes": os.path.getsize(path), "first_epoch_s": jit_s}
        out["loaders"][mode] = loader
        print(f"FFCV {mode}: .beton {os.path.getsize(path) / 1e6:.0f} MB written in {write_s:.1f} s, first "
              f"(JIT) epoch {jit_s:.1f} s")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (300 images, batch 64)")
    ap.add_argument("--images", type=int, default=None, help="generated JPEGs (default 2000, quick 300)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 256 (quick 64)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--install-peers", action="store_true",
                    help="install FFCV (apt packages + pip) when it is missing; without it FFCV is skipped")
    ap.add_argument("--no-ffcv", action="store_true", help="do not measure FFCV even when installed")
    args = ap.parse_args(argv)
    peer_error = install_peers() if args.install_peers and not args.no_ffcv else None
    n_images = args.images or (300 if args.quick else 2000)
    batch = args.batch_size or (64 if args.quick else 256)
    machine = print_machine(machine_info())
    root = ensure_dataset(n_images)
    cache_dir = os.path.join(user_cache_dir(), "datacache", "bench", "loader-lmdb")
    shutil.rmtree(cache_dir, ignore_errors=True)
    torch.set_num_threads(1)  # the main process only receives batches
    results: dict[str, Any] = {}
    notes = [f"{os.cpu_count()} cores shared with other jobs on this machine: absolute numbers are noisy; "
             f"naive, warm and copy epochs ran interleaved in one process ({ROUNDS} rounds of 1 naive epoch "
             f"+ {FAST_EPOCHS} alternating warm/copy/copy-records epochs) for the ratios; "
             "the *_cpu ratios use samples per CPU-second of the main + worker processes, which "
             "other jobs' load does not change"]

    naive = NaivePILDataset(root)
    n = len(naive)
    ds = CachedImageNet(root, cache="lmdb://" + cache_dir, short_side=160, t1_dir=None)
    naive_loader = make_loader(naive, batch, args.workers)
    dc_loader = make_loader(ds, batch, args.workers, AugmentCollate(SIZE))
    copy_loader = make_loader(ds, batch, args.workers, CopyCollate())
    records_loader = make_loader(ds, batch, args.workers, CopyRecordsCollate())
    epochs: list[dict[str, Any]] = []

    def dc_epoch(e: int, loader: DataLoader) -> None:
        ds.reset_stats()
        dt, count, cpu = time_epoch(loader, n, f"datacache epoch {e}")
        st = ds.stats()
        epochs.append({"epoch": e, "samples_per_s": count / dt, "seconds": dt, "cpu_seconds": cpu,
                       "samples_per_cpu_s": count / cpu, "hits": st["hits"],
                       "misses": st["misses"], "decoded": st["decoded"], "bytes_read": st["bytes_read"]})
        print(f"datacache epoch {e}: {count / dt:8.0f} samples/s ({count / cpu:.0f} per CPU-second)  "
              f"hits {st['hits']}  decoded {st['decoded']}")

    load_before = os.getloadavg()
    dc_epoch(1, dc_loader)  # cold: starting its workers is part of the cold cost
    profile = profile_stages(ds, batch, SIZE, copy_windows)  # the cache is warm now
    ds.reset_stats()
    results["per_batch_ms"] = {"batch_size": batch, "where": "main process, 1 thread, median of 6 batches",
                               **{k: round(v, 2) for k, v in profile.items()}}
    print("per batch (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in profile.items()))
    next(iter(naive_loader))  # start the other loaders' persistent workers outside the timed epochs
    next(iter(copy_loader))
    next(iter(records_loader))
    # Fork hazard: FFCV runs its own thread pool in this process; every DataLoader above has forked its
    # (persistent) workers already, so no fork happens while FFCV's threads are alive.
    ffcv_dir = tempfile.mkdtemp(prefix="datacache-bench-ffcv-")
    if args.no_ffcv:
        ffcv: dict[str, Any] = {"available": False, "reason": "--no-ffcv"}
    elif peer_error is not None:
        ffcv = {"available": False, "reason": peer_error}
    else:
        ffcv = run_ffcv_peer(root, ffcv_dir, batch, args.workers)  # first (JIT) epochs run here, untimed
    ffcv_loaders = ffcv.pop("loaders", {})
    timed: dict[str, list[tuple[float, int, float]]] = {"naive": [], "copy_ceiling": [], "copy_records": []}
    ffcv_timed: dict[str, list[tuple[float, int]]] = {m: [] for m in ffcv_loaders}
    for r in range(ROUNDS):  # interleaved rounds: load from other jobs drifts over all pipelines alike
        timed["naive"].append(time_epoch(naive_loader, n, f"naive round {r + 1}"))
        for e in range(FAST_EPOCHS):
            dc_epoch(2 + r * FAST_EPOCHS + e, dc_loader)
            timed["copy_ceiling"].append(time_epoch(copy_loader, n, f"copy round {r + 1}"))
            timed["copy_records"].append(time_epoch(records_loader, n, f"copy records round {r + 1}"))
            for mode, fl in ffcv_loaders.items():  # FFCV's threads run in this process, between our epochs
                ffcv_timed[mode].append(ffcv_epoch(fl, SIZE))
    del naive_loader, dc_loader, copy_loader, records_loader, ffcv_loaders
    shutil.rmtree(ffcv_dir, ignore_errors=True)
    for mode, runs in ffcv_timed.items():
        ffcv[mode].update(samples_per_s=sum(c for _, c in runs) / sum(dt for dt, _ in runs),
                          per_epoch=[c / dt for dt, c in runs])
        print(f"FFCV {mode}:          {ffcv[mode]['samples_per_s']:8.0f} samples/s")
    if not ffcv["available"]:
        print(f"FFCV:              not run: {ffcv['reason']}")
        notes.append(f"FFCV not measured ({ffcv['reason']}); warm_vs_ffcv_* are null")
    else:
        notes.append(f"FFCV 1.0.2: .beton with RGBImageField(max_resolution={ffcv['max_resolution']}) (the "
                     "size of our short-side-160 records), RandomResizedCropRGBImageDecoder((128, 128)) + "
                     "RandomHorizontalFlip, uint8 NCHW, os_cache=True, 2 workers, random order; its first "
                     "(numba JIT) epoch untimed; timed epochs interleaved with ours")
    results["ffcv"] = ffcv
    load_after = os.getloadavg()
    for name, runs in timed.items():
        secs = sum(dt for dt, _, _ in runs)
        cnt = sum(c for _, c, _ in runs)
        cpu = sum(cp for _, _, cp in runs)
        results[name] = {
            "samples_per_s": cnt / secs, "seconds": secs, "samples": cnt, "cpu_seconds": cpu,
            "samples_per_cpu_s": cnt / cpu, "per_epoch": [c / dt for dt, c, _ in runs]}
    print(f"naive PIL:         {results['naive']['samples_per_s']:8.0f} samples/s "
          f"({results['naive']['samples_per_cpu_s']:.0f} per CPU-second)")
    print(f"copy-only ceiling: {results['copy_ceiling']['samples_per_s']:8.0f} samples/s (128x128 window "
          f"of each record); whole records packed: {results['copy_records']['samples_per_s']:.0f} samples/s")
    results["datacache_cold"] = epochs[0]
    warm = epochs[1:]
    warm_rate = sum(x["samples_per_s"] * x["seconds"] for x in warm) / sum(x["seconds"] for x in warm)
    warm_cpu_rate = sum(x["samples_per_s"] * x["seconds"] for x in warm) / sum(x["cpu_seconds"] for x in warm)
    results["datacache_warm"] = {"samples_per_s": warm_rate, "samples_per_cpu_s": warm_cpu_rate,
                                 "epochs": warm}
    results["load_average"] = {"before": load_before, "after": load_after}
    for mode in ffcv_timed:  # FFCV epoch k ran right after our warm epoch k (same round, same load)
        pairs = [w["samples_per_s"] / f for w, f in zip(warm, ffcv[mode]["per_epoch"])]
        ffcv[mode].update(pair_ratios=pairs, pair_median=float(np.median(pairs)),
                          ratio_of_totals=warm_rate / ffcv[mode]["samples_per_s"])
        print(f"ours / FFCV {mode}: median of {len(pairs)} epoch pairs {ffcv[mode]['pair_median']:.2f}, "
              f"ratio of totals {ffcv[mode]['ratio_of_totals']:.2f}")
    notes.append(f"1-min load average {load_before[0]:.1f} before / {load_after[0]:.1f} after the timed "
                 f"part on {os.cpu_count()} cores (other helpers' jobs)")

    dali = run_dali(root, batch, epochs=2)
    results["dali_cpu"] = dali
    if dali["available"]:
        print(f"DALI CPU 2 thr:    {dali['samples_per_s']:8.0f} samples/s")
    else:
        print(f"DALI CPU:          not run: {dali['reason']}")
        notes.append("DALI CPU pipeline not measured: nvidia-dali-cuda120 is not installed here "
                     "(optional extra `dali`); warm_vs_dali is null")

    ratios = {
        "warm_vs_naive": warm_rate / results["naive"]["samples_per_s"],
        "warm_vs_dali": warm_rate / dali["samples_per_s"] if dali["available"] else None,
        "warm_vs_copy_ceiling": warm_rate / results["copy_ceiling"]["samples_per_s"],
        "warm_vs_ffcv_raw": ffcv["raw"]["pair_median"] if ffcv["available"] else None,
        "warm_vs_ffcv_jpg": ffcv["jpg"]["pair_median"] if ffcv["available"] else None,
        "warm_vs_cold": warm_rate / epochs[0]["samples_per_s"],
        "warm_vs_copy_records": warm_rate / results["copy_records"]["samples_per_s"],
        # per CPU-second (robust to other jobs' load on this shared machine)
        "warm_vs_naive_cpu": warm_cpu_rate / results["naive"]["samples_per_cpu_s"],
        "warm_vs_copy_ceiling_cpu": warm_cpu_rate / results["copy_ceiling"]["samples_per_cpu_s"],
    }
    targets = {"warm_vs_naive": 10.0, "warm_vs_dali": 8.0, "warm_vs_copy_ceiling": 0.5,
               "warm_vs_ffcv_raw": 1.5, "warm_vs_ffcv_jpg": 2.5}
    for name, target in targets.items():
        v = ratios[name]
        if v is not None and v < target:
            notes.append(f"target missed: {name} = {v:.2f} < {target}")
    config = {"images": n, "batch_size": batch, "workers": args.workers, "image_size": SIZE,
              "short_side": 160, "source_size": "500x375 q90", "quick": args.quick,
              "decode_backend": ds.stats()["decode_backend"], "dali_installed": dali["available"],
              "ffcv_installed": ffcv["available"]}
    name = "loader" if not args.quick else "loader_quick"
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR) as tmp:  # write, then move: never half-written
        write_results(name, machine=machine, config=config, results=results, ratios=ratios, notes=notes,
                      out_dir=tmp)
        _plot(os.path.join(tmp, name + ".png"), results, epochs, warm_rate, dali, batch, args.workers, n,
              ffcv)
        for ext in (".json", ".png"):
            os.replace(os.path.join(tmp, name + ext), RESULTS_DIR / (name + ext))
    print(f"moved {name}.json / {name}.png into {RESULTS_DIR}")


def _plot(path: str, results: dict[str, Any], epochs: list[dict[str, Any]], warm_rate: float,
          dali: dict[str, Any], batch: int, workers: int, n: int, ffcv: dict[str, Any]) -> None:
    labels = ["naive PIL", "DALI CPU", "FFCV raw", "FFCV jpg", "datacache cold", "datacache warm",
              "copy ceiling"]
    values = [results["naive"]["samples_per_s"], dali.get("samples_per_s", 0.0),
              ffcv.get("raw", {}).get("samples_per_s", 0.0), ffcv.get("jpg", {}).get("samples_per_s", 0.0),
              epochs[0]["samples_per_s"], warm_rate, results["copy_ceiling"]["samples_per_s"]]
    if not dali["available"]:
        labels[1] = "DALI CPU\n(not installed)"
    if not ffcv["available"]:
        labels[2], labels[3] = "FFCV raw\n(not installed)", "FFCV jpg\n(not installed)"
    bar_chart(path, labels, values,
              title=f"{SIZE}px RRC+flip uint8 batches of {batch}, {workers} workers ({n} JPEGs)",
              ylabel="samples/s")


if __name__ == "__main__":
    main()
