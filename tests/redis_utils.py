"""Real Redis for tests: fixtures that start ``redis-server`` processes on free loopback ports and stop them.

* ``redis_server`` (module): one standalone server, flushed before each test that uses ``redis_url``
  (its URL has ``write_back=1``: :func:`private`).
* ``redis_cluster`` (module): a 3-master Redis Cluster (``redis-cli --cluster create``), flushed
  before each test that uses ``cluster_url``.
* ``fresh_cluster`` (function): a cluster of its own, for tests that kill or restart masters.

Everything is skipped with the reason when ``redis-server``/``redis-cli`` or redis-py are missing
(CI installs them: ``./quickstart.sh test``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from datacache.devtools.redis_local import (
    LocalCluster,
    RedisServer,
    redis_available,
    start_cluster,
    start_server,
)

try:
    import redis  # noqa: F401

    _PY = None
except ImportError:  # pragma: no cover - the test extra installs it
    _PY = "redis-py not installed (pip install '.[test]')"

SKIP = redis_available() or _PY
needs_redis = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def flushall(port: int) -> None:
    subprocess.run(["redis-cli", "-p", str(port), "flushall"], capture_output=True, check=True, timeout=10)


def cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=10).stdout.strip()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if SKIP:
        pytest.skip(SKIP)
    srv = start_server(str(tmp_path_factory.mktemp("redis")))
    yield srv
    srv.stop()


def private(url: str) -> str:
    """``url`` with ``write_back=1``: these servers are the test's alone (no ACL, the default user may
    write), so ``CachedImageNet`` writes its misses back as it does to a user's own Redis. The default --
    trainers read, daemons write: a shared tier is never written by a reader -- is what
    tests/test_redis_conf.py (real ACL roles) and tests/test_redis_stores.py check."""
    return url + ("&" if "?" in url else "?") + "write_back=1"


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    flushall(redis_server.port)
    return private(f"redis://{redis_server.addr}/0")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if SKIP:
        pytest.skip(SKIP)
    cl = start_cluster(str(tmp_path_factory.mktemp("cluster")), 3)
    yield cl
    cl.stop()


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    for m in redis_cluster.masters:
        flushall(m.port)
    return private(redis_cluster.url)


@pytest.fixture
def fresh_cluster(tmp_path) -> Iterator[LocalCluster]:
    if SKIP:
        pytest.skip(SKIP)
    cl = start_cluster(str(tmp_path / "cluster"), 3)
    yield cl
    cl.stop()

def slot_owners(port: int) -> dict[int, str]:
    """Slot -> ``host:port`` of its master, asked of a cluster node with ``CLUSTER SLOTS`` (a test reference
    independent of the store's own slot map)."""
    import redis

    owner: dict[int, str] = {}
    r = redis.Redis(host="127.0.0.1", port=port)
    for start, end, master, *_ in r.execute_command("CLUSTER SLOTS"):
        host = master[0].decode() if isinstance(master[0], bytes) else master[0]
        for s in range(int(start), int(end) + 1):
            owner[s] = f"{host}:{int(master[1])}"
    return owner
