"""torchvision's own ImageFolder and transforms as the reference of the drop-in tests.

The reusable part -- registering torchvision's pure-Python modules without its package ``__init__``,
whose compiled operators do not load on the CPU-only torch -- is :mod:`datacache.devtools.torchvision_shim`
(dev-only; ``bench/dropin.py`` uses it too). Here: the pytest face, which skips with the reason where
torchvision is not installed.
"""

from __future__ import annotations

import types

import pytest

from datacache.devtools.torchvision_shim import ShimUnavailable, install, v2_reason

__all__ = ["torchvision_or_skip", "v2_or_skip"]


def torchvision_or_skip() -> types.ModuleType:
    """The ``torchvision`` module (``torchvision.datasets`` / ``torchvision.transforms`` importable), or a
    pytest skip saying why not."""
    try:
        return install()
    except ShimUnavailable as e:
        pytest.skip(str(e))


def v2_or_skip() -> types.ModuleType:
    """``torchvision.transforms.v2``, or a pytest skip saying why not."""
    torchvision_or_skip()
    reason = v2_reason()
    if reason is not None:
        pytest.skip(reason)
    import torchvision.transforms.v2 as v2  # registered by the shim

    return v2
