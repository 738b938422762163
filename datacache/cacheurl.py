"""Cache URLs: the one parser for every place that names a cache.

``CachedImageNet(cache=...)``, ``datacache warm/demo/stats --cache`` and :func:`datacache.stores.open_store`
all go through :func:`parse_cache_url`, which runs where the URL is given (the parent process,
at construction), so a bad URL is reported there and never inside a DataLoader worker.

Grammar::

    cache  = tier ["::" tier ...]                      (fsspec-style chaining of tiers)
    tier   = scheme "://" location ["?" option "=" value ("&" option "=" value)*]

* ``scheme`` must be known: the built-ins (``lmdb``, ``memory``, ``redis``, ``rediss``,
  ``redis+cluster``) are a string table (:data:`KNOWN_SCHEMES`: scheme -> the module that registers
  it, :mod:`datacache.stores.schemes`, imported on first use, as fsspec's ``known_implementations``),
  so this module imports no store; others come from :func:`register_scheme`.
* ``location`` is normalised by the scheme: for ``lmdb`` a directory, ``~`` expanded and made
  absolute (relative to the parent's working directory, so workers with another cwd agree).
* options are typed (:class:`OptionSpec`): ``int``, ``bytes`` (an int or ``512MiB``, ``4GiB``,
  ``2G`` ...), ``bool`` (``1/0/true/false/yes/no/on/off``) or ``str``. An unknown, repeated or
  malformed option is a :class:`~datacache.config.ConfigError` naming it and listing the valid ones.
* several tiers (``lmdb:///local::redis+cluster://h:7000``) are parsed tier by tier, nearest
  first (at most :data:`MAX_TIERS`); :func:`datacache.stores.open_store` -- the one way to open a
  cache -- opens them as one :class:`~datacache.tiered.TieredStore`.
* a password in a location (``redis://user:secret@host:6379``, any character: the userinfo ends at
  the tier's last ``@``) is kept for opening the store but shown as ``***`` in :attr:`StoreSpec.url` /
  :attr:`CacheSpec.url` (what logs, ``repr`` and ``stats()`` show) and in every error message
  (:func:`datacache.redact.redact`); :attr:`CacheSpec.secret_url` is the full text. Better still,
  ``?password_file=`` keeps it out of the URL.

The result is a small frozen, picklable :class:`CacheSpec` (a tuple of :class:`StoreSpec`), which
travels to workers instead of the string: they never re-parse.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode

from datacache.config import ConfigError
from datacache.options import parse_bool, parse_size
from datacache.redact import CACHE_USERINFO_SCHEMES, is_credential_param, redact

__all__ = ["KNOWN_SCHEMES", "MAX_TIERS", "CacheSpec", "OptionSpec", "SchemeSpec", "StoreSpec", "parse_bytes",
           "parse_cache_url", "parse_tier", "redact", "register_scheme", "scheme_spec", "schemes"]

MAX_TIERS = 4


@dataclass(frozen=True)
class OptionSpec:
    """One ``?name=value`` option of a scheme: its kind, an optional minimum and a help text.
    ``positive`` (floats): the value must be > 0 and at most ``maximum`` (a timeout of 0 or -1
    would mean "never wait" or "wait forever" to redis-py, neither of which a cache may do)."""

    kind: str
    doc: str = ""
    minimum: int | None = None
    positive: bool = False
    maximum: float | None = None

    def coerce(self, name: str, text: str, url: str) -> Any:
        """``text`` as this option's type; ConfigError naming the option and the accepted forms."""
        if self.kind == "bool":
            return parse_bool(text, f"{url}: option {name}")
        if self.kind == "str":
            return text
        if self.kind == "float":
            value: Any = _parse_float(text)
        else:
            value = parse_bytes(text) if self.kind == "bytes" else _parse_int(text)
        if value is None:
            what = {"bytes": "a byte size such as 4294967296, 512MiB or 4GiB", "float": "a number such as 0.5"
                    }.get(self.kind, "an integer")
            raise ConfigError(f"{url}: option {name}={text!r} is not {what}")
        if self.minimum is not None and value < self.minimum:
            raise ConfigError(f"{url}: option {name}={value} must be >= {self.minimum}")
        too_big = self.maximum is not None and value > self.maximum
        if self.positive and (not value > 0 or too_big):
            top = f" and <= {self.maximum:g}" if self.maximum is not None else ""
            raise ConfigError(f"{url}: option {name}={text!r} is out of range; it must be > 0{top} "
                              "(seconds, e.g. 2)")
        if too_big:
            raise ConfigError(f"{url}: option {name}={value} must be <= {self.maximum:g}")
        return value


def _parse_float(text: str) -> float | None:
    t = text.strip()
    return float(t) if re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)", t) else None


def _parse_int(text: str) -> int | None:
    t = text.strip()
    return int(t) if re.fullmatch(r"[+-]?\d+", t) else None


def parse_bytes(text: str) -> int | None:
    """``"4GiB"`` -> 4294967296, ``"512M"`` -> 512000000, ``"123"`` -> 123; None if not a size
    (:func:`datacache.options.parse_size`)."""
    return parse_size(text)


@dataclass(frozen=True)
class SchemeSpec:
    """A registered cache scheme: its options, how to normalise a location, how to check and open it.

    ``location(raw, url) -> str`` normalises (and validates) the part between ``://`` and ``?``;
    ``check(spec)`` verifies the environment (e.g. that an LMDB directory is on a local disk) and
    runs where the URL is parsed with ``check=True``; ``factory(spec) -> Store`` opens the store.
    """

    name: str
    factory: Callable[[StoreSpec], Any]
    options: Mapping[str, OptionSpec] = field(default_factory=dict)
    location: Callable[[str, str], str] | None = None
    check: Callable[[StoreSpec], None] | None = None


@dataclass(frozen=True)
class StoreSpec:
    """One parsed tier: scheme, normalised location and typed options (sorted by name)."""

    scheme: str
    location: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def secret_url(self) -> str:
        """Canonical URL including any password (to re-open the store; never logged)."""
        query = urlencode([(k, int(v) if isinstance(v, bool) else v) for k, v in self.options])
        return f"{self.scheme}://{self.location}" + (f"?{query}" if query else "")

    @property
    def url(self) -> str:
        """Canonical URL, e.g. ``lmdb:///abs/dir?readonly=1``, password shown as ``***`` (what logs and
        ``stats()`` show)."""
        return redact(self.secret_url)

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def option(self, name: str, default: Any = None) -> Any:
        return self.opts.get(name, default)



@dataclass(frozen=True)
class CacheSpec:
    """A parsed cache URL: the URL as given and its tiers, nearest first."""

    given: str
    tiers: tuple[StoreSpec, ...]

    @property
    def store(self) -> StoreSpec:
        """The nearest tier (for code that needs one location, e.g. where manifests are kept)."""
        return self.tiers[0]

    @property
    def url(self) -> str:
        """Canonical URL of the chain, passwords shown as ``***``."""
        return "::".join(t.url for t in self.tiers)

    @property
    def secret_url(self) -> str:
        return "::".join(t.secret_url for t in self.tiers)


_SCHEMES: dict[str, SchemeSpec] = {}
# Built-in schemes by name -> the module that registers them, imported on first use (as fsspec's
# known_implementations): this module never imports the stores, so there is no import cycle.
KNOWN_SCHEMES: dict[str, str] = dict.fromkeys(("memory", "lmdb", "redis", "rediss", "redis+cluster"),
                                              "datacache.stores.schemes")


def register_scheme(spec: SchemeSpec) -> None:
    """Add (or replace) a cache scheme (the built-ins register themselves from :data:`KNOWN_SCHEMES`)."""
    _SCHEMES[spec.name] = spec


def schemes() -> list[str]:
    """Scheme names: the built-ins and any registered since."""
    return sorted(set(KNOWN_SCHEMES) | set(_SCHEMES))


def _valid_schemes() -> str:
    return ", ".join(f"{s}://" for s in schemes())


def scheme_spec(name: str, url: str = "") -> SchemeSpec:
    """The :class:`SchemeSpec` of ``name`` (a built-in's module is imported on first use); ConfigError
    listing the valid schemes for an unknown one (``url``: the redacted URL, for the message)."""
    spec = _SCHEMES.get(name)
    if spec is None and name in KNOWN_SCHEMES:
        importlib.import_module(KNOWN_SCHEMES[name])
        spec = _SCHEMES.get(name)
    if spec is None:
        raise ConfigError(f"cache URL {url!r}: unknown scheme {name!r}; valid schemes: {_valid_schemes()}"
                          " (e.g. lmdb:///var/cache/datacache)")
    return spec


def parse_tier(text: str, *, url: str | None = None) -> StoreSpec:
    """Parse one tier ``scheme://location?opts`` (see the module docstring)."""
    url = redact(url or text)  # only for messages: a password never reaches an error text
    scheme, sep, rest = text.partition("://")
    if not sep:
        plain_path = text.startswith(("/", "~", ".")) and "@" not in text
        hint = f"; did you mean lmdb://{text}?" if plain_path else ""
        raise ConfigError(f"cache URL {url!r} has no scheme (scheme://location); valid schemes: "
                          f"{_valid_schemes()}{hint}")
    sch = scheme_spec(scheme, url)
    location, _, query = rest.partition("?")
    if "@" in query and scheme in CACHE_USERINFO_SCHEMES:
        # a raw "?" in the password would put the rest of it here, and the option errors below echo
        # option names and values: refuse without echoing anything of it
        raise ConfigError(f"cache URL {url!r}: an '@' after the '?': percent-encode a '?' in the password "
                          "as %3F and an '@' in an option value as %40")
    if sch.location is not None:
        location = sch.location(location, url)
    seen: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        opt = sch.options.get(name)
        if opt is None:
            valid = ", ".join(sorted(sch.options)) or "none"
            # (url is redacted: a credential parameter's value is never echoed, only its name)
            # (no "@" in the hint: free-text redaction takes a cache URL's userinfo to the line's last "@")
            hint = ("; a password goes in a file, ?password_file=PATH, or in the userinfo (user:password "
                    "before the host)"
                    if is_credential_param(name) and "password_file" in sch.options else "")
            raise ConfigError(f"cache URL {url!r}: unknown option {name!r} for {scheme}://; valid options: "
                              f"{valid}{hint}")
        if name in seen:
            raise ConfigError(f"cache URL {url!r}: option {name!r} is given twice")
        seen[name] = opt.coerce(name, value, url)
    if query and not seen:
        raise ConfigError(f"cache URL {url!r}: cannot parse its query string (use ?name=value&...)")
    return StoreSpec(scheme, location, tuple(sorted(seen.items())))


def parse_cache_url(url: str | CacheSpec, *, check: bool = False, max_tiers: int = MAX_TIERS) -> CacheSpec:
    """Parse and validate a cache URL; ``check=True`` also runs each scheme's environment check.

    Raises :class:`~datacache.config.ConfigError` naming the bad part and the valid schemes/options.
    """
    if isinstance(url, CacheSpec):
        spec = url
    else:
        if not isinstance(url, str) or not url.strip():
            got = repr(url) if isinstance(url, str) or url is None else f"a {type(url).__name__}"
            raise ConfigError(f"cache URL must be a non-empty string such as lmdb:///var/cache/datacache, "
                              f"got {got}")
        text = url.strip()
        spec = CacheSpec(text, tuple(parse_tier(t, url=text) for t in text.split("::")))
    if len(spec.tiers) > max_tiers:
        raise ConfigError(f"cache URL {redact(spec.given)!r} chains {len(spec.tiers)} tiers; at most "
                          f"{max_tiers} are allowed (e.g. lmdb:///local::redis+cluster://h1:7000,h2:7000)")
    if len({t.secret_url for t in spec.tiers}) != len(spec.tiers):
        raise ConfigError(f"cache URL {redact(spec.given)!r} names the same tier twice")
    if check:
        for t in spec.tiers:
            sch = scheme_spec(t.scheme, redact(spec.given))
            if sch.check is not None:
                sch.check(t)
    return spec


def local_path_location(raw: str, url: str) -> str:
    """Location normaliser for directory-backed schemes: required, ``~`` expanded, absolute."""
    if not raw:
        raise ConfigError(f"cache URL {url!r} needs a directory, e.g. lmdb:///var/cache/datacache "
                          "or lmdb://~/.cache/datacache/lmdb")
    return os.path.abspath(os.path.expanduser(raw))
