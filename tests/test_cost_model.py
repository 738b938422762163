"""Tests of trainer/comm/cost_model.py: formulas on hand-computed cases, fitting, recommend, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.comm.cost_model import (
    METHOD_CHOICES,
    PAPER_COMPUTE,
    PAPER_INTER,
    PAPER_INTRA,
    ComputeParams,
    CostConfig,
    LinkParams,
    LinkProfile,
    all_gather_time,
    all_reduce_time,
    fit_collective,
    fit_link,
    fit_per_element,
    main,
    predict,
    recommend,
)

INTRA = LinkParams(1e-6, 1e-10)
INTER = LinkParams(1e-4, 1e-8)
ROOT = Path(__file__).resolve().parents[1]


def test_dense_ring_hand_computed() -> None:
    # P = 4 over the inter link: 2*3*alpha + 2*3/4 * 4000 bytes * beta
    r = predict("allreduce", d=1000, rho=0.5, m=2, n=2, intra=INTRA, inter=INTER)
    assert r["total"] == pytest.approx(6e-4 + 1.5 * 4000 * 1e-8)
    assert r["select"] == 0 and r["decompress"] == 0
    # a single node uses the intra link only
    r1 = predict("allreduce", d=1000, rho=0.5, m=1, n=4, intra=INTRA, inter=INTER)
    assert r1["total"] == pytest.approx(6e-6 + 1.5 * 4000 * 1e-10)
    # every ring step waits for its slowest hop: an intra link slower than the inter one sets the pace
    slow_intra = LinkParams(1e-6, 2e-8)
    r2 = predict("allreduce", d=1000, rho=0.5, m=2, n=2, intra=slow_intra, inter=INTER)
    assert r2["total"] == pytest.approx(6e-4 + 1.5 * 4000 * 2e-8)


def test_torus_hand_computed() -> None:
    d, m, n = 1200, 3, 2
    rs = 1 * 1e-6 + 0.5 * 4 * d * 1e-10               # intra reduce-scatter of 4d bytes among 2
    ar = 2 * 2 * 1e-4 + 2 * 2 / 3 * (4 * d / n) * (2e-8)   # inter all-reduce, 2 streams share the NIC
    ag = 1 * 1e-6 + 1 * (4 * d / n) * 1e-10            # intra all-gather of 4d/n per rank
    r = predict("torus", d=d, rho=0.01, m=m, n=n, intra=INTRA, inter=INTER)
    assert r["communicate"] == pytest.approx(rs + ar + ag)
    # eq. 9 as written (no NIC sharing): the inter term halves its beta part
    r2 = predict("torus", d=d, rho=0.01, m=m, n=n, intra=INTRA, inter=INTER, nic_shared=False)
    assert r2["communicate"] == pytest.approx(rs + 4e-4 + 4 / 3 * 2400 * 1e-8 + ag)


def test_naive_ag_eq3_and_compute_terms() -> None:
    c = ComputeParams(select_s_per_elem=1e-9, dense_s_per_elem=2e-10, scatter_s_per_elem=3e-9)
    d, rho, m, n = 10_000, 0.01, 2, 4    # P = 8, k = 100
    r = predict("naive_ag", d=d, rho=rho, m=m, n=n, intra=INTRA, inter=INTER, compute=c)
    # eq. 3 with packed 8-byte pairs: alpha*log2(8) + (P-1) * 8k * beta
    assert r["communicate"] == pytest.approx(3 * 1e-4 + 7 * 800 * 1e-8)
    assert r["select"] == pytest.approx(d * 1e-9)
    assert r["decompress"] == pytest.approx(d * 2e-10 + 8 * 100 * 3e-9)
    assert r["total"] == pytest.approx(r["select"] + r["communicate"] + r["decompress"])
    # fp16 values: 6 bytes per pair
    r16 = predict("naive_ag", d=d, rho=rho, m=m, n=n, intra=INTRA, inter=INTER, fp16=True)
    assert r16["communicate"] == pytest.approx(3 * 1e-4 + 7 * 600 * 1e-8)


def test_hitopk_eqs_7_to_10() -> None:
    c = ComputeParams(select_s_per_elem=1e-9, dense_s_per_elem=2e-10, scatter_s_per_elem=3e-9)
    d, rho, m, n = 8000, 0.01, 4, 2    # d/n = 4000, k~ = 40
    t1 = 1e-6 + 0.5 * 32000 * 1e-10                    # eq. 7
    t3 = 2 * 1e-4 + 3 * (8 * 40) * (2 * 1e-8)           # eq. 9, 2 streams share the NIC
    t4 = 1e-6 + 1 * 16000 * 1e-10                       # dense d/n slice gathered
    r = predict("hitopk", d=d, rho=rho, m=m, n=n, intra=INTRA, inter=INTER, compute=c)
    assert r["communicate"] == pytest.approx(t1 + t3 + t4)
    assert r["select"] == pytest.approx(4000 * 1e-9)    # eq. 8: linear in d/n
    assert r["decompress"] == pytest.approx(4000 * 2e-10 + 4 * 40 * 3e-9)
    # eq. 10 variant: gather the m*k~ sparse pairs instead of the dense slice
    rs = predict("hitopk", d=d, rho=rho, m=m, n=n, intra=INTRA, inter=INTER, final_gather="sparse")
    assert rs["communicate"] == pytest.approx(t1 + t3 + 1e-6 + 1 * (8 * 4 * 40) * 1e-10)


def test_building_block_and_single_rank() -> None:
    assert all_gather_time(100, 1, INTER) == 0.0
    assert all_gather_time(100, 5, INTER) == pytest.approx(3 * 1e-4 + 4 * 100 * 1e-8)  # ceil(log2 5) = 3
    for meth in METHOD_CHOICES:
        assert predict(meth, 1000, 0.01, 1, 1, INTRA, INTER)["communicate"] == 0.0


def test_fit_link_recovers_exact_and_noisy_data() -> None:
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    link = fit_link(sizes, [2e-4 + 8e-9 * s for s in sizes])
    assert link.alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert link.beta_s_per_byte == pytest.approx(8e-9, rel=1e-9)
    # data whose unconstrained fit has a negative intercept is clamped to alpha = 0
    neg = fit_link([1e6, 2e6, 3e6], [0.5e-3, 2e-3, 3.5e-3])
    assert neg.alpha_s == 0.0 and neg.beta_s_per_byte > 0
    assert fit_per_element([1e6, 2e6, 4e6], [1e-3 + 1e-9 * x for x in (1e6, 2e6, 4e6)]) == pytest.approx(1e-9)
    with pytest.raises(ValueError, match="distinct"):
        fit_link([5, 5], [1.0, 2.0])
    with pytest.raises(ValueError, match="pair up"):
        fit_link([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        fit_link([1], [1.0])


def test_recommend_slow_link_picks_hitopk_fast_link_or_dense_rho_does_not() -> None:
    slow = LinkParams.from_gbit(1.0, alpha_s=50e-6)
    best, rows = recommend(25_000_000, 0.01, 16, 8, PAPER_INTRA, slow, PAPER_COMPUTE)
    assert best == "hitopk" and rows[0]["method"] == "hitopk"
    assert {r["method"] for r in rows} == set(METHOD_CHOICES)
    assert rows == sorted(rows, key=lambda r: r["total"])
    # the paper's own cluster at 1 % density for ResNet-50 and BERT-large
    for d in (25_557_032, 340_000_000):
        assert recommend(d, 0.01, 16, 8, PAPER_INTRA, PAPER_INTER, PAPER_COMPUTE)[0] == "hitopk"
    # rho near 1: sparse pairs cost more bytes than a dense reduction -> a dense method wins
    assert recommend(25_000_000, 1.0, 16, 8, PAPER_INTRA, slow, PAPER_COMPUTE)[0] in ("torus", "allreduce")
    # inter link as fast as NVLink with CPU-speed selection: compute outweighs the byte savings
    fast = LinkParams(5e-6, 1 / 100e9)
    cpu = ComputeParams(select_s_per_elem=1e-8, dense_s_per_elem=1e-9, scatter_s_per_elem=5e-9)
    assert recommend(25_000_000, 0.01, 16, 8, PAPER_INTRA, fast, cpu)[0] in ("torus", "allreduce")
    # ... while the same compute on a 1 Gbit/s inter link still favours hitopk
    assert recommend(25_000_000, 0.01, 16, 8, PAPER_INTRA, slow, cpu)[0] == "hitopk"


def test_fit_collective_inverts_each_formula_and_profiles_route_per_collective() -> None:
    truth = LinkParams(3e-4, 2e-9)
    sizes = [1e5, 1e6, 1e7]
    for p in (2, 4, 5):
        for kind, fn in (("all_reduce", all_reduce_time), ("all_gather", all_gather_time)):
            fitted = fit_collective(kind, p, sizes, [fn(s, p, truth) for s in sizes])
            assert fitted.alpha_s == pytest.approx(3e-4) and fitted.beta_s_per_byte == pytest.approx(2e-9)
    with pytest.raises(ValueError, match="all_reduce, all_gather, reduce_scatter"):
        fit_collective("broadcast", 2, sizes, [1.0, 2.0, 3.0])
    # a profile whose all-gather is 5x slower changes only the steps that all-gather
    slow_ag = LinkProfile(INTRA, LinkParams(INTRA.alpha_s, 5 * INTRA.beta_s_per_byte), INTRA)
    d, m, n = 8000, 4, 2
    base = predict("hitopk", d, 0.01, m, n, INTRA, INTER)
    prof = predict("hitopk", d, 0.01, m, n, slow_ag, INTER)
    assert prof["communicate"] - base["communicate"] == pytest.approx(4 * (4 * d / n) * INTRA.beta_s_per_byte)
    same = predict("allreduce", d, 0.01, m, n, INTRA, INTER)
    assert predict("allreduce", d, 0.01, m, n, slow_ag, INTER) == same
    assert predict("torus", d, 0.01, m, n, LinkProfile.uniform(INTRA), INTER) == predict(
        "torus", d, 0.01, m, n, INTRA, INTER)
    with pytest.raises(TypeError, match="LinkParams or LinkProfile"):
        predict("torus", d, 0.01, m, n, (1e-6, 1e-9), INTER)  # type: ignore[arg-type]


def test_config_errors_list_valid_choices() -> None:
    with pytest.raises(ValueError) as e:
        predict("ring", 1000, 0.01, 2, 2, INTRA, INTER)
    for name in METHOD_CHOICES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="dense, sparse"):
        CostConfig("hitopk", 1000, 0.01, 2, 2, final_gather="tree")
    with pytest.raises(ValueError, match="rho"):
        CostConfig("hitopk", 1000, 0.0, 2, 2)
    with pytest.raises(ValueError, match=r"m \(nodes\) must be an integer"):
        CostConfig("torus", 1000, 0.1, 0, 2)
    with pytest.raises(ValueError, match="beta_s_per_byte"):
        LinkParams(1e-6, -1.0)
    with pytest.raises(ValueError, match="methods is empty"):
        recommend(1000, 0.1, 2, 2, INTRA, INTER, methods=())


def test_cli_help_and_paper_table_subprocess() -> None:
    h = subprocess.run([sys.executable, "-m", "trainer.comm.cost_model", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and "--measured" in h.stdout
    t = subprocess.run([sys.executable, "-m", "trainer.comm.cost_model"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    assert "m=16 nodes x n=8" in t.stdout and "25,557,032" in t.stdout and "340,000,000" in t.stdout
    assert t.stdout.count("<==") == 4          # one recommendation per (d, rho)


def test_cli_measured_file_and_explicit_links(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"results": {"model_params": {
        "m": 2, "n": 2, "intra": {k: {"alpha_s": 1e-4, "beta_s_per_byte": 5e-10}
                                  for k in ("all_reduce", "all_gather", "reduce_scatter")},
        "inter": {"1gbit": {"alpha_s": 2e-4, "beta_s_per_byte": 8e-9},
                  "10gbit": {"alpha_s": 2e-4, "beta_s_per_byte": 8e-10}},
        "compute": {"select_s_per_elem": 2e-8, "scatter_s_per_elem": 1e-8}}}}
    f = tmp_path / "comm.json"
    f.write_text(json.dumps(doc))
    assert main(["--measured", str(f), "--d", "25000000", "--rho", "0.01", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["inter"] for r in rows} == {"1gbit", "10gbit"} and len(rows) == 8
    want = predict("hitopk", 25_000_000, 0.01, 2, 2, LinkParams(1e-4, 5e-10), LinkParams(2e-4, 8e-9),
                   ComputeParams(select_s_per_elem=2e-8, scatter_s_per_elem=1e-8))
    got = next(r for r in rows if r["inter"] == "1gbit" and r["method"] == "hitopk")
    assert got["total"] == pytest.approx(want["total"])
    assert main(["--inter-gbit", "1", "--m", "2", "--n", "2", "--d", "1000", "--rho", "1.0"]) == 0
    assert "m=2 nodes x n=2" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="model_params"):
        main(["--measured", str(bad)])


# ------------------------------------------------------- overlap: the reference is an event simulation
def _simulate_none_async(fwd: float, bwd: float, comm: float, n: int) -> tuple[float, float]:
    """One step, event by event: backward produces piece i at fwd + bwd * i / n; one server, first in first
    out. Synchronous: backward stops while each piece communicates. Asynchronous: it does not."""
    c = comm / n
    t = fwd
    for _ in range(n):  # synchronous hook
        t += bwd / n + c
    free = 0.0
    for i in range(1, n + 1):  # communication thread
        free = max(free, fwd + bwd * i / n) + c
    return t, free


def _simulate_cross(fwd: float, bwd: float, comm: float, n: int, iters: int = 80) -> float:
    """Steady-state step of --overlap cross: layer l's forward (fwd / n) waits for piece l's update of the
    previous step; backward (bwd / n per layer, last layer first) produces piece l; one server, not
    preempted, starts the ready piece of the oldest step and front-most layer; the update is immediate."""
    c, f, b = comm / n, fwd / n, bwd / n
    update = [0.0] * (n + 1)
    pending: list[tuple[int, int, float]] = []  # (step, layer, ready time)
    free, t, ends = 0.0, 0.0, []
    for k in range(iters):
        for layer in range(1, n + 1):
            while update[layer] < 0:  # serve until this layer's update of the previous step is done
                ready = [p for p in pending if p[2] <= free]
                if not ready:  # idle until backward produces the next piece
                    free = min(p[2] for p in pending)
                    continue
                pick = min(ready, key=lambda p: (p[0], p[1]))
                pending.remove(pick)
                free += c
                update[pick[1]] = free
            t = max(t, update[layer]) + f
        for layer in range(n, 0, -1):
            t += b
            pending.append((k, layer, t))
            update[layer] = -1.0
        ends.append(t)
    half = iters // 2
    return (ends[-1] - ends[half]) / (iters - 1 - half)


def test_overlapped_step_against_an_event_simulation() -> None:
    import random

    from trainer.comm.cost_model import overlapped_step

    rng = random.Random(7)
    for _ in range(400):
        compute, comm, n = rng.uniform(0.01, 3.0), rng.uniform(0.0, 4.0), rng.randint(1, 12)
        share = rng.uniform(0.3, 0.9)
        got = overlapped_step(compute, comm, pieces=n, backward_share=share)
        fwd, bwd = (1 - share) * compute, share * compute
        none, asyn = _simulate_none_async(fwd, bwd, comm, n)
        assert got["none"] == pytest.approx(none) and got["async"] == pytest.approx(asyn)
        cross = _simulate_cross(fwd, bwd, comm, n)
        assert got["bound"] - 1e-9 <= got["cross_bound"] <= cross + 1e-9 <= asyn + 2e-9
        assert cross <= got["cross_bound"] + (fwd + bwd) / n + 2 * comm / n + 1e-9  # the waits it leaves out
    for share in (0.3 / 1.3, 1 / 1.3):  # docs/cost_model.md: 1.3x needs comm between 23 % and 77 % of none
        edge = overlapped_step(1 - share, share)
        assert edge["none"] / edge["bound"] == pytest.approx(1.3)
    dense = overlapped_step(0.2, 0.1, pieces=4, dense_hook=True)
    assert dense["none"] == dense["async"]  # DDP's own all-reduce already overlaps
    one = overlapped_step(0.3, 0.3, pieces=1)
    assert one["async"] == one["none"] == pytest.approx(0.6)  # one piece: nothing to overlap with
    with pytest.raises(ValueError, match="pieces must be an integer >= 1"):
        overlapped_step(1.0, 1.0, pieces=0)
    with pytest.raises(ValueError, match="backward_share must be in"):
        overlapped_step(1.0, 1.0, backward_share=1.5)


def test_cli_compute_ms_adds_the_step_per_overlap_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.comm.cost_model import main, overlapped_step

    assert main(["--compute-ms", "200", "--d", "25557032", "--rho", "0.01", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        want = overlapped_step(0.2, r["total"], pieces=8, dense_hook=r["method"] == "allreduce")
        assert {k: r[f"step_{k}"] for k in want} == pytest.approx(want)
    assert main(["--compute-ms", "200", "--d", "25557032", "--rho", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "step ms with 200 ms of compute, 8 pieces (ideal overlap, no contention)" in out
    assert "cross>=" in out
