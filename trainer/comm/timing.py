"""PhaseTimer: wall-clock seconds per communication phase (select / communicate / decompress).

Used by the algorithms (when a timer is passed) and by ``bench/comm.py`` to produce a time
breakdown like Fig. 8 of Shi et al. A phase that runs asynchronously (an ``async_op`` handle
waited later) is charged where the waiting happens.

HAZARD (host/device sync): CUDA kernels are asynchronous, so an honest per-phase time on a
GPU needs ``torch.cuda.synchronize()`` at every phase edge. The timer does this ONLY when it
is enabled and ``cuda_sync`` is true; those syncs serialise the GPU with the host and slow
the step, so never leave an enabled timer in production training (pass ``timer=None``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trainer.comm.names import PHASES


class PhaseTimer:
    """Accumulates seconds and call counts per phase name."""

    def __init__(self, enabled: bool = True, cuda_sync: bool | None = None) -> None:
        self.enabled = enabled
        # Default: synchronise only when a GPU is actually in use by this process.
        self.cuda_sync = (torch.cuda.is_available() and torch.cuda.is_initialized()) \
            if cuda_sync is None else cuda_sync
        self._totals: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def _sync(self) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()  # HAZARD: host/device sync, only while timing is enabled

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the wall time of the ``with`` body to ``name`` (no-op when disabled)."""
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._totals[name] += time.perf_counter() - t0
            self._counts[name] += 1

    def totals(self) -> dict[str, float]:
        """Seconds per phase (the three standard phases always present)."""
        out = {p: 0.0 for p in PHASES}
        out.update(self._totals)
        return out

    def counts(self) -> dict[str, int]:
        """How many times each phase was entered."""
        return dict(self._counts)

    def reset(self) -> None:
        self._totals.clear()
        self._counts.clear()


@contextmanager
def maybe_phase(timer: PhaseTimer | None, name: str) -> Iterator[None]:
    """``timer.phase(name)`` when a timer is given, else nothing."""
    if timer is None:
        yield
    else:
        with timer.phase(name):
            yield
