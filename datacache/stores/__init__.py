"""Sample stores behind one contract (:class:`~datacache.stores.base.BaseStore`).

``open_store(url)`` parses the URL with :func:`datacache.cacheurl.parse_cache_url` (the one
parser) and opens the store of its scheme:

* ``memory://[name]`` - a process-local dict (tests, demos); option ``fetch_bytes``;
* ``lmdb:///abs/path``, ``lmdb://~/dir`` or ``lmdb://rel/dir`` - the embedded on-disk default;
  options ``map_size``, ``max_map_size`` (byte sizes: ``4GiB``), ``max_readers``, ``readonly``,
  ``sync``, ``readahead``. Parsing with ``check=True`` refuses a directory on a network
  filesystem (:func:`datacache.fscheck.require_local_disk`).

Redis schemes (a later issue) register themselves with :func:`datacache.cacheurl.register_scheme`.
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
from datacache.fscheck import require_local_disk
from datacache.stores.base import BaseStore, Store
from datacache.stores.lmdb_store import LMDBStore
from datacache.stores.memory import MemoryStore

__all__ = ["BaseStore", "LMDBStore", "MemoryStore", "Store", "open_store"]


def _open_memory(spec: StoreSpec) -> MemoryStore:
    return MemoryStore(spec.url, fetch_bytes=spec.option("fetch_bytes"),
                       readonly=spec.option("readonly", False))


def _open_lmdb(spec: StoreSpec) -> LMDBStore:
    return LMDBStore(spec.location, **spec.opts)


register_scheme(SchemeSpec(
    "memory", _open_memory, example="memory://",
    options={"fetch_bytes": OptionSpec("bytes", "cap of one read round trip (tests)", minimum=1),
             "readonly": OptionSpec("bool", "refuse writes")}))
register_scheme(SchemeSpec(
    "lmdb", _open_lmdb, location=local_path_location, example="lmdb:///var/cache/datacache",
    check=lambda spec: require_local_disk(spec.location, "lmdb"),
    options={"map_size": OptionSpec("bytes", "initial map reservation (grows)", minimum=1 << 12),
             "max_map_size": OptionSpec("bytes", "cap on map growth (default: free disk)", minimum=1 << 12),
             "max_readers": OptionSpec("int", "reader slots (processes x threads)", minimum=1),
             "readonly": OptionSpec("bool", "open read-only: serve hits, never write"),
             "sync": OptionSpec("bool", "fsync data on commit"),
             "readahead": OptionSpec("bool", "OS readahead on the map")}))


def open_store(url: str | CacheSpec | StoreSpec) -> Any:
    """Open the (single-tier) store named by ``url``; a bad URL raises ConfigError naming the part."""
    if isinstance(url, StoreSpec):
        return url.open()
    return parse_cache_url(url).store.open()
