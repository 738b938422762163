"""Sample stores behind one contract (:class:`~datacache.stores.base.BaseStore`).

``open_store(url)`` parses the URL with :func:`datacache.cacheurl.parse_cache_url` (the one
parser) and opens the store of its scheme:

* ``memory://[name]`` - a process-local dict (tests, demos); option ``fetch_bytes``;
* ``lmdb:///abs/path``, ``lmdb://~/dir`` or ``lmdb://rel/dir`` - the embedded on-disk default;
  options ``map_size``, ``max_map_size`` (byte sizes: ``4GiB``), ``max_readers``, ``readonly``,
  ``sync``, ``readahead``. Parsing with ``check=True`` refuses a directory on a network
  filesystem (:func:`datacache.fscheck.require_local_disk`).

* ``redis://[user:pass@]host:port[/db]``, ``rediss://`` (TLS) and
  ``redis+cluster://[user:pass@]h1:p1[,h2:p2...]`` - Redis and Redis Cluster (the ``[redis]`` extra,
  imported only when such a URL is opened); options in :mod:`datacache.stores.redis_common`.
  Parsing with ``check=True`` PINGs the server: a wrong password / ACL user is a ConfigError.

Several tiers chained with ``::`` open as one :class:`~datacache.tiered.TieredStore`.
"""

from __future__ import annotations

from typing import Any

from datacache.cacheurl import (
    CacheSpec,
    OptionSpec,
    SchemeSpec,
    StoreSpec,
    local_path_location,
    parse_cache_url,
    register_scheme,
)
from datacache.config import ConfigError
from datacache.fscheck import require_local_disk
from datacache.stores.base import BaseStore, Store
from datacache.stores.lmdb_store import LMDBStore
from datacache.stores.memory import MemoryStore
from datacache.stores.redis_common import COMMON_OPTIONS, LOCAL_OPTION, cluster_location, standalone_location

__all__ = ["BaseStore", "LMDBStore", "MemoryStore", "Store", "open_store"]


def _open_memory(spec: StoreSpec) -> MemoryStore:
    return MemoryStore(spec.url, fetch_bytes=spec.option("fetch_bytes"),
                       readonly=spec.option("readonly", False))


def _open_lmdb(spec: StoreSpec) -> LMDBStore:
    return LMDBStore(spec.location, **spec.opts)


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

    store = spec.open()
    try:
        check_credentials(store.ping_client(), spec.url, cluster=spec.scheme == "redis+cluster")
    finally:
        store.close()


for _scheme in ("redis", "rediss"):
    register_scheme(SchemeSpec(_scheme, _open_redis, location=standalone_location, check=_check_redis,
                               options=dict(COMMON_OPTIONS)))
register_scheme(SchemeSpec(
    "redis+cluster", _open_redis_cluster, location=cluster_location, check=_check_redis,
    options={**COMMON_OPTIONS, **LOCAL_OPTION, "tls": OptionSpec("bool", "connect to the masters over TLS")}))


def open_store(url: str | CacheSpec | StoreSpec) -> Any:
    """Open the store named by ``url``: one tier as itself (synchronous writes, also for Redis), a ``::``
    chain as a :class:`~datacache.tiered.TieredStore`. A bad URL raises ConfigError naming the part.
    (The read path opens with :meth:`CacheSpec.open`, which also puts a lone remote tier behind the
    background write-back queue.)"""
    if isinstance(url, StoreSpec):
        return url.open()
    spec = url if isinstance(url, CacheSpec) else parse_cache_url(url)
    return spec.tiers[0].open() if len(spec.tiers) == 1 else spec.open()
