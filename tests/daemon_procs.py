"""Real cache daemons as subprocesses for tests: started in their own process group, reaped after the test.

``daemon_procs`` (an autouse fixture where a test module imports it) SIGKILLs the process group of every
daemon a test started and left running -- a failed assertion, a timeout -- decode pool included, and
SIGCONTs it first so a stopped (SIGSTOPped) worker dies too. :func:`spawn_daemon` starts one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STARTED: list[subprocess.Popen] = []


def spawn_daemon(args: Sequence[str], log: str, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m cache_daemon --no-progress --workers 1 ARGS`` (stdout and stderr appended to ``log``) in
    its own process group (SIGKILL of the group = what systemd does to the unit), this repository on its
    ``PYTHONPATH``, ``env`` added to the environment."""
    with open(log, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--no-progress", "--workers", "1", *args],
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": REPO, **(env or {})})
    _STARTED.append(p)
    return p


@pytest.fixture(autouse=True)
def daemon_procs() -> Iterator[None]:
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped decode worker must die too
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
            p.wait(30)
