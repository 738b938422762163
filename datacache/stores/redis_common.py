"""What the Redis stores share: URL locations, connection options (ACL user, TLS), error classes.

Locations (the part after ``scheme://``)::

    redis://[user:password@]host:port[/db]            one server (db 0 by default)
    rediss://[user:password@]host:port[/db]           the same over TLS
    redis+cluster://[user:password@]h1:p1[,h2:p2...]  seed nodes of a Redis Cluster (?tls=1 for TLS)

Options (``?name=value``): ``socket_timeout`` / ``connect_timeout`` (seconds, default 2 / 1),
``fetch_bytes`` (reply bytes per round trip, default 2 MiB), ``client_name``, and for TLS
``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (``none``/``optional``/``required``)
and ``ssl_check_hostname``.

What both stores inherit: :class:`RedisStoreBase` (a remote tier with Redis's error classes and
advice, the per-key error replies of a pipeline counted as a partial failure) and the pipelined
``SET``/``EXISTS`` of :func:`pipe_set` / :func:`pipe_exists`.

Errors: a refused or reset connection, a timeout, ``CLUSTERDOWN``, ``MOVED``/``ASK`` and
``LOADING`` mean "unavailable right now": the keys are misses and the store keeps going
(:meth:`~datacache.stores.base.BaseStore._is_unavailable`). A wrong password or ACL user is
reported when the URL is checked (``CachedImageNet(...)``, the CLI), as a
:class:`~datacache.config.ConfigError` naming the server and what to fix; a server that is merely
down at that moment is a warning (the cache fills once it is up).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote

from datacache.cacheurl import OptionSpec, StoreSpec, redact
from datacache.config import ConfigError
from datacache.options import choice
from datacache.options import parse_hostport as _hostport
from datacache.redact import register_secret
from datacache.secretfile import read_secret_file
from datacache.stores.base import BaseStore
from datacache.stores.breaker import BreakerOpen, Breakers

PROBE_TIMEOUT_S = 0.5  # the breaker's PING waits at most this (or socket_timeout when shorter)

log = logging.getLogger("datacache.stores.redis")

DEFAULT_FETCH_BYTES = 2 << 20
CERT_REQS = ("none", "optional", "required")

COMMON_OPTIONS: dict[str, OptionSpec] = {
    "socket_timeout": OptionSpec("float", "seconds to wait for a reply (default 2; > 0 and <= 3600)",
                                 positive=True, maximum=3600.0),
    "connect_timeout": OptionSpec("float", "seconds to wait for a connection (default 1; > 0 and <= 3600)",
                                  positive=True, maximum=3600.0),
    "fetch_bytes": OptionSpec("bytes", "reply bytes per round trip (default 2MiB)", minimum=1),
    "client_name": OptionSpec("str", "CLIENT SETNAME shown by CLIENT LIST"),
    "password_file": OptionSpec("str", "file holding the password (user@host in the URL, no password there)"),
    "ssl_ca_certs": OptionSpec("str", "CA bundle file (TLS)"),
    "ssl_certfile": OptionSpec("str", "client certificate file (TLS)"),
    "ssl_keyfile": OptionSpec("str", "client key file (TLS)"),
    "ssl_cert_reqs": OptionSpec("str", "none, optional or required (TLS, default required)"),
    "ssl_check_hostname": OptionSpec("bool", "check the server's hostname (TLS)"),
    # trainers read, daemons write: CachedImageNet never writes a shared tier unless its owner says so
    "write_back": OptionSpec("bool", "CachedImageNet writes its misses back to this tier (default no: the "
                             "daemons fill a shared cache, and the trainers' ACL role cannot write; yes only "
                             "for a Redis that is yours alone, with a credential that may SET)"),
}
# redis+cluster:// only: the master on this node, so reads are counted as local or remote bytes
LOCAL_OPTION = {"local": OptionSpec("str", "host:port of the master on this node (counts local_bytes / "
                                    "remote_bytes)")}


def split_userinfo(raw: str, url: str) -> tuple[str | None, str | None, str]:
    """``user:pass@rest`` -> (user, password, rest); ``:pass@rest`` is a password without a user and
    ``user@rest`` a user without one (its password then comes from ``?password_file=``). The userinfo
    ends at the LAST ``@``, so a password may hold ``@``, ``/``, ``,`` or ``:`` raw; it is
    percent-decoded (write ``%`` as ``%25``, ``?`` as ``%3F``, ``#`` as ``%23``).
    :func:`datacache.redact.redact` hides exactly this password."""
    if "@" not in raw:
        return None, None, raw
    info, _, rest = raw.rpartition("@")
    user, sep, password = info.partition(":")
    if not sep:
        if not user:
            raise ConfigError(f"cache URL {redact(url)!r}: credentials must be user:password@, :password@ "
                              "or user@ (with ?password_file=)")
        return unquote(user), None, rest
    return (unquote(user) or None), unquote(password), rest


def parse_hostport(text: str, url: str) -> tuple[str, int]:
    """``host:port`` of a node in the cache URL ``url`` (:func:`datacache.options.parse_hostport`)."""
    return _hostport(text, f"cache URL {redact(url)!r}")


def standalone_location(raw: str, url: str) -> str:
    """Validate ``[user:pass@]host:port[/db]`` (kept as given, db defaulted to 0)."""
    _, _, rest = split_userinfo(raw, url)
    hostport, _, db = rest.partition("/")
    parse_hostport(hostport, url)
    if db and not db.isdigit():
        raise ConfigError(f"cache URL {redact(url)!r}: database {db!r} must be a number (redis://host:port/0)")
    return raw if db else raw.rstrip("/") + "/0"


def cluster_location(raw: str, url: str) -> str:
    """Validate ``[user:pass@]h1:p1[,h2:p2...]``."""
    _, _, rest = split_userinfo(raw, url)
    if not rest or "/" in rest:
        raise ConfigError(f"cache URL {redact(url)!r}: expected redis+cluster://host:port[,host:port...] "
                          "(a cluster has no database number)")
    for part in rest.split(","):
        parse_hostport(part, url)
    return raw


def connection_kwargs(spec: StoreSpec, *, tls: bool) -> dict[str, Any]:
    """redis-py keyword arguments (credentials, timeouts, TLS) for ``spec``; no retries inside redis-py:
    a failed call is a miss for us, retried by the next batch, never a stall."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    user, password, _ = split_userinfo(spec.location, spec.url)
    password = password_of(spec, password)
    kw: dict[str, Any] = {
        "username": user, "password": password,
        "socket_timeout": spec.option("socket_timeout", 2.0),
        "socket_connect_timeout": spec.option("connect_timeout", 1.0),
        "retry": Retry(NoBackoff(), 0), "health_check_interval": 0,
    }
    if spec.option("client_name"):
        kw["client_name"] = spec.option("client_name")
    if tls:
        reqs = choice(f"cache URL {spec.url!r}: ssl_cert_reqs", spec.option("ssl_cert_reqs", "required"),
                      CERT_REQS)
        kw.update(ssl=True, ssl_cert_reqs=reqs, ssl_check_hostname=spec.option("ssl_check_hostname", False))
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if spec.option(name):
                kw[name] = spec.option(name)
    return kw


def password_of(spec: StoreSpec, inline: str | None) -> str | None:
    """The URL's inline password, or the content of ``?password_file=`` (read in the process that opens
    the store: DataLoader workers and decode workers read the file themselves, nothing secret is
    pickled). Both at once is a ConfigError; so is an unreadable or empty file."""
    path = spec.option("password_file")
    if not path:
        if inline:
            register_secret(inline)
        return inline
    if inline:
        raise ConfigError(f"cache URL {spec.url!r}: a password in the URL and ?password_file= at once; keep "
                          "one (the file: user@host:port?password_file=/path)")
    return read_secret_file(path, what=f"cache URL {spec.url!r}: option password_file")


def is_unavailable(exc: BaseException) -> bool:
    """Connection-level failures, timeouts, a cluster that is down or whose slots moved, a loading node."""
    import redis.exceptions as rex

    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError, rex.BusyLoadingError,
                        ConnectionError, TimeoutError, OSError)):
        return True
    text = str(exc)
    return isinstance(exc, rex.ResponseError) and text.startswith(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN",
                                                                  "LOADING", "MASTERDOWN"))


def is_auth_error(exc: BaseException) -> bool:
    import redis.exceptions as rex

    text = str(exc)
    return isinstance(exc, (rex.AuthenticationError, rex.AuthorizationError, rex.NoPermissionError)) or any(
        w in text for w in ("NOAUTH", "WRONGPASS", "NOPERM", "invalid username-password"))


def advice(exc: BaseException, url: str) -> str:
    """What to do about a Redis failure (used in the one warning per store and process)."""
    text = str(exc)
    import redis.exceptions as rex

    if isinstance(exc, rex.NoPermissionError) or "NOPERM" in text or "no permissions" in text:
        return (f"The ACL user of {url} may not do this. Trainers read, daemons write: the trainers' role "
                "(datacache) reads only; filling the cache (the daemon, datacache warm) needs the daemons' "
                "role (the ACL user datacache-daemon and its password file; docs/security.md).")
    if is_auth_error(exc):
        return (f"Wrong password or ACL user for {url}: put the right user:password@ in the cache URL, or "
                "the ACL user and ?password_file= (python -m datacache.make_secrets makes one per role).")
    if "OOM" in text or "maxmemory" in text:
        return ("Redis refuses writes at its memory budget (maxmemory with maxmemory-policy noeviction, the "
                "default MinIO policy: the cache keeps what it has, the rest is served from the source). "
                "Raise maxmemory, or use allkeys-lru when the dataset fits.")
    if is_unavailable(exc):
        return "The server is unreachable or its cluster is reconfiguring; retried on later batches."
    return ""


def check_credentials(client: Any, url: str, *, cluster: bool = False) -> None:
    """PING with ``client``: a wrong password / ACL user raises ConfigError; a server that is down warns.
    ``cluster``: the server must run in cluster mode, else ConfigError -- a standalone server behind
    ``redis+cluster://`` answers no ``CLUSTER SLOTS`` and every lookup would be a miss forever. Asked
    with ``CLUSTER SLOTS`` itself (the command the store routes with, so an ACL user has it)."""
    try:
        client.ping()
        if cluster:
            _require_cluster_mode(client, url)
    except ConfigError:
        raise
    except Exception as e:
        if is_auth_error(e):
            raise ConfigError(f"cache {url}: {type(e).__name__}: {e}. {advice(e, url)}") from None
        log.warning("cache %s is not reachable now (%s: %s): lookups are misses (served from the source) "
                    "until it is up", url, type(e).__name__, e)
    finally:
        with contextlib.suppress(Exception):  # closing a client that never connected is not worth a crash
            client.close()


def _require_cluster_mode(client: Any, url: str) -> None:
    import redis.exceptions as rex

    try:
        client.execute_command("CLUSTER SLOTS")
    except rex.ResponseError as e:
        if "cluster support disabled" in str(e).lower() or "unknown" in str(e).lower():
            raise ConfigError(f"cache {url}: the server is not in cluster mode (it answered {e}); use "
                              "redis://host:port for one server, or start it with 'cluster-enabled yes'"
                              ) from None
        raise


def server_info(client: Any) -> dict[str, Any]:
    """Memory figures of one server: used/max memory, policy, keys, evictions and rejected writes."""
    mem = client.info("memory")
    stats = client.info("stats")
    return {"used_memory": int(mem.get("used_memory", 0)), "maxmemory": int(mem.get("maxmemory", 0)),
            "maxmemory_policy": mem.get("maxmemory_policy", ""), "keys": int(client.dbsize()),
            "evicted_keys": int(stats.get("evicted_keys", 0))}


def pipe_set(client: Any, items: Sequence[tuple[bytes, bytes]], overwrite: bool) -> list[Any]:
    """``SET key value NX`` (``SET`` when ``overwrite``) per item in one non-transactional pipeline;
    the replies, per-command errors (``OOM`` at maxmemory) returned, not raised."""
    pipe = client.pipeline(transaction=False)
    for k, v in items:
        pipe.set(k, v, nx=not overwrite)
    return pipe.execute(raise_on_error=False)


def pipe_exists(client: Any, keys: Sequence[bytes]) -> list[Any]:
    """``EXISTS`` per key in one non-transactional pipeline; errors returned, not raised."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.exists(k)
    return pipe.execute(raise_on_error=False)


class RedisStoreBase(BaseStore):
    """What the standalone and the cluster store share (their own modules hold the rest)."""

    remote = True  # a network tier: TieredStore writes to it in the background
    spec: StoreSpec
    tls: bool

    def _reset_process_state(self) -> None:
        super()._reset_process_state()
        self._breakers_obj: Breakers | None = None
        self._breakers_pid = -1
        self._counters.update(breaker_skipped=0)

    def _process_attrs(self) -> tuple[str, ...]:
        return (*super()._process_attrs(), "_breakers_obj", "_breakers_pid")

    def breakers(self) -> Breakers:
        """This process's per-node circuit breakers (:mod:`datacache.stores.breaker`). Fork boundary: a
        forked DataLoader worker gets fresh ones (the parent's lock may be held, its probe threads
        were not copied), checked by pid because the standalone store does not reset on fork."""
        if self._breakers_obj is None or self._breakers_pid != os.getpid():
            self._breakers_obj = Breakers(self._probe_ping)
            self._breakers_pid = os.getpid()
        return self._breakers_obj

    def _probe_ping(self, addr: str) -> None:
        """PING ``addr`` over a fresh connection with a short timeout (the breaker's probe thread)."""
        import redis

        host, port = parse_hostport(addr, self.url)
        kw = connection_kwargs(self.spec, tls=self.tls)
        kw["socket_timeout"] = min(PROBE_TIMEOUT_S, kw["socket_timeout"])
        kw["socket_connect_timeout"] = min(PROBE_TIMEOUT_S, kw["socket_connect_timeout"])
        client = redis.Redis(host=host, port=port, **kw)
        try:
            client.ping()
        finally:
            client.close()

    def _guarded(self, addr: str, call: Callable[[], Any], n: int) -> Any:
        """``call()`` to node ``addr`` through its breaker: refused without a network call while open
        (``n`` keys counted in ``breaker_skipped``); a timeout or refused connection opens it."""
        br = self.breakers()
        if not br.allow(addr):
            self._count("breaker_skipped", n)
            raise BreakerOpen(f"{addr}: circuit open after timeouts/refusals (probed in the background)")
        try:
            return call()
        except Exception as e:
            br.failure(addr, e)
            raise

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["breakers"] = self.breakers().state()
        return out

    def health(self) -> dict[str, Any]:
        out = super().health()
        opened = self.breakers().open_nodes()
        out["breakers"] = self.breakers().state()
        if opened:
            out["ok"] = False
            out["detail"] = f"{out['detail']}; circuit open for {', '.join(opened)}"
        return out

    def _is_unavailable(self, exc: BaseException) -> bool:
        return is_unavailable(exc)

    def _advice(self, exc: BaseException) -> str:
        return advice(exc, self.url) or super()._advice(exc)

    def expected_bytes(self, n: int) -> int:
        """Reply bytes expected for ``n`` values (running mean, else the hint): sizes the read buffer."""
        return int(n * (self._mean_value or self._value_hint))

    def _count_set_replies(self, replies: Sequence[Any]) -> int:
        """Count the replies of one ``SET [NX]`` pipeline honestly: ``True`` (OK) is written; ``None``
        (NX found the key) is ``present``; error replies are write errors (counted by the caller via
        :meth:`_reply_errors`). Returns the number written (what the server acknowledged)."""
        present = sum(1 for r in replies if r is None)
        if present:
            self._count("present", present)
        return sum(1 for r in replies if r is True)

    def _reply_errors(self, kind: str, replies: Sequence[Any]) -> list[Exception]:
        """The per-key error replies of one pipeline, counted as one partial failure of ``kind``
        (``read``/``write``); the caller treats those keys as misses / unwritten."""
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            self._partial_failure(kind, errors[0], len(errors))
        return errors
