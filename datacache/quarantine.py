"""Quarantine records: files remembered as undecodable, so a later run or ``datacache warm`` does not
re-read them.

They remember files that could not be *decoded* although their bytes were complete (length equal
to the manifest's size). They are keyed by the variant and the file's identity (path + size + mtime
+ version, :meth:`datacache.manifest.Manifest.identity`), not by the dataset fingerprint: adding an
unrelated file keeps them, and fixing the file (a new size or mtime) clears the verdict. Transient
failures (read errors, short reads, out of memory) are never remembered. The value is a small
msgpack map ``{path, id, reason}``, untrusted input like any cache value: parsed with msgpack only,
type-checked, and it must name the same path and identity.
"""

from __future__ import annotations

from typing import Any

import msgpack
import xxhash

from datacache.source import SourceError

QUARANTINE_PREFIX = "dcq"


def read_failure_reason(err: BaseException) -> str:
    """Quarantine reason for a file the source could not read (names the underlying cause)."""
    cause = err.cause if isinstance(err, SourceError) else err
    return f"cannot read the file: {cause}"


def quarantine_key(variant_tag: str, path: str, identity: str) -> bytes:
    """Key of the remembered verdict for one version of one file (see the module docstring)."""
    digest = xxhash.xxh3_128_hexdigest(f"{path}\x1f{identity}".encode("utf-8", "surrogateescape"))
    return f"{QUARANTINE_PREFIX}:{variant_tag}:{digest}".encode("ascii")


def quarantine_value(path: str, identity: str, reason: str) -> bytes:
    """The record for an undecodable file."""
    return msgpack.packb({"path": path, "id": identity, "reason": reason})


def parse_quarantine(value: Any, path: str, identity: str) -> str | None:
    """Reason text from a quarantine record written for this path and identity, else None."""
    if value is None:
        return None
    try:
        d = msgpack.unpackb(bytes(value), raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if (isinstance(d, dict) and isinstance(d.get("reason"), str) and d.get("path") == path
            and d.get("id") == identity):
        return d["reason"]
    return None
