"""DDP comm hooks on 4 real gloo ranks (2 nodes x 2): equality with plain DDP, NaN skipping,
error-feedback checkpoints, the method switch. One spawned run; the parent asserts.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from tests.dist_utils import run_distributed
from tests.test_comm_algorithms import from_plain, to_plain
from trainer.comm.comm_config import CommConfig
from trainer.comm.error_feedback import ErrorFeedback
from trainer.comm.state import HookState
from trainer.comm.switch import MethodSchedule
from trainer.comm.topology import Topology

WORLD, LOCAL = 4, 2
CAP_MB = 0.001  # ~260 floats per bucket: several buckets for a 676-parameter model


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _ddp(state: HookState | None, model: nn.Module | None = None) -> nn.parallel.DistributedDataParallel:
    from trainer.comm import register

    ddp = nn.parallel.DistributedDataParallel(model or _model(), bucket_cap_mb=CAP_MB)
    if state is not None:
        register(ddp, state)
    return ddp


def _state(**config: object) -> HookState:
    return HookState(CommConfig(**config))  # type: ignore[arg-type]


def _backward(ddp: nn.Module, rank: int, step: int, nan: bool = False) -> None:
    x, y = _batch(rank, step)
    if nan:
        x[0, 0] = float("nan")
    ddp.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()


def _grads(ddp: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in ddp.module.parameters()]


def _grads_after_two_steps(rank: int, state: HookState | None) -> list[torch.Tensor]:
    """Step 0 (dense for sparse hooks, DDP rebuilds buckets after it), then step 1's grads."""
    ddp = _ddp(state)
    for step in range(2):
        _backward(ddp, rank, step)
        if state is not None:
            state.finish_step()
    return _grads(ddp)


def _rank_main(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from trainer.comm import maybe_step

    out: dict = {"plain": _grads_after_two_steps(rank, None), "hooked": {}}
    configs = [("allreduce", "mstopk", False), ("torus", "mstopk", False), ("allreduce", "mstopk", True),
               ("torus", "mstopk", True), ("naive_ag", "exact", True), ("hitopk", "mstopk", True)]
    configs += [(m, s, False) for m in ("naive_ag", "hitopk") for s in ("mstopk", "exact", "dgc")]
    for method, sel, fp16 in configs:
        st = _state(method=method, selector=sel, density=1.0, fp16=fp16, min_numel_for_sparse=0,
                    partition_numel=128 if method == "hitopk" else 0)
        out["hooked"][(method, sel, fp16)] = _grads_after_two_steps(rank, st)

    # wrap() (DDP built for us) with gradient_as_bucket_view: grads are views of the buckets
    from trainer.comm import wrap

    cfg = CommConfig(method="hitopk", selector="exact", density=1.0, min_numel_for_sparse=0)
    ddp, st = wrap(_model(), cfg, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=True)
    for step in range(2):
        _backward(ddp, rank, step)
        st.finish_step()
    out["hooked"][("hitopk", "exact", "wrap+bucket_view")] = _grads(ddp)

    # NaN on rank 3 at step 1: every rank skips, parameters and residuals stay, skip counted.
    nan: dict = {}
    for method in ("allreduce", "torus", "naive_ag", "hitopk"):
        st = _state(method=method, selector="mstopk", density=0.1, min_numel_for_sparse=0)
        ddp = _ddp(st)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        stepped, unchanged, res_kept = [], [], []
        for step in range(3):
            before = [p.detach().clone() for p in ddp.parameters()]
            res_before = {k: st.ef.get(k).clone() for k in st.ef.keys()}  # noqa: SIM118
            _backward(ddp, rank, step, nan=(step == 1 and rank == 3))
            stepped.append(maybe_step(opt, st))
            unchanged.append(all(torch.equal(a, p) for a, p in zip(before, ddp.parameters())))
            res_kept.append(all(torch.equal(v, st.ef.get(k)) for k, v in res_before.items()))
        nan[method] = {"stepped": stepped, "unchanged": unchanged, "res_kept": res_kept,
                       "skipped": st.skipped_steps,
                       "finite": all(torch.isfinite(p).all() for p in ddp.parameters())}
    out["nan"] = nan

    # Error-feedback checkpoint: continue with the original state vs. a reloaded copy.
    st = _state(method="hitopk", selector="exact", density=0.05, min_numel_for_sparse=0)
    ddp = _ddp(st)
    for step in range(3):
        _backward(ddp, rank, step)
        st.finish_step()
    buf = io.BytesIO()
    torch.save(st.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    st2 = _state(method="hitopk", selector="exact", density=0.05, min_numel_for_sparse=0)
    st2.topo = Topology.from_env()
    st2.load_state_dict(loaded)
    ddp2 = _ddp(st2, model=copy.deepcopy(ddp.module))
    keys = sorted(st.ef.keys())
    out["ckpt"] = {"keys": keys, "same": all(torch.equal(st.ef.get(k), st2.ef.get(k)) for k in keys),
                   "counters": (st2.step, st2.skipped_steps)}
    # The resumed DDP's first step is the dense layout warm-up: residuals must survive it ...
    _backward(ddp2, rank, 3)
    st2.finish_step()
    out["ckpt"]["kept"] = sorted(st2.ef.keys()) == keys and all(
        torch.equal(st.ef.get(k), st2.ef.get(k)) for k in keys)
    # ... and the next sparse step uses them exactly like the uninterrupted run does.
    _backward(ddp, rank, 4)
    _backward(ddp2, rank, 4)
    out["ckpt"]["grads"] = (_grads(ddp), _grads(ddp2))
    out["ckpt"]["after"] = (sorted(st2.ef.keys()) == keys, st2.ef.dropped)
    out["ckpt"]["residual_moved"] = not all(torch.equal(st2.ef.get(k), loaded["ef"]["residuals"][k])
                                            for k in keys)

    # Switch: hitopk (step 0 dense by design, step 1 sparse) -> torus at step 2, no optimizer steps
    sched = MethodSchedule([(0, "hitopk"), (2, "torus")], unit="step")
    st = _state(schedule=sched, selector="exact", density=0.05, min_numel_for_sparse=0)
    ddp = _ddp(st)
    plain = _model()
    active, ef_sizes, reduced, local = [], [], [], []
    for step in range(3):
        _backward(ddp, rank, step)
        reduced.append(_grads(ddp))
        x, y = _batch(rank, step)
        plain.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        g = [p.grad.detach().clone() for p in plain.parameters()]
        for t in g:
            dist.all_reduce(t)
        local.append(g)
        active.append(st.active_method)
        ef_sizes.append(len(st.ef))
        st.finish_step()
    out["switch"] = {"active": active, "ef_sizes": ef_sizes, "switches": st.switches,
                     "sent": [sum(r[i] for r in reduced) * world for i in range(4)],
                     "total": [sum(g[i] for g in local) for i in range(4)],
                     "sparse_step_differs": not all(torch.equal(a, b / world)
                                                    for a, b in zip(reduced[1], local[1]))}
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return from_plain(run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL))


def test_hooks_match_plain_ddp(ranks: list[dict]) -> None:
    for out in ranks:
        for (method, sel, fp16), grads in out["hooked"].items():
            tol = {"atol": 2e-3, "rtol": 2e-3} if fp16 is True else {}
            for a, b in zip(grads, out["plain"]):
                assert_close(a, b, **tol, msg=lambda m, k=(method, sel, fp16): f"{k}: {m}")


def test_nan_on_one_rank_skips_the_step_everywhere(ranks: list[dict]) -> None:
    for out in ranks:
        for method, r in out["nan"].items():
            assert r["stepped"] == [True, False, True], method
            assert r["unchanged"] == [False, True, False], method
            assert r["res_kept"][1], method
            assert r["skipped"] == 1 and r["finite"], method


def test_error_feedback_checkpoint_round_trip(ranks: list[dict]) -> None:
    for out in ranks:
        ck = out["ckpt"]
        assert ck["keys"] and all("weight" in k or "bias" in k for k in ck["keys"]), ck["keys"]
        assert ck["same"] and ck["kept"] and ck["residual_moved"]
        assert ck["counters"] == (3, 0)
        assert ck["after"] == (True, 0)  # no new keys, nothing dropped: the loaded ones were used
        for a, b in zip(*ck["grads"]):
            assert_close(a, b)


def test_switch_changes_method_and_flushes_residuals(ranks: list[dict]) -> None:
    for out in ranks:
        sw = out["switch"]
        assert sw["active"] == ["hitopk", "hitopk", "torus"]
        assert sw["switches"] == 1
        assert sw["ef_sizes"][1] > 0 and sw["ef_sizes"][2] == 0  # residuals flushed into torus
        assert sw["sparse_step_differs"]
        for a, b in zip(sw["sent"], sw["total"]):  # nothing held back is lost
            assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_config_and_schedule_validation() -> None:
    with pytest.raises(ValueError, match="allreduce, torus, naive_ag, hitopk"):
        CommConfig(method="ring")
    with pytest.raises(ValueError, match="mstopk"):
        CommConfig(selector="random")
    with pytest.raises(ValueError, match="density"):
        CommConfig(density=0.0)
    with pytest.raises(ValueError, match="partition_numel"):
        CommConfig(partition_numel=-1)
    with pytest.raises(ValueError, match="CommConfig"):
        HookState(config="hitopk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allreduce, torus, naive_ag, hitopk"):
        MethodSchedule([(0, "ring")])
    cfg = CommConfig(method="hitopk")
    with pytest.raises(AttributeError):
        cfg.method = "torus"  # type: ignore[misc]  # frozen
    with pytest.raises(ValueError, match="start at"):
        MethodSchedule([(1, "hitopk")])
    with pytest.raises(ValueError, match="unit"):
        MethodSchedule([(0, "hitopk")], unit="hour")
    s = MethodSchedule([(0, "hitopk"), (13, "torus")])
    assert s.method_at(step=10**6, epoch=12) == "hitopk" and s.method_at(step=0, epoch=13) == "torus"


def test_error_feedback_drops_residuals_on_topology_change(caplog: pytest.LogCaptureFixture) -> None:
    old = Topology(rank=1, world_size=4, local_rank=1, local_size=2, node=0, num_nodes=2)
    ef = ErrorFeedback()
    ef.residual("a", method="hitopk", numel=11, topo=old).add_(1.0)
    ef.residual("b", method="naive_ag", numel=5, topo=old).add_(2.0)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    same = ErrorFeedback()
    same.load_state_dict(sd, old)
    assert torch.equal(same.get("a"), torch.ones(6)) and same.dropped == 0
    new = Topology(rank=1, world_size=8, local_rank=1, local_size=4, node=0, num_nodes=2)
    moved = ErrorFeedback()
    with caplog.at_level(logging.WARNING, logger="trainer.comm.error_feedback"):
        moved.load_state_dict(sd, new)
    assert len(moved) == 0 and moved.dropped == 2 and "dropping residual" in caplog.text
    lazy = ErrorFeedback()
    lazy.load_state_dict(sd)  # no topology given: checked when the hook asks
    assert torch.count_nonzero(lazy.residual("a", method="hitopk", numel=11, topo=new)) == 0
    assert lazy.dropped == 1
    with pytest.raises(ValueError, match="format"):
        ErrorFeedback().load_state_dict({"residuals": {}})
