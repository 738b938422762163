"""The test clusters' port choice (datacache/devtools/redis_local.py): a port picked free but taken by
another listener before redis-server binds it (CI: three test workers pick ports at once) is replaced,
for a standalone server and for a cluster master; a port the caller chose is never silently changed."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import redis

from datacache.devtools import redis_local
from tests.redis_utils import needs_redis

pytestmark = needs_redis


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as s:  # a listener that is not ours, on a port free_ports would accept
        s.bind(("127.0.0.1", redis_local.free_port()))
        s.listen()
        yield s.getsockname()[1]


def picks_taken_first(monkeypatch: pytest.MonkeyPatch, port: int) -> list[int]:
    picked: list[int] = []
    real = redis_local.free_ports

    def pick(n: int = 1) -> int:
        p = port if not picked else real(n)
        picked.append(p)
        return p

    monkeypatch.setattr(redis_local, "free_ports", pick)
    return picked


def test_a_server_on_a_taken_port_moves_to_another(taken: int, tmp_path, monkeypatch) -> None:
    picked = picks_taken_first(monkeypatch, taken)
    srv = redis_local.start_server(str(tmp_path / "s"))
    try:
        assert picked[0] == taken and srv.port == picked[1] != taken
        assert redis.Redis(port=srv.port).ping()
    finally:
        srv.stop()


def test_a_cluster_master_on_a_taken_port_moves_to_another(taken: int, tmp_path, monkeypatch) -> None:
    picked = picks_taken_first(monkeypatch, taken)
    cl = redis_local.start_cluster(str(tmp_path / "c"), 3)
    try:
        assert taken not in [m.port for m in cl.masters] and picked[0] == taken and len(picked) == 4
        assert redis.Redis(port=cl.masters[0].port).cluster("info").get("cluster_state") == "ok"
    finally:
        cl.stop()


def test_a_port_given_is_used_or_fails(taken: int, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="Address already in use"):
        redis_local.start_server(str(tmp_path / "s"), port=taken)
