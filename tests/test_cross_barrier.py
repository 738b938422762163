"""``--overlap cross`` (trainer/comm/cross_barrier.py) on real gloo process groups.

The reference is the synchronous path: DDP with the comm hook (``overlap="none"``) and one
``optimizer.step()`` through ``maybe_step``. DDP rebuilds its buckets after the first step in the
order gradients arrive; the reference records that layout and the cross run uses exactly those pieces
("with the same pieces"). The first step is the dense warm-up in both (two ranks: a + b is exact in
any order, so the different first-step layout cannot matter). Then the parameters after N steps must
be equal bit for bit, for every method, with a step skipped for a NaN on one rank in between.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from trainer.comm.comm_config import CommConfig
from trainer.comm.cross_barrier import CrossBarrier, CrossBarrierError, default_layout
from trainer.comm.state import HookState

METHODS = ("allreduce", "torus", "naive_ag", "hitopk")
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48),
                         nn.ReLU(), nn.Linear(48, 10))


def _batches(rank: int, nan_at: int | None, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        if step == nan_at and rank == 1:
            x[0, 0] = float("nan")  # one rank's gradient goes non-finite: every rank skips the step
        out.append((x.to(device), torch.randint(0, 10, (8,), generator=g).to(device)))
    return out


def _opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _config(method: str) -> CommConfig:
    return CommConfig(method=method, selector="exact", density=0.1, nan_check=True, min_numel_for_sparse=1)


def _sync_reference(method: str, nan_at: int | None, rank: int,
                    device: str = "cpu") -> tuple[dict, list[list[str]], int]:
    from trainer.comm import maybe_step, register
    from trainer.comm.hooks import make_hook

    model = _model().to(device)
    names = {id(p): n for n, p in model.named_parameters()}
    ids = [torch.device(device).index or 0] if device != "cpu" else None
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01, device_ids=ids)
    layout: list[list[str]] = []
    cfg = _config(method)
    hook = make_hook(cfg)

    def recording(state, bucket):  # type: ignore[no-untyped-def]
        layout.append([names[id(p)] for p in bucket.parameters()])
        return hook(state, bucket)

    recording.comm_hook = True  # type: ignore[attr-defined]
    recording.__annotations__ = hook.__annotations__
    state = register(ddp, cfg, recording)
    opt = _opt(list(model.parameters()))
    for x, y in _batches(rank, nan_at, device):
        layout.clear()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        maybe_step(opt, state)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, layout, state.skipped_steps


def _both(rank: int, world: int, method: str, nan_at: int | None, device: str = "cpu") -> dict:
    ref, layout, ref_skipped = _sync_reference(method, nan_at, rank, device)
    model = _model().to(device)
    by_name = dict(model.named_parameters())
    state = HookState(_config(method))
    engine = CrossBarrier(model, _opt, state, layout=[[by_name[n] for n in piece] for piece in layout],
                          credit_mb=0.002)
    engine.trace = []
    applied = []
    for x, y in _batches(rank, nan_at, device):
        applied.append(engine.backward(nn.functional.cross_entropy(engine(x), y)))
    engine.synchronize()
    engine.close()
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"equal": {n: bool(torch.equal(ref[n], got[n])) for n in ref}, "pieces": len(layout),
            "skipped": (ref_skipped, state.skipped_steps), "applied": applied, "rounds": engine.rounds,
            "moved": bool(any(not torch.equal(_model().state_dict()[n].to(device), got[n]) for n in got)),
            "trace_steps": sorted({t["step"] for t in engine.trace})}


@pytest.mark.parametrize("method", METHODS)
def test_cross_equals_the_synchronous_ddp_run_bit_for_bit(method: str) -> None:
    for r in run_distributed(_both, world_size=2, local_size=1, args=(method, None)):
        assert r["pieces"] > 2, r  # several pieces, so priority and credit have something to order
        assert all(r["equal"].values()), r["equal"]
        assert r["moved"] and r["applied"] == [True] * STEPS and r["skipped"] == (0, 0)
        assert r["trace_steps"] == list(range(STEPS)) and r["rounds"] >= STEPS


def test_a_nan_on_one_rank_skips_that_step_everywhere_like_the_synchronous_run() -> None:
    for r in run_distributed(_both, world_size=2, local_size=1, args=("hitopk", 2)):
        assert all(r["equal"].values()), r["equal"]
        assert r["applied"] == [True, True, False, True, True] and r["skipped"] == (1, 1)


def _cuda_every_method(rank: int, world: int) -> dict:  # pragma: no cover - needs a GPU
    return {m: _both(rank, world, m, None, "cuda") for m in METHODS}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cross_on_a_cuda_side_stream_equals_the_synchronous_run() -> None:  # pragma: no cover - needs a GPU
    """One NCCL rank, every method: the side stream, its events and the forward's device-side waits give
    the synchronous DDP run's parameters bit for bit (per-piece optimizers do the same per-element
    arithmetic)."""
    (out,) = run_distributed(_cuda_every_method, world_size=1, local_size=1, backend="nccl", timeout=300)
    for method, r in out.items():
        assert all(r["equal"].values()), (method, r["equal"])
        assert r["moved"] and r["applied"] == [True] * STEPS and r["pieces"] > 2, method


def test_default_layout_groups_backward_order_by_size() -> None:
    model = _model()
    pieces = default_layout(model, piece_mb=0.01)  # 10,485 bytes: about 2,600 floats a piece
    flat = [p for piece in pieces for p in piece]
    assert [id(p) for p in flat] == [id(p) for p in reversed(list(model.parameters()))]
    assert all(sum(p.numel() * 4 for p in piece) <= 10485 or len(piece) == 1 for piece in pieces)
    assert len(default_layout(model, piece_mb=1000)) == 1


def test_refusals_name_the_reason_and_the_alternative() -> None:
    model = _model()
    with pytest.raises(CrossBarrierError, match=r"fp16 wire.*--overlap async"):
        CrossBarrier(model, _opt, HookState(CommConfig(fp16=True)))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(CrossBarrierError, match=r"parameter 1.weight is shared with 0.weight"):
        CrossBarrier(tied, _opt, HookState(CommConfig()))
    with pytest.raises(CrossBarrierError, match="every trainable parameter once"):
        CrossBarrier(model, _opt, HookState(CommConfig()), layout=[list(model.parameters())[:2]])
    with pytest.raises(CrossBarrierError, match="must be > 0 MB"):
        CrossBarrier(model, _opt, HookState(CommConfig()), credit_mb=0)


def _held_round(rank: int, world: int) -> list[int]:
    model = _model()
    engine = CrossBarrier(model, _opt, HookState(_config("allreduce")), piece_mb=0.005, credit_mb=100)
    engine.trace = []
    for step, (x, y) in enumerate(_batches(rank, None)[:3]):
        loss = nn.functional.cross_entropy(engine(x), y)
        if step == 1:
            # The thread cannot take its lock while backward runs: every piece is queued before the
            # round, which then holds all of them (RLock: the hooks on this thread still queue).
            with engine._cv:
                engine.backward(loss)
        else:
            engine.backward(loss)
    engine.close()
    return [t["priority"] for t in sorted(engine.trace, key=lambda t: t["start"]) if t["step"] == 1]


def test_a_round_starts_the_front_layers_first() -> None:
    """Pieces come out of backward last layer first; a round starts them front layer first."""
    for prios in run_distributed(_held_round, world_size=2, local_size=1):
        assert len(prios) > 2 and prios == sorted(prios), prios


# ------------------------------------------------------------------ the trainer: --overlap cross


def _train_rank(rank: int, world: int, cfg_values: dict) -> dict:
    from trainer.run import train
    from trainer.train_config import TrainConfig

    res = train(TrainConfig.from_dict(cfg_values), record_losses=True)
    return {"losses": res.step_losses, "val": [e.get("val_top1") for e in res.epochs],
            "params": {k: v.detach().numpy().copy() for k, v in res.model.named_parameters()},
            "skipped": [e["skipped_steps"] for e in res.epochs]}


@pytest.mark.slow
def test_trainer_cross_equals_overlap_none_and_resumes_mid_epoch(digits_data: dict, tmp_path) -> None:
    """``--overlap cross`` through trainer.run: dense all-reduce on 2 ranks (a + b is exact in any
    order, so DDP's bucket layout cannot matter) with LARS, an LR warm-up (each piece gets its own
    step's lr), a checkpoint mid-epoch and validation: the same losses and parameters as
    ``--overlap none`` bit for bit, and a resume from the step-7 checkpoint continues the cross run
    exactly."""
    from trainer.train_config import make_config

    cfg = make_config(
        data=digits_data["train"], val_data=digits_data["val"], cache=digits_data["cache"], short_side=32,
        model="small_resnet_cifar", width=4, zero_init_residual=False, resolution="16", batch_size="32",
        epochs=2, steps_per_epoch=10, comm="allreduce", optimizer="lars", lr=0.5, lr_scaling="none",
        warmup_epochs=0.5, checkpoint_every=7, keep_checkpoints=0, workers=0, device="cpu",
        progress=False, seed=3, bucket_cap_mb=0.05, comm_credit_mb=0.1, out=str(tmp_path / "none"))
    ref = run_distributed(_train_rank, world_size=2, local_size=1, args=(cfg.to_dict(),))
    cross_cfg = {**cfg.to_dict(), "overlap": "cross", "out": str(tmp_path / "cross")}
    cross = run_distributed(_train_rank, world_size=2, local_size=1, args=(cross_cfg,))
    ckpt = tmp_path / "cross" / "checkpoints" / "step00000007"
    resumed = run_distributed(_train_rank, world_size=2, local_size=1,
                              args=({**cross_cfg, "resume": str(ckpt), "out": str(tmp_path / "resumed")},))
    for rank in range(2):
        a, b, c = ref[rank], cross[rank], resumed[rank]
        assert len(a["losses"]) == 20 and a["losses"] == b["losses"] and b["losses"][7:] == c["losses"]
        assert a["val"] == b["val"] == c["val"] and a["skipped"] == b["skipped"] == [0, 0]
        for k, v in a["params"].items():
            assert np.array_equal(v, b["params"][k]) and np.array_equal(v, c["params"][k]), k


def test_trainer_config_refuses_what_cross_cannot_do() -> None:
    from datacache.config import ConfigError
    from trainer.train_config import make_config

    for extra, word in (({"pto": True, "optimizer": "lars"}, "--pto"), ({"fp16_comm": True}, "--fp16-comm")):
        with pytest.raises(ConfigError, match=f"--overlap cross cannot run with {word}.*--overlap async"):
            make_config(overlap="cross", **extra)
    with pytest.raises(ConfigError, match="comm_credit_mb"):
        make_config(overlap="cross", comm_credit_mb=0)
    with pytest.raises(ValueError, match="CrossBarrier"):
        from trainer.comm import CommConfig, register

        register(nn.Linear(2, 2), CommConfig(overlap="cross"))  # type: ignore[arg-type]


# ------------------------------------------------------------------ CUDA: the stream edges, in order
class _Token:
    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n


class RecordingEdges:
    """:class:`~trainer.comm.cross_barrier.StreamEdges` as the CUDA path calls it, recorded in order (the
    events are tokens; "side" says whether the calling thread is inside ``on_side``)."""

    def __init__(self) -> None:
        import threading

        self.log: list[tuple[str, object, str]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._n = 0

    def inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def _add(self, what: str, token: object) -> None:
        import threading

        with self._lock:
            self.log.append((what, token, threading.current_thread().name))

    def _token(self, kind: str) -> _Token:
        with self._lock:
            self._n += 1
            return _Token(kind, self._n)

    def produced(self, flat: torch.Tensor) -> _Token:
        tok = self._token("ready")
        self._add("produced", tok)
        return tok

    def on_side(self, ready: object):  # type: ignore[no-untyped-def]
        import contextlib

        @contextlib.contextmanager
        def block():  # type: ignore[no-untyped-def]
            self._add("side_wait", ready)
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                yield
            finally:
                self._local.depth -= 1

        return block()

    def applied(self) -> _Token:
        assert self.inside(), "applied() outside on_side"
        tok = self._token("applied")
        self._add("applied", tok)
        return tok

    def before_forward(self, applied: object) -> None:
        self._add("before_forward", applied)

    def drain(self) -> None:
        self._add("drain", None)


def _edges_rank(rank: int, world: int) -> dict:
    import trainer.comm.cross_barrier as cb

    edges = RecordingEdges()
    outside: list[str] = []
    real_reduce = cb._reduce

    recording = [False]  # the plain run has no side stream to be inside of

    def reduce_checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        if recording[0] and not edges.inside():
            outside.append("reduce")
        return real_reduce(*args, **kwargs)

    def opt(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        o = _opt(params)
        step = o.step

        def checked_step(*a, **k):  # type: ignore[no-untyped-def]
            if recording[0] and not edges.inside():
                outside.append("step")
            return step(*a, **k)

        o.step = checked_step  # type: ignore[method-assign]
        return o

    cb._reduce = reduce_checked
    try:
        outs = {}
        for name, kw in (("plain", {}), ("recorded", {"_edges": edges})):
            recording[0] = bool(kw)
            model = _model()
            engine = CrossBarrier(model, opt, HookState(_config("hitopk")), piece_mb=0.005, credit_mb=0.01,
                                  **kw)
            for x, y in _batches(rank, None):
                engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.synchronize()
            engine.close()
            outs[name] = [p.detach().clone() for p in model.parameters()]
    finally:
        cb._reduce = real_reduce
    log = [(what, tok.kind if isinstance(tok, _Token) else None, id(tok) if tok is not None else None, thread)
           for what, tok, thread in edges.log]
    return {"equal": all(torch.equal(a, b) for a, b in zip(outs["plain"], outs["recorded"])),
            "outside": outside, "log": log, "pieces": len(default_layout(_model(), 0.005))}


def test_cuda_stream_edges_come_in_order_on_the_right_threads() -> None:
    """The order the CUDA path relies on (trainer/comm/cross_barrier.py, STREAM EDGE 1 and 2), recorded
    on 2 gloo ranks: each piece's ready event is recorded in backward and waited for by the side stream
    before its reduction; reductions and optimizer steps run inside the side stream; each update records
    an event that the next forward of its module waits for; ``synchronize`` drains the side stream.
    The recording changes nothing: parameters equal the plain CPU run's bit for bit."""
    for r in run_distributed(_edges_rank, world_size=2, local_size=1):
        assert r["equal"] and r["outside"] == [], r["outside"]
        log = r["log"]
        produced = [i for i, e in enumerate(log) if e[0] == "produced"]
        assert len(produced) == r["pieces"] * STEPS
        for i in produced:  # waited for exactly once, later, on the communication thread
            waits = [j for j, e in enumerate(log) if e[0] == "side_wait" and e[2] == log[i][2]]
            assert len(waits) == 1 and waits[0] > i and log[waits[0]][3] == "datacache-cross"
            assert log[i][3] != "datacache-cross"
        applied = {e[2]: i for i, e in enumerate(log) if e[0] == "applied"}
        assert len(applied) == r["pieces"] * STEPS
        assert all(log[i][3] == "datacache-cross" for i in applied.values())
        forwards = [(i, e) for i, e in enumerate(log) if e[0] == "before_forward"]
        waited = [(i, e) for i, e in forwards if e[2] is not None]
        assert len(forwards) > len(waited) > 0  # the first step has nothing to wait for
        for i, e in waited:  # a forward waits only for updates already recorded
            assert e[1] == "applied" and applied[e[2]] < i and e[3] != "datacache-cross"
        assert log[-1][0] == "drain"
