"""gloo fast paths of the collectives (irecv-first direct exchange, reused workspaces, in-place
outputs) and their fallbacks, on 4 real gloo ranks (2 nodes x 2); one spawn, the parent asserts.

Budget: one spawn (~5-10 s) plus single-process unit checks.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.dist_utils import run_distributed, to_plain
from trainer.comm.collectives import parse_backend_config
from trainer.comm.comm_config import CommConfig
from trainer.comm.hitopk import choose_final_gather
from trainer.comm.sparse_ops import flag_is_set, mask_values_, update_residual
from trainer.comm.workspace import Workspace

WORLD, LOCAL = 4, 2


def _grad(rank: int, d: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + d)
    return torch.randn(d, generator=g)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _collective_checks(rank: int, topo, out: dict, tag: str) -> None:
    from trainer.comm.collectives import all_gather_flat, all_gather_packed, reduce_scatter_sum

    lr, node = topo.local_rank, topo.node
    node_ranks = [node * LOCAL + j for j in range(LOCAL)]
    for d in (8, 1000):
        c = d // LOCAL
        ref = sum(_grad(r, d) for r in node_ranks)[lr * c:(lr + 1) * c]
        x = _grad(rank, d)
        keep = x.clone()
        out[f"{tag}rs_{d}"] = _err(reduce_scatter_sum(x, topo.intra), ref)
        out[f"{tag}rs_untouched_{d}"] = bool(torch.equal(x, keep))
        res = torch.empty(c)
        got = reduce_scatter_sum(x, topo.intra, out=res)
        out[f"{tag}rs_out_{d}"] = (_err(res, ref), got.data_ptr() == res.data_ptr())
        # in place: the result lands in my own chunk of the input
        y = x.clone()
        reduce_scatter_sum(y, topo.intra, out=y[lr * c:(lr + 1) * c])
        out[f"{tag}rs_alias_{d}"] = _err(y[lr * c:(lr + 1) * c], ref)
        # all-gather: fresh output, and into `out` with t already being my slice of it
        part = _grad(rank, c, step=1)
        ref_ag = torch.cat([_grad(r, c, step=1) for r in node_ranks])
        out[f"{tag}ag_{d}"] = _err(all_gather_flat(part, topo.intra), ref_ag)
        buf = torch.full((d,), float("nan"))
        buf[lr * c:(lr + 1) * c] = part
        all_gather_flat(buf[lr * c:(lr + 1) * c], topo.intra, out=buf)
        out[f"{tag}ag_into_{d}"] = _err(buf, ref_ag)
    # two packed gathers in flight at once over the world group, waited in reverse order
    k = 5
    pend = [all_gather_packed(torch.full((k,), rank + 0.5 + s), torch.arange(k, dtype=torch.int32) + 100 * s,
                              None, extras=torch.tensor([float(rank + s)]), async_op=True) for s in (0, 1)]
    got = [p.wait() for p in reversed(pend)][::-1]
    ok = True
    for s, (v, i, e) in enumerate(got):
        ok &= torch.equal(v, torch.tensor([[r + 0.5 + s] * k for r in range(WORLD)]))
        ok &= torch.equal(i, (torch.arange(k, dtype=torch.int32) + 100 * s).expand(WORLD, k))
        ok &= torch.equal(e, torch.tensor([[float(r + s)] for r in range(WORLD)]))
    out[f"{tag}packed_concurrent"] = bool(ok)


def _rank_main(rank: int, world: int) -> dict:
    from trainer.comm import collectives
    from trainer.comm.allreduce import allreduce_dense
    from trainer.comm.hitopk import hitopk, hitopk_ex, slice_numel
    from trainer.comm.naive_ag import naive_ag
    from trainer.comm.topology import Topology
    from trainer.comm.torus import torus_allreduce

    topo = Topology.from_env()
    out: dict = {"p2p": collectives.use_p2p(topo.intra), "p2p_world": collectives.use_p2p(None)}
    _collective_checks(rank, topo, out, "")
    saved = collectives.P2P_MAX_GROUP
    collectives.P2P_MAX_GROUP = 1  # force the fallbacks (all_to_all + sum, native all-gather)
    out["fallback_p2p"] = collectives.use_p2p(topo.intra)
    _collective_checks(rank, topo, out, "fb_")
    collectives.P2P_MAX_GROUP = saved

    for d in (1000, 1001):  # divisible by local_size, and padded
        ref = sum(_grad(r, d) for r in range(world))
        for name, fn in (("dense", allreduce_dense), ("torus", torus_allreduce),
                         ("naive", lambda f, t, **kw: naive_ag(f, t, density=1.0, selector="exact", **kw)),
                         ("hitopk", lambda f, t, **kw: hitopk(f, t, density=1.0, selector="exact", **kw))):
            g = _grad(rank, d)
            keep = g.clone()
            plain = fn(g, topo)
            out[f"untouched_{name}_{d}"] = bool(torch.equal(g, keep))
            res = fn(g, topo, inplace=True)
            out[f"inplace_{name}_{d}"] = (_err(plain, ref), _err(g, ref), res.data_ptr() == g.data_ptr())
        # sparse, with error feedback: in place and not in place agree bit for bit, residuals too
        for name in ("naive", "hitopk"):
            rn = d if name == "naive" else slice_numel(d, LOCAL)
            fn = naive_ag if name == "naive" else hitopk
            r1, r2 = torch.zeros(rn), torch.zeros(rn)
            same = True
            for step in range(3):
                g = _grad(rank, d, step)
                a = fn(g, topo, density=0.1, selector="exact", residual=r1)
                b = fn(g.clone(), topo, density=0.1, selector="exact", residual=r2, inplace=True)
                same &= torch.equal(a, b) and torch.equal(r1, r2)
            out[f"sparse_inplace_same_{name}_{d}"] = bool(same)
    # Results are never workspace buffers: a second call of the same size leaves the first intact.
    d = 1000
    first = hitopk(_grad(rank, d), topo, density=0.1, selector="exact", residual=torch.zeros(500))
    snap = first.clone()
    hitopk(_grad(rank, d, 5), topo, density=0.1, selector="exact", residual=torch.zeros(500))
    naive_ag(_grad(rank, d, 5), topo, density=0.1, selector="exact", residual=torch.zeros(d))
    out["result_survives_next_call"] = bool(torch.equal(first, snap))
    # Skipped step in place: NaN on rank 3 only -> zeros everywhere, residual kept, verdict True;
    # for both forms of the final intra gather (dense chunks / eq. 10's sparse pairs).
    for mode in ("dense", "sparse"):
        g = _grad(rank, d)
        if rank == 3:
            g[7] = float("nan")
        res = torch.full((500,), 0.5)
        o, bad = hitopk_ex(g, topo, density=0.1, selector="exact", residual=res, inplace=True,
                           final_gather=mode)
        out[f"nan_inplace_{mode}"] = (bool(bad), bool(torch.equal(o, torch.zeros(d))),
                                      bool(torch.equal(res, torch.full((500,), 0.5))),
                                      o.data_ptr() == g.data_ptr())
    # Both final-gather forms give the same sum and residual (partitioned, fp16 wire, padded d).
    same = True
    for dd, part, fp16 in ((1000, 0, False), (1001, 200, False), (1001, 0, True)):
        rs = {m: torch.zeros(slice_numel(dd, LOCAL)) for m in ("dense", "sparse")}
        for step in range(2):
            got = {m: hitopk(_grad(rank, dd, step), topo, density=0.05, selector="exact", residual=rs[m],
                             partition_numel=part, fp16=fp16, final_gather=m) for m in ("dense", "sparse")}
            # deterministic decompression: both forms add the same rows in the same order
            same &= torch.equal(got["dense"], got["sparse"]) and torch.equal(rs["dense"], rs["sparse"])
    out["final_gather_forms_agree"] = bool(same)
    try:
        hitopk(_grad(rank, d), topo, density=0.1, final_gather="ring")
        out["bad_final_gather"] = None
    except ValueError as e:
        out["bad_final_gather"] = str(e)
    out.update(_default_backend_checks(rank, world))
    return to_plain(out)


def _default_backend_checks(rank: int, world: int) -> dict:
    """Re-initialise with NO backend argument (torch's default, "cpu:gloo" here and
    "cpu:gloo,cuda:nccl" with CUDA): the CPU tensors must still take the gloo fast path."""
    import torch.distributed as dist

    from tests.dist_utils import free_port
    from trainer.comm import collectives
    from trainer.comm.topology import Topology

    port = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(port, 0)
    dist.destroy_process_group()
    dist.init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{int(port)}")
    topo = Topology.from_env()
    d = 1000
    ref = sum(_grad(r, d) for r in range(topo.node * LOCAL, (topo.node + 1) * LOCAL))
    c = d // LOCAL
    got = collectives.reduce_scatter_sum(_grad(rank, d), topo.intra)
    return {"default_config": str(dist.get_backend_config()),
            "default_paths": (collectives.path_for(topo.intra, "cpu"), collectives.path_for(None, "cpu"),
                              collectives.backend_for(None, "cpu")),
            "default_rs_err": _err(got, ref[topo.local_rank * c:(topo.local_rank + 1) * c])}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL)


def test_fast_path_is_used_and_collectives_are_right(ranks: list[dict]) -> None:
    for out in ranks:
        assert out["p2p"] and out["p2p_world"] and not out["fallback_p2p"]
        for tag in ("", "fb_"):  # the direct exchange and the fallbacks give the same sums
            for d in (8, 1000):
                assert out[f"{tag}rs_{d}"] < 1e-5 and out[f"{tag}rs_untouched_{d}"]
                err, same_buffer = out[f"{tag}rs_out_{d}"]
                assert err < 1e-5 and same_buffer
                assert out[f"{tag}rs_alias_{d}"] < 1e-5
                assert out[f"{tag}ag_{d}"] == 0.0 and out[f"{tag}ag_into_{d}"] == 0.0
            assert out[f"{tag}packed_concurrent"]


def test_inplace_outputs_equal_the_sum(ranks: list[dict]) -> None:
    for out in ranks:
        for d in (1000, 1001):
            for name in ("dense", "torus", "naive", "hitopk"):
                assert out[f"untouched_{name}_{d}"], (name, d)
                plain_err, inplace_err, same_buffer = out[f"inplace_{name}_{d}"]
                assert plain_err < 1e-4 and inplace_err < 1e-4 and same_buffer, (name, d)
            assert out[f"sparse_inplace_same_naive_{d}"] and out[f"sparse_inplace_same_hitopk_{d}"]


def test_results_are_not_workspace_and_nan_skip_in_place(ranks: list[dict]) -> None:
    for out in ranks:
        assert out["result_survives_next_call"]
        for mode in ("dense", "sparse"):
            assert out[f"nan_inplace_{mode}"] == (True, True, True, True), mode
        assert out["final_gather_forms_agree"]
        assert "auto, dense, sparse" in out["bad_final_gather"]


def test_default_backend_dispatches_by_device(ranks: list[dict]) -> None:
    for out in ranks:
        assert "gloo" in out["default_config"]
        assert out["default_paths"] == ("p2p", "p2p", "gloo"), out["default_paths"]
        assert out["default_rs_err"] < 1e-5


def test_parse_backend_config() -> None:
    assert parse_backend_config("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert parse_backend_config("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert parse_backend_config("cpu:gloo", "cuda") == "none"
    assert parse_backend_config("nccl", "cpu") == "nccl"
    assert parse_backend_config(" CPU:Gloo , cuda:NCCL ", "cuda") == "nccl"


def test_final_gather_choice() -> None:
    # fp32 pairs are 8 bytes: sparse when 2 * m * k * 8 <= 4 * c
    assert choose_final_gather(c=1000, k=10, m=2, fp16=False) == "sparse"     # 320 <= 4000
    assert choose_final_gather(c=1000, k=200, m=2, fp16=False) == "dense"     # 6400 > 4000
    assert choose_final_gather(c=1000, k=125, m=2, fp16=False) == "sparse"    # 4000 <= 4000
    assert choose_final_gather(c=1000, k=150, m=2, fp16=True) == "sparse"     # 6-byte pairs: 3600
    assert choose_final_gather(c=1000, k=10, m=2, fp16=False, final_gather="dense") == "dense"
    with pytest.raises(ValueError, match="auto, dense, sparse"):
        choose_final_gather(c=1000, k=10, m=2, fp16=False, final_gather="ring")
    with pytest.raises(ValueError, match="auto, dense, sparse"):
        CommConfig(method="hitopk", final_gather="ring")
    assert CommConfig(method="hitopk").final_gather == "auto"


def test_workspace_reuses_per_key_and_thread_and_is_bounded() -> None:
    ws = Workspace(max_entries=2)
    a = ws.get("a", 10, torch.float32, torch.device("cpu"))
    assert ws.get("a", 10, torch.float32, torch.device("cpu")).data_ptr() == a.data_ptr()
    assert ws.get("a", 11, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr()
    other: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: other.append(ws.get("a", 10, torch.float32, torch.device("cpu"))))
    t.start()
    t.join()
    assert other[0].data_ptr() != a.data_ptr()  # another thread gets its own buffer
    ws.get("b", 10, torch.float32, torch.device("cpu"))  # evicts the least recently used ("a", 10)
    assert ws.get("a", 10, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr()
    assert len(ws._local.cache) == 2


def test_cpu_flag_branches() -> None:
    yes, no = torch.tensor([1.0]), torch.tensor([0.0])
    assert flag_is_set(yes) is True and flag_is_set(no) is False
    v = torch.ones(3)
    assert torch.equal(mask_values_(v.clone(), torch.tensor(True)), torch.zeros(3))
    assert torch.equal(mask_values_(v.clone(), torch.tensor(False)), v)
    res = torch.full((4,), 9.0)
    xs = torch.arange(4.0)
    pick = [(torch.tensor([1], dtype=torch.int32), xs[1:2], xs[1:2])]
    update_residual(res, xs.clone(), pick, torch.tensor(True))
    assert torch.equal(res, torch.full((4,), 9.0))  # skipped step keeps the residual
    update_residual(res, xs.clone(), pick, torch.tensor(False))
    assert torch.equal(res, torch.tensor([0.0, 0.0, 2.0, 3.0]))
    v = torch.tensor([2.3])
    i2 = torch.tensor([2], dtype=torch.int32)
    # fp16 wire: the rounding error stays in the residual
    update_residual(res, torch.tensor([0.0, 0.0, 2.3, 3.0]), [(i2, v, v.half())], None)
    assert float(res[2]) == pytest.approx(2.3 - float(v.half().float()), abs=1e-7)
