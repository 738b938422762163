"""The locality-aware sampler in the trainer: which master is on this node, the epoch's owners, batches.

* :func:`local_master` -- the Redis Cluster master on this node: an explicit ``host:port``, or the one
  master whose address is assigned to this host (a UDP socket can bind to it); ambiguous (several
  masters on this host, e.g. a one-machine cluster on 127.0.0.1) or none -> ``None`` with the reason.
* :func:`epoch_owners` -- at the start of an epoch rank 0 maps every training sample to the node whose
  master serves its key slot (``-1``: a master on no training node) and broadcasts the array, so every
  rank plans the epoch from the same slot-map snapshot even if the cluster reshards meanwhile.
* :class:`LocalityBatchSampler` -- :class:`~trainer.data.DistributedBatchSampler` with the order of
  :func:`client.locality_sampler.plan_epoch`: the same number of batches on every rank, every sample once
  an epoch (the ``len % world`` padding aside, as ``DistributedSampler``), a node's ranks reading their
  own shard first, a fraction ``exchange`` swapped across nodes each epoch. The owners snapshot is part
  of its state: a checkpoint stores it, and a resumed epoch continues in exactly the same order.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from client.locality_sampler import owners_digest, owners_from_store, plan_epoch
from datacache.config import ConfigError
from trainer.data import DistributedBatchSampler
from trainer.train_config import SAMPLER_CHOICES  # noqa: F401  (re-exported: the sampler's names)

log = logging.getLogger(__name__)


def _is_local_address(host: str) -> bool:
    """True when ``host`` resolves to an address of this machine (a socket can bind to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def local_master(masters: Sequence[str], explicit: str = "") -> tuple[str | None, str]:
    """``(master on this node or None, why)`` among ``masters`` (``host:port`` strings)."""
    if explicit:
        if explicit not in masters:
            raise ConfigError(f"local master {explicit!r} is not a master of the cluster (masters: "
                              f"{', '.join(masters)}); pass the host:port the cluster announces")
        return explicit, "given"
    mine = [m for m in masters if _is_local_address(m.rpartition(":")[0].strip("[]"))]
    if len(mine) == 1:
        return mine[0], "the only master with an address of this host"
    if not mine:
        return None, "no master has an address of this host: every read is remote"
    return None, (f"{len(mine)} masters have addresses of this host ({', '.join(mine)}): pass the one "
                  "on this node explicitly (--local-master host:port)")


def node_masters(mine: str | None, node_of_rank: Sequence[int], group: Any = None) -> list[str]:
    """The master of every node (``""`` if unknown), gathered from all ranks; ranks of one node must
    agree on theirs."""
    import torch.distributed as dist

    world = len(node_of_rank)
    got: list[Any] = [None] * world
    if dist.is_available() and dist.is_initialized():
        dist.all_gather_object(got, mine or "", group=group)
    else:
        got = [mine or ""]
    nodes = max(node_of_rank) + 1
    out = [""] * nodes
    for r, m in enumerate(got):
        node = node_of_rank[r]
        if out[node] and m and out[node] != m:
            raise ConfigError(f"ranks of node {node} disagree on their local master ({out[node]} vs {m}); "
                              "pass --local-master host:port on every rank of that node")
        out[node] = out[node] or m
    return out


def epoch_owners(store: Any, keys: Sequence[bytes], masters_by_node: Sequence[str], *,
                 src: int = 0, n: int | None = None) -> np.ndarray:
    """Owners of ``keys`` from one slot-map snapshot, taken on rank ``src`` and broadcast to all.
    Only rank ``src`` reads ``keys``: the others may pass ``[]`` and the sample count ``n``."""
    n = len(keys) if n is None else int(n)
    import torch.distributed as dist

    dist_on = dist.is_available() and dist.is_initialized()
    if not dist_on or dist.get_rank() == src:
        try:
            if store is not None and store.sharded:
                store.refresh_slots()  # the slot map at this epoch's start, not what the last read left
            owners = owners_from_store(store, keys, masters_by_node)
        except Exception as e:  # COLLECTIVE below: rank src must reach the broadcast whatever happened
            log.warning("locality sampler: cannot read the slot map of %s (%s: %s); this epoch is an "
                        "ordinary exactly-once shuffle", getattr(store, "url", store), type(e).__name__, e)
            owners = np.full(n, -1, dtype=np.int16)
    else:
        owners = np.empty(n, dtype=np.int16)
    if dist_on:
        # gloo has no int16 collectives ("Invalid scalar type"): int32 on the wire (5 MB at 1.28M
        # samples), int16 again after. A CPU tensor: the trainer's group is cpu:gloo(,cuda:nccl).
        t = torch.from_numpy(owners.astype(np.int32))
        dist.broadcast(t, src=src)
        owners = t.numpy().astype(np.int16)
    return owners


class LocalityBatchSampler(DistributedBatchSampler):
    """Per-rank batches in the locality-aware order (module docstring)."""

    def __init__(self, indices: Sequence[int], owners: np.ndarray, node_of_rank: Sequence[int], rank: int = 0,
                 seed: int = 0, exchange: float = 0.1) -> None:
        super().__init__(indices, len(node_of_rank), rank, seed)
        self.publisher: Any = None  # rank 0's client.run_publisher.PlanPublisher (see plan_publisher)
        if not 0.0 <= float(exchange) <= 1.0:
            raise ConfigError(f"--exchange must be a fraction in [0, 1], got {exchange}")
        self.node_of_rank = [int(n) for n in node_of_rank]
        self.exchange = float(exchange)
        self.set_owners(owners)

    def set_owners(self, owners: np.ndarray) -> None:
        """The owners of ``indices`` (same order), identical on every rank; call before ``set_epoch``."""
        owners = np.asarray(owners, dtype=np.int16)
        if len(owners) != len(self.indices):
            raise ConfigError(f"owners has {len(owners)} entries for {len(self.indices)} samples")
        self.owners = owners

    def _plan_epoch(self) -> list[np.ndarray]:
        return plan_epoch(self.owners, self.node_of_rank, seed=self.seed, epoch=self.epoch,
                          exchange=self.exchange).per_rank

    def _plan_subset(self, sub: np.ndarray, part: int) -> list[np.ndarray]:
        # the rest of a re-planned epoch: the same plan over the remaining samples' owners (the
        # snapshot taken when the run resumed), its own random streams
        return plan_epoch(self.owners[sub], self.node_of_rank, seed=self.seed, epoch=self.epoch,
                          exchange=self.exchange, part=part).per_rank

    def __iter__(self) -> Any:
        pub = self.publisher
        for req in super().__iter__():
            if pub is not None and self.current_rest() is None:
                # the loader draws batches in the main process: what it has taken so far, per rank
                pub.progress(drawn=(req.step + 1) * self.batch_size)
            yield req

    def publish_epoch(self) -> None:
        """Tell the publisher (rank 0 only) that the current epoch starts with the current owners."""
        if self.publisher is not None:
            self.publisher.epoch(self.epoch, self.owners, replanned=self.current_rest() is not None)
            self.publisher.progress(trained=self.start_step * self.batch_size)

    def local_fraction(self) -> float:
        """Of the planned samples that have an owner on a training node, the fraction read on it."""
        nodes = max(self.node_of_rank) + 1
        local = owned = 0
        for r, order in enumerate(self.plan()):
            own = self.owners[order]
            local += int((own == self.node_of_rank[r]).sum())
            owned += int(((own >= 0) & (own < nodes)).sum())
        return local / owned if owned else 1.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this epoch in the same order: the owners snapshot, the
        plan's options, the rank layout the plan was made for (the node of every rank) and the
        re-planned rest of the epoch, if it has one."""
        return {**super().state_dict(), "kind": "local", "owners": torch.from_numpy(self.owners.copy()),
                "digest": owners_digest(self.owners), "exchange": self.exchange,
                "node_of_rank": list(self.node_of_rank)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved epoch on the same layout. Refuses (ConfigError, one line) another --exchange
        or --seed, and another rank layout (the plan gives each NODE its share: another layout re-plans
        the rest of the epoch instead, :mod:`trainer.epoch_rest`)."""
        if float(state["exchange"]) != self.exchange or int(state["seed"]) != self.seed:
            raise ConfigError(f"the checkpoint's sampler used exchange {state['exchange']} and seed "
                              f"{state['seed']}; this run has {self.exchange} and {self.seed}: resume with "
                              "the same --exchange and --seed")
        saved_layout = state.get("node_of_rank")
        if saved_layout is None:
            raise ConfigError("the checkpoint's locality sampler state predates the rank-layout record, so "
                              "its epoch cannot be continued safely: resume from an epoch-end checkpoint")
        if [int(n) for n in saved_layout] != self.node_of_rank:
            raise ConfigError(f"the epoch was planned for {describe_layout(saved_layout)}, this sampler is "
                              f"{describe_layout(self.node_of_rank)}")
        owners = np.asarray(state["owners"], dtype=np.int16)
        if owners_digest(owners) != state["digest"]:
            raise ConfigError("the checkpoint's sampler state is damaged (owners digest mismatch)")
        self.set_owners(owners)
        super().load_state_dict(state)


# ------------------------------------------------------------ wiring into a training run
def plan_publisher(dataset: Any, indices: Sequence[int], sampler: LocalityBatchSampler,
                   masters_by_node: Sequence[str]) -> tuple[Any, str]:
    """Rank 0's run-plan publisher for the cache daemons' rolling fill (:mod:`datacache.run_plan`), or
    ``(None, why not)``: the plan must cover the dataset's indices ``0..n-1`` in order (a held-out split
    of the same folder does not: use ``--val-data``), and every node must have a known master."""
    from client.run_publisher import PlanPublisher

    n = len(dataset)
    if len(indices) != n or not np.array_equal(np.asarray(indices, dtype=np.int64), np.arange(n)):
        return None, ("the training indices are a held-out split of the folder (the daemons plan whole "
                      "datasets): use --val-data for validation")
    if not all(masters_by_node):
        return None, "a node has no known local master (pass --local-master host:port there)"
    try:
        pub = PlanPublisher.for_dataset(dataset, seed=sampler.seed, exchange=sampler.exchange,
                                        drop_last=False, node_of_rank=sampler.node_of_rank,
                                        masters=list(masters_by_node))
    except Exception as e:  # too many ranks for one record, no Redis tier: the run goes on without
        return None, f"{type(e).__name__}: {e}"
    return pub, "published"


def with_local_master(cache_url: str, addr: str) -> str:
    """``cache_url`` with ``local=addr`` on every ``redis+cluster://`` tier that has no ``local=`` yet
    (the store then counts local / remote bytes); other URLs unchanged."""
    from datacache.cacheurl import StoreSpec, parse_cache_url

    spec = parse_cache_url(cache_url)
    tiers = []
    changed = False
    for t in spec.tiers:
        if t.scheme == "redis+cluster" and t.option("local") is None:
            t = StoreSpec(t.scheme, t.location, tuple(sorted((*t.options, ("local", addr)))))
            changed = True
        tiers.append(t.secret_url)
    return "::".join(tiers) if changed else cache_url


def cluster_store(cache_url: str) -> Any | None:
    """A store of the cache's first ``redis+cluster://`` tier (this process's own, for slot maps), or
    ``None`` when the cache has none (LMDB, memory, one Redis server)."""
    from datacache.cacheurl import parse_cache_url
    from datacache.config import default_cache_url
    from datacache.stores import open_store

    for t in parse_cache_url(cache_url or default_cache_url()).tiers:
        if t.scheme == "redis+cluster":
            return open_store(t)
    return None


def find_local_master(store: Any | None, explicit: str, required: bool) -> tuple[str | None, str]:
    """``(master on this node or None, why)`` for the cluster ``store`` (see :func:`local_master`).
    Unreachable cluster: a ConfigError when ``required`` (``--sampler local``), else ``None``."""
    if store is None:
        if explicit:
            raise ConfigError(f"--local-master {explicit} given, but the cache has no redis+cluster:// tier; "
                              "drop --local-master or use a Redis Cluster cache")
        return None, "the cache has no Redis Cluster tier"
    try:
        masters = store.masters()
    except Exception as e:  # any connection failure: say which cluster and why
        if required or explicit:
            raise ConfigError(f"{store.url}: cannot read the cluster's masters ({type(e).__name__}: {e}); "
                              "start the cluster or fix --cache") from None
        return None, f"cluster unreachable at start ({type(e).__name__})"
    return local_master(masters, explicit)


def describe_layout(node_of_rank: Sequence[int]) -> str:
    """``"2 nodes x 4 ranks"`` (or the node of every rank when the nodes hold different counts)."""
    counts = [list(node_of_rank).count(n) for n in sorted(set(node_of_rank))]
    if len(set(counts)) == 1:
        return f"{len(counts)} node{'s' * (len(counts) != 1)} x {counts[0]} rank{'s' * (counts[0] != 1)}"
    return f"ranks on nodes {list(node_of_rank)}"


def node_of_ranks(world_size: int, local_world_size: int) -> list[int]:
    """The node of every rank: torchrun numbers ranks node by node (``GROUP_RANK = rank //
    LOCAL_WORLD_SIZE`` with the same ``--nproc-per-node`` everywhere)."""
    return [r // local_world_size for r in range(world_size)]
