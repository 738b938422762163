"""Fill reports of the cache daemons, kept in Redis next to the samples.

Each daemon reports, per dataset and variant, one field of the hash ``dcd:fill:{fingerprint}:{variant}``
(no ``{}`` in the real key: it is ``dcd:fill:<16 hex>:<tag>``): field = the daemon's node name, value =
a small msgpack map ``{owned, done, quarantined, total, rate, updated}`` -- how many samples this node
owns, how many of them are cached (or known bad), the dataset size, its fill rate in samples/s and a
unix time. Clients (``CachedImageNet.wait_warm``), ``/status`` and ``datacache stats`` read the hash.

A dataset is **full** when the owned shares add up to the dataset (every sample has a reporting owner)
and every node has done what it owns. Values are untrusted input (only the daemons' Redis role may write
them, but a forged one must not reach ``/status`` whole): parsed with msgpack only, and :func:`read_fill`
builds a NEW dict of the known fields -- counts are ints in ``0..MAX_COUNT``, ``rate`` and ``updated``
finite floats >= 0 -- from at most :data:`MAX_REPORTS` reports (field-name order) whose node name has at
most :data:`MAX_NODE_NAME` bytes and whose value at most :data:`MAX_REPORT_BYTES`; everything else is
ignored (as if that node had not reported). So what a reader returns is bounded (about 200 bytes of
JSON per node) whatever the hash holds.

Reports can be stale: a master restarted empty loses its keys but not the reports (they may live on
another master). So a summary also carries the age of the oldest report, and ``wait_until_warm``
checks the reports against the cache itself: ``EXISTS`` of a random sample of the dataset's keys
(:func:`sample_missing`; 256 keys, one pipelined round trip per master, however big the dataset is).
A sampled key that is neither cached nor quarantined means "not full". A master that lost a third of
the keys is missed by 256 samples with probability (2/3)^256, i.e. never; a handful of lost keys
may go unnoticed (they are decoded on their next miss).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from datacache.config import ConfigError

STATUS_PREFIX = "dcd"
_FIELDS = ("owned", "done", "quarantined", "total")
_FLOATS = ("rate", "updated")
MAX_REPORTS = 1024  # reports considered per dataset (a Redis Cluster has at most ~1000 masters)
MAX_NODE_NAME = 200  # bytes of a node name (the daemon config refuses longer names)
MAX_REPORT_BYTES = 1024  # a real report packs to ~90 bytes
MAX_COUNT = 2**40  # samples per dataset, far above any real one (ImageNet-22k: 1.4e7)


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
    """node -> report ``{owned, done, quarantined, total[, rate, updated]}``, built anew from the known
    fields only; malformed, oversized and surplus reports left out (see the module docstring)."""
    raw = status_store(store).status_get(status_key(fingerprint, variant_tag))
    out: dict[str, dict[str, Any]] = {}
    for node in sorted(raw):  # field-name order: the same reports are kept on every read
        if len(out) >= MAX_REPORTS:
            break
        if len(node) > MAX_NODE_NAME:
            continue
        report = _parse_report(raw[node])
        if report is None:
            continue
        name = node.decode("utf-8", "replace") if isinstance(node, (bytes, bytearray)) else str(node)
        out[name] = report
    return out


def _parse_report(value: Any) -> dict[str, Any] | None:
    """A new dict of a report's known fields, or None when it is not a well-formed report."""
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) > MAX_REPORT_BYTES:
        return None  # never unpack what no daemon wrote (checked before parsing)
    try:
        d = msgpack.unpackb(bytes(value), raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(d, dict):
        return None
    report: dict[str, Any] = {}
    for f in _FIELDS:
        v = d.get(f)
        if type(v) is not int or not 0 <= v <= MAX_COUNT:  # type(): a bool is not a count
            return None
        report[f] = v
    for f in _FLOATS:
        if f not in d:
            continue  # optional (older reports)
        v = d[f]
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            return None
        report[f] = float(v)
    return report


SAMPLE_KEYS = 256


def sample_missing(store: Any, total: int, key_of: Callable[[Sequence[int]], list[bytes]],
                   qkey_of: Callable[[Sequence[int]], list[bytes]],
                   known_bad: Callable[[int, Any], Any] | None = None,
                   n: int = SAMPLE_KEYS) -> dict[str, int]:
    """``EXISTS`` of ``n`` random samples in the status tier of ``store``, then, for the absent ones,
    their quarantine entries: ``{"checked", "missing"}``. With ``known_bad(index, value)`` (the reader's
    :meth:`~datacache.readthrough.ReadThrough.parse_known_bad`) an entry counts only when it is valid
    for that file (and MAC'd, with a record key): a forged entry does not make a sample "present".
    Without it, existence is enough. A tier that cannot be read counts its keys as missing."""
    tier = status_store(store)
    idx = sorted(random.sample(range(total), min(n, total))) if total else []
    have = tier.contains(key_of(idx)) if idx else []
    absent = [i for i, h in zip(idx, have) if not h]
    if not absent:
        bad: list[bool] = []
    elif known_bad is None:
        bad = list(tier.contains(qkey_of(absent)))
    else:
        bad = [known_bad(i, v) is not None for i, v in zip(absent, tier.get_many(qkey_of(absent)))]
    return {"checked": len(idx), "missing": sum(1 for b in bad if not b)}


def summarize(reports: dict[str, dict[str, Any]], total: int,
              verified: dict[str, int] | None = None) -> dict[str, Any]:
    """Totals over the nodes, the age of the oldest report (seconds, None without reports) and whether
    the dataset is full (see the module docstring); ``verified`` (:func:`sample_missing`), when given,
    must have found no missing key for the dataset to count as full."""
    owned = sum(r["owned"] for r in reports.values())
    done = sum(min(r["done"], r["owned"]) for r in reports.values())
    stamps = [r.get("updated") for r in reports.values()]
    ages = [max(0.0, time.time() - float(s)) for s in stamps if isinstance(s, (int, float))]
    full = owned >= total and done >= total
    out: dict[str, Any] = {"total": total, "owned": owned, "done": done,
                           "fraction": done / total if total else 1.0, "full": full,
                           "oldest_report_s": round(max(ages), 1) if ages else None, "nodes": reports}
    if verified is not None:
        out["verified"] = verified
        if verified["checked"] and verified["missing"]:
            # the reports are stale (e.g. a master restarted empty): estimate from the sample instead
            out["full"] = False
            out["fraction"] = min(out["fraction"], 1.0 - verified["missing"] / verified["checked"])
    return out


def wait_until_warm(store: Any, fingerprint: str, variant_tag: str, total: int, *, timeout: float | None,
                    poll: float = 0.5,
                    verify: Callable[[], dict[str, int]] | None = None) -> dict[str, Any]:
    """Poll the reports until the dataset is full; TimeoutError (with the last summary) after ``timeout``.
    ``verify`` (e.g. :func:`sample_missing` bound to the dataset's keys) is asked once the reports say
    full; the dataset is full only when it finds nothing missing."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            reports = read_fill(store, fingerprint, variant_tag)
        except ConfigError:
            raise
        except Exception:  # Redis unreachable right now: no reports yet, keep polling
            reports = {}
        summary = summarize(reports, total)
        if summary["full"] and verify is not None:
            summary = summarize(reports, total, verify())
        if summary["full"]:
            return summary
        if deadline is not None and time.monotonic() >= deadline:
            ver = summary.get("verified") or {}
            stale = (f"; but {ver['missing']} of {ver['checked']} sampled keys are not in the cache "
                     "(the reports are stale: a node lost its keys?)" if ver.get("missing") else "")
            raise TimeoutError(f"dataset {fingerprint}/{variant_tag} not warm after {timeout} s: "
                               f"{summary['done']}/{total} cached by {len(summary['nodes'])} reporting "
                               "daemons "
                               f"(owned shares cover {summary['owned']}/{total}){stale}")
        time.sleep(poll)
