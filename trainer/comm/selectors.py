"""Registry of top-k selectors: ``get_selector(name)`` for ``name`` in ``SELECTOR_CHOICES``.

Every selector has the signature ``(x: 1-D float Tensor, k: int) -> (values, indices)`` and
returns exactly ``min(max(k, 0), numel)`` entries: ``values == x[indices]`` (signed, x.dtype),
``indices`` int32 and unique.  They run on CPU and CUDA alike.

- ``mstopk``: Algorithm 1 of Shi et al. 2021 with candidate compaction (trainer/comm/mstopk.py).
- ``exact``: ``torch.topk`` on ``|x|`` (trainer/comm/exact_topk.py).
- ``dgc``: sampled threshold + re-adjustment, as in Deep Gradient Compression (trainer/comm/dgc.py).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer.comm.dgc import dgc_topk
from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import mstopk

Selector = Callable[[Tensor, int], tuple[Tensor, Tensor]]

SELECTOR_CHOICES: tuple[str, ...] = ("mstopk", "exact", "dgc")

_SELECTORS: dict[str, Selector] = {"mstopk": mstopk, "exact": exact_topk, "dgc": dgc_topk}


def get_selector(name: str) -> Selector:
    """The selector called ``name``; ``ValueError`` listing ``SELECTOR_CHOICES`` otherwise."""
    try:
        return _SELECTORS[name]
    except (KeyError, TypeError):
        choices = ", ".join(SELECTOR_CHOICES)
        raise ValueError(f"unknown top-k selector {name!r}; choose one of: {choices}") from None


__all__ = ["SELECTOR_CHOICES", "Selector", "dgc_topk", "exact_topk", "get_selector", "mstopk"]
