"""Datasets registered at run time, shared by every daemon of a cluster through Redis.

``POST /datasets`` on any daemon (``datacache warm --via-daemon URL`` does it, with the API token)
validates the dataset against that daemon's ``allowed_sources`` and adds it to the Redis hash
``dcd:datasets`` (field = ``source|variant``, value = msgpack of the
:class:`~cache_daemon.daemon_config.DatasetSpec` fields), at most ``max_registrations`` entries.
``DELETE /datasets/{id}`` removes one. Every daemon reads the hash before each fill pass, so each
ingests its own share of a dataset registered on any node.

Entries are untrusted input (anyone who can write to Redis can write them): parsed with msgpack,
validated like a config file's ``[[datasets]]``, and checked against the READING daemon's own
``allowed_sources``; an entry that fails is skipped and logged, never read from.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import msgpack

from cache_daemon.daemon_config import DatasetSpec, source_allowed
from datacache.config import ConfigError
from datacache.fillstatus import status_store

log = logging.getLogger("cache_daemon.registry")
REGISTRY_KEY = b"dcd:datasets"
MAX_ENTRY_BYTES = 8192


def register(store: Any, spec: DatasetSpec, *, max_registrations: int) -> None:
    """Add ``spec``; ConfigError when the registry already holds ``max_registrations`` other entries."""
    tier = status_store(store)
    current = tier.status_get(REGISTRY_KEY)
    # check-then-set is not atomic: concurrent POSTs on several daemons can overshoot the cap by the
    # number of racing requests; the cap bounds growth, it is not a quota.
    if spec.ident().encode() not in current and len(current) >= max_registrations:
        raise ConfigError(f"the registry already holds {len(current)} datasets (max_registrations = "
                          f"{max_registrations}); DELETE /datasets/<id> one first or raise max_registrations")
    tier.status_set(REGISTRY_KEY, spec.ident(), msgpack.packb(asdict(spec)))


def unregister(store: Any, ident: str) -> bool:
    """Remove the entry ``ident`` (``source|variant``); False when there was none."""
    return status_store(store).status_del(REGISTRY_KEY, ident) > 0


def registered(store: Any, allowed_sources: tuple[str, ...], *, strict: bool = False) -> list[DatasetSpec]:
    """The valid entries under ``allowed_sources``. An unreachable registry is an empty list (retried next
    pass), or with ``strict`` raises: a caller that drops datasets missing from the list must not read
    "unreachable" as "everything was deleted"."""
    try:
        registry = status_store(store)
    except ConfigError:  # a cache with no Redis tier (lmdb://, memory://) has no registry: nothing registered
        return []
    try:
        raw = registry.status_get(REGISTRY_KEY)
    except Exception as e:
        if strict:
            raise
        log.debug("dataset registry unreadable: %s", e)
        return []
    out = []
    for field_name, value in sorted(raw.items()):
        try:
            if len(value) > MAX_ENTRY_BYTES:
                raise ConfigError(f"entry of {len(value)} bytes (more than {MAX_ENTRY_BYTES})")
            spec = DatasetSpec.from_dict(msgpack.unpackb(bytes(value), raw=False), "registry entry")
            if not source_allowed(spec.source, allowed_sources):
                raise ConfigError(f"source {spec.source!r} is outside this daemon's allowed_sources")
        except (ConfigError, ValueError, TypeError, msgpack.UnpackException) as e:
            log.warning("skipping registry entry %r: %s", field_name[:200], e)
            continue
        out.append(spec)
    return out
