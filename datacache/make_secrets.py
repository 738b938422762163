"""Generate the Redis passwords of a datacache cluster: ``python -m datacache.make_secrets DIR``.

Writes one random password per role (:mod:`datacache.redis_roles`) into ``DIR``:

* ``admin.pass``, ``datacache-daemon.pass``, ``datacache.pass`` -- 256-bit random (``secrets``), created
  mode 0600 (the umask is set before the file exists, never a chmod after it), in a directory created
  mode 0700. Existing ones are REUSED, never overwritten (a re-run is idempotent); one that is empty,
  short, a placeholder, readable by group/others or owned by another user is refused with the file
  named, and so is an existing DIR that is another user's or writable by group/others
  (:mod:`datacache.ownership`): whoever can write there could choose the passwords we would reuse.
* ``users.acl`` (0600) -- the ACL lines with SHA-256 hashes (``user default off`` + one line per role):
  paste them over the placeholder lines of ``deploy/redis/redis.conf``, or delete those lines and point
  Redis at the file (``aclfile DIR/users.acl``).
* with ``--redis-conf TEMPLATE``: ``redis.conf`` (0600) -- the template with its placeholder hashes
  filled (what ``deploy/docker/compose.yaml`` mounts as a Docker secret).

Derived files are rewritten never: an existing one that differs from what the passwords give is refused
(remove it to regenerate). Nothing secret is printed: stdout shows the files, the ACL lines (hashes) and
the cache URLs with ``?password_file=``. Stdlib only (``deploy/local-cluster.sh`` runs it with any python3
through :mod:`datacache.devtools.redis_local`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field

from datacache.ownership import dir_problem, secret_stat_problem
from datacache.redis_roles import (
    ADMIN,
    DAEMON,
    PLACEHOLDER,
    ROLES,
    TRAINER,
    RolesError,
    acl_lines,
    fill_template,
)

MIN_PASSWORD = 16  # characters of a reused password file; generated ones have 43
MAX_PASSWORD = 4096
ACL_FILE = "users.acl"
CONF_FILE = "redis.conf"


def password_file(directory: str, role: str) -> str:
    return os.path.join(directory, f"{role}.pass")


@dataclass
class Secrets:
    """What :func:`ensure_passwords` found or made in ``dir``."""

    dir: str
    passwords: dict[str, str] = field(repr=False)
    created: list[str] = field(default_factory=list)  # file names created by this call
    created_dir: bool = False


def _create_private(path: str, data: bytes) -> None:
    """Create ``path`` mode 0600 (O_EXCL: never over an existing file or through a symlink).

    Process-wide hazard: the umask is the process's, set around the open only; a file another thread
    creates in that instant is created owner-only too (never more open)."""
    old = os.umask(0o077)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    finally:
        os.umask(old)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_private(path: str) -> str:
    """An existing password file's content; RolesError naming the file when it must not be reused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise RolesError(f"{path}: cannot read it ({e.strerror}); remove it to generate a new one") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RolesError(f"{path}: not a regular file; remove it to generate a new one")
        if st.st_uid != os.geteuid():  # another user's file: that user chose (and knows) the password
            why = secret_stat_problem(st, allow_root_group=False)
            raise RolesError(f"{path}: {why}; a password file must be yours and mode 0600: remove it to "
                             "generate a new one (or `chown` it to you after checking who wrote it)")
        if st.st_mode & 0o077:
            raise RolesError(f"{path}: readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                             "a password file must be mode 0600: `chmod 600` it after checking who read it, "
                             "or remove it to generate a new one")
        raw = f.read(MAX_PASSWORD + 1)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise RolesError(f"{path}: not UTF-8 text; remove it to generate a new one") from None
    if len(raw) > MAX_PASSWORD or len(text) < MIN_PASSWORD or PLACEHOLDER in text or any(
            c.isspace() for c in text):
        raise RolesError(f"{path}: not a usable password ({MIN_PASSWORD}..{MAX_PASSWORD} characters, no "
                         f"spaces, no {PLACEHOLDER}); remove it to generate a new one")
    return text


def ensure_passwords(directory: str) -> Secrets:
    """Reuse or create one password file per role in ``directory`` (created 0700 when missing). An
    existing directory must be this user's and not writable by group or others (RolesError, one line):
    whoever can write into it can plant the passwords we would reuse."""
    out = Secrets(os.path.abspath(directory), {})
    if os.path.lexists(out.dir):
        why = dir_problem(out.dir, what="secrets directory")
        if why:
            raise RolesError(why)
    else:
        old = os.umask(0o077)  # see _create_private: process-wide, restored at once
        try:
            os.makedirs(out.dir, mode=0o700)
        finally:
            os.umask(old)
        out.created_dir = True
    for role in ROLES:
        path = password_file(out.dir, role)
        if not os.path.lexists(path):
            try:
                _create_private(path, (secrets.token_urlsafe(32) + "\n").encode())
                out.created.append(os.path.basename(path))
            except FileExistsError:  # a concurrent run made it first: reuse theirs
                pass
        out.passwords[role] = _read_private(path)
    return out


def write_derived(path: str, text: str) -> bool:
    """Create ``path`` (0600) holding ``text``; True when created, False when it already holds exactly
    that. RolesError when it holds something else (never overwritten)."""
    data = text.encode("utf-8")
    if os.path.lexists(path):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                same = f.read(len(data) + 1) == data
        except OSError:
            same = False
        if not same:
            raise RolesError(f"{path}: exists and differs from what the passwords give; it is never "
                             "overwritten: remove it to regenerate it")
        return False
    _create_private(path, data)
    return True


def cache_url(role: str, directory: str, hosts: str = "HOST1:7000,HOST2:7000,HOST3:7000") -> str:
    """The cache URL of ``role`` with its password read from its file (no secret in the URL)."""
    from urllib.parse import quote

    return (f"redis+cluster://{role}@{hosts}?password_file="
            f"{quote(password_file(os.path.abspath(directory), role), safe='/')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m datacache.make_secrets",
        description="Create (or reuse) one random Redis password per datacache role in DIR (files mode "
                    "0600), write the ACL lines with their SHA-256 hashes to DIR/users.acl and print them. "
                    "Nothing secret is printed.")
    ap.add_argument("dir", help="directory for the secrets (created mode 0700 when missing)")
    ap.add_argument("--redis-conf", metavar="TEMPLATE",
                    help="also write DIR/redis.conf: this template (deploy/redis/redis.conf) with the "
                         "placeholder hashes filled")
    a = ap.parse_args(argv)
    try:
        s = ensure_passwords(a.dir)
        lines = acl_lines(s.passwords)
        acl_path = os.path.join(s.dir, ACL_FILE)
        written = [ACL_FILE] if write_derived(acl_path, "\n".join(lines) + "\n") else []
        if a.redis_conf:
            try:
                with open(a.redis_conf, encoding="utf-8") as f:
                    template = f.read()
            except OSError as e:
                raise RolesError(f"{a.redis_conf}: cannot read the template ({e.strerror})") from None
            conf = fill_template(template, s.passwords, where=a.redis_conf)
            conf += f"\n# filled by python -m datacache.make_secrets from {os.path.abspath(a.redis_conf)}\n"
            if write_derived(os.path.join(s.dir, CONF_FILE), conf):
                written.append(CONF_FILE)
    except RolesError as e:
        print(f"make_secrets: {e}", file=sys.stderr)
        return 2
    for role in ROLES:
        name = os.path.basename(password_file(s.dir, role))
        print(f"{password_file(s.dir, role)}: {'created' if name in s.created else 'reused'} (mode 0600)")
    for name in written:
        print(f"{os.path.join(s.dir, name)}: created (mode 0600)")
    print("\n# ACL lines for redis.conf (replace its four 'user' lines with them, or delete those lines "
          f"and add: aclfile {acl_path})")
    print("\n".join(lines))
    print("\n# cache URLs (the password is read from the file; put your masters' host:port in)")
    print(f"#   daemons (daemon.toml 'cache'): {cache_url(DAEMON, s.dir)}")
    print(f"#   trainers:                      {cache_url(TRAINER, s.dir)}")
    admin = password_file(s.dir, ADMIN)
    print(f"# cluster creation: REDISCLI_AUTH=\"$(cat {admin})\" redis-cli --user admin --no-auth-warning "
          "--cluster create HOST1:7000 HOST2:7000 HOST3:7000 --cluster-yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
