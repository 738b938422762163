"""bench/emucluster.py uses the Redis roles: its masters run the filled redis.conf (no placeholder, no
password-less access), its daemons the ``datacache-daemon`` role from a 0600 TOML, and the trainers' URL
(``cache_url()``, ``EMUCLUSTER_CACHE_URL``) is the ``datacache`` role, which reads samples the daemons
wrote and can write nothing: no sample (trainers read, daemons write), not the daemons' registry. Real
namespaces, servers and daemons; skipped with the
reason where namespaces cannot be made (not root, no ip/tc, no redis-server).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from bench.emucluster import EmuCluster, EmuConfig, why_unavailable

SKIP = why_unavailable()
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=f"emulated cluster: {SKIP}"), pytest.mark.netns]

_CLIENT = r"""
import os, sys
from redis.exceptions import NoPermissionError
from datacache.stores import open_store
s = open_store(os.environ["EMUCLUSTER_CACHE_URL"])
assert s.put_many([(b"dc:emu:role", b"x" * 100)]) == 0 and s.counters()["write_errors"] == 1  # NOPERM
assert s.get_many([b"dc:emu:role"]) == [None]
try:
    s.status_set(b"dcd:datasets", "/etc|t160", b"x")
    print("WROTE")
except NoPermissionError:
    print("REFUSED")
"""


def test_emulated_cluster_runs_each_process_in_its_role(tmp_path) -> None:
    with EmuCluster(EmuConfig(state_dir=str(tmp_path / "state"), rate_gbit=None, images=12, timeout=60)) as c:
        assert c.cache_url().startswith("redis+cluster://datacache:")
        for i in range(3):
            wd = os.path.join(c.dir, f"node{i}")
            for name in ("daemon.toml", "redis.conf"):
                assert stat.S_IMODE(os.stat(os.path.join(wd, name)).st_mode) == 0o600
            with open(os.path.join(wd, "daemon.toml")) as f:
                assert '"redis+cluster://datacache-daemon:' in f.read()
            with open(os.path.join(wd, "redis.conf")) as f:
                live = [ln for ln in f.read().splitlines() if not ln.lstrip().startswith("#")]
            assert not any("CHANGE_ME" in ln for ln in live)
            assert "NOAUTH" in subprocess.run(
                ["ip", "netns", "exec", c.ns(i), "redis-cli", "-h", c.addrs[i], "-p",
                 str(c.state["redis_port"]), "ping"], capture_output=True, text=True, timeout=30).stdout
            assert c.daemon_health(i) is True  # the daemons run as datacache-daemon (fill reports: HSET)
        p = c.run_on(0, [sys.executable, "-c", _CLIENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "REFUSED", out + err[-2000:]
