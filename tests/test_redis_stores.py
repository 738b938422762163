"""Redis and Redis Cluster stores against real redis-server processes (tests/redis_utils.py)."""

from __future__ import annotations

import logging
import os
import pickle

import numpy as np
import pytest

from datacache.config import ConfigError
from datacache.record import decode_record, encode_record
from datacache.stores import open_store
from datacache.stores.redis_cluster import RedisClusterStore, key_slots
from tests.redis_utils import cli, flushall, needs_redis, private

pytestmark = needs_redis


def rec(i: int, side: int = 40) -> tuple[bytes, bytes]:
    key = b"dc:0123456789abcdef:t:%d" % i
    px = np.full((side, side, 3), i % 251, dtype=np.uint8)
    return key, encode_record(px, i, key=key)


def _round_trips(port: int) -> int:
    """Read events the server processed (one per pipelined request that arrives in one packet)."""
    for line in cli(port, "info", "stats").splitlines():
        if line.startswith("total_reads_processed:"):
            return int(line.split(":")[1])
    raise AssertionError("no total_reads_processed in INFO stats")


def test_standalone_round_trip_nx_contains_and_byte_capped_reads(redis_url: str, redis_server) -> None:
    s = open_store(redis_url + "&fetch_bytes=20000")
    items = [rec(i) for i in range(40)]  # ~4.9 KB each: 20 KB per round trip = ~4 keys
    assert s.put_many(items) == 40
    assert s.put_many([(items[0][0], b"other")]) == 0  # SET NX keeps the first value
    s.hint_value_bytes(len(items[0][1]))  # what CachedImageNet does from its variant
    before = _round_trips(redis_server.port)
    got = s.get_many([k for k, _ in items] + [b"dc:absent"])
    assert [bytes(v) for v in got[:40]] == [v for _, v in items] and got[40] is None
    trips = _round_trips(redis_server.port) - before - 1  # minus the INFO call itself
    assert 8 <= trips <= 14, trips  # chunked by reply bytes inside the store, not one 200 KB reply
    assert s.contains([items[3][0], b"nope"]) == [True, False]
    assert s.put_many([(items[0][0], b"x")], overwrite=True) == 1
    st = s.stats()
    assert st["entries"] == 40 and st["maxmemory_policy"] == "noeviction" and s.health()["ok"]
    clone = pickle.loads(pickle.dumps(s))  # picklable: only the configuration travels
    assert clone.get_many([items[5][0]])[0] == items[5][1]


def test_cluster_spreads_keys_reads_per_node_and_refuses_nothing(cluster_url: str, redis_cluster) -> None:
    s = open_store(cluster_url)
    assert isinstance(s, RedisClusterStore) and len(s.masters()) == 3
    items = [rec(i) for i in range(300)]
    assert s.put_many(items) == 300
    per_master = [int(cli(m.port, "dbsize")) for m in redis_cluster.masters]
    assert sum(per_master) == 300 and min(per_master) > 50  # spread over all masters (no hash tags)
    owners = s.master_of([k for k, _ in items])
    assert {o for o in owners} == {m.addr for m in redis_cluster.masters}
    got = s.get_many([k for k, _ in items])
    assert all(decode_record(v, k)[1] == i for i, ((k, _), v) in enumerate(zip(items, got)))
    assert s.contains([items[7][0], b"dc:nothing"]) == [True, False]
    assert s.put_many(items[:10]) == 0  # NX on every node
    st = s.stats()
    assert st["entries"] == 300 and st["read_errors"] == 0 and s.health()["ok"]
    # the slot of a key is Redis's own (CLUSTER KEYSLOT)
    assert int(cli(redis_cluster.masters[0].port, "cluster", "keyslot", items[9][0].decode())) == \
        int(key_slots([items[9][0]])[0])


def test_dead_master_is_misses_for_its_keys_only(fresh_cluster) -> None:
    s = open_store(fresh_cluster.url)
    items = [rec(i) for i in range(120)]
    s.put_many(items)
    owners = s.master_of([k for k, _ in items])
    dead = fresh_cluster.masters[1]
    dead.kill()
    got = s.get_many([k for k, _ in items])  # never raises, never waits for the dead node
    for (_k, v), o, g in zip(items, owners, got):
        assert (g is None) if o == dead.addr else (g == v)
    c = s.counters()
    lost = owners.count(dead.addr)
    assert c["unavailable"] == lost and c["read_errors"] == lost and c["misses"] == lost
    assert not s.health()["ok"]
    assert s.put_many([rec(1000 + i) for i in range(30)]) < 30  # the dead node's share is skipped
    fresh_cluster.restart_empty(1)
    got = s.get_many([k for k, _ in items])
    assert sum(g is None for g in got) == lost  # the restarted master came back empty
    assert s.put_many(items) == lost  # refilled


def test_wrong_password_or_acl_user_is_a_clear_error_at_open(tmp_path, small_imagefolder: str) -> None:
    from client.dataset import CachedImageNet
    from datacache.devtools.redis_local import start_server

    srv = start_server(str(tmp_path / "acl"), user="trainer", password="s3cret")
    try:
        for bad in (f"redis://trainer:wrong@{srv.addr}", f"redis://nobody:s3cret@{srv.addr}",
                    f"redis://{srv.addr}"):
            with pytest.raises(ConfigError, match=r"(?s)Wrong password or ACL user.*user:password@") as ei:
                CachedImageNet(small_imagefolder, cache=bad, short_side=32, t1_dir=None)
            assert "wrong" not in str(ei.value) and "s3cret" not in str(ei.value)  # never echoed
        good = private(f"redis://trainer:s3cret@{srv.addr}/0")
        ds = CachedImageNet(small_imagefolder, cache=good, short_side=32, t1_dir=None)
        assert "s3cret" not in repr(ds) and "trainer:***@" in ds.cache_url
        _img, label = ds[0]
        assert ds.stats()["decoded"] == 1 and ds[0][1] == label and ds.stats()["hits"] == 1
    finally:
        srv.stop()


def test_unreachable_server_warns_at_open_and_serves_from_the_source(small_imagefolder: str, caplog) -> None:
    from client.dataset import CachedImageNet
    from datacache.devtools.redis_local import free_port

    with caplog.at_level(logging.WARNING):
        url = private(f"redis://127.0.0.1:{free_port()}/0")
        ds = CachedImageNet(small_imagefolder, cache=url, short_side=32, t1_dir=None)
    assert "not reachable now" in caplog.text
    assert len(ds.__getitems__(list(range(6)))) == 6
    st = ds.stats()
    assert st["decoded"] == 6 and st["t2"]["unavailable"] >= 6
    assert ds.flush(timeout=10) and ds.store.counters()["write_errors"] == 6  # background write-backs too


class _Bomb:
    """If anything ever unpickled a cache value, this would create the file below."""

    path = ""

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def test_poisoned_value_is_a_miss_refilled_and_never_unpickled(redis_url: str, small_imagefolder: str,
                                                               tmp_path) -> None:
    from client.dataset import CachedImageNet

    ds = CachedImageNet(small_imagefolder, cache=redis_url, short_side=32, t1_dir=None)
    _Bomb.path = str(tmp_path / "unpickled")
    store = ds.store.tiers[0]  # the Redis tier itself (synchronous writes)
    store.put_many([(ds.key(0), pickle.dumps(_Bomb())), (ds.key(1), os.urandom(5000))])
    got = ds.__getitems__([0, 1])
    st = ds.stats()
    assert st["t2"]["invalid_rewritten"] == 2 and st["decoded"] == 2
    assert not os.path.exists(_Bomb.path)
    assert ds.flush(timeout=10)  # the rewrite went through the background write-back queue
    values = store.get_many([ds.key(0), ds.key(1)])
    assert all(decode_record(v, ds.key(i)) is not None for i, v in enumerate(values))
    assert [int(x[1]) for x in got] == [ds.targets[0], ds.targets[1]]


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_maxmemory_below_the_dataset(tmp_path, imagefolder_factory, policy: str, caplog) -> None:
    """~77 KB records x 90 samples = 7 MB; the server may hold ~2-3 MB of them."""
    import torch

    from client.dataset import CachedImageNet
    from datacache.decode import decode_image
    from datacache.devtools.redis_local import start_server

    root = imagefolder_factory(classes=3, per_class=30, size=(213, 160))
    srv = start_server(str(tmp_path / "mm"), maxmemory="4mb", policy=policy)
    try:
        ds = CachedImageNet(root, cache=private(f"redis://{srv.addr}/0"), short_side=160, t1_dir=None)
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                for s in range(0, len(ds), 8):
                    idx = list(range(s, min(len(ds), s + 8)))
                    for i, (img, label) in zip(idx, ds.__getitems__(idx)):
                        with open(os.path.join(root, ds.manifest.paths[i]), "rb") as f:
                            ref = torch.from_numpy(decode_image(f.read(), ds.variant)).permute(2, 0, 1)
                        assert torch.equal(img, ref) and label == ds.targets[i]
        assert ds.flush(timeout=10)
        st = ds.stats()
        info = ds.store.tiers[0].stats()
        assert st["hits"] < len(ds) and st["decoded"] > len(ds)  # part cached at most, the rest refilled
        if policy == "allkeys-lru":  # sequential scans thrash an LRU smaller than the data (CoorDL's finding)
            assert info["evicted_keys"] > 0 and st["t2"]["write_errors"] == 0
        else:  # MinIO: keeps what it has, so the second pass hits exactly what the first one stored
            assert info["evicted_keys"] == 0 and info["write_errors"] > 0  # refused (background write-backs)
            assert 0 < st["hits"] <= info["keys"], (st, info)
            assert "maxmemory" in caplog.text and "noeviction" in caplog.text  # one warning saying why
    finally:
        srv.stop()


def test_rediss_tls_end_to_end(tmp_path, small_imagefolder: str) -> None:
    """rediss:// against a real TLS listener (a self-signed CA made with openssl here)."""
    import shutil
    import subprocess

    from client.dataset import CachedImageNet
    from datacache.devtools.redis_local import RedisServer, free_port, server_args

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path / "tls"
    d.mkdir()

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=datacache-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj",
        "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "srv.pem", "-days", "2")
    port, tls_port = free_port(), free_port()
    args = [*server_args(port), "--tls-port", str(tls_port), "--tls-cert-file", str(d / "srv.pem"),
            "--tls-key-file", str(d / "srv.key"), "--tls-ca-cert-file", str(d / "ca.pem"),
            "--tls-auth-clients", "no"]
    srv = RedisServer(port, str(d / "run"), args).start()
    try:
        url = private(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={d / 'ca.pem'}")
        ds = CachedImageNet(small_imagefolder, cache=url, short_side=32, t1_dir=None)
        first = ds.__getitems__(list(range(8)))
        assert ds.flush(10) and ds.stats()["decoded"] == 8
        again = ds.__getitems__(list(range(8)))
        assert ds.stats()["hits"] == 8 and all(a[0].equal(b[0]) for a, b in zip(first, again))
        assert int(cli(port, "dbsize")) == 8  # the same server, written over TLS
        # a client that does not trust the server's CA is refused: misses, never a crash
        untrusted = f"rediss://127.0.0.1:{tls_port}/0"
        bad = CachedImageNet(small_imagefolder, cache=untrusted, short_side=32, t1_dir=None)
        assert len(bad.__getitems__([0, 1])) == 2 and bad.stats()["t2"]["unavailable"] >= 2
    finally:
        srv.stop()


def test_a_reader_never_writes_a_shared_tier_unless_told(redis_server, tmp_path, small_imagefolder: str,
                                                           caplog) -> None:
    """Trainers read, daemons write, as the client's own policy (not only the ACL's): on a Redis whose
    default user may write, CachedImageNet serves its misses without one write (the server stays empty,
    no write error); in a chain the local LMDB tier is still written; ``?write_back=1`` opts back in."""
    import logging

    from client.dataset import CachedImageNet

    flushall(redis_server.port)
    url = f"redis://{redis_server.addr}/0"
    with caplog.at_level(logging.INFO, logger="datacache.readthrough"):
        ds = CachedImageNet(small_imagefolder, cache=url, short_side=32, t1_dir=None)
        assert len(ds.__getitems__(list(range(8)))) == 8 and ds.flush(10)
    st = ds.stats()
    assert st["decoded"] == 8 and st["t2"]["written"] == 0 and st["t2"]["write_errors"] == 0, st
    assert int(cli(redis_server.port, "dbsize")) == 0
    assert "trainers read, daemons write" in caplog.text  # said once, with what to do
    chained = CachedImageNet(small_imagefolder, cache=f"lmdb://{tmp_path}/near::{url}", short_side=32,
                             t1_dir=None)
    chained.__getitems__(list(range(8)))
    assert chained.flush(10) and chained.stats()["t2"]["written"] == 8  # the local tier
    assert int(cli(redis_server.port, "dbsize")) == 0
    again = CachedImageNet(small_imagefolder, cache=f"lmdb://{tmp_path}/near::{url}", short_side=32,
                           t1_dir=None)
    again.__getitems__(list(range(8)))
    assert again.stats()["decoded"] == 0 and int(cli(redis_server.port, "dbsize")) == 0
    mine = CachedImageNet(small_imagefolder, cache=url + "?write_back=1", short_side=32, t1_dir=None)
    mine.__getitems__(list(range(8)))
    assert mine.flush(10) and int(cli(redis_server.port, "dbsize")) == 8
