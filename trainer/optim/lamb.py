"""LAMB: layer-wise adaptive moments for large batches (You et al. 2020), with optional PTO.

For every layer with a gradient (step t counted per parameter)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + wd * w   (no bias correction
                                                                           if disabled)
    trust = |w| / |u|                       (1 where either norm is 0)
    w -= lr * trust * u

Biases and normalisation parameters (``ndim <= 1`` by default, or a group with
``lars_exclude=True``) skip the trust ratio and the weight decay: they get plain Adam.

Sync-free like :class:`~trainer.optim.lars.LARS` (``torch._foreach_*``, ``torch.where``, no
``.item()``). With ``pto=True``/``pto=<ProcessGroup>`` every rank still updates the moments
of all layers (it needs ``u`` to apply them), but computes the norms and trust ratios of its
share of the layers only; one all-gather per step shares the ratios. Gradients must already
be averaged over the ranks (DDP does that).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from trainer.optim._trust import check_hyper, is_excluded, lamb_trust, stacked_norms
from trainer.optim.pto import PTO


class LAMB(Optimizer):
    """Adam moments + decoupled-in-update weight decay + layer-wise trust ratio |w|/|u|.

    Args:
        params: parameters or param groups (groups may override the options below and set
            ``lars_exclude``: ``None`` = exclude ``ndim <= 1``, ``True``/``False`` = all/none).
        lr: learning rate.
        betas: coefficients of the first and second moment averages.
        eps: added to the denominator ``sqrt(v_hat)``.
        weight_decay: weight decay added to the update of adapted layers.
        bias_correction: divide the moments by ``1 - beta**t``.
        pto: ``False``, ``True`` (default process group) or a ``ProcessGroup``.
        pto_collective: ``"all_gather"`` (default) or ``"all_reduce"``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        *,
        pto: bool | ProcessGroup | PTO = False,
        pto_collective: str = "all_gather",
    ) -> None:
        check_hyper("lr", lr)
        check_hyper("eps", eps)
        check_hyper("weight_decay", weight_decay)
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"invalid betas[{i}]: {b!r} (must be in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, lars_exclude=None)
        super().__init__(params, defaults)
        self.pto = PTO.resolve(pto, pto_collective)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Perform one optimisation step (``closure`` re-evaluates the loss, as in torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Phase 1 (every rank, every layer): moments and the raw update u.
        adapted_p: list[Tensor] = []
        adapted_u: list[Tensor] = []
        # (lr, params, updates, the slice of the trust ratios; None: an excluded layer, ratio 1)
        applies: list[tuple[float, list[Tensor], list[Tensor], slice | None]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = self._adam_direction(group, params)
            excl = [is_excluded(p, group["lars_exclude"]) for p in params]
            ad_p = [p for p, e in zip(params, excl) if not e]
            ad_u = [u for u, e in zip(updates, excl) if not e]
            if ad_p and group["weight_decay"] != 0.0:
                torch._foreach_add_(ad_u, ad_p, alpha=group["weight_decay"])
            first = len(adapted_p)
            adapted_p += ad_p
            adapted_u += ad_u
            applies.append((group["lr"], ad_p, ad_u, slice(first, len(adapted_p))))
            applies.append((group["lr"], [p for p, e in zip(params, excl) if e],
                            [u for u, e in zip(updates, excl) if e], None))
        # Phase 2 (sharded with PTO): trust ratios |w| / |u| of the adapted layers.
        trust = list(self._trust(adapted_p, adapted_u).unbind(0)) if adapted_p else []
        # Phase 3 (every rank, every layer): w -= lr * trust * u. Launch hazard: on CUDA,
        # _foreach_addcmul_ with a list of 0-d tensors stays on the fused multi-tensor kernels, while a
        # _foreach_mul_ by that list falls back to one kernel per tensor (measured with the profiler on
        # an H100; tests/op_audit.py's ForeachShapeAudit keeps every foreach call here fused).
        for lr, ps, us, sl in applies:
            if not ps:
                continue
            if sl is None:
                torch._foreach_add_(ps, us, alpha=-lr)
            else:
                torch._foreach_addcmul_(ps, us, trust[sl], value=-lr)
        return loss

    def _trust(self, params: list[Tensor], updates: list[Tensor]) -> Tensor:
        def compute(idx: Iterable[int]) -> Tensor:
            idx = list(idx)
            return lamb_trust(stacked_norms([params[i] for i in idx]),
                              stacked_norms([updates[i] for i in idx]))

        if self.pto is None:
            return compute(range(len(params)))
        return self.pto.map(compute, [p.numel() for p in params], params[0].device)

    def _adam_direction(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        """Update the moments of ``params`` in place and return m_hat / (sqrt(v_hat) + eps)."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        ms, vs, bc1, bc2 = [], [], [], []
        for p in params:
            st = self.state[p]
            if "step" not in st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1  # a host int: bias corrections stay host floats (no sync)
            ms.append(st["exp_avg"])
            vs.append(st["exp_avg_sq"])
            t = st["step"]
            bc1.append(1.0 - beta1**t if group["bias_correction"] else 1.0)
            bc2.append(math.sqrt(1.0 - beta2**t) if group["bias_correction"] else 1.0)
        torch._foreach_lerp_(ms, grads, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(ms, denom)
        torch._foreach_div_(updates, bc1)
        return list(updates)
