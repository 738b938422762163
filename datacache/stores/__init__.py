"""Sample stores behind one small protocol (:class:`~datacache.stores.base.Store`).

``open_store(url, **opts)`` picks the implementation from the URL scheme:

* ``memory://`` - a process-local dict (tests, demos);
* ``lmdb:///abs/path`` or ``lmdb://rel/path`` - the embedded on-disk default; options
  (``map_size``, ``max_map_size``, ``max_readers``, ``subdir``, ``readonly``, ``sync``) come from
  ``opts`` or the URL query string (``lmdb:///c?map_size=4294967296``).

``redis://`` and ``redis-cluster://`` come with the Redis tier (a later issue) and register
themselves through :func:`register_scheme`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from datacache.config import ConfigError
from datacache.stores.base import Store
from datacache.stores.lmdb_store import LMDBStore
from datacache.stores.memory import MemoryStore

__all__ = ["LMDBStore", "MemoryStore", "Store", "open_store", "register_scheme"]

_INT_OPTS = ("map_size", "max_map_size", "max_readers")
_BOOL_OPTS = ("subdir", "readonly", "sync", "readahead")


def _coerce(opts: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in opts.items():
        if k in _INT_OPTS:
            out[k] = int(v)
        elif k in _BOOL_OPTS:
            out[k] = v.lower() in ("1", "true", "yes", "on")
        else:
            raise ConfigError(f"unknown store option {k!r}; valid: {', '.join(_INT_OPTS + _BOOL_OPTS)}")
    return out


def _open_memory(rest: str, url: str, opts: dict[str, Any]) -> Store:
    if opts:
        raise ConfigError(f"memory:// takes no options, got {sorted(opts)}")
    return MemoryStore(url)


def _open_lmdb(rest: str, url: str, opts: dict[str, Any]) -> Store:
    path, _, query = rest.partition("?")
    if not path:
        raise ConfigError(f"{url}: lmdb URL needs a path, e.g. lmdb:///var/cache/datacache/lmdb")
    return LMDBStore(path, **{**_coerce(dict(parse_qsl(query))), **opts})


_SCHEMES: dict[str, Callable[[str, str, dict[str, Any]], Store]] = {
    "memory": _open_memory,
    "lmdb": _open_lmdb,
}


def register_scheme(scheme: str, factory: Callable[[str, str, dict[str, Any]], Store]) -> None:
    """Add a store scheme: ``factory(rest_of_url, url, opts) -> Store``."""
    _SCHEMES[scheme] = factory


def open_store(url: str, **opts: Any) -> Store:
    """Open the store named by ``url`` (see the module docstring)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError(
            f"unknown cache store URL {url!r}; valid schemes: {', '.join(s + '://' for s in _SCHEMES)} "
            "(redis:// and redis-cluster:// arrive with the Redis tier in a later issue)"
        )
    return _SCHEMES[scheme](rest, url, opts)
