"""Pipelined ``GET``s read straight into one buffer: the Redis stores' read path.

redis-py parses every reply into a fresh ``bytes`` (hiredis copies each value twice on the way:
into its buffer, then into the object), which caps a Python client at well under the server's
speed for ~100 KB values. Here one pipeline of ``GET``s is written to the connection's socket as one
packed command, and the replies are received into one ``bytearray`` (the only copy: kernel ->
buffer); values come back as zero-copy ``memoryview`` slices of it. The buffer lives as long as any
value (a numpy view, a tensor) refers to it.

Buffers are recycled (:class:`ArenaPool`): a fresh multi-MB ``bytearray`` per round trip costs page
faults -- glibc returns large freed blocks to the kernel, so every batch faulted its memory in again
-- which halved the read rate (measured: bench/results/NOTES.md#resp-arena). A
buffer is reused only when no view of it is alive any more: CPython refuses to resize a
``bytearray`` while a buffer export (a memoryview, a numpy array made from one) exists, and that
refusal is the liveness test.

The reply grammar accepted (RESP2 and the RESP3 null): ``$<len>\\r\\n<bytes>\\r\\n`` (a value),
``$-1\\r\\n`` / ``_\\r\\n`` (absent), ``-<error text>\\r\\n`` (a per-key error such as ``MOVED``: returned
as a :class:`redis.exceptions.ResponseError`). Anything else is a protocol error: the connection is
dropped (never reused half-read) and the error raised to the store, which counts the keys as misses.
Values are untrusted bytes: only lengths are parsed here; records are checked by
:func:`datacache.record.decode_record`.

The connection comes from the redis-py client's pool (so AUTH, SELECT, TLS and timeouts are
redis-py's) and goes back to it fully read.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Sequence
from typing import Any

_CRLF = b"\r\n"


def _unexported(buf: bytearray) -> bool:
    """True when no memoryview / numpy array refers to ``buf`` (resizing is refused while one does)."""
    try:
        buf.append(0)
    except BufferError:
        return False
    buf.pop()
    return True


class ArenaPool:
    """Receive buffers recycled once the values sliced out of them are dropped (see the module docstring)."""

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = keep_bytes  # the pool keeps at most this much between calls
        self._arenas: list[bytearray] = []
        self._busy: set[int] = set()  # ids of arenas being filled by a thread right now
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes that nothing refers to (contents undefined)."""
        with self._lock:
            for a in self._arenas:
                if id(a) not in self._busy and len(a) >= size and _unexported(a):
                    self._busy.add(id(a))
                    return a
            buf = bytearray(size)
            kept = sum(len(a) for a in self._arenas)
            if kept + size > self.keep_bytes:  # make room by dropping idle arenas, smallest first
                for a in sorted((a for a in self._arenas if id(a) not in self._busy and _unexported(a)),
                                key=len):
                    self._arenas.remove(a)
                    kept -= len(a)
                    if kept + size <= self.keep_bytes:
                        break
            if kept + size <= self.keep_bytes:
                self._arenas.append(buf)
                self._busy.add(id(buf))
            return buf

    def give_back(self, buf: bytearray) -> None:
        """``buf`` is filled: from now on the views sliced out of it protect it."""
        with self._lock:
            self._busy.discard(id(buf))

    def reset(self) -> None:
        """Fork boundary: a lock held by a parent thread would stay held in the child."""
        self._lock = threading.Lock()
        self._busy = set()


POOL = ArenaPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL.reset)


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """RESP of ``GET key`` for every key, one buffer."""
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)


def read_replies(sock: Any, n: int, expect_bytes: int) -> list[Any]:
    """Read ``n`` GET replies from ``sock`` (see the module docstring); ``expect_bytes`` sizes the buffer."""
    buf = POOL.take(max(1 << 16, int(expect_bytes * 1.25) + 64 * n))
    try:
        return _parse(sock, n, buf)
    finally:
        POOL.give_back(buf)


def _parse(sock: Any, n: int, buf: bytearray) -> list[Any]:
    from redis.exceptions import ResponseError

    filled = pos = 0
    spans: list[Any] = []  # (start, length), None or an exception; views are made at the end

    def fill(need: int) -> None:
        nonlocal filled
        while filled < need:
            if len(buf) - filled < 1 << 16:  # grows in place: no view of buf exists yet
                buf.extend(bytes(max(len(buf), need - filled + (1 << 16))))
            with memoryview(buf) as mv:
                got = sock.recv_into(mv[filled:])
            if got == 0:
                raise ConnectionError("connection closed by the server in the middle of a reply")
            filled += got

    while len(spans) < n:
        end = buf.find(_CRLF, pos, filled)
        if end < 0:
            fill(filled + 1)
            continue
        kind = buf[pos]
        if kind == 0x24:  # "$"
            length = int(buf[pos + 1:end])
            if length < 0:
                spans.append(None)
                pos = end + 2
                continue
            start = end + 2
            fill(start + length + 2)
            if buf[start + length:start + length + 2] != _CRLF:
                raise ConnectionError("malformed bulk reply (no CRLF after the value)")
            spans.append((start, length))
            pos = start + length + 2
        elif kind == 0x5F:  # "_" (RESP3 null)
            spans.append(None)
            pos = end + 2
        elif kind == 0x2D:  # "-" error for this key (MOVED, ASK, OOM, NOPERM ...)
            spans.append(ResponseError(buf[pos + 1:end].decode("utf-8", "replace")))
            pos = end + 2
        else:
            raise ConnectionError(f"unexpected reply type {chr(kind)!r} to GET")
    if pos != filled:
        raise ConnectionError("extra bytes after the last reply")
    view = memoryview(buf)
    return [view[s[0]:s[0] + s[1]] if isinstance(s, tuple) else s for s in spans]


def _needs_command_name(pool: Any) -> bool:
    """redis-py 5.0-5.2 require ``get_connection(command_name, ...)``; 5.3+ made it optional and
    deprecated passing it. Decided from the signature, once per pool class."""
    cls = type(pool)
    cached = _NEEDS_NAME.get(cls)
    if cached is None:
        try:
            param = inspect.signature(cls.get_connection).parameters.get("command_name")
        except (TypeError, ValueError):  # no readable signature: pass the name (every version accepts it)
            cached = True
        else:
            cached = param is not None and param.default is inspect.Parameter.empty
        _NEEDS_NAME[cls] = cached
    return cached


_NEEDS_NAME: dict[type, bool] = {}


def get_connection(pool: Any) -> Any:
    """A connection from a redis-py pool, with the ``command_name`` that redis-py < 5.3 requires."""
    return pool.get_connection("GET") if _needs_command_name(pool) else pool.get_connection()


def pipelined_get(client: Any, keys: Sequence[bytes], expect_bytes: int) -> list[Any]:
    """``GET`` every key over one pooled connection of ``client`` (a ``redis.Redis``)."""
    pool = client.connection_pool
    conn = get_connection(pool)
    ok = False
    try:
        conn.send_packed_command([pack_gets(keys)], check_health=False)
        sock = conn._sock  # redis-py's socket (plain or TLS) of this connection
        out = read_replies(sock, len(keys), expect_bytes)
        ok = True
        return out
    finally:
        if not ok:
            conn.disconnect()  # never hand a half-read connection back
        pool.release(conn)
