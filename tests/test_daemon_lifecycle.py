"""The daemon never hangs: one long-lived decode pool, a pass watchdog in /health, a bounded SIGTERM drain.

Real daemons (``sys.executable -m cache_daemon``) over real LMDB / redis-server caches, real signals
(SIGTERM, SIGSTOP, SIGKILL) sent to real pool workers; the workers' pids and signal dispositions are
read from ``/proc``. Bounds on waits are generous "no hang" limits, not timings.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cache_daemon.daemon_config import DaemonConfig, load_config
from cache_daemon.watchdog import Watchdog
from datacache.config import ConfigError
from datacache.devtools.redis_local import free_port
from tests.redis_utils import cli, needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 32
EXIT_FORCED = 3  # documented in cache_daemon.service / docs/cluster.md (independent constant on purpose)

_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap_daemons():
    """Whatever a test leaves running is killed with its decode pool (its own process group); stopped
    workers are continued so the kill reaches them."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGCONT)
            p.wait(30)


def start(tmp_path, *args: str, env: dict[str, str] | None = None, log: str = "d.log") -> subprocess.Popen:
    """A daemon in its own process group, with its manifests under ``tmp_path``."""
    path = str(tmp_path / log)
    with open(path, "ab") as f:
        p = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--no-progress", "--workers", "1",
                              "--short-side", str(SHORT), *args], stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": REPO, "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                                  **(env or {})}, start_new_session=True)
    _STARTED.append(p)
    return p


def text_of(path: str) -> str:
    with open(path) as f:
        return f.read()


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(what, timeout: float, proc: subprocess.Popen, log: str, step: float = 0.05):
    """Poll ``what()`` until it returns something truthy (HTTP not up yet counts as falsy)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = what()
        except OSError:
            got = None
        if got:
            return got
        assert proc.poll() is None, f"daemon exited {proc.returncode}:\n{text_of(log)[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{text_of(log)[-3000:]}"
        time.sleep(step)


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def sig_masks(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        pairs = (ln.split(":\t") for ln in f.read().splitlines() if ln.startswith("Sig"))
        return {k: int(v, 16) for k, v in pairs if k in ("SigBlk", "SigIgn", "SigCgt")}


def alive(pid: int) -> bool:
    """Running or stopped (a zombie or a vanished pid is not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def pool_pids(port: int) -> list[int]:
    return get(port, "/status")[1]["loop"]["pool"]["pids"]


# ------------------------------------------------------------------ soak


def test_soak_2000_passes_over_a_full_dataset_then_sigterm(imagefolder_factory, tmp_path) -> None:
    """The reported defect: a short poll over a fully cached dataset stopped after tens to hundreds of
    passes (a pool forked and terminated per pass) and then ignored SIGTERM. Now a full pass forks
    nothing, 2,000 passes go by, and SIGTERM exits 0 within 5 s."""
    from datacache.warm import warm_cache

    root = imagefolder_factory(classes=2, per_class=3, size=(80, 60))
    cache = f"lmdb://{tmp_path}/cache"
    rep = warm_cache(root, cache, workers=1, short_side=SHORT, t1_dir=None, progress=False)
    assert rep.written == 6
    port, log = free_port(), str(tmp_path / "d.log")
    t0 = time.monotonic()
    p = start(tmp_path, "--cache", cache, "--dataset", root, "--poll-interval", "0.01",
              "--http-port", str(port))
    seen_children: set[int] = set()
    last = -1

    def advanced() -> bool:
        nonlocal last
        loop = get(port, "/status")[1]["loop"]
        if loop["passes"] >= 1:  # the first pass lists in a child process (ingest.list_in_child), reaped
            seen_children.update(children(p.pid))  # before that pass ends; later full passes fork nothing
        assert loop["passes"] >= last, loop  # passes only ever advance
        last = loop["passes"]
        return loop["passes"] >= 2000

    wait_for(advanced, 240, p, log, step=0.25)
    soak_s = time.monotonic() - t0
    status = get(port, "/status")[1]
    (d,) = status["datasets"]
    # (status is "listing"/"filling" while a pass runs, "full" between passes)
    assert not d["error"], d
    assert d["passes"] >= 2000 and d["owned"] == d["done"] == 6, d
    assert status["loop"]["pool"]["created"] == 0, status["loop"]  # a full pass forks nothing
    assert not seen_children, (seen_children, Path(log).read_text()[-3000:])
    # the allocator was tuned at start (cache_daemon.heap.limit_heap_growth), or the environment's kept
    assert "allocator: {'MALLOC_ARENA_MAX': 2, 'MALLOC_MMAP_THRESHOLD_': 1048576}" in Path(log).read_text() \
        or any(k.startswith("MALLOC_") for k in os.environ)
    assert get(port, "/health")[0] == 200
    t1 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(5) == 0
    text = text_of(log)
    assert "stopped cleanly" in text and "decode pool" not in text
    print(f"soak: 2000 passes in {soak_s:.1f} s (with start-up); SIGTERM -> exit in "
          f"{time.monotonic() - t1:.2f} s")


@needs_redis
def test_one_pool_serves_every_pass_of_every_dataset(redis_url: str, redis_server, imagefolder_factory,
                                                     tmp_path) -> None:
    """Two datasets with work, then new files in one of them: every decode runs in the same pool
    (same worker pids), forked once; workers ignore SIGTERM/SIGINT; SIGTERM drains and exits 0."""
    a = imagefolder_factory(classes=2, per_class=5, size=(80, 60))
    b = imagefolder_factory(classes=2, per_class=5, size=(80, 60))
    port, log = free_port(), str(tmp_path / "d.log")
    p = start(tmp_path, "--cache", redis_url, "--dataset", a, "--dataset", b, "--poll-interval", "0.05",
              "--http-port", str(port))

    def full() -> bool:
        ds = get(port, "/status")[1]["datasets"]
        return len(ds) == 2 and all(d["status"] == "full" for d in ds)

    wait_for(full, 120, p, log)
    pids = pool_pids(port)
    assert len(pids) == 1 and children(p.pid) == pids
    masks = sig_masks(pids[0])
    for sig in (signal.SIGTERM, signal.SIGINT):  # ignored, not blocked and not caught
        bit = 1 << (sig - 1)
        assert masks["SigIgn"] & bit and not masks["SigBlk"] & bit and not masks["SigCgt"] & bit, masks
    assert not sig_masks(p.pid)["SigBlk"] & (1 << (signal.SIGTERM - 1))  # the daemon's mask restored
    from datacache.devtools.synth import make_imagefolder

    make_imagefolder(a, classes=2, per_class=8, size=(80, 60), seed=1)  # a changed dataset: 16 files
    wait_for(lambda: get(port, "/status")[1]["datasets"][0]["owned"] == 16 and full(), 120, p, log)
    status = get(port, "/status")[1]
    assert status["loop"]["pool"] == {"created": 1, "workers": 1, "pids": pids}
    # all decoded by that one pool (a pass may have listed the folder while it was being rewritten:
    # then some files were decoded twice, under two fingerprints -- hence >=)
    (da, db) = status["datasets"]
    assert da["decoded"] >= 10 + 16 and db["decoded"] == 10 and da["done"] == 16
    assert len([k for k in cli(redis_server.port, "--scan", "--pattern", "dc:*").splitlines() if k]) >= 36
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert not alive(pids[0])


def test_sigterm_to_the_process_group_mid_fill_drains_and_exits_0(imagefolder_factory, tmp_path) -> None:
    """systemd's default stop signals every process of the unit: the workers must not die (their
    chunks would be lost and the drain would wait for them) nor run the daemon's handler; they ignore
    it, the daemon drains what it submitted and exits 0."""
    root = imagefolder_factory(classes=3, per_class=20, size=(80, 60))
    port, log = free_port(), str(tmp_path / "d.log")
    p = start(tmp_path, "--cache", f"lmdb://{tmp_path}/cache", "--dataset", f"slowfile://{root}?latency_ms=40",
              "--http-port", str(port))
    pids = wait_for(lambda: pool_pids(port), 60, p, log)
    wait_for(lambda: get(port, "/status")[1]["datasets"][0]["done"] > 0, 60, p, log)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(30) == 0
    text = text_of(log)
    assert "stopped cleanly" in text and "Traceback" not in text
    assert not any(alive(x) for x in pids)


# ------------------------------------------------------------------ frozen and killed workers


def _stuck_daemon(tmp_path, imagefolder_factory, drain: float, pass_timeout: float = 1.0):
    root = imagefolder_factory(classes=3, per_class=30, size=(80, 60))
    port, log = free_port(), str(tmp_path / "d.log")
    env = {"DATACACHE_DAEMON_PASS_TIMEOUT": str(pass_timeout), "DATACACHE_DAEMON_DRAIN_TIMEOUT": str(drain)}
    p = start(tmp_path, "--cache", f"lmdb://{tmp_path}/cache", "--dataset", f"slowfile://{root}?latency_ms=40",
              "--http-port", str(port), env=env)
    (worker,) = wait_for(lambda: pool_pids(port), 60, p, log)
    os.kill(worker, signal.SIGSTOP)  # frozen mid-pass: its chunk never comes back
    return p, port, log, worker


def test_stopped_worker_fails_health_then_sigterm_forces_exit_within_drain_timeout(imagefolder_factory,
                                                                                    tmp_path) -> None:
    p, port, log, worker = _stuck_daemon(tmp_path, imagefolder_factory, drain=3.0)
    _, health = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/health")), 60, p, log)
    reason = health["loop"]["stuck"]
    assert "fill pass of slowfile://" in reason and "since 20" in reason and "deadline of 1 s" in reason
    assert health["store"]["ok"]  # the store is fine: the loop is what fails the check
    status = get(port, "/status")[1]
    assert status["loop"]["stuck"] and status["loop"]["current"]["dataset"].startswith("slowfile://")
    assert status["datasets"][0]["status"] == "filling"
    p.send_signal(signal.SIGTERM)
    assert p.wait(3.0 + 20) == EXIT_FORCED  # drain_timeout + a generous no-hang margin
    text = text_of(log)
    assert "SIGTERM received: draining" in text and "drain not finished within 3.0 s" in text
    assert "killing the decode pool" in text
    assert not alive(worker)  # the stopped worker was killed, not left behind


def test_second_signal_forces_exit_at_once(imagefolder_factory, tmp_path) -> None:
    p, port, log, worker = _stuck_daemon(tmp_path, imagefolder_factory, drain=120.0)
    wait_for(lambda: get(port, "/status")[1]["loop"]["current"], 30, p, log)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received: draining" in text_of(log), 30, p, log)
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == EXIT_FORCED  # long before drain_timeout (120 s)
    assert "received again: stopping now" in text_of(log)
    assert not alive(worker)


def test_killed_worker_fails_the_pass_a_fresh_pool_finishes_it(imagefolder_factory, tmp_path) -> None:
    """A worker killed mid-task (OOM killer) took its chunk with it: the pass fails with the reason
    instead of waiting forever, the next pass forks a fresh pool, the dataset gets full, SIGTERM -> 0."""
    root = imagefolder_factory(classes=3, per_class=30, size=(80, 60))
    port, log = free_port(), str(tmp_path / "d.log")
    # 300 ms a file: the first pass lasts seconds, so the kill below lands while chunks are in flight (at
    # 40 ms a loaded CI machine once finished the pass before the kill, and nothing was lost to notice)
    p = start(tmp_path, "--cache", f"lmdb://{tmp_path}/cache", "--dataset", f"slowfile://{root}?latency_ms=300",
              "--poll-interval", "0.1", "--http-port", str(port))
    (worker,) = wait_for(lambda: pool_pids(port), 60, p, log)
    os.kill(worker, signal.SIGKILL)
    assert get(port, "/status")[1]["datasets"][0]["done"] < 90, "the pass ended before the kill: test is void"
    wait_for(lambda: get(port, "/status")[1]["datasets"][0]["status"] == "full", 120, p, log)
    status = get(port, "/status")[1]
    assert status["loop"]["pool"]["created"] == 2 and worker not in status["loop"]["pool"]["pids"]
    assert status["datasets"][0]["done"] == 90
    text = text_of(log)
    assert f"decode worker pid {worker} died (signal 9)" in text
    assert get(port, "/health")[0] == 200
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0


# ------------------------------------------------------------------ in-process pieces


def test_full_fill_creates_no_process_and_a_shared_pool_is_reused(imagefolder_factory, tmp_path) -> None:
    from datacache.cacheurl import parse_cache_url
    from datacache.config import Variant
    from datacache.decodepool import DecodePool
    from datacache.manifest import Manifest
    from datacache.readthrough import ReadThrough
    from datacache.warm import fill_missing

    root = imagefolder_factory(classes=2, per_class=4, size=(80, 60))
    spec = parse_cache_url(f"lmdb://{tmp_path}/cache")
    reader = ReadThrough(Manifest.build(root), Variant(short_side=SHORT), spec, t1_dir=None, writer=True)
    pool = DecodePool(1)
    try:
        first = fill_missing(reader, range(4), pool=pool, progress=False)
        pids = pool.pids()
        second = fill_missing(reader, range(8), pool=pool, progress=False)
        assert (first.written, second.written, second.skipped) == (4, 4, 4)
        assert pool.created == 1 and pool.pids() == pids  # the same workers served both fills
        idle = DecodePool(1)
        again = fill_missing(reader, range(8), pool=idle, progress=False)
        assert again.skipped == 8 and idle.created == 0  # nothing to decode: no process
        assert pool.close(timeout=30) and not any(alive(x) for x in pids)
    finally:
        pool.kill()
        reader.store.close()


def test_pool_is_forked_with_sigterm_and_sigint_blocked() -> None:
    """The window between fork and the worker's initializer: the pool's helper thread (which forks the
    replacement workers) keeps SIGTERM/SIGINT blocked for good, the creating thread gets its mask back,
    and a replacement worker ignores both like the first ones."""
    from datacache.decodepool import DecodePool

    term, intr = 1 << (signal.SIGTERM - 1), 1 << (signal.SIGINT - 1)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    pool = DecodePool(1)
    try:
        mp_pool = pool.get()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        handler_tid = mp_pool._worker_handler.native_id
        with open(f"/proc/{os.getpid()}/task/{handler_tid}/status") as f:
            blk = int(next(ln for ln in f.read().splitlines() if ln.startswith("SigBlk")).split()[1], 16)
        assert blk & term and blk & intr
        (first,) = pool.pids()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not [p.pid for p in mp_pool._pool if p.pid != first and p.exitcode is None]:
            assert time.monotonic() < deadline, "no replacement worker"
            time.sleep(0.05)
        (new,) = [p.pid for p in mp_pool._pool if p.pid != first]
        deadline = time.monotonic() + 30
        while not sig_masks(new)["SigIgn"] & term:  # its initializer runs right after the fork
            assert time.monotonic() < deadline, sig_masks(new)
            time.sleep(0.05)
        masks = sig_masks(new)
        assert masks["SigIgn"] & intr and not masks["SigBlk"] & (term | intr)
        with pytest.raises(Exception, match=f"decode worker pid {first} died \\(signal 9\\)"):
            pool.check()
    finally:
        pool.kill()


def test_close_of_a_pool_with_a_stopped_worker_is_bounded() -> None:
    from datacache.decodepool import DecodePool

    pool = DecodePool(2)
    pool.get()
    pids = pool.pids()
    os.kill(pids[0], signal.SIGSTOP)
    done = threading.Event()
    result: list[bool] = []
    threading.Thread(target=lambda: (result.append(pool.close(timeout=1.0)), done.set()), daemon=True).start()
    assert done.wait(30), "DecodePool.close blocked"
    assert result == [False] and not any(alive(x) for x in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.get()


_UNCLOSED = """
import time
from datacache.decodepool import DecodePool
pools = [DecodePool(2) for _ in range(3)]
for p in pools:
    assert sum(p.get().map(abs, range(-50, 50))) == 2500
    p.get().apply_async(time.sleep, (5,))  # one worker busy when the interpreter exits
time.sleep(0.5)
print(" ".join(str(q) for p in pools for q in p.pids()), flush=True)
"""  # and exits without closing any


def test_an_unclosed_pool_never_holds_the_interpreter_at_exit() -> None:
    """multiprocessing's exit handler terminates a pool nobody closed: it drains the task queue (the
    busy worker's stop sentinel with it), SIGTERMs the workers and joins them. Ours ignore SIGTERM, so
    the busy one, done with its task, waited for a sentinel that never came, and the interpreter for
    it, for ever. The exit hook SIGKILLs unclosed pools first: the process exits, no worker is left."""
    p = subprocess.run([sys.executable, "-c", _UNCLOSED], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stderr[-2000:]
    pids = [int(x) for x in p.stdout.split()]
    assert len(pids) == 6 and not any(alive(x) for x in pids)


def test_pass_and_drain_timeouts_in_config(tmp_path) -> None:
    env = {"DATACACHE_DAEMON_CACHE": f"lmdb://{tmp_path}/c", "DATACACHE_DAEMON_PASS_TIMEOUT": "90",
           "DATACACHE_DAEMON_DRAIN_TIMEOUT": "5"}
    cfg = load_config(None, env=env)
    assert (cfg.pass_timeout, cfg.drain_timeout) == (90.0, 5.0)
    assert (DaemonConfig(cache="memory://").pass_timeout, DaemonConfig(cache="memory://").drain_timeout) == \
        (0.0, 30.0)
    for key, value in (("PASS_TIMEOUT", "-1"), ("PASS_TIMEOUT", "nan"), ("DRAIN_TIMEOUT", "inf"),
                       ("DRAIN_TIMEOUT", "0")):
        with pytest.raises(ConfigError, match=f"'{key.lower()}' must be a finite number of seconds"):
            load_config(None, env={"DATACACHE_DAEMON_CACHE": "memory://", f"DATACACHE_DAEMON_{key}": value})


def test_watchdog_deadlines() -> None:
    w = Watchdog(pass_timeout=0, workers=4)
    assert w.stuck() is None and w.as_json()["current"] is None
    w.begin("ds|v")
    w.work(4000)  # derived: 600 s + 4000 samples * 1 s / 4 workers
    assert w.as_json()["current"]["deadline_s"] == 1600.0 and w.stuck() is None
    w.end()
    assert w.passes == 1 and w.as_json()["seconds_since_last_pass"] is not None
    fixed = Watchdog(pass_timeout=0.05, workers=1)
    fixed.begin("/data/train|s32")
    fixed.work(10 ** 9)  # a configured deadline does not grow
    time.sleep(0.1)
    assert "fill pass of /data/train|s32" in fixed.stuck() and fixed.as_json()["stuck"]
    fixed.end()
    assert fixed.stuck() is None


def test_non_finite_poll_interval_never_busy_loops(tmp_path) -> None:
    """Validation refuses them (config's job); should one reach the loop it waits, never spins or raises."""
    from cache_daemon.service import Daemon

    d = Daemon(DaemonConfig(cache=f"lmdb://{tmp_path}/c"))
    try:
        for value, wait in ((math.nan, 30.0), (math.inf, None), (-1.0, 30.0), (0.25, 0.25)):
            object.__setattr__(d.cfg, "poll_interval", value)
            assert d._poll_wait() == wait
    finally:
        d.store.close()
