"""Tensor helper of the client: the zero-copy CHW tensor view of a record's pixels."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

_readonly_warning_silenced = False


def to_chw_tensor(pixels: np.ndarray) -> Any:
    """HWC uint8 numpy (possibly a read-only view of a store buffer) -> CHW tensor *view*."""
    import torch  # here, not at module import: `datacache warm` never needs torch

    global _readonly_warning_silenced
    if not pixels.flags.writeable and not _readonly_warning_silenced:
        # torch warns once per process about read-only arrays; the view is documented read-only.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(pixels)
        _readonly_warning_silenced = True
    else:
        t = torch.from_numpy(pixels)
    return t.permute(2, 0, 1)
