"""Liveness apart from readiness: ``/livez`` (this daemon's own loop), ``/readyz`` (this node's own master),
``/health`` (both), ``/status`` (the whole cluster).

Real 3-master Redis Clusters (``fresh_cluster``: real ``redis-server`` processes, SIGKILLed for real) and
real daemon processes (``sys.executable -m cache_daemon``). The references are independent of the code
under test: slot owners from ``CLUSTER SLOTS`` asked with redis-py, key slots from redis-py's CRC16, keys
counted with ``redis-cli --scan`` on the master itself. Bounds on waits are generous "no hang" limits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

from datacache.devtools.redis_local import free_port
from tests.daemon_procs import daemon_procs, spawn_daemon  # noqa: F401 (autouse fixture)
from tests.redis_utils import cli, needs_redis, slot_owners

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 32
TOKEN = "t" * 32
REGISTRY_KEY = b"dcd:datasets"  # docs/cluster.md: registrations live in the Redis hash dcd:datasets
# docs/cluster.md: 3 rounds in a row failing before any pass fail /livez; we watch past that
ROUNDS_TO_FAIL = 3
EXIT_FORCED = 3

def start(tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int, str]:
    """A daemon in its own process group; returns (process, HTTP port, log path)."""
    port = free_port()
    log = str(tmp_path / f"d{port}.log")
    p = spawn_daemon(["--short-side", str(SHORT), "--http-port", str(port), *args], log,
                     env={"XDG_CACHE_HOME": str(tmp_path / "xdg"), **(env or {})})
    return p, port, log


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def text(path: str) -> str:
    with open(path) as f:
        return f.read()


def wait_for(what, timeout: float, proc: subprocess.Popen, log: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = what()
        except OSError:  # HTTP not up yet
            got = None
        if got:
            return got
        assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{text(log)[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{text(log)[-3000:]}"
        time.sleep(step)


def codes(port: int) -> dict[str, int]:
    return {p: get(port, p)[0] for p in ("/livez", "/readyz", "/health")}


def key_slot(key: bytes) -> int:
    from redis.crc import key_slot as crc_slot  # redis-py's CRC16, not the project's

    return crc_slot(key)


def roles(cl) -> tuple[dict[int, str], str]:
    """(slot -> owner from CLUSTER SLOTS, the master holding the registry)."""
    ref = slot_owners(cl.masters[0].port)
    return ref, ref[key_slot(REGISTRY_KEY)]


def owned_keys_check(port: int, redis_port: int, own: str, ref: dict[int, str], n: int, log: str,
                     proc: subprocess.Popen) -> dict:
    """Wait for the one dataset to be full; its keys on the own master must be exactly the samples whose
    slot that master owns (computed here from CLUSTER SLOTS and CRC16)."""
    d = wait_for(lambda: (lambda ds: ds[0] if ds and ds[0]["status"] == "full" else None)(
        get(port, "/status")[1]["datasets"]), 180, proc, log)
    prefix = f"dc:{d['fingerprint']}:{d['variant']}:"
    expected = {i for i in range(n) if ref[key_slot(f"{prefix}{i}".encode())] == own}
    found = {int(k[len(prefix):]) for k in cli(redis_port, "--scan", "--pattern", prefix + "*").splitlines()
             if k}
    assert expected and found == expected, (sorted(expected), sorted(found))
    assert d["owned"] == d["done"] == len(expected), d
    return d


def rounds(port: int) -> int:
    return get(port, "/status")[1]["loop"]["rounds"]


def stays(port: int, want: dict[str, int], proc: subprocess.Popen, log: str) -> None:
    """``want`` holds over more than ROUNDS_TO_FAIL further rounds of the daemon's loop."""
    start_round = rounds(port)
    while rounds(port) < start_round + ROUNDS_TO_FAIL + 2:
        assert codes(port) == want, (codes(port), get(port, "/health")[1])
        assert proc.poll() is None, text(log)[-3000:]
        time.sleep(0.2)
    assert codes(port) == want


# ------------------------------------------------------------------ another node's master dies
@needs_redis
def test_another_nodes_master_killed_this_daemon_stays_live_and_ready_and_fills_a_new_registration(
        fresh_cluster, imagefolder_factory, tmp_path) -> None:
    """The reported defect: one master SIGKILLed turned /health 503 on every daemon of the cluster. Now a
    daemon whose own master is fine stays live and ready, /status reports the loss (which master, how
    many slots), and a dataset registered after the kill fills exactly this node's share."""
    cl = fresh_cluster
    ref, registry = roles(cl)
    own = next(m for m in cl.masters if m.addr != registry)
    victim = next(m for m in cl.masters if m.addr not in (registry, own.addr))
    root = imagefolder_factory(classes=3, per_class=12, size=(80, 60))
    env = {"DATACACHE_DAEMON_API_TOKEN": TOKEN, "DATACACHE_DAEMON_ALLOWED_SOURCES": os.path.dirname(root)}
    p, port, log = start(tmp_path, "--cache", cl.url, "--redis-node", own.addr, "--node", "own",
                         "--poll-interval", "0.3", env=env)
    wait_for(lambda: codes(port) == {"/livez": 200, "/readyz": 200, "/health": 200}, 60, p, log)
    victim.kill()  # SIGKILL: gone with its memory, no replica takes over
    st = wait_for(lambda: (lambda s: s if s["store"].get("masters_down") else None)(get(port, "/status")[1]),
                  60, p, log)
    assert st["store"]["masters_down"] == [victim.addr] and not st["store"]["ok"]
    assert st["store"]["slots_uncovered"] == sum(1 for o in ref.values() if o == victim.addr)
    assert st["store"]["masters"][own.addr]["ok"] and st["live"] and st["ready"]
    assert codes(port) == {"/livez": 200, "/readyz": 200, "/health": 200}
    ready = get(port, "/readyz")[1]["store"]
    assert ready["node"] == own.addr and ready["ok"] and ready["slots"] == sum(
        1 for o in ref.values() if o == own.addr)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/datasets", method="POST",
                                 data=json.dumps({"source": root, "short_side": SHORT}).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 201
    owned_keys_check(port, own.port, own.addr, ref, 36, log, p)
    stays(port, {"/livez": 200, "/readyz": 200, "/health": 200}, p, log)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


@needs_redis
def test_the_registry_master_down_before_start_a_configured_dataset_still_fills(
        fresh_cluster, imagefolder_factory, tmp_path) -> None:
    """Hostile case: the master holding the dataset registry (another node's) is dead before the daemon
    starts. Rounds used to fail before any pass (registry unreadable): nothing filled and /health 503.
    Now the configured dataset fills this node's share, the daemon is live and ready, and /status names
    the registry's failure."""
    cl = fresh_cluster
    ref, registry = roles(cl)
    own = next(m for m in cl.masters if m.addr != registry)
    next(m for m in cl.masters if m.addr == registry).kill()
    root = imagefolder_factory(classes=3, per_class=12, size=(80, 60))
    p, port, log = start(tmp_path, "--cache", cl.url, "--redis-node", own.addr, "--node", "own",
                         "--poll-interval", "0.3", "--dataset", root)
    owned_keys_check(port, own.port, own.addr, ref, 36, log, p)
    st = get(port, "/status")[1]
    assert st["store"]["masters_down"] == [registry] and st["live"] and st["ready"]
    assert not st["registry"]["ok"] and "Error" in st["registry"]["error"]
    assert st["loop"]["failed_rounds"] == 0
    stays(port, {"/livez": 200, "/readyz": 200, "/health": 200}, p, log)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


# ------------------------------------------------------------------ its own master dies
@needs_redis
def test_own_master_killed_live_but_not_ready_then_refilled_when_it_is_back(
        fresh_cluster, imagefolder_factory, tmp_path) -> None:
    """Restarting the daemon would not bring its master back: /livez stays 200 while /readyz and /health
    are 503 (the registry is on that master too: the hostile choice). The master restarted empty: ready
    again, and its share is filled again."""
    cl = fresh_cluster
    ref, registry = roles(cl)
    i = next(k for k, m in enumerate(cl.masters) if m.addr == registry)
    own = cl.masters[i]
    root = imagefolder_factory(classes=3, per_class=12, size=(80, 60))
    p, port, log = start(tmp_path, "--cache", cl.url, "--redis-node", own.addr, "--node", "own",
                         "--poll-interval", "0.3", "--dataset", root)
    owned_keys_check(port, own.port, own.addr, ref, 36, log, p)
    own.kill()
    wait_for(lambda: get(port, "/readyz")[0] == 503, 60, p, log)
    code, ready = get(port, "/readyz")
    assert not ready["ok"] and ready["store"]["node"] == own.addr and ready["store"]["detail"] != "PONG"
    code, health = get(port, "/health")
    assert code == 503 and health["live"] is True and health["ready"] is False
    stays(port, {"/livez": 200, "/readyz": 503, "/health": 503}, p, log)
    st = get(port, "/status")[1]
    assert st["live"] and not st["ready"] and st["store"]["masters_down"] == [own.addr]
    cl.restart_empty(i)  # back on its port with its slots, no data
    wait_for(lambda: codes(port) == {"/livez": 200, "/readyz": 200, "/health": 200}, 60, p, log)
    owned_keys_check(port, own.port, own.addr, ref, 36, log, p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


# ------------------------------------------------------------------ its own loop is stuck
def test_a_stopped_decode_worker_makes_the_daemon_not_live_but_still_ready(imagefolder_factory,
                                                                           tmp_path) -> None:
    """A decode worker SIGSTOPped mid-pass with pass_timeout = 1 s: /livez 503 naming the pass, /readyz 200
    (the store is fine), /health 503; restarting would help, and SIGTERM gets the daemon out (exit 3)."""
    root = imagefolder_factory(classes=3, per_class=30, size=(80, 60))
    env = {"DATACACHE_DAEMON_PASS_TIMEOUT": "1", "DATACACHE_DAEMON_DRAIN_TIMEOUT": "3"}
    p, port, log = start(tmp_path, "--cache", f"lmdb://{tmp_path}/cache", "--dataset",
                         f"slowfile://{root}?latency_ms=40", env=env)
    (worker,) = wait_for(lambda: get(port, "/status")[1]["loop"]["pool"]["pids"], 60, p, log)
    os.kill(worker, signal.SIGSTOP)
    code, live = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/livez")), 60, p, log)
    assert not live["ok"] and "fill pass of slowfile://" in live["reason"]
    assert "deadline of 1 s" in live["reason"]
    assert get(port, "/readyz")[0] == 200
    code, health = get(port, "/health")
    assert code == 503 and health["live"] is False and health["ready"] is True
    p.send_signal(signal.SIGTERM)
    assert p.wait(3 + 30) == EXIT_FORCED


def test_a_dead_pass_thread_is_not_live_unless_the_daemon_is_stopping(tmp_path) -> None:
    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.service import Daemon

    d = Daemon(DaemonConfig(cache=f"lmdb://{tmp_path}/c", node="n1"), progress=False)
    try:
        assert d.liveness()["ok"] and d.readiness()["ok"]  # no loop started yet (in-process servers)
        dead = threading.Thread(target=lambda: None)
        dead.start()
        dead.join()
        d.pass_thread = dead
        live = d.liveness()
        assert not live["ok"] and "pass thread is not running" in live["reason"]
        d.stop.set()  # SIGTERM: the loop ends on purpose
        assert d.liveness()["ok"]
    finally:
        d.store.close()
