"""deploy/local-cluster.sh and ``python -m datacache.devtools.redis_local``: never touch a directory they did
not create, clean only what they wrote, report dead daemons, restart what is missing, one-line status; no
password-less access (ACL roles with generated 0600 password files) and no password on a command line.

Everything runs for real: redis-server processes, the cache daemons as subprocesses, the shell script.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from datacache.devtools.redis_local import MARKER, free_ports
from datacache.redis_roles import ROLES
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "deploy", "local-cluster.sh")


def _redis_local(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datacache.devtools.redis_local", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO})


def _admin_cli(d, port: int, *args: str) -> str:
    """redis-cli as the local cluster's admin (password from its file, through REDISCLI_AUTH)."""
    pw = (d / "secrets" / "admin.pass").read_text().strip()
    out = subprocess.run(["redis-cli", "-p", str(port), "--user", "admin", "--no-auth-warning", *args],
                         capture_output=True, text=True, timeout=10, env={**os.environ, "REDISCLI_AUTH": pw})
    return out.stdout + out.stderr


def _pids_whose_cmdline_holds(needles: set[bytes]) -> list[int]:
    """Pids whose ``/proc/<pid>/cmdline`` contains one of ``needles`` (processes that vanish are skipped)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if any(n in cmd for n in needles):
            found.append(int(pid))
    return found


def _procs_showing(secrets: list[str]) -> list[int]:
    """Pids whose command line holds one of ``secrets`` (never printed: only the pids are returned)."""
    return _pids_whose_cmdline_holds({s.encode() for s in secrets})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_refuses_a_foreign_non_empty_dir_and_leaves_it_intact(tmp_path) -> None:
    d = tmp_path / "home"
    d.mkdir()
    (d / "thesis.txt").write_text("years of work")
    (d / "sub").mkdir()
    (d / "sub" / "notes").write_text("keep")
    out = _redis_local("up", "--dir", str(d), "--base-port", str(free_ports(3)))
    assert out.returncode == 2
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and str(d) in err and "not empty" in err and "Traceback" not in err
    assert sorted(os.listdir(d)) == ["sub", "thesis.txt"]
    assert (d / "thesis.txt").read_text() == "years of work" and (d / "sub" / "notes").read_text() == "keep"
    # down on a directory without the marker removes nothing either
    out = _redis_local("down", "--dir", str(d))
    assert out.returncode == 0 and "nothing" in out.stdout
    assert sorted(os.listdir(d)) == ["sub", "thesis.txt"]


def test_script_refuses_a_foreign_dir_before_starting_anything(tmp_path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    (d / "x.bin").write_bytes(b"\0" * 10)
    port = free_ports(3)
    env = {**os.environ, "PYTHON": sys.executable, "PORT": str(port), "HTTP_PORT": str(free_ports(3)),
           "DIR": str(d)}
    out = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not empty" in out.stderr and "up:" not in out.stderr
    assert os.listdir(d) == ["x.bin"]


@needs_redis
def test_up_down_in_its_own_dir_removes_only_what_it_wrote(tmp_path) -> None:
    # an existing empty dir: used, kept on down (it was not created by up)
    d = tmp_path / "empty"
    d.mkdir()
    port = free_ports(3)
    out = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    assert out.returncode == 0, out.stderr
    state = json.loads((d / "cluster.json").read_text())
    assert state["ports"] == [port, port + 1, port + 2] and (d / MARKER).exists()
    # the masters run with the roles: nothing answers without a password, the admin's works
    assert "NOAUTH" in subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True,
                                      timeout=10).stdout
    assert "cluster_state:ok" in _admin_cli(d, port, "cluster", "info")
    assert sorted(os.listdir(d / "secrets")) == sorted(f"{r}.pass" for r in ROLES)
    # a re-run finds it alive: no second cluster, same url
    again = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    assert again.returncode == 0 and again.stdout.strip() == state["url"]
    assert "already running" in again.stderr
    # a file the user dropped into a node directory survives down (and so does that directory)
    (d / f"node-{port}" / "mine.txt").write_text("mine")
    down = _redis_local("down", "--dir", str(d))
    assert down.returncode == 0 and "stopped" in down.stdout
    assert not any(_alive(p) for p in state["pids"])
    assert sorted(os.listdir(d)) == [f"node-{port}"] and os.listdir(d / f"node-{port}") == ["mine.txt"]
    # a dir up created itself: gone after down
    d2 = tmp_path / "new" / "lc"
    out = _redis_local("up", "--dir", str(d2), "--base-port", str(port))
    assert out.returncode == 0, out.stderr
    assert _redis_local("down", "--dir", str(d2)).returncode == 0
    assert not d2.exists() and (tmp_path / "new").exists()


@needs_redis
def test_up_restarts_a_dead_master(tmp_path) -> None:
    d = tmp_path / "lc"
    port = free_ports(3)
    assert _redis_local("up", "--dir", str(d), "--base-port", str(port)).returncode == 0
    try:
        pids = json.loads((d / "cluster.json").read_text())["pids"]
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = _redis_local("up", "--dir", str(d), "--base-port", str(port))
        assert out.returncode == 0, out.stderr
        assert f"restarted the redis-server on 127.0.0.1:{port + 1}" in out.stderr
        new = json.loads((d / "cluster.json").read_text())["pids"]
        assert new[0] == pids[0] and new[2] == pids[2] and new[1] != pids[1] and _alive(new[1])
        # restarted with the same roles and passwords (from DIR/secrets)
        assert "cluster_state:ok" in _admin_cli(d, port + 1, "cluster", "info")
    finally:
        _redis_local("down", "--dir", str(d))


def _script_env(tmp_path, **extra: str) -> dict[str, str]:
    port = free_ports(3)  # PORT..PORT+2 and their bus ports, as the script uses them
    taken = {port + i + bus for i in range(3) for bus in (0, 10000)}
    http = free_ports(3)
    while taken & {http, http + 1, http + 2}:
        http = free_ports(3)
    return {**os.environ, "PYTHON": sys.executable, "PORT": str(port), "HTTP_PORT": str(http),
            "DIR": str(tmp_path / "lc"), "IMAGES": "20", "XDG_CACHE_HOME": str(tmp_path / "xdg"),
            "HEALTH_WAIT": "90", **extra}


def _run(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)


@needs_redis
def test_script_up_status_rerun_restart_down(tmp_path) -> None:
    env = _script_env(tmp_path)
    lc = tmp_path / "lc"
    try:
        out = _run(env, "up")
        assert out.returncode == 0, out.stderr
        assert "[local-cluster] up:" in out.stderr and "started node 0 1 2" in out.stderr
        deadline = time.monotonic() + 90
        lines: list[str] = []
        while time.monotonic() < deadline:  # wait for the fill (bounded: proves no hang)
            st = _run(env, "status", timeout=60)
            lines = st.stdout.strip().splitlines()
            if st.returncode == 0 and len(lines) == 3 and all("100.0%" in ln for ln in lines):
                break
            time.sleep(1)
        assert len(lines) == 3, lines  # one line per node
        for i, ln in enumerate(lines):
            assert ln.startswith(f"node-{i}") and f"127.0.0.1:{int(env['PORT']) + i} up" in ln, ln
            assert "daemon" in ln and " ok " in ln and "100.0%" in ln, ln
        owned = [int(ln.split("cached ")[1].split("/")[1].split()[0]) for ln in lines]
        assert sum(owned) == 23  # 20 generated + 3 photos matplotlib ships, each owned by one node
        # no password-less access; passwords in 0600 files in a 0700 directory, on no command line
        # (masters: hashes only; redis-cli: REDISCLI_AUTH; daemons: ?password_file=) and in no log
        sdir = lc / "secrets"
        secrets = [(sdir / f"{r}.pass").read_text().strip() for r in ROLES]
        assert stat.S_IMODE(sdir.stat().st_mode) == 0o700
        assert all(stat.S_IMODE((sdir / f"{r}.pass").stat().st_mode) == 0o600 for r in ROLES)
        assert all(len(s) >= 32 for s in secrets) and len(set(secrets)) == 3
        assert "NOAUTH" in subprocess.run(["redis-cli", "-p", env["PORT"], "ping"], capture_output=True,
                                          text=True, timeout=10).stdout
        assert _procs_showing(secrets) == []
        daemon_cmd = (f"/proc/{int((lc / 'daemon-0.pid').read_text())}/cmdline")
        with open(daemon_cmd, "rb") as f:
            assert b"datacache-daemon@127.0.0.1:" in f.read()  # the daemons' role, by its file
        logs = b"".join((lc / f"daemon-{i}.log").read_bytes() for i in range(3)) + out.stderr.encode()
        assert not any(s.encode() in logs for s in secrets)
        assert "datacache@127.0.0.1:" in out.stderr and "password_file=" in out.stderr  # the trainers' URL
        url = _redis_local("url", "--dir", str(lc), "--base-port", env["PORT"], "--role", "datacache")
        assert url.returncode == 0 and f"up: {url.stdout.strip()};" in out.stderr  # printed again on demand
        full = json.loads(_run(env, "status", "--json", timeout=60).stdout)
        assert [d["node"] for d in full] == ["node-0", "node-1", "node-2"]
        assert sum(d["status"]["datasets"][0]["owned"] for d in full) == 23
        ds = [d["status"]["datasets"][0] for d in full]
        assert all(d["health"]["ok"] for d in full) and all(x["done"] == x["owned"] for x in ds)
        # everything alive: a re-run says so and starts nothing
        again = _run(env, "up")
        assert again.returncode == 0 and "already up" in again.stderr, again.stderr
        # a dead daemon: the re-run restarts it (and only it)
        pids = [int((lc / f"daemon-{i}.pid").read_text()) for i in range(3)]
        os.kill(pids[2], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pids[2]) and time.monotonic() < deadline:
            time.sleep(0.05)
        st = _run(env, "status", timeout=60)
        assert st.returncode == 1 and "unreachable" in st.stdout.splitlines()[2]
        again = _run(env, "up")
        assert again.returncode == 0 and "started node 2" in again.stderr, again.stderr
        assert "already up" not in again.stderr
        new = [int((lc / f"daemon-{i}.pid").read_text()) for i in range(3)]
        assert new[:2] == pids[:2] and new[2] != pids[2]
        # a daemon that does not drain on SIGTERM (stopped here) is killed with its process group by down
        os.kill(new[0], signal.SIGSTOP)
    finally:
        down = _run({**env, "DOWN_WAIT": "3"}, "down", timeout=120)
    assert down.returncode == 0 and "stopped the local cluster" in down.stdout, down.stderr
    assert "daemon node-0 did not exit within 3 s of SIGTERM: killing its process group" in down.stderr
    assert not lc.exists()  # the script created DIR, so down removes it (nothing else was in it)
    assert _daemons_of(env) == []  # no daemon and no decode-pool child left behind


def _daemons_of(env: dict[str, str]) -> list[int]:
    """Live processes whose command line names one of this cluster's daemon HTTP ports."""
    ports = {f"--http-port\0{int(env['HTTP_PORT']) + i}\0".encode() for i in range(3)}
    found = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [pid for pid in _pids_whose_cmdline_holds(ports) if _alive(pid)]
        if not found:
            break
        time.sleep(0.2)  # killed children may take a moment to be reaped
    return found


@needs_redis
def test_script_reports_a_daemon_that_died_at_start(tmp_path) -> None:
    import socket

    env = _script_env(tmp_path)
    blocker = socket.socket()  # node-1's HTTP port is taken: that daemon cannot start
    blocker.bind(("127.0.0.1", int(env["HTTP_PORT"]) + 1))
    blocker.listen(1)
    try:
        out = _run(env, "up")
        assert out.returncode != 0
        assert "[local-cluster] up:" not in out.stderr and "already up" not in out.stderr
        assert "daemon node-1 exited at start" in out.stderr and "not up" in out.stderr, out.stderr
    finally:
        blocker.close()
        down = _run(env, "down", timeout=90)
    assert down.returncode == 0


def test_up_without_redis_server_says_what_to_install(tmp_path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()  # a PATH with no redis-server / redis-cli on it
    d = tmp_path / "lc"
    out = subprocess.run([sys.executable, "-m", "datacache.devtools.redis_local", "up", "--dir", str(d),
                          "--base-port", str(free_ports(3))], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO, "PATH": str(empty_bin)})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["cannot start the local cluster: redis-server and redis-cli "
                                               "not installed (apt-get install redis-server)"]
    assert not d.exists()  # nothing created either


def test_script_without_python_uses_quickstarts_interpreter(tmp_path) -> None:
    if sys.prefix == sys.base_prefix:
        pytest.skip("the test interpreter is not in a virtual environment (quickstart would create .venv)")
    d = tmp_path / "data"
    d.mkdir()
    (d / "keep").write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(VIRTUAL_ENV=sys.prefix, PORT=str(free_ports(3)), HTTP_PORT=str(free_ports(3)), DIR=str(d))
    out = subprocess.run([SCRIPT, "up"], env=env, capture_output=True, text=True, timeout=120)
    # quickstart.sh's rule picked the active venv's interpreter, which had everything (no install),
    # and that interpreter ran redis_local, which refused the foreign directory
    assert f"[quickstart] using the active virtual environment: {sys.prefix}/bin/python" in out.stderr
    assert "installing" not in out.stderr and "not empty" in out.stderr and out.returncode != 0
    assert os.listdir(d) == ["keep"]


@needs_redis
def test_up_with_a_taken_port_is_one_line_and_down_cleans(tmp_path) -> None:
    import socket

    port = free_ports(3)
    blocker = socket.socket()  # the second master's port is taken by someone else
    blocker.bind(("127.0.0.1", port + 1))
    blocker.listen(1)
    d = tmp_path / "lc"
    try:
        out = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    finally:
        blocker.close()
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and f"port {port + 1}" in out.stderr, out.stderr
    # the port is free again: a re-run starts over in its own directory
    again = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    assert again.returncode == 0 and again.stdout.startswith("redis+cluster://"), again.stderr
    assert _redis_local("down", "--dir", str(d)).returncode == 0
    assert not d.exists()


@needs_redis
def test_script_demo_runs_as_the_trainers_role_with_no_acl_denial(tmp_path) -> None:
    env = _script_env(tmp_path)
    lc = tmp_path / "lc"
    try:
        out = _run(env, "demo", "--epochs", "1", "--workers", "1", "--no-progress", timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "epoch 1:" in out.stdout and "datacache@127.0.0.1:" in out.stdout  # the trainers' role
        secrets = [(lc / "secrets" / f"{r}.pass").read_text().strip() for r in ROLES]
        assert not any(s in out.stdout + out.stderr for s in secrets)
        # the daemons (datacache-daemon) and the demo (datacache) sent nothing their role refuses
        for i in range(3):
            assert _admin_cli(lc, int(env["PORT"]) + i, "acl", "log").strip() == ""
    finally:
        down = _run(env, "down", timeout=120)
    assert down.returncode == 0 and not lc.exists()
