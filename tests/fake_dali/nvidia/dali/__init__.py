"""A stand-in for ``nvidia.dali`` (not installable on CI's machines) with just the API that
``cache_daemon.decoders.DaliDecoder`` uses, to test what the daemon does around DALI: which kwargs each
process builds its pipeline with, and what happens when a pipeline cannot be built or stops working.

Put ``tests/fake_dali`` first on ``sys.path`` and drop any imported ``nvidia`` modules: ``nvidia`` is a
regular package here, so it wins over an installed DALI's (also regular) ``nvidia``. Controlled through
the environment, so forked pool workers obey it too:

* ``FAKE_DALI_LOG``: a file that gets one JSON line per pipeline built or refused (pid, kwargs, decoder
  device, ok) -- the test reads what every worker did;
* ``FAKE_DALI_FAIL_BUILD``: ``mixed`` -- building a GPU (``mixed``) pipeline raises, as DALI does when
  the process cannot use CUDA;
* ``FAKE_DALI_FAIL_RUN_AFTER``: N -- every run after the N-th in a process raises (a lost device).

Decoding: Pillow decodes and resizes (bilinear), then every pixel's lowest bit is flipped, so a test can
tell this "DALI"'s pixels from Pillow's exactly. A stream holding the bytes ``dali-refuses`` (a JPEG
comment) is refused, like a stream DALI cannot parse.
"""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace
from typing import Any

import numpy as np

_RUNS = {"pid": -1, "n": 0}


def _log(entry: dict[str, Any]) -> None:
    path = os.environ.get("FAKE_DALI_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **entry}) + "\n")


class _Node:
    def __init__(self, op: str, inputs: tuple[Any, ...] = (), **kw: Any) -> None:
        self.op, self.inputs, self.kw = op, inputs, kw


def _external_source(name: str, dtype: Any = None) -> _Node:
    return _Node("external_source", name=name)


def _image(data: _Node, device: str = "cpu", output_type: Any = None) -> _Node:
    return _Node("decode", (data,), device=device)


def _resize(images: _Node, size: _Node, interp_type: Any = None, antialias: bool = True) -> _Node:
    return _Node("resize", (images, size))


fn = SimpleNamespace(external_source=_external_source, decoders=SimpleNamespace(image=_image),
                     resize=_resize)
types = SimpleNamespace(UINT8="uint8", FLOAT="float", RGB="rgb", INTERP_LINEAR="linear")


class _Batch:
    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def as_cpu(self) -> _Batch:
        return self

    def at(self, i: int) -> np.ndarray:
        return self.arrays[i]


class _Pipeline:
    def __init__(self, out: _Node, kwargs: dict[str, Any]) -> None:
        self.out, self.kwargs, self.inputs = out, kwargs, {}
        self.decode_device = out.inputs[0].kw["device"]

    def build(self) -> None:
        ok = not (self.decode_device == "mixed" and os.environ.get("FAKE_DALI_FAIL_BUILD") == "mixed")
        _log({"event": "build", "ok": ok, "device": self.decode_device, **self.kwargs})
        if not ok:
            raise RuntimeError("CUDA error: initialization error (fake)")
        if self.decode_device == "mixed" and self.kwargs.get("device_id") is None:
            raise RuntimeError("mixed decoder needs a device_id")

    def feed_input(self, name: str, data: list[np.ndarray]) -> None:
        self.inputs[name] = data

    def run(self) -> tuple[_Batch]:
        from PIL import Image

        if _RUNS["pid"] != os.getpid():
            _RUNS.update(pid=os.getpid(), n=0)
        _RUNS["n"] += 1
        limit = os.environ.get("FAKE_DALI_FAIL_RUN_AFTER")
        if limit is not None and _RUNS["n"] > int(limit):
            _log({"event": "run", "ok": False})
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
        out = []
        for data, size in zip(self.inputs["jpegs"], self.inputs["sizes"]):
            raw = data.tobytes()
            if b"dali-refuses" in raw:
                _log({"event": "refused", "batch": len(self.inputs["jpegs"])})
                raise RuntimeError("nvJPEG: unsupported stream (fake)")
            h, w = int(size[0]), int(size[1])
            img = Image.open(io.BytesIO(raw)).convert("RGB").resize((w, h), Image.BILINEAR)
            out.append(np.asarray(img, dtype=np.uint8) ^ 1)
        _log({"event": "run", "ok": True, "n": len(out)})
        return (_Batch(out),)


def pipeline_def(**kwargs: Any) -> Any:
    def wrap(graph: Any) -> Any:
        def make() -> _Pipeline:
            return _Pipeline(graph(), kwargs)
        return make
    return wrap
