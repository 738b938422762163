"""``redis://`` and ``rediss://``: one Redis server as a sample store (redis-py, the ``[redis]`` extra).

* ``get_many``: one pipeline of ``GET``s per chunk, its replies received into one buffer and returned
  as zero-copy views (:mod:`datacache.stores.resp`); chunks are capped at ``fetch_bytes`` of expected
  reply (2 MiB by default, :mod:`datacache.stores.base`), so a batch of 256 x 77 KB samples is ~10
  round trips of ~2 MB, never one 20 MB reply that stalls the socket.
* ``put_many``: ``SET key value NX`` (``SET`` when ``overwrite``) in one non-transactional pipeline
  per call. A server at ``maxmemory`` with ``noeviction`` answers ``OOM`` per command: those writes
  are counted in ``write_errors`` (one warning that says why), the others succeed.
* ``contains``: ``EXISTS`` per key, pipelined.
* Values are returned as ``bytes`` and treated as untrusted (:mod:`datacache.record` checks them;
  nothing is unpickled).

Per-process state (fork/spawn boundary): the redis-py client and its connection pool are created
lazily in the process that uses them (pid-checked), never inherited by a DataLoader worker.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from datacache.cacheurl import StoreSpec
from datacache.stores.base import Value
from datacache.stores.redis_common import (
    DEFAULT_FETCH_BYTES,
    RedisStoreBase,
    connection_kwargs,
    parse_hostport,
    pipe_exists,
    pipe_set,
    server_info,
    split_userinfo,
)
from datacache.stores.resp import pipelined_get


class RedisStore(RedisStoreBase):
    """One Redis server (see the module docstring)."""

    backend = "redis"

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.tls = spec.scheme == "rediss"
        _, _, rest = split_userinfo(spec.location, spec.url)
        hostport, _, db = rest.partition("/")
        self.host, self.port = parse_hostport(hostport, spec.url)
        self.db = int(db or 0)
        super().__init__(spec.url, fetch_bytes=spec.option("fetch_bytes", DEFAULT_FETCH_BYTES))

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._client: Any = None
        self._pid = -1

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_client", "_pid")

    def client(self) -> Any:
        """This process's redis-py client (created on first use; see the module docstring)."""
        if self._client is None or self._pid != os.getpid():
            import redis

            self._client = redis.Redis(host=self.host, port=self.port, db=self.db,
                                       **connection_kwargs(self.spec, tls=self.tls))
            self._pid = os.getpid()
        return self._client

    ping_client = client  # what the URL check PINGs (and closes): this store's own client

    def masters(self) -> list[str]:
        return [self.addr]

    def node_client(self, addr: str) -> Any:
        if addr != self.addr:
            raise KeyError(f"{self.url} has no server {addr!r} (it is {self.addr})")
        return self.client()

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def _get_many(self, keys: list[bytes]) -> list[Value | None]:
        got = self._guarded(self.addr, lambda: pipelined_get(self.client(), keys,
                                                             self.expected_bytes(len(keys))), len(keys))
        self._reply_errors("read", got)  # per-key errors (e.g. a LOADING server): those keys are misses
        return [None if isinstance(r, Exception) else r for r in got]

    def _put_many(self, items: Sequence[tuple[bytes, bytes]], *, overwrite: bool) -> int:
        replies = self._guarded(self.addr, lambda: pipe_set(self.client(), items, overwrite), len(items))
        self._reply_errors("write", replies)  # per-command errors (OOM at maxmemory): write errors
        return self._count_set_replies(replies)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        got = self._guarded(self.addr, lambda: pipe_exists(self.client(), keys), len(keys))
        return [r == 1 for r in got]  # an error reply is "not there"

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """``DEL`` of ``keys`` (the rolling fill's evictions; the daemons' role only); the number deleted."""
        if not keys:
            return 0

        def op() -> list[Any]:
            pipe = self.client().pipeline(transaction=False)
            for k in keys:
                pipe.delete(k)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._guarded(self.addr, op, len(keys))
        except Exception as exc:
            self._failed("write", exc, len(keys))
            return 0
        return sum(r for r in replies if isinstance(r, int))

    def client_for(self, name: bytes) -> Any:
        """The redis-py client that serves ``name`` (this one server)."""
        return self.client()

    def status_set(self, name: bytes, field: str, value: bytes) -> None:
        """HSET of a daemon report (:mod:`datacache.fillstatus`); raises on failure (callers decide)."""
        self.client().hset(name, field, value)

    def status_del(self, name: bytes, field: str) -> int:
        """HDEL of one field (a daemon registry entry); the number removed (0 or 1)."""
        return int(self.client().hdel(name, field))

    def status_get(self, name: bytes) -> dict[bytes, bytes]:
        return dict(self.client().hgetall(name))

    def _stats(self) -> dict[str, Any]:
        info = server_info(self.client())
        return {"entries": info["keys"], **info}

    def _health(self) -> str:
        self.client().ping()
        return f"PONG from {self.host}:{self.port}/{self.db}"

    def _close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None
