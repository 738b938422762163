"""Where each byte went: a ``redis+cluster://...?local=host:port`` tier counts what the master on this
node served (local) and what came from the other masters (remote), per tier in ``ds.stats()``, summed
over DataLoader workers. Reference: the slot map as the servers report it (``CLUSTER KEYSLOT`` and
``CLUSTER SLOTS`` asked with redis-py) and each value's ``STRLEN`` on its master."""

from __future__ import annotations

import pytest
import redis
from torch.utils.data import DataLoader

from client.dataset import CachedImageNet
from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError
from datacache.stores import open_store
from tests.redis_utils import needs_redis, slot_owners

pytestmark = needs_redis


def _reference(cluster, keys: list[bytes], local: str) -> tuple[int, int, int, int]:
    """(local hits, local bytes, remote hits, remote bytes) from the servers' own answers."""
    first = cluster.masters[0]
    r = redis.Redis(host="127.0.0.1", port=first.port)
    owner = slot_owners(cluster.masters[0].port)
    clients = {m.addr: redis.Redis(host="127.0.0.1", port=m.port) for m in cluster.masters}
    out = [0, 0, 0, 0]
    for k in keys:
        addr = owner[int(r.execute_command("CLUSTER KEYSLOT", k))]
        size = int(clients[addr].strlen(k))
        assert size > 0
        base = 0 if addr == local else 2
        out[base] += 1
        out[base + 1] += size
    for c in [r, *clients.values()]:
        c.close()
    return tuple(out)  # type: ignore[return-value]


def _placed(d: dict) -> tuple[int, int, int, int]:
    return d["local_hits"], d["local_bytes"], d["remote_hits"], d["remote_bytes"]


def _read_all(ds: CachedImageNet, workers: int) -> None:
    loader = DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=lambda b: len(b))
    assert sum(loader) == len(ds)


def test_local_and_remote_bytes_match_the_slot_map(cluster_url: str, redis_cluster, imagefolder_factory,
                                                    tmp_path) -> None:
    root = imagefolder_factory(classes=3, per_class=10, size=(64, 48))
    CachedImageNet(root, cache=cluster_url, short_side=32).__getitems__(list(range(30)))  # fill
    local = redis_cluster.masters[1].addr
    ds = CachedImageNet(root, cache=f"{cluster_url}&local={local}", short_side=32)
    keys = [ds.key(i) for i in range(len(ds))]
    lh, lb, rh, rb = _reference(redis_cluster, keys, local)
    assert lh > 0 and rh > 0  # 30 keys over 3 masters: both kinds occur
    _read_all(ds, workers=2)  # two worker processes: their counters are summed
    s = ds.stats()
    assert s["processes"] >= 2
    tier = s["tiers"][0]
    assert _placed(tier) == (lh, lb, rh, rb)
    assert tier["local_bytes"] + tier["remote_bytes"] == tier["bytes"] == s["t2"]["bytes"]
    assert (s["local_bytes"], s["remote_bytes"]) == (lb, rb)

    # without local=: everything the cluster served is remote
    plain = CachedImageNet(root, cache=cluster_url, short_side=32)
    _read_all(plain, workers=0)
    p = plain.stats()
    assert _placed(p) == (0, 0, lh + rh, lb + rb)

    # chained behind a fresh LMDB tier: the cluster is tier 1, the LMDB tier counts no placement
    chained = CachedImageNet(root, cache=f"lmdb://{tmp_path / 'near'}::{cluster_url}&local={local}",
                             short_side=32)
    _read_all(chained, workers=0)
    c = chained.stats()
    near, far = c["tiers"]
    assert near["local_bytes"] == near["remote_bytes"] == 0 and near["hits"] == 0
    assert _placed(far) == (lh, lb, rh, rb)
    assert far["local_bytes"] + far["remote_bytes"] == far["bytes"]
    chained.flush(10)


def test_local_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="is not host:port"):
        open_store("redis+cluster://127.0.0.1:7000?local=nonsense")
    with pytest.raises(ConfigError, match="unknown option 'local' for redis://"):
        parse_cache_url("redis://127.0.0.1:7000?local=127.0.0.1:7000")
