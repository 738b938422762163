"""``CommThread``: run each bucket's communication off the backward thread (``--overlap async``).

In the synchronous mode (``overlap="none"``) every method except the plain dense all-reduce runs
inside DDP's comm hook: backward stops while a bucket's selection and collectives run. With
``CommConfig(overlap="async")`` the hook only decides what to do (on the backward thread: method,
fp16 wire, warm-up, residual key) and hands the work to ONE communication thread per
:class:`~trainer.comm.state.HookState`; DDP gets a real ``torch.futures.Future`` that the thread
completes, and backward goes on computing the next buckets' gradients meanwhile. DDP waits for
every future at the end of backward, so ``maybe_step`` sees every bucket's verdict as before.

Same results, bit for bit: the thread runs exactly the synchronous code on exactly the same
inputs. Order is what makes that safe. Collectives on a process group must be issued in the same
order on every rank; DDP hands buckets to the hook in bucket order on every rank, and the thread
runs them FIFO, one at a time, so every rank issues the same sequence (sparse and dense buckets
of one step mixed: all of them go through the thread, never some from the backward thread).

Devices:

* CPU (gloo): the thread calls the method directly; gloo's waits and torch's kernels release
  the GIL, so backward's autograd thread keeps running.
* CUDA: the thread runs the method on a dedicated side stream per device. STREAM EDGE 1: the hook
  records an event on the producer's current stream (the bucket's gradients are written there)
  and the side stream waits for it before touching the bucket. STREAM EDGE 2: the future is
  CUDA-aware (``Future(devices=[...])``): ``set_result`` on the side stream records events there,
  and DDP's ``wait()`` makes ITS current stream wait for them and records the result's memory on
  it for the caching allocator. No host sync is added on either edge.

Failure: a method that raises fails its future (DDP re-raises it from ``backward()``) and poisons
the thread: every later task fails at once with the same cause instead of issuing a collective
the other ranks may never match (a hang). Build a new ``HookState`` to recover.

HAZARD (fork): the thread starts lazily, at the first bucket. A process forked afterwards (a
DataLoader worker) has no copy of it and must not use this state; the loader's workers never do.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_STOP = object()


class CommThread:
    """One FIFO communication thread (see the module docstring); ``submit`` returns DDP's future."""

    def __init__(self, name: str = "datacache-comm") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._failed: BaseException | None = None
        self.tasks_run = 0  # completed tasks (tests, logs)
        # Benchmarks set a list here: one (submitted, started, finished) perf_counter triple per task.
        self.trace: list[tuple[float, float, float]] | None = None

    # ---- producer side (the backward thread) -------------------------------------------
    def submit(self, fn: Callable[[], Tensor], like: Tensor) -> torch.futures.Future[Tensor]:
        """Queue ``fn`` (returns the bucket's reduced tensor) and return its future.

        ``like``: the bucket buffer; its device decides the CPU or the side-stream path."""
        if like.device.type == "cuda":
            fut: torch.futures.Future[Tensor] = torch.futures.Future(devices=[like.device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(like.device))  # STREAM EDGE 1 (producer side)
        else:
            fut = torch.futures.Future()
            ready = None
        self._start()
        self._queue.put((fn, fut, ready, like.device, time.perf_counter()))
        return fut

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # daemon: a run that ends (or dies) with work queued must not hang at exit
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    # ---- consumer side (the communication thread) ----------------------------------------
    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _run_one(self, fn: Callable[[], Tensor], fut: torch.futures.Future[Tensor], ready: Any,
                 device: torch.device) -> None:
        if self._failed is not None:
            raise RuntimeError(f"communication thread {self.name!r} stopped after an earlier failure "
                               f"({type(self._failed).__name__}: {self._failed}); build a new HookState")
        if ready is None:
            fut.set_result(fn())
            return
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)  # STREAM EDGE 1 (consumer side): the bucket is written
            out = fn()
            fut.set_result(out)  # STREAM EDGE 2: records events on this side stream for wait()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, fut, ready, device, submitted = item
            started = time.perf_counter()
            try:
                self._run_one(fn, fut, ready, device)
                self.tasks_run += 1
                if self.trace is not None:  # CUDA: host times (the kernels may still run after)
                    self.trace.append((submitted, started, time.perf_counter()))
            except BaseException as exc:  # handed to DDP through the future (re-raised from backward)
                if self._failed is None:
                    self._failed = exc
                fut.set_exception(exc)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the queued tasks (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(_STOP)
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
