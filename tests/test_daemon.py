"""cache_daemon against real Redis: config, ownership (exactly once), SIGKILL/SIGTERM, HTTP, budget."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from cache_daemon.daemon_config import load_config
from datacache.config import ConfigError
from datacache.devtools.redis_local import free_port
from datacache.record import decode_record
from datacache.stores import open_store
from tests.daemon_procs import daemon_procs, spawn_daemon  # noqa: F401 (autouse fixture)
from tests.redis_utils import cli, needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 32


def start_daemon(*args: str, log: str) -> subprocess.Popen:
    """A daemon in its own process group, polling every 0.3 s (reaped by ``daemon_procs``)."""
    return spawn_daemon(["--poll-interval", "0.3", *args], log)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def decoded_in(log: str) -> list[int]:
    with open(log) as f:
        return [int(m) for m in re.findall(r"decoded (\d+), skipped", f.read())]


def all_keys(port: int, pattern: str = "dc:*") -> list[str]:
    out = cli(port, "--scan", "--pattern", pattern)
    return [k for k in out.splitlines() if k]


def test_config_toml_env_and_errors(tmp_path) -> None:
    p = tmp_path / "daemon.toml"
    p.write_text('cache = "redis+cluster://127.0.0.1:7000"\nredis_node = "127.0.0.1:7000"\nworkers = 3\n'
                 'memory_budget = "2GiB"\n[[datasets]]\nsource = "/data/train"\nshort_side = 96\n')
    cfg = load_config(str(p), env={"DATACACHE_DAEMON_HTTP_PORT": "9001", "DATACACHE_DAEMON_WORKERS": "5"})
    assert (cfg.ownership, cfg.workers, cfg.http_port, cfg.memory_budget) == ("cluster", 5, 9001, 2 << 30)
    assert cfg.datasets[0].short_side == 96 and cfg.datasets[0].variant().tag().startswith("s96")
    bad = [
        ('cache = "redis://h:1"\nworkerz = 2\n', {}, ["unknown key(s) workerz", "valid keys", "workers"]),
        ('cache = "redis://h:1"\ndecoder = "simd"\n', {}, ["decoder='simd'", "pillow, dali"]),
        ('cache = "redis://h:1"\n', {"DATACACHE_DAEMON_OWNERSHIP": "round-robin"},
         ["ownership", "cluster, hash, all"]),
        ('cache = "redis://h:1"\n', {"DATACACHE_DAEMON_HTTP_PORT": "high"},
         ["DATACACHE_DAEMON_HTTP_PORT", "'http_port' must be an integer"]),
        ('cache = "redis://h:1"\n', {"DATACACHE_DAEMON_PORT": "1"},
         ["unknown variable", "DATACACHE_DAEMON_HTTP_PORT"]),
        ('cache = "redis+cluster://h:1"\n', {}, ["'redis_node' is required"]),
        ('cache = "redis://h:1"\nownership = "hash"\nrank = 3\nworld_size = 2\n', {},
         ["rank must be in 0..world_size-1"]),
        ('cache = "redis://h:1"\n[[datasets]]\nshort_side = 96\n', {}, ["datasets[0]", "'source'"]),
        ('cache = "bogus://x"\n', {}, ["unknown scheme 'bogus'"]),
        ("cache = \n", {}, ["not valid TOML"]),
    ]
    for text, env, words in bad:
        p.write_text(text)
        with pytest.raises(ConfigError) as ei:
            load_config(str(p), env=env)
        assert all(w in str(ei.value) for w in words), (str(ei.value), words)


def test_cli_config_error_exit_code() -> None:
    out = subprocess.run([sys.executable, "-m", "cache_daemon", "--cache", "redis+cluster://127.0.0.1:7000"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 2 and "redis_node" in out.stderr and "Traceback" not in out.stderr


@needs_redis
def test_three_daemons_ingest_every_sample_exactly_once(cluster_url: str, redis_cluster, imagefolder_factory,
                                                        tmp_path) -> None:
    from client.dataset import CachedImageNet

    root = imagefolder_factory(classes=3, per_class=12, size=(80, 60))
    logs = [str(tmp_path / f"d{i}.log") for i in range(3)]
    procs = [start_daemon("--cache", cluster_url, "--redis-node", m.addr, "--node", f"node{i}", "--dataset",
                          root, "--short-side", str(SHORT), "--http-port", "0", "--once", log=logs[i])
             for i, m in enumerate(redis_cluster.masters)]
    assert [p.wait(120) for p in procs] == [0, 0, 0]
    per_node = [all_keys(m.port, "dc:*") for m in redis_cluster.masters]
    decoded = [decoded_in(log)[0] for log in logs]
    assert decoded == [len(k) for k in per_node]  # each daemon wrote exactly the keys its own master serves
    assert sum(decoded) == 36 and len({k for ks in per_node for k in ks}) == 36  # every sample, once
    ds = CachedImageNet(root, cache=cluster_url, short_side=SHORT, t1_dir=None)
    report = ds.wait_warm(timeout=5)
    assert report["full"] and {n: r["owned"] for n, r in report["nodes"].items()} == \
        {f"node{i}": len(k) for i, k in enumerate(per_node)}
    ds.__getitems__(list(range(36)))
    assert ds.stats()["decoded"] == 0  # a client afterwards only hits


@needs_redis
def test_sigkill_mid_ingest_then_restart_finishes_without_duplicates(redis_url: str, redis_server,
                                                                      imagefolder_factory, tmp_path) -> None:
    root = imagefolder_factory(classes=2, per_class=20, size=(80, 60))
    # the NFS stand-in: 20 ms a request and 50 KB/s, so the ~100 KB of files arrive over ~2 s and the chunks
    # are written one after another (latency alone is overlapped by concurrent reads: all 40 in one go)
    slow = f"slowfile://{root}?latency_ms=20&mbps=0.05"
    log = str(tmp_path / "d.log")
    args = ("--cache", redis_url, "--dataset", slow, "--short-side", str(SHORT), "--http-port", "0")
    p = start_daemon(*args, log=log)
    deadline = time.monotonic() + 60
    while len(all_keys(redis_server.port)) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # daemon and its decode pool, mid-ingest
    p.wait(30)
    acked = all_keys(redis_server.port)
    assert 8 <= len(acked) < 40
    q = start_daemon(*args, "--once", log=log)
    assert q.wait(120) == 0
    keys = all_keys(redis_server.port)
    assert len(keys) == 40 and set(acked) <= set(keys)
    import redis

    r = redis.Redis(port=redis_server.port)
    for k in keys:  # nothing torn: every record passes its checksum for its own key
        assert decode_record(r.get(k), k.encode()) is not None
    assert decoded_in(log)[-1] == 40 - len(acked)  # the restart decoded only what was not acknowledged


@needs_redis
def test_sigterm_drains_and_exits_0(redis_url: str, redis_server, imagefolder_factory, tmp_path) -> None:
    root = imagefolder_factory(classes=2, per_class=20, size=(80, 60))
    log = str(tmp_path / "d.log")
    p = start_daemon("--cache", redis_url, "--dataset", f"slowfile://{root}?latency_ms=60", "--short-side",
                     str(SHORT), "--http-port", "0", log=log)
    deadline = time.monotonic() + 60
    while not all_keys(redis_server.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0
    text = read(log)
    assert "SIGTERM received: draining" in text and "stopped cleanly" in text
    written = len(all_keys(redis_server.port))
    assert 0 < written <= 40 and decoded_in(log)[-1] == written  # what it decoded was written (drained)


@needs_redis
def test_http_endpoints_registration_and_wait_warm(redis_url: str, imagefolder_factory, tmp_path,
                                                   monkeypatch) -> None:
    from client.dataset import CachedImageNet
    from datacache.cli import main as datacache_main

    root = imagefolder_factory(classes=2, per_class=6, size=(80, 60))
    # registration needs a token (the daemon and `warm --via-daemon` both read it from here) and a prefix
    monkeypatch.setenv("DATACACHE_DAEMON_API_TOKEN", "t" * 32)
    monkeypatch.setenv("DATACACHE_DAEMON_ALLOWED_SOURCES", os.path.dirname(root))
    port = free_port()
    log = str(tmp_path / "d.log")
    p = start_daemon("--cache", redis_url, "--http-port", str(port), "--node", "n1", log=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline, read(log)
                time.sleep(0.1)
        assert health["ok"] and health["node"] == "n1"
        bad = urllib.request.Request(base + "/datasets", data=b'{"short_side": 32}', method="POST",
                                     headers={"Authorization": "Bearer " + "t" * 32})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(bad, timeout=5)
        assert ei.value.code == 400 and "'source'" in ei.value.read().decode()
        assert datacache_main(["warm", root, "--via-daemon", base, "--short-side", str(SHORT)]) == 0
        ds = CachedImageNet(root, cache=redis_url, short_side=SHORT, t1_dir=None)
        report = ds.wait_warm(timeout=60)
        assert report["full"] and report["nodes"]["n1"]["done"] == 12
        with urllib.request.urlopen(base + "/status", timeout=5) as r:
            status = json.loads(r.read())
        (d,) = status["datasets"]
        assert d["status"] == "full" and d["owned"] == d["done"] == 12 and d["cluster"]["full"]
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        fill = r'datacache_daemon_fill_ratio\{dataset=".*",variant="s32m64bilinear-raw"\} 1\.0'
        assert re.search(fill, metrics)
        assert "datacache_daemon_store_up 1.0" in metrics
        ds.__getitems__(list(range(12)))
        assert ds.stats()["decoded"] == 0
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0


def test_wait_warm_needs_a_redis_tier(small_imagefolder: str, tmp_path) -> None:
    from client.dataset import CachedImageNet

    ds = CachedImageNet(small_imagefolder, cache=f"lmdb://{tmp_path}/c", short_side=SHORT, t1_dir=None)
    with pytest.raises(ConfigError, match="no Redis tier"):
        ds.wait_warm(timeout=1)


@needs_redis
def test_wait_warm_times_out_with_the_fill_so_far(redis_url: str, small_imagefolder: str) -> None:
    from client.dataset import CachedImageNet

    ds = CachedImageNet(small_imagefolder, cache=redis_url, short_side=SHORT, t1_dir=None)
    with pytest.raises(TimeoutError, match=r"0/24 cached by 0 reporting daemons"):
        ds.wait_warm(timeout=0.5, poll=0.1)


@needs_redis
def test_memory_budget_stops_filling_minio_policy(tmp_path, imagefolder_factory) -> None:
    from datacache.devtools.redis_local import start_server

    root = imagefolder_factory(classes=2, per_class=20, size=(213, 160))  # ~102 KB records at 160 px
    srv = start_server(str(tmp_path / "r"), maxmemory="3mb", policy="noeviction")
    try:
        log = str(tmp_path / "d.log")
        p = start_daemon("--cache", f"redis://{srv.addr}/0", "--dataset", root, "--short-side", "160",
                         "--http-port", "0", "--once", log=log)
        assert p.wait(120) == 0
        text = read(log)
        assert "memory budget" in text and "MinIO policy" in text and "status budget" in text
        cached = len(all_keys(srv.port))
        evicted = int(cli(srv.port, "info", "stats").split("evicted_keys:")[1].split()[0])
        assert 5 < cached < 40 and evicted == 0
    finally:
        srv.stop()


@needs_redis
def test_the_minio_fill_sizes_itself_to_the_room_left(tmp_path, imagefolder_factory) -> None:
    """A pass writes only what fits in ``memory_budget - used_memory`` at the measured cost of a record:
    before, every chunk in flight when used_memory crossed the budget landed too (issue 36: 1.3-1.9 MB of
    records over a 3.7 MB budget). Two passes: the first with nothing cached (the nominal record size),
    the second measuring cached records; the budget is never exceeded by more than a record, and its room
    is used."""
    import redis

    from datacache.devtools.redis_local import start_server
    from datacache.plan import redis_bytes_per_key

    root = imagefolder_factory(classes=2, per_class=40, size=(213, 160))  # 80 records of ~102 KB at 160 px
    srv = start_server(str(tmp_path / "r"))  # no maxmemory: only the daemon's budget limits the fill
    try:
        r = redis.Redis(port=srv.port)
        base = int(r.info("memory")["used_memory"])
        cost = redis_bytes_per_key(160 * 213 * 3)
        budget = base + int(30.5 * cost)  # room for 30 of the 80 records (3 MB; a connection costs ~20 KB)
        for n_pass in range(2):
            state, _, store = _one_pass(f"redis://{srv.addr}/0", root, short_side=160, memory_budget=budget)
            store.close()
            used = int(r.info("memory")["used_memory"])
            cached = len(all_keys(srv.port))
            # within one record of it: the cost of a record is an estimate (the nominal size on the first
            # pass; a record's header, the fill report and a connection's buffers are not in it)
            assert used <= budget + cost, (n_pass, used - budget, cached)
            assert state.status == "budget" and state.done == cached, (state.status, state.done, cached)
        assert cached >= 27, cached  # the room was used: at most a few records short of it
    finally:
        srv.stop()


def _one_pass(cache: str, root: str, short_side: int = SHORT, **cfg_kw):
    """One in-process ingest pass over ``root`` into ``cache``; returns (state, report, store)."""
    import threading

    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.ingest import DatasetState, ingest_pass
    from datacache.cacheurl import parse_cache_url

    cfg = DaemonConfig(cache=cache, node="n0", workers=1, t1_dir="none", **cfg_kw)
    store = open_store(parse_cache_url(cache).tiers[-1])
    state = DatasetState(DatasetSpec(root, short_side=short_side))
    rep = ingest_pass(cfg, state, store, decoder=None, stop=threading.Event(), progress=False)
    return state, rep, store


def test_ingest_pass_ownership_all_on_lmdb_is_not_an_error(imagefolder_factory, tmp_path) -> None:
    # node_memory used to ask a non-Redis store for store.client(): every pass ended in "error".
    # A memory_budget that cannot be measured (no Redis) must not block the fill either.
    root = imagefolder_factory(classes=2, per_class=3, size=(80, 60))
    state, rep, store = _one_pass(f"lmdb://{tmp_path}/lmdb", root, ownership="all", memory_budget=1)
    try:
        assert state.status == "full" and not state.error, state.error
        assert rep is not None and rep.written == 6 and state.done == state.owned == 6
        assert store.stats()["entries"] == 6
    finally:
        store.close()


@needs_redis
def test_ingest_pass_ownership_hash_on_a_cluster_is_not_an_error(cluster_url: str, redis_cluster,
                                                                 imagefolder_factory, tmp_path,
                                                                 monkeypatch) -> None:
    # with ownership "hash" there is no redis_node: node_memory used to call store.client() without an
    # address (TypeError); a cluster without redis_node has no per-node figure, so no budget
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the pass persists its manifest there
    root = imagefolder_factory(classes=2, per_class=3, size=(80, 60))
    state, rep, store = _one_pass(cluster_url, root, ownership="hash", rank=0, world_size=1)
    try:
        assert state.status == "full" and not state.error, state.error
        assert rep is not None and rep.written == 6 and state.done == state.owned == 6
        assert sum(len(all_keys(m.port, "dc:*")) for m in redis_cluster.masters) == 6
    finally:
        store.close()
