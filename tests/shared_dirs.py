"""Directories built once per test run and shared by every pytest-xdist worker of that run.

``built_once(tmp_path_factory, "digits", {"short_side": 32}, build)`` returns the path of a directory
that ``build(path)`` filled, the first caller of the run building it and every later caller (another
test, another worker) reusing it. The directory lives in the run's own temporary root (pytest's
``pytest-N`` directory, the parent of each worker's ``popen-gwK``), named by the name and a digest of the
parameters, so two parameter sets never share one and nothing outlives the run's own temporary tree.

Hazards handled here:

* **two workers at once** -- the build runs under an exclusive ``flock`` on ``<dir>.lock``; the loser
  of the race waits for the winner and then reuses its directory;
* **a build that failed or was killed half-way** -- ``<dir>.done`` is written only after ``build``
  returned; a directory without it is removed and built again (builders may record absolute paths, so
  the build happens in place rather than in a directory renamed afterwards);
* **a test that writes into it** -- shared directories are read-only by contract (fixtures say so);
  nothing here can stop a test writing, so the fixtures that hand them out document it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary root of this test run, the same for every xdist worker of it."""
    base = tmp_path_factory.getbasetemp()
    # xdist: each worker's basetemp is <run root>/popen-gwK; without xdist the basetemp is the root
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, params: dict[str, Any],
               build: Callable[[Path], None]) -> Path:
    """``build(path)`` run once per test run for (``name``, ``params``); the finished directory's path."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:12]
    shared = run_root(tmp_path_factory) / "shared"
    shared.mkdir(exist_ok=True)
    final = shared / f"{name}-{digest}"
    done = shared / f"{name}-{digest}.done"
    with open(shared / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if done.exists():
            return final
        shutil.rmtree(final, ignore_errors=True)  # what a failed or killed build left
        final.mkdir()
        try:
            build(final)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        done.touch()
    return final
