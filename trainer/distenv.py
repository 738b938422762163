"""Process group and device from torchrun's environment (or a one-process group without it).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``; the comm hooks' topology (intra-/inter-node groups) is built from the same
variables. Run without torchrun, the trainer makes a one-rank gloo group on a free loopback
port, so the same DDP + hooks code path runs. Backend: ``cpu:gloo,cuda:nccl`` on GPUs (the hooks
dispatch by the tensor's device), plain gloo on CPUs.

Ranks die with their launcher: torchrun starts every worker in its own process group, so a
``kill -9`` of torchrun (or of its process group) would leave the ranks running -- orphans that
go on training and writing checkpoints into the directory a restarted run uses. Under a launcher
each rank therefore asks the Linux kernel for ``SIGKILL`` when its parent dies
(:func:`die_with_parent`, ``prctl(PR_SET_PDEATHSIG)``). Checkpoints are written atomically, so a
rank killed mid-save leaves the previous checkpoint intact. Other systems: no-op (logged).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from datacache.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a single-process run's rendezvous, the benchmarks' torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; see the module
    docstring). Returns whether it is armed. HAZARD: the death signal fires when the parent
    THREAD that forked us exits, and is cleared in a forked child (DataLoader workers are not
    covered; they exit when their pipe to this process closes). If the parent died while the
    call was being made (we were re-parented meanwhile), this process gets ``sig`` at once."""
    if not sys.platform.startswith("linux"):
        log.info("die_with_parent: not on Linux; ranks will not follow a killed launcher")
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): ranks will not follow a killed launcher",
                    ctypes.get_errno())
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)  # the launcher died between getppid() and prctl(): we are an orphan
    return True


def pick_device(pref: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; ``cuda`` without a GPU is a clear error.

    The GPU is ``LOCAL_RANK % device_count()``: with every GPU visible that is the rank's own;
    when the scheduler gives each process one visible GPU (``CUDA_VISIBLE_DEVICES`` per rank) it
    is ``cuda:0``, the only one there is."""
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use --device cpu or auto")
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))
    return torch.device("cpu")


def cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device index of local rank ``local_rank`` when ``visible`` devices are visible."""
    if visible < 1:
        raise ConfigError("no visible CUDA device (CUDA_VISIBLE_DEVICES empty?); use --device cpu")
    return local_rank % visible


ALLOC_CONF = "expandable_segments:True"


def cuda_allocator_defaults(environ: dict[str, str] | None = None) -> str:
    """``PYTORCH_CUDA_ALLOC_CONF`` for training, unless the user set one (theirs is kept); returns the
    value in force. Every batch's packed crop windows and padded batch have another size (window
    sizes vary), and the side stream allocates them: with fixed-size segments the caching allocator
    splits and strands blocks of many sizes (fragmentation: reserved memory grows over an epoch).
    Expandable segments grow one mapping instead, so freed memory of any size is reused. Read by the
    allocator at its first CUDA allocation: call before any (init_distributed does)."""
    env = os.environ if environ is None else environ
    return env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)


def init_distributed(device_pref: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Initialise (or reuse) the default process group; returns the rank layout and device.
    ``timeout_s``: how long a collective waits for its peers before it fails (torch's default,
    30 min, when None). A node lost without closing its connections (power, a cut link) is only
    noticed this way: the surviving ranks fail after ``timeout_s`` and an elastic launcher
    (``torchrun --nnodes MIN:MAX --max-restarts K``) restarts them on the nodes left."""
    if "RANK" not in os.environ:  # not under torchrun: a one-process group
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    elif "TORCHELASTIC_RUN_ID" in os.environ or "GROUP_RANK" in os.environ:
        die_with_parent()  # a torchrun worker: never outlive the launcher (module docstring)
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    cuda_allocator_defaults()  # before the first CUDA allocation (the allocator reads it once)
    device = pick_device(device_pref)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL touches the GPU
    if not dist.is_initialized():
        kw = {"timeout": datetime.timedelta(seconds=float(timeout_s))} if timeout_s else {}
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", **kw)
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ["LOCAL_RANK"]),
                    local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), device=device)
    if info.world_size % info.local_world_size:
        raise ConfigError(f"WORLD_SIZE={info.world_size} is not a multiple of LOCAL_WORLD_SIZE="
                          f"{info.local_world_size}: launch the same --nproc-per-node on every node")
    return info
