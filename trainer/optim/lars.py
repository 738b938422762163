"""LARS: layer-wise adaptive rate scaling (You et al. 2017; Shi et al. 2021 eq. 11), with PTO.

For every adapted layer l (weights of convolutions and linear layers)::

    trust_l = eta * |w_l| / (|g_l| + wd * |w_l| + eps)      (1 where |w_l| or |g_l| is 0)
    d_l     = trust_l * (g_l + wd * w_l)
    buf_l   = momentum * buf_l + d_l                          (buf starts at 0, so buf = d_1)
    w_l    -= lr * buf_l                                      (nesterov: lr * (d_l + momentum * buf_l))

Eq. 11's local LR is ``lr * trust_l``; the global LR is applied outside the momentum
buffer, as torch's SGD does (identical to the paper's form at constant LR; with a schedule
the buffer does not need re-scaling). Biases and BatchNorm parameters (``ndim <= 1`` by
default, or a param group with ``lars_exclude=True``) skip the adaptation AND the weight
decay: they get plain momentum SGD. A group may also set ``weight_decay=0``.

The step is sync-free: norms come from ``torch._foreach_norm``, the zero-norm cases from
``torch.where``, and the per-layer trust ratios are applied as 0-d tensors through
``torch._foreach_*`` ops (no ``.item()``, no Python branch on a tensor value).

``pto=True`` (default process group) or ``pto=<ProcessGroup>`` computes the trust ratios
with PTO (see :mod:`trainer.optim.pto`): each rank computes the norms and ratios of its
share of the layers and one all-gather per step shares them. Gradients must already be
averaged over the ranks (DDP does that), so all ranks hold identical params and grads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from trainer.optim._trust import HyperCache, LayerTable, check_hyper, is_excluded, lars_trust, stacked_norms
from trainer.optim.pto import PTO


class LARS(Optimizer):
    """Momentum SGD with LARS layer-wise trust ratios (optionally computed with PTO).

    Args:
        params: parameters or param groups (groups may set any of the keyword options
            below, plus ``lars_exclude``: ``None`` = exclude ``ndim <= 1`` tensors, ``True``
            = exclude the whole group, ``False`` = adapt every tensor of the group).
        lr: global learning rate.
        momentum: momentum factor (0 disables the buffer).
        weight_decay: L2 weight decay of adapted layers (excluded layers get none).
        trust_coefficient: eta of the trust ratio (``gamma`` in Shi et al. eq. 11).
        eps: added to the trust ratio's denominator.
        nesterov: Nesterov momentum.
        pto: ``False`` (every rank computes every ratio), ``True`` (PTO over the default
            process group) or a ``ProcessGroup`` (PTO over that group).
        pto_collective: ``"all_gather"`` (default) or ``"all_reduce"``; see ``pto.py``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        nesterov: bool = False,
        *,
        pto: bool | ProcessGroup | PTO = False,
        pto_collective: str = "all_gather",
    ) -> None:
        check_hyper("lr", lr)
        check_hyper("momentum", momentum)
        check_hyper("weight_decay", weight_decay)
        check_hyper("trust_coefficient", trust_coefficient, inclusive=False)
        check_hyper("eps", eps)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        lars_exclude=None)
        super().__init__(params, defaults)
        self.pto = PTO.resolve(pto, pto_collective)
        self._hyper = HyperCache()
        self._sel: dict[tuple, Tensor] = {}

    def _layer_table(self) -> LayerTable:
        """The adapted layers that have a gradient this step, with their hyper-parameters."""
        table = LayerTable()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not is_excluded(p, group["lars_exclude"]):
                    table.add(p, eta=group["trust_coefficient"], wd=group["weight_decay"],
                              eps=group["eps"])
        return table

    @torch.no_grad()
    def trust_ratios(self) -> tuple[LayerTable, Tensor]:
        """Trust ratios (fp32 vector) of all adapted layers for the current gradients.

        This is the "norm phase" that PTO parallelises; ``step`` calls it once. With PTO
        it is a collective: every rank of the group must call it.
        """
        table = self._layer_table()
        if not table.params:
            return table, torch.zeros(0)
        device = table.params[0].device
        hyper = self._hyper.vectors(table, device)

        def compute(idx: list[int] | tuple[int, ...]) -> Tensor:
            ws = [table.params[i] for i in idx]
            w_norm = stacked_norms(ws)
            g_norm = stacked_norms([w.grad for w in ws])
            sel = None
            if len(idx) != len(table.params):  # PTO shard: index the hyper vectors (cached tensor)
                key = (tuple(idx), str(device))
                if key not in self._sel:
                    self._sel = {key: torch.tensor(idx, dtype=torch.long, device=device)}
                sel = self._sel[key]

            def h(name: str) -> Tensor:
                return hyper[name] if sel is None else hyper[name][sel]

            return lars_trust(w_norm, g_norm, h("eta"), h("wd"), h("eps"))

        if self.pto is None:
            return table, compute(range(len(table.params)))
        return table, self.pto.map(compute, table.numels, device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Perform one optimisation step (``closure`` re-evaluates the loss, as in torch.optim)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        table, trust = self.trust_ratios()
        trust_of = dict(zip((id(p) for p in table.params), trust.unbind(0) if trust.numel() else ()))
        for group in self.param_groups:
            adapted = [p for p in group["params"] if p.grad is not None and id(p) in trust_of]
            plain = [p for p in group["params"] if p.grad is not None and id(p) not in trust_of]
            if adapted:
                self._update(group, adapted, [trust_of[id(p)] for p in adapted], group["weight_decay"])
            if plain:
                self._update(group, plain, None, 0.0)
        return loss

    def _update(self, group: dict[str, Any], params: list[Tensor], trust: list[Tensor] | None,
                wd: float) -> None:
        """Apply the (momentum) update to ``params``; ``trust`` None means ratio 1 and no decay."""
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        grads = [p.grad for p in params]
        decay: list[Tensor] | None = None
        if trust is not None and wd != 0.0:
            decay = torch._foreach_mul(trust, wd)          # trust_l * wd, 0-d tensors
        bufs: list[Tensor] = []
        if momentum != 0.0:
            for p in params:
                st = self.state[p]
                if "momentum_buffer" not in st:  # 0 * momentum + d == d: same as torch SGD's first step
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(st["momentum_buffer"])
            # buf = momentum * buf + trust * g + trust * wd * w   (no temporaries)
            torch._foreach_mul_(bufs, momentum)
            if trust is None:
                torch._foreach_add_(bufs, grads)
            else:
                torch._foreach_addcmul_(bufs, grads, trust)
                if decay is not None:
                    torch._foreach_addcmul_(bufs, params, decay)
            if not nesterov:
                torch._foreach_add_(params, bufs, alpha=-lr)
                return
        # w -= lr * d  ==  w - lr * (trust * wd) * w - lr * trust * g   (old w: decay first). Launch
        # hazard: multiplying by a list of 0-d tensors (_foreach_mul_) takes one kernel per tensor on
        # CUDA; _foreach_addcmul_ with that list stays on the fused multi-tensor kernels.
        if decay is not None:
            torch._foreach_addcmul_(params, params, decay, value=-lr)
        if trust is None:
            torch._foreach_add_(params, grads, alpha=-lr)
        else:
            torch._foreach_addcmul_(params, grads, trust, value=-lr)
        if momentum != 0.0:  # nesterov: w -= lr * (d + momentum * buf)
            torch._foreach_add_(params, bufs, alpha=-lr * momentum)
