"""``--comm auto``: this job's links, selection cost and forward + backward measured at start
(trainer.comm.probe), the method with the shortest predicted step (with ``--overlap auto`` also whether
the thread can pay), the same on every rank, said in the log, recorded in checkpoints and kept by a
resume; the measurement leaves the model as it was (real gloo groups)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tests.dist_utils import run_distributed
from trainer.comm import cost_model as cm
from trainer.comm.names import METHOD_CHOICES
from trainer.comm.probe import fit_profile
from trainer.train_config import make_config


def test_config_takes_auto_alone() -> None:
    from datacache.config import ConfigError

    assert make_config(comm="auto").comm == "auto"
    with pytest.raises(ConfigError, match="auto picks one method for the whole run"):
        make_config(comm="0:auto,3:torus")
    with pytest.raises(ConfigError, match=r"choose one of allreduce.* or auto"):
        make_config(comm="fastest")


def test_fit_profile_recovers_a_link_from_the_collectives_own_formulas() -> None:
    """Timings made with the textbook formulas (ring all_reduce 2(p-1)α + 2(p-1)/p Bβ, all_gather
    ⌈log2 p⌉α + (p-1)bβ, reduce_scatter (p-1)α + (p-1)/p Bβ) of a known link are fitted back to it."""
    alpha, beta, p = 2e-4, 8 / 1e9, 4
    sizes = [65536.0, 1048576.0, 4194304.0]
    times = {"all_reduce": [2 * (p - 1) * alpha + 2 * (p - 1) / p * s * beta for s in sizes],
             "all_gather": [2 * alpha + (p - 1) * s * beta for s in sizes],
             "reduce_scatter": [(p - 1) * alpha + (p - 1) / p * s * beta for s in sizes]}
    prof = fit_profile({k: {"sizes_bytes": sizes, "times_s": t} for k, t in times.items()}, p)
    for link in (prof.all_reduce, prof.all_gather, prof.reduce_scatter):
        assert link.alpha_s == pytest.approx(alpha, rel=1e-6) and link.beta_s_per_byte == pytest.approx(beta)


def test_the_model_picks_sparse_on_a_slow_link_and_dense_on_a_fast_one() -> None:
    """What the probe feeds the model decides: 0.1 Gbit/s between nodes and 25M gradients at 1 %: a sparse
    method; a 400 Gbit/s link and 10k gradients with a costly selection: a dense method."""
    slow = cm.LinkParams.from_gbit(0.1, 1e-4)
    fast = cm.LinkParams.from_gbit(400.0, 1e-6)
    costly = cm.ComputeParams(select_s_per_elem=1e-8)
    assert cm.recommend(25_000_000, 0.01, 2, 2, fast, slow, costly)[0] in ("hitopk", "naive_ag")
    assert cm.recommend(10_000, 0.01, 2, 2, fast, fast, costly)[0] in ("allreduce", "torus")  # dense


def _choose(rank: int, world: int) -> dict:
    from trainer.comm.probe import choose_method
    from trainer.comm.topology import Topology

    topo = Topology.from_env(2)
    c = choose_method(topo, 200_000, 0.01, reps=2)
    return {"method": c.method, "rows": [r["method"] for r in c.rows], "line": c.line(),
            "inter": c.inter.all_reduce.beta_s_per_byte, "intra": c.intra.all_reduce.beta_s_per_byte,
            "select": c.compute.select_s_per_elem}


def test_every_rank_measures_and_picks_the_same_method() -> None:
    res = run_distributed(_choose, world_size=4, local_size=2)
    assert len({r["method"] for r in res}) == 1 and res[0]["method"] in METHOD_CHOICES
    assert sorted(res[0]["rows"]) == sorted(METHOD_CHOICES)
    # measured, not defaults: selection always costs; both "links" are loopback here, so one of the two
    # fits may come out at beta 0 (a 4 MiB all_reduce no slower than 64 KiB within the noise)
    assert res[0]["select"] > 0 and max(res[0]["inter"], res[0]["intra"]) > 0
    assert min(res[0]["inter"], res[0]["intra"]) >= 0
    assert len({(r["inter"], r["intra"], r["select"]) for r in res}) == 1  # the same fits on every rank
    line = res[0]["line"]
    assert line.startswith(f"--comm auto: {res[0]['method']} (predicted ms per step for 200,000")
    assert "Gbit/s" in line


def _rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.run import train
    from trainer.train_config import TrainConfig

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        result = train(TrainConfig.from_dict(cfg_values))
    params = torch.cat([p.detach().flatten() for p in result.model.parameters()])
    buffers = torch.cat([b.detach().double().flatten() for b in result.model.buffers()])
    return {"said": said.getvalue(), "params": params.tolist(), "buffers": buffers.tolist(),
            "losses": result.step_losses}


def _sim_step(compute: float, comm: float, n: int, share: float, dense_hook: bool) -> dict[str, float]:
    """The synchronous and asynchronous step by event simulation (tests/test_cost_model.py's reference)."""
    from tests.test_cost_model import _simulate_none_async

    none, asyn = _simulate_none_async((1 - share) * compute, share * compute, comm, n)
    return {"none": asyn if dense_hook else none, "async": asyn}


def test_rank_by_step_ranks_by_the_simulated_step_of_the_mode_that_will_run() -> None:
    """The method is the one whose step -- not communication alone -- is the shortest in the mode that
    will run (reference: the event simulation); with --overlap auto the mode is none when the chosen
    method's async gains under the margin, else left to the trainer's measurement."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        rows = [{"method": m, "total": rng.uniform(0.0, 0.5)} for m in METHOD_CHOICES]
        compute, n, share = rng.uniform(0.01, 1.0), rng.randint(1, 10), rng.uniform(0.4, 0.8)
        sims = {r["method"]: _sim_step(compute, r["total"], n, share, r["method"] == "allreduce")
                for r in rows}
        for overlap in ("none", "async", "auto"):
            method, mode, ranked = cm.rank_by_step(rows, compute, overlap=overlap, pieces=n,
                                                   backward_share=share, margin=0.03)
            key = {"none": lambda s: s["none"], "async": lambda s: s["async"],
                   "auto": lambda s: min(s["none"], s["async"])}[overlap]
            best = min(key(s) for s in sims.values())
            assert key(sims[method]) == pytest.approx(best), (overlap, rows)
            assert ranked[0]["method"] == method and len(ranked) == len(rows)
            if overlap != "auto":
                assert mode == overlap
            else:
                pays = sims[method]["async"] < 0.97 * sims[method]["none"] - 1e-12
                assert mode == ("auto" if pays else "none") or abs(
                    sims[method]["async"] - 0.97 * sims[method]["none"]) < 1e-9
    # the dense all-reduce overlaps in DDP's own hook: it wins with a slightly slower link than torus
    rows = [{"method": "torus", "total": 0.10}, {"method": "allreduce", "total": 0.12}]
    assert cm.rank_by_step(rows, 1.0, overlap="none", pieces=8)[0] == "allreduce"
    # communication a sliver of the step: the thread cannot pay -> none, not measured
    assert cm.rank_by_step([{"method": "hitopk", "total": 0.001}], 1.0, overlap="auto", pieces=8)[1] == "none"
    assert cm.rank_by_step([{"method": "hitopk", "total": 0.3}], 0.5, overlap="auto", pieces=8)[1] == "auto"
    # the dense all-reduce gains nothing from the thread (DDP overlaps it already)
    # one bucket: nothing to overlap with, whatever the link
    assert cm.rank_by_step([{"method": "hitopk", "total": 0.3}], 0.5, overlap="auto", pieces=1)[1] == "none"
    dense = [{"method": "allreduce", "total": 0.3}]
    assert cm.rank_by_step(dense, 0.5, overlap="auto", pieces=8)[1] == "none"
    with pytest.raises(ValueError, match="choose one of none, async, cross, auto"):
        cm.rank_by_step(rows, 1.0, overlap="sometimes")


def _measure(rank: int, world: int) -> dict:
    from torch import nn

    from trainer.comm.probe import measure_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(),
                          nn.LazyLinear(10))
    model(torch.zeros(2, 3, 12, 12))  # materialise the lazy layer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(16, 3, 12, 12), torch.arange(16) % 10
    rng = torch.get_rng_state()
    st = measure_step(model, x, y, reps=2)
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return {"seconds": st.seconds, "share": st.backward_share, "same": same,
            "grads": [p.grad is None for p in model.parameters()],
            "rng": torch.equal(rng, torch.get_rng_state())}


def test_measure_step_leaves_the_model_and_rng_as_they_were() -> None:
    res = run_distributed(_measure, world_size=2, local_size=2)
    assert all(r["same"] and all(r["grads"]) and r["rng"] for r in res)  # BatchNorm stats, grads, dropout RNG
    assert res[0]["seconds"] == res[1]["seconds"] > 0  # the mean over the ranks, on every rank
    assert 0 <= res[0]["share"] <= 1  # the forward timed apart: clamped, never outside


@pytest.mark.slow
def test_trainer_auto_picks_logs_records_and_a_resume_keeps_it(digits_data, tmp_path) -> None:
    out = tmp_path / "run"
    base = dict(data=digits_data["val"], val_data=digits_data["val"], cache=digits_data["cache"],
                short_side=32, model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16",
                batch_size="48", epochs=1, lr=0.1, lr_scaling="none", workers=0, device="cpu", progress=False,
                seed=5, val_every=0, out=str(out), keep_checkpoints=0, checkpoint_every=3, comm="auto",
                density=0.05, steps_per_epoch=5)
    res = run_distributed(_rank, world_size=4, local_size=2, args=(make_config(**base).to_dict(),))
    said = res[0]["said"]
    line = next(ln for ln in said.splitlines() if "--comm auto:" in ln)
    method = line.split("--comm auto: ", 1)[1].split(" ", 1)[0]
    assert method in METHOD_CHOICES
    ckpt = out / "checkpoints" / "step00000003"
    saved = torch.load(ckpt / "train.pt", weights_only=True)
    assert json.loads(saved["config"])["comm"] == method  # the checkpoint records the chosen method
    assert json.loads(saved["schedules"])["comm_method"] == method
    again = {**base, "resume": str(ckpt), "epochs": 1}
    res = run_distributed(_rank, world_size=4, local_size=2, args=(make_config(**again).to_dict(),))
    said = res[0]["said"]
    assert f"--comm auto: {method}, the method of the checkpoint (no new measurement on resume)" in said
    assert "resumed from" in said and "step 3" in said


@pytest.mark.slow
def test_trainer_auto_with_overlap_auto_does_what_it_says_and_trains_as_the_named_method(digits_data,
                                                                                          tmp_path) -> None:
    """--comm auto --overlap auto: the method line gives the measured step, the overlap line says none
    (then no measuring steps run) or leaves it to the measurement (then its decision is logged); the run
    trains exactly as the same run with the chosen method named (the probe's forward and backward leave
    the model, its BatchNorm statistics and the RNG as they were)."""
    base = dict(data=digits_data["val"], val_data=digits_data["val"], cache=digits_data["cache"],
                short_side=32, model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16",
                batch_size="16", epochs=1, lr=0.1, lr_scaling="none", workers=0, device="cpu", progress=False,
                seed=5, val_every=0, keep_checkpoints=0, comm="auto", overlap="auto", density=0.05,
                bucket_cap_mb=0.004)  # ~20 buckets: the thread may pay (then measured: 19 of the 21 steps)
    res = run_distributed(_rank, world_size=2, local_size=1,
                          args=(make_config(**base, out=str(tmp_path / "auto")).to_dict(),))
    said = res[0]["said"]
    line = next(ln for ln in said.splitlines() if ln.startswith("--comm auto: "))
    method = line.split("--comm auto: ", 1)[1].split(" ", 1)[0]
    assert method in METHOD_CHOICES and "ms of forward + backward measured" in line
    assert "by the better of the synchronous and the asynchronous hooks" in line
    said_overlap = next(ln for ln in said.splitlines() if ln.startswith("--comm auto, --overlap auto: "))
    start = json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])
    if "not measured" in said_overlap:
        assert start["config"]["overlap"] == "none"
        assert "--overlap auto: " not in said.replace(said_overlap, "")  # no measuring steps
    else:
        assert start["config"]["overlap"] == "auto" and "both are timed on the first steps" in said_overlap
        assert "--overlap auto: none (median step" in said or "--overlap auto: async (median step" in said
    print(line, said_overlap, sep="\n")  # what a user reads (pytest -s)
    named = {**base, "comm": method, "overlap": "none", "out": str(tmp_path / "named")}
    ref = run_distributed(_rank, world_size=2, local_size=1, args=(make_config(**named).to_dict(),))
    for a, b in zip(res, ref):  # --overlap auto's modes are bit for bit alike (tests/test_overlap_auto.py)
        assert a["losses"] == b["losses"] and a["params"] == b["params"] and a["buffers"] == b["buffers"]
