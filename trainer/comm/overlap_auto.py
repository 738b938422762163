"""``--overlap auto``: time the synchronous hooks against the communication thread on this job's first
steps and keep the faster one for the rest of the run.

Both DDP modes give the same parameters bit for bit (``tests/test_comm_overlap.py``), so the choice
changes only the time a step takes, never what the model learns, and a resumed run may choose again on
its new machines. It is measured rather than predicted because what decides it is the CPU backward and
the communication thread share, which no α-β term knows: on the 2-core emulated cluster the thread
paid for some methods and not for others, the plain dense all-reduce (which DDP already overlaps) least
(``bench/results/overlap.json``). ``--overlap cross`` replaces DDP itself and is chosen by name only.

Schedule, in step counts (the same on every rank): ``warmup`` steps synchronous (DDP's first-iteration
bucket rebuild, the dense first step, allocator warm-up), then ``blocks`` blocks of ``block`` steps
alternating none, async, none, async, ... Each rank keeps its median step time per mode; ONE all-reduce
(SUM, the default group) averages the medians over the ranks, so every rank takes the same decision at
the same step. Async wins only when at least ``margin`` faster (otherwise one thread fewer). A step is
timed from its forward to the end of the optimizer step (after the step's one host read, so the step's
communication is done), without the loader's wait.

HAZARDS: the mode changes only between steps, when DDP has waited for every bucket's future (the
communication thread is idle), and on every rank at the same step, so collectives keep one order
everywhere. The decision is a COLLECTIVE at a fixed step count: every rank must run the same number of
steps (the trainer's samplers give every rank the same number of batches).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.comm.cost_model import ASYNC_MARGIN, async_pays
from trainer.comm.state import HookState

log = logging.getLogger(__name__)
MODES: tuple[str, str] = ("none", "async")
MARGIN = ASYNC_MARGIN  # async must be this fraction faster to be kept (one thread fewer otherwise)


@dataclass(frozen=True)
class OverlapDecision:
    """What ``--overlap auto`` chose, and the measured medians (seconds, averaged over the ranks)."""

    mode: str
    none_s: float
    async_s: float
    steps_per_mode: int
    world: int
    margin: float

    def line(self) -> str:
        """One log line: the choice and why."""
        faster = self.none_s / self.async_s if self.async_s > 0 else float("inf")
        why = (f"async {faster:.2f}x the synchronous step" if self.mode == "async" else
               f"async {faster:.2f}x, under the {1 / (1 - self.margin):.2f}x that pays for its thread")
        return (f"--overlap auto: {self.mode} (median step {1e3 * self.none_s:.1f} ms synchronous vs "
                f"{1e3 * self.async_s:.1f} ms async, {self.steps_per_mode} steps each, mean over "
                f"{self.world} rank(s): {why}); kept for the rest of this run")


def decide(none_s: float, async_s: float, margin: float) -> str:
    """``"async"`` when its step is at least ``margin`` (a fraction) shorter than the synchronous one."""
    return "async" if async_pays(none_s, async_s, margin) else "none"


class OverlapTuner:
    """Drives ``state.overlap_mode`` for ``CommConfig(overlap="auto")`` (module docstring).

    Per training step: :meth:`before_step`, the step, :meth:`after_step`. ``clock``: seconds (tests)."""

    def __init__(self, state: HookState, *, device: torch.device, warmup: int = 3, block: int = 4,
                 blocks: int = 4, margin: float = MARGIN,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if state.config.overlap != "auto":
            raise ValueError(f"OverlapTuner needs CommConfig(overlap='auto'), got {state.config.overlap!r}")
        if warmup < 0 or block < 1 or blocks < 2 or blocks % 2 or not 0.0 <= margin < 1.0:
            raise ValueError(f"OverlapTuner: needs warmup >= 0, block >= 1, an even blocks >= 2 and "
                             f"0 <= margin < 1, got {warmup}, {block}, {blocks}, {margin}")
        self.state, self.device = state, device
        self.warmup, self.block, self.blocks, self.margin = warmup, block, blocks, margin
        self.clock = clock
        self.steps = 0
        self._t0 = 0.0
        self.times: dict[str, list[float]] = {m: [] for m in MODES}
        self.decision: OverlapDecision | None = None
        state.overlap_mode = "none"

    @property
    def measuring_steps(self) -> int:
        return self.warmup + self.block * self.blocks

    def _mode_at(self, step: int) -> str:
        i = step - self.warmup
        return "none" if i < 0 else MODES[(i // self.block) % 2]

    def before_step(self) -> None:
        """Set the mode of the step about to run (host only; between steps: the thread is idle)."""
        if self.decision is None:
            self.state.overlap_mode = self._mode_at(self.steps)
            self._t0 = self.clock()

    def after_step(self) -> OverlapDecision | None:
        """Time the step just run; at the last measuring step decide (COLLECTIVE) and return it."""
        if self.decision is not None:
            return None
        if self.device.type == "cuda":
            # HOST SYNC, only while measuring (19 steps by default): the step's kernels and collectives are
            # done, so both modes are timed to the same point.
            torch.cuda.synchronize(self.device)
        seconds = self.clock() - self._t0
        if self.steps >= self.warmup:
            self.times[self._mode_at(self.steps)].append(seconds)
        self.steps += 1
        if self.steps < self.measuring_steps:
            return None
        med = torch.tensor([statistics.median(self.times[m]) for m in MODES], dtype=torch.float64,
                           device=self.device if self.device.type == "cuda" else None)
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            dist.all_reduce(med)  # COLLECTIVE, at the same step on every rank (module docstring)
        none_s, async_s = (float(v) / world for v in med.tolist())  # HOST READ: once per run
        mode = decide(none_s, async_s, self.margin)
        self.state.overlap_mode = mode
        self.decision = OverlapDecision(mode, none_s, async_s, self.block * self.blocks // 2, world,
                                        self.margin)
        log.info("%s", self.decision.line())
        return self.decision
