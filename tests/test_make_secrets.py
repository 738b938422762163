"""``python -m datacache.make_secrets DIR``: random passwords per role in 0600 files (umask set before the
files exist, never a chmod after), reused and never overwritten, nothing secret printed; and the daemon
refuses a template's placeholder password (inline or in its password file) and over-long node names.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys

import pytest

from datacache.config import ConfigError
from datacache.make_secrets import ensure_passwords, password_file
from datacache.redis_roles import ROLES, RolesError, fill_template

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "deploy", "redis", "redis.conf")


def _run(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    pre = (lambda: os.umask(umask)) if umask is not None else None  # the child's umask, for the test
    return subprocess.run([sys.executable, "-m", "datacache.make_secrets", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO}, preexec_fn=pre)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_creates_private_random_passwords_and_prints_no_secret(tmp_path) -> None:
    d = tmp_path / "new" / "secrets"
    out = _run(str(d), "--redis-conf", CONF, umask=0)  # a permissive umask: the files are private anyway
    assert out.returncode == 0, out.stderr
    assert _mode(d) == 0o700
    names = sorted(os.listdir(d))
    assert names == sorted([*(f"{r}.pass" for r in ROLES), "users.acl", "redis.conf"])
    assert {_mode(d / n) for n in names} == {0o600}
    pw = {r: (d / f"{r}.pass").read_text().strip() for r in ROLES}
    assert len(set(pw.values())) == 3 and all(len(p) >= 40 for p in pw.values())  # 256-bit, distinct
    assert not any(p in out.stdout + out.stderr for p in pw.values())  # nothing secret printed
    acl = (d / "users.acl").read_text()
    for r in ROLES:  # the printed / written ACL lines carry each password's SHA-256, computed here
        line = f"user {r} on #{hashlib.sha256(pw[r].encode()).hexdigest()} "
        assert line in acl and line in out.stdout
    assert "user default off" in acl.splitlines()
    conf = (d / "redis.conf").read_text()
    assert all(hashlib.sha256(p.encode()).hexdigest() in conf for p in pw.values())
    assert "password_file=" in out.stdout and "REDISCLI_AUTH" in out.stdout


def test_a_rerun_reuses_and_never_overwrites(tmp_path) -> None:
    d = tmp_path / "s"
    assert _run(str(d)).returncode == 0
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    again = _run(str(d))
    assert again.returncode == 0 and again.stdout.count("reused") == 3 and "created" not in again.stdout
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    # a derived file that does not match is refused, left as it was
    (d / "users.acl").write_text("user default on nopass ~* +@all\n")
    bad = _run(str(d))
    assert bad.returncode == 2 and "users.acl" in bad.stderr and "never overwritten" in bad.stderr
    assert (d / "users.acl").read_text() == "user default on nopass ~* +@all\n"


@pytest.mark.parametrize("content, mode, why", [
    ("a" * 40 + "\n", 0o644, "readable by group or others"),
    ("CHANGE_ME_please_change_me_now\n", 0o600, "not a usable password"),
    ("short\n", 0o600, "not a usable password"),
    ("", 0o600, "not a usable password"),
])
def test_an_unusable_existing_password_file_is_refused_untouched(tmp_path, content: str, mode: int,
                                                                 why: str) -> None:
    d = tmp_path / "s"
    d.mkdir()
    f = d / "datacache.pass"
    f.write_text(content)
    os.chmod(f, mode)  # the test sets up a bad file; the tool itself never chmods
    out = _run(str(d))
    assert out.returncode == 2 and str(f) in out.stderr and why in out.stderr, out.stderr
    assert f.read_text() == content and _mode(f) == mode
    assert content.strip() not in out.stderr or not content.strip()  # never echoed


def test_files_are_created_private_without_any_chmod(tmp_path, monkeypatch) -> None:
    def no_chmod(*a, **k):
        raise AssertionError("chmod after creation: the file was briefly readable")

    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(os, "fchmod", no_chmod)
    old = os.umask(0)
    try:
        s = ensure_passwords(str(tmp_path / "s"))
    finally:
        os.umask(old)
    assert sorted(s.created) == sorted(f"{r}.pass" for r in ROLES) and s.created_dir
    assert {_mode(password_file(s.dir, r)) for r in ROLES} == {0o600} and _mode(s.dir) == 0o700
    assert ensure_passwords(s.dir).passwords == s.passwords  # reused


def test_server_command_lines_carry_hashes_only(tmp_path) -> None:
    from datacache.devtools.redis_local import server_args

    s = ensure_passwords(str(tmp_path / "s"))
    args = server_args(7000, cluster=True, roles=s.passwords)
    joined = "\0".join(args)
    assert not any(p in joined for p in s.passwords.values())  # `ps` shows this command line
    for r in ROLES:
        assert f"#{hashlib.sha256(s.passwords[r].encode()).hexdigest()}" in args
    assert args[args.index("default") - 1:args.index("default") + 2] == ["--user", "default", "off"]


def test_fill_template_refuses_missing_or_leftover_placeholders(tmp_path) -> None:
    with open(CONF) as f:
        text = f.read()
    pw = {r: r + "-" + "x" * 40 for r in ROLES}
    with pytest.raises(RolesError, match="expected the placeholder line 'user datacache-daemon"):
        broken = text.replace("user datacache-daemon on #CHANGE_ME", "user datacache-daemon off #CHANGE_ME")
        fill_template(broken, pw)
    with pytest.raises(RolesError, match="still holds a CHANGE_ME"):
        fill_template(text + "masterauth CHANGE_ME_ADMIN\n", pw)
    out = _run(str(tmp_path / "s"), "--redis-conf", str(tmp_path / "missing.conf"))
    assert out.returncode == 2 and "missing.conf" in out.stderr


# ------------------------------------------------------------------------------ the daemon's refusals
def test_daemon_refuses_a_placeholder_password_inline_or_in_its_file(tmp_path) -> None:
    from cache_daemon.daemon_config import DaemonConfig

    with pytest.raises(ConfigError, match=r"key 'cache'.*placeholder.*make_secrets") as ei:
        DaemonConfig(cache="redis+cluster://datacache-daemon:CHANGE_ME@10.0.0.1:7000",
                     redis_node="10.0.0.1:7000")
    assert ":CHANGE_ME@" not in str(ei.value)  # the URL is shown redacted
    f = tmp_path / "daemon.pass"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"CHANGE_ME_ADMIN\n")
    os.close(fd)
    with pytest.raises(ConfigError, match=r"key 'cache'.*placeholder"):
        DaemonConfig(cache=f"redis+cluster://datacache-daemon@10.0.0.1:7000?password_file={f}",
                     redis_node="10.0.0.1:7000")
    s = ensure_passwords(str(tmp_path / "real"))
    pw_file = password_file(s.dir, "datacache-daemon")
    ok = f"redis+cluster://datacache-daemon@10.0.0.1:7000?password_file={pw_file}"
    assert DaemonConfig(cache=ok, redis_node="10.0.0.1:7000").cache == ok


def test_daemon_refuses_a_node_name_readers_would_drop() -> None:
    from cache_daemon.daemon_config import DaemonConfig
    from datacache.fillstatus import MAX_NODE_NAME

    assert DaemonConfig(cache="memory://", node="n" * MAX_NODE_NAME).node
    with pytest.raises(ConfigError, match=f"key 'node' must be at most {MAX_NODE_NAME} bytes"):
        DaemonConfig(cache="memory://", node="n" * (MAX_NODE_NAME + 1))
