"""Secrets never printed: the one redaction for every URL, config dump, log line and error.

* :func:`redact` -- one URL (a cache URL, ``::``-chained tiers included, or a dataset source):
  the password of its ``user:password@`` is shown as ``***``, whatever characters it holds
  (``/ , @ : % # ?`` and spaces, percent-encoded or not). The userinfo of a cache URL ends at the
  **last** ``@`` of its tier -- the same split :func:`datacache.stores.redis_common.split_userinfo`
  uses to find the password -- so what is parsed as the password is exactly what is hidden. Source
  URLs (any other scheme) follow RFC 3986: the userinfo lies inside the authority, before the first
  ``/``. The value of every **credential query parameter** (:func:`is_credential_param`: ``password=``,
  ``token=``, ``key=``, Azure SAS ``sig=``, ``X-Amz-*``, GCS ``Signature``/``GoogleAccessId``, ... --
  :data:`CREDENTIAL_PARAMS`) is shown as ``***`` too, its name kept (``?sv=2024&sig=***``), every
  occurrence of it, its name compared case-insensitively after percent-decoding (an array suffix
  ``sig[]`` ignored); an ``=`` written percent-encoded (``?sig%3D...``) and a path's matrix parameter
  (``/list.txt;sig=...``) count too. When in doubt, more is hidden, never less.
* :func:`redact_text` -- free text (an exception message, a log line) that may contain URLs: a cache
  URL's userinfo runs to the last ``@`` of its line (its password may hold spaces), every other
  ``scheme://...`` token is redacted as one URL, a credential parameter after a ``?``, ``&`` or ``;``
  outside a URL (``list.txt?sig=...``, ``?sig%3D...``, or all percent-encoded, once or twice:
  ``%3Fsig%3D...``, ``%253Fsig%253D...``) is masked as in a
  URL, and any known secret
  (:func:`register_secret`) is replaced by ``***`` wherever it appears -- raw, percent-encoded or
  percent-decoded.
* :class:`ScrubFilter` -- a :mod:`logging` filter applying :func:`redact_text` to each record's
  final message (installed on the handlers of the daemon and the CLI): defence in depth for a secret
  that reached a message some other way.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any
from urllib.parse import quote, unquote, unquote_plus

# the cache schemes whose location parser takes userinfo up to the tier's last "@" (a password may hold
# a raw "/", "@" or "?"); every other scheme is a source URL, parsed the RFC 3986 way
CACHE_USERINFO_SCHEMES = frozenset({"redis", "rediss", "redis+cluster"})
_TIER_SPLIT = re.compile(r"::(?=[A-Za-z][A-Za-z0-9+.\-]*://)")
_URL_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_CACHE_URL_START = re.compile(r"(?<![A-Za-z0-9+.\-])(?:rediss?|redis\+cluster)://", re.IGNORECASE)
MASK = "***"

# Query parameters whose VALUE is a credential, compared with the name lower-cased and percent-decoded
# (:func:`is_credential_param`). One list for every place that shows a URL. Kept visible on purpose
# (operators need them, and they grant nothing): Azure SAS ``sv`` (version), ``se``/``st`` (expiry,
# start), ``sp`` (permissions), ``sr``/``ss``/``srt``/``spr``; CloudFront ``Expires``/``Policy``; every
# option of a cache URL (``password_file``, ``ssl_keyfile`` are paths, not secrets).
CREDENTIAL_PARAMS = frozenset({
    "password", "passwd", "pass", "pwd", "passphrase",
    "secret", "client_secret", "token", "access_token", "refresh_token", "id_token", "auth", "authorization",
    "key", "api_key", "apikey", "access_key", "accesskey", "secret_key", "private_key", "account_key",
    "sig", "signature", "credential", "credentials", "jwt", "session", "sessionid", "session_id",
    "sas", "sas_token", "code_verifier",
    "googleaccessid",  # GCS V2 signed URL (with Signature=)
    "awsaccesskeyid",  # S3 SigV2 presigned URL (with Signature=)
    "key-pair-id",  # CloudFront signed URL (with Signature=)
})
# any name ending so (``x-amz-security-token``, ``client_secret``, ``subscription-key``, ``db_password``)
CREDENTIAL_PARAM_SUFFIXES = ("password", "passwd", "secret", "token", "key", "signature", "credential",
                             "credentials", "sessionid", "session_id")
# any name starting so: S3 SigV4 (X-Amz-Signature, -Credential, -Security-Token...) and GCS V4 presigned
# URLs, all of their parameters (the non-secret ones too: simpler than a list that must stay complete)
CREDENTIAL_PARAM_PREFIXES = ("x-amz-", "x-goog-")
_MAX_DECODE = 4  # percent-decoding rounds for a parameter name (a double-encoded name still matches)
# a query percent-encoded as a whole (a URL inside a logged request path): %3F/%26/%3B name %3D value
_ENC_PARAM = re.compile(r"(?i)(?<=%3F|%26|%3B)((?:[A-Za-z0-9_.~+\-]|%(?!3D|26|3F)[0-9A-F]{2}){1,200})%3D"
                        r"((?:(?!%26)[^&\s'\"<>])*)")
# the same, encoded twice (a URL-quoted id quoted again by a client): %253F/%2526/%253B name %253D value
_ENC2_PARAM = re.compile(r"(?i)(?<=%253F|%2526|%253B)"
                         r"((?:[A-Za-z0-9_.~+\-]|%25(?!3D|26|3F)[0-9A-F]{2}){1,200})%253D((?:(?!%2526)[^&\s'\"<>])*)")
# an "=" percent-encoded inside a query piece (``?sig%3DSECRET``): what follows it is hidden when the name
# before it is a credential's (a server may decode the piece before splitting it)
_ENC_EQ = re.compile(r"(?i)%(?:25)*3D")
# a PHP/Rails-style array or map suffix of a parameter name: ``sig[]``, ``token[0]``
_NAME_SUFFIX = re.compile(r"(?:\[[^\]]*\])+$")
# a path's matrix parameter (``/list.txt;sig=...``), masked like a query parameter; its value runs to the
# next ";" or the query (a "/" in a raw signature does not end it: more hidden, never less)
_PATH_PARAM = re.compile(r";([^;=/?#]{1,200})=([^;?#]*)")
# outside a URL: [?&;]name=value, the value up to the next "&", space, quote or angle bracket
_FREE_PARAM = re.compile(r"(?<=[?&;])([^=&;?\s'\"<>#]{1,200})=([^&\s'\"<>]*)")
# outside a URL, its "=" percent-encoded: [?&;]name%3Dvalue (or %253D...)
_FREE_ENC_EQ = re.compile(r"(?i)(?<=[?&;])((?:[^=&;?\s'\"<>#%]|%(?!(?:25)*3D)[0-9A-F]{2}){1,200})"
                          r"(%(?:25)*3D)([^&\s'\"<>]*)")

_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
# shorter "secrets" would mask ordinary words in every log line of the process (and a password that short
# is no secret anyway); they are still hidden wherever they sit in a URL (redact)
MIN_SECRET_LEN = 8


def _param_name(raw: str) -> str:
    """A query parameter's name as a server would read it: percent-decoded (``+`` = space; repeatedly,
    so a double-encoded name matches too), stripped, lower-cased."""
    name = raw
    for _ in range(_MAX_DECODE):
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return _NAME_SUFFIX.sub("", name.strip()).strip().lower()


def is_credential_param(name: str) -> bool:
    """Is ``name`` (as written in a URL: percent-encoded or not, any case) a query parameter whose value
    is a credential? :data:`CREDENTIAL_PARAMS`, or a name with a suffix of
    :data:`CREDENTIAL_PARAM_SUFFIXES` or a prefix of :data:`CREDENTIAL_PARAM_PREFIXES`."""
    n = _param_name(name)
    return (n in CREDENTIAL_PARAMS or n.endswith(CREDENTIAL_PARAM_SUFFIXES)
            or n.startswith(CREDENTIAL_PARAM_PREFIXES))


def _redact_pair(pair: str) -> str:
    """One ``&``-separated piece of a query: the value of a credential parameter masked. A value runs to
    the next ``&`` (how the cache URL parser and most servers split); a ``;`` inside it may separate
    parameters for some servers, so a credential name after a ``;`` masks the rest of the piece too."""
    name, eq, _ = pair.partition("=")
    if eq and is_credential_param(name):
        return f"{name}={MASK}"
    enc = _ENC_EQ.search(name)  # "sig%3DSECRET": the "=" percent-encoded
    if enc and is_credential_param(name[:enc.start()]):
        return f"{name[:enc.end()]}{MASK}"
    head, *more = pair.split(";")
    for i, sub in enumerate(more):
        sub_name, sub_eq, _ = sub.partition("=")
        if sub_eq and is_credential_param(sub_name):
            return ";".join([head, *more[:i], f"{sub_name}={MASK}"])
    return pair


def redact_query(query: str) -> str:
    """A query string (what follows the ``?``, without it) with every credential parameter's value shown
    as ``***`` (names kept, every occurrence, nothing else changed)."""
    if "=" not in query and "%" not in query:  # ("%": an "=" percent-encoded, ?sig%3D...)
        return query
    return "&".join(_redact_pair(p) for p in query.split("&"))


def _redact_tail(tail: str) -> str:
    """The part of a URL after its userinfo: its query (from the first ``?``, fragment included --
    more is hidden, never less) with the credential parameters masked."""
    path, q, query = tail.partition("?")
    if ";" in path:  # matrix parameters: /list.txt;sig=...
        path = _PATH_PARAM.sub(lambda m: f";{m.group(1)}={MASK}" if is_credential_param(m.group(1))
                               else m.group(0), path)
    return f"{path}?{redact_query(query)}" if q else path


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
        return f"{scheme}://{_redact_tail(rest)}"
    user, colon, _ = info.partition(":")
    if not colon:  # a user name alone (the password comes from a file, or there is none)
        return f"{scheme}://{info}@{_redact_tail(tail)}"
    return f"{scheme}://{user}:{MASK}@{_redact_tail(tail)}"


def redact(url: str) -> str:
    """``redis://user:secret@h:1`` -> ``redis://user:***@h:1``, ``https://h/l.txt?sv=1&sig=S`` ->
    ``https://h/l.txt?sv=1&sig=***``; every tier of a ``::`` chain; idempotent. Text without
    ``scheme://`` (a local path) is returned unchanged."""
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
    out = _FREE_PARAM.sub(lambda m: f"{m.group(1)}={MASK}" if is_credential_param(m.group(1)) else m.group(0),
                          out)
    if "%" in out:
        out = _FREE_ENC_EQ.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}" if is_credential_param(m.group(1))
                               else m.group(0), out)
        out = _ENC_PARAM.sub(lambda m: f"{m.group(1)}%3D{MASK}" if is_credential_param(m.group(1))
                             else m.group(0), out)
        out = _ENC2_PARAM.sub(lambda m: f"{m.group(1)}%253D{MASK}" if is_credential_param(m.group(1))
                              else m.group(0), out)
    with _SECRETS_LOCK:
        known = sorted(_SECRETS, key=len, reverse=True)  # longest first: a secret containing another
    for s in known:
        if s in out:
            out = out.replace(s, MASK)
    return out


def redact_json(obj: Any, _depth: int = 0) -> Any:
    """``obj`` (JSON-like: dicts, lists, tuples, strings, numbers) with :func:`redact_text` applied to every
    string, keys included: what an HTTP endpoint answers, whatever put a URL into it. A new object; the
    input is not changed. Anything nested deeper than 64 levels is shown as ``***`` (the daemon's JSON is a
    few levels deep; more is hidden, never less)."""
    if isinstance(obj, str):
        return redact_text(obj)
    if _depth > 64:
        return MASK
    if isinstance(obj, dict):
        return {redact_json(k, _depth + 1): redact_json(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_json(v, _depth + 1) for v in obj]
    return obj


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
