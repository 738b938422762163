"""Secrets read from files (the Kubernetes / Docker secrets convention), never from command lines.

:func:`read_secret_file` reads one secret -- a Redis password (``?password_file=`` of a cache URL), an
API token, a record key -- with one set of rules: at most :data:`MAX_SECRET_BYTES`, surrounding
whitespace (the trailing newline of ``echo``) stripped, not empty, and a clear
:class:`~datacache.config.ConfigError` naming the FILE (never its content) and what to do when it
cannot be used. What it returns is registered with :func:`datacache.redact.register_secret`, so a
secret read here is masked in any log line that reaches a :class:`~datacache.redact.ScrubFilter`.
"""

from __future__ import annotations

from datacache.config import ConfigError
from datacache.redact import register_secret

MAX_SECRET_BYTES = 4096
HOW_TO_MAKE = "e.g. (umask 077; head -c 32 /dev/urandom | base64 > FILE)"


def read_secret_file(path: str, *, what: str, min_len: int = 1) -> str:
    """The secret in ``path`` (stripped); ConfigError naming ``what`` and the file when it cannot be
    read, is empty, too short (``min_len`` characters) or longer than :data:`MAX_SECRET_BYTES`."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"{what}: the secret file must be a path, got {type(path).__name__}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read the secret file {path} ({type(e).__name__}: "
                          f"{e.strerror or 'unreadable'}); create it readable only by this user, "
                          f"{HOW_TO_MAKE.replace('FILE', path)}") from None
    if len(raw) > MAX_SECRET_BYTES:
        raise ConfigError(f"{what}: the secret file {path} holds more than {MAX_SECRET_BYTES} bytes; it "
                          "must hold the secret alone")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: the secret file {path} is not UTF-8 text; write the secret as text, "
                          f"{HOW_TO_MAKE.replace('FILE', path)}") from None
    if len(text) < max(1, min_len):
        raise ConfigError(f"{what}: the secret file {path} is empty or shorter than {min_len} characters; "
                          f"{HOW_TO_MAKE.replace('FILE', path)}")
    register_secret(text)
    return text
