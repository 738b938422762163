"""Fill reports of the cache daemons, kept in Redis next to the samples.

Each daemon reports, per dataset and variant, one field of the hash ``dcd:fill:{fingerprint}:{variant}``
(no ``{}`` in the real key: it is ``dcd:fill:<16 hex>:<tag>``): field = the daemon's node name, value =
a small msgpack map ``{owned, done, quarantined, total, rate, updated}`` -- how many samples this node
owns, how many of them are cached (or known bad), the dataset size, its fill rate in samples/s and a
unix time. Clients (``CachedImageNet.wait_warm``), ``/status`` and ``datacache stats`` read the hash.

A dataset is **full** when the owned shares add up to the dataset (every sample has a reporting owner)
and every node has done what it owns. Values are untrusted input: parsed with msgpack only and
type-checked; a malformed field is ignored (as if that node had not reported).
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from datacache.config import ConfigError

STATUS_PREFIX = "dcd"
_FIELDS = ("owned", "done", "quarantined", "total")


def status_key(fingerprint: str, variant_tag: str) -> bytes:
    return f"{STATUS_PREFIX}:fill:{fingerprint}:{variant_tag}".encode("ascii")


def status_store(store: Any) -> Any:
    """The tier of ``store`` that can hold fill reports (the first Redis tier); ConfigError if none."""
    for tier in getattr(store, "tiers", [store]):
        if hasattr(tier, "status_get"):
            return tier
    raise ConfigError(f"cache {store.url} has no Redis tier: cache daemons report their fill in Redis "
                      "(use a redis:// or redis+cluster:// cache, alone or chained: lmdb:///x::redis+cluster://...)")


def report_fill(store: Any, fingerprint: str, variant_tag: str, node: str, *, owned: int, done: int,
                quarantined: int, total: int, rate: float) -> None:
    """Write this node's report (overwrites its previous one)."""
    value = msgpack.packb({"owned": int(owned), "done": int(done), "quarantined": int(quarantined),
                           "total": int(total), "rate": float(rate), "updated": time.time()})
    status_store(store).status_set(status_key(fingerprint, variant_tag), node, value)


def read_fill(store: Any, fingerprint: str, variant_tag: str) -> dict[str, dict[str, Any]]:
    """node -> report, malformed reports left out."""
    raw = status_store(store).status_get(status_key(fingerprint, variant_tag))
    out: dict[str, dict[str, Any]] = {}
    for node, value in raw.items():
        try:
            d = msgpack.unpackb(bytes(value), raw=False)
        except (ValueError, msgpack.UnpackException):
            continue
        if isinstance(d, dict) and all(isinstance(d.get(f), int) and d[f] >= 0 for f in _FIELDS):
            name = node.decode("utf-8", "replace") if isinstance(node, bytes) else str(node)
            out[name] = d
    return out


def summarize(reports: dict[str, dict[str, Any]], total: int) -> dict[str, Any]:
    """Totals over the nodes and whether the dataset is full (see the module docstring)."""
    owned = sum(r["owned"] for r in reports.values())
    done = sum(min(r["done"], r["owned"]) for r in reports.values())
    return {"total": total, "owned": owned, "done": done, "fraction": done / total if total else 1.0,
            "full": owned >= total and done >= total, "nodes": reports}


def wait_until_warm(store: Any, fingerprint: str, variant_tag: str, total: int, *, timeout: float | None,
                    poll: float = 0.5) -> dict[str, Any]:
    """Poll the reports until the dataset is full; TimeoutError (with the last summary) after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            reports = read_fill(store, fingerprint, variant_tag)
        except ConfigError:
            raise
        except Exception:  # Redis unreachable right now: no reports yet, keep polling
            reports = {}
        summary = summarize(reports, total)
        if summary["full"]:
            return summary
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"dataset {fingerprint}/{variant_tag} not warm after {timeout} s: "
                               f"{summary['done']}/{total} cached by {len(summary['nodes'])} reporting "
                               "daemons "
                               f"(owned shares cover {summary['owned']}/{total})")
        time.sleep(poll)
