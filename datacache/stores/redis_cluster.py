"""``redis+cluster://h1:p1[,h2:p2...]``: a Redis Cluster as the cluster-memory tier (T3).

Routing is done here, not by redis-py's cluster client, so a batch never waits on redirections:

* the slot map comes from ``CLUSTER SLOTS`` (asked of the first seed or known master that
  answers) as one numpy array slot -> master; a key's slot is redis-py's CRC16
  (``redis.crc.key_slot``). Keys never contain ``{}`` (no hash tags), so samples spread over
  all slots;
* ``get_many`` groups the keys by master and sends one non-transactional pipeline of ``GET``s per
  master, the pipelines in parallel (one thread per master; never a cross-slot ``MGET``); the
  chunk of keys per call is capped at ``fetch_bytes`` per master (:meth:`BaseStore._lanes`);
* ``put_many`` sends ``SET key value NX`` per key in one pipeline per master, in parallel;
  ``contains`` sends ``EXISTS`` per key, grouped the same way;
* a master that refuses the connection, times out, answers ``MOVED``/``ASK``/``CLUSTERDOWN``, or a
  slot no master serves: **those keys** are misses (counted in ``read_errors`` and
  ``unavailable``), the other masters' answers are used, and the slot map is refreshed in the
  background (at most every 0.5 s) -- the training loop never blocks on a dead node.

:meth:`RedisClusterStore.masters` and :meth:`RedisClusterStore.master_of` expose the map for the
daemon's ownership (:mod:`cache_daemon.ownership`).

Where each byte went: with ``?local=host:port`` (the master on this node) every ``get_many`` counts
the hits and value bytes each master served as ``local_hits``/``local_bytes`` (that master) or
``remote_hits``/``remote_bytes`` (any other) in :meth:`counters`; without it everything is remote.

Per-process state (fork/spawn boundary): clients, the slot map, the refresh thread and the
thread pool belong to the process that created them (pid-checked); a forked DataLoader worker
builds its own on first use.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from datacache.cacheurl import StoreSpec
from datacache.stores.base import Value
from datacache.stores.redis_common import (
    DEFAULT_FETCH_BYTES,
    RedisStoreBase,
    connection_kwargs,
    is_unavailable,
    parse_hostport,
    pipe_exists,
    pipe_set,
    server_info,
    split_userinfo,
)
from datacache.stores.resp import pipelined_get

NSLOTS = 16384
_UNWRITTEN = object()  # the reply stand-in of a write whose master failed (an error, counted as one)
_REFRESH_EVERY_S = 0.5


def key_slots(keys: Sequence[bytes]) -> np.ndarray:
    """Redis Cluster hash slot of every key (CRC16 mod 16384; keys have no ``{}`` hash tags)."""
    from redis.crc import key_slot

    return np.fromiter((key_slot(bytes(k)) for k in keys), dtype=np.int32, count=len(keys))


def _crc16_table() -> np.ndarray:
    """CRC16-XMODEM (polynomial 0x1021, initial 0: Redis Cluster's key hash) table, one entry per byte."""
    table = np.zeros(256, dtype=np.uint32)
    for b in range(256):
        crc = b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table[b] = crc & 0xFFFF
    return table


_CRC16 = _crc16_table()


def index_key_slots(prefix: bytes, indices: np.ndarray) -> np.ndarray:
    """Hash slot of every key ``prefix + b"%d" % i`` for ``i`` in ``indices`` (non-negative ints), without
    building one key: the CRC of ``prefix`` once, then the decimal digits of every index at once (the CRC
    is a byte-at-a-time recurrence, vectorised over the keys, grouped by digit count). Equal to
    :func:`key_slots` of the built keys (tested against redis-py's ``key_slot`` and ``CLUSTER KEYSLOT``);
    a daemon's ownership needs neither a key per sample nor a hash call per key
    (bench/results/NOTES.md#idle-pass)."""
    idx = np.asarray(indices, dtype=np.int64)
    if b"{" in prefix:  # a hash tag could make only part of the key count: the general path
        return key_slots([prefix + b"%d" % i for i in idx.tolist()])
    if idx.size and int(idx.min()) < 0:
        raise ValueError("index_key_slots: indices must be >= 0")
    crc0 = 0
    for byte in prefix:
        crc0 = ((crc0 << 8) & 0xFFFF) ^ int(_CRC16[((crc0 >> 8) ^ byte) & 0xFF])
    out = np.empty(idx.shape, dtype=np.int32)
    digits = np.ones(idx.shape, dtype=np.int64)
    for d in range(1, 19):
        digits[idx >= 10 ** d] = d + 1
    for nd in np.unique(digits).tolist():
        sel = np.flatnonzero(digits == nd)
        vals = idx[sel]
        crc = np.full(sel.shape, crc0, dtype=np.uint32)
        for k in range(nd - 1, -1, -1):  # most significant digit first, as the key's bytes are
            byte = (vals // 10 ** k) % 10 + 48
            crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte.astype(np.uint32)) & 0xFF]
        out[sel] = (crc & 0x3FFF).astype(np.int32)
    return out


class RedisClusterStore(RedisStoreBase):
    """A Redis Cluster (see the module docstring)."""

    backend = "redis-cluster"

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        _, _, rest = split_userinfo(spec.location, spec.url)
        self.seeds = [parse_hostport(p, spec.url) for p in rest.split(",")]
        self.tls = bool(spec.option("tls", False))
        local = spec.option("local")  # the master on this node: its reads are counted as local
        self.local = None if local is None else "{}:{}".format(*parse_hostport(local, spec.url))
        super().__init__(spec.url, fetch_bytes=spec.option("fetch_bytes", DEFAULT_FETCH_BYTES))

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._pid = os.getpid()
        self._clients: dict[str, Any] = {}
        # The slot map: masters "host:port" and slot -> index into them (-1 = not served). Thread
        # hazard: the background refresh replaces both (under _lock, never mutated in place) while
        # reads run. A read takes one snapshot (_map), and a known master keeps its index across
        # refreshes (CLUSTER SLOTS re-orders its masters after a resharding), so even a table of one
        # refresh read with the list of a later one routes every key to the master it names.
        self._nodes: list[str] = []
        self._slots: np.ndarray | None = None
        self._lock = threading.Lock()
        self._refreshing = False
        self._last_refresh = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._counters.update(slot_refreshes=0, local_hits=0, local_bytes=0, remote_hits=0, remote_bytes=0)

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_pid", "_clients", "_nodes", "_slots", "_lock", "_refreshing",
                "_last_refresh", "_pool")

    def _ensure(self) -> None:
        if self._pid != os.getpid():  # forked: nothing of the parent's connections or threads is usable
            self._reset_process_state()
        if self._slots is None:
            self.refresh_slots()

    # ------------------------------------------------------------ topology
    def client(self, addr: str) -> Any:
        """Client of one node (created on first use in this process)."""
        c = self._clients.get(addr)
        if c is None:
            import redis

            host, port = parse_hostport(addr, self.url)
            c = self._clients[addr] = redis.Redis(host=host, port=port,
                                                  **connection_kwargs(self.spec, tls=self.tls))
        return c

    sharded = True

    def node_client(self, addr: str) -> Any:
        """Client of the node ``addr`` (a master of :meth:`masters`, or ``redis_node``)."""
        return self.client(addr)

    def ping_client(self) -> Any:
        """What the URL check PINGs (and closes): the first seed's client."""
        host, port = self.seeds[0]
        return self.client(f"{host}:{port}")

    def refresh_slots(self) -> None:
        """Rebuild the slot map from ``CLUSTER SLOTS`` of the first node that answers; raises the last
        error when none does."""
        candidates = list(dict.fromkeys([*self._nodes, *(f"{h}:{p}" for h, p in self.seeds)]))
        # nodes whose breaker is open (frozen or down) are asked last: a frozen one costs a timeout
        br = self.breakers()
        candidates.sort(key=lambda a: not br.allow(a))
        last: BaseException | None = None
        for addr in candidates:
            try:
                reply = self.client(addr).execute_command("CLUSTER SLOTS")
            except Exception as e:
                last = e
                continue
            host_default = addr.rpartition(":")[0]
            nodes = list(self._nodes)  # known masters keep their index; new ones are appended
            table = np.full(NSLOTS, -1, dtype=np.int16)
            for entry in reply:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                ip = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                node = f"{ip or host_default}:{int(master[1])}"
                if node not in nodes:
                    nodes.append(node)
                table[start:end + 1] = nodes.index(node)
            with self._lock:
                self._nodes, self._slots = nodes, table
                self._last_refresh = time.monotonic()
            self._count("slot_refreshes")
            return
        with self._lock:
            if self._slots is None:
                self._slots = np.full(NSLOTS, -1, dtype=np.int16)
        raise last if last is not None else ConnectionError(f"{self.url}: no seed node")

    def _refresh_in_background(self) -> None:
        """Refresh the slot map off the read path (a thread of this process), at most every 0.5 s."""
        with self._lock:
            if self._refreshing or time.monotonic() - self._last_refresh < _REFRESH_EVERY_S:
                return
            self._refreshing = True
            self._last_refresh = time.monotonic()

        def run() -> None:
            try:
                self.refresh_slots()
            except Exception:  # every node unreachable: the next failed read schedules another try
                pass
            finally:
                self._refreshing = False

        threading.Thread(target=run, name="datacache-slot-refresh", daemon=True).start()

    def _map(self) -> tuple[list[str], np.ndarray]:
        """One consistent snapshot of the slot map: (masters, slot -> index into masters)."""
        self._ensure()
        with self._lock:
            nodes, slots = self._nodes, self._slots
        assert slots is not None
        return nodes, slots

    def masters(self) -> list[str]:
        """Addresses of the masters that serve at least one slot."""
        nodes, slots = self._map()
        served = set(np.unique(slots[slots >= 0]).tolist())
        return [n for i, n in enumerate(nodes) if i in served]

    def slot_table(self) -> tuple[list[str], np.ndarray]:
        """A snapshot of the slot map: (masters, slot -> index into masters, -1 = not served); read-only."""
        nodes, slots = self._map()
        view = slots.view()
        view.flags.writeable = False
        return list(nodes), view

    def master_of(self, keys: Sequence[bytes]) -> list[str | None]:
        """The master serving each key's slot now (None for a slot no master serves)."""
        nodes, slots = self._map()
        return [nodes[i] if i >= 0 else None for i in slots[key_slots(keys)].tolist()]

    def _lanes(self) -> int:
        slots = self._slots  # no refresh here: this sizes a chunk, before the call's failure policy applies
        if slots is None:
            return max(1, len(self.seeds))
        return max(1, len(np.unique(slots[slots >= 0])))  # serving masters (a departed one keeps an index)

    # ------------------------------------------------------------ fan-out
    def _fan_out(self, keys: Sequence[bytes], op: Callable[[Any, list[int]], list[Any]], kind: str,
                 miss: Any) -> list[Any]:
        """Run ``op(client, positions)`` once per master for its keys, in parallel; a master that fails
        gives ``miss`` for its keys (counted, slot map refreshed in the background)."""
        nodes, slots = self._map()  # the refresh thread may swap the map while this call runs
        owner = slots[key_slots(keys)]
        out: list[Any] = [miss] * len(keys)
        groups = {int(n): np.flatnonzero(owner == n).tolist() for n in np.unique(owner)}
        unserved = groups.pop(-1, [])
        if unserved:
            self._partial_failure(kind, ConnectionError(f"{len(unserved)} keys in slots no master serves"),
                                  len(unserved))
            self._refresh_in_background()

        def one(node: int, pos: list[int]) -> tuple[list[int], list[Any] | BaseException]:
            addr = nodes[node]
            try:  # through the node's breaker: a frozen master is not waited on batch after batch
                return pos, self._guarded(addr, lambda: op(self.client(addr), pos), len(pos))
            except Exception as e:  # a dead or unreachable master: its keys are misses
                return pos, e

        if len(groups) == 1:
            results = [one(*next(iter(groups.items())))]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="datacache-redis")
            results = list(self._pool.map(lambda kv: one(*kv), groups.items()))
        for pos, got in results:
            if isinstance(got, BaseException):
                self._partial_failure(kind, got, len(pos))
                self._refresh_in_background()
                continue
            if any(is_unavailable(e) for e in self._reply_errors(kind, got)):
                self._refresh_in_background()  # MOVED / ASK: a slot moved
            for p, r in zip(pos, got):
                if not isinstance(r, Exception):
                    out[p] = r
        return out

    def _get_many(self, keys: list[bytes]) -> list[Value | None]:
        def op(client: Any, pos: list[int]) -> list[Any]:  # replies straight into one buffer per node
            got = pipelined_get(client, [keys[p] for p in pos], self.expected_bytes(len(pos)))
            # where the bytes came from (runs in a pool thread: _count takes the counters' lock)
            local = self.local is not None and client is self._clients.get(self.local)
            where = "local" if local else "remote"
            values = [r for r in got if r is not None and not isinstance(r, Exception)]
            self._count(f"{where}_hits", len(values))
            self._count(f"{where}_bytes", sum(len(v) for v in values))
            return got

        return self._fan_out(keys, op, "read", None)

    def _put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool) -> int:
        def op(client: Any, pos: list[int]) -> list[Any]:
            return pipe_set(client, [items[p] for p in pos], overwrite)

        # A master that failed gives _UNWRITTEN for its keys (already counted as write errors), so
        # they are neither "written" nor "present".
        replies = self._fan_out([k for k, _ in items], op, "write", _UNWRITTEN)
        return self._count_set_replies(replies)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        def op(client: Any, pos: list[int]) -> list[Any]:
            return pipe_exists(client, [keys[p] for p in pos])

        return [r == 1 for r in self._fan_out(keys, op, "read", 0)]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """``DEL`` of ``keys`` (the rolling fill's evictions; the daemons' role only), one pipeline per
        master; the number deleted. A master that fails deletes nothing (counted as write errors)."""
        def op(client: Any, pos: list[int]) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for p in pos:
                pipe.delete(keys[p])
            return pipe.execute(raise_on_error=False)

        return sum(r for r in self._fan_out(list(keys), op, "write", 0) if isinstance(r, int))

    # ------------------------------------------------------------ daemon reports
    def client_for(self, name: bytes) -> Any:
        """The redis-py client of the master serving ``name``'s slot (run plans: one hash tag)."""
        return self._master_client(name)

    def _master_client(self, name: bytes) -> Any:
        addr = self.master_of([name])[0]
        if addr is None:
            raise ConnectionError(f"{self.url}: no master serves the slot of {name!r}")
        return self.client(addr)

    def status_set(self, name: bytes, field: str, value: bytes) -> None:
        """HSET of a daemon report on the master of ``name``'s slot; raises on failure."""
        self._master_client(name).hset(name, field, value)

    def status_del(self, name: bytes, field: str) -> int:
        """HDEL of one field (a daemon registry entry); the number removed (0 or 1)."""
        return int(self._master_client(name).hdel(name, field))

    def status_get(self, name: bytes) -> dict[bytes, bytes]:
        return dict(self._master_client(name).hgetall(name))

    # ------------------------------------------------------------ misc
    def _stats(self) -> dict[str, Any]:
        self._ensure()
        per: dict[str, Any] = {}
        for addr in self.masters():
            try:
                per[addr] = server_info(self.client(addr))
            except Exception as e:
                per[addr] = {"error": f"{type(e).__name__}: {e}"}
        keys = sum(int(v.get("keys", 0)) for v in per.values())
        used = sum(int(v.get("used_memory", 0)) for v in per.values())
        return {"entries": keys, "used_memory": used, "masters": per}

    def _ping(self, addr: str) -> str | None:
        """PING one node with this process's client (its ``socket_timeout``); None when it answered, else
        the error's class name and message (an address and a reason; never a credential)."""
        try:
            self.client(addr).ping()
            return None
        except Exception as e:
            return f"{type(e).__name__}: {e}"[:300]

    def node_health(self, addr: str) -> dict[str, Any]:
        """Health of ONE node (a daemon's own master, ``redis_node``): ``{"ok", "url", "backend", "node",
        "detail", "slots", "breaker"}``. Only ``addr`` is PINGed: another master being down does not
        matter here. ``slots``: how many slots the current slot map gives it (0 when it serves none,
        e.g. after a failover; the map is not refreshed for this)."""
        err = self._ping(addr)
        slots = 0
        with self._lock:
            nodes, table = self._nodes, self._slots
        if table is not None and addr in nodes:
            slots = int((table == nodes.index(addr)).sum())
        return {"ok": err is None, "url": self.url, "backend": self.backend, "node": addr,
                "detail": "PONG" if err is None else err, "slots": slots,
                "breaker": self.breakers().state().get(addr, {"state": "closed"})}

    def cluster_health(self) -> dict[str, Any]:
        """The whole cluster as this process's slot map sees it, every master PINGed: ``{"ok", "url",
        "backend", "detail", "masters": {addr: {"ok", "detail", "slots"}}, "masters_down": [addr...],
        "slots_unassigned", "slots_uncovered"}`` -- ``slots_uncovered`` counts the slots no master serves
        plus those of the masters down (their keys are misses for every client until they are back).
        A master that dies without a replica keeps its slots in ``CLUSTER SLOTS`` (with
        ``cluster-require-full-coverage no`` the others keep serving): it shows here as down, not as
        unassigned slots. Raises only when no node answers ``CLUSTER SLOTS`` at all."""
        nodes, slots = self._map()
        counts = np.bincount(slots[slots >= 0], minlength=len(nodes)) if len(nodes) else np.zeros(0, int)
        masters: dict[str, dict[str, Any]] = {}
        for i, addr in enumerate(nodes):
            if counts[i]:  # a departed master keeps its index in the map but serves nothing
                err = self._ping(addr)
                masters[addr] = {"ok": err is None, "detail": "PONG" if err is None else err,
                                 "slots": int(counts[i])}
        down = [a for a, m in masters.items() if not m["ok"]]
        unassigned = int((slots < 0).sum())
        uncovered = unassigned + sum(masters[a]["slots"] for a in down)
        if down:
            kinds = {a: masters[a]["detail"].partition(":")[0] for a in down}  # the error's class name
            detail = "masters down: " + ", ".join(f"{a} ({kind})" for a, kind in kinds.items())
        elif unassigned:
            detail = f"{unassigned} slots not served"
        else:
            detail = f"{len(masters)} masters, all {NSLOTS} slots served"
        return {"ok": not down and not unassigned, "url": self.url, "backend": self.backend, "detail": detail,
                "masters": masters, "masters_down": down, "slots_unassigned": unassigned,
                "slots_uncovered": uncovered}

    def _health(self) -> str:
        h = self.cluster_health()
        if not h["ok"]:
            raise ConnectionError(h["detail"])
        return h["detail"]

    def _close(self) -> None:
        if self._pid == os.getpid():
            for c in self._clients.values():
                c.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        self._clients, self._pool = {}, None
