"""Datasets registered at run time, shared by every daemon of a cluster through Redis.

``POST /datasets`` on any daemon (``datacache warm --via-daemon URL`` does it) validates the dataset
and adds it to the Redis hash ``dcd:datasets`` (field = ``source|variant``, value = msgpack of the
:class:`~cache_daemon.config.DatasetSpec` fields). Every daemon reads the hash before each fill pass,
so each ingests its own share of a dataset registered on any node. Entries are untrusted input:
parsed with msgpack, validated like a config file's ``[[datasets]]``; a bad one is skipped and logged.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import msgpack

from cache_daemon.config import DatasetSpec
from datacache.config import ConfigError
from datacache.fillstatus import status_store

log = logging.getLogger("cache_daemon.registry")
REGISTRY_KEY = b"dcd:datasets"


def register(store: Any, spec: DatasetSpec) -> None:
    status_store(store).status_set(REGISTRY_KEY, spec.ident(), msgpack.packb(asdict(spec)))


def registered(store: Any) -> list[DatasetSpec]:
    """The datasets in the registry (an unreachable registry is an empty list: retried next pass)."""
    try:
        raw = status_store(store).status_get(REGISTRY_KEY)
    except Exception as e:
        log.debug("dataset registry unreadable: %s", e)
        return []
    out = []
    for field_name, value in sorted(raw.items()):
        try:
            out.append(DatasetSpec.from_dict(msgpack.unpackb(bytes(value), raw=False), "registry entry"))
        except (ConfigError, ValueError, msgpack.UnpackException) as e:
            log.warning("skipping registry entry %r: %s", field_name, e)
    return out
