"""The daemon's watchdog: a pass that outlives its deadline turns ``/livez`` (and ``/health``) into a 503.

It is the liveness half of the daemon's checks: it reads only this process's clock and state, never a
server, so a Redis node that is down (readiness, ``/readyz``) never makes it fire; a decode worker or a
store call that hangs past the pass's deadline does.

The pass thread reports to a :class:`Watchdog` (:meth:`~Watchdog.begin` a pass of a dataset,
:meth:`~Watchdog.work` once it knows how many samples it owns, :meth:`~Watchdog.end`); the HTTP
thread asks :meth:`~Watchdog.stuck` and :meth:`~Watchdog.as_json`. Threads: every method takes the
lock, none blocks.

Deadline of a pass: ``pass_timeout`` seconds when configured (> 0); otherwise derived from the work --
:data:`LISTING_S` for listing the source, and once the pass knows how many samples it owns,
``LISTING_S + owned * SECONDS_PER_SAMPLE / workers`` (a generous bound: decoding a JPEG takes
milliseconds per core; a full dataset's pass only checks that its keys exist).
"""

from __future__ import annotations

import threading
import time
from typing import Any

LISTING_S = 600.0
SECONDS_PER_SAMPLE = 1.0


class Watchdog:
    """Deadline and liveness of the daemon's passes (see the module docstring)."""

    def __init__(self, pass_timeout: float, workers: int) -> None:
        self.pass_timeout = float(pass_timeout)
        self.workers = max(1, int(workers))
        self._lock = threading.Lock()
        self._dataset = ""
        self._started = 0.0  # monotonic start of the pass in progress; 0 = none
        self._started_wall = 0.0
        self._deadline = 0.0
        self.passes = 0  # completed passes, over every dataset
        self.rounds = 0  # completed rounds (one pass of each dataset, then the poll wait)
        self.last_pass_end = 0.0  # wall clock (time.time()) of the last completed pass; 0 = none yet

    def begin(self, dataset: str) -> None:
        with self._lock:
            self._dataset = dataset
            self._started, self._started_wall = time.monotonic(), time.time()
            self._deadline = self._started + (self.pass_timeout or LISTING_S)

    def work(self, owned: int) -> None:
        """The pass owns ``owned`` samples: the derived deadline grows with them (no-op with pass_timeout)."""
        with self._lock:
            if not self.pass_timeout and self._started:
                self._deadline = self._started + LISTING_S + owned * SECONDS_PER_SAMPLE / self.workers

    def end(self) -> None:
        with self._lock:
            self._started = 0.0
            self._dataset = ""
            self.passes += 1
            self.last_pass_end = time.time()

    def end_round(self) -> None:
        with self._lock:
            self.rounds += 1

    def stuck(self) -> str | None:
        """Why the loop is not live (a pass past its deadline), or None."""
        with self._lock:
            if not self._started or time.monotonic() <= self._deadline:
                return None
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._started_wall))
            return (f"the fill pass of {self._dataset} has run {time.monotonic() - self._started:.0f} s "
                    f"(since {since}), past its deadline of {self._deadline - self._started:.0f} s: a decode "
                    "worker or the store is stuck; the daemon keeps waiting (SIGTERM stops it within "
                    "drain_timeout)")

    def as_json(self) -> dict[str, Any]:
        reason = self.stuck()
        with self._lock:
            now = time.monotonic()
            return {"passes": self.passes, "rounds": self.rounds,
                    "last_pass_end": self.last_pass_end or None,
                    "seconds_since_last_pass": round(time.time() - self.last_pass_end, 3)
                    if self.last_pass_end else None,
                    "current": {"dataset": self._dataset, "seconds": round(now - self._started, 3),
                                "deadline_s": round(self._deadline - self._started, 1)}
                    if self._started else None,
                    "stuck": reason}
