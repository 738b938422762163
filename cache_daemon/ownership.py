"""Which samples this daemon ingests: every sample is ingested by exactly one daemon.

* ``cluster`` (Redis Cluster): the keys whose hash slot is served by the master on this node
  (``redis_node`` in the config), asked of the cluster itself (``CLUSTER SLOTS``,
  :meth:`~datacache.stores.redis_cluster.RedisClusterStore.master_of`). Writes are then local to the
  node, and the dataset is split across the nodes' memory the way Redis splits the keys. The map is
  refreshed before every fill pass, so a slot moved by a resharding (or a replica promoted) moves
  its samples to their new owner on the next pass. Keys never contain ``{}`` hash tags.
* ``hash`` (a plain list of nodes sharing one store): ``xxh3_64(key) % world_size == rank``; with
  every daemon configured with the same ``world_size`` and distinct ranks ``0..world_size-1`` the
  shares are disjoint and cover every key.
* ``all``: one daemon owns everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from cache_daemon.daemon_config import DaemonConfig


def hash_owner(keys: Sequence[bytes], world_size: int) -> np.ndarray:
    """Rank owning each key under ``hash`` ownership (the documented hash)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(bytes(k)) % world_size for k in keys), dtype=np.int64,
                       count=len(keys))


def owned_mask(cfg: DaemonConfig, store: Any, keys: Sequence[bytes]) -> np.ndarray:
    """Boolean mask of the keys this daemon owns now (see the module docstring)."""
    if cfg.ownership == "all":
        return np.ones(len(keys), dtype=bool)
    if cfg.ownership == "hash":
        return hash_owner(keys, cfg.world_size) == cfg.rank
    store.refresh_slots()  # ask the cluster now: slots may have moved since the last pass
    masters = store.masters()
    if cfg.redis_node not in masters:
        raise RuntimeError(f"redis_node {cfg.redis_node} is not a master of the cluster now (masters: "
                           f"{', '.join(masters)}); this daemon owns nothing until it is")
    owners = store.master_of(keys)
    return np.fromiter((o == cfg.redis_node for o in owners), dtype=bool, count=len(keys))
