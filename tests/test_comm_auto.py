"""``--comm auto``: this job's links and selection cost measured at start (trainer.comm.probe), the
cheapest method by the cost model, the same on every rank, said in the log, recorded in checkpoints and
kept by a resume (real gloo groups, 2 nodes x 2 ranks)."""

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
        train(TrainConfig.from_dict(cfg_values))
    return {"said": said.getvalue()}


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
