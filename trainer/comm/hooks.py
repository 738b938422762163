"""DDP communication hooks for dense all-reduce, NaiveAG, 2D-Torus and HiTopKComm.

One line::

    state = HookState(method="hitopk", selector="mstopk", density=0.01)
    register(ddp_model, state)                 # or: ddp = wrap(model, state, bucket_cap_mb=25)
    ...
    loss.backward()
    maybe_step(optimizer, state)               # optimizer.step() unless the step was skipped

Every hook returns the bucket's gradient SUM divided by the world size (DDP's averaging).

NaN/inf policy (``nan_check``): a non-finite value on ANY rank makes EVERY rank return a zero
gradient for that bucket and mark the step as skipped; ``maybe_step`` then does not call
``optimizer.step()`` (zero grads would still move weights through momentum / weight decay),
counts the skip in ``state.skipped_steps`` and keeps the error-feedback residuals unchanged.
How the ranks agree without extra round trips:

* dense / torus: check AFTER the reduction. A NaN/inf in any rank's input propagates into the
  reduced sum that every rank receives, so all ranks reach the same verdict from the same data.
* naive_ag / hitopk: the top-k may not pick a NaN, so the verdict travels explicitly: one fp32
  flag inside the packed all-gather packet (4 bytes, no extra message); HiTopK adds a 1-element
  intra-node all-reduce before decompressing (see hitopk.py). The verdict zeroes the small
  gathered values, so no dense masking pass over the bucket is needed.

Buffers: every method writes its result into the bucket buffer the hook owns (``inplace=True``):
no output allocation and, for torus / HiTopK, the final all-gather lands directly in the bucket.

The flags stay on the device; ``state.finish_step()`` (called by ``maybe_step``) reads them:
THAT is the one host sync per step, outside the hooks.
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.comm.allreduce import allreduce_dense
from trainer.comm.error_feedback import ErrorFeedback, bucket_key
from trainer.comm.hitopk import FINAL_GATHER_CHOICES, hitopk_ex
from trainer.comm.naive_ag import naive_ag_ex
from trainer.comm.selectors import SELECTOR_CHOICES
from trainer.comm.switch import METHOD_CHOICES, MethodSchedule
from trainer.comm.timing import PhaseTimer
from trainer.comm.topology import Topology
from trainer.comm.torus import torus_allreduce

log = logging.getLogger(__name__)

SPARSE_METHODS = ("naive_ag", "hitopk")


@dataclass
class HookState:
    """Options and per-run state shared by the hooks (one per DDP model).

    method: one of ``METHOD_CHOICES``; selector: one of ``SELECTOR_CHOICES``; density: fraction
    of a bucket sent by the sparse methods, in (0, 1]; fp16: float16 values on the wire;
    error_feedback: keep residuals of what top-k did not send; nan_check: see module doc;
    min_numel_for_sparse: buckets smaller than this go dense (all-reduce) because a sparse
    packet of a tiny bucket saves nothing and top-k has a fixed cost; partition_numel: HiTopK
    pipelining piece size in bucket elements (0 = off); final_gather: HiTopK's last intra-node
    step, "dense" chunks, "sparse" pairs (eq. 10) or "auto" (see hitopk.choose_final_gather);
    schedule: optional ``MethodSchedule`` (then ``method`` is ignored and
    :func:`~trainer.comm.switch.switch_hook` is used);
    timer: optional ``PhaseTimer`` (adds device syncs on CUDA: benchmarks only);
    dense_first_step: reduce the first step after :func:`register` densely even for a sparse
    method (a "layout warm-up"): DDP rebuilds its buckets after its first iteration, so
    residuals keyed on the first layout would be orphaned. That step neither creates, flushes
    nor prunes residuals, so residuals loaded from a checkpoint wait for the rebuilt layout.
    """

    method: str = "allreduce"
    selector: str = "mstopk"
    density: float = 0.01
    fp16: bool = False
    error_feedback: bool = True
    nan_check: bool = True
    min_numel_for_sparse: int = 4096
    partition_numel: int = 0
    final_gather: str = "auto"
    dense_first_step: bool = True
    schedule: MethodSchedule | None = None
    timer: PhaseTimer | None = None
    topo: Topology | None = None
    ef: ErrorFeedback = field(default_factory=ErrorFeedback)
    param_names: dict[int, str] = field(default_factory=dict)
    step: int = 0
    epoch: int = 0
    skipped_steps: int = 0
    switches: int = 0
    active_method: str | None = None
    _flags: list[Tensor] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _warned_names: bool = field(default=False, repr=False)
    _fresh: bool = field(default=True, repr=False)  # no step finished since register()

    def __post_init__(self) -> None:
        if self.method not in METHOD_CHOICES:
            raise ValueError(f"HookState.method={self.method!r}; choose one of {', '.join(METHOD_CHOICES)}")
        if self.selector not in SELECTOR_CHOICES:
            raise ValueError(f"HookState.selector={self.selector!r}; "
                             f"choose one of {', '.join(SELECTOR_CHOICES)}")
        if not (0.0 < float(self.density) <= 1.0):
            raise ValueError(f"HookState.density={self.density!r}; must be in (0, 1], e.g. 0.01 for 1 %")
        if self.final_gather not in FINAL_GATHER_CHOICES:
            raise ValueError(f"HookState.final_gather={self.final_gather!r}; "
                             f"choose one of {', '.join(FINAL_GATHER_CHOICES)}")
        if self.min_numel_for_sparse < 0 or self.partition_numel < 0:
            raise ValueError("HookState.min_numel_for_sparse and partition_numel must be >= 0")
        if self.schedule is not None and not isinstance(self.schedule, MethodSchedule):
            raise ValueError("HookState.schedule must be a trainer.comm.switch.MethodSchedule or None")

    # ---- topology / names -------------------------------------------------------------
    def ensure_topology(self) -> Topology:
        """The topology, built on first use. COLLECTIVE (new_group): every rank's first bucket
        reaches this point in the same order, but prefer building it in :func:`register`."""
        if self.topo is None:
            self.topo = Topology.from_env()
        return self.topo

    def set_param_names(self, model: nn.Module) -> None:
        """Remember parameter names (stable residual keys across DDP bucket rebuilds)."""
        self.param_names = {id(p): name for name, p in model.named_parameters()}

    def key_for(self, bucket: Any) -> str:
        if not self.param_names and not self._warned_names:
            log.warning("HookState has no parameter names: residual keys fall back to shapes; "
                        "use trainer.comm.hooks.register(ddp_model, state) to register the hook")
            self._warned_names = True
        return bucket_key(bucket.parameters(), self.param_names)

    # ---- step bookkeeping --------------------------------------------------------------
    def note_flag(self, bad: Tensor) -> None:
        """Record a bucket's global non-finite verdict (device tensor; may run on a comm thread)."""
        with self._lock:
            self._flags.append(bad.reshape(()))

    def step_was_skipped(self) -> bool:
        """True if any bucket of the current step was non-finite on any rank.

        HOST SYNC: reads the device flags. This is the ONE sync per step; call it (or
        :meth:`finish_step` / :func:`maybe_step`) after ``backward()``, never inside a hook.
        """
        with self._lock:
            flags = list(self._flags)
        if not flags:
            return False
        # Reduce on the device first: one device->host read for all buckets (moving each flag
        # to the CPU separately would be one sync per bucket).
        return bool(torch.stack([f.to(torch.bool) for f in flags]).any().item())

    def finish_step(self) -> bool:
        """End the step: returns whether it was skipped, counts skips, advances ``step``."""
        skipped = self.step_was_skipped()
        with self._lock:
            self._flags.clear()
        if skipped:
            self.skipped_steps += 1
            log.warning("non-finite gradient on some rank: step %d skipped on every rank "
                        "(%d skipped so far)", self.step, self.skipped_steps)
        if self._fresh:
            self.ef.prune_unused(keep_all=True)  # first-layout keys say nothing: keep everything
        else:
            self.ef.prune_unused()
        self._fresh = False
        self.step += 1
        return skipped

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Per-rank checkpoint of counters and residuals (weights_only-loadable)."""
        return {"step": self.step, "epoch": self.epoch, "skipped_steps": self.skipped_steps,
                "ef": self.ef.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.skipped_steps = int(state["skipped_steps"])
        self.ef.load_state_dict(state["ef"], self.topo)


def _done(t: Tensor) -> torch.futures.Future[Tensor]:
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def _finish_dense(state: HookState, out: Tensor, world: int) -> Tensor:
    if state.nan_check:
        # Check after the reduction: every rank holds the same reduced data -> same verdict.
        bad = ~torch.isfinite(out.sum())
        out.masked_fill_(bad, 0.0)
        state.note_flag(bad)
    return out.div_(world)


def run_method(state: HookState, bucket: Any, method: str) -> torch.futures.Future[Tensor]:
    """Run ``method`` on ``bucket`` (a ``dist.GradBucket``) and return DDP's future."""
    topo = state.ensure_topology()
    flat: Tensor = bucket.buffer()
    world = topo.world_size
    warmup = state.dense_first_step and state._fresh
    sparse = method in SPARSE_METHODS and flat.numel() >= state.min_numel_for_sparse and not warmup
    if sparse:
        key = state.key_for(bucket)
        residual = (state.ef.residual(key, method=method, numel=flat.numel(), topo=topo, device=flat.device)
                    if state.error_feedback else None)
        # inplace: the hook owns the bucket buffer, so the result is built inside it (no copy).
        common = dict(density=state.density, selector=state.selector, residual=residual, fp16=state.fp16,
                      timer=state.timer, check_finite=state.nan_check, inplace=True)
        if method == "hitopk":
            out, bad = hitopk_ex(flat, topo, partition_numel=state.partition_numel,
                                 final_gather=state.final_gather, **common)
        else:
            out, bad = naive_ag_ex(flat, topo, **common)
        if bad is not None:
            state.note_flag(bad)
        return _done(out.div_(world))
    if state.error_feedback and state.ef and not warmup:
        # Switched from a sparse method (or a bucket fell under the size threshold): hand the
        # held-back residual to this dense reduction so it is not lost.
        state.ef.flush_into(state.key_for(bucket), flat, topo)
    if method == "torus":
        out = torus_allreduce(flat, topo, timer=state.timer, fp16=state.fp16, inplace=True)
        return _done(_finish_dense(state, out, world))
    if state.fp16 or state.timer is not None or not dist.is_initialized():
        out = allreduce_dense(flat, topo, timer=state.timer, fp16=state.fp16, inplace=True)
        return _done(_finish_dense(state, out, world))
    # Plain dense all-reduce stays asynchronous so DDP overlaps it with the rest of backward;
    # the callback runs on the backend's thread when the reduction completes.
    fut = dist.all_reduce(flat, async_op=True).get_future()
    return fut.then(lambda f: _finish_dense(state, f.value()[0], world))


# Hook signatures use the real objects as annotations (no `from __future__ import annotations`
# in this file): DDP's register_comm_hook compares them with dist.GradBucket / Future[Tensor].
def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Dense all-reduce (baseline)."""
    return run_method(state, bucket, "allreduce")


def naive_ag_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k per rank + one packed all-gather over the world (NaiveAG)."""
    return run_method(state, bucket, "naive_ag")


def torus_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """2D-Torus all-reduce."""
    return run_method(state, bucket, "torus")


def hitopk_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """HiTopKComm (Algorithm 2 of Shi et al.)."""
    return run_method(state, bucket, "hitopk")


HOOKS: dict[str, Callable[[HookState, Any], torch.futures.Future[Tensor]]] = {
    "allreduce": allreduce_hook, "naive_ag": naive_ag_hook, "torus": torus_hook, "hitopk": hitopk_hook}


def make_hook(state: HookState) -> Callable[[HookState, Any], torch.futures.Future[Tensor]]:
    """The hook for ``state``: the switching hook when a schedule is set, else ``state.method``'s."""
    if state.schedule is not None:
        from trainer.comm.switch import switch_hook

        return switch_hook
    return HOOKS[state.method]


def register(ddp_model: nn.parallel.DistributedDataParallel, state: HookState) -> HookState:
    """Register the hook for ``state`` on ``ddp_model``. COLLECTIVE: call on every rank.

    Builds the topology (process groups) now, on every rank in the same order, and the
    parameter-name map used for stable residual keys.
    """
    state.set_param_names(ddp_model.module)
    state._fresh = True  # a new DDP starts with its first-iteration bucket layout
    state.ensure_topology()
    ddp_model.register_comm_hook(state, make_hook(state))
    return state


def wrap(model: nn.Module, state: HookState, *, bucket_cap_mb: float = 25.0,
         **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model, bucket_cap_mb=...)`` with the hook registered.

    ``bucket_cap_mb`` is DDP's tensor-fusion size (the Perseus/Horovod "fusion buffer"):
    bigger buckets mean fewer, larger messages and a larger top-k per call.
    """
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    register(ddp, state)
    return ddp


def maybe_step(optimizer: torch.optim.Optimizer, state: HookState) -> bool:
    """``optimizer.step()`` unless the step was skipped for non-finite gradients.

    Returns True when the optimizer stepped. Contains the step's one host sync (reading the
    non-finite flags); call it once per iteration after ``backward()``.
    """
    skipped = state.finish_step()
    if not skipped:
        optimizer.step()
    return not skipped
