"""deploy/: what can be validated here is validated for real.

* the systemd unit with ``systemd-analyze verify`` (skipped only when systemd-analyze is missing);
* ``redis.conf`` as the compose file uses it: filled by the documented ``make_secrets`` command, three
  real ``redis-server`` processes started with the compose command, its health check, its cluster-create
  step (as admin, password from the secret file) and the daemons' role (tests/test_redis_conf.py runs
  every role's real code path);
* ``daemon.toml`` and the compose file's daemon environment through the daemon's own config loader, with
  the secret files the documented command makes (and the template refusing to start without them);
* the compose file's structure (YAML; the docker engine is not available here): no password literal,
  Docker secrets, health checks, and the Dockerfile;
* ``deploy/local-cluster.sh`` end to end (cluster, 3 daemons filling, down).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from cache_daemon.daemon_config import load_config
from datacache.devtools.redis_local import RedisServer, free_port, free_ports
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


def _make_secrets(out_dir, *extra: str) -> subprocess.CompletedProcess:
    """The documented command: ``python -m datacache.make_secrets DIR [--redis-conf TEMPLATE]``."""
    return subprocess.run([sys.executable, "-m", "datacache.make_secrets", str(out_dir), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})


def test_daemon_toml_template_refuses_to_start_until_its_password_file_exists(tmp_path) -> None:
    from datacache.config import ConfigError

    template = os.path.join(DEPLOY, "daemon.toml")
    with open(template) as f:
        text = f.read()
    assert not [ln for ln in text.splitlines() if "CHANGE_ME" in ln.split("#", 1)[0]]  # no placeholder value
    assert not re.search(r"redis(\+cluster)?://[^@\s\"]*:[^@\s\"]*@", text)  # no user:password@ anywhere
    with pytest.raises(ConfigError, match=r"key 'cache'.*/etc/datacache/secrets/datacache-daemon\.pass"
                                          r".*make_secrets"):
        load_config(template, env={})  # the file is not there: refused, naming it and how to make it
    assert _make_secrets(tmp_path / "s").returncode == 0
    local = tmp_path / "daemon.toml"
    local.write_text(text.replace("/etc/datacache/secrets", str(tmp_path / "s")))
    cfg = load_config(str(local), env={})
    assert cfg.ownership == "cluster" and cfg.redis_node == "10.0.0.1:7000" and cfg.http_host == "127.0.0.1"
    assert cfg.datasets[0].short_side == 160 and cfg.cache.startswith("redis+cluster://datacache-daemon@")


COMPOSE = os.path.join(DEPLOY, "docker", "compose.yaml")
MAKE_SECRETS_CMD = ("python -m datacache.make_secrets deploy/docker/secrets --redis-conf "
                    "deploy/redis/redis.conf")
# the daemons' API token: a file (Docker secret api_token), never an environment variable
API_TOKEN_CMD = ("test -s deploy/docker/secrets/api-token || (umask 077; head -c 32 /dev/urandom | base64 "
                 "> deploy/docker/secrets/api-token)")


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation for what the file uses: ${VAR:-default}, ${VAR:?error}, $$."""
    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value).replace("$$", "$")


def _make_api_token(secrets_dir) -> None:
    """The compose file's (and docs/deploy.md's) documented token command, run as written (the directory
    -> ``secrets_dir``), twice: the second run keeps the token, 0600."""
    cmd = API_TOKEN_CMD.replace("deploy/docker/secrets", str(secrets_dir))
    tokens = []
    for _ in range(2):
        subprocess.run(["sh", "-c", cmd], check=True, timeout=60)
        with open(os.path.join(str(secrets_dir), "api-token")) as f:
            tokens.append(f.read())
    assert tokens[0] == tokens[1] and len(tokens[0].strip()) >= 32  # made once, then reused
    assert os.stat(os.path.join(str(secrets_dir), "api-token")).st_mode & 0o777 == 0o600


def _compose(tmp_path) -> tuple[dict, dict[str, str]]:
    """The compose file and its secrets as the documented command makes them (in a temp copy of
    deploy/docker/secrets): secret name -> host file."""
    with open(COMPOSE) as f:
        doc = yaml.safe_load(f)
    out = _make_secrets(tmp_path / "secrets", "--redis-conf", os.path.join(DEPLOY, "redis", "redis.conf"))
    assert out.returncode == 0, out.stderr
    _make_api_token(tmp_path / "secrets")
    files = {}
    for name, spec in doc["secrets"].items():
        rel = spec["file"]
        assert rel.startswith("./secrets/"), rel  # relative to deploy/docker: the documented directory
        files[name] = str(tmp_path / "secrets" / rel[len("./secrets/"):])
        assert os.path.exists(files[name]), f"the documented command does not make {rel}"
    return doc, files


def test_compose_file_has_no_password_and_uses_docker_secrets(tmp_path) -> None:
    with open(COMPOSE) as f:
        text = f.read()
    assert MAKE_SECRETS_CMD in text  # documented before `docker compose up`
    assert text.index(MAKE_SECRETS_CMD) < text.index("docker compose -f deploy/docker/compose.yaml up")
    assert API_TOKEN_CMD in text and text.index(API_TOKEN_CMD) < text.index("docker compose -f")
    assert "CHANGE_ME" not in text and "--pass" not in text and "requirepass" not in text
    assert not re.search(r"redis(\+cluster)?://[^@\s\"]*:[^@\s\"]*@", text)  # no user:password@
    doc, files = _compose(tmp_path)
    svc = doc["services"]
    for name, s in svc.items():
        # everything runs as the owner of the secret files (compose bind-mounts them with host modes)
        with pytest.raises(KeyError, match="DATACACHE_UID"):
            _interpolate(s["user"], {})
        assert _interpolate(s["user"], {"DATACACHE_UID": "1000", "DATACACHE_GID": "1000"}) == "1000:1000"
        assert name == "cluster-create" or s.get("tmpfs"), name  # a writable dir for that uid
        for secret in s.get("secrets", []):
            assert secret in doc["secrets"], (name, secret)
    assert {stat_mode(p) for p in files.values()} == {0o600}
    # the redis servers read the filled config; nothing else of theirs holds a credential
    for n in ("redis-1", "redis-2", "redis-3"):
        assert svc[n]["secrets"] == ["redis_conf"] and "/run/secrets/redis_conf" in svc[n]["command"]
        assert "environment" not in svc[n]
    assert svc["cluster-create"]["secrets"] == ["admin_pass"]
    assert "REDISCLI_AUTH" in " ".join(svc["cluster-create"]["entrypoint"])  # never an argument
    for n in ("daemon-1", "daemon-2", "daemon-3"):
        d = svc[n]
        assert d["secrets"] == ["datacache_daemon_pass", "api_token"]
        # the API token is a Docker secret read through api_token_file, never in the environment (which
        # `docker inspect` shows to anyone allowed to inspect the container)
        assert d["environment"]["DATACACHE_DAEMON_API_TOKEN_FILE"] == "/run/secrets/api_token"
        assert not any("TOKEN" in k and not k.endswith("_FILE") for k in d["environment"]), d["environment"]
        assert "/livez" in " ".join(d["healthcheck"]["test"])  # the daemon's own loop alive
        cache = d["environment"]["DATACACHE_DAEMON_CACHE"]
        assert cache.startswith("redis+cluster://datacache-daemon@")  # the daemons' role, not trainers'
        assert cache.endswith("?password_file=/run/secrets/datacache_daemon_pass")


def test_generated_compose_secrets_are_git_ignored() -> None:
    for name in ("admin.pass", "datacache-daemon.pass", "datacache.pass", "users.acl", "redis.conf",
                 "api-token"):
        path = os.path.join("deploy", "docker", "secrets", name)
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO, timeout=30)
        assert out.returncode == 0, f"{path} would be committable"
    keep = "deploy/docker/secrets/.gitignore"
    out = subprocess.run(["git", "check-ignore", "-q", keep], cwd=REPO, timeout=30)
    assert out.returncode == 1  # the ignore file itself is kept


def stat_mode(path: str) -> int:
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def test_compose_file_structure_and_daemon_env(tmp_path) -> None:
    doc, files = _compose(tmp_path)
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
        # the daemon accepts exactly this environment, compose-interpolated, with its secret where
        # compose mounts it (/run/secrets/<name>: here the file the documented command made)
        env = {k: _interpolate(str(v), {}) for k, v in d["environment"].items() if k.startswith("DATACACHE_")}
        for name, path in files.items():
            env = {k: v.replace(f"/run/secrets/{name}", path) for k, v in env.items()}
        cfg = load_config(None, env=env)
        assert cfg.ownership == "cluster" and cfg.redis_node in addrs
        with open(files["api_token"]) as f:  # the token comes from the secret file, whole
            assert cfg.api_token == f.read().strip() and len(cfg.api_token) >= 32
        assert cfg.allowed_sources == ("/data",)
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
def test_compose_redis_healthcheck_cluster_create_and_daemon_role_for_real(tmp_path) -> None:
    """The compose file's own commands, run here: redis-server with the filled config, the health check
    (up without a credential), the cluster-create step (admin, password from its secret file) and the
    daemons' role from its secret file. Only what docker provides is substituted: addresses, the
    /run/secrets mount, the tmpfs dir."""
    from datacache.stores import open_store

    doc, files = _compose(tmp_path)
    svc = doc["services"]
    mounts = {f"/run/secrets/{name}": path for name, path in files.items()}

    def local(args: list[str], addr_map: dict[str, str]) -> list[str]:
        out = []
        for a in args:
            a = _interpolate(a, {})
            for old, new in {**mounts, **addr_map}.items():
                a = a.replace(old, new)
            out.append(a)
        return out

    masters = []
    try:
        addr_map = {}
        for n in ("redis-1", "redis-2", "redis-3"):
            port = free_port()
            addr_map[f"{svc[n]['networks']['cache']['ipv4_address']}:7000"] = f"127.0.0.1:{port}"
            argv = local(svc[n]["command"], {"/data": str(tmp_path / n)})
            assert argv[0] == "redis-server"
            os.makedirs(tmp_path / n)
            masters.append(RedisServer(port, str(tmp_path / n), [*argv[1:], "--port", str(port), "--bind",
                                                                  "127.0.0.1"]).start())
            check = svc[n]["healthcheck"]["test"]
            assert check[0] == "CMD-SHELL"
            hc = subprocess.run(["sh", "-c", check[1].replace("-p 7000", f"-p {port}")], timeout=30)
            assert hc.returncode == 0  # healthy: it answers (NOAUTH), no credential needed
        create = svc["cluster-create"]
        argv = local([*create["entrypoint"], *create["command"]], addr_map)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=90)
        assert "[OK] All 16384 slots covered" in out.stdout, out.stdout + out.stderr
        with open(files["admin_pass"]) as f:
            admin = f.read().strip()
        assert admin not in " ".join(argv)  # the password was never an argument
        deadline = time.monotonic() + 20
        env = {**os.environ, "REDISCLI_AUTH": admin}
        while time.monotonic() < deadline and not all(
                "cluster_state:ok" in subprocess.run(["redis-cli", "-p", str(m.port), "--user", "admin",
                                                      "--no-auth-warning", "cluster", "info"],
                                                     capture_output=True, text=True, env=env).stdout
                for m in masters):
            time.sleep(0.1)
        # the daemons' URL, as daemon-1's environment gives it, works for the daemons' keys
        url = local([svc["daemon-1"]["environment"]["DATACACHE_DAEMON_CACHE"]], addr_map)[0]
        s = open_store(url)
        try:
            items = [(b"dc:f:v:%d" % i, b"x" * 5000) for i in range(60)]
            assert s.put_many(items) == 60 and s.get_many([k for k, _ in items]) == [v for _, v in items]
            assert s.health()["ok"] and s.stats()["entries"] == 60
            s.status_set(b"dcd:fill:f:v", "n1", b"r")
            assert s.status_get(b"dcd:fill:f:v") == {b"n1": b"r"}
            assert s.put_many([(b"other:key", b"x")]) == 0 and s.counters()["write_errors"] == 1  # NOPERM
        finally:
            s.close()
        p = masters[0].port
        admin_cli = ["redis-cli", "-p", str(p), "--user", "admin", "--no-auth-warning"]
        assert "noeviction" in subprocess.run([*admin_cli, "config", "get", "maxmemory-policy"],
                                              capture_output=True, text=True, env=env).stdout
        assert "2147483648" in subprocess.run([*admin_cli, "config", "get", "maxmemory"], capture_output=True,
                                              text=True, env=env).stdout  # the compose command's 2gb
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
                # each node's own status and its cluster summary (every peer's report, published
                # by that peer when it finished): the nodes finish at different moments
                if all(f["datasets"] and f["datasets"][0]["status"] == "full"
                       and (f["datasets"][0]["cluster"] or {}).get("full") for f in fills):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert sum(f["datasets"][0]["owned"] for f in fills) == 33  # 30 generated + 3 shipped photos
        assert all(f["datasets"][0]["cluster"]["full"] for f in fills)
    finally:
        down = subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "stopped the local cluster" in down.stdout
