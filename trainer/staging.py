"""Stage the next item of an iterator on a background thread, one item ahead of the consumer.

The prefetcher's inline path stages batch ``t + 1`` (takes it from the loader, issues its copy,
enqueues its augmentation) on the training thread, between the step's one host sync and the next
forward's first kernel: the GPU idles for that host time every step (docs/benchmarks.md, "The
prefetcher on the H100"). :class:`StagingThread` moves that work off the training thread: the
consumer only takes a finished item from a queue.

Rules (each is a hazard handled here):

* **One item ahead, never more.** A semaphore with one permit: the thread takes item ``t + 1`` from
  the source only after the consumer took item ``t``, so at most two staged items are alive (the one
  in use, the next one), as on the inline path: device memory does not grow.
* **Order and errors.** Items come out in the source's order. An exception raised by the source or
  by ``stage`` ends the thread and is raised to the consumer at the item where it happened, with its
  traceback; nothing after it is staged.
* **The source is used on the thread only.** The caller creates the iterator on its own thread
  before starting this one (a ``DataLoader`` forks its workers in ``iter()``: fork from the training
  thread, while no staging thread of this pass exists), and never touches it again.
* **Close joins.** :meth:`close` (also on ``GeneratorExit`` of a consumer that stops early) stops the
  thread and joins it: the iterator is released before the caller may start another pass over the
  same loader (persistent workers reuse one iterator object). The thread is never inside ``next``
  for longer than the source itself blocks.
* **GIL.** The thread holds the GIL only for Python between torch calls, which release it: the
  training thread launching kernels interleaves with it at every op.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

# where a prefetcher stages the next batch (trainer/prefetch.py): on the training thread, or on this one
STAGING_CHOICES = ("inline", "thread")

T = TypeVar("T")
S = TypeVar("S")

_END = object()


class StagingThread(Generic[T, S]):
    """Iterate ``stage(item)`` for each ``item`` of ``source`` with staging on a thread (see the module
    docstring). ``waits`` holds, per item taken, the seconds the consumer blocked for it."""

    def __init__(self, source: Iterator[T], stage: Callable[[T], S], *, name: str = "datacache-stage",
                 setup: Callable[[], None] | None = None) -> None:
        self._source = source
        self._stage = stage
        self._setup = setup
        self._permit = threading.Semaphore(1)
        self._ready: queue.Queue[tuple[object, Any]] = queue.Queue()
        self._stop = threading.Event()
        self.waits: list[float] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()  # e.g. the thread's CUDA device: the current device is per thread
            while True:
                self._permit.acquire()  # one item ahead: released when the consumer takes one
                if self._stop.is_set():
                    return
                try:
                    item = next(self._source)
                except StopIteration:
                    self._ready.put((_END, None))
                    return
                self._ready.put((None, self._stage(item)))
        except BaseException as exc:  # any: handed to the consumer and raised there
            self._ready.put((exc, None))
        finally:
            self._source = None  # type: ignore[assignment]  # the iterator is released with the thread

    def __iter__(self) -> Iterator[S]:
        try:
            while True:
                t = time.perf_counter()
                tag, value = self._ready.get()
                self.waits.append(time.perf_counter() - t)
                if tag is _END:
                    self.waits.pop()  # the end of the pass is no data wait
                    return
                if isinstance(tag, BaseException):
                    self.waits.pop()
                    raise tag
                self._permit.release()  # the thread may stage the next item while this one is used
                yield value
        finally:
            self.close()

    def close(self) -> None:
        """Stop staging and join the thread (idempotent); staged items not taken are dropped."""
        self._stop.set()
        self._permit.release()  # wakes a thread waiting for its permit; it sees the stop and returns
        self._thread.join()
        while not self._ready.empty():  # drop what was staged and not taken (device memory freed)
            self._ready.get_nowait()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
