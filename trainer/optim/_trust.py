"""Shared, sync-free helpers for layer-wise adaptive optimizers (LARS, LAMB).

Everything here works on whole lists of layers at once and never reads a tensor value on
the host (no ``.item()``, no Python ``if`` on a tensor): zero-norm special cases are
handled with ``torch.where``, so a step on CUDA issues kernels without a device->host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def is_excluded(param: Tensor, group_flag: bool | None) -> bool:
    """Whether ``param`` skips the layer-wise adaptation and weight decay.

    ``group_flag`` is the param group's ``lars_exclude``: ``True`` excludes every tensor of
    the group, ``False`` adapts every tensor, ``None`` (default) excludes tensors with
    ``ndim <= 1`` — biases and BatchNorm/LayerNorm scales and shifts, "as usual".
    """
    if group_flag is None:
        return param.ndim <= 1
    return bool(group_flag)


def stacked_norms(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of every tensor, as one fp32 vector (``torch._foreach_norm`` + ``stack``)."""
    if not tensors:
        return torch.zeros(0)
    norms = torch._foreach_norm(list(tensors))
    return torch.stack(norms).float()


def lars_trust(w_norm: Tensor, g_norm: Tensor, eta: Tensor, weight_decay: Tensor, eps: Tensor) -> Tensor:
    """LARS trust ratio (Shi et al. eq. 11 without the global LR): ``eta*|w| / (|g| + wd*|w| + eps)``.

    Returns 1 where either norm is zero (a freshly zero-initialised layer or a layer whose
    gradient is zero), so such layers fall back to the plain (momentum SGD) update.
    """
    ratio = eta * w_norm / (g_norm + weight_decay * w_norm + eps)
    ok = (w_norm > 0) & (g_norm > 0)
    return torch.where(ok, ratio, torch.ones_like(ratio))


def lamb_trust(w_norm: Tensor, u_norm: Tensor) -> Tensor:
    """LAMB trust ratio ``|w| / |update|``; 1 where either norm is zero."""
    ok = (w_norm > 0) & (u_norm > 0)
    ratio = w_norm / torch.where(ok, u_norm, torch.ones_like(u_norm))
    return torch.where(ok, ratio, torch.ones_like(ratio))


@dataclass
class LayerTable:
    """The adapted layers of one step, in a fixed order (group order, then param order).

    ``hyper`` holds per-layer hyper-parameter vectors (built once and cached by the caller
    while the hyper-parameters do not change; building them is a small host->device copy,
    not a sync).
    """

    params: list[Tensor] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    hyper: dict[str, list[float]] = field(default_factory=dict)

    def add(self, p: Tensor, **hyper: float) -> None:
        self.params.append(p)
        self.numels.append(p.numel())
        for k, v in hyper.items():
            self.hyper.setdefault(k, []).append(float(v))

    def key(self) -> tuple:
        return (tuple(id(p) for p in self.params),
                tuple((k, tuple(v)) for k, v in sorted(self.hyper.items())))


class HyperCache:
    """Caches the per-layer hyper-parameter vectors of a :class:`LayerTable` on a device."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._vecs: dict[str, Tensor] = {}

    def vectors(self, table: LayerTable, device: torch.device) -> dict[str, Tensor]:
        key = (table.key(), str(device))
        if key != self._key:
            self._vecs = {k: torch.tensor(v, dtype=torch.float32, device=device)
                          for k, v in table.hyper.items()}
            self._key = key
        return self._vecs


def check_hyper(name: str, value: float, low: float = 0.0, *, inclusive: bool = True) -> None:
    """Raise a ValueError naming the hyper-parameter when ``value`` is out of range."""
    bad = value < low if inclusive else value <= low
    if bad:
        op = ">=" if inclusive else ">"
        raise ValueError(f"invalid {name}: {value!r} (must be {op} {low})")
