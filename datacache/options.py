"""One way to check a configuration value: choices, booleans, byte sizes and host:port.

Every config surface -- cache URL options (:mod:`datacache.cacheurl`), :class:`~datacache.config.Variant`,
``CachedImageNet``'s arguments, the daemon's TOML/environment (:mod:`cache_daemon.daemon_config`), the
Redis stores' locations -- checks values with these helpers, so the same mistake gets the same
:class:`~datacache.config.ConfigError` everywhere: what was given, where, and the valid forms.
``what`` names the value in the message (``"Variant.encoding"``, ``"daemon config: key 'decoder'"``).
This module imports nothing of the project (:class:`ConfigError` lives here), so every module can use it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class ConfigError(ValueError):
    """An invalid configuration value; the message names it and lists the valid choices (re-exported by
    :mod:`datacache.config`, where most code imports it from)."""

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def choice(what: str, value: object, choices: Sequence[str]) -> str:
    """``value`` when it is one of ``choices``, else ConfigError listing them."""
    if isinstance(value, str) and value in choices:
        return value
    raise ConfigError(f"{what}={value!r} is not valid; choose one of {', '.join(choices)}")


def parse_bool(text: object, what: str) -> bool:
    """``1/0/true/false/yes/no/on/off`` (any case) or a bool; ConfigError listing them otherwise."""
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in TRUE or low in FALSE:
        return low in TRUE
    raise ConfigError(f"{what}={text!r} is not a boolean; use one of {', '.join(TRUE + FALSE)}")


def parse_size(text: object) -> int | None:
    """``"4GiB"`` -> 4294967296, ``"512M"`` -> 512000000, ``"123"`` -> 123; None if not a size."""
    if isinstance(text, bool):
        return None
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        return None
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except (OverflowError, ValueError):
        return None


def parse_hostport(text: object, what: str) -> tuple[str, int]:
    """``"10.0.0.1:7000"`` / ``"[::1]:7000"`` -> (host, port) with a port in 1..65535; ConfigError else."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not port.isascii() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: {text!r} is not host:port with a port in 1..65535 (e.g. 127.0.0.1:6379)")
    return host.strip("[]"), int(port)
