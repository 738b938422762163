"""Checkpoints: everything needed to continue a run mid-epoch exactly where it stopped.

Layout under ``<out>/checkpoints/``::

    step00000120/train.pt         rank 0: model, optimizer, GradScaler, position, schedules, config, RNG
    step00000120/comm_rank{r}.pt  every rank: the hooks' state (error-feedback residuals differ per rank)
    latest                        name of the newest complete checkpoint (written last)

Position = ``(epoch, step)``: the next step to run (``step`` within the epoch), with the global
step count. The sampler's order is a function of ``(seed, epoch)`` and the crops of ``(seed,
epoch, step, rank)``, so the position alone restores the remaining sample order and augmentation.
The schedule values in force (LR, global batch, resolution, comm method) are saved too and
checked against the config on resume: a resumed run with other schedules is refused mid-epoch.

Writes are atomic (temporary file + ``os.replace``) and ``latest`` moves only after every rank
wrote its file (a barrier), so a run killed while saving resumes from the previous checkpoint.
Everything loads with ``torch.load(weights_only=True)``: tensors, numbers and strings only.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from datacache.config import ConfigError

FORMAT = 1


@dataclass
class Position:
    epoch: int
    step: int          # next step within the epoch
    global_step: int


def _atomic_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def checkpoint_dir(out: str, global_step: int) -> str:
    return os.path.join(out, "checkpoints", f"step{global_step:08d}")


def save(out: str, *, rank: int, pos: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler | None, comm_state: dict[str, Any], schedules: dict[str, Any],
         config_json: str, world_size: int, keep: int = 0) -> str:
    """Write this rank's part of the checkpoint at ``pos`` (COLLECTIVE: every rank calls it); with
    ``keep`` > 0 rank 0 then deletes all but the newest ``keep`` complete checkpoints."""
    d = checkpoint_dir(out, pos.global_step)
    os.makedirs(d, exist_ok=True)
    _atomic_save(comm_state, os.path.join(d, f"comm_rank{rank}.pt"))
    if rank == 0:
        _atomic_save({
            "format": FORMAT, "position": [pos.epoch, pos.step, pos.global_step],
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "schedules": json.dumps(schedules), "config": config_json, "world_size": world_size,
            "rng": torch.get_rng_state(),
        }, os.path.join(d, "train.pt"))
    if dist.is_initialized():
        dist.barrier()  # every rank's file is complete before `latest` points at it
    if rank == 0:
        tmp = os.path.join(out, "checkpoints", f"latest.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(os.path.basename(d) + "\n")
        os.replace(tmp, os.path.join(out, "checkpoints", "latest"))
        if keep > 0:
            _prune(os.path.join(out, "checkpoints"), keep)
    return d


def _prune(root: str, keep: int) -> None:
    """Delete the oldest ``stepNNNNNNNN`` directories beyond the newest ``keep`` (after ``latest`` moved)."""
    steps = sorted(d for d in os.listdir(root) if d.startswith("step") and d[4:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def resolve(resume: str, out: str) -> str | None:
    """The checkpoint directory ``--resume`` names: ``auto`` = the newest under ``out`` (None when
    there is none yet: a fresh start), else a directory or its ``train.pt``."""
    if not resume:
        return None
    if resume == "auto":
        latest = os.path.join(out, "checkpoints", "latest")
        if not os.path.exists(latest):
            return None
        with open(latest) as f:
            return os.path.join(out, "checkpoints", f.read().strip())
    path = resume[: -len("/train.pt")] if resume.endswith("/train.pt") else resume
    if not os.path.exists(os.path.join(path, "train.pt")):
        raise ConfigError(f"--resume {resume}: no checkpoint there (expected {path}/train.pt); "
                          "pass a step directory under <out>/checkpoints or 'auto'")
    return path


@dataclass
class Loaded:
    pos: Position
    train: dict[str, Any]
    comm: dict[str, Any] | None
    schedules: dict[str, Any]


def load(path: str, rank: int, world_size: int, map_location: torch.device | str = "cpu") -> Loaded:
    """Read a checkpoint directory (every rank reads ``train.pt`` and its own comm state)."""
    train = torch.load(os.path.join(path, "train.pt"), map_location=map_location, weights_only=True)
    if train.get("format") != FORMAT:
        raise ConfigError(f"{path}/train.pt: checkpoint format {train.get('format')!r}, expected {FORMAT}")
    comm_file = os.path.join(path, f"comm_rank{rank}.pt")
    comm = torch.load(comm_file, map_location="cpu", weights_only=True) if os.path.exists(comm_file) else None
    epoch, step, global_step = (int(v) for v in train["position"])
    return Loaded(Position(epoch, step, global_step), train, comm, json.loads(train["schedules"]))


def check_resumable(loaded: Loaded, schedules_now: dict[str, Any], world_size: int, path: str) -> None:
    """Refuse a mid-epoch resume whose sample order or schedules would differ from the saved run."""
    if loaded.pos.step == 0:
        return  # an epoch boundary: any world size and schedule can continue from here
    saved_world = int(loaded.train.get("world_size", world_size))
    if saved_world != world_size:
        raise ConfigError(f"{path}: saved mid-epoch with {saved_world} ranks, now {world_size}; the "
                          "remaining sample order cannot be continued -- resume from an epoch-end "
                          "checkpoint or with the same world size")
    diff = {k: (loaded.schedules.get(k), v) for k, v in schedules_now.items()
            if k != "lr" and loaded.schedules.get(k) != v}
    if diff:
        raise ConfigError(f"{path}: the schedules differ from the checkpoint's mid-epoch ({diff}); "
                          "resume with the same config, or from an epoch-end checkpoint")
