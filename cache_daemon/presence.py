"""Can this pass skip asking for every key? -- the idle pass's shortcut ("nothing was removed since").

A daemon's pass over a full dataset used to ask the store for every owned key (``EXISTS``), ~427k
per daemon at ImageNet scale on 3 nodes: seconds of CPU per pass, every ``poll_interval``, for nothing.
Keys of a full dataset only go away when something **removes** them, and Redis counts removals. A
:class:`Stamp` of the servers that hold this daemon's keys records, per server:

* ``run_id`` -- a restarted server (empty, or reloaded from an older dump) has a new one;
* ``removals`` -- ``evicted_keys + expired_keys`` plus the calls of every command that removes a key
  (:data:`REMOVING_COMMANDS`, from ``INFO commandstats``; commands run by scripts and ``MULTI`` are
  counted there too). ``CONFIG RESETSTAT`` zeroes these counters: any difference, down included,
  counts as a change, and so does ``total_commands_processed`` going down (the reset's other trace);
* the number of keys in each slot this daemon owns (``CLUSTER COUNTKEYSINSLOT``, one pipeline:
  bench/results/NOTES.md#idle-pass), or the server's ``DBSIZE`` for a store that is not a cluster -- a second,
  independent guard: a removal path missing from the list above still lowers a count.

A pass that verified "every owned key is present" keeps the stamp it took **before** verifying (a
removal during the verification then shows as a change). The next pass takes a new stamp and skips
the per-key check when: same dataset (fingerprint, variant) and ownership, the last verification
found nothing missing and is younger than ``verify_interval`` seconds, and :meth:`Stamp.covers`
(same servers and run ids, the same removal counters, no slot with fewer keys). Anything else --
a restart, an eviction, a ``DEL``/``FLUSHALL``, a resharding, a failover (another master), a count
that went down -- falls back to the full per-key check. Adding keys (other datasets filling) never
invalidates the stamp.

What it cannot see: a key removed, then ``CONFIG RESETSTAT`` run, then as many commands as the server had
processed before and a new key in the same slot, all between two passes. The cost of such a miss is
small and bounded: ``verify_interval`` (10 minutes by default) later every key is checked again, and a
reader that misses the sample meanwhile decodes it from the source and writes it back.

Stores without such counters (``lmdb://``, ``memory://``) have no stamp: every pass checks every key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache_daemon.daemon_config import DaemonConfig

# Commands that can remove a string key (or every key). cmdstat names are lower case; subcommands are
# "container|sub". Commands not in this list that remove keys (an emptied list or hash, say) are caught
# by the per-slot counts instead.
REMOVING_COMMANDS = ("del", "unlink", "getdel", "rename", "renamenx", "move", "migrate", "flushdb",
                     "flushall", "swapdb", "restore", "cluster|reset", "cluster|flushslots",
                     "cluster|delkeysinslot", "debug")


@dataclass(frozen=True)
class ServerStamp:
    addr: str
    run_id: str
    removals: int
    commands: int  # total_commands_processed: only grows, except through CONFIG RESETSTAT
    slots: np.ndarray  # the slots counted (int32); empty = the whole server (DBSIZE)
    counts: np.ndarray  # keys per slot in ``slots``, or [DBSIZE]


@dataclass(frozen=True)
class Stamp:
    """What the servers holding this daemon's keys looked like (see the module docstring)."""

    servers: tuple[ServerStamp, ...]

    def covers(self, later: Stamp) -> bool:
        """True when nothing that was in the servers at ``self`` can have been removed by ``later``."""
        if len(self.servers) != len(later.servers):
            return False
        for a, b in zip(self.servers, later.servers):
            if (a.addr, a.run_id, a.removals) != (b.addr, b.run_id, b.removals):
                return False
            if b.commands < a.commands or not np.array_equal(a.slots, b.slots) or (b.counts < a.counts).any():
                return False
        return True


def removals_of(info: dict[str, Any]) -> int:
    """The removal counter of one server from its ``INFO stats`` + ``INFO commandstats`` dict."""
    total = int(info.get("evicted_keys", 0)) + int(info.get("expired_keys", 0))
    for cmd in REMOVING_COMMANDS:
        stat = info.get(f"cmdstat_{cmd}")
        if isinstance(stat, dict):
            total += int(stat.get("calls", 0))
    return total


def server_stamp(client: Any, addr: str, slots: Sequence[int] | None) -> ServerStamp:
    """The stamp of one server; ``slots``: the cluster slots to count (None = ``DBSIZE``). Raises on a
    connection error (the caller then does the full check)."""
    info = client.execute_command("INFO", "server", "stats", "commandstats")
    if not isinstance(info, dict):  # redis-py parses INFO into a dict; anything else is not a stamp
        raise TypeError(f"{addr}: unexpected INFO reply ({type(info).__name__})")
    slot_arr = np.asarray(list(slots) if slots is not None else [], dtype=np.int32)
    if slots is None:
        counts = np.asarray([int(client.dbsize())], dtype=np.int64)
    else:
        pipe = client.pipeline(transaction=False)
        for s in slot_arr.tolist():
            pipe.execute_command("CLUSTER COUNTKEYSINSLOT", s)
        counts = np.asarray([int(c) for c in pipe.execute()], dtype=np.int64)
    return ServerStamp(addr, str(info.get("run_id", "")), removals_of(info),
                       int(info.get("total_commands_processed", 0)), slot_arr, counts)


def take_stamp(cfg: DaemonConfig, store: Any, owned_slots: np.ndarray | None) -> Stamp | None:
    """The stamp of the servers holding this daemon's keys now, or None when the store has none
    (LMDB, memory) -- then every pass checks every key."""
    masters = store.masters()
    if not masters:
        return None
    if store.sharded and cfg.ownership == "cluster" and owned_slots is not None:
        return Stamp((server_stamp(store.node_client(cfg.redis_node), cfg.redis_node, owned_slots),))
    # one server, or hash / all ownership over a cluster (this daemon's keys are on every master)
    return Stamp(tuple(server_stamp(store.node_client(a), a, None) for a in sorted(masters)))
