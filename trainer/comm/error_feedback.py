"""Error-feedback residuals (fp32) per gradient bucket, keyed by a stable name.

A bucket's key is derived from the names of the parameters in it (``bucket_key``), not from
DDP's bucket index: DDP rebuilds its buckets after the first iteration, which changes the
indices and the grouping. Residuals whose bucket no longer exists are pruned at the end of a
step (:meth:`ErrorFeedback.prune_unused`); only the first step's unsent mass is lost that way.

Layout depends on the method: NaiveAG keeps a full-bucket residual (``numel`` elements, this
rank's own unsent gradient); HiTopKComm keeps ``ceil(numel / local_size)`` elements (the
node's unsent sum for this rank's chunk). Each residual carries metadata (method, bucket
numel, world size, local size, local rank) and is only reused when all of it matches.

Resume on a different topology (world size, local size or rank changed): a residual's meaning
depends on the topology (HiTopK chunks follow the local size, NaiveAG residuals belong to a
rank), so a mismatching residual loaded here is DROPPED with a logged warning and counted in
``dropped``. Re-splitting needs every rank's residual at once: :mod:`trainer.comm.ef_reshard`
does it from all saved ranks' states (the trainer's resume), keeping what the model is owed.

Units: residuals are in averaged gradient units, and under fp16 AMP UNSCALED (true gradient
units). The bucket the hook sees holds loss-scaled gradients (``GradScaler``'s current scale S);
the hook multiplies the residual by S before compensating and divides the updated residual by S
afterwards (:attr:`HookState.grad_scale`; S is a power of two, so both are exact). When the
scaler halves or doubles S, the held-back gradient keeps its weight; stored in scaled units it
would count x0.5 or x2 in the next step.

Devices: residuals live on the bucket's device; a residual loaded from a checkpoint (CPU) moves
to the bucket's device and dtype when it is first used or flushed into a dense bucket.

Checkpoints: residuals differ per rank, so save ``state_dict()`` PER RANK (e.g.
``ef_rank{rank}.pt``). The dict holds only tensors, strings and ints, so
``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from trainer.comm.hitopk import slice_numel
from trainer.comm.topology import Topology

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def bucket_key(params: Iterable[Tensor], names: dict[int, str]) -> str:
    """Stable key of a bucket from its parameters' names (``first..last#count:hash``).

    ``names`` maps ``id(param)`` to its name (built from ``model.named_parameters()`` at
    registration). Unknown parameters are named by shape (less stable, still deterministic).
    """
    labels = [names.get(id(p), f"?{tuple(p.shape)}") for p in params]
    if not labels:
        return "empty"
    digest = hashlib.sha1("|".join(labels).encode()).hexdigest()[:10]
    return f"{labels[0]}..{labels[-1]}#{len(labels)}:{digest}"


def _meta(method: str, numel: int, topo: Topology) -> dict[str, Any]:
    return {"method": method, "numel": int(numel), "world_size": topo.world_size,
            "local_size": topo.local_size, "local_rank": topo.local_rank, "rank": topo.rank}


def residual_numel(method: str, numel: int, local_size: int) -> int:
    """Residual length for a bucket of ``numel`` elements under ``method``."""
    if method == "hitopk":
        return slice_numel(numel, local_size)  # this rank's chunk of the padded bucket
    if method == "naive_ag":
        return numel
    raise ValueError(f"no residual layout for method {method!r}; sparse methods are naive_ag, hitopk")


class ErrorFeedback:
    """fp32 residual memory for the sparse methods, with per-rank state_dict round trips."""

    def __init__(self) -> None:
        self._res: dict[str, Tensor] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._used: set[str] = set()
        self.dropped = 0  # residuals discarded because their layout/topology no longer matched

    def __len__(self) -> int:
        return len(self._res)

    def keys(self) -> list[str]:
        return list(self._res)

    def get(self, key: str) -> Tensor | None:
        return self._res.get(key)

    def _drop(self, key: str, why: str) -> None:
        log.warning("error feedback: dropping residual %r (%s)", key, why)
        self._res.pop(key, None)
        self._meta.pop(key, None)
        self.dropped += 1

    def residual(self, key: str, *, method: str, numel: int, topo: Topology,
                 device: torch.device | str = "cpu") -> Tensor:
        """The residual for bucket ``key`` (zeros when new or when the old one does not fit)."""
        meta = _meta(method, numel, topo)
        self._used.add(key)
        old = self._res.get(key)
        if old is not None:
            if self._meta.get(key) == meta:
                if old.device != torch.device(device):
                    old = self._res[key] = old.to(device=device, dtype=torch.float32)
                return old
            self._drop(key, f"layout changed: {self._meta.get(key)} -> {meta}")
        res = torch.zeros(residual_numel(method, numel, topo.local_size), dtype=torch.float32,
                          device=device)
        self._res[key], self._meta[key] = res, meta
        return res

    def flush_into(self, key: str, flat: Tensor, topo: Topology, scale: float = 1.0,
                   grad_scale: Tensor | None = None) -> bool:
        """Add ``scale`` x bucket ``key``'s residual into a dense gradient ``flat`` and forget it.

        Used when the method switches from sparse to dense: summed over ranks, the flushed
        residuals deliver exactly the mass that was held back. The hooks keep residuals in
        averaged units and divide the dense sum by the world size afterwards, so they pass
        ``scale=world_size``; under AMP ``grad_scale`` (the loss scale of this backward, a device
        tensor: no host read) brings the unscaled residual to the bucket's units. The residual is
        moved to ``flat``'s device and dtype (a residual loaded from a checkpoint is on the CPU).
        Returns True if one was added.
        """
        self._used.add(key)
        res = self._res.get(key)
        if res is None:
            return False
        meta = self._meta[key]
        if (meta["world_size"], meta["local_size"], meta["rank"], meta["numel"]) != \
                (topo.world_size, topo.local_size, topo.rank, flat.numel()):
            self._drop(key, "topology or bucket size changed before it could be flushed")
            return False
        res = res.to(device=flat.device)  # a checkpoint's residual is on the CPU, the bucket maybe not
        if grad_scale is not None:
            res = res * grad_scale.to(device=flat.device, dtype=res.dtype)
        res = res.to(dtype=flat.dtype)
        if meta["method"] == "naive_ag":
            flat.add_(res, alpha=scale)
        else:  # hitopk: my chunk of the padded bucket
            a = meta["local_rank"] * res.numel()
            b = min(a + res.numel(), flat.numel())
            if b > a:  # narrow, not slicing: also runs on fake CUDA tensors (tests/test_fake_cuda.py)
                flat.narrow(0, a, b - a).add_(res.narrow(0, 0, b - a), alpha=scale)
        del self._res[key], self._meta[key]
        return True

    def prune_unused(self, keep_all: bool = False) -> int:
        """Drop residuals not touched since the last prune (buckets DDP rebuilt away).

        ``keep_all`` only resets the usage record (used after DDP's first-layout step).
        """
        if keep_all or not self._used:
            self._used.clear()
            return 0  # no hook ran this step (or it proves nothing): drop nothing
        stale = [k for k in self._res if k not in self._used]
        for k in stale:
            self._res.pop(k)
            self._meta.pop(k)
        self._used.clear()
        return len(stale)

    def state_dict(self) -> dict[str, Any]:
        """Per-rank checkpoint: ``{"format", "residuals": {key: cpu tensor}, "meta": {...}}``."""
        return {"format": FORMAT_VERSION,
                "residuals": {k: v.detach().cpu().clone() for k, v in self._res.items()},
                "meta": {k: dict(m) for k, m in self._meta.items()},
                "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any], topo: Topology | None = None) -> None:
        """Restore residuals; with ``topo``, drop (and log) the ones saved on another topology.

        Without ``topo`` the check happens lazily when a hook first asks for the residual.
        """
        fmt = state.get("format") if isinstance(state, dict) else None
        if fmt != FORMAT_VERSION:
            raise ValueError(f"ErrorFeedback.load_state_dict: expected a dict from "
                             f"ErrorFeedback.state_dict() with format={FORMAT_VERSION}, got "
                             f"{type(state).__name__} with format={fmt!r}")
        res, meta = state.get("residuals", {}), state.get("meta", {})
        if set(res) != set(meta):
            raise ValueError("ErrorFeedback.load_state_dict: 'residuals' and 'meta' keys differ; "
                             "the checkpoint is damaged")
        self._res = {k: v.detach().to(torch.float32, copy=True) for k, v in res.items()}  # no aliasing
        self._meta = {k: dict(m) for k, m in meta.items()}
        self._used.clear()
        self.dropped = int(state.get("dropped", 0))
        if topo is not None:
            now = (topo.world_size, topo.local_size, topo.rank)
            for k in list(self._res):
                m = self._meta[k]
                if (m["world_size"], m["local_size"], m["rank"]) != now:
                    self._drop(k, f"saved on world_size={m['world_size']} local_size={m['local_size']} "
                                  f"rank={m['rank']}, now {now}")
