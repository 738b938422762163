"""The miss path for one sample: source bytes -> decoded variant -> record, or a classified failure.

Used by :class:`datacache.readthrough.ReadThrough` (so by ``CachedImageNet``, ``datacache warm`` and
the daemon's decode pool alike), so one rule decides what is remembered as bad:

* a **read failure** (unreadable, missing, I/O error, or bytes whose length differs from the
  manifest's size) is *transient*: the sample is skipped for this run, never remembered;
* an **out-of-memory** decode is transient too;
* only a **decode failure of complete bytes** (length equal to the manifest's size) is
  remembered, keyed by the file's identity (:mod:`datacache.quarantine`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from datacache.config import Variant
from datacache.decode import DecodeError, decode_image
from datacache.quarantine import read_failure_reason
from datacache.record import decode_record, encode_record


@dataclass
class Filled:
    """Outcome of :func:`fill_one`: a record and its pixels, or a reason (and whether to remember it)."""

    record: bytes | None = None
    pixels: np.ndarray | None = None
    reason: str = ""
    remember: bool = False


Decoder = Callable[..., np.ndarray]  # decode_image's signature: (data, variant, *, name) -> HWC uint8


def fill_one(data: bytes | BaseException, *, rel: str, size: int, label: int, key: bytes,
             variant: Variant, decoder: Decoder | None = None) -> Filled:
    """Decode ``data`` (or classify the read error it is) into the record stored under ``key``.
    ``decoder`` is Pillow's :func:`~datacache.decode.decode_image` unless a backend (DALI) is given."""
    if isinstance(data, BaseException):
        return Filled(reason=read_failure_reason(data))
    try:
        pixels = (decode_image if decoder is None else decoder)(data, variant, name=rel)
    except DecodeError as e:
        complete = size >= 0 and len(data) == size
        return Filled(reason=f"cannot decode: {e.reason}", remember=complete and not e.transient)
    rec = encode_record(pixels, label, variant, key=key)
    if variant.encoding != "raw":
        # serve exactly what a later hit will serve (the re-encoded pixels)
        decoded = decode_record(rec, key)
        pixels = decoded[0] if decoded is not None else pixels
    return Filled(record=rec, pixels=pixels)
