"""Error-feedback residuals across a change of world size or layout: keep what the model is owed.

A residual is gradient the sparse methods held back (averaged units: it enters the averaged update
as it is, whatever the world size; see :mod:`trainer.comm.error_feedback`). What the model is owed
for a bucket is one dense vector, ``owed``, of the bucket's length, assembled from EVERY old rank's
residual:

* ``naive_ag``: each rank holds its own unsent gradient for the whole bucket: ``owed = sum_r e_r``;
* ``hitopk``: each rank holds its node's unsent sum for its chunk of the padded bucket (chunk
  ``local_rank``, ``ceil(numel / local_size)`` elements): ``owed[chunk l] = sum over nodes of e_(node, l)``.

On the new topology every rank gets its share so that the new ranks' residuals sum to ``owed`` again
(fp32 rounding aside): ``naive_ag``: ``owed / world`` on each rank; ``hitopk``: rank (node n, local l)
holds chunk ``l`` of ``owed / nodes``. The method stays the one the residual was made for (a residual
is flushed into a dense reduction when the method changes, as always).

Every rank reads every old rank's comm state (``comm_rank*.pt`` of the checkpoint), so the rule needs
no collective. A key whose residuals disagree (different lengths or methods across ranks, or missing
on some rank) is dropped with a warning and counted, as a topology mismatch is today.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.comm.error_feedback import FORMAT_VERSION, residual_numel
from trainer.comm.topology import Topology

log = logging.getLogger(__name__)


def owed(states: Sequence[dict[str, Any]]) -> tuple[dict[str, tuple[str, Tensor]], list[str]]:
    """``({key: (method, owed vector)}, dropped keys)`` from every old rank's ``ErrorFeedback.state_dict()``
    (in rank order: ``states[r]`` is rank r's)."""
    world = len(states)
    keys = sorted({k for s in states for k in s["residuals"]})
    out: dict[str, tuple[str, Tensor]] = {}
    dropped = []
    for key in keys:
        parts = [(s["residuals"].get(key), s["meta"].get(key)) for s in states]
        metas = [m for _, m in parts]
        if any(m is None for m in metas) or len({(m["method"], m["numel"], m["world_size"], m["local_size"])
                                                 for m in metas}) != 1 or metas[0]["world_size"] != world:
            dropped.append(key)
            continue
        method, numel = metas[0]["method"], int(metas[0]["numel"])
        total = torch.zeros(numel, dtype=torch.float32)
        for res, meta in parts:
            assert res is not None
            res = res.to(torch.float32).reshape(-1)
            if method == "naive_ag":
                total += res
            else:  # hitopk: this rank's chunk of the padded bucket
                a = int(meta["local_rank"]) * res.numel()
                b = min(a + res.numel(), numel)
                if b > a:
                    total[a:b] += res[: b - a]
        out[key] = (method, total)
    return out, dropped


def share(method: str, total: Tensor, topo: Topology) -> Tensor:
    """This rank's residual under ``topo`` for a bucket owed ``total`` (see the module docstring)."""
    numel = total.numel()
    if method == "naive_ag":
        return total / topo.world_size
    chunk = residual_numel(method, numel, topo.local_size)
    out = torch.zeros(chunk, dtype=torch.float32)
    a = topo.local_rank * chunk
    b = min(a + chunk, numel)
    if b > a:
        out[: b - a] = total[a:b] / topo.num_nodes
    return out


def reshard(states: Sequence[dict[str, Any]], topo: Topology) -> dict[str, Any]:
    """An ``ErrorFeedback.state_dict()`` for THIS rank of ``topo`` carrying its share of everything the
    old ranks' residuals owed; :meth:`ErrorFeedback.load_state_dict` with ``topo`` then keeps it all."""
    totals, dropped = owed(states)
    for key in dropped:
        log.warning("error feedback: dropping residual %r on resume (its ranks' residuals disagree)", key)
    residuals, meta = {}, {}
    for key, (method, total) in totals.items():
        residuals[key] = share(method, total, topo)
        meta[key] = {"method": method, "numel": total.numel(), "world_size": topo.world_size,
                     "local_size": topo.local_size, "local_rank": topo.local_rank, "rank": topo.rank}
    before = max((int(s.get("dropped", 0)) for s in states), default=0)
    return {"format": FORMAT_VERSION, "residuals": residuals, "meta": meta, "dropped": before + len(dropped)}


def needs_reshard(state: dict[str, Any], topo: Topology) -> bool:
    """Whether a rank's saved ``ErrorFeedback.state_dict()`` was made on another topology."""
    now = (topo.world_size, topo.local_size, topo.rank)
    return any((m["world_size"], m["local_size"], m["rank"]) != now for m in state.get("meta", {}).values())
