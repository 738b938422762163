"""datacache: decode-once sample cache for data-parallel training.

The core (config, manifest, source, decode, record codec, keys, stores) lives here.
``CachedImageNet`` is re-exported lazily (PEP 562) from :mod:`client`, so importing the
core never imports the training-side packages.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["CachedImageNet", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "CachedImageNet":
        from client.dataset import CachedImageNet

        return CachedImageNet
    raise AttributeError(f"module 'datacache' has no attribute {name!r}")
