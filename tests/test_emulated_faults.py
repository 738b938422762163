"""Faults on the emulated cluster (bench/emucluster.py, for real): a cache daemon SIGKILLed mid-ingest and
restarted, a node's Redis master SIGKILLed mid-epoch, a node's link cut for a few seconds under a reading
job and under a 3-node torchrun training run.

"The job" is tests/emu_reader.py started inside a node's namespace: CachedImageNet + a DataLoader with 2
workers, every sample compared to a direct decode of the file's bytes (datacache.decode.decode_image with
the same Variant), independent of the cache. Cache URLs carry small socket timeouts (``socket_timeout=1``,
``connect_timeout=0.5``) so that an unreachable master costs about a second per attempt, not minutes.

Every wait is bounded; links are restored and the cluster taken down in ``finally`` blocks. Skipped with
the reason where namespaces cannot be made (not root, no ip/tc, no redis-server).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench.emucluster import REPO, STATE, EmuCluster, EmuConfig, EmuError, why_unavailable

SKIP = why_unavailable()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster: {SKIP}"), pytest.mark.netns]
IMAGES = 200
LATENCY_MS = 80
SHORT_SIDE = 64  # the daemons' variant (EmuConfig.short_side): the readers use the same one
READER = os.path.join(REPO, "tests", "emu_reader.py")
TIMEOUTS = "socket_timeout=1&connect_timeout=0.5"


def _status(c: EmuCluster, node: int) -> dict[str, Any] | None:
    code, body = c.daemon_get(node, "/status")
    if code != 200 or not isinstance(body, dict) or not body.get("datasets"):
        return None
    return dict(body["datasets"][0])


def _wait_full(c: EmuCluster, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        sts = [_status(c, i) for i in range(3)]
        if all(s and s["status"] == "full" for s in sts):
            return sts  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"daemons did not fill within {timeout} s: {sts}"
        time.sleep(0.3)


def _keys(c: EmuCluster, node: int, fp: str) -> int:
    out = c.redis_cli(node, "--scan", "--pattern", f"dc:{fp}:*", check=True, timeout=20).stdout
    return len([ln for ln in out.splitlines() if ln.strip()])


def _url(c: EmuCluster) -> str:
    return f"{c.cache_url()}?{TIMEOUTS}"


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmuCluster]:
    from datacache.devtools.synth import make_imagefolder

    base = tmp_path_factory.mktemp("emufaults")
    root = str(base / "data")
    make_imagefolder(root, classes=10, per_class=IMAGES // 10, size=(160, 120))
    # the NFS stand-in with 80 ms per open: one decode process per daemon ingests its ~67 samples in
    # several seconds, long enough for test (b) to catch a daemon in the middle of it
    src = f"slowfile://{root}?latency_ms={LATENCY_MS}"
    c = EmuCluster(EmuConfig(state_dir=str(base / "state"), rate_gbit=1.0, datasets=(src,),
                             short_side=SHORT_SIDE, workers=1, timeout=60))
    c.up()
    try:
        yield c
    finally:
        for i in range(3):
            with contextlib.suppress(EmuError):  # a test failed mid-cut: restore before tearing down
                c.link_up(i)
        c.down()


def _root(c: EmuCluster) -> str:
    src = c.state["datasets"][0]
    assert src.startswith("slowfile://")
    return str(src[len("slowfile://"):].split("?")[0])


class Reader:
    """tests/emu_reader.py running in a node's namespace; ``lines`` are its JSON lines."""

    def __init__(self, c: EmuCluster, node: int, tmp: str, *, pause_after: int = -1, epochs: int = 1) -> None:
        self.go = os.path.join(tmp, f"go-{node}-{time.monotonic_ns()}")
        argv = [sys.executable, READER, "--source", c.state["datasets"][0], "--cache", _url(c), "--root",
                _root(c), "--short-side", str(SHORT_SIDE), "--batch", "2", "--epochs", str(epochs),
                "--pause-after", str(pause_after), "--go", self.go]
        self.p = c.run_on(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[dict[str, Any]] = []

    def wait_mid(self, timeout: float = 60.0) -> None:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        # readline blocks: the reader prints "mid" or exits (its own pause is bounded too)
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                self.lines.append(json.loads(line))
                if self.lines[-1]["event"] == "mid":
                    return
        raise AssertionError(f"reader did not reach the middle of its epoch: rc={self.p.poll()}")

    def resume(self) -> None:
        open(self.go, "w").close()

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        try:
            out, err = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, err = self.p.communicate()
            raise AssertionError(f"reader hung (> {timeout} s): {err[-2000:]}") from None
        assert self.p.returncode == 0, err[-3000:]
        self.lines += [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        return [x for x in self.lines if x["event"] == "epoch"]


def _assert_all_correct(epochs: list[dict[str, Any]], n: int) -> None:
    for e in epochs:
        assert (e["seen"], e["n"], e["bad"]) == (n, n, []), {k: e[k] for k in ("epoch", "seen", "n", "bad")}


# ------------------------------------------------------------------------------------------------- (b)
_KILL_MID_INGEST = """
import json, os, signal, sys, time, urllib.request
url = "http://127.0.0.1:%s/status" % sys.argv[1]
state, node, old = sys.argv[2], sys.argv[3], int(sys.argv[4])  # the daemon's pid: from emucluster.json
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        st = json.loads(urllib.request.urlopen(url, timeout=2).read())
        ds = st["datasets"][0]
    except (OSError, ValueError, KeyError, IndexError):
        time.sleep(0.005)
        continue
    if 0 < ds["done"] < ds["owned"]:
        with open(state) as f:
            pid = int(json.load(f)["pids"][node][1])
        if pid == old:
            continue
        os.kill(pid, signal.SIGKILL)
        print(json.dumps({"pid": pid, "done": ds["done"], "owned": ds["owned"]}))
        sys.exit(0)
    if ds["owned"] and ds["done"] == ds["owned"]:
        sys.exit("the daemon finished before it could be caught mid-ingest: " + json.dumps(ds))
    time.sleep(0.005)
sys.exit("no /status with a partial ingest within 60 s")
"""


def test_b_daemon_sigkilled_mid_ingest_restarts_and_fills(emu: EmuCluster, tmp_path) -> None:
    c = emu
    node = 1
    fp = _wait_full(c)[0]["fingerprint"]
    share = _keys(c, node, fp)
    # make node 1's daemon ingest its share again: stop it, empty its master, start it (it re-checks)
    old = c.state["pids"][str(node)][1]
    c.kill_daemon(node)
    assert c.redis_cli(node, "flushall", check=True).stdout.strip() == "OK"
    assert _keys(c, node, fp) == 0
    # a watcher inside node 1 (its daemon's HTTP is on that namespace's loopback) SIGKILLs the restarted
    # daemon as soon as its /status shows some, not all, of its share ingested: a kill mid-ingest
    watcher = c.run_on(node, [sys.executable, "-c", _KILL_MID_INGEST, str(c.state["http_port"]),
                                  os.path.join(c.dir, STATE), str(node), str(old)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = c.restart_daemon(node)
    out, err = watcher.communicate(timeout=90)
    assert watcher.returncode == 0, err[-2000:]
    seen = json.loads(out.splitlines()[-1])
    assert seen["pid"] == first and 0 < seen["done"] < seen["owned"] == share, seen
    c.kill_daemon(node)  # reaps it (the watcher's SIGKILL already ended it)
    assert not os.path.exists(f"/proc/{first}")
    assert c.daemon_health(node) is None  # nobody answers on its port now
    assert 0 < _keys(c, node, fp) < share  # it had written part of its share
    second = c.restart_daemon(node)
    assert second != first and c.state["pids"][str(node)][1] == second
    sts = _wait_full(c)
    fp = sts[0]["fingerprint"]
    assert {s["fingerprint"] for s in sts} == {fp}
    assert sum(s["owned"] for s in sts) == IMAGES
    per_master = [_keys(c, i, fp) for i in range(3)]
    # nothing duplicated or missing: one key per sample, each on the master its daemon owns
    assert per_master == [s["owned"] for s in sts] and sum(per_master) == IMAGES, per_master
    # nothing torn: a reader gets every sample from the cache (no decode), each equal to a direct decode
    r = Reader(c, 0, str(tmp_path))
    epochs = r.finish(timeout=120)
    _assert_all_correct(epochs, IMAGES)
    stats = epochs[0]["stats"]
    assert stats["hits"] == IMAGES and stats["misses"] == 0, stats


# ------------------------------------------------------------------------------------------------- (a)
def test_a_master_killed_mid_epoch_reads_fall_back_then_refill(emu: EmuCluster, tmp_path) -> None:
    c = emu
    node = 2
    fp = _wait_full(c)[0]["fingerprint"]
    share = _keys(c, node, fp)
    assert share > 0
    r = Reader(c, 0, str(tmp_path), pause_after=3)
    try:
        r.wait_mid()
        c.kill_master(node)
    finally:
        r.resume()
    t0 = time.monotonic()
    epochs = r.finish(timeout=150)
    took = time.monotonic() - t0
    _assert_all_correct(epochs, IMAGES)  # every sample still right: node 2's ones came from the source
    stats = epochs[0]["stats"]
    assert stats["misses"] > 0, stats  # node 2's samples (after the kill) were misses, decoded again
    assert took < 150
    # back: the master rejoins with its slots, empty (no persistence); its share is refilled by its daemon
    # (a pass every poll_interval: the daemon stays live and keeps passing while its master is down); the
    # readers only read (trainers read, daemons write) -- no "still empty" check here: it would race
    c.restart_master(node)
    r2 = Reader(c, 0, str(tmp_path))
    epochs = r2.finish(timeout=120)
    _assert_all_correct(epochs, IMAGES)
    deadline = time.monotonic() + 30
    while _keys(c, node, fp) < share and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _keys(c, node, fp) == share  # refilled, nothing extra
    r3 = Reader(c, 1, str(tmp_path))
    epochs = r3.finish(timeout=120)
    _assert_all_correct(epochs, IMAGES)
    assert epochs[0]["stats"]["hits"] == IMAGES, epochs[0]["stats"]


# ------------------------------------------------------------------------------------------------- (c)
CUT_S = 4.0  # well under gloo's timeout (the trainer's process group: 30 min default) and TCP's give-up


def test_c_link_cut_reader_falls_back_and_completes(emu: EmuCluster, tmp_path) -> None:
    c = emu
    node = 1
    _wait_full(c)
    r = Reader(c, node, str(tmp_path), pause_after=3)
    try:
        r.wait_mid()
        c.link_down(node)
        r.resume()
        time.sleep(CUT_S)
    finally:
        c.link_up(node)
        r.resume()
    epochs = r.finish(timeout=120)
    _assert_all_correct(epochs, IMAGES)
    stats = epochs[0]["stats"]
    assert stats["misses"] > 0, stats


def test_c_link_cut_under_torchrun_training_completes(emu: EmuCluster, tmp_path) -> None:
    c = emu
    out = str(tmp_path / "run")
    args = ["-m", "trainer", "--recipe", "digits", "--data", _root(c), "--cache", _url(c), "--device", "cpu",
            "--threads", "1", "--epochs", "2", "--batch-size", "12", "--comm", "allreduce", "--out", out,
            "--no-progress"]
    agents = [c.run_on(i, c.torchrun_argv(i, args, rdzv_port=29431), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env={"OMP_NUM_THREADS": "1"}) for i in range(3)]
    metrics = os.path.join(out, "metrics.jsonl")
    cut_while_running = False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not os.path.exists(metrics):
            if any(a.poll() is not None for a in agents):
                break  # an agent exited before training started: its log is shown below
            time.sleep(0.1)
        if os.path.exists(metrics) and all(a.poll() is None for a in agents):
            c.link_down(2)
            time.sleep(CUT_S)
            cut_while_running = all(a.poll() is None for a in agents)
    finally:
        c.link_up(2)
    logs = []
    try:
        for a in agents:
            o, _ = a.communicate(timeout=240)
            logs.append(o)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait(10)
    assert [a.returncode for a in agents] == [0, 0, 0], "\n----\n".join(x[-2500:] for x in logs)
    assert cut_while_running  # the cut happened during training, not after it
    with open(metrics) as f:
        recs = [json.loads(ln) for ln in f]
    assert [r["epoch"] for r in recs if r["event"] == "epoch"] == [0, 1]
    start = next(r for r in recs if r["event"] == "start")
    assert start["world_size"] == 3
    assert "epoch 2/2" in logs[0]
