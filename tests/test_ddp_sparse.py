"""Real sparsity through DDP: density 1 %, buckets of 30k and 81k elements (so MSTopK's device
path and its CPU compact path both run, in NaiveAG and in HiTopK's chunks), 4 gloo ranks as
2 nodes x 2, one spawn for all configurations. A frozen output offset scaled by 1e9 gives 8
gradient entries ~1e9x the rest (the outliers that broke value-range bisection). Every bucket of
every step is checked against a sequential numpy re-statement of the algorithm (error feedback
included) fed with the same per-rank bucket inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed, to_plain
from trainer.comm.comm_config import CommConfig
from trainer.comm.mstopk import COMPACT_MIN_NUMEL

WORLD, LOCAL, NODES = 4, 2, 2
DENSITY = 0.01
STEPS = 4  # step 0 is DDP's dense layout warm-up, then 3 sparse steps
CAP_MB = 0.1  # DDP closes a bucket once it reaches the cap: 30,286 and 81,000 elements


CONFIGS = (("naive_ag", "mstopk"), ("hitopk", "mstopk"), ("hitopk", "exact"))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(80, 1000), nn.Tanh(), nn.Linear(1000, 30), nn.Tanh(),
                                  nn.Linear(30, 8))
        self.offset = nn.Parameter(torch.zeros(8))  # trained with lr 0: its gradient is 1e9 x dL/dy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + 1e9 * self.offset


def _rank_main(rank: int, world: int) -> dict:
    return to_plain({cfg: _run_config(rank, *cfg) for cfg in CONFIGS})


def _run_config(rank: int, method: str, selector: str) -> list[list[tuple]]:
    from trainer.comm import HOOKS, register

    model = _Net()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    steps: list[list[tuple]] = []

    def recording(state, bucket):  # no annotations: DDP checks real objects
        key = "|".join(names[id(p)] for p in bucket.parameters())
        before = bucket.buffer().detach().clone()
        fut = HOOKS[method](state, bucket)
        return fut.then(lambda f: steps[-1].append((key, before, f.value().detach().clone())) or f.value())

    state = register(ddp, CommConfig(method=method, selector=selector, density=DENSITY), hook=recording)
    groups = [{"params": model.body.parameters()}, {"params": [model.offset], "lr": 0.0}]
    opt = torch.optim.SGD(groups, lr=0.05)
    for step in range(STEPS):
        steps.append([])
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 80, generator=g), torch.randn(32, 8, generator=g)
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        state.finish_step()
    return steps


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x| (ties: lowest index), by a stable sort: the selectors' rule."""
    return np.argsort(-np.abs(x), kind="stable")[:k]


def _k(numel: int) -> int:
    return min(numel, max(1, round(DENSITY * numel)))


def _ref_naive_ag(inputs: list[np.ndarray], res: list[np.ndarray]) -> np.ndarray:
    out = np.zeros_like(inputs[0])
    for r, g in enumerate(inputs):
        x = res[r] + g * np.float32(1 / WORLD)
        sel = _topk(x, _k(x.size))
        np.add.at(out, sel, x[sel])
        x[sel] = 0
        res[r] = x
    return out


def _ref_hitopk(inputs: list[np.ndarray], res: list[np.ndarray]) -> np.ndarray:
    d = inputs[0].size
    c = -(-d // LOCAL)
    padded = [np.concatenate([g, np.zeros(LOCAL * c - d, np.float32)]) for g in inputs]
    out = np.zeros(LOCAL * c, np.float32)
    for j in range(LOCAL):  # chunk j is handled by local rank j of every node
        for i in range(NODES):
            node_sum = padded[i * LOCAL][j * c:(j + 1) * c] + padded[i * LOCAL + 1][j * c:(j + 1) * c]
            r = i * LOCAL + j
            x = res[r] + node_sum * np.float32(1 / WORLD)
            sel = _topk(x, _k(c))
            np.add.at(out, j * c + sel, x[sel])
            x[sel] = 0
            res[r] = x
    return out[:d]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_rank_main, world_size=WORLD, local_size=LOCAL)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_sparse_ddp_matches_sequential_reference(ranks: list[dict], config: tuple[str, str]) -> None:
    method = config[0]
    runs = [out[config] for out in ranks]
    ref_fn = _ref_naive_ag if method == "naive_ag" else _ref_hitopk
    residuals: dict[str, list[np.ndarray]] = {}
    sizes = set()
    for step in range(STEPS):
        buckets = [{key: (inp, out) for key, inp, out in runs[r][step]} for r in range(WORLD)]
        assert all(b.keys() == buckets[0].keys() for b in buckets)
        for key in buckets[0]:
            inputs = [buckets[r][key][0] for r in range(WORLD)]
            outputs = [buckets[r][key][1] for r in range(WORLD)]
            for o in outputs[1:]:
                assert np.array_equal(o, outputs[0]), (step, key)  # bit-identical on every rank
            if step == 0:  # dense layout warm-up: the plain average
                np.testing.assert_allclose(outputs[0], sum(inputs) / WORLD, rtol=1e-5, atol=1e-7)
                continue
            d = inputs[0].size
            sizes.add(d)
            rlen = d if method == "naive_ag" else -(-d // LOCAL)
            res = residuals.setdefault(key, [np.zeros(rlen, np.float32) for _ in range(WORLD)])
            expect = ref_fn(inputs, res)
            assert np.count_nonzero(outputs[0]) <= np.count_nonzero(expect)
            np.testing.assert_allclose(outputs[0], expect, rtol=1e-5, atol=1e-8, err_msg=f"{step} {key}")
            # the same support: exactly the entries the reference selected
            assert np.array_equal(outputs[0] != 0, expect != 0), (step, key)
    # both selection paths ran: a chunk below COMPACT_MIN_NUMEL (device path) and one above (compact)
    assert sizes == {30_286, 81_000}, sizes
    chunks = sizes if method == "naive_ag" else {-(-d // LOCAL) for d in sizes}
    assert min(chunks) < COMPACT_MIN_NUMEL <= max(chunks), chunks
