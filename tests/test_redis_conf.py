"""deploy/redis/redis.conf for real: three redis-server masters started with the file (port, bind and
memory adapted to a temp dir), joined with its admin user; then, as its restricted ``datacache`` user,
every path the stores, the fill reports and a real cache daemon use must work with no ACL denial at all
(``ACL LOG`` stays empty on every master), and the commands that list key names or destroy data are
refused with NOPERM. The output buffers for normal clients are bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from datacache.redis_local import RedisServer, free_port, free_ports
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "deploy", "redis", "redis.conf")
ADMIN = ["--user", "admin", "--pass", "CHANGE_ME_ADMIN", "--no-auth-warning"]
USER = ["--user", "datacache", "--pass", "CHANGE_ME", "--no-auth-warning"]

FORBIDDEN = [
    ["scan", "0"], ["keys", "*"], ["cluster", "getkeysinslot", "0", "10"], ["script", "flush"],
    ["eval", "return 1", "0"], ["flushall"], ["flushdb"], ["config", "get", "maxmemory"],
    ["debug", "sleep", "0"], ["del", "dc:x"], ["unlink", "dc:x"], ["monitor"], ["client", "list"],
    ["client", "kill", "127.0.0.1:1"], ["acl", "list"], ["shutdown", "nosave"], ["cluster", "reset"],
    ["cluster", "nodes"], ["randomkey"], ["object", "encoding", "dc:x"], ["save"], ["bgsave"],
]


def _cli(port: int, auth: list[str], *args: str) -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), *auth, *args], capture_output=True, text=True,
                         timeout=15)
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def conf_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conf")
    masters: list[RedisServer] = []
    try:
        for _ in range(3):
            port = free_port()
            args = [CONF, "--port", str(port), "--bind", "127.0.0.1", "--maxmemory", "64mb",
                    "--cluster-config-file", f"nodes-{port}.conf"]
            masters.append(RedisServer(port, str(tmp / f"n{port}"), args).start())
        out = subprocess.run(["redis-cli", *ADMIN, "--cluster", "create", *[m.addr for m in masters],
                              "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert "[OK] All 16384 slots covered" in out.stdout, out.stdout + out.stderr
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in _cli(m.port, ADMIN, "cluster", "info") for m in masters):
            assert time.monotonic() < deadline, "cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        for m in masters:
            _cli(m.port, ADMIN, "acl", "log", "reset")
        yield masters
    finally:
        for m in masters:
            m.stop()


def _acl_denials(masters: list[RedisServer]) -> dict[int, str]:
    logs = {m.port: _cli(m.port, ADMIN, "acl", "log").strip() for m in masters}
    return {p: log for p, log in logs.items() if log}


@needs_redis
def test_output_buffers_for_normal_clients_are_bounded(conf_cluster) -> None:
    limits = _cli(conf_cluster[0].port, ADMIN, "config", "get", "client-output-buffer-limit")
    assert "normal 268435456 67108864 60" in limits, limits


@needs_redis
def test_store_daemon_and_fill_paths_work_as_the_datacache_user(conf_cluster, tmp_path) -> None:
    from datacache import synth
    from datacache.fillstatus import read_fill, report_fill, summarize
    from datacache.stores import open_store

    masters = conf_cluster
    url = "redis+cluster://datacache:CHANGE_ME@" + ",".join(m.addr for m in masters)
    s = open_store(url)
    try:
        # 40 x 100 KB: get_many's replies span several fetch_bytes (2 MiB) round trips per master
        items = [(b"dc:f:v:%d" % i, os.urandom(100_000)) for i in range(40)]
        assert s.put_many(items) == 40
        assert [bytes(v) for v in s.get_many([k for k, _ in items])] == [v for _, v in items]
        assert s.contains([b"dc:f:v:0", b"dc:f:v:missing"]) == [True, False]
        assert s.put_many(items[:3]) == 0  # SET NX: already there
        assert s.health()["ok"] and s.stats()["entries"] >= 40
        report_fill(s, "0123456789abcdef", "t160", "n1", owned=10, done=4, quarantined=0, total=20, rate=1.5)
        fill = read_fill(s, "0123456789abcdef", "t160")
        assert fill["n1"]["done"] == 4 and summarize(fill, 20)["done"] == 4
        # the registry of POST / DELETE /datasets (HSET, HGETALL, HDEL on dcd:datasets)
        from cache_daemon.daemon_config import DatasetSpec
        from cache_daemon.registry import register, registered, unregister

        spec = DatasetSpec(source=str(tmp_path / "reg"))
        register(s, spec, max_registrations=4)
        assert [d.ident() for d in registered(s, (str(tmp_path),))] == [spec.ident()]
        assert unregister(s, spec.ident()) and registered(s, (str(tmp_path),)) == []
        assert s.counters()["write_errors"] == 0 and s.counters()["read_errors"] == 0
    finally:
        s.close()
    # a real cache daemon as the datacache user fills its node's share of a small dataset and exits
    src = str(tmp_path / "ds")
    synth.make_imagefolder(src, classes=2, per_class=6, size=(120, 90))
    http = free_ports(1)
    out = subprocess.run(
        [sys.executable, "-m", "cache_daemon", "--cache", url, "--redis-node", masters[0].addr,
         "--node", "n0", "--dataset", src, "--http-port", str(http), "--workers", "1", "--once",
         "--no-progress", "--poll-interval", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOPERM" not in out.stderr
    # the idle pass's presence stamp (INFO sections, COUNTKEYSINSLOT) works as that user: a second pass
    # over the full share skips the per-key check
    import threading

    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.ingest import DatasetState, ingest_pass

    cfg = DaemonConfig(cache=url, node="n0", redis_node=masters[0].addr, workers=1, t1_dir="none")
    state, s = DatasetState(DatasetSpec(source=src)), open_store(url)
    try:
        for _ in range(2):
            ingest_pass(cfg, state, s, decoder=None, stop=threading.Event(), progress=False)
    finally:
        s.close()
    assert state.status == "full" and state.shortcut_passes == 1, state
    # nothing any of that sent was refused by the ACL on any master
    assert _acl_denials(masters) == {}


@needs_redis
@pytest.mark.parametrize("cmd", FORBIDDEN, ids=[" ".join(c[:2]) for c in FORBIDDEN])
def test_datacache_user_is_refused_what_lists_keys_or_destroys(conf_cluster, cmd: list[str]) -> None:
    port = conf_cluster[0].port
    # the ACL itself denies it (asked of the server without running it) ...
    dry = _cli(port, ADMIN, "acl", "dryrun", "datacache", *cmd)
    assert "no permissions" in dry, (cmd, dry)
    # ... and sent for real as the user it is refused (DEBUG is refused even before the ACL)
    reply = _cli(port, USER, *cmd)
    assert "NOPERM" in reply or (cmd[0] == "debug" and "not allowed" in reply), (cmd, reply)
    assert conf_cluster[0].proc is not None and conf_cluster[0].proc.poll() is None  # shutdown refused


@needs_redis
def test_datacache_user_keys_outside_its_prefixes_are_refused(conf_cluster) -> None:
    port = conf_cluster[0].port
    assert "NOPERM" in _cli(port, USER, "get", "other:key")
    assert "NOPERM" in _cli(port, USER, "set", "other:key", "1")
