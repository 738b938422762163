"""α-β cost model of the four gradient-aggregation methods (dense ring, 2D-Torus, NaiveAG, HiTopKComm).

A link moves ``b`` bytes in ``alpha + beta * b`` seconds (:class:`LinkParams`; per collective kind:
:class:`LinkProfile`). ``m`` nodes x ``n`` ranks (``P = m n``); ranks of a node use the *intra* link,
nodes the *inter* link. Costs follow Shi et al. 2021 §3 (eq. 3, eqs. 7–10) and Mikami et al. §2.2:
ring reduce-scatter of B bytes among p ``(p-1) α + (p-1)/p B β`` (eq. 7); all-gather of b bytes per
rank ``⌈log2 p⌉ α + (p-1) b β`` (eqs. 3, 9, 10); ring all-reduce ``2(p-1) α + 2(p-1)/p B β``.
Deliberate differences from the paper (docs/cost_model.md): sparse pairs are packed in ONE
all-gather (8 bytes, 6 with fp16 values); the ``n`` inter streams of torus/hitopk share one NIC
(``nic_shared``, each sees ``n β``); HiTopKComm's last step gathers the dense ``d/n`` chunk by
default (``final_gather="sparse"`` is eq. 10; hitopk.choose_final_gather picks per call); compute terms
(:class:`ComputeParams`) for selection, decompression, scatter-add and local sums.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.comm.names import FINAL_GATHER_FORMS, METHOD_CHOICES, OVERLAP_CHOICES, PHASES, check_choice

INDEX_BYTES = 4  # int32 indices (trainer/comm/collectives.py::all_gather_packed bit-casts them)


def _check_nonneg(cls: str, fields: dict[str, object]) -> None:
    for name, v in fields.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{cls}.{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class LinkParams:
    """One link: latency ``alpha_s`` (seconds per message) and ``beta_s_per_byte`` (1 / bandwidth)."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        _check_nonneg("LinkParams", asdict(self))

    @classmethod
    def from_gbit(cls, gbit_per_s: float, alpha_s: float) -> LinkParams:
        """A link of ``gbit_per_s`` gigabits per second and latency ``alpha_s``."""
        if gbit_per_s <= 0:
            raise ValueError(f"bandwidth must be > 0 Gbit/s, got {gbit_per_s}")
        return cls(alpha_s, 8.0 / (gbit_per_s * 1e9))

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


@dataclass(frozen=True)
class ComputeParams:
    """Per-element compute costs in seconds; all default to 0 (a pure communication model).

    select_s_per_elem:  top-k selection per INPUT element (incl. adding the error-feedback residual
                        and the non-finite check, when the implementation does them there).
    dense_s_per_elem:   dense per-element work of decompression: allocating/zero-filling the output
                        (and writing the error-feedback residual back), per element of the output.
    scatter_s_per_elem: scatter-adding one received (value, index) pair.
    reduce_s_per_elem:  the local sum that reduce-scatter / all-reduce do, per element reduced.
    """

    select_s_per_elem: float = 0.0
    dense_s_per_elem: float = 0.0
    scatter_s_per_elem: float = 0.0
    reduce_s_per_elem: float = 0.0

    def __post_init__(self) -> None:
        _check_nonneg("ComputeParams", asdict(self))


COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class LinkProfile:
    """One link as each collective sees it: α, β per collective kind.

    On NCCL the three are close and one :class:`LinkParams` is enough (``LinkProfile.uniform``).
    On gloo over TCP they are not: measured here, a 2-rank all-gather moved bytes 2-7x slower than
    an all-reduce over the same link, so the benchmark fits each kind (:func:`fit_collective`).
    """

    all_reduce: LinkParams
    all_gather: LinkParams
    reduce_scatter: LinkParams

    @classmethod
    def uniform(cls, link: LinkParams) -> LinkProfile:  # the same α-β for every collective
        return cls(link, link, link)

    def scaled_beta(self, factor: float) -> LinkProfile:
        return LinkProfile(*(LinkParams(lp.alpha_s, lp.beta_s_per_byte * factor)
                             for lp in (self.all_reduce, self.all_gather, self.reduce_scatter)))


Link = LinkParams | LinkProfile


def as_profile(link: Link) -> LinkProfile:
    if isinstance(link, (LinkProfile, LinkParams)):
        return link if isinstance(link, LinkProfile) else LinkProfile.uniform(link)
    raise TypeError(f"expected LinkParams or LinkProfile, got {type(link).__name__}")


@dataclass(frozen=True)
class CostConfig:
    """One prediction request. Errors name the field and list the valid choices."""

    method: str
    d: int
    rho: float
    m: int
    n: int
    fp16: bool = False
    nic_shared: bool = True
    final_gather: str = "dense"

    def __post_init__(self) -> None:
        check_choice("CostConfig.method", self.method, METHOD_CHOICES)
        check_choice("CostConfig.final_gather", self.final_gather, FINAL_GATHER_FORMS)  # no "auto" here
        for name, v in (("d (elements)", self.d), ("m (nodes)", self.m), ("n (ranks per node)", self.n)):
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (0.0 < self.rho <= 1.0):
            raise ValueError(f"rho (density k/d) must be in (0, 1], got {self.rho!r}")


# ---------------------------------------------------------------- collective building blocks
def _log2p(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def reduce_scatter_time(nbytes: float, p: int, link: LinkParams) -> float:
    """Ring reduce-scatter of a ``nbytes`` buffer among ``p`` ranks (eq. 7)."""
    return 0.0 if p <= 1 else (p - 1) * link.alpha_s + (p - 1) / p * nbytes * link.beta_s_per_byte


def all_gather_time(nbytes_per_rank: float, p: int, link: LinkParams) -> float:
    """All-gather where each of ``p`` ranks contributes ``nbytes_per_rank`` (eqs. 3, 9, 10)."""
    return 0.0 if p <= 1 else _log2p(p) * link.alpha_s + (p - 1) * nbytes_per_rank * link.beta_s_per_byte


def all_reduce_time(nbytes: float, p: int, link: LinkParams) -> float:
    """Ring all-reduce of a ``nbytes`` buffer among ``p`` ranks."""
    return 0.0 if p <= 1 else 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes * link.beta_s_per_byte


def _shared(link: LinkProfile, streams: int, shared: bool) -> LinkProfile:
    """``streams`` concurrent flows through one NIC each get 1/streams of its bandwidth."""
    return link.scaled_beta(streams) if shared and streams > 1 else link


# ---------------------------------------------------------------- per-method model
def predict_config(cfg: CostConfig, intra: Link, inter: Link,
                   compute: ComputeParams | None = None) -> dict[str, float]:
    """Seconds per aggregation of ``cfg.d`` fp32 gradients, split into select/communicate/decompress."""
    c = compute or ComputeParams()
    ia, ie = as_profile(intra), as_profile(inter)
    d, m, n, rho = int(cfg.d), int(cfg.m), int(cfg.n), float(cfg.rho)
    p = m * n
    vbytes = 2 if cfg.fp16 else 4  # wire bytes of a value (fp16 halves sparse values only)
    pair = vbytes + INDEX_BYTES
    sel = comm = dec = 0.0
    if cfg.method == "allreduce":
        # One flat ring over all P ranks: with ranks numbered node by node only one flow per node
        # crosses the inter link; every ring step waits for its slowest hop, so the step runs at
        # max(intra, inter) (the inter link on real clusters; on an emulated one the intra may be slower).
        a, b = ia.all_reduce, ie.all_reduce
        link = a if m == 1 else b if n == 1 else LinkParams(
            max(a.alpha_s, b.alpha_s), max(a.beta_s_per_byte, b.beta_s_per_byte))
        comm = all_reduce_time(4.0 * d, p, link) + (p - 1) / p * d * c.reduce_s_per_elem
    elif cfg.method == "torus":
        # Mikami §2.2: intra reduce-scatter -> n concurrent inter all-reduces of d/n -> intra all-gather.
        comm = (reduce_scatter_time(4.0 * d, n, ia.reduce_scatter) + (n - 1) / n * d * c.reduce_s_per_elem
                + all_reduce_time(4.0 * d / n, m, _shared(ie, n, cfg.nic_shared).all_reduce)
                + (m - 1) / m * d / n * c.reduce_s_per_elem
                + all_gather_time(4.0 * d / n, n, ia.all_gather))
    elif cfg.method == "naive_ag":
        # Eq. 3 with one packed all-gather of k (value, index) pairs among all P ranks.
        k = max(1, round(rho * d))
        sel = d * c.select_s_per_elem
        comm = all_gather_time(pair * k, p, (ie if m > 1 else ia).all_gather)
        dec = d * c.dense_s_per_elem + p * k * c.scatter_s_per_elem
    else:  # hitopk, eqs. 7-10
        dn = math.ceil(d / n)
        kt = max(1, round(rho * dn))
        t1 = reduce_scatter_time(4.0 * d, n, ia.reduce_scatter) + (n - 1) / n * d * c.reduce_s_per_elem  # 7
        sel = dn * c.select_s_per_elem                                                            # eq. 8
        t3 = all_gather_time(pair * kt, m, _shared(ie, n, cfg.nic_shared).all_gather)             # eq. 9
        dec = dn * c.dense_s_per_elem + m * kt * c.scatter_s_per_elem
        if cfg.final_gather == "dense":
            t4 = all_gather_time(4.0 * dn, n, ia.all_gather)
        else:                                                                                     # eq. 10
            # every rank scatter-adds all n*m*k~ pairs into its zeroed d-vector (no chunk pass)
            t4 = all_gather_time(pair * m * kt, n, ia.all_gather)
            dec = d * c.dense_s_per_elem + n * m * kt * c.scatter_s_per_elem
        comm = t1 + t3 + t4
    return {"select": sel, "communicate": comm, "decompress": dec, "total": sel + comm + dec}


def predict(method: str, d: int, rho: float, m: int, n: int, intra: Link, inter: Link,
            compute: ComputeParams | None = None, *, fp16: bool = False, nic_shared: bool = True,
            final_gather: str = "dense") -> dict[str, float]:
    """Predicted seconds of ``method`` on ``m`` nodes x ``n`` ranks for ``d`` elements at density ``rho``.

    Returns ``{"select", "communicate", "decompress", "total"}``. Dense methods ignore ``rho``.
    """
    cfg = CostConfig(method, d, rho, m, n, fp16=fp16, nic_shared=nic_shared, final_gather=final_gather)
    return predict_config(cfg, intra, inter, compute)


def recommend(d: int, rho: float, m: int, n: int, intra: Link, inter: Link,
              compute: ComputeParams | None = None, *, methods: Sequence[str] = METHOD_CHOICES,
              **kwargs: object) -> tuple[str, list[dict[str, object]]]:
    """Cheapest method and the table (one row per method, sorted by predicted total)."""
    if not methods:
        raise ValueError(f"methods is empty; choose from {', '.join(METHOD_CHOICES)}")
    rows = sorted(({"method": meth, **predict(meth, d, rho, m, n, intra, inter, compute, **kwargs)}
                   for meth in methods), key=lambda r: float(r["total"]))  # type: ignore[arg-type]
    return str(rows[0]["method"]), rows


# ---------------------------------------------------------------- overlap with compute
def overlapped_step(compute_s: float, comm_s: float, *, pieces: int = 1, backward_share: float = 2 / 3,
                    dense_hook: bool = False) -> dict[str, float]:
    """Ideal seconds per training step for each ``--overlap`` mode (no contention for cores or links).

    ``compute_s``: forward + backward without communication, ``backward_share`` of it backward;
    ``comm_s``: the method's seconds per step (:func:`predict`'s ``total``), in ``pieces`` equal parts
    that backward produces at even intervals (last layers first) and one communication server handles
    one at a time. ``none``: backward waits for each piece (``compute + comm``), except DDP's own
    asynchronous dense all-reduce (``dense_hook=True``: as ``async``). ``async``: first in, first out
    while backward goes on, the optimizer after the last piece: ``F + max(B + c, B / n + comm)`` with
    ``c = comm / n`` (the latest of "the last piece starts when backward ends" and "the first piece
    starts early and the server never idles"). ``cross_bound``: a lower bound of ``--overlap cross``'s
    steady state, ``max(compute + c, comm)`` (the front piece, produced last, is communicated before the
    next forward can start; the server cannot do more than its work); the forward's waits for the back
    pieces add at most ``(F + B + 2 comm) / n`` to it. ``bound``: ``max(compute, comm)``.
    The event simulation in ``tests/test_cost_model.py`` is the reference. A machine where backward and
    the communication thread share cores stays well above ``bound`` (bench/results/overlap.json): this
    model leaves that contention out, and ``--overlap auto`` measures instead of guessing.
    """
    if pieces < 1 or int(pieces) != pieces:
        raise ValueError(f"pieces must be an integer >= 1, got {pieces!r}")
    if not 0.0 <= backward_share <= 1.0:
        raise ValueError(f"backward_share must be in [0, 1], got {backward_share!r}")
    _check_nonneg("overlapped_step", {"compute_s": compute_s, "comm_s": comm_s})
    fwd, bwd, c = (1.0 - backward_share) * compute_s, backward_share * compute_s, comm_s / pieces
    asyn = fwd + max(bwd + c, bwd / pieces + comm_s)
    return {"none": asyn if dense_hook else compute_s + comm_s, "async": asyn,
            "cross_bound": max(compute_s + c, comm_s), "bound": max(compute_s, comm_s)}


ASYNC_MARGIN = 0.03  # async must be this fraction faster than none to pay for its thread


def async_pays(none_s: float, async_s: float, margin: float = ASYNC_MARGIN) -> bool:
    """The one rule for the communication thread (``--overlap auto``'s measurement and the model's
    prediction alike): its step at least ``margin`` (a fraction) shorter than the synchronous one."""
    return async_s < none_s * (1.0 - margin)


def rank_by_step(rows: Sequence[dict[str, object]], compute_s: float, *, overlap: str, pieces: int = 1,
                 backward_share: float = 2 / 3, margin: float = ASYNC_MARGIN
                 ) -> tuple[str, str, list[dict[str, object]]]:
    """``--comm auto`` with the step measured: rank :func:`recommend`'s rows by the predicted step.

    Each row gets ``step_none``, ``step_async``, ``step_cross_bound`` (:func:`overlapped_step` with
    ``compute_s`` and ``pieces``; the dense all-reduce is overlapped by DDP even in ``none``) and
    ``step``, the one it is ranked by: the step of the given ``overlap`` mode (``cross``: its bound), or
    for ``auto`` the better of ``none`` and ``async`` (the two ``--overlap auto`` chooses between).

    Returns ``(method, overlap, rows)``, rows fastest first. ``overlap`` is the given mode, except for
    ``auto``: ``"none"`` when even this contention-free model gives the chosen method's ``async`` less
    than ``margin`` over ``none`` (the thread cannot pay), else ``"auto"`` (it may pay: the trainer
    measures both on the first steps, since the cores backward and the thread share are what the model
    leaves out).
    """
    check_choice("rank_by_step overlap", overlap, OVERLAP_CHOICES)
    if not rows:
        raise ValueError("rows is empty; pass recommend()'s rows")
    out = []
    for r in rows:
        st = overlapped_step(compute_s, float(r["total"]), pieces=pieces,  # type: ignore[arg-type]
                             backward_share=backward_share, dense_hook=r["method"] == "allreduce")
        step = {"none": st["none"], "async": st["async"], "cross": st["cross_bound"],
                "auto": min(st["none"], st["async"])}[overlap]
        out.append({**r, **{f"step_{k}": v for k, v in st.items() if k != "bound"}, "step": step})
    out.sort(key=lambda r: (float(r["step"]), float(r["total"])))  # type: ignore[arg-type]
    best = out[0]
    pays = async_pays(float(best["step_none"]), float(best["step_async"]), margin)  # type: ignore[arg-type]
    return str(best["method"]), "none" if overlap == "auto" and not pays else overlap, out


# ---------------------------------------------------------------- fitting
def _fit_nonneg_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with ``a, b >= 0`` (2-parameter NNLS by checking the faces)."""
    if len(x) != len(y):
        raise ValueError(f"got {len(x)} sizes but {len(y)} times; they must pair up")
    if len(x) < 2:
        raise ValueError(f"need at least 2 measurements to fit, got {len(x)}")
    xs = [float(v) for v in x]
    ys = [float(v) for v in y]
    if not all(math.isfinite(v) and v >= 0 for v in xs + ys):
        raise ValueError("sizes and times must be finite and >= 0")
    if len(set(xs)) < 2:
        raise ValueError("need at least 2 distinct sizes to separate alpha from beta")
    nx = len(xs)
    mx, my = sum(xs) / nx, sum(ys) / nx
    sxx = sum((v - mx) ** 2 for v in xs)
    b = sum((u - mx) * (v - my) for u, v in zip(xs, ys)) / sxx
    a = my - b * mx
    if a >= 0 and b >= 0:
        return a, b                             # unconstrained optimum is feasible
    cands = [(0.0, max(0.0, sum(u * v for u, v in zip(xs, ys)) / max(sum(u * u for u in xs), 1e-300))),
             (max(0.0, my), 0.0)]       # the two faces of the feasible quadrant
    return min(cands, key=lambda ab: sum((ab[0] + ab[1] * u - v) ** 2 for u, v in zip(xs, ys)))


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> LinkParams:
    """Fit ``t = alpha + beta * n`` (non-negative least squares) to one-way message times."""
    a, b = _fit_nonneg_line(sizes_bytes, times_s)
    return LinkParams(a, b)


def fit_per_element(counts: Sequence[float], times_s: Sequence[float]) -> float:
    """Seconds per element from ``(count, time)`` pairs; a fixed overhead is fitted and dropped."""
    return _fit_nonneg_line(counts, times_s)[1]


def fit_collective(kind: str, p: int, sizes_bytes: Sequence[float], times_s: Sequence[float]) -> LinkParams:
    """α, β of a link as seen by one collective among ``p`` ranks, from timings of that collective.

    ``sizes_bytes``: the buffer for all_reduce / reduce_scatter, each rank's share for all_gather.
    Inverts the building-block formulas above, so ``<kind>_time(size, p, fit)`` reproduces the fit.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(COLLECTIVES)}")
    if p < 2:
        raise ValueError(f"need p >= 2 ranks to fit a collective, got {p}")
    # (latency multiplier, bytes multiplier) of each formula
    lat, byt = {"all_reduce": (2 * (p - 1), 2 * (p - 1) / p), "all_gather": (_log2p(p), p - 1),
                "reduce_scatter": (p - 1, (p - 1) / p)}[kind]
    a, b = _fit_nonneg_line([byt * s for s in sizes_bytes], times_s)
    return LinkParams(a / lat, b)


# ---------------------------------------------------------------- the paper's cluster
# Shi et al. 2021 §5.1: 16 Tencent Cloud instances, each 8x V100-32GB with NVLink, 25 Gbit/s Ethernet.
PAPER_M, PAPER_N = 16, 8
# Inter: 25 GbE line rate (paper §5.1) -> beta = 8/25e9 s/B; the paper gives no latency: 50 us is a
# typical TCP message latency inside a cloud VPC (assumption).
PAPER_INTER = LinkParams.from_gbit(25.0, alpha_s=50e-6)
# Intra: NVLink 2.0, 25 GB/s per link and direction, 6 links per V100 (V100 whitepaper); NCCL on 8x V100
# reaches ~100-130 GB/s bus bandwidth -> beta = 1/100e9 s/B, alpha 5 us (assumptions, not paper values).
PAPER_INTRA = LinkParams(5e-6, 1.0 / 100e9)
# V100 compute from HBM2 bandwidth (~900 GB/s), estimates: MSTopK ~30 passes -> 30*4/900e9 s/elem; zero-fill
# 4/900e9; scatter-add of random pairs ~2e-10 s/pair (uncoalesced atomics); local sum 12/900e9 s/elem.
PAPER_COMPUTE = ComputeParams(select_s_per_elem=1.3e-10, dense_s_per_elem=4.4e-12,
                              scatter_s_per_elem=2e-10, reduce_s_per_elem=1.3e-11)
MODEL_SIZES = {"resnet50": 25_557_032, "bert_large": 340_000_000}


def table_rows(ds: Sequence[int], rhos: Sequence[float], m: int, n: int, intra: Link,
               inter: Link, compute: ComputeParams | None, **kwargs: object) -> list[dict[str, object]]:
    """Predictions for every (d, rho, method), with the recommended method flagged."""
    out: list[dict[str, object]] = []
    for d in ds:
        for rho in rhos:
            best, rows = recommend(d, rho, m, n, intra, inter, compute, **kwargs)
            for r in sorted(rows, key=lambda r: METHOD_CHOICES.index(str(r["method"]))):
                out.append({"d": d, "rho": rho, **r, "best": r["method"] == best})
    return out


def format_table(rows: Sequence[dict[str, object]], title: str) -> str:
    lines = [title, f"{'d':>12} {'rho':>7} {'method':>9} {'select':>9} {'comm':>9} {'decomp':>9} "
             f"{'total ms':>9}  best"]
    for r in rows:
        ms = {k: 1e3 * float(r[k]) for k in (*PHASES, "total")}  # type: ignore[arg-type]
        lines.append(f"{r['d']:>12,} {100 * float(r['rho']):>6.2f}% {r['method']:>9} {ms['select']:>9.2f} "
                     f"{ms['communicate']:>9.2f} {ms['decompress']:>9.2f} {ms['total']:>9.2f}  "
                     f"{'<==' if r['best'] else ''}")
    return "\n".join(lines)


def format_steps(rows: Sequence[dict[str, object]], title: str) -> str:
    """The ``--compute-ms`` table: each row's step per overlap mode and the best mode's gain over none."""
    lines = [title, f"{'d':>12} {'rho':>7} {'method':>9} {'none':>9} {'async':>9} {'cross>=':>9} {'gain':>6}"]
    for r in rows:
        ms = {k: 1e3 * float(r[f"step_{k}"]) for k in ("none", "async", "cross_bound")}  # type: ignore[arg-type]
        lines.append(f"{r['d']:>12,} {100 * float(r['rho']):>6.2f}% {r['method']:>9} {ms['none']:>9.2f} "
                     f"{ms['async']:>9.2f} {ms['cross_bound']:>9.2f} {ms['none'] / ms['cross_bound']:>5.2f}x")
    return "\n".join(lines)


def _link_from_json(doc: dict[str, object]) -> Link:
    if "alpha_s" in doc:
        return LinkParams(**doc)  # type: ignore[arg-type]
    return LinkProfile(**{k: LinkParams(**doc[k]) for k in COLLECTIVES})  # type: ignore[arg-type]


def load_measured(path: Path | str) -> tuple[int, int, Link, dict[str, Link], ComputeParams]:
    """Read ``results.model_params`` from a bench/results/comm.json written by bench/comm.py."""
    p = Path(path)
    try:
        mp = json.loads(p.read_text())["results"]["model_params"]
        intra = _link_from_json(mp["intra"])
        inters = {str(k): _link_from_json(v) for k, v in mp["inter"].items()}
        compute = ComputeParams(**mp.get("compute", {}))
        return int(mp["m"]), int(mp["n"]), intra, inters, compute
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SystemExit(f"{p}: cannot read results.model_params ({exc!r}); run `python -m bench.comm` "
                         "to produce it, or pass --alpha-inter/--beta-inter etc. explicitly") from exc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.comm.cost_model",
        description="Predict aggregation time of allreduce / torus / naive_ag / hitopk with an alpha-beta "
                    "model. Default: the paper's cluster (16 nodes x 8 V100, 25 GbE, NVLink).")
    ap.add_argument("--measured", help="bench/results/comm.json from `python -m bench.comm` (fitted links)")
    ap.add_argument("--m", type=int, help="nodes (default 16, or the measured file's)")
    ap.add_argument("--n", type=int, help="ranks per node (default 8, or the measured file's)")
    for flag, hlp in (("--alpha-inter", "inter-node latency, s"), ("--beta-inter", "inter-node s/byte"),
                      ("--inter-gbit", "inter-node Gbit/s (sets beta)"),
                      ("--alpha-intra", "intra-node latency, s"), ("--beta-intra", "intra-node s/byte")):
        ap.add_argument(flag, type=float, help=hlp)
    ap.add_argument("--d", type=int, nargs="+", default=list(MODEL_SIZES.values()),
                    help="gradient sizes in elements (default ResNet-50 25.6M, BERT-large 340M)")
    ap.add_argument("--rho", type=float, nargs="+", default=[0.001, 0.01], help="densities (0.1%%, 1%%)")
    ap.add_argument("--fp16", action="store_true", help="fp16 values on the wire for sparse methods")
    ap.add_argument("--no-nic-shared", action="store_true",
                    help="each inter stream gets the full NIC (as eq. 9 is written)")
    ap.add_argument("--final-gather", choices=FINAL_GATHER_FORMS, default="dense")
    ap.add_argument("--no-compute", action="store_true", help="drop the compute terms (pure alpha-beta)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--compute-ms", type=float,
                    help="forward + backward ms per step without communication: adds each method's step time "
                         "per --overlap mode (ideal, no contention; see overlapped_step)")
    ap.add_argument("--pieces", type=int, default=8,
                    help="buckets/pieces per step for --compute-ms (default 8)")
    a = ap.parse_args(argv)
    if a.compute_ms is not None and (a.compute_ms < 0 or a.pieces < 1):
        ap.error(f"--compute-ms must be >= 0 and --pieces >= 1, got {a.compute_ms} and {a.pieces}")

    if a.measured:
        m, n, intra, inters, compute = load_measured(a.measured)
        source = f"measured ({a.measured})"
    else:
        m, n, intra, inters, compute = PAPER_M, PAPER_N, PAPER_INTRA, {"25gbit": PAPER_INTER}, PAPER_COMPUTE
        source = "paper cluster (Shi et al. 2021 §5.1; alpha/beta assumptions in cost_model.py)"
    m, n = a.m or m, a.n or n
    if a.alpha_intra is not None or a.beta_intra is not None:  # explicit values: one α-β for all kinds
        base = as_profile(intra).all_reduce
        intra = LinkParams(base.alpha_s if a.alpha_intra is None else a.alpha_intra,
                           base.beta_s_per_byte if a.beta_intra is None else a.beta_intra)
    if a.alpha_inter is not None or a.beta_inter is not None or a.inter_gbit is not None:
        beta = 8.0 / (a.inter_gbit * 1e9) if a.inter_gbit is not None else a.beta_inter
        base = as_profile(next(iter(inters.values()))).all_reduce
        inters = {"custom": LinkParams(base.alpha_s if a.alpha_inter is None else a.alpha_inter,
                                       base.beta_s_per_byte if beta is None else beta)}
    kwargs = {"fp16": a.fp16, "nic_shared": not a.no_nic_shared, "final_gather": a.final_gather}
    compute_used = None if a.no_compute else compute
    all_rows = []
    for label, inter in inters.items():
        rows = table_rows(a.d, a.rho, m, n, intra, inter, compute_used, **kwargs)
        if a.compute_ms is not None:
            for r in rows:
                steps = overlapped_step(a.compute_ms / 1e3, float(r["total"]), pieces=a.pieces,  # type: ignore[arg-type]
                                        dense_hook=r["method"] == "allreduce")
                r.update({f"step_{k}": v for k, v in steps.items()})
        all_rows.extend({"inter": label, **r} for r in rows)
        if not a.json:
            print(format_table(rows, f"{source}: m={m} nodes x n={n} ranks, inter {label} {inter}, "
                                     f"intra {intra}, compute {compute_used}") + "\n")
            if a.compute_ms is not None:
                print(format_steps(rows, f"step ms with {a.compute_ms:g} ms of compute, {a.pieces} pieces "
                                         "(ideal overlap, no contention)") + "\n")
    if a.json:
        print(json.dumps(all_rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
