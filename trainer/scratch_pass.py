"""Forward/backward passes that leave no trace on the model (a layout warm-up, a timing probe).

A pass in training mode updates BatchNorm's running statistics (and ``num_batches_tracked``) and
accumulates gradients. A pass that must not change what the run learns -- DDP's layout warm-up after
a resume (:func:`trainer.build.layout_warmup`), ``--comm auto``'s timing of the step
(:func:`trainer.comm.probe.measure_step`) -- runs inside :func:`leaves_no_trace`. Parameters are not
touched by a pass (no optimizer step), so they need no copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def leaves_no_trace(module: nn.Module) -> Iterator[None]:
    """On exit (an exception too): ``module``'s buffers put back as they were on entry, and every
    parameter's gradient dropped (``None``, as after ``zero_grad(set_to_none=True)``)."""
    saved = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buf in module.named_buffers():
                buf.copy_(saved[name])
        for p in module.parameters():
            p.grad = None
