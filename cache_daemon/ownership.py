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

:func:`owned_indices` answers for a whole dataset without building its keys (the slots of
``prefix + index`` are computed from the indices: :func:`~datacache.stores.redis_cluster.index_key_slots`)
and returns a digest of what decided it (the node's slots, or rank/world size): a pass whose digest and
dataset are unchanged reuses the previous answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


HASH_CHUNK = 65536  # keys built at once under ``hash`` ownership (bounded memory at any dataset size)


@dataclass(frozen=True)
class Owned:
    """The samples of a dataset this daemon owns, and what decided them. Kept between passes, so it is
    stored as one bit per sample of the dataset (160 KB at ImageNet's 1.28M; the int64 indices of a
    third of it would be 3.4 MB more for the daemon's whole life): :attr:`indices` unpacks them."""

    bits: np.ndarray  # uint8, np.packbits of the "owned" mask over 0..n-1
    count: int  # how many are owned
    prefix: bytes  # the dataset's key prefix (fingerprint and variant) and its size: what was asked
    n: int
    digest: bytes  # ownership inputs (mode, node and its slots / rank and world size)
    slots: np.ndarray | None  # cluster: the slots this node serves (int32, ascending); else None

    @classmethod
    def of_mask(cls, mask: np.ndarray, prefix: bytes, digest: bytes, slots: np.ndarray | None) -> Owned:
        return cls(np.packbits(mask), int(np.count_nonzero(mask)), prefix, len(mask), digest, slots)

    @property
    def indices(self) -> np.ndarray:
        """The owned indices, ascending (int64, a fresh array: a pass holds it only while it runs)."""
        return np.flatnonzero(np.unpackbits(self.bits, count=self.n))


def _cluster_slots(cfg: DaemonConfig, store: Any) -> np.ndarray:
    store.refresh_slots()  # ask the cluster now: slots may have moved since the last pass
    nodes, table = store.slot_table()
    masters = store.masters()
    if cfg.redis_node not in masters:
        raise RuntimeError(f"redis_node {cfg.redis_node} is not a master of the cluster now (masters: "
                           f"{', '.join(masters)}); this daemon owns nothing until it is")
    return np.flatnonzero(table == nodes.index(cfg.redis_node)).astype(np.int32)


def ownership_digest(cfg: DaemonConfig, store: Any) -> tuple[bytes, np.ndarray | None]:
    """(digest of the ownership inputs now, the node's slots under ``cluster`` ownership)."""
    if cfg.ownership == "cluster":
        slots = _cluster_slots(cfg, store)
        return xxhash.xxh3_128_digest(b"cluster:" + cfg.redis_node.encode() + b":" + slots.tobytes()), slots
    if cfg.ownership == "hash":
        return f"hash:{cfg.rank}/{cfg.world_size}".encode(), None
    return b"all", None


def owned_indices(cfg: DaemonConfig, store: Any, prefix: bytes, n: int,
                  previous: Owned | None = None) -> Owned:
    """Indices ``0..n-1`` whose keys ``prefix + b"%d" % i`` this daemon owns now (module docstring);
    ``previous`` is returned as is when it answered the same question (same prefix -- the dataset's
    fingerprint and variant --, size and ownership digest): nothing is recomputed."""
    digest, slots = ownership_digest(cfg, store)
    if previous is not None and (previous.prefix, previous.n, previous.digest) == (prefix, n, digest):
        return previous
    if cfg.ownership == "all":
        return Owned.of_mask(np.ones(n, dtype=bool), prefix, digest, None)
    if cfg.ownership == "hash":
        mask = np.zeros(n, dtype=bool)
        for s in range(0, n, HASH_CHUNK):
            idx = range(s, min(n, s + HASH_CHUNK))
            mask[s:s + len(idx)] = hash_owner([prefix + b"%d" % i for i in idx], cfg.world_size) == cfg.rank
        return Owned.of_mask(mask, prefix, digest, None)
    from datacache.stores.redis_cluster import NSLOTS, index_key_slots

    assert slots is not None
    member = np.zeros(NSLOTS, dtype=bool)
    member[slots] = True
    return Owned.of_mask(member[index_key_slots(prefix, np.arange(n))], prefix, digest, slots)
