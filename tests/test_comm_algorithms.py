"""Collectives and algorithms on 4 real gloo ranks (2 nodes x 2), checked against references.

One spawned run computes everything (each spawn costs ~5 s); the parent process asserts.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from tests.dist_utils import run_distributed
from trainer.comm.collectives import pack, unpack
from trainer.comm.selector_registry import get_selector
from trainer.comm.sparse_ops import choose_k
from trainer.comm.timing import PhaseTimer

WORLD, LOCAL = 4, 2
SIZES = (5, 1000, 1001)


def _grad(rank: int, d: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + d)
    return torch.randn(d, generator=g)


def to_plain(obj):
    """Tensors -> numpy (torch's multiprocessing queue would share tensors through file
    descriptors that die with the child process); containers recursively."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj


def from_plain(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_plain(v) for v in obj)
    return obj


def _rank_main(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from trainer.comm.allreduce import allreduce_dense
    from trainer.comm.collectives import all_gather_packed, reduce_scatter_sum
    from trainer.comm.hitopk import hitopk, slice_numel
    from trainer.comm.naive_ag import naive_ag
    from trainer.comm.topology import Topology
    from trainer.comm.torus import torus_allreduce

    topo = Topology.from_env()
    out: dict = {"topo": topo.describe(), "again_same": Topology.from_env() is topo,
                 "intra": dist.get_process_group_ranks(topo.intra),
                 "inter": dist.get_process_group_ranks(topo.inter)}
    # collectives
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    out["rs"] = reduce_scatter_sum(x, topo.intra)
    try:
        reduce_scatter_sum(torch.ones(3), topo.intra)
        out["rs_error"] = None
    except ValueError as e:
        out["rs_error"] = str(e)
    k = 3  # odd k with fp16 values: unaligned byte offsets inside the packet
    v, i, e = all_gather_packed(torch.full((k,), rank + 0.5, dtype=torch.float16),
                                torch.arange(k, dtype=torch.int32) + 10 * rank, topo.inter,
                                extras=torch.tensor([float(rank)]), async_op=True).wait()
    out["packed"] = (v, i, e)

    dense, torus, torus16, dense16, sparse1 = {}, {}, {}, {}, {}
    for d in SIZES:
        g = _grad(rank, d)
        before = g.clone()
        dense[d] = allreduce_dense(g, topo)
        torus[d] = torus_allreduce(g, topo)
        dense16[d] = allreduce_dense(g, topo, fp16=True)
        torus16[d] = torus_allreduce(g, topo, fp16=True)
        for sel in ("mstopk", "exact", "dgc"):
            sparse1[(d, "naive_ag", sel)] = naive_ag(g, topo, density=1.0, selector=sel)
            sparse1[(d, "hitopk", sel)] = hitopk(g, topo, density=1.0, selector=sel)
        sparse1[(d, "hitopk_part", "exact")] = hitopk(g, topo, density=1.0, selector="exact",
                                                      partition_numel=64)
        sparse1[(d, "naive_ag16", "exact")] = naive_ag(g, topo, density=1.0, selector="exact", fp16=True)
        sparse1[(d, "hitopk16", "exact")] = hitopk(g, topo, density=1.0, selector="exact", fp16=True)
        out[("untouched", d)] = torch.equal(before, g)
    out.update(dense=dense, torus=torus, torus16=torus16, dense16=dense16, sparse1=sparse1)

    # HiTopK at density 0.1 (exact selector), with and without partitioning, with a timer.
    timer = PhaseTimer()
    out["hitopk_sparse"] = {(d, p): hitopk(_grad(rank, d), topo, density=0.1, selector="exact",
                                           partition_numel=p, timer=timer)
                            for d in SIZES for p in (0, 200)}
    out["timer"] = timer.totals()

    # Error feedback over 4 steps (fp32 and fp16 wire), residuals returned for the parent.
    ef: dict = {}
    for method, fn, rnumel in (("naive_ag", naive_ag, 1001), ("hitopk", hitopk, slice_numel(1001, LOCAL))):
        for fp16 in (False, True):
            res = torch.zeros(rnumel)
            outs, history = [], []
            for step in range(4):
                prev = res.clone()
                outs.append(fn(_grad(rank, 1001, step), topo, density=0.05, selector="mstopk",
                               residual=res, fp16=fp16))
                history.append((prev, res.clone()))
            ef[(method, fp16)] = (torch.stack(outs), res.clone(), history)
    out["ef"] = ef

    # Non-finite input on rank 3 only: every rank returns zeros and keeps its residual.
    nan_out = {}
    for method, fn, rnumel in (("naive_ag", naive_ag, 1000), ("hitopk", hitopk, slice_numel(1000, LOCAL))):
        g = _grad(rank, 1000)
        if rank == 3:
            g[17] = float("nan") if method == "naive_ag" else float("inf")
        res = torch.full((rnumel,), 0.25)
        o = fn(g, topo, density=0.01, selector="mstopk", residual=res)
        nan_out[method] = (o, res)
    out["nan"] = nan_out
    return to_plain(out)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return from_plain(run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL))


def _ref_hitopk(grads: list[torch.Tensor], m: int, n: int, density: float, partition_numel: int = 0
                ) -> torch.Tensor:
    """Sequential simulation of Algorithm 2 with the exact selector (per-partition top-k)."""
    d = grads[0].numel()
    c = math.ceil(d / n)
    padded = [torch.cat([g, torch.zeros(n * c - d)]) for g in grads]
    node_sums = [torch.stack(padded[i * n:(i + 1) * n]).sum(0) for i in range(m)]
    step = max(1, partition_numel // n) if partition_numel else c
    select = get_selector("exact")
    chunks = []
    for j in range(n):
        acc = torch.zeros(c)
        for i in range(m):  # step 2 on every (node, local rank), step 3 gathers over nodes
            chunk = node_sums[i][j * c:(j + 1) * c]
            for a in range(0, c, step):
                b = min(a + step, c)
                vals, idx = select(chunk[a:b], choose_k(density, b - a))
                acc.index_add_(0, idx.long() + a, vals)
        chunks.append(acc)
    return torch.cat(chunks)[:d]


def test_topology_groups(ranks: list[dict]) -> None:
    for r, out in enumerate(ranks):
        node, lr = divmod(r, LOCAL)
        assert out["topo"] == {"rank": r, "world_size": WORLD, "local_rank": lr, "local_size": LOCAL,
                               "node": node, "num_nodes": WORLD // LOCAL}
        assert out["intra"] == [node * LOCAL + j for j in range(LOCAL)]
        assert out["inter"] == [i * LOCAL + lr for i in range(WORLD // LOCAL)]
        assert out["again_same"]


def test_collectives(ranks: list[dict]) -> None:
    for r, out in enumerate(ranks):
        node, lr = divmod(r, LOCAL)
        total = sum(q + 1 for q in (node * LOCAL, node * LOCAL + 1))
        assert_close(out["rs"], torch.arange(8, dtype=torch.float32)[lr * 4:(lr + 1) * 4] * total)
        assert "not divisible" in out["rs_error"]
        v, i, e = out["packed"]
        peers = [i_ * LOCAL + lr for i_ in range(WORLD // LOCAL)]
        assert v.dtype == torch.float16 and i.dtype == torch.int32
        assert_close(v, torch.tensor([[p + 0.5] * 3 for p in peers], dtype=torch.float16))
        expect_idx = torch.tensor([[10 * p + q for q in range(3)] for p in peers], dtype=torch.int32)
        assert torch.equal(i, expect_idx)
        assert_close(e, torch.tensor([[float(p)] for p in peers]))


def test_dense_torus_and_density_one_equal_the_sum(ranks: list[dict]) -> None:
    for d in SIZES:
        expect = torch.stack([_grad(r, d) for r in range(WORLD)]).sum(0)
        for out in ranks:
            assert out[("untouched", d)]
            assert_close(out["dense"][d], expect)
            assert_close(out["torus"][d], expect)  # 2D-Torus == all-reduce
            assert_close(out["dense16"][d], expect, atol=1e-2, rtol=1e-2)
            assert_close(out["torus16"][d], expect, atol=1e-2, rtol=1e-2)
            for (dd, method, sel), got in out["sparse1"].items():
                if dd != d:
                    continue
                tol = {"atol": 1e-2, "rtol": 1e-2} if method.endswith("16") else {}
                assert_close(got, expect, **tol,
                             msg=lambda m, meth=method, s=sel, dd=d: f"{meth}/{s} d={dd}: {m}")


def test_hitopk_matches_sequential_reference(ranks: list[dict]) -> None:
    for d in SIZES:
        grads = [_grad(r, d) for r in range(WORLD)]
        for p in (0, 200):
            ref = _ref_hitopk(grads, WORLD // LOCAL, LOCAL, 0.1, p)
            for out in ranks:
                assert_close(out["hitopk_sparse"][(d, p)], ref)
        if d == 1000:  # it is really sparse: at most m*n*k non-zeros of d
            nnz = int((ranks[0]["hitopk_sparse"][(d, 0)] != 0).sum())
            assert 0 < nnz <= WORLD * choose_k(0.1, 500)
    timer = ranks[0]["timer"]
    assert set(timer) >= {"select", "communicate", "decompress"} and all(v > 0 for v in timer.values())


def test_error_feedback_conserves_gradient_mass(ranks: list[dict]) -> None:
    for method in ("naive_ag", "hitopk"):
        for fp16 in (False, True):
            total_grad = sum(_grad(r, 1001, s) for r in range(WORLD) for s in range(4))
            sent = ranks[0]["ef"][(method, fp16)][0].sum(0)
            for out in ranks[1:]:  # every rank received the same updates
                assert_close(out["ef"][(method, fp16)][0].sum(0), sent)
            if method == "naive_ag":
                residual = sum(out["ef"][(method, fp16)][1] for out in ranks)
            else:  # node residuals per chunk: sum over nodes, concatenate the chunks
                chunks = [sum(ranks[i * LOCAL + j]["ef"][(method, fp16)][1] for i in range(WORLD // LOCAL))
                          for j in range(LOCAL)]
                residual = torch.cat(chunks)[:1001]
            assert_close(sent + residual, total_grad, atol=1e-4, rtol=1e-4)
            # per rank and step, what left the residual is exactly one k-sparse message, and
            # the messages of all ranks add up to what every rank received that step
            for step in range(4):
                msgs = []
                for r, out in enumerate(ranks):
                    prev, new = out["ef"][(method, fp16)][2][step]
                    assert not torch.equal(prev, new)
                    if method == "naive_ag":
                        msgs.append(_grad(r, 1001, step) + prev - new)
                        assert int((msgs[-1] != 0).sum()) <= choose_k(0.05, 1001)
                if msgs:
                    assert_close(sum(msgs), ranks[0]["ef"][(method, fp16)][0][step], atol=1e-5, rtol=1e-5)


def test_nonfinite_on_one_rank_zeroes_every_rank(ranks: list[dict]) -> None:
    for out in ranks:
        for method in ("naive_ag", "hitopk"):
            o, res = out["nan"][method]
            assert torch.count_nonzero(o) == 0, method
            assert torch.all(res == 0.25), f"{method}: residual changed on a skipped step"


def test_pack_unpack_roundtrip_and_validation() -> None:
    vals = torch.randn(5).half()
    idx = torch.tensor([4, 0, 9, 2, 7], dtype=torch.int32)
    packet = pack(vals, idx, torch.tensor([1.0, 2.0]))
    v, i, e = unpack(packet.view(1, -1), 5, torch.float16, 2)
    assert torch.equal(v[0], vals) and torch.equal(i[0], idx) and e[0].tolist() == [1.0, 2.0]
    with pytest.raises(TypeError, match="int32"):
        pack(vals, idx.long())
    with pytest.raises(ValueError, match="density"):
        choose_k(0.0, 10)
    assert choose_k(0.01, 10) == 1 and choose_k(1.0, 10) == 10 and choose_k(0.5, 0) == 0


def test_single_process_topology_and_timer() -> None:
    from trainer.comm.hitopk import hitopk
    from trainer.comm.topology import Topology

    if "LOCAL_WORLD_SIZE" in os.environ:
        pytest.skip("test runs in a launched distributed job")  # pragma: no cover
    topo = Topology.from_env()
    assert (topo.world_size, topo.local_size, topo.num_nodes) == (1, 1, 1)
    g = torch.randn(100)
    assert_close(hitopk(g, topo, density=1.0, selector="exact"), g)
    out = hitopk(g, topo, density=0.1, selector="exact")
    assert int((out != 0).sum()) == 10
    t = PhaseTimer(enabled=False)
    with t.phase("select"):
        pass
    assert t.totals()["select"] == 0.0
