"""StagingThread (trainer.staging) and the prefetcher's ``staging="thread"`` / ``--prefetch thread``: the
same items in the same order, staging one item ahead and never more, while the consumer holds the
current one; errors raised where they happened; a consumer that stops early leaves no thread and no
iterator behind; the trainer's losses and parameters equal the inline path's bit for bit."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader

from client.crop import BatchRequest, CropCollate, TaggedDataset
from client.dataset import CachedImageNet
from trainer.device_augment import DeviceAugment
from trainer.prefetch import Prefetcher
from trainer.staging import StagingThread

PATIENCE_S = 10.0  # a wait that fails the test instead of hanging it; never a speed assertion


def test_every_item_in_order_and_the_thread_ends() -> None:
    staged = StagingThread(iter(range(50)), lambda v: v * v)
    assert list(staged) == [v * v for v in range(50)]
    assert not staged.alive and len(staged.waits) == 50


def test_one_item_ahead_never_more() -> None:
    counts = {"staged": 0, "taken": 0, "worst": 0}

    def stage(v: int) -> int:
        counts["staged"] += 1
        counts["worst"] = max(counts["worst"], counts["staged"] - counts["taken"])
        return v

    for _ in StagingThread(iter(range(20)), stage):
        counts["taken"] += 1
        time.sleep(0.005)  # room for the thread to run ahead, if it could
    # at most the item in use and the next one exist at any time (as on the inline path)
    assert counts["staged"] == 20 and counts["worst"] <= 2


def test_the_next_item_is_staged_while_the_consumer_holds_this_one() -> None:
    staging = {k: threading.Event() for k in range(4)}

    def stage(v: int) -> int:
        staging[v].set()
        return v

    got = []
    for v in StagingThread(iter(range(4)), stage):
        if v + 1 in staging:
            # the consumer still holds item v: item v + 1 must be staged meanwhile (inline staging would
            # wait for the consumer to ask: this wait would then time out)
            assert staging[v + 1].wait(PATIENCE_S), f"item {v + 1} was not staged while item {v} was in use"
        got.append(v)
    assert got == [0, 1, 2, 3]


def _failing_source(at: int) -> Iterator[int]:
    for v in range(10):
        if v == at:
            raise ValueError(f"source item {v} is unreadable")
        yield v


@pytest.mark.parametrize("where", ["source", "stage"])
def test_an_error_is_raised_at_its_item_and_nothing_after_it_is_staged(where: str) -> None:
    staged_values: list[int] = []

    def stage(v: int) -> int:
        if where == "stage" and v == 3:
            raise ValueError(f"stage of item {v} failed")
        staged_values.append(v)
        return v

    source = _failing_source(3 if where == "source" else 99)
    staged = StagingThread(source, stage)
    got = []
    with pytest.raises(ValueError, match="item 3") as err:
        for v in staged:
            got.append(v)
    assert got == [0, 1, 2] and staged_values == [0, 1, 2]
    assert err.value.__traceback__ is not None  # the thread's traceback travels with it
    assert not staged.alive


def test_a_consumer_that_stops_early_leaves_no_thread_and_frees_the_iterator() -> None:
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            v = 0
            while True:
                yield v
                v += 1
        finally:
            closed.set()

    staged = StagingThread(endless(), lambda v: v)
    for v in staged:
        if v == 2:
            break
    staged.close()  # idempotent: the generator's own close already ran it
    assert not staged.alive
    gc.collect()
    assert closed.is_set(), "the source iterator is still referenced after close"


def test_close_while_the_thread_is_inside_the_source_waits_for_it_and_returns() -> None:
    inside = threading.Event()

    def slow() -> Iterator[int]:
        yield 0
        inside.set()
        time.sleep(0.3)  # a loader still making its batch when the consumer stops
        yield 1

    staged = StagingThread(slow(), lambda v: v)
    it = iter(staged)
    assert next(it) == 0
    assert inside.wait(PATIENCE_S)
    staged.close()
    assert not staged.alive


def test_waits_are_the_time_the_consumer_blocked() -> None:
    def slow() -> Iterator[int]:
        for v in range(3):
            time.sleep(0.05)
            yield v

    staged = StagingThread(slow(), lambda v: v)
    assert list(staged) == [0, 1, 2]
    # the consumer does nothing between items: it waits for each one's 50 ms (lower bound only)
    assert len(staged.waits) == 3 and all(w >= 0.04 for w in staged.waits)


def _loader(root: str, cache: str, persistent: bool) -> DataLoader:
    ds = CachedImageNet(root, cache=cache, short_side=40)
    requests = [BatchRequest(tuple(range(k, k + 5)), epoch=0, step=k // 5) for k in range(0, 20, 5)]
    return DataLoader(TaggedDataset(ds), batch_sampler=requests, num_workers=2,
                      collate_fn=CropCollate(seed=3), persistent_workers=persistent)


@pytest.mark.parametrize("persistent", [False, True])
def test_prefetcher_thread_staging_gives_the_inline_batches(small_imagefolder: str, tmp_path,
                                                            persistent: bool) -> None:
    loader = _loader(small_imagefolder, "lmdb://" + str(tmp_path / "c"), persistent)
    aug = DeviceAugment()
    inline = list(Prefetcher(loader, "cpu", aug, 24))
    staged = Prefetcher(loader, "cpu", aug, 24, staging="thread")
    for _ in range(2):  # two passes over the same loader (persistent workers: the same iterator object)
        got = list(staged)
        assert len(got) == len(inline) == 4
        for (x1, y1), (x2, y2) in zip(inline, got):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
        st = staged.stats
        assert st.steps == 4 and st.samples == 20 and len(st.waits) == 4 and st.augment_s > 0
    # a pass stopped after one batch, then a full pass: the first pass's thread freed the iterator
    for _ in staged:
        break
    assert len(list(staged)) == 4
    assert not [t for t in threading.enumerate() if t.name == "datacache-stage"]


def test_prefetcher_refuses_an_unknown_staging() -> None:
    with pytest.raises(ValueError, match="choose one of inline, thread"):
        Prefetcher([], "cpu", DeviceAugment(), 8, staging="later")


def test_trainer_prefetch_thread_equals_inline_bit_for_bit(digits_data, tmp_path,
                                                           in_process_training) -> None:
    from trainer.run import train
    from trainer.train_config import make_config

    runs = {}
    for mode in ("inline", "thread"):
        cfg = make_config(data=digits_data["val"], val_data=digits_data["val"], cache=digits_data["cache"],
                          short_side=32, model="small_resnet_cifar", width=4, resolution="16",
                          batch_size="16", epochs=2, lr=0.05, lr_scaling="none", workers=2, device="cpu",
                          progress=False, seed=3, val_every=1, out=str(tmp_path / mode), keep_checkpoints=0,
                          steps_per_epoch=6, prefetch=mode)
        runs[mode] = train(cfg, record_losses=True)
    inline, thread = runs["inline"], runs["thread"]
    assert len(inline.step_losses) == 12 and inline.step_losses == thread.step_losses
    def val(run):
        return [(e["val_top1"], e["val_loss"]) for e in run.epochs]

    assert val(inline) == val(thread) and len(val(inline)) == 2
    for a, b in zip(inline.model.state_dict().values(), thread.model.state_dict().values()):
        assert torch.equal(a, b)


def test_cuda_edges_of_thread_staging_come_in_order_on_the_right_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path of ``staging="thread"`` (trainer/prefetch.py, hazards 1-3) with recording stand-ins for
    torch.cuda's streams and events, on CPU tensors: each batch is augmented inside the side stream on
    the staging thread, which then records an event; the training thread makes its stream wait for
    exactly that event and records x and y to its stream before the step gets them. Same batches."""
    log: list[tuple] = []
    here = threading.current_thread().name
    in_side = threading.local()

    class Stream:
        def __init__(self, device=None) -> None:  # type: ignore[no-untyped-def]
            self.name = "side"

        def wait_event(self, event) -> None:  # type: ignore[no-untyped-def]
            log.append(("wait_event", event.n, threading.current_thread().name))

    class Event:
        count = 0

        def __init__(self) -> None:
            Event.count += 1
            self.n = Event.count

        def record(self, stream) -> None:  # type: ignore[no-untyped-def]
            log.append(("record", self.n, threading.current_thread().name, stream.name))

    class StreamContext:
        def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
            self.stream = stream

        def __enter__(self) -> None:
            in_side.on = True

        def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
            in_side.on = False

    compute = Stream()
    compute.name = "compute"
    aug = DeviceAugment()

    def augment(batch, size):  # type: ignore[no-untyped-def]
        out = aug(batch, size)
        inside = getattr(in_side, "on", False)
        log.append(("augment", int(out[1][0]), threading.current_thread().name, inside))
        return out

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: log.append(("set_device", threading.current_thread().name)))
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.append(("record_stream", s.name, threading.current_thread().name)))
    batches = [(torch.full((2, 3, 4, 4), k, dtype=torch.uint8), torch.tensor([k, k])) for k in range(3)]
    pre = Prefetcher(batches, "cpu", augment, 4, staging="thread")  # type: ignore[arg-type]
    pre.use_streams = True  # the CUDA path, with the stand-ins above
    got = []
    for _x, y in pre:
        got.append(int(y[0]))
        log.append(("step", int(y[0]), threading.current_thread().name))
    assert got == [0, 1, 2]
    stager = log[0][1]
    assert log[0] == ("set_device", stager) and stager != here  # the thread's own device, first
    for k in range(3):
        a = log.index(("augment", k, stager, True))  # on the staging thread, inside the side stream
        rec = next(i for i, e in enumerate(log) if e[0] == "record" and i > a)
        n = log[rec][1]
        assert log[rec] == ("record", n, stager, "side")  # the batch's event, after its augmentation
        wait = log.index(("wait_event", n, here))  # waited for on the training thread ...
        step = log.index(("step", k, here))
        assert rec < wait < step  # ... before the step reads the batch
        assert log[wait + 1:wait + 3] == [("record_stream", "compute", here)] * 2  # x and y, hazard 2
    assert sum(e[0] == "wait_event" for e in log) == 3
