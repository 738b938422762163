"""Measure this job's links and selection cost at start, and pick the gradient method (``--comm auto``).

The cost model (:mod:`trainer.comm.cost_model`) predicts each method's step communication from α-β link
parameters per collective and per-element compute costs. Here they come from the job itself, on its own
ranks and links, in a few seconds before training starts:

* **links** (:func:`measure_collectives`): all_reduce, all_gather and reduce_scatter of a few sizes on
  the intra-node groups (all nodes at once, as torus/hitopk run them) and on local rank 0's inter-node
  group (one stream; the model splits a shared NIC itself); fitted per collective
  (:func:`~trainer.comm.cost_model.fit_collective`). A link with one rank (one node, or one rank per
  node) is not measured: the model's terms for it are zero.
* **compute** (:func:`measure_compute`): MSTopK selection with error-feedback compensation, the dense
  passes of decompression and the scatter-add of received pairs, on ``min(d, 4M)`` elements of the
  training device, fitted per element.
* **the step** (:func:`measure_step`, when the trainer passes its model and batch): forward and
  backward of this job's model on one batch of its shape, without communication, and the backward's
  share of it. The methods are then ranked by the step the cost model predicts with that compute
  (:func:`~trainer.comm.cost_model.rank_by_step`: the dense all-reduce overlapped by DDP, and with
  ``--overlap auto`` the better of the synchronous and the asynchronous hooks), not by communication
  alone; with ``--overlap auto`` a method for which even the contention-free model gives the thread
  nothing is run synchronously without the measuring steps.

Every timing is averaged over the ranks that ran it (an all_reduce), so every rank fits the same numbers
and makes the same choice (:func:`choose_method` is COLLECTIVE). Host syncs: the probe reads its
timings on the host on purpose (it runs once, before training); on CUDA each timed call ends with
``torch.cuda.synchronize`` so the host clock sees the device's work.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.comm import cost_model as cm
from trainer.comm.names import METHOD_CHOICES, OVERLAP_CHOICES
from trainer.scratch_pass import leaves_no_trace

# bytes: the buffer of all_reduce / reduce_scatter, each rank's share of all_gather
PROBE_SIZES = (64 << 10, 1 << 20, 4 << 20)
COMPUTE_MAX = 1 << 22  # elements the compute probe runs on (costs are per element)
_ZERO = cm.LinkProfile.uniform(cm.LinkParams(0.0, 0.0))  # a link with one rank: never used by the model


def timed(fn: Callable[[], Any], reps: int, active: bool = True, mean: bool = True,
          device: torch.device | None = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` barrier-aligned rounds after one warm-up round; only
    ``active`` ranks call ``fn``; the mean over active ranks (``mean``) or rank 0's value, on every rank.
    COLLECTIVE. On CUDA (``device``) each call is followed by a synchronize (HAZARD: a host sync, on
    purpose: the host clock must cover the device's work)."""
    cuda = device is not None and device.type == "cuda"
    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if active:
            fn()
            if cuda:
                torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times) if active else 0.0, float(active)], dtype=torch.float64)
    if cuda:
        t = t.to(device)  # NCCL groups need device tensors
    if mean:
        dist.all_reduce(t)
        return float(t[0] / t[1])
    dist.broadcast(t, 0)
    return float(t[0])


def measure_collectives(group: Any, sizes: Sequence[int], reps: int, active: bool,
                        device: torch.device | None = None) -> dict[str, dict[str, list[float]]]:
    """Timings of the three collectives the methods use on ``group`` per size (module docstring).
    COLLECTIVE over the world (``timed`` aligns every rank; inactive ranks only wait)."""
    from trainer.comm.collectives import all_gather_flat, all_reduce_sum_, reduce_scatter_sum

    dev = device or torch.device("cpu")
    p = dist.get_world_size(group) if active else 1
    fns: dict[str, Callable[[Any, Any], Any]] = {
        "all_reduce": lambda x, o: all_reduce_sum_(x, group),
        "all_gather": lambda x, o: all_gather_flat(x, group, out=o),
        "reduce_scatter": lambda x, o: reduce_scatter_sum(x, group, out=o[:x.numel() // p])}
    out: dict[str, dict[str, list[float]]] = {}
    for kind, fn in fns.items():
        times = []
        for nb in sizes:
            x, o = torch.ones(nb // 4, device=dev), torch.empty(p * nb // 4, device=dev)
            times.append(timed(lambda fn=fn, x=x, o=o: fn(x, o), reps, active, device=device))
        out[kind] = {"sizes_bytes": [float(s) for s in sizes], "times_s": times}
    return out


def measure_compute(d: int, rho: float, world: int, reps: int,
                    device: torch.device | None = None) -> dict[str, dict[str, list[float]]]:
    """Per-element timings of selection, decompression's dense passes and the scatter-add (module
    docstring), at ``d / 4``, ``d / 2`` and ``d`` elements, all ranks at once (CPU sharing as in the
    methods). COLLECTIVE."""
    from trainer.comm.selector_registry import get_selector
    from trainer.comm.sparse_ops import add_rows_, compensate, wire_and_flag

    dev = device or torch.device("cpu")
    sel = get_selector("auto")  # what the methods run by default on this device
    g = torch.Generator().manual_seed(1234)
    flat, res = torch.randn(d, generator=g).to(dev), (torch.randn(d, generator=g) * 0.01).to(dev)
    out: dict[str, dict[str, list[float]]] = {k: {"counts": [], "times": []} for k in ("select", "dense",
                                                                                       "scatter")}

    def add(kind: str, count: int, fn: Callable[[], Any]) -> None:
        out[kind]["counts"].append(count)
        out[kind]["times"].append(timed(fn, reps, device=device))

    ybuf = torch.empty(d, device=dev)

    def select(x: Any, r: Any, k: int) -> None:  # as the methods: compensate, select, flag the sent values
        y = compensate(x, r, world, out=ybuf[:x.numel()])
        wire_and_flag(sel(y, k)[0], False, True)

    for frac in (4, 2, 1):
        n = d // frac
        x, r = flat[:n], res[:n]
        add("select", n, lambda x=x, r=r, n=n: select(x, r, max(1, round(rho * n))))
        # decompression's dense passes as in the methods: zero the reused output, write the residual back
        rbuf, obuf = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        add("dense", n, lambda x=x, rb=rbuf, ob=obuf: (ob.zero_(), rb.copy_(x)))
        kk = max(1, round(rho * d)) // frac  # per row; the methods add `world` rows, one at a time
        idx = torch.stack([torch.randperm(d, generator=g)[:kk] for _ in range(world)]).to(dev, torch.int32)
        vals, dst = torch.randn(world, kk, generator=g).to(dev), torch.zeros(d, device=dev)
        add("scatter", world * kk, lambda i=idx, v=vals, dst=dst: add_rows_(dst, i, v))
    return out


@dataclass(frozen=True)
class StepCompute:
    """Seconds of one training step's forward + backward without communication (mean over the ranks),
    and the backward's share of them (:func:`measure_step`)."""

    seconds: float
    backward_share: float


def measure_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, reps: int = 3,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 device: torch.device | None = None) -> StepCompute:
    """Time ``model``'s forward (with autograd, as in training) and forward + backward on ``(x, y)``,
    cross-entropy loss, under the training step's ``autocast``; the model is left as it was: BatchNorm's
    buffers are restored and the gradients dropped (parameters are untouched: no optimizer step), and
    the global RNG is restored (dropout). COLLECTIVE (``timed``: barrier-aligned, mean over the ranks).
    HAZARD, CUDA: each timed call ends with a synchronize (on purpose: the host clock must cover the
    kernels); this runs once, before training."""
    ac = autocast or contextlib.nullcontext
    cuda = device is not None and device.type == "cuda"

    def forward() -> torch.Tensor:
        with ac():
            return torch.nn.functional.cross_entropy(model(x), y)

    def step() -> None:
        forward().backward()
        for p in model.parameters():
            p.grad = None  # the next rep allocates afresh, as a step after zero_grad(set_to_none) does

    with torch.random.fork_rng(devices=[device] if cuda else []), leaves_no_trace(model):
        fwd = timed(forward, reps, device=device)
        total = timed(step, reps, device=device)
    share = min(1.0, max(0.0, 1.0 - fwd / total)) if total > 0 else 2 / 3
    return StepCompute(total, share)


def fit_profile(meas: dict[str, dict[str, list[float]]], p: int) -> cm.LinkProfile:
    """The link as each collective sees it, from :func:`measure_collectives`' timings among ``p`` ranks."""
    return cm.LinkProfile(**{k: cm.fit_collective(k, p, meas[k]["sizes_bytes"], meas[k]["times_s"])
                             for k in cm.COLLECTIVES})


def fit_compute(meas: dict[str, dict[str, list[float]]]) -> cm.ComputeParams:
    """Per-element costs from :func:`measure_compute`'s timings (the local sums stay in the link fits)."""
    return cm.ComputeParams(**{f"{k}_s_per_elem": cm.fit_per_element(meas[k]["counts"], meas[k]["times"])
                               for k in ("select", "dense", "scatter")})


@dataclass(frozen=True)
class AutoChoice:
    """What ``--comm auto`` picked and why: the cheapest method by predicted seconds per step."""

    method: str
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per method, cheapest first
    intra: cm.LinkProfile = _ZERO
    inter: cm.LinkProfile = _ZERO
    compute: cm.ComputeParams = field(default_factory=cm.ComputeParams)
    m: int = 1
    n: int = 1
    d: int = 0
    rho: float = 0.0
    step: StepCompute | None = None  # measured: the rows are ranked by the predicted step
    overlap: str = ""  # with the step measured: the --overlap mode to run (rank_by_step)
    asked_overlap: str = ""
    pieces: int = 1

    def line(self) -> str:
        """One log line: the choice, every method's prediction, the measured links."""
        if self.step is not None:
            return self._step_line()
        preds = ", ".join(f"{r['method']} {1e3 * float(r['total']):.1f}" for r in self.rows)

        return (f"--comm auto: {self.method} (predicted ms per step for {self.d:,} gradient elements at "
                f"density {self.rho:g} on {self.m} node(s) x {self.n} rank(s): {preds}; {self._measured()})")

    def _measured(self) -> str:
        return (f"measured all_reduce bandwidth inter {_gbit(self.inter)}, intra {_gbit(self.intra)}; "
                f"selection {1e9 * self.compute.select_s_per_elem:.2f} ns/element")

    def _step_line(self) -> str:
        assert self.step is not None
        mode = self.asked_overlap
        ranked_by = {"none": "the synchronous hooks (the dense all-reduce overlapped by DDP)",
                     "async": "--overlap async", "cross": "--overlap cross's lower bound",
                     "auto": "the better of the synchronous and the asynchronous hooks"}[mode]
        preds = ", ".join(f"{r['method']} {1e3 * float(r['step']):.1f} ({1e3 * float(r['total']):.1f} comm)"
                          for r in self.rows)
        return (f"--comm auto: {self.method} (predicted ms per step with {1e3 * self.step.seconds:.1f} ms of "
                f"forward + backward measured ({100 * self.step.backward_share:.0f} % backward) and "
                f"{self.pieces} bucket(s), by {ranked_by}, for {self.d:,} gradient elements at density "
                f"{self.rho:g} on {self.m} node(s) x {self.n} rank(s): {preds}; {self._measured()})")

    def overlap_line(self) -> str:
        """With ``--overlap auto``: the overlap mode the model leaves to run, and why ("" otherwise)."""
        if self.step is None or self.asked_overlap != "auto":
            return ""
        r = self.rows[0]
        gain = float(r["step_none"]) / float(r["step_async"]) if float(r["step_async"]) > 0 else 1.0
        if self.overlap == "none":
            return (f"--comm auto, --overlap auto: none for {self.method} (the model, which leaves out the "
                    f"cores backward and a communication thread share, gives async at most {gain:.2f}x "
                    "the synchronous step: its thread cannot pay; not measured)")
        return (f"--comm auto, --overlap auto: the model gives {self.method} async up to {gain:.2f}x the "
                "synchronous step (no contention for cores): both are timed on the first steps to decide")


def _gbit(link: cm.LinkProfile) -> str:
    b = link.all_reduce.beta_s_per_byte
    return "-" if b == 0 else f"{8 / b / 1e9:.2f} Gbit/s"


def choose_method(topo: Any, d: int, rho: float, *, fp16: bool = False, reps: int = 3,
                  sizes: Sequence[int] = PROBE_SIZES, device: torch.device | None = None,
                  methods: Sequence[str] = METHOD_CHOICES, step: StepCompute | None = None,
                  overlap: str = "none", pieces: int = 1, margin: float = cm.ASYNC_MARGIN) -> AutoChoice:
    """Measure (module docstring) and return the cheapest of ``methods`` for ``d`` gradient elements at
    density ``rho``: by predicted communication, or -- given the measured ``step`` -- by the predicted
    step in ``overlap`` mode with ``pieces`` buckets (and for ``overlap="auto"`` the mode to run,
    :func:`~trainer.comm.cost_model.rank_by_step`). COLLECTIVE: every rank calls it and gets the same
    answer (the timings are averaged over the ranks, then rank 0's choice is broadcast)."""
    m, n = topo.num_nodes, topo.local_size
    intra = inter = _ZERO
    if n > 1:  # every node's group at once
        intra = fit_profile(measure_collectives(topo.intra, sizes, reps, True, device), n)
    if m > 1:  # local rank 0's inter-node group; the others wait
        meas = measure_collectives(topo.inter, sizes, reps, topo.local_rank == 0, device)
        inter = fit_profile(meas, m)
    compute = fit_compute(measure_compute(min(d, COMPUTE_MAX), rho, topo.world_size, reps, device))
    method, rows = cm.recommend(d, rho, m, n, intra, inter, compute, methods=methods, fp16=fp16)
    mode = ""
    if step is not None:
        method, mode, rows = cm.rank_by_step(rows, step.seconds, overlap=overlap, pieces=pieces,
                                             backward_share=step.backward_share, margin=margin)
    # one answer everywhere even if a float comparison differed between ranks: rank 0's index wins
    modes = ("", *OVERLAP_CHOICES)
    pick = torch.tensor([list(methods).index(method), modes.index(mode)], dtype=torch.int64,
                        device=device if device is not None and device.type == "cuda" else None)
    dist.broadcast(pick, 0)
    method, mode = list(methods)[int(pick[0].item())], modes[int(pick[1].item())]
    return AutoChoice(method, rows, intra, inter, compute, m, n, d, rho, step, mode,
                      overlap if step is not None else "", pieces)
