"""Decode backends of the ingest pool: Pillow (the core's :func:`~datacache.decode.decode_image`) and DALI.

DALI's pixels are not Pillow's (another JPEG decoder build or nvJPEG, another resize), so they are their
own decoder family: :attr:`DaliDecoder.family` is ``dali`` (CPU) or ``dali-gpu`` (nvJPEG), the daemon fills
``Variant(decoder_family=...)`` of that family (:func:`variant_for`: the family is part of the key's variant
tag) and a client reads them by asking for that family. Within a family a sample is a function of the file
bytes only: a plain JPEG is decoded by DALI (alone, if its chunk's batch fails), anything else -- and a
file DALI cannot decode -- by Pillow's :func:`~datacache.decode.decode_image`. The output size is the
core's (:func:`~datacache.decode.plain_jpeg_target`), so both families have samples of identical shape.

:class:`DaliDecoder` (the ``[dali]`` extra, ``nvidia-dali-cuda120``): a DALI pipeline fed with the
bytes *our* reader fetched (``fn.external_source``: T1, retries and identity checks stay ours),
decoding with ``fn.decoders.image`` on the CPU (``device="cpu"``, ``device_id=None``: no GPU needed)
or, when the node has a GPU, the ``mixed`` (nvJPEG) decoder, then ``fn.resize`` to the target size
(linear, antialiased). It decodes whole chunks: the pool worker calls :meth:`DaliDecoder.prepare`
with a chunk's bytes, then :func:`~datacache.fill.fill_one` asks for each sample. Anything that is not
a plain JPEG (PNG, CMYK, EXIF-rotated, corrupt) goes to Pillow, so the bad-input policy is unchanged.

Process boundary: the pipeline is built lazily in the process that uses it (the object pickles as its
settings only), one pipeline per process. A pipeline inherited over fork (the parent used the decoder
before starting the pool) has lost its worker threads and would hang on its next run: the child
detects the pid change, never touches (nor destroys) the inherited pipeline and builds its own.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cache_daemon.gpu_probe import probe_gpus
from datacache.config import Variant
from datacache.decode import decode_image, pil_family, plain_jpeg_target
from datacache.fill import DecoderUnavailable

_INHERITED: list[Any] = []  # pipelines inherited over fork: referenced forever, so never destroyed here
_RETRY_BROKEN_S = 60.0  # a worker whose pipeline could not be built tries again after this long
log = logging.getLogger("datacache.daemon.decoders")


def dali_available() -> str | None:
    """Why DALI cannot run here, or None."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return f"nvidia-dali-cuda120 is not installed (pip install 'datacache[dali]'): {e}"
    return None


def gpu_available() -> bool:
    """Whether this process sees a GPU, asked through NVML: never initialises CUDA, never imports torch
    (:mod:`cache_daemon.gpu_probe`: safe in the daemon's parent, before its decode pool forks)."""
    return bool(probe_gpus())


def _canary_jpeg() -> bytes:
    """A small plain JPEG made here (Pillow): DALI must decode it whenever its pipeline works."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (90, 140, 200)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _worker_slot() -> int:
    """0-based number of this ``multiprocessing`` worker (0 in a process that is not one). The workers of
    one pool (and its replacement workers) get consecutive numbers, so numbers modulo the GPU count
    spread a pool of k <= GPUs workers over k different GPUs."""
    ident = getattr(mp.current_process(), "_identity", ())  # (pool no., worker no.), 1-based; () = parent
    return int(ident[-1]) - 1 if ident else 0


class DaliDecoder:
    """DALI decode backend (see the module docstring); ``device``: ``auto``, ``cpu`` or ``gpu``.

    ``gpus``: the CUDA ordinals GPU decoding may use (None: probed through NVML when the family is first
    asked, in the daemon's parent). Worker ``k`` of the pool decodes on ``gpus[k % len(gpus)]``."""

    name = "dali"

    def __init__(self, device: str = "auto", threads: int = 1, max_batch: int = 64,
                 gpus: Sequence[int] | None = None) -> None:
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"DaliDecoder device={device!r}: choose auto, cpu or gpu")
        self.device = device
        self.threads = int(threads)
        self.max_batch = int(max_batch)
        self.gpus: tuple[int, ...] | None = tuple(gpus) if gpus is not None else None
        self._pipeline: Any = None  # built on first use, in this process (module docstring)
        self._ready: dict[int, np.ndarray] = {}
        self._refused: set[int] = set()  # ids of this chunk's files DALI refused alone (Pillow decides)
        self._pid = os.getpid()
        self._family: str | None = None
        self._broken, self._broken_until = "", 0.0  # why this process cannot build a pipeline, until when
        self._counts = {"pillow_fallbacks": 0, "unavailable": 0}

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "threads": self.threads, "max_batch": self.max_batch,
                "gpus": self.gpus,
                "_pipeline": None, "_ready": {}, "_refused": set(), "_pid": -1, "_family": self._family,
                "_broken": "", "_broken_until": 0.0, "_counts": {"pillow_fallbacks": 0, "unavailable": 0}}

    @property
    def on_gpu(self) -> bool:
        return self.family == "dali-gpu"

    @property
    def family(self) -> str:
        """Decoder family of the pixels (module docstring): ``dali-gpu`` with nvJPEG, else ``dali``.
        Resolved once per object, in the process that creates it (the daemon's parent): ``auto`` asks NVML
        (:func:`gpu_available`), so the keys' family is settled before the pool forks."""
        if self._family is None:
            self._family = "dali" if self.device == "cpu" else self._gpu_family()
        return self._family

    def _gpu_family(self) -> str:
        """``auto``/``gpu``: ``dali-gpu`` when a GPU is visible (NVML, unless ``gpus`` was given), else
        ``dali`` for ``auto`` and a ConfigError for ``gpu``."""
        why = "no GPU given"
        if self.gpus is None:
            probe = probe_gpus()
            self.gpus, why = probe.ordinals, probe.reason
        if self.gpus:
            return "dali-gpu"
        if self.device == "gpu":
            from datacache.config import ConfigError

            raise ConfigError(f"DALI decoder device \"gpu\": {why}; use device \"auto\" or \"cpu\" to "
                              "decode on the CPU (the dali family)")
        return "dali"

    @property
    def device_id(self) -> int | None:
        """The CUDA ordinal this process decodes on (None on the CPU)."""
        if not self.on_gpu or not self.gpus:
            return None
        return self.gpus[_worker_slot() % len(self.gpus)]

    def take_counts(self) -> dict[str, int]:
        """Samples of the plain-JPEG kind that DALI refused (decoded by Pillow, by the family's rule) and
        samples left unfilled because the pipeline could not run here, since the last call; then zero."""
        out, self._counts = self._counts, {"pillow_fallbacks": 0, "unavailable": 0}
        return out

    def _unavailable(self) -> DecoderUnavailable:
        return DecoderUnavailable(self._broken or "the DALI pipeline cannot run in this worker")

    def _mark_broken(self, what: str, e: BaseException) -> DecoderUnavailable:
        """Remember (for ``_RETRY_BROKEN_S``) that no pipeline runs here; log it once, with the error's type
        and first line (DALI's text names the device and CUDA, never file bytes)."""
        where = f"GPU {self.device_id}" if self.on_gpu else "the CPU"
        self._broken = f"DALI ({self.family}) {what} on {where}"  # a sample's reason: no pid, bounded
        self._broken_until = time.monotonic() + _RETRY_BROKEN_S
        first = (str(e).strip().splitlines() or [""])[0][:200]
        log.warning("%s (worker pid %d): %s: %s; no %s key is written by this worker (its samples stay "
                    "unfilled and are retried in %.0f s; decoder_device = \"cpu\" fills the dali family)",
                    self._broken, os.getpid(), type(e).__name__, first, self.family, _RETRY_BROKEN_S)
        if self._pipeline is not None:
            _INHERITED.append(self._pipeline)  # a broken pipeline is never run (nor destroyed) again
        self._pipeline = None
        return self._unavailable()

    def _pipe(self) -> Any:
        if self._pid != os.getpid():  # fork boundary (module docstring): keep, never run, the parent's
            if self._pipeline is not None:
                _INHERITED.append(self._pipeline)
            self._pipeline, self._pid = None, os.getpid()
            self._broken, self._broken_until = "", 0.0
        if self._pipeline is not None:
            return self._pipeline
        if self._broken and time.monotonic() < self._broken_until:
            raise self._unavailable()  # no pipeline build per sample while it cannot succeed
        gpu = self.on_gpu  # the family the keys were named for, resolved once (parent)
        device_id = self.device_id
        try:
            from nvidia.dali import fn, pipeline_def, types  # type: ignore[import-not-found]

            @pipeline_def(batch_size=self.max_batch, num_threads=self.threads, device_id=device_id,
                          prefetch_queue_depth=1)
            def build():  # type: ignore[no-untyped-def]
                jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
                sizes = fn.external_source(name="sizes", dtype=types.FLOAT)
                images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
                # sizes = [h, w] from the core's rounding; linear + antialias ~ Pillow's bilinear reduce
                return fn.resize(images, size=sizes, interp_type=types.INTERP_LINEAR, antialias=True)

            pipe = build()
            pipe.build()
        except Exception as e:  # no CUDA in this worker, no such device, out of GPU memory, ...
            raise self._mark_broken("could not build its pipeline", e) from None
        self._pipeline, self._broken = pipe, ""
        return pipe

    def decode_batch(self, datas: Sequence[bytes], sizes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Decode plain JPEGs to the given (width, height) targets; HWC uint8 arrays. Raises
        :class:`~datacache.fill.DecoderUnavailable` when no pipeline can be built here."""
        pipe = self._pipe()
        out: list[np.ndarray] = []
        for s in range(0, len(datas), self.max_batch):
            part = datas[s:s + self.max_batch]
            pipe.feed_input("jpegs", [np.frombuffer(d, dtype=np.uint8) for d in part])
            pipe.feed_input("sizes", [np.array([h, w], dtype=np.float32)
                                      for w, h in sizes[s:s + self.max_batch]])
            (images,) = pipe.run()
            if self.on_gpu:
                images = images.as_cpu()  # device -> host copy (a sync point)
            out.extend(np.ascontiguousarray(images.at(i)) for i in range(len(part)))
        return out

    def _pipeline_works(self) -> bool:
        """After DALI refused a file: does it still decode a good JPEG? If not, the pipeline (not the file)
        is at fault -- a CUDA error, a lost device -- and Pillow must not stand in for it."""
        data = _canary_jpeg()
        try:
            self.decode_batch([data], [(32, 24)])
        except DecoderUnavailable:
            return False
        except Exception as e:
            self._mark_broken("stopped decoding (a known-good JPEG fails too)", e)
            return False
        return True

    def prepare(self, datas: Sequence[Any], variant: Variant) -> None:
        """Decode every plain JPEG of a chunk in one pipeline run; the rest is left to Pillow."""
        self._ready.clear()
        self._refused.clear()
        todo = [(d, plain_jpeg_target(d, variant)) for d in datas if isinstance(d, (bytes, bytearray))]
        todo = [(d, t) for d, t in todo if t is not None]
        if not todo:
            return
        try:
            datas_, sizes_ = [d for d, _ in todo], [t for _, t in todo]
            pixels: list[np.ndarray | None] = list(self.decode_batch(datas_, sizes_))
        except DecoderUnavailable:
            return  # each sample's __call__ reports it (unfilled, counted)
        except Exception:  # DALI refused the batch (one corrupt stream): decode each file alone, so a
            pixels = []  # file never depends on its chunk
            for d, t in todo:
                try:
                    pixels.append(self._decode_alone(d, t))
                except DecoderUnavailable:
                    break  # the rest: each sample's __call__ reports it (unfilled, counted)
        for (d, t), px in zip(todo, pixels):
            if px is not None and px.shape[:2] == (t[1], t[0]):
                self._ready[id(d)] = px
            elif px is None:
                self._refused.add(id(d))  # refused alone while the pipeline works: not tried again

    def _decode_alone(self, data: bytes, target: tuple[int, int]) -> np.ndarray | None:
        """One plain JPEG through DALI; None when DALI cannot decode it (Pillow then decides). Raises
        :class:`~datacache.fill.DecoderUnavailable` when the pipeline, not the file, fails."""
        try:
            px = self.decode_batch([data], [target])[0]
        except DecoderUnavailable:
            raise
        except Exception:
            if not self._pipeline_works():
                raise self._unavailable() from None
            return None
        return px if px.shape[:2] == (target[1], target[0]) else None

    def __call__(self, data: bytes, variant: Variant, *, name: str = "<bytes>") -> np.ndarray:
        px = self._ready.pop(id(data), None)
        if px is not None:
            return px
        target = plain_jpeg_target(data, variant) if isinstance(data, (bytes, bytearray)) else None
        if target is not None:  # not decoded with its chunk: DALI decodes it alone (unless it refused)
            try:
                if id(data) in self._refused:  # prepare tried it alone with a working pipeline
                    self._refused.discard(id(data))
                    px = None
                else:
                    px = self._decode_alone(data, target)
            except DecoderUnavailable:
                self._counts["unavailable"] += 1  # never Pillow's pixels under this family's key
                raise
            if px is not None:
                return px
            self._counts["pillow_fallbacks"] += 1  # DALI refuses these bytes: Pillow's verdict, always
        return decode_image(data, variant, name=name)


def variant_for(variant: Variant, decoder: Any) -> Variant:
    """``variant`` in the decoder family of ``decoder`` (None = this process's Pillow): what it fills."""
    family = pil_family() if decoder is None else decoder.family
    return dataclasses.replace(variant, decoder_family=family)


def make_decoder(name: str, device: str = "auto", *, workers: int = 0, gpu_decode_workers: int = 0,
                 cores: int | None = None) -> tuple[Any, int]:
    """The daemon's decoder and its decode pool's size: ``(None, workers)`` for Pillow (the core's
    default); for ``dali`` a :class:`DaliDecoder` whose family is settled here, in the parent, without
    CUDA (:mod:`cache_daemon.gpu_probe`). ``workers``: decode processes (0 = ``cores``).

    GPU decoding caps the pool: ``gpu_decode_workers`` processes (0 = one per visible GPU), spread over
    the visible GPUs, each running DALI with ``cores // processes`` threads -- a CUDA context and an
    nvJPEG pool per process, not one per core on the GPU that local rank 0 trains on."""
    cores = max(1, int(cores or os.cpu_count() or 1))
    size = workers or cores
    if name == "pillow":
        return None, size
    why = dali_available()
    if why:
        from datacache.config import ConfigError

        raise ConfigError(f"decoder = \"dali\": {why}")
    dec = DaliDecoder(device=device)
    if dec.family == "dali-gpu":  # NVML only: the parent never initialises CUDA (fork hazard)
        gpus = dec.gpus or (0,)
        size = min(size, gpu_decode_workers or len(gpus))
        dec.threads = max(1, cores // size)
        log.info("DALI decodes on GPU%s %s: %d worker processes, %d DALI threads each",
                 "s" if len(gpus) > 1 else "", ", ".join(map(str, gpus)), size, dec.threads)
    return dec, size
