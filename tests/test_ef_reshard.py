"""Error-feedback residuals across a world-size or layout change (trainer.comm.ef_reshard): the new
ranks' residuals owe the model exactly what the old ranks' owed. Residuals made by the real hooks on
4 gloo ranks (2 nodes x 2), re-split for 2 ranks (1 x 2), 3 ranks (1 x 3, 3 x 1) and back; on the new
ranks the next dense reduction delivers the owed mass (real gloo groups, checked against a plain
all-reduce plus an independent sum of the saved residuals)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from tests.test_comm_algorithms import from_plain
from tests.test_comm_overlap import CAP_MB, _batch, _model
from trainer.comm.comm_config import CommConfig
from trainer.comm.ef_reshard import owed, reshard, share
from trainer.comm.error_feedback import ErrorFeedback
from trainer.comm.state import HookState
from trainer.comm.topology import Topology


def _make_residuals(rank: int, world: int, method: str) -> dict:
    """3 sparse steps (no optimizer step): every rank's residuals, as a checkpoint saves them."""
    from trainer.comm import register

    state = HookState(CommConfig(method=method, density=0.05, min_numel_for_sparse=0))
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    register(ddp, state)
    for step in range(3):
        x, y = _batch(rank, step)
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        state.finish_step()
    return to_plain(state.state_dict())


def _deliver(rank: int, world: int, saved: list[dict]) -> dict:
    """Load this rank's share, then one dense all-reduce with error feedback: it flushes the share."""
    import torch.distributed as dist

    from trainer.comm import register

    topo = Topology.from_env()
    state = HookState(CommConfig(method="allreduce", dense_first_step=False))
    state.topo = topo
    efs = [from_plain(s["ef"]) for s in saved]
    state.ef.load_state_dict(reshard(efs, topo), topo)
    kept = len(state.ef)
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    register(ddp, state)
    # step 0 runs DDP's first bucket layout (other keys: nothing to flush, every residual kept);
    # step 1 the rebuilt layout the residuals were keyed by: the dense reduction flushes them
    x, y = _batch(rank, 7)
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        state.finish_step()
    reduced = [p.grad.detach().clone() for p in model.parameters()]
    plain = _model()
    nn.functional.mse_loss(plain(x), y).backward()
    avg = []
    for p in plain.parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        avg.append(g / world)
    return to_plain({"kept": kept, "left": len(state.ef), "extra": [r - a for r, a in zip(reduced, avg)],
                     "names": [n for n, _ in model.named_parameters()]})


@pytest.fixture(scope="module")
def saved() -> dict[str, list[dict]]:
    return {m: from_plain(run_distributed(_make_residuals, world_size=4, local_size=2, args=(m,)))
            for m in ("naive_ag", "hitopk")}


def _owed_by_param(ef_states: list[dict]) -> dict[str, torch.Tensor]:
    """An independent statement of what is owed, per bucket key, from the raw saved residuals."""
    out: dict[str, torch.Tensor] = {}
    for s in ef_states:
        for key, res in s["residuals"].items():
            m = s["meta"][key]
            total = out.setdefault(key, torch.zeros(m["numel"]))
            if m["method"] == "naive_ag":
                total += res
            else:
                start = m["local_rank"] * res.numel()
                n = max(0, min(res.numel(), m["numel"] - start))
                total[start:start + n] += res[:n]
    return out


@pytest.mark.parametrize("method", ["naive_ag", "hitopk"])
@pytest.mark.parametrize(("world", "local"), [(2, 2), (3, 3), (3, 1), (4, 2), (1, 1)])
def test_the_new_ranks_owe_what_the_old_ones_owed(saved: dict, method: str, world: int, local: int) -> None:
    efs = [s["ef"] for s in saved[method]]
    expect = _owed_by_param(efs)
    assert expect and all(t.abs().sum() > 0 for t in expect.values())
    shares = [reshard(efs, Topology(rank=r, world_size=world, local_rank=r % local, local_size=local,
                                    node=r // local, num_nodes=world // local)) for r in range(world)]
    got, dropped = owed(shares)
    assert not dropped and got.keys() == expect.keys()
    for key, (m, total) in got.items():
        assert m == method
        torch.testing.assert_close(total, expect[key], rtol=1e-6, atol=1e-7)
    # the hook's own layout check accepts every share: nothing is dropped when it is used
    for r, st in enumerate(shares):
        topo = Topology(rank=r, world_size=world, local_rank=r % local, local_size=local, node=r // local,
                        num_nodes=world // local)
        ef = ErrorFeedback()
        ef.load_state_dict(st, topo)
        for key in st["residuals"]:
            assert ef.residual(key, method=method, numel=expect[key].numel(), topo=topo) is ef.get(key)
        assert ef.dropped == 0


@pytest.mark.parametrize("method", ["naive_ag", "hitopk"])
@pytest.mark.parametrize("world", [3])
def test_the_next_dense_reduction_delivers_it_on_real_gloo_ranks(saved: dict, method: str,
                                                                  world: int) -> None:
    outs = from_plain(run_distributed(_deliver, world_size=world, local_size=1,
                                      args=(to_plain(saved[method]),)))
    expect = _owed_by_param([s["ef"] for s in saved[method]])
    for out in outs:
        assert out["kept"] == len(expect) and out["left"] == 0  # every share used, then flushed
        flat = torch.cat([e.reshape(-1) for e in out["extra"]])
        owed_all = torch.cat([v.reshape(-1) for v in expect.values()])
        # the reduced gradient exceeds the plain average by exactly the owed vectors: a bucket is its
        # parameters' gradients laid end to end, so the same values in another order (fp32 rounding)
        torch.testing.assert_close(torch.sort(flat).values, torch.sort(owed_all).values, rtol=1e-4, atol=1e-6)
        assert float(owed_all.abs().sum()) > 0


def test_disagreeing_residuals_are_dropped_and_counted() -> None:
    old = [Topology(rank=r, world_size=2, local_rank=r, local_size=2, node=0, num_nodes=1) for r in range(2)]
    efs = []
    for r, topo in enumerate(old):
        ef = ErrorFeedback()
        ef.residual("a", method="naive_ag", numel=4, topo=topo).add_(1.0)
        ef.residual("b" if r == 0 else "c", method="naive_ag", numel=4, topo=topo).add_(1.0)
        efs.append(ef.state_dict())
    new = Topology(rank=0, world_size=1, local_rank=0, local_size=1, node=0, num_nodes=1)
    st = reshard(efs, new)
    assert set(st["residuals"]) == {"a"} and st["dropped"] == 2
    assert torch.equal(st["residuals"]["a"], torch.full((4,), 2.0))
    assert torch.equal(share("hitopk", torch.arange(5.0), Topology(rank=1, world_size=2, local_rank=1,
                                                                   local_size=2, node=0, num_nodes=1)),
                       torch.tensor([3.0, 4.0, 0.0]))
