"""Sample stores behind one contract (:class:`~datacache.stores.base.BaseStore`), and the one way to open
a cache: :func:`open_store`.

``open_store(url)`` parses the URL with :func:`datacache.cacheurl.parse_cache_url` (the one parser)
and opens each tier with its scheme's store (:mod:`datacache.stores.schemes`):

* ``memory://[name]`` - a process-local dict (tests, demos); option ``fetch_bytes``;
* ``lmdb:///abs/path``, ``lmdb://~/dir`` or ``lmdb://rel/dir`` - the embedded on-disk default;
  options ``map_size``, ``max_map_size`` (byte sizes: ``4GiB``), ``max_readers``, ``readonly``,
  ``sync``, ``readahead``. Parsing with ``check=True`` refuses a directory on a network
  filesystem (:func:`datacache.fscheck.require_local_disk`).

* ``redis://[user[:pass]@]host:port[/db]``, ``rediss://`` (TLS) and
  ``redis+cluster://[user[:pass]@]h1:p1[,h2:p2...]`` - Redis and Redis Cluster (the ``[redis]`` extra,
  imported only when such a URL is opened); options in :mod:`datacache.stores.redis_common`
  (``password_file=`` among them). Parsing with ``check=True`` PINGs the server: a wrong password /
  ACL user is a ConfigError.

Several tiers chained with ``::`` open as one :class:`~datacache.tiered.TieredStore`.
"""

from __future__ import annotations

from typing import Any

from datacache.cacheurl import CacheSpec, StoreSpec, parse_cache_url
from datacache.stores.base import BaseStore, Store
from datacache.stores.lmdb_store import LMDBStore
from datacache.stores.memory import MemoryStore
from datacache.stores.schemes import scheme_factory

__all__ = ["BaseStore", "LMDBStore", "MemoryStore", "Store", "open_store"]


def open_store(url: str | CacheSpec | StoreSpec, *, background_writes: bool = False,
               reader: bool = False) -> Any:
    """Open the cache ``url`` names, in the process that will use it. One tier opens as itself, with
    synchronous, acknowledged writes (what the daemon and ``datacache warm`` want, also for Redis); a
    ``::`` chain opens as a :class:`~datacache.tiered.TieredStore`. ``background_writes=True`` (the read
    path of ``CachedImageNet``) also puts a lone remote tier behind the TieredStore's background
    write-back queue, so a miss's write-back never waits for the network. A bad URL raises ConfigError
    naming the part.

    ``reader=True`` (``CachedImageNet``'s read path): **trainers read, daemons write** -- every remote
    (shared) tier opens read-only unless its URL says ``?write_back=1`` (a Redis that is the user's
    alone); local tiers (LMDB, memory) stay writable, so the embedded cache keeps its write-back."""
    if isinstance(url, StoreSpec):
        tiers: tuple[StoreSpec, ...] = (url,)
    else:
        tiers = (url if isinstance(url, CacheSpec) else parse_cache_url(url)).tiers
    stores = [scheme_factory(t) for t in tiers]
    if reader:
        for st, t in zip(stores, tiers):
            if getattr(st, "remote", False) and not t.option("write_back", False):
                # never a write to a shared tier: BaseStore.put_many refuses, TieredStore skips it
                st.readonly = st.reader_only = True
    if len(stores) == 1 and not (background_writes and getattr(stores[0], "remote", False)):
        return stores[0]
    from datacache.tiered import TieredStore

    return TieredStore(stores)
