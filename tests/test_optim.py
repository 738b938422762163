"""LARS / LAMB against slow per-layer references, state_dict, sync-freedom, and PTO on 4 gloo ranks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from tests.dist_utils import run_distributed
from trainer.models import resnet50
from trainer.optim.lamb import LAMB
from trainer.optim.lars import LARS
from trainer.optim.pto import PTO, balanced_assignment, make_plan

# ----------------------------------------------------------------------------- fixtures


def _tensors() -> list[dict]:
    """Param groups covering every case: conv/linear weights, biases, BN-like 1-D, a zero-grad
    layer, a zero-weight layer, a param without grad, an excluded 2-D group, an adapted 1-D group."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    base = [t(8, 3, 3, 3), t(8), t(8), t(8), t(10, 8), t(10), t(6, 5), torch.zeros(7, 4), t(3, 3)]
    names = ["conv.w", "conv.b", "bn.w", "bn.b", "fc.w", "fc.b", "zero_grad.w", "zero_w.w", "no_grad.w"]
    main = [nn.Parameter(x) for x in base]
    excl2d = [nn.Parameter(t(4, 4))]
    adapt1d = [nn.Parameter(t(9))]
    groups = [
        {"params": main, "names": names},
        {"params": excl2d, "lars_exclude": True, "weight_decay": 0.0, "names": ["excl.w"]},
        {"params": adapt1d, "lars_exclude": False, "trust_coefficient": 0.02, "names": ["adapt1d.w"]},
    ]
    return groups


def _set_grads(groups: list[dict], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for grp in groups:
        for name, p in zip(grp["names"], grp["params"]):
            if name == "no_grad.w":
                p.grad = None
            elif name == "zero_grad.w":
                p.grad = torch.zeros_like(p)
            else:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _opt_groups(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in grp.items() if k != "names"} for grp in groups]


def _excluded(p: torch.Tensor, grp: dict) -> bool:
    flag = grp.get("lars_exclude")
    return p.ndim <= 1 if flag is None else flag


def _ref_lars(groups: list[dict], state: dict, defaults: dict) -> None:
    """Straight from the formula, one layer at a time, with .item() and Python branches."""
    for grp in groups:
        h = {**defaults, **{k: v for k, v in grp.items() if k not in ("params", "names")}}
        for p in grp["params"]:
            if p.grad is None:
                continue
            with torch.no_grad():
                g = p.grad
                if _excluded(p, grp):
                    d = g.clone()
                else:
                    wn, gn = p.norm().item(), g.norm().item()
                    wd = h["weight_decay"]
                    trust = 1.0
                    if wn > 0 and gn > 0:
                        trust = h["trust_coefficient"] * wn / (gn + wd * wn + h["eps"])
                    d = trust * (g + wd * p)
                if h["momentum"] > 0:
                    buf = state.get(id(p))
                    buf = d.clone() if buf is None else h["momentum"] * buf + d
                    state[id(p)] = buf
                    d = d + h["momentum"] * buf if h["nesterov"] else buf
                p -= h["lr"] * d


def _ref_lamb(groups: list[dict], state: dict, defaults: dict) -> None:
    for grp in groups:
        h = {**defaults, **{k: v for k, v in grp.items() if k not in ("params", "names")}}
        b1, b2 = h["betas"]
        for p in grp["params"]:
            if p.grad is None:
                continue
            with torch.no_grad():
                st = state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                st["t"] += 1
                st["m"] = b1 * st["m"] + (1 - b1) * p.grad
                st["v"] = b2 * st["v"] + (1 - b2) * p.grad**2
                mh, vh = st["m"] / (1 - b1 ** st["t"]), st["v"] / (1 - b2 ** st["t"])
                u = mh / (vh.sqrt() + h["eps"])
                trust = 1.0
                if not _excluded(p, grp):
                    u = u + h["weight_decay"] * p
                    wn, un = p.norm().item(), u.norm().item()
                    trust = wn / un if wn > 0 and un > 0 else 1.0
                p -= h["lr"] * trust * u


def _flat(groups: list[dict]) -> list[torch.Tensor]:
    return [p.detach().clone() for grp in groups for p in grp["params"]]


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("nesterov,momentum", [(False, 0.9), (True, 0.9), (False, 0.0)])
def test_lars_matches_reference(nesterov: bool, momentum: float) -> None:
    defaults = dict(lr=0.5, momentum=momentum, weight_decay=1e-2, trust_coefficient=0.01, eps=1e-9,
                    nesterov=nesterov)
    ours, ref = _tensors(), _tensors()
    opt = LARS(_opt_groups(ours), **defaults)
    ref_state: dict = {}
    start = _flat(ours)
    for step in range(5):
        _set_grads(ours, step)
        _set_grads(ref, step)
        if step == 0:
            table, trust = opt.trust_ratios()
            names = [n for grp in ours for n, p in zip(grp["names"], grp["params"])
                     if any(p is q for q in table.params)]
            # excluded tensors are absent; zero grad / zero weight layers get ratio 1
            assert names == ["conv.w", "fc.w", "zero_grad.w", "zero_w.w", "adapt1d.w"]
            assert trust[2].item() == 1.0 and trust[3].item() == 1.0
            assert (trust[[0, 1, 4]] < 0.5).all()
        opt.step()
        _ref_lars(ref, ref_state, defaults)
        for a, b in zip(_flat(ours), _flat(ref)):
            assert_close(a, b)
    end = _flat(ours)
    names = [n for grp in ours for n in grp["names"]]
    moved = {n: not torch.equal(a, b) for n, a, b in zip(names, start, end)}
    # only the tensor without a gradient stays put; zero-weight (ratio 1 -> plain SGD) and
    # zero-grad layers (weight decay only) move
    assert not moved["no_grad.w"]
    assert all(v for n, v in moved.items() if n != "no_grad.w")


def test_lamb_matches_reference() -> None:
    defaults = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    ours, ref = _tensors(), _tensors()
    opt = LAMB(_opt_groups(ours), **defaults)
    ref_state: dict = {}
    for step in range(5):
        _set_grads(ours, step)
        _set_grads(ref, step)
        opt.step()
        _ref_lamb(ref, ref_state, defaults)
        for a, b in zip(_flat(ours), _flat(ref)):
            assert_close(a, b)


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=0.3, weight_decay=1e-3, nesterov=True)),
                                    (LAMB, dict(lr=0.01))])
def test_state_dict_round_trip_continues_identically(cls: type, kw: dict) -> None:
    a = _tensors()
    opt_a = cls(_opt_groups(a), **kw)
    for step in range(3):
        _set_grads(a, step)
        opt_a.step()
    sd = copy.deepcopy(opt_a.state_dict())
    key = "momentum_buffer" if cls is LARS else "exp_avg_sq"
    assert sum(key in s for s in sd["state"].values()) == 10  # the 11 tensors less the one without grad
    b = _tensors()
    for ga, gb in zip(a, b):
        for pa, pb in zip(ga["params"], gb["params"]):
            pb.data.copy_(pa.data)
    opt_b = cls(_opt_groups(b), **kw)
    opt_b.load_state_dict(sd)
    for step in range(3, 6):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for x, y in zip(_flat(a), _flat(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_step_is_sync_free_on_meta_tensors(cls: type) -> None:
    # Meta tensors have no data: any .item() or Python branch on a tensor value raises.
    params = [nn.Parameter(torch.empty(16, 8, 3, 3, device="meta")),
              nn.Parameter(torch.empty(16, device="meta"))]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = cls(params, lr=0.1, weight_decay=1e-4)
    opt.step()
    opt.step()
    assert opt.state[params[0]]  # state was created


@pytest.mark.parametrize("cls,kw", [(LARS, dict(lr=2.0, momentum=0.9, trust_coefficient=0.02)),
                                    (LAMB, dict(lr=0.02))])
def test_closure_and_real_model_training_reduces_loss(cls: type, kw: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4))
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    opt = cls(model.parameters(), **kw)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(10):
        last = opt.step(closure).item()
    assert math.isfinite(last) and last < 0.7 * first


def test_bad_arguments_give_clear_errors() -> None:
    p = [nn.Parameter(torch.randn(3, 3))]
    with pytest.raises(ValueError, match="lr"):
        LARS(p, lr=-1.0)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(p, lr=0.1, trust_coefficient=0.0)
    with pytest.raises(ValueError, match="betas"):
        LAMB(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov"):
        LARS(p, lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        LARS(p, lr=0.1, pto=True)
    with pytest.raises(TypeError, match="pto must be"):
        LARS(p, lr=0.1, pto="yes")  # type: ignore[arg-type]


def test_balanced_assignment_resnet50() -> None:
    numels = [p.numel() for p in resnet50().parameters()]
    for world in (1, 2, 4, 7, 128):
        owner = balanced_assignment(numels, world)
        assert owner == balanced_assignment(numels, world)  # deterministic
        loads = [0] * world
        for n, r in zip(numels, owner):
            loads[r] += n
        # greedy LPT: no rank exceeds the lightest by more than the largest layer
        assert max(loads) - min(loads) <= max(numels)
        if world == 4:
            assert max(loads) / (sum(numels) / 4) < 1.05
        plans = [make_plan(numels, r, world) for r in range(world)]
        mine = sorted(i for pl in plans for i in pl.mine)
        assert mine == list(range(len(numels)))
        slots = {pl.gather_index[i] for pl in plans for i in pl.mine}
        assert len(slots) == len(numels) and max(slots) < world * plans[0].max_count


# ----------------------------------------------------------------------------- distributed (PTO)

_STEPS = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    # GroupNorm (not BatchNorm): per-rank batch statistics would make DDP != full-batch
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.GroupNorm(2, 6), nn.ReLU(), nn.Conv2d(6, 4, 3, bias=False),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.Linear(5, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _make_opt(kind: str, params, pto) -> torch.optim.Optimizer:
    if kind.startswith("lars"):
        coll = "all_reduce" if kind == "lars_ar" else "all_gather"
        return LARS(params, lr=0.8, momentum=0.9, weight_decay=5e-3, trust_coefficient=0.01,
                    pto=pto, pto_collective=coll)
    return LAMB(params, lr=0.01, weight_decay=0.02, pto=pto)


_KINDS = ("lars", "lars_ar", "lars_sub", "lamb")


def _average_grads(model: nn.Module, world: int) -> None:
    """What DDP does: average the gradients over the ranks (here one flat all-reduce; DDP
    itself is not used because its first construction imports torch._dynamo, ~6 s a rank)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))


def _pto_worker(rank: int, world: int) -> dict:
    sub, _ = dist.new_subgroups(2)  # ranks {0,1} and {2,3}: PTO over an explicit ProcessGroup
    out: dict = {"params": {}, "trust_equal": True}
    for kind in _KINDS:
        model = _net()
        opt = _make_opt(kind, model.parameters(), sub if kind == "lars_sub" else True)
        lo, hi = rank * 8 // world, (rank + 1) * 8 // world
        for step in range(_STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi])
            loss.backward()
            _average_grads(model, world)
            if kind == "lars":
                _, pto_trust = opt.trust_ratios()
                plain = _make_opt("lars", model.parameters(), False)
                _, ref_trust = plain.trust_ratios()
                out["trust_equal"] &= bool(torch.equal(pto_trust, ref_trust))
                out["plan"] = opt.pto.plan([p.numel() for p in model.parameters() if p.ndim > 1]).owner
            opt.step()
        # numpy, not tensors: torch's queue would share tensor storage by fd, which dies with the rank
        out["params"][kind] = [p.detach().numpy().copy() for p in model.parameters()]
    return out


def test_pto_matches_single_process_on_4_ranks() -> None:
    results = run_distributed(_pto_worker, world_size=4, local_size=2)
    # single process, full batch, no PTO
    for kind in _KINDS:
        model = _net()
        opt = _make_opt(kind, model.parameters(), False)
        assert getattr(opt, "pto", None) is None
        for step in range(_STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        for rank, res in enumerate(results):
            for a, b in zip(res["params"][kind], model.parameters()):
                assert_close(torch.from_numpy(a), b.detach(),
                             msg=lambda m, k=kind, r=rank: f"{k} rank {r}: {m}")
    for res in results:
        assert res["trust_equal"]
        assert res["plan"] == results[0]["plan"]        # every rank derived the same plan
        assert len(set(res["plan"])) == 4               # 4 adapted layers over 4 ranks: one each
    for kind in _KINDS:  # the ranks agree bit for bit
        for res in results[1:]:
            for a, b in zip(res["params"][kind], results[0]["params"][kind]):
                assert (a == b).all()


def test_pto_world_of_one_needs_no_collective(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        a, b = _tensors(), _tensors()
        opt_a = LARS(_opt_groups(a), lr=0.3, weight_decay=1e-3, pto=True)
        assert isinstance(opt_a.pto, PTO) and opt_a.pto.world_size == 1
        opt_b = LARS(_opt_groups(b), lr=0.3, weight_decay=1e-3)
        for step in range(2):
            _set_grads(a, step)
            _set_grads(b, step)
            opt_a.step()
            opt_b.step()
        for x, y in zip(_flat(a), _flat(b)):
            assert torch.equal(x, y)
    finally:
        dist.destroy_process_group()
