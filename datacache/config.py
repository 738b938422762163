"""Typed configuration for the data path: the *variant* and default locations.

A :class:`Variant` is the preprocessing spec that fully determines the pixels stored in
the cache (shorter side, cap on the longer side, resample filter, record encoding). It is
part of every cache key (:meth:`Variant.tag`), so changing any field can never serve
samples made with another spec. Training resolution and augmentation are *not* part of it:
one variant serves progressive resizing and every sweep run.

Defaults: short side 160 (decoded uint8 ImageNet at 160 px is ~98 GB; 224 px would be
~193 GB), longer side capped at 2x the short side so panoramas stay bounded, bilinear
resampling (with Pillow's antialiasing support when shrinking: close to "area" quality at a
fraction of lanczos' cost), raw pixels, decoded by stock Pillow (``decoder_family="pil"``;
``"dali"`` / ``"dali-gpu"`` name the samples a DALI-decoding daemon fills, ``"pil-simd"`` those of a
pillow-simd install). ``encoding="jpeg"`` re-encodes the resized sample as JPEG (quality
``jpeg_quality``), ~7x smaller, for clusters whose memory cannot hold raw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from datacache.options import ConfigError, choice

__all__ = ["ConfigError", "Variant", "default_cache_url", "default_t1_dir", "user_cache_dir"]

RESAMPLE_CHOICES = ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos")
ENCODING_CHOICES = ("raw", "jpeg")
# Which decoder + resize implementation made the pixels. Implementations that do not reproduce each
# other byte for byte are separate families, so their samples never share a key
# (docs/internals.md "Decoding").
DECODER_FAMILY_CHOICES = ("pil", "pil-simd", "dali", "dali-gpu")


@dataclass(frozen=True)
class Variant:
    """Preprocessing spec of the cached pixels (see the module docstring)."""

    short_side: int = 160
    max_long_side: int | None = None  # None -> 2 * short_side
    resample: str = "bilinear"
    encoding: str = "raw"
    jpeg_quality: int = 90
    decoder_family: str = "pil"

    def __post_init__(self) -> None:
        if not isinstance(self.short_side, int) or isinstance(self.short_side, bool) or self.short_side < 1:
            raise ConfigError(f"Variant.short_side must be a positive int, got {self.short_side!r}")
        if self.max_long_side is not None and (
            not isinstance(self.max_long_side, int) or self.max_long_side < self.short_side
        ):
            raise ConfigError(
                f"Variant.max_long_side must be None (= 2 * short_side) or an int >= short_side "
                f"({self.short_side}), got {self.max_long_side!r}"
            )
        choice("Variant.resample", self.resample, RESAMPLE_CHOICES)
        choice("Variant.encoding", self.encoding, ENCODING_CHOICES)
        if not isinstance(self.jpeg_quality, int) or not 1 <= self.jpeg_quality <= 100:
            raise ConfigError(f"Variant.jpeg_quality must be an int in 1..100, got {self.jpeg_quality!r}")
        choice("Variant.decoder_family", self.decoder_family, DECODER_FAMILY_CHOICES)

    @property
    def long_cap(self) -> int:
        """Effective cap on the longer side."""
        return self.max_long_side if self.max_long_side is not None else 2 * self.short_side

    def tag(self) -> str:
        """Short stable string naming this variant inside cache keys, e.g. ``s160m320bilinear-raw``.

        The JPEG quality is part of the tag only for the jpeg encoding (``...-jpeg90``). The decoder
        family is part of it unless it is the default ``pil`` (``s160m320bilinear-raw-dali``), so samples
        of different decoder families never share a key.
        """
        enc = self.encoding if self.encoding == "raw" else f"{self.encoding}{self.jpeg_quality}"
        fam = "" if self.decoder_family == "pil" else f"-{self.decoder_family}"
        return f"s{self.short_side}m{self.long_cap}{self.resample}-{enc}{fam}"


def user_cache_dir() -> str:
    """``$XDG_CACHE_HOME`` or ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(base)


def default_cache_url() -> str:
    """Default T2 store: ``lmdb://<user cache dir>/datacache/lmdb``."""
    return "lmdb://" + os.path.join(user_cache_dir(), "datacache", "lmdb")


def default_t1_dir() -> str:
    """Default T1 (raw bytes) cache directory: ``<user cache dir>/datacache/t1``."""
    return os.path.join(user_cache_dir(), "datacache", "t1")
