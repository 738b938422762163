"""deploy/: what can be validated here is validated for real.

* the systemd unit with ``systemd-analyze verify`` (skipped only when systemd-analyze is missing);
* ``redis.conf`` by starting three real ``redis-server`` processes with it, creating the cluster with
  its admin user, and running the datacache store with its restricted ACL user;
* ``daemon.toml`` and the compose file's daemon environment through the daemon's own config loader;
* the compose file's structure (YAML; the docker engine is not available here) and the Dockerfile;
* ``deploy/local-cluster.sh`` end to end (cluster, 3 daemons filling, down).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from cache_daemon.daemon_config import load_config
from datacache.redis_local import RedisServer, free_port, free_ports
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(REPO, "deploy")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path) -> None:
    with open(os.path.join(DEPLOY, "systemd", "datacache-daemon.service")) as f:
        unit = f.read()
    for key in ("Restart=on-failure", "User=datacache", "/etc/datacache/daemon.toml", "KillSignal=SIGTERM"):
        assert key in unit
    # verify needs an executable that exists here: the same daemon through this interpreter
    local = unit.replace("/usr/local/bin/datacache-daemon", f"{sys.executable} -m cache_daemon")
    path = tmp_path / "datacache-daemon.service"
    path.write_text(local)
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr


def test_daemon_toml_template_loads() -> None:
    cfg = load_config(os.path.join(DEPLOY, "daemon.toml"), env={})
    assert cfg.ownership == "cluster" and cfg.redis_node == "10.0.0.1:7000" and cfg.http_host == "127.0.0.1"
    assert cfg.datasets[0].short_side == 160


def test_compose_file_structure_and_daemon_env() -> None:
    with open(os.path.join(DEPLOY, "docker", "compose.yaml")) as f:
        doc = yaml.safe_load(f)
    svc = doc["services"]
    redis = [n for n in svc if n.startswith("redis-")]
    daemons = [n for n in svc if n.startswith("daemon-")]
    assert len(redis) == 3 and len(daemons) == 3
    addrs = {f"{svc[n]['networks']['cache']['ipv4_address']}:7000" for n in redis}
    create = svc["cluster-create"]
    assert set(create["depends_on"]) == set(redis)
    assert all(v["condition"] == "service_healthy" for v in create["depends_on"].values())
    cmd = create["command"]
    assert "--cluster" in cmd and "create" in cmd and "--cluster-yes" in cmd and addrs <= set(cmd)
    nodes = set()
    for n in daemons:
        d = svc[n]
        assert d["depends_on"]["cluster-create"]["condition"] == "service_completed_successfully"
        assert d["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        env = {k: str(v) for k, v in d["environment"].items()}
        cfg = load_config(None, env=env)  # the daemon accepts exactly this environment
        assert cfg.ownership == "cluster" and cfg.redis_node in addrs
        nodes.add(cfg.redis_node)
        assert all(p.startswith("127.0.0.1:") for p in d["ports"])  # HTTP stays on the host's loopback
    assert nodes == addrs  # one daemon per master


def test_dockerfile_runs_the_daemon_unprivileged() -> None:
    with open(os.path.join(DEPLOY, "docker", "Dockerfile")) as f:
        text = f.read()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.11")
    assert "USER datacache" in lines and any(ln.startswith("HEALTHCHECK") for ln in lines)
    assert 'ENTRYPOINT ["datacache-daemon", "--no-progress"]' in lines and "STOPSIGNAL SIGTERM" in lines
    assert '.[daemon,fast]' in text and "EXPOSE 8470" in lines


@needs_redis
def test_redis_conf_runs_a_cluster_for_the_acl_user(tmp_path) -> None:
    from datacache.stores import open_store

    conf = os.path.join(DEPLOY, "redis", "redis.conf")
    masters = []
    try:
        for _ in range(3):
            port = free_port()
            d = tmp_path / f"n{port}"
            args = [conf, "--port", str(port), "--bind", "127.0.0.1", "--maxmemory", "64mb",
                    "--cluster-config-file", f"nodes-{port}.conf"]
            srv = RedisServer(port, str(d), args)
            masters.append(srv.start())
        admin_auth = ["--user", "admin", "--pass", "CHANGE_ME_ADMIN", "--no-auth-warning"]
        out = subprocess.run(["redis-cli", *admin_auth, "--cluster", "create", *[m.addr for m in masters],
                              "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert "[OK] All 16384 slots covered" in out.stdout, out.stdout + out.stderr

        def admin(port: int, *args: str) -> str:
            return subprocess.run(["redis-cli", "-p", str(port), *admin_auth, *args], capture_output=True,
                                  text=True).stdout

        p = masters[0].port
        assert "noeviction" in admin(p, "config", "get", "maxmemory-policy")
        assert admin(p, "config", "get", "appendonly").split()[-1] == "no"
        assert admin(p, "config", "get", "save").strip().endswith("save")  # save "" = no snapshots
        assert admin(p, "config", "get", "protected-mode").split()[-1] == "yes"
        deadline = time.monotonic() + 20  # every master agrees the cluster is up (not only the first)
        while (not all("cluster_state:ok" in admin(m.port, "cluster", "info") for m in masters)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        url = "redis+cluster://datacache:CHANGE_ME@" + ",".join(m.addr for m in masters)
        s = open_store(url)
        items = [(b"dc:f:v:%d" % i, b"x" * 5000) for i in range(60)]
        assert s.put_many(items) == 60 and s.get_many([k for k, _ in items]) == [v for _, v in items]
        assert s.health()["ok"] and s.stats()["entries"] == 60
        s.status_set(b"dcd:fill:f:v", "n1", b"r")
        assert s.status_get(b"dcd:fill:f:v") == {b"n1": b"r"}
        assert s.put_many([(b"other:key", b"x")]) == 0 and s.counters()["write_errors"] == 1  # NOPERM
        noperm = subprocess.run(["redis-cli", "-p", str(p), "--user", "datacache", "--pass", "CHANGE_ME",
                                 "--no-auth-warning", "flushall"], capture_output=True, text=True).stdout
        assert "NOPERM" in noperm
    finally:
        for m in masters:
            m.stop()


@needs_redis
def test_local_cluster_script_up_fill_down(tmp_path) -> None:
    port = free_ports(3)  # PORT..PORT+2 and their bus ports, as the script uses them
    taken = {port + i + bus for i in range(3) for bus in (0, 10000)}
    http = free_ports(3)
    while taken & {http, http + 1, http + 2}:
        http = free_ports(3)
    env = {**os.environ, "PYTHON": sys.executable, "PORT": str(port), "HTTP_PORT": str(http),
           "DIR": str(tmp_path / "lc"), "IMAGES": "30", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    script = os.path.join(DEPLOY, "local-cluster.sh")
    try:
        out = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 60
        fills = []
        while time.monotonic() < deadline:
            try:
                fills = [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http + i}/status",
                                                           timeout=2).read()) for i in range(3)]
                if all(f["datasets"] and f["datasets"][0]["status"] == "full" for f in fills):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert sum(f["datasets"][0]["owned"] for f in fills) == 33  # 30 generated + 3 shipped photos
        assert all(f["datasets"][0]["cluster"]["full"] for f in fills)
    finally:
        down = subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "stopped the local cluster" in down.stdout
