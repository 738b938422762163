"""Secrets read from files (the Kubernetes / Docker secrets convention), never from command lines.

:func:`read_secret_file` reads one secret -- a Redis password (``?password_file=`` of a cache URL), an
API token, a record key -- with one set of rules: at most :data:`MAX_SECRET_BYTES`, surrounding
whitespace (the trailing newline of ``echo``) stripped, not empty, and a clear
:class:`~datacache.config.ConfigError` naming the FILE (never its content) and what to do when it
cannot be used. The file must be a regular file owned by this user with no group or other access
(0600 / 0400), or owned by root and readable only by one of this process's groups (the Kubernetes
secret-volume layout, root:fsGroup 0440; see :func:`datacache.ownership.secret_stat_problem`); a
group/world-readable or foreign-owned file is refused in one line naming the file and the fix. The last
component is never followed as a symlink unless root or this user owns the link (Kubernetes mounts
each secret as a root-owned link into its ``..data`` directory); the checks are made on the open
descriptor, so the file checked is the file read. What it returns is registered with
:func:`datacache.redact.register_secret`, so a secret read here is masked in any log line that reaches
a :class:`~datacache.redact.ScrubFilter`.
"""

from __future__ import annotations

import errno
import os
import stat

from datacache.config import ConfigError
from datacache.ownership import secret_stat_problem
from datacache.redact import register_secret

MAX_SECRET_BYTES = 4096
HOW_TO_MAKE = "e.g. (umask 077; head -c 32 /dev/urandom | base64 > FILE)"


def read_secret_file(path: str, *, what: str, min_len: int = 1) -> str:
    """The secret in ``path`` (stripped); ConfigError naming ``what`` and the file when it cannot be
    read, is empty, too short (``min_len`` characters) or longer than :data:`MAX_SECRET_BYTES`."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ConfigError(f"{what}: the secret file must be a path, got {type(path).__name__}")
    try:
        fd = _open_secret(path, what)
    except OSError as e:
        raise ConfigError(f"{what}: cannot read the secret file {path} ({type(e).__name__}: "
                          f"{e.strerror or 'unreadable'}); create it readable only by this user, "
                          f"{HOW_TO_MAKE.replace('FILE', path)}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block a read forever, a device never end
            raise ConfigError(f"{what}: the secret file {path} is not a regular file; "
                              f"{HOW_TO_MAKE.replace('FILE', path)}")
        why = secret_stat_problem(st)
        if why:
            fix = (f"`chmod 600 {path}` after checking who read it" if st.st_uid == os.geteuid()
                   else f"`chown` it to this user and `chmod 600 {path}` after checking who wrote it, or "
                        "make it anew")
            raise ConfigError(f"{what}: the secret file {path} {why}; refused: {fix}")
        os.set_blocking(f.fileno(), True)
        raw = f.read(MAX_SECRET_BYTES + 1)
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


def _open_secret(path: str, what: str) -> int:
    """A read descriptor of ``path``: never through a final symlink another user owns, never blocking
    on a FIFO (O_NONBLOCK; the caller checks the type and restores blocking reads)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(path, flags | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    owner = os.lstat(path).st_uid
    if owner not in (0, os.geteuid()):  # a link another user planted names whatever they chose
        raise OSError(errno.ELOOP, f"a symbolic link owned by uid {owner}, not by this user or root")
    return os.open(path, flags)  # root's or our own link (a Kubernetes secret volume): followed
