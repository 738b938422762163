"""Gradient communication: top-k selectors, error feedback, collectives and DDP comm hooks.

Public API (imported lazily, PEP 562, so ``python -m trainer.comm.cost_model`` stays light)::

    from trainer.comm import CommConfig, MethodSchedule, register, maybe_step, fp16_wrapper
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CommConfig": "trainer.comm.comm_config",
    "HookState": "trainer.comm.state",
    "MethodSchedule": "trainer.comm.switch",
    "register": "trainer.comm.hooks",
    "wrap": "trainer.comm.hooks",
    "make_hook": "trainer.comm.hooks",
    "HOOKS": "trainer.comm.hooks",
    "maybe_step": "trainer.comm.step",
    "fp16_wrapper": "trainer.comm.fp16",
    "METHOD_CHOICES": "trainer.comm.names",
    "SELECTOR_CHOICES": "trainer.comm.names",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.comm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
