"""bench/emucluster.py for real: namespaces, a bridge, tbf-shaped veths, 3 redis-server masters formed
into a Redis Cluster across the node addresses, 3 cache daemons filling a generated dataset, a client in
node 0's namespace, teardown (also after a failed or interrupted ``up``).

Skipped with the reason where namespaces cannot be made (not root, no ip/tc, no redis-server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench.emucluster import (
    DAEMON_TEMPLATE,
    IF_PREFIX,
    PREFIX,
    REDIS_TEMPLATE,
    REPO,
    STATE,
    EmuCluster,
    EmuConfig,
    EmuError,
    fill_daemon_toml,
    fill_redis_conf,
    why_unavailable,
)
from cache_daemon.daemon_config import load_config
from datacache.redis_roles import DAEMON

SKIP = why_unavailable()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster: {SKIP}"), pytest.mark.netns]
IMAGES = 60


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _leftovers(tag: str, pids: list[int]) -> list[str]:
    """Anything of run ``tag`` still alive: namespaces, host links, processes."""
    left = [n for n in _ip("netns", "list").split() if n.startswith(f"{PREFIX}{tag}")]
    left += [ln for ln in _ip("-o", "link", "show").splitlines() if f"{IF_PREFIX}{tag}" in ln]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(f"pid {pid}")
        except OSError:
            pass
    return left


def _all_pids(c: EmuCluster) -> list[int]:
    return [p for ps in c.state.get("pids", {}).values() for p in ps]


def _scan_count(c: EmuCluster, node: int, pattern: str) -> int:
    out = c.redis_cli(node, "--scan", "--pattern", pattern, check=True).stdout
    return len([ln for ln in out.splitlines() if ln.strip()])


def _wait_full(c: EmuCluster, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        sts = [c.daemon_get(i, "/status")[1] for i in range(3)]
        if all(s and s["datasets"] and s["datasets"][0]["status"] == "full" for s in sts):
            return sts
        assert time.monotonic() < deadline, f"daemons did not fill within {timeout} s: {sts}"
        time.sleep(0.5)


def _assert_cluster(c: EmuCluster) -> None:
    st = c.status()
    assert [n["ok"] for n in st] == [True] * 3, st
    masters = c.cluster_masters()
    assert sorted(m["addr"] for m in masters) == sorted(f"{a}:7000" for a in c.addrs)
    assert sum(m["slots"] for m in masters) == 16384 and all(m["slots"] > 5000 for m in masters)


def _tbf_rates(ns: str, dev: str) -> list[int]:
    out = json.loads(_ip("-n", ns, "-j", "link", "show", "dev", dev))  # the device exists there
    assert out
    q = subprocess.run(["ip", "netns", "exec", ns, "tc", "-j", "qdisc", "show", "dev", dev],
                       capture_output=True, text=True, check=True).stdout
    return [int(x["options"]["rate"]) for x in json.loads(q) if x.get("kind") == "tbf"]


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmuCluster]:
    d = str(tmp_path_factory.mktemp("emu") / "state")
    c = EmuCluster(EmuConfig(state_dir=d, rate_gbit=1.0, images=IMAGES))
    c.up()
    try:
        yield c
    finally:
        c.down()


def test_shaped_cluster_is_healthy_and_links_capped_both_ways(shaped: EmuCluster) -> None:
    c = shaped
    _assert_cluster(c)
    for i in range(3):
        # 1 Gbit/s = 125,000,000 bytes/s on the node's egress and on the switch's egress towards it
        assert _tbf_rates(c.ns(i), c.ifname(i)) == [125_000_000]
        assert _tbf_rates(c.state["switch"], c.state["switch_ifnames"][i]) == [125_000_000]
    # the addresses exist only inside our namespaces, never in the host's
    host = _ip("-o", "-4", "addr", "show")
    assert not any(a in host for a in c.addrs)
    # the CLI status of this state dir agrees (another process, as a user would run it)
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "status", "--dir", c.dir],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert [n["cluster_state"] for n in json.loads(r.stdout)] == ["ok"] * 3


def test_daemons_fill_their_share_of_the_dataset(shaped: EmuCluster) -> None:
    c = shaped
    sts = _wait_full(c)
    fp = sts[0]["datasets"][0]["fingerprint"]
    assert {s["datasets"][0]["fingerprint"] for s in sts} == {fp}
    assert sorted(s["node"] for s in sts) == ["node-0", "node-1", "node-2"]
    assert sum(s["datasets"][0]["owned"] for s in sts) == IMAGES
    on_master = [_scan_count(c, i, f"dc:{fp}:*") for i in range(3)]
    assert sum(on_master) == IMAGES
    # each master holds about its third of the slots' keys (exact counts vary with the fingerprint)
    # (binomial(60, 1/3): 20 +- 3.7; these bounds are ~3.5 standard deviations out)
    assert all(0.10 * IMAGES <= n <= 0.60 * IMAGES for n in on_master), on_master
    # and each daemon ingested exactly the keys its own master serves
    assert [s["datasets"][0]["owned"] for s in sts] == on_master


_CLIENT = """
import json, sys
from datacache.stores import open_store
s = open_store(sys.argv[1])
items = [(b"dc:emutest:v:%d" % i, bytes([i % 251]) * 20000) for i in range(150)]
wrote = s.put_many(items, overwrite=True)
got = s.get_many([k for k, _ in items])
print(json.dumps({"wrote": wrote, "same": got == [v for _, v in items]}))
"""


def test_client_in_node0_reads_and_writes_all_masters_and_counters_move(shaped: EmuCluster) -> None:
    c = shaped
    before = c.link_counters()
    # a writer (the daemons' role: trainers read, daemons write -- the trainers' role could not write)
    p = c.run_on(0, [sys.executable, "-c", _CLIENT, c.cache_url(user=DAEMON)], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"wrote": 150, "same": True}
    per_master = [_scan_count(c, i, "dc:emutest:*") for i in range(3)]
    assert sum(per_master) == 150 and all(n > 0 for n in per_master), per_master
    after = c.link_counters()
    # node 0's own master is reached over its loopback; the other two masters' values cross its veth
    remote_bytes = (per_master[1] + per_master[2]) * 20000
    assert after[0]["tx_bytes"] - before[0]["tx_bytes"] >= remote_bytes
    for i in (1, 2):
        assert after[i]["rx_bytes"] - before[i]["rx_bytes"] >= per_master[i] * 20000


_ENV_PROBE = """
import json, os, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"PING\\r\\n")
reply = s.recv(64).decode()
print(json.dumps({"env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "NODE_RANK")},
                  "ifs": sorted(os.listdir("/sys/class/net")), "reply": reply, "local": s.getsockname()[0]}))
"""


def test_run_on_starts_a_process_in_the_node_namespace(shaped: EmuCluster) -> None:
    c = shaped
    p = c.run_on(1, [sys.executable, "-c", _ENV_PROBE, c.addrs[2], "7000"], stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    got = json.loads(out.splitlines()[-1])
    assert got["env"] == {"GLOO_SOCKET_IFNAME": c.ifname(1), "MASTER_ADDR": c.addrs[0], "NODE_RANK": "1"}
    assert got["ifs"] == sorted(["lo", c.ifname(1)])  # node 1's namespace: its loopback and its veth
    assert got["local"] == c.addrs[1]  # it reached node 2 from node 1's address
    assert got["reply"].startswith("-NOAUTH")  # node 2's master answers (the default user is off)
    with pytest.raises(EmuError, match=r"node must be 0\.\.2"):
        c.run_on(3, ["true"])


def test_links_are_capped_and_reshaped(shaped: EmuCluster) -> None:
    c = shaped
    # an upper bound on throughput only (load can only make it slower): unshaped veths do > 5 Gbit/s here
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "links", "--mb", "16", "--dir", c.dir],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    links = json.loads(r.stdout)["links"]
    assert [(x["src"], x["dst"]) for x in links] == [(0, 1), (1, 2), (2, 0)]
    assert all(0 < x["gbit_s"] < 1.5 for x in links), links
    c.set_rate(0.25)
    try:
        assert _tbf_rates(c.ns(2), c.ifname(2)) == [31_250_000]
        assert _tbf_rates(c.state["switch"], c.state["switch_ifnames"][0]) == [31_250_000]
        assert c.throughput_gbit(2, 0, 4 << 20) < 0.4
    finally:
        c.set_rate(1.0)


_RANK = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
                  "ifname": os.environ["GLOO_SOCKET_IFNAME"], "node": os.environ["NODE_RANK"]}))
dist.destroy_process_group()
"""


def test_torchrun_ranks_on_three_nodes_all_reduce(shaped: EmuCluster, tmp_path) -> None:
    c = shaped
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    agents = [c.run_on(i, c.torchrun_argv(i, [str(script)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True) for i in range(3)]
    outs = []
    for a in agents:
        out, err = a.communicate(timeout=120)
        assert a.returncode == 0, err[-2000:]
        outs.append(json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]))
    assert sorted(o["rank"] for o in outs) == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 6.0 for o in outs)
    assert [(o["node"], o["ifname"]) for o in outs] == [(str(i), c.ifname(i)) for i in range(3)]


def test_status_reports_a_dead_node(shaped: EmuCluster) -> None:
    c = shaped
    redis_pid, daemon_pid = c.state["pids"]["2"]
    for pid in (daemon_pid, redis_pid):
        os.kill(pid, signal.SIGKILL)
    for p in c._procs:
        if p.pid in (daemon_pid, redis_pid):
            p.wait(10)
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "status", "--dir", c.dir],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                       timeout=60)
    assert r.returncode == 1  # not every node is healthy
    nodes = json.loads(r.stdout)
    assert [(n["redis"], n["cluster_state"]) for n in nodes[:2]] == [(True, "ok")] * 2, json.dumps(nodes)
    assert (nodes[2]["redis"], nodes[2]["daemon_health"], nodes[2]["ok"]) == (False, None, False)
    # the surviving daemons stay healthy: /health is live and ready, and their own masters answer (the
    # lost master shows in their /status, not as a failed probe that would restart every daemon)
    assert [n["daemon_health"] for n in nodes[:2]] == [True, True]


def test_shaped_down_leaves_nothing(shaped: EmuCluster) -> None:
    c = shaped
    tag, pids, d = c.state["tag"], _all_pids(c), c.dir
    assert len(pids) == 6  # 3 redis-servers + 3 daemons
    c.down()
    assert _leftovers(tag, pids) == []
    assert not os.path.exists(os.path.join(d, STATE))
    assert c.down() == []  # idempotent


def test_fast_mode_up_and_cli_down(tmp_path) -> None:
    d = str(tmp_path / "state")
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "up", "--fast", "--dir", d],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    c = EmuCluster.load(d)
    tag, pids = c.state["tag"], _all_pids(c)
    try:
        assert c.state["rate_gbit"] is None
        _assert_cluster(c)  # the services outlived the `up` command
        for i in range(3):
            assert _tbf_rates(c.ns(i), c.ifname(i)) == []
            assert _tbf_rates(c.state["switch"], c.state["switch_ifnames"][i]) == []
    finally:
        r = subprocess.run([sys.executable, "-m", "bench.emucluster", "down", "--dir", d],
                           capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0 and tag in r.stdout, r.stdout + r.stderr
    assert _leftovers(tag, pids) == []
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "status", "--dir", d], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=60)
    assert r.returncode == 2 and "no emulated cluster is up" in r.stderr


def _tags_now() -> set[str]:
    return {n.split("-")[1] for n in _ip("netns", "list").split() if n.startswith(PREFIX)}


@pytest.mark.netns_exclusive  # compares or removes every emulated cluster of the machine
def test_failure_during_up_tears_everything_down(tmp_path) -> None:
    # a daemon template with a typo'd key: namespaces, links, the 3 masters and the cluster are built,
    # then each daemon exits with its ConfigError; up must raise and remove everything it made
    bad = tmp_path / "daemon.toml"
    with open(DAEMON_TEMPLATE) as f:
        bad.write_text("http_prot = 1\n" + f.read())
    before = _tags_now()
    c = EmuCluster(EmuConfig(state_dir=str(tmp_path / "state"), rate_gbit=1.0, daemon_template=str(bad),
                             timeout=30))
    with pytest.raises(EmuError, match=r"daemon on node 0 did not become healthy.*http_prot"):
        c.up()
    assert _leftovers(c.state["tag"], _all_pids(c)) == [] and _tags_now() == before
    assert len(_all_pids(c)) == 6  # it really got as far as the daemons


def test_bad_redis_template_mid_up_tears_down(tmp_path) -> None:
    bad = tmp_path / "redis.conf"
    bad.write_text("port 7000\n")  # no ACL placeholders: fails after the network is built
    c = EmuCluster(EmuConfig(state_dir=str(tmp_path / "state"), redis_template=str(bad)))
    with pytest.raises(EmuError, match="expected the placeholder"):
        c.up()
    assert c.state["created"]  # namespaces had been made ...
    assert _leftovers(c.state["tag"], []) == []  # ... and are gone


def test_ctrl_c_during_up_tears_everything_down(tmp_path) -> None:
    d = tmp_path / "state"
    p = subprocess.Popen([sys.executable, "-m", "bench.emucluster", "up", "--dir", str(d)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    state = d / STATE
    deadline = time.monotonic() + 60
    snap: dict = {}
    while time.monotonic() < deadline:  # wait until the first redis-server runs, then Ctrl-C
        try:
            snap = json.loads(state.read_text())
        except (OSError, ValueError):
            snap = {}
        if snap.get("pids"):
            break
        time.sleep(0.02)
    assert snap.get("pids"), "up did not start a redis-server in time"
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT  # interrupted, not finished
    pids = [x for ps in snap["pids"].values() for x in ps]
    assert _leftovers(snap["tag"], pids) == [] and not state.exists()


@pytest.mark.netns_exclusive  # compares or removes every emulated cluster of the machine
def test_bad_input_is_one_clear_line(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": REPO}
    before = _tags_now()
    for args, msg in ((["--redis-port", "70000"], "redis_port must be 1..65535, got 70000"),
                      (["--http-port", "17000"], "http_port 17000 collides"),
                      (["--rate-gbit", "0"], "rate_gbit must be > 0"),
                      (["--nodes", "2"], "nodes must be 3..16")):
        r = subprocess.run([sys.executable, "-m", "bench.emucluster", "up", "--dir", str(tmp_path / "s"),
                            *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    r = subprocess.run([sys.executable, "-m", "bench.emucluster", "up", "--dir", str(foreign)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert r.returncode == 2 and "was not made by bench/emucluster.py" in r.stderr
    assert (foreign / "keep.txt").read_text() == "not ours" and _tags_now() == before


@pytest.mark.netns_exclusive  # compares or removes every emulated cluster of the machine
def test_cleanup_removes_leftovers_of_a_lost_state(tmp_path) -> None:
    c = EmuCluster(EmuConfig(state_dir=str(tmp_path / "state"), rate_gbit=None)).up()
    c.disarm()  # as if the process that ran up had died: only --cleanup can find it now
    tag, pids = c.state["tag"], _all_pids(c)
    try:
        os.remove(os.path.join(c.dir, STATE))
        # host-side links an older crash could have left (none is made there now): a veth of our pattern
        stray = (f"{IF_PREFIX}{tag}n9", f"{IF_PREFIX}{tag}s9")
        subprocess.run(["ip", "link", "add", stray[0], "type", "veth", "peer", "name", stray[1]], check=True)
        other = tmp_path / "empty"
        r = subprocess.run([sys.executable, "-m", "bench.emucluster", "down", "--cleanup",
                            "--dir", str(other)], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
        assert r.returncode == 0 and f"{PREFIX}{tag}-n0" in r.stdout, r.stdout + r.stderr
        assert stray[0] in r.stdout and tag not in _ip("-o", "link", "show")
        for p in c._procs:
            p.wait(10)  # our children: reaped here, killed by the other process
        assert _leftovers(tag, pids) == []
        assert not other.exists()  # --cleanup creates nothing
    finally:
        c.down()
        subprocess.run(["ip", "link", "del", f"{IF_PREFIX}{tag}n9"], capture_output=True)


def test_templates_filled_per_node_load_in_the_daemon(tmp_path) -> None:
    text = fill_daemon_toml(DAEMON_TEMPLATE, {"node": "node-2", "cache": "redis+cluster://10.214.1.1:7000",
                                              "redis_node": "10.214.1.3:7000", "http_port": 9000},
                            [{"source": "slowfile:///data", "short_side": 64}])
    path = tmp_path / "d.toml"
    path.write_text(text)
    cfg = load_config(str(path), env={})
    assert (cfg.node, cfg.redis_node, cfg.http_port, cfg.ownership) == ("node-2", "10.214.1.3:7000", 9000,
                                                                         "cluster")
    assert [(d.source, d.short_side) for d in cfg.datasets] == [("slowfile:///data", 64)]
    assert cfg.http_host == "127.0.0.1"  # kept from the template
    conf = fill_redis_conf(REDIS_TEMPLATE, addr="10.214.1.2", port=7001, workdir="/w", maxmemory="64mb",
                           admin_pass="a" * 32, user_pass="u" * 32, daemon_pass="d" * 32)
    import hashlib

    def sha(p: str) -> str:
        return hashlib.sha256(p.encode()).hexdigest()

    live = [ln for ln in conf.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("CHANGE_ME" in ln for ln in live) and not any(p * 32 in conf for p in "aud")
    assert {f"user admin on #{sha('a' * 32)}", f"user datacache-daemon on #{sha('d' * 32)}",
            f"user datacache on #{sha('u' * 32)}"} <= {" ".join(ln.split()[:4]) for ln in live}
    tail = conf.rsplit("bench/emucluster.py", 1)[1].splitlines()  # the per-node block comes last: it wins
    assert {"port 7001", "bind 10.214.1.2", "cluster-announce-ip 10.214.1.2", "maxmemory 64mb",
            "cluster-config-file nodes-7001.conf", "dir /w"} <= set(tail)
