"""The output directory of a run: one run at a time, and no silent mixing with an older run.

* :class:`RunLock`: rank 0 holds an exclusive ``fcntl.flock`` on ``<out>/.lock`` for the whole run.
  A second run into the same directory (another job, or an orphan of a killed launcher still
  writing) is refused with one line naming the holder's pid. The kernel drops the lock when the
  holder's process exits, however it exits (SIGKILL too): no stale lock files to clean up.
  HAZARD (fork): a flock belongs to the open file description, which a forked child inherits; the
  trainer's DataLoader workers are forked after the lock is taken, so the descriptor is opened
  with ``O_CLOEXEC`` and workers never release it (only ``close`` by its last holder or
  ``LOCK_UN`` does; the workers do neither).
* :func:`check_fresh_start`: a run that does not resume, into a directory that already holds
  checkpoints, is refused (``--resume auto`` continues it, ``--overwrite`` replaces it). With
  ``--overwrite`` the old checkpoints (``checkpoints/stepNNNNNNNN`` directories and ``latest``,
  which the trainer wrote) and ``metrics.jsonl`` are deleted; nothing else in the directory is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil

from datacache.config import ConfigError
from trainer.checkpoint import is_step_dir

LOCK_NAME = ".lock"


class RunLock:
    """An exclusive, non-blocking lock on ``<out>/.lock`` (see the module docstring)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.path = os.path.join(out, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        os.makedirs(self.out, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"pid {holder}" if holder else "another process"
                raise ConfigError(f"--out {self.out} is in use by another run ({who} holds {self.path}); "
                                  "wait for it to end or stop it, or pass another --out") from None
            raise ConfigError(f"--out {self.out}: cannot lock {self.path} ({e.strerror}); "
                              "use a local directory that supports flock, or another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def existing_checkpoints(out: str) -> list[str]:
    """The trainer's checkpoint entries under ``<out>/checkpoints`` (step directories, ``latest``)."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if is_step_dir(n) or n == "latest")


def check_fresh_start(out: str, resuming: bool, overwrite: bool) -> None:
    """Refuse a fresh run over another run's checkpoints; with ``overwrite`` delete them first.
    Call on rank 0 while holding the :class:`RunLock`."""
    if resuming:
        return
    found = existing_checkpoints(out)
    if not found:
        return
    root = os.path.join(out, "checkpoints")
    if not overwrite:
        raise ConfigError(f"--out {out} already holds checkpoints of another run ({root}: "
                          f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); pass --resume auto "
                          "to continue it, --overwrite to replace it, or another --out")
    for name in found:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
