"""DDP communication hooks for dense all-reduce, 2D-Torus, NaiveAG and HiTopKComm.

One line::

    state = register(ddp_model, CommConfig(method="hitopk", selector="mstopk", density=0.01))
    ...
    loss.backward()
    maybe_step(optimizer, state)               # optimizer.step() unless the step was skipped

Every hook returns the bucket's gradient SUM divided by the world size (DDP's averaging). The
division happens first (before any fp16 cast or selection), so residuals are in averaged units.

Skipping a step (``nan_check``; always for fp16 overflow): a non-finite value on ANY rank makes
EVERY rank return a zero gradient for that bucket and mark the step as skipped; ``maybe_step``
then does not step the optimizer (zero grads would still move weights through momentum / weight
decay), counts the skip once and keeps the error-feedback residuals unchanged. How the ranks
agree without extra round trips:

* dense / torus: check AFTER the reduction. A NaN/inf in any rank's input, or an fp16 overflow,
  propagates into the reduced sum every rank receives: same data, same verdict.
* naive_ag / hitopk: the verdict travels explicitly, one fp32 flag inside the packed all-gather
  packet (see naive_ag.py, hitopk.py); it zeroes the small gathered values, no dense pass.

No rank raises alone inside a collective section: the selectors never raise on values (NaN/inf
are selected like the largest magnitudes), and every check that can raise (sizes, options)
depends only on what all ranks share. With ``nan_check=False`` a NaN therefore reaches every
rank's gradient alike instead of hanging the others.

Overlap (``CommConfig(overlap="async")``): the hook decides on the backward thread (method, fp16 wire,
warm-up, residual key) and the reduction runs on the state's communication thread, in bucket order,
with exactly the code below (trainer/comm/comm_thread.py); "none" runs it here.

Host/device syncs: none inside the hooks on CUDA with the ``mstopk`` or ``exact`` selector
(``dgc`` syncs by design). The verdict flags stay on the device; ``maybe_step`` reads them once
per step, after backward.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.comm.allreduce import allreduce_dense
from trainer.comm.comm_config import CommConfig
from trainer.comm.fp16 import checks_finite, wire_fp16
from trainer.comm.hitopk import hitopk_ex
from trainer.comm.naive_ag import naive_ag_ex
from trainer.comm.names import SPARSE_METHODS
from trainer.comm.state import HookState
from trainer.comm.torus import torus_allreduce

log = logging.getLogger(__name__)


def _done(t: Tensor) -> torch.futures.Future[Tensor]:
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def _finish_dense(state: HookState, out: Tensor, check: bool) -> Tensor:
    if check:
        # Check after the reduction: every rank holds the same reduced data -> same verdict.
        bad = ~torch.isfinite(out.sum())
        out.masked_fill_(bad, 0.0)  # device-side: no host sync
        state.flags.add(bad)
    return out


@dataclass(frozen=True)
class _Plan:
    """What one bucket gets, decided on the backward thread (host values only: no sync)."""

    method: str
    sparse: bool
    fp16: bool  # read here: fp16_wrapper's context variable does not reach the comm thread
    check: bool
    key: str | None  # residual key (needs the GradBucket, which only lives during the hook call)


def _plan(state: HookState, bucket: Any, method: str, numel: int) -> _Plan:
    cfg = state.config
    fp16 = cfg.fp16 or wire_fp16()  # the config's switch, or an fp16_wrapper around this hook
    warmup = cfg.dense_first_step and state.fresh
    sparse = method in SPARSE_METHODS and numel >= cfg.min_numel_for_sparse and not warmup
    # A dense bucket needs its key only to flush a residual a sparse step left (see _reduce);
    # decided from host facts that do not change while the comm thread works on earlier buckets.
    may_hold_residual = bool(state.ef) or cfg.schedule is not None or cfg.method in SPARSE_METHODS
    needs_key = sparse or (cfg.error_feedback and not warmup and may_hold_residual)
    return _Plan(method, sparse, fp16, checks_finite(cfg.nan_check, fp16),
                 state.key_for(bucket) if needs_key else None)


def _reduce(state: HookState, plan: _Plan, flat: Tensor,
            blocking: bool) -> Tensor | torch.futures.Future[Tensor]:
    """The bucket's reduction: a tensor, or (plain dense, ``blocking=False``) the backend's future."""
    cfg = state.config
    topo = state.ensure_topology()
    world = topo.world_size
    fp16, check = plan.fp16, plan.check
    if plan.sparse:
        assert plan.key is not None
        residual = (state.ef.residual(plan.key, method=plan.method, numel=flat.numel(), topo=topo,
                                      device=flat.device)
                    if cfg.error_feedback else None)
        gscale = state.grad_scale if residual is not None else None
        if gscale is not None:
            # The residual is stored unscaled; the bucket is loss-scaled: bring it to this step's
            # units, and back after the update below (a power of two: exact, no host sync).
            gscale = gscale.to(device=residual.device, dtype=residual.dtype)
            residual.mul_(gscale)
        # inplace: the hook owns the bucket buffer, so the result is built inside it (no copy).
        common = dict(density=cfg.density, selector=cfg.selector, residual=residual, fp16=fp16,
                      timer=state.timer, check_finite=cfg.nan_check, inplace=True, divide_by=world)
        if plan.method == "hitopk":
            out, bad = hitopk_ex(flat, topo, partition_numel=cfg.partition_numel,
                                 final_gather=cfg.final_gather, **common)
        else:
            out, bad = naive_ag_ex(flat, topo, **common)
        if gscale is not None:
            residual.div_(gscale)
        if bad is not None:
            state.flags.add(bad)
        return out
    if plan.key is not None and state.ef:
        # Switched from a sparse method (or a bucket fell under the size threshold): hand the
        # held-back residual (averaged units) to this dense reduction so it is not lost.
        state.ef.flush_into(plan.key, flat, topo, scale=world, grad_scale=state.grad_scale)
    if plan.method == "torus":
        out = torus_allreduce(flat, topo, timer=state.timer, fp16=fp16, inplace=True, divide_by=world)
        return _finish_dense(state, out, check)
    if fp16 or state.timer is not None or not dist.is_initialized():
        out = allreduce_dense(flat, topo, timer=state.timer, fp16=fp16, inplace=True, divide_by=world)
        return _finish_dense(state, out, check)
    if blocking:  # on the comm thread: the same reduction, waited for there
        dist.all_reduce(flat)
        return _finish_dense(state, flat.div_(world), check)
    # Plain dense all-reduce stays asynchronous so DDP overlaps it with the rest of backward;
    # the callback runs on the backend's thread when the reduction completes.
    fut = dist.all_reduce(flat, async_op=True).get_future()
    return fut.then(lambda f: _finish_dense(state, f.value()[0].div_(world), check))


def run_method(state: HookState, bucket: Any, method: str) -> torch.futures.Future[Tensor]:
    """Run ``method`` on ``bucket`` (a ``dist.GradBucket``) and return DDP's future.

    ``overlap="async"``: the plan is made here, the reduction runs on the state's communication
    thread (:mod:`trainer.comm.comm_thread`), in bucket order, and the future completes there."""
    flat: Tensor = bucket.buffer()
    plan = _plan(state, bucket, method, flat.numel())
    comm = state.comm_thread()
    if comm is not None:
        return comm.submit(lambda: _reduce(state, plan, flat, blocking=True), flat)  # type: ignore[return-value]
    out = _reduce(state, plan, flat, blocking=False)
    return _done(out) if isinstance(out, Tensor) else out  # the backend's future (a torch._C.Future)


def _comm_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn.comm_hook = True  # type: ignore[attr-defined]  # fp16_wrapper accepts these
    return fn


# Hook signatures use the real objects as annotations (no `from __future__ import annotations`
# in this file): DDP's register_comm_hook compares them with dist.GradBucket / Future[Tensor].
@_comm_hook
def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Dense all-reduce (baseline)."""
    return run_method(state, bucket, "allreduce")


@_comm_hook
def naive_ag_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Top-k per rank + one packed all-gather over the world (NaiveAG)."""
    return run_method(state, bucket, "naive_ag")


@_comm_hook
def torus_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """2D-Torus all-reduce."""
    return run_method(state, bucket, "torus")


@_comm_hook
def hitopk_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """HiTopKComm (Algorithm 2 of Shi et al.)."""
    return run_method(state, bucket, "hitopk")


def current_method(state: HookState) -> str:
    """The method for the current step/epoch: the schedule's (a switch is logged and counted once) or the
    config's one method. Host counters only: no sync."""
    if state.config.schedule is None:
        return state.config.method
    method = state.config.method_at(state.step, state.epoch)
    if method != state.active_method:
        if state.active_method is not None:
            log.info("comm method switch: %s -> %s at step %d / epoch %d",
                     state.active_method, method, state.step, state.epoch)
            state.switches += 1
        state.active_method = method
    return method


@_comm_hook
def switch_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The method ``state.config.schedule`` selects for the current step/epoch (host counters: no sync)."""
    return run_method(state, bucket, current_method(state))


HOOKS: dict[str, Callable[[HookState, Any], torch.futures.Future[Tensor]]] = {
    "allreduce": allreduce_hook, "naive_ag": naive_ag_hook, "torus": torus_hook, "hitopk": hitopk_hook}


def make_hook(config: CommConfig) -> Callable[[HookState, Any], torch.futures.Future[Tensor]]:
    """The hook for ``config``: the switching hook when a schedule is set, else the method's.
    ``config.fp16`` needs no :func:`~trainer.comm.fp16.fp16_wrapper`: the hook reads it itself."""
    return switch_hook if config.schedule is not None else HOOKS[config.method]


def register(ddp_model: nn.parallel.DistributedDataParallel, state: HookState | CommConfig,
             hook: Callable[[HookState, Any], torch.futures.Future[Tensor]] | None = None) -> HookState:
    """Register the hook on ``ddp_model`` and return the run state. COLLECTIVE: call on every rank.

    ``state``: a ``HookState`` or just a ``CommConfig`` (a fresh ``HookState`` is made). ``hook``:
    defaults to :func:`make_hook` of the config. Builds the topology (process groups, layout
    check) now, on every rank in the same order, and the parameter-name map used for stable
    residual keys.
    """
    if isinstance(state, CommConfig):
        state = HookState(state)
    elif not isinstance(state, HookState):
        raise TypeError(f"register: expected a HookState or CommConfig, got {type(state).__name__}")
    if state.config.overlap == "cross":
        raise ValueError("register: overlap='cross' does not run inside DDP's hook; wrap the model in "
                         "trainer.comm.cross_barrier.CrossBarrier instead (or use overlap='async')")
    state.set_param_names(ddp_model.module)
    state.fresh = True  # a new DDP starts with its first-iteration bucket layout
    state.ensure_topology()
    ddp_model.register_comm_hook(state, hook or make_hook(state.config))
    return state


def wrap(model: nn.Module, state: HookState | CommConfig, *, bucket_cap_mb: float = 25.0,
         **ddp_kwargs: Any) -> tuple[nn.parallel.DistributedDataParallel, HookState]:
    """``DistributedDataParallel(model, bucket_cap_mb=...)`` with the hook registered: ``(ddp, state)``.

    ``bucket_cap_mb`` is DDP's tensor-fusion size (the Perseus/Horovod "fusion buffer"):
    bigger buckets mean fewer, larger messages and a larger top-k per call.
    """
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    return ddp, register(ddp, state)
