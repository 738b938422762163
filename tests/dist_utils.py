"""Run a function on N real gloo ranks (loopback) the way torchrun would set them up.

``run_distributed(fn, world_size=4, local_size=2, args=(...))`` spawns ``world_size``
processes, sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), initialises the default process group (gloo; ``backend="nccl"``
gives each rank its own GPU, ``rank % device_count``), calls
``fn(rank, world_size, *args)`` and returns the list of per-rank return values (which must
be picklable). An exception on any rank is re-raised in the parent with its traceback.
``fn`` must be a module-level function (it is pickled by reference). Return plain Python
or numpy values, not torch tensors: torch's multiprocessing queue shares tensors through
handles that die with the child process (``to_plain`` converts nested results).

Ranks are forked from a forkserver that imported torch once (see ``_RANK_START``), not spawned: a
spawned rank re-imports torch (~3.5 s of CPU each on a 2-core CI machine, four per call), which was a
fifth of the whole suite's CPU time. Each rank still starts from a clean single-threaded process and
gets the caller's environment, working directory and ``sys.path``, as a spawned one does.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distenv import free_port


def to_plain(obj: Any) -> Any:
    """Convert torch tensors (also nested in lists/tuples/dicts) to numpy arrays for the result queue."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj


# Process boundary: the forkserver is one clean, single-threaded process per pytest process that
# imports these modules up front and forks every rank from there (fork after torch's import is
# safe: no intra-op thread pool exists until an op runs; the server never runs one). A forked rank
# inherits the *server's* environment, taken when it started, so the caller's os.environ is sent
# with each rank and put back first thing (_worker), as spawn would have passed it.
_RANK_START = "forkserver"
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "tests.dist_utils"]


def _worker(rank: int, world_size: int, local_size: int, port: int, fn: Callable[..., Any],
            args: Sequence[Any], queue: Any, backend: str = "gloo",
            environ: dict[str, str] | None = None) -> None:
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_size), "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    })
    import torch

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        queue.put((rank, True, to_plain(out)))
    except BaseException:  # report every failure to the parent, never hang it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int = 4, local_size: int = 2,
                    args: Sequence[Any] = (), timeout: float = 240.0, backend: str = "gloo") -> list[Any]:
    ctx = mp.get_context(_RANK_START)
    ctx.set_forkserver_preload(_PRELOAD)  # only the first call of a process starts the server
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, local_size, port, fn, tuple(args), queue, backend,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                # A child that died before reporting (import error, crash) would otherwise
                # make us wait for the whole timeout.
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    errors.append(f"rank(s) {dead} exited with codes {[procs[i].exitcode for i in dead]}"
                                  " before reporting a result")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:.0f} s waiting for ranks")
                continue
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env() -> dict[str, str]:
    """The environment for a trainer subprocess: this checkout first on PYTHONPATH, and none of the
    torchrun variables an earlier in-process distributed test may have left behind."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    for k in TORCHRUN_VARS:
        env.pop(k, None)
    return env


class RecordingBatchSampler:
    """A batch sampler that records every request the DataLoader takes from the trainer's sampler
    (``(epoch, step, indices)`` appended to ``seen``): what the tests count, never the sampler's own
    bookkeeping."""

    def __init__(self, sampler: Any, seen: list) -> None:
        self.sampler, self.seen = sampler, seen

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for req in self.sampler:
            self.seen.append((req.epoch, req.step, list(req.indices)))
            yield req
