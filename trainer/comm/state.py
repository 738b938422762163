"""``HookState``: the run state of the DDP comm hooks (one per DDP model).

Holds the :class:`~trainer.comm.comm_config.CommConfig`, the topology (process groups), the
error-feedback residuals, the host-side counters (step, epoch, skipped steps, method switches)
and the current step's verdict flags. Config is frozen; everything here changes as training runs.

Flags: each bucket's global "skip this step" verdict is a device tensor recorded by the hook
(possibly on a comm thread). Nothing reads them inside a hook; :meth:`HookState.step_flag`
combines them on the device (no sync) and :meth:`HookState.step_was_skipped` reads the result:
THE one host read of a step, done by ``maybe_step`` after backward.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from trainer.comm.comm_config import CommConfig
from trainer.comm.comm_thread import CommThread
from trainer.comm.error_feedback import ErrorFeedback, bucket_key
from trainer.comm.timing import PhaseTimer
from trainer.comm.topology import Topology

log = logging.getLogger(__name__)


class StepFlags:
    """Thread-safe list of this step's device verdicts (0-d bool tensors)."""

    def __init__(self) -> None:
        self._flags: list[Tensor] = []
        self._lock = threading.Lock()

    def add(self, bad: Tensor) -> None:
        with self._lock:
            self._flags.append(bad.reshape(()).to(torch.bool))

    def combined(self) -> Tensor | None:
        """Any flag set (0-d bool on the first flag's device), or None if no bucket was checked.
        No host sync: the reduction is enqueued on the device."""
        with self._lock:
            flags = list(self._flags)
        if not flags:
            return None
        dev = flags[0].device
        return torch.stack([f.to(dev) for f in flags]).any()

    def clear(self) -> None:
        with self._lock:
            self._flags.clear()


@dataclass
class HookState:
    """Run state shared by the hooks of one DDP model; pass it to ``register`` (or let
    ``register(ddp, CommConfig(...))`` build it). ``timer``: optional ``PhaseTimer`` (on CUDA it
    synchronises at phase edges: benchmarks only)."""

    config: CommConfig = field(default_factory=CommConfig)
    timer: PhaseTimer | None = None
    topo: Topology | None = None
    ef: ErrorFeedback = field(default_factory=ErrorFeedback)
    step: int = 0
    epoch: int = 0
    skipped_steps: int = 0
    switches: int = 0
    active_method: str | None = None
    # The loss scale of the backward in progress (fp16 AMP: the GradScaler's scale tensor, on the
    # device; None without loss scaling). Set by the training loop before backward; the hooks
    # keep error-feedback residuals unscaled with it (see trainer.comm.error_feedback).
    grad_scale: Tensor | None = field(default=None, repr=False)
    flags: StepFlags = field(default_factory=StepFlags, repr=False)
    fresh: bool = field(default=True, repr=False)  # no step finished since register()
    # overlap="auto": the DDP mode in force ("none" or "async"), set between steps by the OverlapTuner
    overlap_mode: str | None = None
    _comm: CommThread | None = field(default=None, repr=False)
    _param_names: dict[int, str] = field(default_factory=dict, repr=False)
    _warned_names: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, CommConfig):
            raise ValueError(f"HookState.config must be a CommConfig, got {type(self.config).__name__}")

    # ---- communication thread (overlap="async") --------------------------------------
    @property
    def overlap(self) -> str:
        """The overlap mode in force: the config's, or for ``"auto"`` the one
        :class:`~trainer.comm.overlap_auto.OverlapTuner` set (``"none"`` until it does)."""
        if self.config.overlap == "auto":
            return self.overlap_mode or "none"
        return self.config.overlap

    def comm_thread(self) -> CommThread | None:
        """The communication thread while the mode in force is ``"async"`` (made on first use), else None."""
        if self.overlap != "async":
            return None
        if self._comm is None:
            self._comm = CommThread()
        return self._comm

    def close(self) -> None:
        """Stop the communication thread, if any (after its queued work); safe to call twice."""
        if self._comm is not None:
            self._comm.close()

    # ---- topology / names -------------------------------------------------------------
    def ensure_topology(self) -> Topology:
        """The topology, built on first use. COLLECTIVE (process groups, a layout check):
        ``register`` builds it on every rank in the same order."""
        if self.topo is None:
            self.topo = Topology.from_env()
        return self.topo

    def set_param_names(self, model: nn.Module) -> None:
        """Remember parameter names (stable residual keys across DDP bucket rebuilds)."""
        self._param_names = {id(p): name for name, p in model.named_parameters()}

    def key_for(self, bucket: Any) -> str:
        """Stable residual key of a ``dist.GradBucket`` (from its parameters' names)."""
        if not self._param_names and not self._warned_names:
            log.warning("HookState has no parameter names: residual keys fall back to shapes; "
                        "use trainer.comm.register(ddp_model, state) to register the hook")
            self._warned_names = True
        return bucket_key(bucket.parameters(), self._param_names)

    # ---- step bookkeeping --------------------------------------------------------------
    def step_flag(self) -> Tensor | None:
        """This step's verdict over every bucket and rank: 0-d bool device tensor (no sync), or
        None when no bucket was checked."""
        return self.flags.combined()

    def step_was_skipped(self) -> bool:
        """True if any bucket of the current step was non-finite (or overflowed fp16) on any rank.

        HOST SYNC: the one read of the step; call it (or ``maybe_step``) after ``backward()``,
        never inside a hook.
        """
        flag = self.step_flag()
        return False if flag is None else bool(flag.item())

    def finish_step(self, skipped: bool | None = None) -> bool:
        """End the step: count a skip (once), prune residuals of vanished buckets, advance
        ``step``. ``skipped=None`` reads the flags (:meth:`step_was_skipped`, a host sync);
        ``maybe_step`` passes the value it already knows. Returns whether it was skipped."""
        if skipped is None:
            skipped = self.step_was_skipped()
        self.flags.clear()
        if skipped:
            self.skipped_steps += 1
            log.warning("non-finite gradient (or fp16 overflow) on some rank: step %d skipped on every "
                        "rank (%d skipped so far)", self.step, self.skipped_steps)
        self.ef.prune_unused(keep_all=self.fresh)  # first-layout keys say nothing: keep everything
        self.fresh = False
        self.step += 1
        return skipped

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Per-rank checkpoint of counters and residuals (``torch.load(weights_only=True)`` reads it)."""
        return {"step": self.step, "epoch": self.epoch, "skipped_steps": self.skipped_steps,
                "ef": self.ef.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.skipped_steps = int(state["skipped_steps"])
        self.ef.load_state_dict(state["ef"], self.topo)
