"""Cache keys: ``{prefix}:{fingerprint}:{variant_tag}:{index}`` as ASCII bytes.

* ``prefix`` namespaces the cache (default ``dc``) so several caches can share a Redis.
* ``fingerprint`` is the manifest fingerprint (16 hex chars): any change to the listing
  (a file added, removed, resized or touched) changes every key, so stale samples are
  never served — they simply become unreachable and age out (LRU in Redis).
* ``variant_tag`` is :meth:`datacache.config.Variant.tag`.
* ``index`` is the sample's position in the manifest.

Keys are short (~40 bytes) because Redis and LMDB pay per key byte; the fields never
contain ``:`` (the fingerprint is hex, tags are ``[a-z0-9-]``), so parsing is unambiguous.
"""

from __future__ import annotations


def sample_key(fingerprint: str, variant_tag: str, index: int, prefix: str = "dc") -> bytes:
    """Key of sample ``index`` of the dataset with ``fingerprint`` in variant ``variant_tag``."""
    for name, part in (("prefix", prefix), ("fingerprint", fingerprint), ("variant_tag", variant_tag)):
        if not part or ":" in part:
            raise ValueError(f"sample_key: {name}={part!r} must be non-empty and contain no ':'")
    if index < 0:
        raise ValueError(f"sample_key: index must be >= 0, got {index}")
    return f"{prefix}:{fingerprint}:{variant_tag}:{int(index)}".encode("ascii")


def parse_key(key: bytes | str) -> tuple[str, str, str, int]:
    """Inverse of :func:`sample_key`: ``(prefix, fingerprint, variant_tag, index)``."""
    text = bytes(key).decode("ascii") if isinstance(key, (bytes, bytearray, memoryview)) else key
    parts = text.split(":")
    if len(parts) != 4 or not parts[3].isdigit():
        raise ValueError(f"not a datacache sample key: {text!r} (expected prefix:fingerprint:variant:index)")
    return parts[0], parts[1], parts[2], int(parts[3])
