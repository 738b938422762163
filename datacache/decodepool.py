"""The decode process pool of fills: one per ``datacache warm`` run, one for a daemon's whole life.

:class:`DecodePool` wraps a ``multiprocessing`` fork pool and owns the three things that used to hang
the daemon:

* **Signals from birth.** A forked child starts as a copy of the parent, Python signal handlers
  included: until a worker's initializer ran, a SIGTERM sent to the process group (systemd, ``kill
  -TERM -PGID``) ran the *daemon's* handler inside the worker, which then neither exited nor worked,
  and ``Pool.terminate()`` waited for it forever. The pool is therefore created with SIGTERM and
  SIGINT **blocked** in the creating thread (``pthread_sigmask``): the children and the pool's helper
  threads (whose thread also forks replacement workers) inherit the blocked mask, so no signal can be
  handled in a child before :func:`_init_worker` has set both to ``SIG_IGN`` and unblocked them. A
  worker ignores SIGTERM/SIGINT for its whole life: only its parent decides when it ends (drain, or
  SIGKILL).
* **Bounded shutdown.** ``Pool.join()``/``Pool.terminate()`` block forever when a worker is stopped
  (SIGSTOP), wedged in a system call or died holding the task queue's lock. :meth:`DecodePool.close`
  waits for a clean exit at most ``timeout`` seconds, then SIGKILLs every worker (SIGKILL also ends
  a stopped process) and finishes ``Pool.terminate()`` in a daemon thread it never waits for.
* **Exit never waits on it.** A pool nobody closed (an exception between ``get`` and ``close``, a
  notebook that just exits) is SIGKILLed by an ``atexit`` hook before ``multiprocessing``'s own exit
  handler runs: that handler terminates the pool and joins its workers, and a worker that ignores
  SIGTERM (all of ours) and missed its stop sentinel kept the interpreter from exiting, for ever.
* **Lost work is noticed.** A worker that dies mid-task (OOM killer, SIGKILL) takes its task with it:
  ``Pool`` starts a replacement but the result never comes. :meth:`DecodePool.check` raises
  :class:`WorkerLost` when any worker of the pool has exited, so the fill fails (and is retried)
  instead of waiting forever; :meth:`DecodePool.discard` then drops the broken pool and the next
  :meth:`DecodePool.get` forks a fresh one.

Fork boundary: the daemon creates its pool lazily, from its pass thread, after it opened its store
and started its HTTP thread. A worker never uses anything it inherited (store, LMDB environment,
Redis connections, threads): everything it needs comes with each task (:mod:`datacache.warm`), and a
remote store is opened in the worker itself. Workers leave with ``os._exit`` (multiprocessing), so
no inherited handle is ever closed (or flushed) twice.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.util  # its exit handler is registered before ours (see _kill_unclosed_pools)
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("datacache.decodepool")
_SIGNALS = {signal.SIGTERM, signal.SIGINT}


_LIVE: weakref.WeakSet[DecodePool] = weakref.WeakSet()  # pools with workers, for the exit hook


@atexit.register
def _kill_unclosed_pools() -> None:
    # atexit runs last-registered first: multiprocessing.util (imported above) registered its handler
    # before this one, so every pool still alive here is killed before it would join their workers.
    for pool in list(_LIVE):
        pool.kill()


class WorkerLost(RuntimeError):
    """A decode worker exited while the pool was in use; its task (if any) is lost."""


def _init_worker(setup: Callable[[], None] | None = None) -> None:
    # Runs first in every worker, with SIGTERM/SIGINT still blocked (see the module docstring): ignore
    # both for good, then unblock (a signal that arrived in between is discarded, as it is ignored).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Fork boundary: a parent that ran torch ops has a live OpenMP pool that the child inherited
        # without its threads; the next parallel region in the child (decode's torch shrink) would hang.
        # One intra-op thread per worker (what DataLoader workers do) never enters that pool.
        torch.set_num_threads(1)
    if setup is not None:
        setup()  # the owner's per-worker setup (the daemon's: cache_daemon.heap.decode_worker_heap)


class DecodePool:
    """A lazily forked pool of ``workers`` decode processes (see the module docstring).

    Thread-safe: :meth:`get`, :meth:`check`, :meth:`pids` may be called from the pass thread while the
    main thread calls :meth:`close` or :meth:`kill`.
    """

    def __init__(self, workers: int | None = None, worker_setup: Callable[[], None] | None = None) -> None:
        self.workers = max(1, int(workers or os.cpu_count() or 1))
        self.worker_setup = worker_setup  # called first in every worker (fork: nothing is pickled)
        self.created = 0  # pools forked so far (a daemon's /status shows it: 1 in a healthy life)
        self._pool: Any = None
        self._procs: list[Any] = []  # the workers forked with this pool (Process objects)
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> Any:
        """The ``multiprocessing`` pool, forked on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError("decode pool is closed (the daemon is stopping)")
            if self._pool is None:
                ctx = mp.get_context("fork")  # POSIX; the signal mask below is what makes fork safe here
                # Signal boundary: block SIGTERM/SIGINT in this thread while the workers and the pool's
                # helper threads are created, so they start with them blocked (module docstring). The
                # daemon's handler still runs: a process-wide signal goes to a thread that does not
                # block it (Python then runs the handler in the main thread).
                old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
                try:
                    self._pool = ctx.Pool(self.workers, initializer=_init_worker,
                                          initargs=(self.worker_setup,))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
                # Pool keeps its workers in the private list ``_pool`` (stable since Python 3.2); it is
                # the only way to learn their pids, and to SIGKILL them where terminate() would hang.
                self._procs = list(self._pool._pool)
                self.created += 1
                _LIVE.add(self)
                log.info("decode pool %d: %d processes (pids %s)", self.created, self.workers,
                         ", ".join(str(p.pid) for p in self._procs))
            return self._pool

    def pids(self) -> list[int]:
        with self._lock:
            return [p.pid for p in self._procs]

    def check(self) -> None:
        """Raise :class:`WorkerLost` if a worker of the current pool has exited."""
        with self._lock:
            dead = [p for p in self._procs if p.exitcode is not None]
        if dead:
            p = dead[0]
            how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            raise WorkerLost(f"decode worker pid {p.pid} died ({how}); the chunks it held are decoded "
                             "again by the next pass")

    def discard(self) -> None:
        """Kill the current pool (if any); the next :meth:`get` forks a new one."""
        with self._lock:
            pool, procs, self._pool, self._procs = self._pool, self._procs, None, []
        _kill(pool, procs)

    def kill(self) -> None:
        """SIGKILL every worker now and refuse new pools (forced shutdown)."""
        with self._lock:
            self._closed = True
            pool, procs, self._pool, self._procs = self._pool, self._procs, None, []
        _kill(pool, procs)

    def close(self, timeout: float, abort: threading.Event | None = None) -> bool:
        """Let the workers finish their tasks and exit, at most ``timeout`` seconds (or until ``abort`` is
        set); True when they did. Otherwise every worker is SIGKILLed (:meth:`kill`). Never blocks
        longer than ``timeout`` (plus the bounded kill)."""
        with self._lock:
            self._closed = True
            pool, procs = self._pool, self._procs
        if pool is None:
            return True
        done = threading.Event()

        def finish() -> None:
            pool.close()
            pool.join()
            done.set()

        # Hazard: Pool.join() can block forever (a stopped worker); it runs in a daemon thread that the
        # interpreter does not wait for, and we wait for that thread at most ``timeout`` seconds.
        threading.Thread(target=finish, name="datacache-pool-close", daemon=True).start()
        end = time.monotonic() + max(0.0, timeout)
        while not done.wait(min(0.1, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end or (abort is not None and abort.is_set()):
                break
        if done.is_set():
            with self._lock:
                self._pool, self._procs = None, []
            pool.terminate()  # joined already: only releases the pool's handler threads and pipes
            return True
        log.warning("decode pool did not exit within %.1f s (or was told to stop): killing its %d processes",
                    timeout, len(procs))
        self.kill()
        return False


def _kill(pool: Any, procs: list[Any]) -> None:
    """End ``pool`` without waiting on it: ``pool.terminate()`` starts in a daemon thread (it first tells
    the pool's worker handler to stop starting replacements), then every worker -- the first ones and
    any replacement -- is SIGKILLed (a stopped process dies too). Nobody waits for ``terminate()``: it
    can block forever on the task queue's lock when a killed worker held it (an idle worker holds it
    while it waits for a task)."""
    if pool is None:
        return
    threading.Thread(target=pool.terminate, name="datacache-pool-terminate", daemon=True).start()
    killed: set[int] = set()
    deadline = time.monotonic() + 3.0  # the whole kill is bounded (a worker in D state dies late)
    for n in range(20):  # the worker handler polls every 0.1 s: two quiet rounds and it has stopped
        current = [p for p in [*procs, *list(getattr(pool, "_pool", []))] if p.pid not in killed]
        if not current and n > 1:
            break
        for p in current:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            killed.add(p.pid)
        for p in current:  # reap them (a killed process exits at once)
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        time.sleep(0.12)
