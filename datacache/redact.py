"""Secrets never printed: the one redaction for every URL, config dump, log line and error.

* :func:`redact` -- one URL (a cache URL, ``::``-chained tiers included, or a dataset source):
  the password of its ``user:password@`` is shown as ``***``, whatever characters it holds
  (``/ , @ : % # ?`` and spaces, percent-encoded or not). The userinfo of a cache URL ends at the
  **last** ``@`` of its tier -- the same split :func:`datacache.stores.redis_common.split_userinfo`
  uses to find the password -- so what is parsed as the password is exactly what is hidden. Source
  URLs (any other scheme) follow RFC 3986: the userinfo lies inside the authority, before the first
  ``/``. When in doubt, more is hidden, never less.
* :func:`redact_text` -- free text (an exception message, a log line) that may contain URLs: a cache
  URL's userinfo runs to the last ``@`` of its line (its password may hold spaces), every other
  ``scheme://...`` token is redacted as one URL, and any known secret (:func:`register_secret`) is
  replaced by ``***`` wherever it appears -- raw, percent-encoded or percent-decoded.
* :class:`ScrubFilter` -- a :mod:`logging` filter applying :func:`redact_text` to each record's
  final message (installed on the handlers of the daemon and the CLI): defence in depth for a secret
  that reached a message some other way.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import quote, unquote

# the cache schemes whose location parser takes userinfo up to the tier's last "@" (a password may hold
# a raw "/", "@" or "?"); every other scheme is a source URL, parsed the RFC 3986 way
CACHE_USERINFO_SCHEMES = frozenset({"redis", "rediss", "redis+cluster"})
_TIER_SPLIT = re.compile(r"::(?=[A-Za-z][A-Za-z0-9+.\-]*://)")
_URL_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_CACHE_URL_START = re.compile(r"(?<![A-Za-z0-9+.\-])(?:rediss?|redis\+cluster)://", re.IGNORECASE)
MASK = "***"

_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
# shorter "secrets" would mask ordinary words in every log line of the process (and a password that short
# is no secret anyway); they are still hidden wherever they sit in a URL (redact)
MIN_SECRET_LEN = 8


def _redact_tier(tier: str) -> str:
    scheme, sep, rest = tier.partition("://")
    if not sep:
        return tier
    if scheme.lower() in CACHE_USERINFO_SCHEMES:
        info, at, tail = rest.rpartition("@")
    else:  # RFC 3986: the authority ends at the first "/", "?" or "#"; its userinfo at its last "@"
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        info, at, host = rest[:end].rpartition("@")
        tail = host + rest[end:]
    if not at:
        return tier
    user, colon, _ = info.partition(":")
    if not colon:  # a user name alone (the password comes from a file, or there is none)
        return tier
    return f"{scheme}://{user}:{MASK}@{tail}"


def redact(url: str) -> str:
    """``redis://user:secret@h:1`` -> ``redis://user:***@h:1``; every tier of a ``::`` chain; idempotent.
    Text without ``scheme://`` (a local path) is returned unchanged."""
    if not isinstance(url, str):
        return url
    return "::".join(_redact_tier(t) for t in _TIER_SPLIT.split(url))


def register_secret(secret: str | bytes | None) -> None:
    """Remember ``secret`` (a password, a token) so :func:`redact_text` masks it wherever it appears."""
    if not secret:
        return
    text = secret.decode("utf-8", "replace") if isinstance(secret, bytes) else str(secret)
    forms = {text, quote(text, safe=""), quote(text, safe="/"), unquote(text)}
    with _SECRETS_LOCK:
        _SECRETS.update(f for f in forms if len(f) >= MIN_SECRET_LEN)


def _redact_cache_urls_in_line(line: str) -> str:
    """Free text: a cache URL's password may hold spaces, so its userinfo runs to the LAST ``@`` of the
    line (more is hidden when an ``@`` follows later on the line, never less)."""
    out, pos = [], 0
    for m in _CACHE_URL_START.finditer(line):
        if m.start() < pos:
            continue
        at = line.rfind("@", m.end())
        colon = line.find(":", m.end(), at) if at >= 0 else -1
        if colon < 0:
            continue
        out.append(line[pos:colon + 1] + MASK)
        pos = at
    return "".join(out) + line[pos:]


def redact_text(text: str) -> str:
    """Free text with every URL redacted and every registered secret masked (see the module docstring)."""
    if not isinstance(text, str) or not text:
        return text
    out = "\n".join(_redact_cache_urls_in_line(line) for line in text.split("\n"))
    out = _URL_TOKEN.sub(lambda m: redact(m.group(0)), out)
    with _SECRETS_LOCK:
        known = sorted(_SECRETS, key=len, reverse=True)  # longest first: a secret containing another
    for s in known:
        if s in out:
            out = out.replace(s, MASK)
    return out


class ScrubFilter(logging.Filter):
    """Masks URLs' passwords and registered secrets in every record it sees (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error path
            return True
        clean = redact_text(msg)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


def install_scrub_filter(logger: logging.Logger | None = None) -> None:
    """Add one :class:`ScrubFilter` to every handler of ``logger`` (default: the root logger)."""
    for h in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, ScrubFilter) for f in h.filters):
            h.addFilter(ScrubFilter())
