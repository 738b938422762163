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
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from datacache.config import Variant
from datacache.decode import decode_image, pil_family, plain_jpeg_target

_INHERITED: list[Any] = []  # pipelines inherited over fork: referenced forever, so never destroyed here


def dali_available() -> str | None:
    """Why DALI cannot run here, or None."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return f"nvidia-dali-cuda120 is not installed (pip install 'datacache[dali]'): {e}"
    return None


def gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


class DaliDecoder:
    """DALI decode backend (see the module docstring); ``device``: ``auto``, ``cpu`` or ``gpu``."""

    name = "dali"

    def __init__(self, device: str = "auto", threads: int = 1, max_batch: int = 64) -> None:
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"DaliDecoder device={device!r}: choose auto, cpu or gpu")
        self.device = device
        self.threads = int(threads)
        self.max_batch = int(max_batch)
        self._pipeline: Any = None  # built on first use, in this process (module docstring)
        self._ready: dict[int, np.ndarray] = {}
        self._pid = os.getpid()
        self._family: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "threads": self.threads, "max_batch": self.max_batch,
                "_pipeline": None, "_ready": {}, "_pid": -1,
                "_family": self._family}

    @property
    def on_gpu(self) -> bool:
        return self.device == "gpu" or (self.device == "auto" and gpu_available())

    @property
    def family(self) -> str:
        """Decoder family of the pixels (module docstring): ``dali-gpu`` with nvJPEG, else ``dali``.
        Resolved once per object (``fill_one`` asks for every sample; ``auto`` probes for a GPU)."""
        if self._family is None:
            self._family = "dali-gpu" if self.on_gpu else "dali"
        return self._family

    def _pipe(self) -> Any:
        if self._pid != os.getpid():  # fork boundary (module docstring): keep, never run, the parent's
            if self._pipeline is not None:
                _INHERITED.append(self._pipeline)
            self._pipeline, self._pid = None, os.getpid()
        if self._pipeline is not None:
            return self._pipeline
        from nvidia.dali import fn, pipeline_def, types  # type: ignore[import-not-found]

        gpu = self.family == "dali-gpu"  # the family the keys were named for, resolved once (parent)

        @pipeline_def(batch_size=self.max_batch, num_threads=self.threads, device_id=0 if gpu else None,
                      prefetch_queue_depth=1)
        def build():  # type: ignore[no-untyped-def]
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
            sizes = fn.external_source(name="sizes", dtype=types.FLOAT)
            images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
            # sizes = [h, w] from the core's rounding; linear + antialias ~ Pillow's bilinear reduce
            return fn.resize(images, size=sizes, interp_type=types.INTERP_LINEAR, antialias=True)

        pipe = build()
        pipe.build()
        self._pipeline = pipe
        return pipe

    def decode_batch(self, datas: Sequence[bytes], sizes: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Decode plain JPEGs to the given (width, height) targets; HWC uint8 arrays."""
        pipe = self._pipe()
        out: list[np.ndarray] = []
        for s in range(0, len(datas), self.max_batch):
            part = datas[s:s + self.max_batch]
            pipe.feed_input("jpegs", [np.frombuffer(d, dtype=np.uint8) for d in part])
            pipe.feed_input("sizes", [np.array([h, w], dtype=np.float32)
                                      for w, h in sizes[s:s + self.max_batch]])
            (images,) = pipe.run()
            if self.family == "dali-gpu":
                images = images.as_cpu()  # device -> host copy (a sync point)
            out.extend(np.ascontiguousarray(images.at(i)) for i in range(len(part)))
        return out

    def prepare(self, datas: Sequence[Any], variant: Variant) -> None:
        """Decode every plain JPEG of a chunk in one pipeline run; the rest is left to Pillow."""
        self._ready.clear()
        todo = [(d, plain_jpeg_target(d, variant)) for d in datas if isinstance(d, (bytes, bytearray))]
        todo = [(d, t) for d, t in todo if t is not None]
        if not todo:
            return
        try:
            datas_, sizes_ = [d for d, _ in todo], [t for _, t in todo]
            pixels: list[np.ndarray | None] = list(self.decode_batch(datas_, sizes_))
        except Exception:  # DALI refused the batch (one corrupt stream): decode each file alone, so a
            pixels = [self._decode_alone(d, t) for d, t in todo]  # file never depends on its chunk
        for (d, t), px in zip(todo, pixels):
            if px is not None and px.shape[:2] == (t[1], t[0]):
                self._ready[id(d)] = px

    def _decode_alone(self, data: bytes, target: tuple[int, int]) -> np.ndarray | None:
        """One plain JPEG through DALI; None when DALI cannot decode it (Pillow then decides)."""
        try:
            px = self.decode_batch([data], [target])[0]
        except Exception:
            return None
        return px if px.shape[:2] == (target[1], target[0]) else None

    def __call__(self, data: bytes, variant: Variant, *, name: str = "<bytes>") -> np.ndarray:
        px = self._ready.pop(id(data), None)
        if px is not None:
            return px
        target = plain_jpeg_target(data, variant) if isinstance(data, (bytes, bytearray)) else None
        if target is not None:  # not prepared with its chunk: DALI still decodes it (same family bytes)
            px = self._decode_alone(data, target)
            if px is not None:
                return px
        return decode_image(data, variant, name=name)


def variant_for(variant: Variant, decoder: Any) -> Variant:
    """``variant`` in the decoder family of ``decoder`` (None = this process's Pillow): what it fills."""
    family = pil_family() if decoder is None else decoder.family
    return dataclasses.replace(variant, decoder_family=family)


def make_decoder(name: str) -> Any:
    """``None`` for Pillow (the core's default), a :class:`DaliDecoder` for ``dali``."""
    if name == "pillow":
        return None
    why = dali_available()
    if why:
        from datacache.config import ConfigError

        raise ConfigError(f"decoder = \"dali\": {why}")
    return DaliDecoder()
