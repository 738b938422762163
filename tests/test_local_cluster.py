"""deploy/local-cluster.sh and ``python -m datacache.redis_local``: never touch a directory they did not
create, clean only what they wrote, report dead daemons, restart what is missing, one-line status.

Everything runs for real: redis-server processes, the cache daemons as subprocesses, the shell script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from datacache.redis_local import MARKER, free_ports
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "deploy", "local-cluster.sh")


def _redis_local(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datacache.redis_local", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


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
    # a re-run finds it alive: no second cluster, same url
    again = _redis_local("up", "--dir", str(d), "--base-port", str(port))
    assert again.returncode == 0 and again.stdout.strip() == state["url"] and "already up" in again.stderr
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
        info = subprocess.run(["redis-cli", "-p", str(port + 1), "cluster", "info"], capture_output=True,
                              text=True, timeout=10).stdout
        assert "cluster_state:ok" in info
    finally:
        _redis_local("down", "--dir", str(d))
