"""The miss path for one sample: source bytes -> decoded variant -> record, or a classified failure.

Used by :class:`datacache.readthrough.ReadThrough` (so by ``CachedImageNet``, ``datacache warm`` and
the daemon's decode pool alike), so one rule decides what is remembered as bad:

* a **read failure** (unreadable, missing, I/O error, or bytes whose length differs from the
  manifest's size) is *transient*: the sample is skipped for this run, never remembered;
* an **out-of-memory** decode is transient too;
* only a **decode failure of complete bytes** (length equal to the manifest's size) is
  remembered, keyed by the file's identity (:mod:`datacache.quarantine`).

The decoder must belong to the variant's decoder family (:attr:`~datacache.config.Variant.decoder_family`):
a key holds the pixels of exactly one family, so a mismatch (a DALI decoder asked to fill a ``pil``
variant, pillow-simd filling ``pil``, no DALI decoder for a ``dali`` variant) is a
:class:`~datacache.config.ConfigError` naming the fix, raised before anything is decoded or written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from datacache.config import ConfigError, Variant
from datacache.decode import DecodeError, decode_image, pil_family
from datacache.quarantine import read_failure_reason
from datacache.record import CHANNELS, RecordKey, decode_record, encode_record, shape_fits_variant


@dataclass
class Filled:
    """Outcome of :func:`fill_one`: a record and its pixels, or a reason (and whether to remember it)."""

    record: bytes | None = None
    pixels: np.ndarray | None = None
    reason: str = ""
    remember: bool = False


class DecoderUnavailable(RuntimeError):
    """A decode backend cannot run in this process (its pipeline could not be built, or stopped working):
    it makes no pixels of its family here, and the caller must not store another decoder's pixels under
    its keys. ``reason`` is a fixed sentence naming the backend and device, never file bytes."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across pool processes
        return (DecoderUnavailable, (self.reason,))


Decoder = Callable[..., np.ndarray]  # decode_image's signature: (data, variant, *, name) -> HWC uint8


def decoder_family(decoder: Decoder | None) -> str:
    """Family of the pixels ``decoder`` makes: Pillow's (:func:`~datacache.decode.pil_family`) for None,
    else the backend's ``family`` attribute (a backend without one is refused)."""
    if decoder is None:
        return pil_family()
    fam = getattr(decoder, "family", None)
    if not isinstance(fam, str):
        raise ConfigError(f"decoder {decoder!r} has no 'family' attribute: a decode backend must say which "
                          "decoder family (Variant.decoder_family) its pixels belong to")
    return fam


def check_family(variant: Variant, decoder: Decoder | None) -> None:
    """Raise :class:`ConfigError` unless ``decoder`` makes pixels of ``variant.decoder_family``."""
    fam = decoder_family(decoder)
    if fam == variant.decoder_family:
        return
    if variant.decoder_family.startswith("dali"):
        fix = ("samples of this family are filled by a daemon with decoder = \"dali\": let it fill them "
               "first (CachedImageNet.wait_warm()), or pass a DALI decoder of that family to fill")
    elif fam.startswith("dali"):
        fix = (f"use Variant(decoder_family={fam!r}) for what this DALI decoder fills (its own keys), or "
               "decode with Pillow")
    else:
        fix = (f"this process's PIL is {fam!r}; use Variant(decoder_family={fam!r}) (own keys) or install "
               "the PIL of the variant's family")
    raise ConfigError(f"variant {variant.tag()} holds {variant.decoder_family!r} pixels but the decoder here "
                      f"makes {fam!r} pixels, which differ: {fix}")


def fill_one(data: bytes | BaseException, *, rel: str, size: int, label: int, key: bytes,
             variant: Variant, decoder: Decoder | None = None, record_key: RecordKey | None = None) -> Filled:
    """Decode ``data`` (or classify the read error it is) into the record stored under ``key`` (MAC'd with
    ``record_key`` when given: every encode path passes the reader's key).
    ``decoder`` is Pillow's :func:`~datacache.decode.decode_image` unless a backend (DALI) is given; it
    must make pixels of ``variant.decoder_family`` (:func:`check_family`, module docstring).

    Reasons carry the exception's type and a fixed message, never its text (it may quote file bytes);
    a :class:`DecoderUnavailable` backend leaves the sample unfilled (never decoded by another decoder);
    an exception other than :class:`~datacache.decode.DecodeError` from a decoder is a failure for this
    run (not remembered: it may be the decoder's fault, not the file's), never an exception here."""
    check_family(variant, decoder)
    if isinstance(data, BaseException):
        return Filled(reason=read_failure_reason(data))
    try:
        pixels = (decode_image if decoder is None else decoder)(data, variant, name=rel)
    except DecodeError as e:
        complete = size >= 0 and len(data) == size
        return Filled(reason=f"cannot decode: {e.reason}", remember=complete and not e.transient)
    except DecoderUnavailable as e:  # the backend, not the file: nothing written, nothing remembered
        return Filled(reason=f"decoder unavailable: {e.reason} (not remembered; retried in a later pass)")
    except Exception as e:  # a decoder bug or an error type decode_image does not classify
        return Filled(reason=f"cannot decode: unexpected {type(e).__name__} in the decoder (not remembered; "
                      "retried in a later run)")
    shape = getattr(pixels, "shape", ())
    if (getattr(pixels, "dtype", None) != np.uint8 or len(shape) != 3 or shape[2] != CHANNELS
            or not shape_fits_variant(int(shape[0]), int(shape[1]), variant)):
        # a record of another geometry would be a miss for every reader (decode_record checks it)
        return Filled(reason=f"cannot decode: the decoder made a {'x'.join(map(str, shape)) or '?'} "
                      "array, not the variant's RGB geometry (a decoder bug; not remembered)")
    rec = encode_record(pixels, label, variant, key=key, record_key=record_key)
    if variant.encoding != "raw":
        # serve exactly what a later hit will serve (the re-encoded pixels)
        decoded = decode_record(rec, key, variant, record_key=record_key)
        pixels = decoded[0] if decoded is not None else pixels
    return Filled(record=rec, pixels=pixels)
