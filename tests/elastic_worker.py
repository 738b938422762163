"""A training worker for tests/test_emulated_elastic.py: ``python -m trainer``'s own run, started by an
elastic torchrun inside a node's namespace, with a test hook between the trainer's sampler and its
DataLoader.

Usage: ``torchrun ... tests/elastic_worker.py TRACE_DIR PACE_S HOLD <trainer flags>`` (HOLD: see
``Tracing``). It runs ``trainer.cli.main``: exit codes, error lines and process-group cleanup as
``python -m trainer``. Each worker process appends one JSON line per batch the DataLoader takes
(epoch, step, sample indices) to its own file ``TRACE_DIR/<restart>-<rank>-<pid>.jsonl``, whose
first line says the world size and the launcher's restart count, and sleeps ``PACE_S`` seconds per
batch. The counting is the test's (by the batches taken), never the sampler's bookkeeping.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class Tracing:
    """Batch sampler wrapper: records each request, then paces the run. At ``hold`` = (epoch, step,
    release file) it waits until the file exists (at most ``HOLD_MAX_S``): the run parked mid-epoch,
    every checkpoint up to that step written (workers=0 on a CPU: a batch is taken only when its step
    starts), no collective in flight -- the test then cuts a node, or lets a returning node restart it."""

    def __init__(self, sampler: Any, path: str, pace: float, hold: tuple[int, int, str] | None) -> None:
        self.sampler, self.path, self.pace, self.hold = sampler, path, pace, hold

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for req in self.sampler:
            with open(self.path, "a") as f:
                f.write(json.dumps({"epoch": req.epoch, "step": req.step, "indices": list(req.indices),
                                    "t": time.time()}) + "\n")
            if self.hold is not None and (req.epoch, req.step) == self.hold[:2]:
                deadline = time.monotonic() + HOLD_MAX_S
                while not os.path.exists(self.hold[2]) and time.monotonic() < deadline:
                    time.sleep(0.1)
            time.sleep(self.pace)
            yield req


HOLD_MAX_S = 120.0


def main(argv: list[str]) -> int:
    trace_dir, pace, hold_spec, flags = argv[0], float(argv[1]), argv[2], argv[3:]
    world = int(os.environ["WORLD_SIZE"])
    hold = None  # HOLD = WORLD:EPOCH:STEP[,...] ("-": never): park the run of that world size there
    for spec in hold_spec.split(",") if hold_spec != "-" else []:
        w, e, st = (int(x) for x in spec.split(":"))
        if w == world:
            hold = (e, st, os.path.join(trace_dir, f"release-{w}"))
    import trainer.run
    from trainer.cli import main as trainer_main

    path = os.path.join(trace_dir, f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-"
                                   f"{os.environ['RANK']}-{os.getpid()}.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"]),
                            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                            "t": time.time()}) + "\n")
    real = trainer.run.train_loader

    def traced_loader(dataset: Any, sampler: Any, **kw: Any) -> Any:
        return real(dataset, Tracing(sampler, path, pace, hold), **kw)

    trainer.run.train_loader = traced_loader  # the trainer's own loader, its sampler observed
    return trainer_main(["train", *flags])  # python -m trainer's whole path: errors, exit codes, cleanup


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
