"""Quarantine records: files remembered as undecodable, so a later run or ``datacache warm`` does not
re-read them.

They remember files that could not be *decoded* although their bytes were complete (length equal
to the manifest's size). They are keyed by the variant and the file's identity (path + size + mtime
+ version, :meth:`datacache.manifest.Manifest.identity`), not by the dataset fingerprint: adding an
unrelated file keeps them, and fixing the file (a new size or mtime) clears the verdict. Transient
failures (read errors, short reads, out of memory) are never remembered. The value is a small
msgpack map ``{path, id, reason}``, untrusted input like any cache value: parsed with msgpack only
(small limits), type-checked, and it must name the same path and identity. With a record key
(:class:`~datacache.record.RecordKey`, ``record_key_file``) the map also carries ``mac``, a keyed
BLAKE2b over the storage key, the path, the identity and the reason: a keyed reader ignores an entry
without the right MAC (the sample is then decoded normally and a genuinely bad file's entry is
rewritten); an unkeyed reader (a trainer: only writers can write entries) reads it without checking
the MAC. A writer never trusts an entry it did not verify itself
(:meth:`datacache.readthrough.ReadThrough.trusted_bad`).

Reasons carry no file content (docs/using-the-cache.md "Bad input"): every reason made here or in
:mod:`datacache.decode` / :mod:`datacache.fill` is the exception's *type* and a fixed message (sizes and
the file's relative path at most) -- never ``str(e)`` of a decoder or reader exception, which can quote
the file's bytes (Pillow's "Token too long in file header: ..." does). A reason read back from the
store is passed through :func:`clean_reason` (printable ASCII, bounded), so an entry written by someone
else cannot put control characters or a page of text into a log line.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgpack
import xxhash

from datacache.record import MAC_BYTES, RecordKey
from datacache.source import SourceError
from datacache.source_errors import ConfinementError, NotARegularFile, RedirectRefused, SizeMismatchError

QUARANTINE_PREFIX = "dcq"
MAX_REASON_CHARS = 300
_MAX_VALUE_STR = 8192
_ADVICE = {
    FileNotFoundError: "it does not exist (deleted, moved, or a dangling symlink); restore it or rebuild "
                       "the manifest",
    IsADirectoryError: "it is a directory, not a file; rename or remove it",
    NotADirectoryError: "a component of its path is not a directory; check the dataset layout",
    PermissionError: "permission denied; fix the file permissions or the storage credentials",
    ConfinementError: "outside the allowed sources (a symlink, mount or redirect escapes the dataset root); "
                      "add the directory it really lies in to allowed_sources",
    RedirectRefused: "outside the allowed sources (a symlink, mount or redirect escapes the dataset root); "
                     "add the directory it really lies in to allowed_sources",
    NotARegularFile: "not a regular file (a FIFO, socket or device); remove it from the dataset",
}


def clean_reason(text: str) -> str:
    """``text`` as printable ASCII on one line (anything else becomes ``?``), at most
    :data:`MAX_REASON_CHARS` characters."""
    out = "".join(ch if " " <= ch <= "~" else "?" for ch in str(text)[:MAX_REASON_CHARS])
    return " ".join(out.split()) or "unknown"


def read_failure_reason(err: BaseException) -> str:
    """Quarantine reason for a file the source could not read: the cause's type and a fixed message
    (never the cause's text: a reader's message could quote bytes of the file)."""
    cause: Any = err.cause if isinstance(err, SourceError) else err
    if isinstance(cause, str):  # a cause that could not cross a process boundary (only its repr did)
        return "cannot read the file (an error in another process); check the storage/network health"
    name = type(cause).__name__
    if isinstance(cause, SizeMismatchError):
        return (f"cannot read the file ({name}): it changed since the dataset was listed, or the read was "
                f"cut short (read {int(cause.got)} bytes, the listing says {int(cause.expected)}); re-list "
                "with revalidate='full' to pick up the new version")
    advice = _ADVICE.get(type(cause))  # exact types: a subclass (ConfinementError...) says more by its name
    if advice is not None:
        return f"cannot read the file ({name}): {advice}"
    if isinstance(cause, PermissionError):
        return (f"cannot read the file ({name}): reading it was refused (permissions, or it lies outside "
                "what this process may read)")
    return f"cannot read the file ({name}); check the storage/network health (retried in a later epoch)"


def quarantine_key(variant_tag: str, path: str, identity: str) -> bytes:
    """Key of the remembered verdict for one version of one file (see the module docstring)."""
    digest = xxhash.xxh3_128_hexdigest(f"{path}\x1f{identity}".encode("utf-8", "surrogateescape"))
    return f"{QUARANTINE_PREFIX}:{variant_tag}:{digest}".encode("ascii")


def _mac(record_key: RecordKey, qkey: bytes, path: str, identity: str, reason: str) -> bytes:
    m = record_key.quarantine_mac()
    for part in (bytes(qkey), path.encode("utf-8", "surrogateescape"),
                 identity.encode("utf-8", "surrogateescape"), reason.encode("utf-8", "surrogateescape")):
        m.update(b"%d:" % len(part))
        m.update(part)
    return m.digest()


def quarantine_value(path: str, identity: str, reason: str, *, qkey: bytes = b"",
                     record_key: RecordKey | None = None) -> bytes:
    """The record for an undecodable file stored under ``qkey`` (MAC'd with ``record_key`` if given)."""
    d: dict[str, Any] = {"path": path, "id": identity, "reason": reason}
    if record_key is not None:
        d["mac"] = _mac(record_key, qkey, path, identity, reason)
    return msgpack.packb(d, use_bin_type=True)


def parse_quarantine(value: Any, path: str, identity: str, *, qkey: bytes = b"",
                     record_key: RecordKey | None = None) -> str | None:
    """Reason text from a quarantine record written for this path and identity (and, with
    ``record_key``, MAC'd with it under ``qkey``), else None. Never raises."""
    if value is None:
        return None
    try:
        d = msgpack.unpackb(bytes(value), raw=False, max_str_len=_MAX_VALUE_STR, max_bin_len=MAC_BYTES,
                            max_array_len=0, max_map_len=8, max_ext_len=0)
        fields = set(d) if isinstance(d, dict) else set()
        if not (fields == {"path", "id", "reason", "mac"}
                or (record_key is None and fields == {"path", "id", "reason"})):
            return None
        reason = d["reason"]
        if not isinstance(reason, str) or d["path"] != path or d["id"] != identity:
            return None
        if record_key is not None:
            mac = d["mac"]
            if not (isinstance(mac, bytes) and hmac.compare_digest(mac, _mac(record_key, qkey, path,
                                                                              identity, reason))):
                return None
        return clean_reason(reason)
    except Exception:  # any malformed value (msgpack's own errors, a wrong type) is simply not an entry
        return None
