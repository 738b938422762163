"""The one list of names the comm stack, its config, the cost model and the benchmarks share.

No torch import: ``trainer.comm.cost_model`` (a light CLI) reads these too.
"""

from __future__ import annotations

# Aggregation methods, in the order tables and plots show them (dense ring, 2D-Torus, NaiveAG, HiTopKComm).
METHOD_CHOICES: tuple[str, ...] = ("allreduce", "torus", "naive_ag", "hitopk")
SPARSE_METHODS: tuple[str, ...] = ("naive_ag", "hitopk")  # top-k + error feedback

# When a bucket's communication runs: inside DDP's hook (none), on a communication thread (async),
# priority-scheduled pieces whose updates overlap the next forward, without DDP (cross), or the faster of
# none and async measured on the first steps (auto: trainer/comm/overlap_auto.py).
OVERLAP_CHOICES: tuple[str, ...] = ("none", "async", "cross", "auto")

# Top-k selectors (trainer/comm/selector_registry.py maps each name to its function).
SELECTOR_CHOICES: tuple[str, ...] = ("auto", "mstopk", "exact", "dgc")
SELECTOR_ALGORITHMS: tuple[str, ...] = SELECTOR_CHOICES[1:]  # "auto" picks one of these per device

# HiTopK's last intra-node step: the two forms, and the config value that picks one per call.
FINAL_GATHER_FORMS: tuple[str, ...] = ("dense", "sparse")
FINAL_GATHER_CHOICES: tuple[str, ...] = ("auto", *FINAL_GATHER_FORMS)

# PhaseTimer's phases (Fig. 8 of Shi et al.): every method's time splits into these.
PHASES: tuple[str, ...] = ("select", "communicate", "decompress")

# MethodSchedule units.
UNIT_CHOICES: tuple[str, ...] = ("step", "epoch")


def check_choice(owner: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming ``owner`` and listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}={value!r}; choose one of {', '.join(choices)}")
    return value
