"""``CrossBarrier``: priority-scheduled communication across the iteration barrier (``--overlap cross``).

ByteScheduler (Peng et al., SOSP'19; the seeds' talk by Guo) on our methods, without DDP:

* **Pieces.** The parameters are cut into buckets ("pieces", ``piece_mb`` each, grouped in the
  order backward produces them, as DDP's rebuilt buckets are; or the exact layout passed in).
  Every method runs per piece with the synchronous path's own code (``hooks._plan``/``_reduce``),
  so a sparse method keeps its exact per-piece semantics.
* **Priority under a credit.** A piece whose gradients are complete (post-accumulate-grad hooks)
  is queued; the communication thread starts queued pieces front layers first, at most
  ``credit_mb`` per round. Collectives must be issued in the same order on every rank, and which
  pieces are queued depends on timing, so each round starts with one tiny all-reduce (MIN of a
  ready mask, on a process group of its own) that yields the pieces ready on EVERY rank; all ranks
  then pick the same ones in the same order. The intersection is never empty: every rank issued the
  same pieces so far and backward produces them in the same order everywhere, so a rank's queue is
  "produced so far" minus "issued", and the shortest of these prefixes still has an unissued piece.
* **Across the barrier.** When a piece's reduced gradient is back, the thread applies that piece's
  optimizer step at once (one optimizer per piece, built by ``make_optimizer``: SGD, momentum,
  weight decay, LARS, LAMB are per-parameter or per-layer, so stepping per piece is the same
  arithmetic), clears its gradients and releases the piece. The next forward of a module waits (a
  forward pre-hook) only for the pieces holding its own parameters; ``backward`` returns as soon
  as the local gradients exist. The first layers' pieces, produced last and needed first, go first.

**One skip decision per step.** Updates start before every piece is reduced, so the verdict cannot
wait for the reduced sums. Each piece's local gradient is checked for non-finite values when it is
queued; right after backward the main thread all-reduces (MAX, its own process group) that flag:
ANY rank's non-finite gradient makes EVERY rank skip EVERY piece of the step (no optimizer step,
error-feedback residuals handled by the methods exactly as in the synchronous path). A piece is
updated only after that verdict, which costs one tiny all-reduce after backward. The remaining
case -- finite gradients whose fp32 sum overflows -- shows in the reduced data that every rank
holds alike, and raises on every rank (``CrossBarrierError``) instead of applying half a step.

Refused in one line each: an fp16 wire (its sum overflows where the local values did not) and a
``GradScaler`` (its unscale/skip is one decision over all parameters at ``step`` time; bf16
autocast needs none), a global-norm gradient clip and PTO-LARS (both need every piece before any
update: use ``--overlap async``).

Using it: build it on every rank in the same order (COLLECTIVE: parameter broadcast and process
groups), then per step ``loss = criterion(engine(x), y); engine.backward(loss)``. Do not call
``zero_grad`` or an optimizer yourself; call :meth:`synchronize` before reading parameters
(evaluation, checkpoint) and :meth:`close` at the end.

HAZARDS: the optimizer steps run on the communication thread while the main thread runs the next
forward -- on disjoint parameters, which the pre-hooks guarantee; a parameter used outside its own
module's ``forward`` (tied weights) would be read while it is updated: refused at build time if
shared. Host syncs: the verdict read after backward (one per step, as ``maybe_step``); per piece,
the thread reads that piece's reduced-sum flag (off the main thread).

CUDA (:class:`StreamEdges`): the thread reduces and applies every piece on ONE side stream (NCCL
collectives are issued on the calling thread's current stream). STREAM EDGE 1: the autograd thread
records an event on its stream once the piece's gradients are flattened, and the side stream waits
for it before the reduction. STREAM EDGE 2: after the piece's optimizer step the side stream records
an event, and the next forward's pre-hook makes the training stream wait for it (a device-side wait:
the host waits only for the thread to have enqueued the update). ALLOCATOR: the flattened gradients
are allocated on the training stream and freed on the thread, so they are ``record_stream``-ed to the
side stream; reduced gradients and optimizer state live on the side stream only. :meth:`CrossBarrier.
synchronize` makes the training stream wait for the side stream, so checkpoints and evaluation read
applied parameters. The ready-mask rounds and the verdict run on gloo groups of their own with CPU
tensors (the verdict is the step's one host read). Unproven on a GPU so far: the edge ORDER is tested
on the CPU with a recording stand-in (``tests/test_cross_barrier.py``), the real run waits for a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.comm.hooks import _plan, _reduce, current_method
from trainer.comm.state import HookState

log = logging.getLogger(__name__)
_MB = 1 << 20


class CrossBarrierError(RuntimeError):
    """A step that cannot be applied piece by piece, or the communication thread failed."""


class StreamEdges:
    """The side stream and the events between it and the training stream (module docstring, CUDA);
    on a CPU device every method is a no-op. One per :class:`CrossBarrier`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device=device) if self.cuda else None

    def produced(self, flat: Tensor) -> Any:
        """Autograd thread, after ``flat`` (and the piece's local sum) was computed: STREAM EDGE 1."""
        if not self.cuda:
            return None
        flat.record_stream(self.side)  # ALLOCATOR: freed on the thread after the side stream used it
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def on_side(self, ready: Any) -> Iterator[None]:
        """Communication thread: run the block on the side stream after ``ready`` (None: no wait)."""
        if not self.cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            if ready is not None:
                self.side.wait_event(ready)  # STREAM EDGE 1 (consumer side)
            yield

    def applied(self) -> Any:
        """Communication thread, inside :meth:`on_side` after the optimizer step: STREAM EDGE 2."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def before_forward(self, applied: Any) -> None:
        """Main thread, forward pre-hook: the training stream waits for the piece's update on the device."""
        if self.cuda and applied is not None:
            torch.cuda.current_stream(self.device).wait_event(applied)  # STREAM EDGE 2 (consumer side)

    def drain(self) -> None:
        """Main thread: later work on the training stream sees every update enqueued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.side)


@dataclass(eq=False)  # identity: a piece is hashed and compared as itself
class _Piece:
    index: int  # position in backward's order (0 = produced first = the model's last layers)
    priority: int  # 0 = the model's first layers = started first
    params: list[nn.Parameter]
    numel: int
    nbytes: int
    optimizer: torch.optim.Optimizer
    released: threading.Event = field(default_factory=threading.Event)
    pending: int = 0  # parameters of the current step still without a gradient
    flat: Tensor | None = None  # the step's local gradients, flattened (owned by the thread)
    local_sum: Tensor | None = None  # sum of the step's local gradients (non-finite if any value is)
    step: int = -1  # the step whose gradients are queued
    reduced: Tensor | None = None  # the reduced gradient, until applied
    reduced_bad: bool = False
    ready_event: Any = None  # CUDA: the flattened gradients are written (StreamEdges.produced)
    applied_event: Any = None  # CUDA: the last update is done on the side stream (StreamEdges.applied)
    times: dict[str, float] = field(default_factory=dict)

    def parameters(self) -> list[nn.Parameter]:  # what HookState.key_for reads from a GradBucket
        return self.params


def default_layout(model: nn.Module, piece_mb: float) -> list[list[nn.Parameter]]:
    """Pieces of about ``piece_mb`` in the order backward produces them (reverse registration)."""
    cap = max(1, int(piece_mb * _MB))
    pieces: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if not pieces or size + nbytes > cap:
            pieces.append([])
            size = 0
        pieces[-1].append(p)
        size += nbytes
    return pieces


def piece_optimizers(full: torch.optim.Optimizer) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``make_optimizer`` for :class:`CrossBarrier` from one optimizer over the whole model: each piece
    gets a shallow copy of ``full`` holding only its parameters (every group's hyper-parameters kept)
    and SHARING ``full.state`` -- so ``full.state_dict()`` / ``load_state_dict()`` still checkpoint
    every momentum buffer. Only the communication thread steps the copies, one at a time."""
    if getattr(full, "pto", None):
        raise CrossBarrierError("--overlap cross: PTO computes the trust ratios of all layers together, "
                                "after every piece is reduced; use --overlap async with --pto, or drop --pto")

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        ids = {id(p) for p in params}
        # The same class, defaults, hooks, caches and state dict (shared, see above). Not copy.copy:
        # Optimizer.__getstate__ keeps only defaults/state/param_groups and would drop a subclass's caches.
        opt = object.__new__(type(full))
        opt.__dict__.update(full.__dict__)
        opt.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in ids]}
                            for g in full.param_groups]
        opt.param_groups = [g for g in opt.param_groups if g["params"]]
        opt._cross_full = full  # type: ignore[attr-defined]  # see _step_piece
        return opt

    return make


def _step_piece(opt: torch.optim.Optimizer) -> None:
    full = getattr(opt, "_cross_full", None)
    if full is not None:
        # full.load_state_dict() (a resume) REPLACES full.state: follow it, or the piece would step with
        # the empty momentum it was built with.
        opt.state = full.state
    opt.step()


class CrossBarrier:
    """See the module docstring. ``make_optimizer(params)`` builds one piece's optimizer."""

    def __init__(self, model: nn.Module,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], state: HookState,
                 *, piece_mb: float = 4.0, credit_mb: float = 8.0,
                 layout: Sequence[Sequence[nn.Parameter]] | None = None, timeout: float = 600.0,
                 _edges: StreamEdges | None = None) -> None:  # _edges: tests record the stream edges
        cfg = state.config
        if cfg.fp16:
            raise CrossBarrierError("--overlap cross: an fp16 wire can overflow in the sum where every local "
                                    "gradient was finite, after earlier pieces were applied; use --overlap "
                                    "async with --fp16-comm, or an fp32 wire")
        params = [p for p in model.parameters() if p.requires_grad]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise CrossBarrierError(f"--overlap cross: the parameters must live on one device, got "
                                    f"{sorted(map(str, devices)) or 'none'}")
        if credit_mb <= 0 or piece_mb <= 0:
            raise CrossBarrierError(f"--overlap cross: credit and piece sizes must be > 0 MB, got "
                                    f"{credit_mb} and {piece_mb}")
        self.model, self.state, self.timeout = model, state, timeout
        self.edges = _edges if _edges is not None else StreamEdges(next(iter(devices)))
        self.credit_bytes = int(credit_mb * _MB)
        groups = [list(g) for g in (layout if layout is not None else default_layout(model, piece_mb))]
        flat_ids = [id(p) for g in groups for p in g]
        if sorted(flat_ids) != sorted(id(p) for p in params) or len(set(flat_ids)) != len(flat_ids):
            raise CrossBarrierError("--overlap cross: the layout must hold every trainable parameter once")
        self._check_owners(model)
        state.set_param_names(model)
        state.fresh = True
        state.ensure_topology()  # COLLECTIVE: the methods' process groups, same order on every rank
        # Process groups of their own (COLLECTIVE, same order everywhere): the ready-mask rounds run on
        # the communication thread, the verdict on the main thread; a group is used by one thread only.
        self._round_group = dist.new_group(backend="gloo")
        self._verdict_group = dist.new_group(backend="gloo")
        for p in params:  # every rank starts from rank 0's parameters, as DDP does
            dist.broadcast(p.data, src=0)
        for b in model.buffers():
            dist.broadcast(b.data, src=0)
        n = len(groups)
        self.pieces = [_Piece(index=i, priority=n - 1 - i, params=g, numel=sum(p.numel() for p in g),
                              nbytes=sum(p.numel() * p.element_size() for p in g),
                              optimizer=make_optimizer(g)) for i, g in enumerate(groups)]
        self._piece_of: dict[int, _Piece] = {id(p): pc for pc in self.pieces for p in pc.params}
        for pc in self.pieces:
            pc.released.set()
            pc.pending = len(pc.params)
        self._cv = threading.Condition()
        self._queued: list[_Piece] = []  # gradients complete, not yet started
        self._parked: list[_Piece] = []  # reduced, waiting for their step's verdict
        self._verdicts: dict[int, bool] = {}
        self._lrs: dict[int, float] = {}
        self._left: dict[int, int] = {}  # step -> pieces not yet applied (or skipped)
        self._failed: BaseException | None = None
        self._closing = False
        self.step = 0  # the step whose backward runs next
        self.rounds = 0  # negotiation rounds (each one tiny all-reduce)
        self.trace: list[dict[str, float | int]] | None = None  # benchmarks: per piece times
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        for mod in model.modules():
            own = [self._piece_of[id(p)] for p in mod.parameters(recurse=False) if id(p) in self._piece_of]
            if own:
                mine = sorted(set(own), key=lambda pc: pc.index)
                self._handles.append(mod.register_forward_pre_hook(
                    lambda _m, _i, mine=mine: self._wait_released(mine)))
        self._thread = threading.Thread(target=self._loop, name="datacache-cross", daemon=True)
        self._thread.start()
        log.info("--overlap cross: %d pieces (%s), credit %.1f MB per round", n,
                 ", ".join(f"{pc.numel}" for pc in self.pieces[:8]) + (" ..." if n > 8 else ""), credit_mb)

    @staticmethod
    def _check_owners(model: nn.Module) -> None:
        seen: dict[int, str] = {}
        for name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    raise CrossBarrierError(f"--overlap cross: parameter {name}.{pname} is shared with "
                                            f"{seen[id(p)]} (tied weights); use --overlap async")
                seen[id(p)] = f"{name}.{pname}"

    # ---- the main thread ------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise CrossBarrierError(f"--overlap cross: the communication thread failed "
                                    f"({type(self._failed).__name__}: {self._failed})") from self._failed

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while not ready():
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CrossBarrierError(f"--overlap cross: waited {self.timeout:.0f} s for {what}")
                self._cv.wait(min(left, 1.0))
            self._raise_if_failed()

    def _wait_released(self, pieces: Iterable[_Piece]) -> None:
        # Forward pre-hook: this module's parameters must hold the previous step's update.
        for pc in pieces:
            if not pc.released.is_set():
                self._wait(pc.released.is_set, f"piece {pc.index}'s update")
            self.edges.before_forward(pc.applied_event)  # CUDA: on the device too (STREAM EDGE 2)

    def _grad_ready(self, p: Tensor) -> None:
        # Autograd thread (CPU: the thread calling backward). Flatten the piece once complete.
        pc = self._piece_of[id(p)]
        pc.pending -= 1
        if pc.pending:
            return
        flat = torch.cat([q.grad.reshape(-1) for q in pc.params])  # every one has its gradient now
        for q in pc.params:
            q.grad = None  # the thread hands the reduced gradient back to the optimizer
        pc.flat, pc.step, pc.pending = flat, self.step, len(pc.params)
        pc.times = {"ready": time.perf_counter()}
        # One reduction, no bool mask the size of the piece (isfinite(flat).all() showed in profiles), and
        # no host read here: a NaN/inf anywhere makes the sum non-finite; backward() reads them all once.
        pc.local_sum = flat.sum() if self.state.config.nan_check else None
        pc.ready_event = self.edges.produced(flat)  # CUDA: STREAM EDGE 1 (after flat and its sum)
        pc.released.clear()
        with self._cv:
            self._queued.append(pc)
            self._cv.notify_all()

    def backward(self, loss: Tensor, lr: float | None = None) -> bool:
        """``loss.backward()``, then the step's skip verdict (one tiny all-reduce); returns True when
        the step will be applied. Communication and updates go on after this returns. ``lr``: this
        step's learning rate (set on each piece's optimizer right before its update: a piece of the
        previous step may still be applied while this one runs)."""
        self._raise_if_failed()
        step = self.step
        with self._cv:
            self._left[step] = len(self.pieces)
            if lr is not None:
                self._lrs[step] = lr
        loss.backward()
        missing = [pc for pc in self.pieces if pc.step != step]
        if missing:
            names = self.state._param_names
            first = next(names.get(id(p), "?") for p in missing[0].params)
            raise CrossBarrierError(f"--overlap cross: {len(missing)} pieces got no gradient this step (e.g. "
                                    f"{first}); every parameter must be used in every step")
        bad = torch.zeros(1)
        if self.state.config.nan_check:
            sums = torch.stack([pc.local_sum for pc in self.pieces if pc.local_sum is not None])
            bad[0] = (~torch.isfinite(sums)).any().to("cpu")  # CUDA: HOST SYNC, the step's one read
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._verdict_group)  # gloo, CPU tensor
        skipped = bool(bad.item() > 0)  # HOST read: the step's one verdict
        with self._cv:
            self._verdicts[step] = skipped
            self._cv.notify_all()
        self.step += 1
        return not skipped

    def synchronize(self) -> None:
        """Wait until every queued piece is reduced and applied (evaluation, checkpoints, the end)."""
        self._wait(lambda: not self._left, "the last pieces")
        self.edges.drain()  # CUDA: the training stream waits for the side stream's updates

    def close(self) -> None:
        """Finish the queued work, stop the thread and remove the hooks (idempotent)."""
        if self._thread.is_alive() and self._failed is None:
            self.synchronize()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(10.0)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def module(self) -> nn.Module:
        return self.model

    def train(self, mode: bool = True) -> CrossBarrier:
        self.model.train(mode)
        return self

    def eval(self) -> CrossBarrier:
        return self.train(False)

    # ---- the communication thread ---------------------------------------------------------
    def _appliable(self) -> bool:
        return any(pc.step in self._verdicts for pc in self._parked)

    def _round(self) -> list[_Piece] | None:
        """Wait for a local piece (or a parked one whose verdict came), then agree with every rank on
        what to start (module docstring); None once closing with nothing left."""
        with self._cv:
            while not self._queued and not self._appliable():
                if self._closing:
                    return None
                self._cv.wait()
            if not self._queued:
                return []
            mask = torch.zeros(len(self.pieces), dtype=torch.int32)
            for pc in self._queued:
                mask[pc.index] = 1
        dist.all_reduce(mask, op=dist.ReduceOp.MIN, group=self._round_group)  # tiny; every rank
        self.rounds += 1
        with self._cv:
            common = sorted((pc for pc in self._queued if mask[pc.index]),
                            key=lambda pc: (pc.step, pc.priority))
            chosen: list[_Piece] = []
            size = 0
            for pc in common:
                if chosen and size + pc.nbytes > self.credit_bytes:
                    break
                chosen.append(pc)
                size += pc.nbytes
            for pc in chosen:
                self._queued.remove(pc)
        if not chosen:  # cannot happen (module docstring); fail loudly rather than spin
            raise CrossBarrierError("--overlap cross: no piece ready on every rank; the ranks' backward "
                                    "orders differ (a data-dependent model?)")
        return chosen

    def _communicate(self, pc: _Piece, round_start: float) -> None:
        state = self.state
        assert pc.flat is not None
        started = time.perf_counter()
        plan = _plan(state, pc, current_method(state), pc.numel)
        with self.edges.on_side(pc.ready_event):  # CUDA: the side stream, after STREAM EDGE 1
            out = _reduce(state, plan, pc.flat, blocking=True)
            assert isinstance(out, Tensor)
            flag = state.flags.combined()
            state.flags.clear()
            # host read on this thread (one per piece; CUDA: waits for the side stream's reduction)
            pc.reduced_bad = flag is not None and bool(flag)
        pc.reduced = out
        pc.ready_event = None
        pc.flat = None
        pc.times.update(round=round_start, start=started, comm_end=time.perf_counter())
        self._parked.append(pc)

    def _apply_parked(self) -> None:
        """Apply (or skip) every reduced piece whose step has its verdict; release it to the forward."""
        with self._cv:
            ready = [pc for pc in self._parked if pc.step in self._verdicts]
        for pc in ready:
            skipped = self._verdicts[pc.step]
            if pc.reduced_bad and not skipped:
                raise CrossBarrierError(f"--overlap cross: piece {pc.index}'s reduced gradient is non-finite "
                                        "although every rank's gradient was finite (the fp32 sum "
                                        "overflowed); lower the learning rate or use --overlap async")
            out = pc.reduced
            assert out is not None
            if not skipped:
                lr = self._lrs.get(pc.step)
                if lr is not None:
                    for g in pc.optimizer.param_groups:
                        g["lr"] = lr
                with self.edges.on_side(None):  # CUDA: after the reduction on the same side stream
                    off = 0
                    for p in pc.params:
                        p.grad = out[off:off + p.numel()].view_as(p)
                        off += p.numel()
                    _step_piece(pc.optimizer)
                    for p in pc.params:
                        p.grad = None
                    pc.applied_event = self.edges.applied()  # STREAM EDGE 2 (producer side)
            pc.reduced = None
            if self.trace is not None:
                self.trace.append({"piece": pc.index, "priority": pc.priority, "numel": pc.numel,
                                   "step": pc.step, **pc.times, "applied": time.perf_counter()})
            with self._cv:
                self._parked.remove(pc)
                pc.released.set()
                self._left[pc.step] -= 1
                if not self._left[pc.step]:
                    del self._left[pc.step]
                    self._lrs.pop(pc.step, None)
                    self.state.finish_step(skipped=self._verdicts.pop(pc.step))
                self._cv.notify_all()

    def _loop(self) -> None:
        try:
            while True:
                chosen = self._round()
                self._apply_parked()
                if chosen is None:
                    return
                now = time.perf_counter()
                for pc in chosen:
                    self._communicate(pc, now)
                    self._apply_parked()
        except BaseException as exc:  # re-raised by the main thread's next wait or backward
            log.exception("--overlap cross: the communication thread failed")
            with self._cv:
                self._failed = exc
                self._cv.notify_all()
