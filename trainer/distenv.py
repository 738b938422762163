"""Process group and device from torchrun's environment (or a one-process group without it).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``; the comm hooks' topology (intra-/inter-node groups) is built from the same
variables. Run without torchrun, the trainer makes a one-rank gloo group on a free loopback
port, so the same DDP + hooks code path runs. Backend: ``cpu:gloo,cuda:nccl`` on GPUs (the hooks
dispatch by the tensor's device), plain gloo on CPUs.
"""

from __future__ import annotations

import logging
import os
import socket
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


def pick_device(pref: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; ``cuda`` without a GPU is a clear error."""
    if pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use --device cpu or auto")
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device_pref: str = "auto") -> DistInfo:
    """Initialise (or reuse) the default process group; returns the rank layout and device."""
    if "RANK" not in os.environ:  # not under torchrun: a one-process group
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    device = pick_device(device_pref)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL touches the GPU
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ["LOCAL_RANK"]),
                    local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), device=device)
    if info.world_size % info.local_world_size:
        raise ConfigError(f"WORLD_SIZE={info.world_size} is not a multiple of LOCAL_WORLD_SIZE="
                          f"{info.local_world_size}: launch the same --nproc-per-node on every node")
    return info
