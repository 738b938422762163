"""Registry of top-k selectors: ``get_selector(name)`` for ``name`` in ``SELECTOR_CHOICES``.

Every selector has the signature ``(x: 1-D float Tensor, k: int) -> (values, indices)`` and
returns exactly ``min(max(k, 0), numel)`` entries: ``values == x[indices]`` (signed, x.dtype),
``indices`` int32 and unique. NaN/inf rank above every finite magnitude (``topk_keys.py``).

- ``auto`` (the default): ``mstopk`` on CPU tensors, ``exact`` on CUDA -- the faster of the two on
  each, as measured (trainer/comm/auto_topk.py); decided from ``x.device``, no host sync.
- ``mstopk``: exact, fixed-pass threshold search on magnitude keys (trainer/comm/mstopk.py);
  ties at the threshold go to the lowest indices; no host sync on CUDA.
- ``exact``: ``torch.topk`` on ``|x|`` (trainer/comm/exact_topk.py); no host sync on CUDA.
- ``dgc``: sampled threshold + re-adjustment, as in Deep Gradient Compression (trainer/comm/dgc.py);
  data-dependent sizes, so it syncs with the host on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from trainer.comm.auto_topk import auto_topk
from trainer.comm.dgc import dgc_topk
from trainer.comm.exact_topk import exact_topk
from trainer.comm.mstopk import mstopk
from trainer.comm.names import SELECTOR_CHOICES, check_choice

Selector = Callable[[Tensor, int], tuple[Tensor, Tensor]]

_SELECTORS: dict[str, Selector] = {"auto": auto_topk, "mstopk": mstopk, "exact": exact_topk, "dgc": dgc_topk}
assert tuple(_SELECTORS) == SELECTOR_CHOICES


def get_selector(name: str) -> Selector:
    """The selector called ``name``; ``ValueError`` listing ``SELECTOR_CHOICES`` otherwise."""
    return _SELECTORS[check_choice("top-k selector", name, SELECTOR_CHOICES)]


__all__ = ["SELECTOR_CHOICES", "Selector", "auto_topk", "dgc_topk", "exact_topk", "get_selector", "mstopk"]
