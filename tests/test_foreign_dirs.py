"""No directory or file another user prepared (issue 35, item 2; T1 and secret-file parts of item 8).

Reproductions with a REAL second user (``nobody``, through ``runuser`` or a forked, setuid child) and
real ``redis-server`` processes: a local-cluster directory another user prepared (marker, its own 0600
password files, a ``redis.log`` symlink to a root-owned file) is refused in one line and that file is
left untouched; a pid planted in ``cluster.json`` or a daemon pid file is never signalled; a symlinked
``daemon-N.log`` is never truncated by ``deploy/local-cluster.sh``; secret files that are group/world
readable or another user's are refused; T1 entries are 0600 in a 0700 directory, and a T1 directory
another user owns is not used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from datacache.config import ConfigError
from datacache.devtools.redis_local import MARKER, claim_dir, default_dir, free_ports
from datacache.redis_roles import ROLES, RolesError
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "deploy", "local-cluster.sh")
KEY = "Zm9vYmFyYmF6cXV4LXJlY29yZC1rZXktQS0xMjM0NTY3OA=="  # 48 characters


def _nobody() -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def _why_no_second_user() -> str | None:
    if os.geteuid() != 0:
        return "needs root to act as a second user (setuid in a forked child)"
    if _nobody() is None:
        return "no user 'nobody' on this machine"
    return None


needs_second_user = pytest.mark.skipif(_why_no_second_user() is not None,
                                       reason=_why_no_second_user() or "")


def _as_nobody(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` run by the real user nobody (a forked child that drops to nobody's uid, gid and
    no supplementary groups); its result (repr-able) or the text of its exception comes back."""
    uid, gid = _nobody()  # type: ignore[misc]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                got = ("ok", fn(*args))
            except Exception as e:
                got = ("error", f"{type(e).__name__}: {e}")
            os.write(w, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        kind, value = json.loads(f.read() or '["error", "the child died"]')
    os.waitpid(pid, 0)
    if kind != "ok":
        raise AssertionError(f"as nobody: {value}")
    return value


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (root's, mode 1777) that nobody can reach (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="dc-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        _stop_servers_under(str(d))
        shutil.rmtree(d, ignore_errors=True)


def _stop_servers_under(root: str) -> None:
    """SIGKILL the processes THIS test started whose working directory is under ``root`` (a failing
    run on an unfixed tree would leave its redis-servers there)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + "/"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _redis_local(*args: str, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datacache.devtools.redis_local", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


def _plant(d: str, base: int, target: str) -> None:
    """What user nobody prepares: the marker, its own 0600 password files, redis.log links to ``target``."""
    os.mkdir(d, 0o755)
    with open(os.path.join(d, MARKER), "w") as f:
        f.write('{"created_dir": false}')
    os.mkdir(os.path.join(d, "secrets"), 0o700)
    for role in ROLES:
        fd = os.open(os.path.join(d, "secrets", f"{role}.pass"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"chosen-by-nobody-0123456789abcdef\n")
        os.close(fd)
    for port in range(base, base + 3):
        os.mkdir(os.path.join(d, f"node-{port}"), 0o755)
        os.symlink(target, os.path.join(d, f"node-{port}", "redis.log"))


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.lstat().st_uid, p.lstat().st_mode) for p in sorted(d.rglob("*"))}


@needs_redis
@needs_second_user
def test_up_refuses_the_default_dir_another_user_prepared(shared_tmp, tmp_path) -> None:
    precious = tmp_path / "precious"  # root's file, which the planted links name
    precious.write_text("root's data\n")
    before = precious.stat()
    port = free_ports(3)
    env = {"TMPDIR": str(shared_tmp)}
    # nobody prepares both the old fixed name and the per-user default of root in the shared directory
    planted = [shared_tmp / "datacache-local-cluster", shared_tmp / f"datacache-local-cluster-{os.geteuid()}"]
    for d in planted:
        _as_nobody(_plant, str(d), port, str(precious))
    trees = [_tree(d) for d in planted]
    out = _redis_local("up", "--base-port", str(port), env=env)  # the default directory
    err = out.stderr.strip()
    assert out.returncode == 2, (out.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "owned by uid 65534" in err and "datacache-local-cluster" in err, err
    # and the old fixed name given explicitly: refused the same way
    out = _redis_local("up", "--dir", str(planted[0]), "--base-port", str(port), env=env)
    assert out.returncode == 2 and "owned by uid 65534" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    # nothing started (nobody's passwords never became admin's), nothing written anywhere
    assert not any(_listens(port + i) for i in range(3))
    assert [_tree(d) for d in planted] == trees
    after = precious.stat()
    assert precious.read_text() == "root's data\n" and (after.st_size, after.st_mtime_ns) == \
        (before.st_size, before.st_mtime_ns)
    # down in another user's directory stops nothing and removes nothing
    out = _redis_local("down", "--dir", str(planted[0]), env=env)
    assert out.returncode == 2 and "owned by uid 65534" in out.stderr
    assert [_tree(d) for d in planted] == trees


def test_default_dir_is_per_user() -> None:
    assert default_dir() == os.path.join(tempfile.gettempdir(), f"datacache-local-cluster-{os.geteuid()}")


def test_claim_dir_refuses_dirs_others_can_write(tmp_path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    why = claim_dir(str(loose))
    assert why and "writable by group or others" in why and "\n" not in why and os.listdir(loose) == []
    parent = tmp_path / "open-parent"  # ours, but others may rename what is in it (no sticky bit)
    parent.mkdir()
    os.chmod(parent, 0o777)
    why = claim_dir(str(parent / "lc"))
    assert why and "without the sticky bit" in why and not (parent / "lc").exists()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    why = claim_dir(str(link))
    assert why and "symbolic link" in why and not (tmp_path / "elsewhere").exists()
    fresh = tmp_path / "fresh" / "lc"
    assert claim_dir(str(fresh)) is None
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE((fresh / MARKER).stat().st_mode) == 0o600


def _decoy(argv0: str, cwd: str, user: int | None = None) -> subprocess.Popen:
    """A sleeping process whose command line starts with ``argv0`` (it is /bin/sleep all the same)."""
    return subprocess.Popen([argv0, "300"], executable=shutil.which("sleep"), cwd=cwd, user=user,
                            start_new_session=True)


@needs_redis
@needs_second_user
def test_down_never_signals_a_pid_planted_in_cluster_json(tmp_path) -> None:
    d = tmp_path / "lc"
    port = free_ports(3)
    out = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    assert out.returncode == 0, out.stderr
    state = json.loads((d / "cluster.json").read_text())
    real = state["pids"]
    uid = _nobody()[0]  # type: ignore[index]
    decoys = [
        _decoy("sleep", "/", user=uid),                                    # another user's process
        _decoy(f"redis-server 127.0.0.1:{port + 1}", str(d / f"node-{port + 1}")),  # ours, not redis
        _decoy(f"redis-server 127.0.0.1:{port + 2}", "/", user=uid),         # another user's "redis"
    ]
    try:
        time.sleep(0.2)
        state["pids"] = [p.pid for p in decoys]
        (d / "cluster.json").write_text(json.dumps(state))
        down = _redis_local("down", "--dir", str(d))
        assert down.returncode == 0, down.stderr
        time.sleep(0.5)
        assert all(p.poll() is None for p in decoys), [p.poll() for p in decoys]
    finally:
        for p in decoys:
            p.kill()
            p.wait(10)
        for pid in real:  # the servers this test started, by their recorded pids
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_script_down_never_signals_a_planted_daemon_pid(tmp_path) -> None:
    d = tmp_path / "lc"
    assert claim_dir(str(d)) is None
    decoy = _decoy(f"{sys.executable} -m cache_daemon --http-port 1", "/")  # ours, looks like a daemon
    try:
        time.sleep(0.2)
        (d / "daemon-0.pid").write_text(f"{decoy.pid}\n")
        env = {**os.environ, "PYTHON": sys.executable, "DIR": str(d), "DOWN_WAIT": "1",
               "HTTP_PORT": "1", "PORT": str(free_ports(3))}
        out = subprocess.run([SCRIPT, "down"], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        time.sleep(0.3)
        assert decoy.poll() is None
    finally:
        decoy.kill()
        decoy.wait(10)


@needs_redis
def test_script_never_truncates_a_symlinked_daemon_log(tmp_path) -> None:
    d = tmp_path / "lc"
    assert claim_dir(str(d)) is None
    precious = tmp_path / "precious"
    precious.write_text("root's data\n")
    (d / "daemon-0.log").symlink_to(precious)
    port, http = free_ports(3), free_ports(3)
    env = {**os.environ, "PYTHON": sys.executable, "DIR": str(d), "PORT": str(port), "HTTP_PORT": str(http),
           "IMAGES": "20", "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HEALTH_WAIT": "60", "DOWN_WAIT": "5"}
    try:
        out = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and "daemon-0.log is a symbolic link" in out.stderr, out.stderr[-2000:]
        assert precious.read_text() == "root's data\n"
        assert (d / "daemon-0.log").is_symlink()
    finally:
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True, text=True, timeout=180)
    assert precious.read_text() == "root's data\n"


# ------------------------------------------------------------------------------------ secret files
def _secret(path: Path, mode: int, text: str = KEY) -> str:
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o660])
def test_secret_files_open_to_group_or_others_are_refused(tmp_path, mode: int) -> None:
    from datacache.record import load_record_key
    from datacache.secretfile import read_secret_file

    f = _secret(tmp_path / f"s{mode:o}", mode)
    with pytest.raises(ConfigError) as ei:
        read_secret_file(f, what="test")
    msg = str(ei.value)
    assert f in msg and "chmod 600" in msg and "\n" not in msg and KEY not in msg, msg
    with pytest.raises(ConfigError) as ei:
        load_record_key(f)
    assert f in str(ei.value) and KEY not in str(ei.value)


@pytest.mark.timeout(60)
def test_a_fifo_as_secret_file_is_refused_without_blocking(tmp_path) -> None:
    from datacache.secretfile import read_secret_file

    fifo = tmp_path / "pass"
    os.mkfifo(fifo, 0o600)  # no writer: a blocking open or read would hang here forever
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret_file(str(fifo), what="test")


def test_a_private_secret_file_is_read(tmp_path) -> None:
    from datacache.secretfile import read_secret_file

    assert read_secret_file(_secret(tmp_path / "ok", 0o600), what="test") == KEY
    assert read_secret_file(_secret(tmp_path / "ro", 0o400), what="test") == KEY
    link = tmp_path / "link"  # our own link (as a Kubernetes secret volume's, which root owns)
    link.symlink_to(tmp_path / "ok")
    assert read_secret_file(str(link), what="test") == KEY


@needs_second_user
def test_secret_files_of_another_user_are_refused(tmp_path) -> None:
    from datacache.make_secrets import ensure_passwords
    from datacache.secretfile import read_secret_file

    uid, gid = _nobody()  # type: ignore[misc]
    f = _secret(tmp_path / "theirs", 0o600)
    os.chown(f, uid, gid)
    with pytest.raises(ConfigError) as ei:
        read_secret_file(f, what="test")
    msg = str(ei.value)
    assert f in msg and "owned by uid 65534" in msg and "chown" in msg and "\n" not in msg and KEY not in msg
    link = tmp_path / "their-link"  # a link another user planted, to a private file of ours
    link.symlink_to(tmp_path / "mine")
    _secret(tmp_path / "mine", 0o600)
    os.lchown(link, uid, gid)
    with pytest.raises(ConfigError, match="symbolic link owned by uid 65534"):
        read_secret_file(str(link), what="test")
    # make_secrets: another user's password file, or directory, is never reused
    s = tmp_path / "secrets"
    s.mkdir(mode=0o700)
    pw = _secret(s / "datacache.pass", 0o600, "chosen-by-nobody-0123456789abcdef")
    os.chown(pw, uid, gid)
    with pytest.raises(RolesError) as ei:
        ensure_passwords(str(s))
    assert pw in str(ei.value) and "owned by uid 65534" in str(ei.value)
    assert "chosen-by-nobody" not in str(ei.value)
    os.chown(pw, 0, 0)
    os.chown(s, uid, gid)
    with pytest.raises(RolesError, match="owned by uid 65534"):
        ensure_passwords(str(s))


def test_make_secrets_refuses_a_secrets_dir_others_can_write(tmp_path) -> None:
    from datacache.make_secrets import ensure_passwords

    s = tmp_path / "secrets"
    s.mkdir()
    os.chmod(s, 0o777)
    with pytest.raises(RolesError, match="writable by group or others"):
        ensure_passwords(str(s))
    assert os.listdir(s) == []


@needs_second_user
def test_a_root_provisioned_group_secret_is_read_by_a_member_only(tmp_path) -> None:
    """The Kubernetes secret-volume layout (root:fsGroup 0440): read by a process in that group, refused
    to one that is not, never to others."""
    from datacache.secretfile import read_secret_file

    _uid, gid = _nobody()  # type: ignore[misc]
    d = Path(tempfile.mkdtemp(prefix="dc-grp-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        ok = _secret(d / "ours", 0o440)
        os.chown(ok, 0, gid)
        other = _secret(d / "other", 0o440)
        os.chown(other, 0, 0)
        world = _secret(d / "world", 0o444)
        os.chown(world, 0, gid)
        def read(path: str) -> str:
            try:
                return "ok" if read_secret_file(path, what="t") == KEY else "wrong"
            except ConfigError as e:
                return "refused: " + str(e)

        results = [_as_nobody(read, p) for p in (ok, other, world)]
        assert results[0] == "ok", results
        assert results[1].startswith("refused") and results[2].startswith("refused"), results
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -------------------------------------------------------------------------------------------- T1
def _t1_source(src: Path, t1: Path):
    from datacache.source import Source

    return Source(str(src), t1_dir=str(t1), force_t1=True)


def test_t1_entries_are_private(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"private remote bytes")
    t1 = tmp_path / "cache" / "t1"
    s = _t1_source(src, t1)
    assert s.read("a.bin", size=20, identity="v1") == b"private remote bytes"
    assert s.read("a.bin", size=20, identity="v1") == b"private remote bytes"
    assert s.stats()["t1_hits"] == 1
    assert stat.S_IMODE(t1.stat().st_mode) == 0o700
    entries = os.listdir(t1)
    assert entries and all(stat.S_IMODE((t1 / e).stat().st_mode) == 0o600 for e in entries)


@needs_second_user
def test_t1_dir_of_another_user_is_not_used(tmp_path, caplog) -> None:
    uid, gid = _nobody()  # type: ignore[misc]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"real bytes")
    t1 = tmp_path / "t1"
    t1.mkdir()
    os.chown(t1, uid, gid)
    with caplog.at_level(logging.WARNING, logger="datacache.source"):
        s = _t1_source(src, t1)
        assert s.read("a.bin", size=10, identity="v1") == b"real bytes"
    assert os.listdir(t1) == [] and "owned by uid 65534" in caplog.text and "T1" in caplog.text
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    s = _t1_source(src, loose)
    assert s.read("a.bin", size=10, identity="v1") == b"real bytes" and os.listdir(loose) == []
