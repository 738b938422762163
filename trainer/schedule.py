"""Schedules by epoch: batch size, resolution, comm method; and the per-step learning rate.

* :class:`EpochSchedule` -- ``(start_epoch, value)`` phases, written ``"0:96,13:128,24:224"`` on
  the command line (a single value ``"128"`` means one phase from epoch 0). Batch-size control
  (Mikami et al. 2018 §2.1: a predetermined schedule of growing global batch sizes) and
  progressive resizing (Shi et al. 2021 §5.6: 96 -> 128 -> 224 -> 288 px) are both one.
* :class:`LRSchedule` -- linear warm-up, then poly (Mikami: ``(1 - e/E)^2``) or cosine decay,
  evaluated at the fractional epoch ``epoch + step / steps_in_epoch`` (processed samples over
  dataset size), so it stays smooth when the batch size, and with it the number of steps per
  epoch, changes. With ``scaling="linear"`` the peak follows the current global batch
  (Goyal et al.: ``lr x batch / 256``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from datacache.config import ConfigError

T = TypeVar("T")

DECAY_CHOICES = ("poly", "cosine", "none")
LR_SCALING_CHOICES = ("none", "linear")


@dataclass(frozen=True)
class EpochSchedule(Generic[T]):
    """Piecewise-constant value by epoch: ``phases`` = ``((0, v0), (e1, v1), ...)``, starts strictly
    increasing from 0."""

    phases: tuple[tuple[int, T], ...]

    def __post_init__(self) -> None:
        phases = tuple((int(s), v) for s, v in self.phases)
        if not phases or phases[0][0] != 0:
            raise ConfigError(f"a schedule must start at epoch 0, got {self.text(phases)!r}")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(phases)):
            raise ConfigError(f"schedule epochs must increase strictly, got {self.text(phases)!r}")
        object.__setattr__(self, "phases", phases)

    @staticmethod
    def text(phases: Sequence[tuple[int, Any]]) -> str:
        return ",".join(f"{s}:{v}" for s, v in phases)

    def __str__(self) -> str:
        return self.text(self.phases)

    @classmethod
    def parse(cls, spec: str | int | EpochSchedule[T], convert: Callable[[str], T],
              what: str) -> EpochSchedule[T]:
        """``"96"`` or ``"0:96,13:128"`` -> schedule; ``convert`` turns each value (raising on a bad one)."""
        if isinstance(spec, EpochSchedule):
            return spec
        phases: list[tuple[int, T]] = []
        for part in str(spec).split(","):
            part = part.strip()
            start, sep, value = part.rpartition(":")
            try:
                epoch = int(start) if sep else 0
                phases.append((epoch, convert(value)))
            except (ValueError, ConfigError) as e:
                raise ConfigError(f"{what}: cannot read {part!r} of {spec!r} ({e}); expected VALUE or "
                                  f"EPOCH:VALUE[,EPOCH:VALUE...] such as 0:96,13:128") from None
        if len(phases) > 1 and not all(":" in p for p in str(spec).split(",")):
            raise ConfigError(f"{what}: every phase of {spec!r} needs an EPOCH: prefix (0:96,13:128)")
        try:
            return cls(tuple(phases))
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}") from None

    def at(self, epoch: int) -> T:
        current = self.phases[0][1]
        for start, value in self.phases:
            if epoch >= start:
                current = value
        return current


def positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise ValueError(f"{v} is not a positive integer")
    return v


@dataclass(frozen=True)
class LRSchedule:
    """Learning rate at a fractional epoch (see the module docstring)."""

    peak: float
    epochs: int
    warmup_epochs: float = 0.0
    warmup_start: float = 0.0   # fraction of the peak at epoch 0
    decay: str = "cosine"
    power: float = 2.0          # poly decay exponent
    scaling: str = "none"
    ref_batch: int = 256

    def __post_init__(self) -> None:
        if self.decay not in DECAY_CHOICES:
            raise ConfigError(f"lr decay={self.decay!r}; choose one of {', '.join(DECAY_CHOICES)}")
        if self.scaling not in LR_SCALING_CHOICES:
            raise ConfigError(f"lr scaling={self.scaling!r}; choose one of {', '.join(LR_SCALING_CHOICES)}")
        if not (self.peak > 0 and self.epochs >= 1 and 0 <= self.warmup_epochs <= self.epochs
                and 0 <= self.warmup_start <= 1 and self.power > 0 and self.ref_batch >= 1):
            raise ConfigError(f"invalid LR schedule {self}: need lr > 0, epochs >= 1, "
                              "0 <= warmup_epochs <= epochs, 0 <= warmup_start <= 1, power > 0")

    def peak_for(self, global_batch: int) -> float:
        return self.peak * global_batch / self.ref_batch if self.scaling == "linear" else self.peak

    def at(self, epoch_f: float, global_batch: int) -> float:
        """LR at fractional epoch ``epoch_f`` with the current global batch size."""
        peak = self.peak_for(global_batch)
        if epoch_f < self.warmup_epochs:
            return peak * (self.warmup_start + (1.0 - self.warmup_start) * epoch_f / self.warmup_epochs)
        span = self.epochs - self.warmup_epochs
        t = min(1.0, (epoch_f - self.warmup_epochs) / span) if span > 0 else 1.0
        if self.decay == "poly":
            return peak * (1.0 - t) ** self.power
        if self.decay == "cosine":
            return peak * 0.5 * (1.0 + math.cos(math.pi * t))
        return peak
