"""Safety of the comm stack on 4 real gloo ranks (2 nodes x 2), one spawn; the parent asserts:

* fp16 cannot poison training: an overflowing step is skipped on every rank, residuals and
  parameters stay finite, later steps run; dividing before the cast keeps a representable
  average that the fp16 SUM would overflow (all four methods);
* replicas stay bit-identical over 20 sparse steps, and no decompression scatter ever adds
  duplicate indices in one call (the op whose CUDA atomics make sums order-dependent);
* the hooks' CUDA code path (forced on CPU) runs no host-syncing op;
* the host layout is checked at start-up (node-contiguous ranks, one local size);
* with ``nan_check=False`` a NaN on one rank never leaves the others hanging.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from tests.op_audit import ScatterAudit, SyncAudit
from trainer.comm.comm_config import CommConfig
from trainer.comm.names import METHOD_CHOICES
from trainer.comm.topology import check_layout

WORLD, LOCAL = 4, 2
CAP_MB = 0.02  # ~5k floats per bucket: a few buckets, the sparse path runs (min_numel_for_sparse=0)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _loss(model: nn.Module, rank: int, step: int, scale: float = 1.0, nan: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return nn.functional.mse_loss(model(x), y) * scale


def _train(rank: int, config: CommConfig, steps: int, *, hook_factory=None, scale_at=None, nan_at=None,
           momentum: float = 0.9) -> dict:
    """``steps`` DDP steps with the comm hooks; per step: stepped?, params and residuals finite."""
    from trainer.comm import maybe_step, register

    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
    state = register(ddp, config, hook=hook_factory(config) if hook_factory else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
    stepped, finite, res_finite, moved = [], [], [], []
    for step in range(steps):
        before = [p.detach().clone() for p in ddp.parameters()]
        ddp.zero_grad(set_to_none=True)
        scale = 1e9 if (scale_at is not None and step == scale_at[0] and rank == scale_at[1]) else 1.0
        nan = nan_at is not None and step == nan_at[0] and rank == nan_at[1]
        _loss(ddp, rank, step, scale, nan).backward()
        stepped.append(maybe_step(opt, state))
        finite.append(all(bool(torch.isfinite(p).all()) for p in ddp.parameters()))
        res_finite.append(all(bool(torch.isfinite(state.ef.get(k)).all()) for k in state.ef.keys()))  # noqa: SIM118
        moved.append(not all(torch.equal(a, p) for a, p in zip(before, ddp.parameters())))
    return {"stepped": stepped, "finite": finite, "res_finite": res_finite, "moved": moved,
            "skipped": state.skipped_steps, "params": [p.detach().clone() for p in ddp.parameters()],
            "grads": [p.grad.detach().clone() for p in ddp.parameters()]}


class _Const(nn.Module):
    """loss = sum(w * c): the gradient is c on every rank, so the average is c too."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, c: float) -> torch.Tensor:
        return (self.w * c).sum()


def _fp16_checks(rank: int) -> dict:
    from trainer.comm import HOOKS, fp16_wrapper, register

    out: dict = {}
    for i, method in enumerate(METHOD_CHOICES):
        cfg = CommConfig(method=method, density=0.1, min_numel_for_sparse=0)
        # half of the runs ask for fp16 in the config, half wrap the hook explicitly (same thing)
        if i % 2:
            r = _train(rank, cfg, 5, hook_factory=lambda c: fp16_wrapper(HOOKS[c.method]), scale_at=(2, 1))
        else:
            r = _train(rank, dataclasses.replace(cfg, fp16=True), 5, scale_at=(2, 1))
        out[f"overflow_{method}"] = r
        # every rank's gradient is 40000 (fits fp16); their SUM (160000) would not: divided first, it is fine
        m = _Const(3000)
        ddp = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=CAP_MB)
        st = register(ddp, CommConfig(method=method, density=1.0, fp16=True, min_numel_for_sparse=0,
                                      dense_first_step=False))
        ddp(40000.0).backward()
        out[f"big_average_{method}"] = (st.step_was_skipped(), m.w.grad.clone())
    return out


def _replica_checks(rank: int) -> dict:
    out: dict = {}
    for method in ("naive_ag", "hitopk"):
        for fp16 in (False, True):
            cfg = CommConfig(method=method, density=0.05, fp16=fp16, min_numel_for_sparse=0)
            out[f"replica_{method}_{fp16}"] = _train(rank, cfg, 20)["params"]
    # Scatter audit on the functional forms: many duplicate indices across ranks (density 0.5).
    from trainer.comm.hitopk import hitopk
    from trainer.comm.naive_ag import naive_ag
    from trainer.comm.topology import Topology

    topo = Topology.from_env()
    g = torch.randn(4000, generator=torch.Generator().manual_seed(rank))
    with ScatterAudit() as audit:
        naive_ag(g, topo, density=0.5, selector="mstopk", residual=torch.zeros(4000))
        for mode in ("dense", "sparse"):
            hitopk(g, topo, density=0.5, selector="mstopk", residual=torch.zeros(2000), final_gather=mode,
                   partition_numel=1000)
    out["scatter_audit"] = (audit.calls, audit.with_duplicates)
    return out


def _sync_checks(rank: int) -> dict:
    """The CUDA code path, forced on CPU tensors, under the sync audit: functional forms and a
    DDP backward whose hooks run inside the audit."""
    from trainer.comm import HOOKS, fp16_wrapper, register, topk_keys
    from trainer.comm.hitopk import hitopk_ex
    from trainer.comm.naive_ag import naive_ag_ex
    from trainer.comm.topology import Topology

    topo = Topology.from_env()
    found: list[str] = []
    topk_keys.DEVICE_PATH_ON_CPU = True
    try:
        for fp16 in (False, True):
            g = torch.randn(6000, generator=torch.Generator().manual_seed(rank))
            if rank == 1:
                g[3] = float("nan")
            with SyncAudit() as audit:
                _, bad1 = naive_ag_ex(g, topo, density=0.01, residual=torch.zeros(6000), fp16=fp16,
                                      divide_by=4)
                for mode in ("dense", "sparse"):
                    hitopk_ex(g, topo, density=0.01, residual=torch.zeros(3000), fp16=fp16, final_gather=mode,
                              partition_numel=2000, divide_by=4)
            found += audit.found
        audits: list[SyncAudit] = []
        for method in ("naive_ag", "hitopk", "torus", "allreduce"):
            for selector in ("mstopk", "exact"):
                def audited(state, bucket, _m=method):  # no annotations: DDP checks real objects
                    audit = SyncAudit()
                    audits.append(audit)
                    with audit:
                        return fp16_wrapper(HOOKS[_m])(state, bucket)

                ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=CAP_MB)
                cfg = CommConfig(method=method, selector=selector, density=0.05, min_numel_for_sparse=0,
                                 dense_first_step=False)
                state = register(ddp, cfg, hook=audited)
                for step in range(2):
                    _loss(ddp, rank, step).backward()
                    state.finish_step()
        found += [f for a in audits for f in a.found]
    finally:
        topk_keys.DEVICE_PATH_ON_CPU = False
    return {"sync_found": found, "sync_bad_flag": bool(bad1), "hook_calls": len(audits)}


def _topology_checks(rank: int) -> dict:
    from trainer.comm.topology import Topology

    out = {}
    for name, hosts in (("contiguous", "AABB"), ("round_robin", "ABAB"), ("one_host", "AAAA")):
        try:
            t = Topology.from_env(host=f"host-{hosts[rank]}")
            out[name] = ("ok", t.intra_ranks)
        except ValueError as e:
            out[name] = ("error", str(e))
    return out


def _nan_unchecked(rank: int) -> dict:
    out = {}
    for method in ("naive_ag", "hitopk"):
        cfg = CommConfig(method=method, density=0.1, nan_check=False, min_numel_for_sparse=0)
        r = _train(rank, cfg, 2, nan_at=(1, 3), momentum=0.0)
        out[f"nan_unchecked_{method}"] = r["grads"]
    return out


def _rank_main(rank: int, world: int) -> dict:
    out: dict = {}
    out.update(_fp16_checks(rank))
    out.update(_replica_checks(rank))
    out.update(_sync_checks(rank))
    out.update(_topology_checks(rank))
    out.update(_nan_unchecked(rank))
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.test_comm_algorithms import from_plain

    return from_plain(run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL, timeout=180))


def test_fp16_overflow_skips_one_step_only(ranks: list[dict]) -> None:
    for out in ranks:
        for method in METHOD_CHOICES:
            r = out[f"overflow_{method}"]
            assert r["stepped"] == [True, True, False, True, True], (method, r["stepped"])
            assert r["moved"] == [True, True, False, True, True], method
            assert all(r["finite"]) and all(r["res_finite"]), method
            assert r["skipped"] == 1, method


def test_fp16_divides_before_the_cast(ranks: list[dict]) -> None:
    for out in ranks:
        for method in METHOD_CHOICES:
            skipped, grad = out[f"big_average_{method}"]
            assert not skipped, method
            assert torch.equal(grad, torch.full_like(grad, 40000.0)), method


def test_replicas_bit_identical_after_20_sparse_steps(ranks: list[dict]) -> None:
    for key in (k for k in ranks[0] if k.startswith("replica_")):
        for other in ranks[1:]:
            for a, b in zip(ranks[0][key], other[key]):
                assert torch.equal(a, b), key
    for out in ranks:
        calls, dups = out["scatter_audit"]
        assert calls > 0 and dups == [], dups


def test_hooks_cuda_path_runs_no_host_sync(ranks: list[dict]) -> None:
    for out in ranks:
        assert out["hook_calls"] > 0
        assert out["sync_found"] == [], out["sync_found"]
        assert out["sync_bad_flag"]  # the NaN on rank 1 was flagged on every rank, device-side


def test_topology_checks_the_host_layout(ranks: list[dict]) -> None:
    for r, out in enumerate(ranks):
        node = r // LOCAL
        assert out["contiguous"] == ("ok", [node * LOCAL, node * LOCAL + 1])
        assert out["one_host"][0] == "ok"  # several emulated nodes on one host: allowed (logged)
        kind, msg = out["round_robin"]
        assert kind == "error" and "spans hosts" in msg and "torchrun" in msg


def test_check_layout_errors() -> None:
    assert check_layout(["a", "a", "b", "b"], [2] * 4, [0, 1, 0, 1], 2) == 2
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE differs"):
        check_layout(["a"] * 4, [2, 2, 4, 2], [-1] * 4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        check_layout(["a"] * 3, [2] * 3, [-1] * 3, 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=0"):
        check_layout(["a", "a", "b", "b"], [2] * 4, [0, 0, 0, 1], 2)
    with pytest.raises(ValueError, match="spans hosts"):
        check_layout(["a", "a", "a", "b"], [2] * 4, [-1] * 4, 2)


def test_nan_without_check_reaches_every_rank_alike(ranks: list[dict]) -> None:
    """No rank raised (the run finished); every rank holds the same gradient, NaN included."""
    for method in ("naive_ag", "hitopk"):
        grads = [out[f"nan_unchecked_{method}"] for out in ranks]
        assert any(not bool(torch.isfinite(g).all()) for g in grads[0])
        for other in grads[1:]:
            for a, b in zip(grads[0], other):
                torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA devices (NCCL ranks need one each)")
def test_replicas_bit_identical_on_cuda() -> None:  # pragma: no cover - needs GPUs
    n = min(4, torch.cuda.device_count())
    outs = run_distributed(_cuda_replicas, world_size=n, local_size=math.gcd(n, 2), backend="nccl")
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert (a == b).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_training_step_sync_free_on_one_gpu() -> None:  # pragma: no cover - needs a GPU
    """One NCCL rank: every method/selector/fp16 combination runs backward (hooks included)
    under ``set_sync_debug_mode("error")``; replicas are trivially equal, so only syncs are checked."""
    configs = [CommConfig(method=m, selector=s, fp16=f, density=0.05, min_numel_for_sparse=0)
               for m in METHOD_CHOICES for s in ("auto", "mstopk", "exact") for f in (False, True)]
    run_distributed(_cuda_sync_steps, world_size=1, local_size=1, backend="nccl", args=(configs,))


def _cuda_sync_steps(rank: int, world: int, configs: list[CommConfig]) -> None:  # pragma: no cover
    for cfg in configs:
        _cuda_replicas(rank, world, cfg, steps=4)


def _cuda_replicas(rank: int, world: int, config: CommConfig | None = None,
                   steps: int = 20) -> list:  # pragma: no cover - needs GPUs
    from trainer.comm import maybe_step, register

    ddp = nn.parallel.DistributedDataParallel(_model().cuda(), bucket_cap_mb=CAP_MB)
    state = register(ddp, config or CommConfig(method="hitopk", density=0.05, min_numel_for_sparse=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()
        if step >= 2:  # after DDP's first iteration and its bucket rebuild (those may sync)
            torch.cuda.set_sync_debug_mode("error")  # the hooks run inside backward: no host sync
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        maybe_step(opt, state)
    return to_plain([p.detach().cpu() for p in ddp.parameters()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_decompression_deterministic_on_cuda() -> None:  # pragma: no cover - needs a GPU
    """Rows with heavy duplicates, added on the GPU: the same bits every time, equal to the CPU's."""
    from trainer.comm.sparse_ops import add_rows_

    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(1000, generator=g)[:800] for _ in range(16)]).to(torch.int32)
    vals = torch.randn(16, 800, generator=g) * torch.logspace(-8, 8, 800)
    ref = add_rows_(torch.zeros(1000), idx, vals)
    for _ in range(20):
        got = add_rows_(torch.zeros(1000, device="cuda"), idx.cuda(), vals.cuda())
        assert torch.equal(got.cpu(), ref)
