"""Checkpoints: everything needed to continue a run mid-epoch exactly where it stopped.

Layout under ``<out>/checkpoints/``::

    step00000120/train.pt         rank 0: model, optimizer, GradScaler, position, schedules, config, RNG
    step00000120/comm_rank{r}.pt  every rank: the hooks' state (error-feedback residuals differ per rank)
    latest                        name of the newest complete checkpoint (written last)

Position = ``(epoch, step)``: the next step to run (``step`` within the epoch), with the global
step count. The sampler's order is a function of ``(seed, epoch)`` and the crops of ``(seed,
epoch, step, rank)``, so the position alone restores the remaining sample order and augmentation.
With ``--sampler local`` the order also depends on the epoch's owners snapshot (which node's master
held each sample at the epoch's start): ``train.pt`` carries it (``sampler``), so a resumed epoch
continues in the saved order even if the cluster resharded meanwhile.
The schedule values in force (LR, global batch, resolution, comm method) are saved too and
checked against the config on resume: a resumed run with other schedules is refused mid-epoch.

Writes are atomic (temporary file + ``os.replace``) and durable: each file is fsynced before its
rename and the directory after it, so after a power loss ``latest`` never names an empty file.
``latest`` moves only after every rank wrote its file (a barrier), so a run killed while saving
resumes from the previous checkpoint. Everything loads with ``torch.load(weights_only=True)``:
tensors, numbers and strings only. A file that cannot be read (truncated, overwritten, another
program's) is a :class:`~datacache.config.ConfigError` naming it and saying what to do.

Pruning (:class:`Pruner`) deletes only checkpoints this run wrote, oldest first, and never the
one ``latest`` names; the output directory itself is guarded by :mod:`trainer.rundir` (one run
at a time, no fresh run over old checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
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


def _fsync_dir(path: str) -> None:
    """Make a rename/creation in directory ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file, fsync it, rename it over ``path``, fsync the directory."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def read_latest(root: str) -> str | None:
    """The step directory name ``<root>/latest`` holds, or None when there is none."""
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def is_step_dir(name: str) -> bool:
    return name.startswith("step") and name[4:].isdigit() and len(name) == 12


class Pruner:
    """Keeps the newest ``keep`` checkpoints THIS run wrote (``keep`` 0: all). Checkpoints of other
    runs (or the one a resumed run started from) are never touched, nor the one ``latest`` names."""

    def __init__(self, root: str, keep: int) -> None:
        self.root = root
        self.keep = int(keep)
        self.written: list[str] = []  # step directory names, oldest first

    def add(self, name: str) -> None:
        if name in self.written:
            self.written.remove(name)
        self.written.append(name)

    def prune(self) -> list[str]:
        """Delete this run's checkpoints beyond the newest ``keep``; returns the names deleted."""
        if self.keep <= 0 or len(self.written) <= self.keep:
            return []
        latest = read_latest(self.root)
        gone = []
        for name in self.written[:-self.keep]:
            if name == latest:
                continue  # what `latest` names is never deleted
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            gone.append(name)
        self.written = [n for n in self.written if n not in gone]
        return gone


def checkpoint_dir(out: str, global_step: int) -> str:
    return os.path.join(out, "checkpoints", f"step{global_step:08d}")


def dataset_fingerprint(classes: Sequence[str], files: Iterable[tuple[str, int]],
                        count: int) -> dict[str, Any]:
    """What a checkpoint records of the training split: its size, a digest of the class names (the
    model's head) and a digest of ``files``, the training samples in order as (path relative to the
    dataset root, label) -- a dataset moved elsewhere keeps its fingerprint; other files, another order
    or another split do not."""
    classes_digest = hashlib.blake2b("\n".join(classes).encode(), digest_size=8).hexdigest()
    h = hashlib.blake2b(digest_size=8)
    for rel, target in files:
        h.update(f"{rel}\0{int(target)}\n".encode("utf-8", "surrogateescape"))
    return {"samples": int(count), "classes": classes_digest, "files": h.hexdigest()}


def save(out: str, *, rank: int, pos: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler | None, comm_state: dict[str, Any], schedules: dict[str, Any],
         config_json: str, world_size: int, pruner: Pruner | None = None,
         sampler: dict[str, Any] | None = None, dataset: dict[str, Any] | None = None) -> str:
    """Write this rank's part of the checkpoint at ``pos`` (COLLECTIVE: every rank calls it); with
    a ``pruner`` rank 0 then deletes this run's checkpoints beyond its ``keep``."""
    d = checkpoint_dir(out, pos.global_step)
    os.makedirs(d, exist_ok=True)
    _fsync_dir(os.path.dirname(d))
    _atomic_save(comm_state, os.path.join(d, f"comm_rank{rank}.pt"))
    if rank == 0:
        _atomic_save({
            "format": FORMAT, "position": [pos.epoch, pos.step, pos.global_step],
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "schedules": json.dumps(schedules), "config": config_json, "world_size": world_size,
            "rng": torch.get_rng_state(), **({"sampler": sampler} if sampler is not None else {}),
            **({"dataset": dataset} if dataset is not None else {}),
        }, os.path.join(d, "train.pt"))
    if dist.is_initialized():
        dist.barrier()  # every rank's file is complete before `latest` points at it
    if rank == 0:
        _atomic_write_text(os.path.basename(d) + "\n", os.path.join(out, "checkpoints", "latest"))
        if pruner is not None:
            pruner.add(os.path.basename(d))
            pruner.prune()
    return d


def resolve(resume: str, out: str) -> str | None:
    """The checkpoint directory ``--resume`` names: ``auto`` = the newest under ``out`` (None when
    there is none yet: a fresh start), else a directory or its ``train.pt``."""
    if not resume:
        return None
    if resume == "auto":
        root = os.path.join(out, "checkpoints")
        name = read_latest(root)
        if name is None:
            return None
        if not os.path.exists(os.path.join(root, name, "train.pt")):
            raise ConfigError(f"{root}/latest names {name}, which has no train.pt; resume from another "
                              f"checkpoint with --resume {root}/stepNNNNNNNN, or start over with --overwrite")
        return os.path.join(root, name)
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
    path: str = ""

    @property
    def saved_config(self) -> dict[str, Any]:
        try:
            cfg = json.loads(self.train.get("config", "{}"))
        except (TypeError, ValueError):
            return {}
        return cfg if isinstance(cfg, dict) else {}


WHAT_TO_DO = ("resume from an earlier checkpoint (--resume <out>/checkpoints/stepNNNNNNNN) or start over "
              "with --overwrite")


def _read(file: str, map_location: torch.device | str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of one checkpoint file; any failure -> one-line ConfigError
    naming the file (never the file's contents: torch's message may quote its bytes)."""
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{file}: missing; {WHAT_TO_DO}") from None
    except Exception as e:  # truncated zip, random bytes, a pickle with forbidden globals, ...
        raise ConfigError(f"{file}: not a readable checkpoint file ({type(e).__name__}; truncated or "
                          f"overwritten?); {WHAT_TO_DO}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{file}: holds a {type(obj).__name__}, not a checkpoint dict; {WHAT_TO_DO}")
    return obj


def _check_comm(comm: dict[str, Any], file: str) -> None:
    """Refuse a damaged per-rank comm state now (a throwaway HookState reads it), on the rank that
    has it, before any rank applies anything."""
    from trainer.comm.state import HookState

    try:
        HookState().load_state_dict(comm)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"{file}: not a comm state this trainer wrote ({type(e).__name__}: "
                          f"{str(e)[:200]}); {WHAT_TO_DO}") from None


def read_comm_states(path: str, saved_world: int) -> list[dict[str, Any]]:
    """Every saved rank's comm state (``comm_rank0.pt`` ... in rank order), each checked like
    :func:`load` checks its own: what a resume on another world size or layout re-splits the
    error-feedback residuals from (:mod:`trainer.comm.ef_reshard`)."""
    states = []
    for r in range(saved_world):
        file = os.path.join(path, f"comm_rank{r}.pt")
        comm = _read(file, "cpu")
        _check_comm(comm, file)
        states.append(comm)
    return states


def load(path: str, rank: int, world_size: int, map_location: torch.device | str = "cpu") -> Loaded:
    """Read a checkpoint directory (every rank reads ``train.pt`` and its own comm state). Reading
    changes nothing in the run: :func:`check_resumable` runs on the result before anything is applied."""
    file = os.path.join(path, "train.pt")
    train = _read(file, map_location)
    if train.get("format") != FORMAT:
        raise ConfigError(f"{file}: checkpoint format {train.get('format')!r}, expected {FORMAT}; "
                          f"{WHAT_TO_DO}")
    missing = [k for k in ("position", "model", "optimizer", "schedules", "config", "rng") if k not in train]
    if missing:
        raise ConfigError(f"{file}: lacks {missing}; {WHAT_TO_DO}")
    comm_file = os.path.join(path, f"comm_rank{rank}.pt")
    comm = _read(comm_file, "cpu") if os.path.exists(comm_file) else None
    if comm is not None:
        _check_comm(comm, comm_file)
    try:
        epoch, step, global_step = (int(v) for v in train["position"])
        schedules = json.loads(train["schedules"])
    except (TypeError, ValueError):
        raise ConfigError(f"{file}: damaged position or schedules; {WHAT_TO_DO}") from None
    return Loaded(Position(epoch, step, global_step), train, comm, schedules, path)


# What a checkpoint's tensors are shaped by: never changeable on resume (epoch end or not).
FIXED_FIELDS = ("model", "width", "optimizer")


def check_resumable(loaded: Loaded, schedules_now: dict[str, Any], path: str,
                    config_now: dict[str, Any] | None = None,
                    dataset_now: dict[str, Any] | None = None, *, replanned: bool = False) -> None:
    """Refuse a resume that cannot continue the saved run. Runs BEFORE anything is loaded.

    Always: the model, its width and the optimizer must be the checkpoint's (their tensors are
    shaped by them), and the class names (the model's head; :func:`dataset_fingerprint`).
    Mid-epoch (``step > 0``) also the training files in order, and every schedule value in
    ``schedules_now`` but the LR (the run's values at the resumed epoch; empty: not checked). The
    world size and rank layout may change mid-epoch: the rest of the epoch is then re-planned
    (:mod:`trainer.epoch_rest`, ``replanned``: its step count differs by design). At an epoch end
    anything else may change. A checkpoint without a dataset record (older) is not checked for it.
    """
    file = os.path.join(path, "train.pt")
    saved_data = loaded.train.get("dataset")
    if dataset_now is not None and isinstance(saved_data, dict):
        if saved_data.get("classes") != dataset_now["classes"]:
            raise ConfigError(f"{file}: the checkpoint was trained on other class folders (the model's head "
                              "differs); resume with the dataset it was made with, or start a new run in "
                              "another --out")
        if loaded.pos.step > 0 and (saved_data.get("samples"), saved_data.get("files")) != \
                (dataset_now["samples"], dataset_now["files"]):
            same_count = saved_data.get("samples") == dataset_now["samples"]
            other = " (other files or another order)" if same_count else ""
            raise ConfigError(f"{file}: saved mid-epoch on {saved_data.get('samples')} training files, now "
                              f"{dataset_now['samples']}{other}; "
                              "the remaining samples cannot be continued -- resume with the same --data "
                              "(and split) or from an epoch-end checkpoint")
    saved = loaded.saved_config
    if config_now is not None:
        diff = {k: (saved.get(k), config_now.get(k)) for k in FIXED_FIELDS
                if k in saved and saved.get(k) != config_now.get(k)}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            flags = " ".join(f"--{k} {a}" for k, (a, _) in diff.items())
            raise ConfigError(f"{file}: the checkpoint was made with another {'/'.join(diff)} ({what}); "
                              f"resume with {flags}, or start a new run in another --out")
    if loaded.pos.step == 0:
        return  # an epoch boundary: world size and schedules may change from here
    free = ("lr", "steps_in_epoch") if replanned else ("lr",)
    diff = {k: (loaded.schedules.get(k), v) for k, v in schedules_now.items()
            if k not in free and loaded.schedules.get(k) != v}
    if diff:
        raise ConfigError(f"{file}: the schedules differ from the checkpoint's mid-epoch ({diff}); "
                          "resume with the same config, or from an epoch-end checkpoint")
