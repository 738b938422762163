"""Pipelined ``GET``s read straight into one buffer: the Redis stores' read path.

redis-py parses every reply into a fresh ``bytes`` (hiredis copies each value twice on the way:
into its buffer, then into the object), which caps a Python client at well under the server's
speed for ~100 KB values. Here one pipeline of ``GET``s is written to the connection's socket as one
packed command, and the replies are received into one ``bytearray`` (the only copy: kernel ->
buffer); values come back as zero-copy ``memoryview`` slices of it. The buffer lives as long as any
value (a numpy view, a tensor) refers to it.

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

from collections.abc import Sequence
from typing import Any

_CRLF = b"\r\n"


def pack_gets(keys: Sequence[bytes]) -> bytes:
    """RESP of ``GET key`` for every key, one buffer."""
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)


def read_replies(sock: Any, n: int, expect_bytes: int) -> list[Any]:
    """Read ``n`` GET replies from ``sock`` (see the module docstring); ``expect_bytes`` sizes the buffer."""
    from redis.exceptions import ResponseError

    buf = bytearray(max(1 << 16, int(expect_bytes * 1.25) + 64 * n))
    filled = pos = 0
    spans: list[Any] = []  # (start, length), None or an exception; views are made at the end

    def fill(need: int) -> None:
        nonlocal buf, filled
        while filled < need:
            if len(buf) - filled < 1 << 16:
                buf.extend(bytes(max(len(buf), need - filled + (1 << 16))))  # no view exists yet: may move
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


def pipelined_get(client: Any, keys: Sequence[bytes], expect_bytes: int) -> list[Any]:
    """``GET`` every key over one pooled connection of ``client`` (a ``redis.Redis``)."""
    pool = client.connection_pool
    conn = pool.get_connection()
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
