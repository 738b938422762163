"""Per-node circuit breakers of the Redis stores: a node that timed out or refused a connection is not
asked again until a background probe finds it answering.

* ``closed`` (the normal state): calls go to the node. A timeout or a refused/reset connection opens it.
* ``open``: the node's keys are misses and its writes are skipped (counted by the store) without
  touching the network, for a back-off of 1 s that doubles while the node keeps failing, up to 30 s,
  with +-20 % jitter (so the DataLoader workers of many nodes do not probe in step).
* the probe: one daemon thread per open node and process (never two), which waits out the back-off,
  then PINGs with a short timeout (``probe_timeout``); a PONG closes the breaker, a failure doubles the
  back-off and waits again.

Per process (fork boundary): a :class:`Breakers` belongs to the process that created it; the stores
create theirs in ``_reset_process_state`` (which runs again in a forked DataLoader worker, whose
probe threads the fork did not copy). Thread hazard: the read path, the write-back thread and the
probe threads share the state, guarded by one lock.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
JITTER = 0.2


class BreakerOpen(ConnectionError):
    """The node's breaker is open: the call was not sent (counted as unavailable, like a refusal)."""


def trips_breaker(exc: BaseException) -> bool:
    """A timeout or a refused/reset connection (not an error reply: MOVED, OOM, LOADING ... do not)."""
    import redis.exceptions as rex

    if isinstance(exc, BreakerOpen):
        return False
    return isinstance(exc, (rex.ConnectionError, rex.TimeoutError, ConnectionError, TimeoutError, OSError))


@dataclass
class _Node:
    failures: int = 0  # consecutive failures (0 = closed)
    retry_at: float = 0.0  # monotonic time of the next probe while open
    probing: bool = False
    opened: int = 0  # times this node's breaker opened (in this process)


class Breakers:
    """The breakers of one store in one process, keyed by node address (``host:port``)."""

    def __init__(self, ping: Callable[[str], Any], *, start_s: float = BACKOFF_START_S,
                 max_s: float = BACKOFF_MAX_S) -> None:
        self._ping = ping  # PINGs one node with a short timeout; raises on failure
        self._start, self._max = start_s, max_s
        self._nodes: dict[str, _Node] = {}
        self._lock = threading.Lock()

    def _backoff(self, failures: int) -> float:
        base = min(self._max, self._start * 2 ** max(0, failures - 1))
        return base * random.uniform(1 - JITTER, 1 + JITTER)

    def allow(self, addr: str) -> bool:
        """Whether a call may go to ``addr`` now (False while its breaker is open)."""
        with self._lock:
            node = self._nodes.get(addr)
            return node is None or node.failures == 0

    def failure(self, addr: str, exc: BaseException) -> None:
        """Record a failed call to ``addr``; a timeout or a refused connection opens its breaker."""
        if not trips_breaker(exc):
            return
        with self._lock:
            node = self._nodes.setdefault(addr, _Node())
            if node.failures == 0:
                node.opened += 1
            node.failures += 1
            node.retry_at = time.monotonic() + self._backoff(node.failures)
            if node.probing:
                return
            node.probing = True
        threading.Thread(target=self._probe, args=(addr,), name=f"datacache-probe-{addr}",
                         daemon=True).start()

    def _probe(self, addr: str) -> None:
        """Probe thread of one node: wait out the back-off, PING, close on success, else back off more."""
        while True:
            with self._lock:
                node = self._nodes[addr]
                wait = node.retry_at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
                continue
            try:
                self._ping(addr)
            except Exception:
                with self._lock:
                    node.failures += 1
                    node.retry_at = time.monotonic() + self._backoff(node.failures)
                continue
            with self._lock:
                node.failures = 0
                node.probing = False
            return

    def state(self) -> dict[str, dict[str, Any]]:
        """Per node that ever failed: ``state`` (open/closed), consecutive ``failures``, times ``opened``
        and ``retry_in_s`` (seconds to the next probe while open)."""
        now = time.monotonic()
        with self._lock:
            return {a: {"state": "open" if n.failures else "closed", "failures": n.failures,
                        "opened": n.opened,
                        "retry_in_s": round(max(0.0, n.retry_at - now), 2) if n.failures else None}
                    for a, n in self._nodes.items()}

    def open_nodes(self) -> list[str]:
        with self._lock:
            return [a for a, n in self._nodes.items() if n.failures]
