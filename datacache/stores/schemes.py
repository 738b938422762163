"""The built-in cache schemes, registered with :mod:`datacache.cacheurl` when this module is imported.

:data:`datacache.cacheurl.KNOWN_SCHEMES` names this module for each built-in scheme, so the parser
imports it on first use (and this module imports the parser: one direction only). Each scheme says
which options it takes, how its location is normalised, what is checked at construction
(``check=True``) and which store class opens it; the Redis classes are imported only when a Redis URL
is opened (the ``[redis]`` extra).
"""

from __future__ import annotations

from typing import Any

from datacache.cacheurl import OptionSpec, SchemeSpec, StoreSpec, local_path_location, register_scheme
from datacache.config import ConfigError
from datacache.fscheck import require_local_disk
from datacache.stores.lmdb_store import LMDBStore
from datacache.stores.memory import MemoryStore
from datacache.stores.redis_common import COMMON_OPTIONS, LOCAL_OPTION, cluster_location, standalone_location


def _open_memory(spec: StoreSpec) -> MemoryStore:
    return MemoryStore(spec.url, fetch_bytes=spec.option("fetch_bytes"),
                       readonly=spec.option("readonly", False))


def _open_lmdb(spec: StoreSpec) -> LMDBStore:
    return LMDBStore(spec.location, **spec.opts)


def _require_redis(url: str) -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError(f"cache {url}: the redis package is not installed; pip install 'datacache[redis]'"
                          ) from None


def _open_redis(spec: StoreSpec) -> Any:
    _require_redis(spec.url)
    from datacache.stores.redis_store import RedisStore

    return RedisStore(spec)


def _open_redis_cluster(spec: StoreSpec) -> Any:
    _require_redis(spec.url)
    from datacache.stores.redis_cluster import RedisClusterStore

    return RedisClusterStore(spec)


def _check_redis(spec: StoreSpec) -> None:
    """At construction: the extra is installed and the credentials are right (a server that is down
    only warns: lookups are misses until it is up)."""
    from datacache.stores.redis_common import check_credentials

    store = scheme_factory(spec)
    try:
        check_credentials(store.ping_client(), spec.url, cluster=spec.scheme == "redis+cluster")
    finally:
        store.close()


def scheme_factory(spec: StoreSpec) -> Any:
    """The store of one parsed tier (what :func:`datacache.stores.open_store` calls per tier)."""
    from datacache.cacheurl import scheme_spec

    return scheme_spec(spec.scheme, spec.url).factory(spec)


register_scheme(SchemeSpec(
    "memory", _open_memory,
    options={"fetch_bytes": OptionSpec("bytes", "cap of one read round trip (tests)", minimum=1),
             "readonly": OptionSpec("bool", "refuse writes")}))
register_scheme(SchemeSpec(
    "lmdb", _open_lmdb, location=local_path_location,
    check=lambda spec: require_local_disk(spec.location, "lmdb"),
    options={"map_size": OptionSpec("bytes", "initial map reservation (grows)", minimum=1 << 12),
             "max_map_size": OptionSpec("bytes", "cap on map growth (default: free disk)", minimum=1 << 12),
             "max_readers": OptionSpec("int", "reader slots (processes x threads)", minimum=1),
             "readonly": OptionSpec("bool", "open read-only: serve hits, never write"),
             "sync": OptionSpec("bool", "fsync data on commit"),
             "readahead": OptionSpec("bool", "OS readahead on the map")}))
for _name in ("redis", "rediss"):
    register_scheme(SchemeSpec(_name, _open_redis, location=standalone_location, check=_check_redis,
                               options=dict(COMMON_OPTIONS)))
register_scheme(SchemeSpec(
    "redis+cluster", _open_redis_cluster, location=cluster_location, check=_check_redis,
    options={**COMMON_OPTIONS, **LOCAL_OPTION, "tls": OptionSpec("bool", "connect to the masters over TLS")}))
