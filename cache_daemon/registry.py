"""Datasets registered at run time, shared by every daemon of a cluster through Redis.

``POST /datasets`` on any daemon (``datacache warm --via-daemon URL`` does it, with the API token)
validates the dataset against that daemon's ``allowed_sources`` and adds it to the Redis hash
``dcd:datasets`` (field = ``source|variant``, value = msgpack of the
:class:`~cache_daemon.daemon_config.DatasetSpec` fields), at most ``max_registrations`` entries.
``DELETE /datasets/{id}`` removes one. Every daemon reads the hash before each fill pass, so each
ingests its own share of a dataset registered on any node.

Entries are untrusted input (only the daemons' Redis role and the admin may write the hash -- trainers'
role may not, see :mod:`datacache.redis_roles` -- but a leaked daemon password must not be enough to
steer every daemon): parsed with msgpack, validated like a config file's ``[[datasets]]``, and checked
against the READING daemon's own ``allowed_sources``; an entry that fails is skipped and logged, never
read from. The cap holds on READ too: :func:`registered` keeps at most ``max_registrations`` valid
entries -- the first ones in field-name order, the same choice on every daemon -- and looks at no more
than :data:`MAX_EXAMINED` fields; what it leaves out is logged once per distinct count. Skipped entries
are logged one by one only for the first :data:`MAX_LOGGED_PER_READ` of a read, each once per process
(:class:`_OnceLog` remembers at most :data:`ONCE_LOG_MEMORY` messages), the rest as one count per
distinct number, so a flooded registry cannot flood the log.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import asdict
from typing import Any

import msgpack

from cache_daemon.daemon_config import MAX_REGISTRATIONS_MAX, DatasetSpec, source_allowed
from datacache.config import ConfigError
from datacache.fillstatus import status_store
from datacache.redact import redact

log = logging.getLogger("cache_daemon.registry")
REGISTRY_KEY = b"dcd:datasets"
MAX_ENTRY_BYTES = 8192
MAX_EXAMINED = 4096  # registry fields parsed per read at most (4 x the largest max_registrations)
MAX_LOGGED_PER_READ = 10  # skipped entries logged one by one per read (the first); the rest as a count
ONCE_LOG_MEMORY = 1024  # distinct messages remembered (oldest forgotten first) so each is logged once


class _OnceLog:
    """Log each distinct message once per process, remembering at most ``ONCE_LOG_MEMORY`` of them.

    Thread boundary: the pass thread reads the registry, tests and the HTTP thread may too: a lock."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            while len(self._seen) > ONCE_LOG_MEMORY:
                self._seen.popitem(last=False)
            return True


_once = _OnceLog()


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


def registered(store: Any, allowed_sources: tuple[str, ...], *, strict: bool = False,
               max_registrations: int = MAX_REGISTRATIONS_MAX) -> list[DatasetSpec]:
    """The valid entries under ``allowed_sources``, at most ``max_registrations`` of them (see the module
    docstring). An unreachable registry is an empty list (retried next pass), or with ``strict`` raises: a
    caller that drops datasets missing from the list must not read "unreachable" as "everything was
    deleted"."""
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
    cap = max(0, min(int(max_registrations), MAX_REGISTRATIONS_MAX))
    names = sorted(raw)  # field-name order: every daemon keeps the same entries
    out: list[DatasetSpec] = []
    skipped = examined = 0
    for field_name in names:
        if len(out) >= cap or examined >= MAX_EXAMINED:
            break
        examined += 1
        value = raw[field_name]
        try:
            if len(value) > MAX_ENTRY_BYTES:
                raise ConfigError(f"entry of {len(value)} bytes (more than {MAX_ENTRY_BYTES})")
            spec = DatasetSpec.from_dict(msgpack.unpackb(bytes(value), raw=False), "registry entry")
            if not source_allowed(spec.source, allowed_sources):
                raise ConfigError(f"source {redact(spec.source)!r} is outside this daemon's allowed_sources")
        except (ConfigError, ValueError, TypeError, msgpack.UnpackException) as e:
            skipped += 1
            name, why = field_name[:200], (str(e) or type(e).__name__)[:500]
            # one by one: only the first few of a read (field-name order: the same ones every read), each
            # once per process; the rest go into the count below
            if skipped <= MAX_LOGGED_PER_READ and _once.first_time(f"skip:{name!r}:{why[:200]}"):
                log.warning("skipping registry entry %r: %s", name, why)
            continue
        out.append(spec)
    if skipped > MAX_LOGGED_PER_READ and _once.first_time(f"skipped:{skipped}"):
        log.warning("dataset registry: %d entries skipped as invalid or not allowed here (the first %d "
                    "logged one by one)", skipped, MAX_LOGGED_PER_READ)
    left = len(names) - examined
    if left and _once.first_time(f"over:{left}:{cap}"):
        log.warning("dataset registry %s holds %d entries: %d not used (this daemon keeps at most "
                    "max_registrations = %d valid ones, the first in field-name order, and parses at most "
                    "%d); DELETE /datasets/<id> what is not needed, or find who writes to Redis directly",
                    REGISTRY_KEY.decode(), len(names), left, cap, MAX_EXAMINED)
    return out
