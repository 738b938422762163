"""Run plans: what a training run will read next, published for the cache daemons' rolling fill.

A run that samples with the locality plan (:mod:`datacache.epoch_plan`) reads its samples in an order
that is a pure function of (seed, epoch, exchange, drop_last, rank layout, owners). Rank 0 publishes
those inputs and the run's progress as one small JSON record, refreshed four times a second; every
daemon recomputes the plan and so knows when each of its node's samples will be read next
(:func:`uses_at`). Data-parallel ranks train in lockstep (every step trains one batch on every rank),
so one rank's counts are every rank's.

Keys: ``dcp:{<fingerprint>:<variant tag>}:<slot>``, slot ``00`` .. ``15`` (:data:`MAX_RUNS` runs per
dataset and variant). The hash tag puts a dataset's slots on one master: a daemon reads all of them in
one pipelined round trip of ``GETRANGE 0 MAX_RECORD_BYTES`` (a bounded read whatever a key holds). A
run claims a free slot with ``SET NX PX`` and refreshes it with ``SET XX PX GET`` (the old value tells
whether the slot was still its own); the TTL (``PX``, the server's clock, never a comparison of two
machines' clocks) is what expires a run that stopped refreshing: a killed or frozen trainer.

Records are untrusted input (the trainers' role may write ``dcp:*``): :func:`parse_record` accepts
only the documented fields with bounded types and values, and anything else makes the record
"invalid" (the daemon counts it and ignores the slot). A forged but well-formed plan can change which
samples the rolling fill keeps (the hit ratio), never a sample's bytes: the rolling fill never deletes a
sample any live run has in flight, and each live run keeps its own fair share of the window (its soonest
needs), so adding a plan can never push out what another live run reads next; a live plan the daemon
cannot reproduce (another slot map, another sample count, a mid-epoch re-plan) stops every deletion.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from datacache.epoch_plan import plan_epoch

PLAN_PREFIX = "dcp"
FORMAT = 1
MAX_RUNS = 16  # slots per dataset and variant
MAX_RECORD_BYTES = 8192  # a real record is ~400 bytes plus ~3 per rank and ~25 per node
MAX_RANKS = 1024
MAX_NODES = 256
MAX_ADDR = 300  # bytes of one master address
MAX_SAMPLES = 2**40
MAX_EPOCH = 2**31
DEFAULT_TTL_S = 30.0  # a run that stops refreshing for this long is dead (rolling fill falls back to MinIO)
MAX_TTL_S = 3600.0
_HEX16 = re.compile(r"[0-9a-f]{16}")  # (fullmatch: no trailing newline slips through, as "$" would let)
_ADDR = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,300}")


class PlanRecordError(ValueError):
    """A run record that is malformed, oversized or out of bounds (the message says which field)."""


def slot_key(fingerprint: str, tag: str, slot: int) -> bytes:
    """The key of slot ``slot`` of a dataset's run plans (every slot on one master: the hash tag)."""
    return f"{PLAN_PREFIX}:{{{fingerprint}:{tag}}}:{int(slot):02d}".encode("ascii")


def slot_keys(fingerprint: str, tag: str) -> list[bytes]:
    return [slot_key(fingerprint, tag, s) for s in range(MAX_RUNS)]


def new_run_id() -> str:
    return os.urandom(8).hex()


@dataclass
class RunRecord:
    """One run's plan inputs and progress (what rank 0 publishes).

    ``trained``: samples per rank of ``epoch`` the training loop has finished (lockstep: every rank's);
    ``drawn``: indices per rank the loader has taken from the sampler (``drawn - trained`` is what the
    loader's workers have fetched or are fetching: measured, it is the safety margin the daemons keep);
    ``replanned``: the epoch's rest was re-planned on another layout mid-epoch (the daemons hold their
    window until the next epoch: they neither evict for nor fill ahead of this run)."""

    run: str
    seed: int
    epoch: int
    exchange: float
    drop_last: bool
    node_of_rank: list[int]
    masters: list[str]  # the Redis master on each node (owners[i] indexes this list)
    owners_digest: str  # of the epoch's owners snapshot (datacache.epoch_plan.owners_digest)
    samples: int  # len(owners): the plan's sample count (indices 0..samples-1 of the dataset)
    trained: int = 0
    drawn: int = 0
    rate: float = 0.0  # samples per second per rank, measured by the publisher
    replanned: bool = False
    seq: int = 0  # bumped on every publish
    v: int = field(default=FORMAT)

    def encode(self) -> bytes:
        out = json.dumps(asdict(self), separators=(",", ":"), allow_nan=False).encode("ascii")
        if len(out) > MAX_RECORD_BYTES:
            raise PlanRecordError(f"run record of {len(out)} bytes exceeds {MAX_RECORD_BYTES} "
                                  f"({len(self.node_of_rank)} ranks, {len(self.masters)} nodes)")
        return out


def _int(d: dict[str, Any], k: str, lo: int, hi: int) -> int:
    v = d.get(k)
    if type(v) is not int or not lo <= v <= hi:
        raise PlanRecordError(f"field {k!r} must be an integer in [{lo}, {hi}]")
    return v


def parse_record(raw: bytes | None) -> RunRecord:
    """A validated :class:`RunRecord` from untrusted bytes; PlanRecordError names the first problem."""
    if raw is None:
        raise PlanRecordError("empty slot")
    if len(raw) > MAX_RECORD_BYTES:
        raise PlanRecordError(f"record larger than {MAX_RECORD_BYTES} bytes")
    try:
        d = json.loads(bytes(raw).decode("ascii"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PlanRecordError(f"not an ASCII JSON object ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise PlanRecordError("not a JSON object")
    known = {f for f in RunRecord.__dataclass_fields__}
    extra = sorted(set(d) - known)
    if extra:
        raise PlanRecordError(f"unknown field {extra[0][:40]!r}")
    if type(d.get("v")) is not int or d["v"] != FORMAT:
        raise PlanRecordError(f"format {str(d.get('v'))[:20]!r}, expected {FORMAT}")
    run = d.get("run")
    if not isinstance(run, str) or not _HEX16.fullmatch(run):
        raise PlanRecordError("field 'run' must be 16 lowercase hex digits")
    digest = d.get("owners_digest")
    if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
        raise PlanRecordError("field 'owners_digest' must be 16 lowercase hex digits")
    nor = d.get("node_of_rank")
    if not isinstance(nor, list) or not 1 <= len(nor) <= MAX_RANKS or \
            any(type(x) is not int or not 0 <= x < MAX_NODES for x in nor):
        raise PlanRecordError(f"field 'node_of_rank' must list 1..{MAX_RANKS} node numbers in "
                              f"[0, {MAX_NODES})")
    masters = d.get("masters")
    if not isinstance(masters, list) or not 1 <= len(masters) <= MAX_NODES or \
            any(not isinstance(a, str) or not _ADDR.fullmatch(a) for a in masters):
        raise PlanRecordError(f"field 'masters' must list 1..{MAX_NODES} host:port addresses")
    if max(nor) >= len(masters):
        raise PlanRecordError("field 'node_of_rank' names a node without a master in 'masters'")
    for k in ("exchange", "rate"):
        v = d.get(k)
        if type(v) not in (int, float) or (type(v) is int and abs(v) > 2**53) or not math.isfinite(v) \
                or v < 0 or (k == "exchange" and v > 1):
            bound = " and <= 1" if k == "exchange" else ""
            raise PlanRecordError(f"field {k!r} must be a finite number >= 0{bound}")
    for k in ("drop_last", "replanned"):
        if type(d.get(k)) is not bool:
            raise PlanRecordError(f"field {k!r} must be true or false")
    samples = _int(d, "samples", 1, MAX_SAMPLES)
    per_rank = samples // len(nor) if d["drop_last"] else -(-samples // len(nor))
    if per_rank == 0:
        raise PlanRecordError("field 'samples' gives the ranks no sample")
    trained = _int(d, "trained", 0, per_rank)
    drawn = _int(d, "drawn", trained, per_rank)
    return RunRecord(run=run, seed=_int(d, "seed", 0, 2**63 - 1), epoch=_int(d, "epoch", 0, MAX_EPOCH),
                     exchange=float(d["exchange"]), drop_last=d["drop_last"], node_of_rank=list(nor),
                     masters=list(masters), owners_digest=digest, samples=samples, trained=trained,
                     drawn=drawn, rate=float(d["rate"]), replanned=d["replanned"],
                     seq=_int(d, "seq", 0, 2**62))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


NOT_READ = np.iinfo(np.int64).max  # next use of a sample no plan reads (in this epoch or the next)
IN_FLIGHT = -1  # drawn by the loader and not yet trained: being fetched; neither deleted nor filled


@dataclass(frozen=True)
class Uses:
    """Where each sample of the dataset stands in one run's plan.

    ``next_use[i]``: how many per-rank samples after the loaders' frontier (``drawn``) sample ``i`` is
    read next: this epoch's position when it is still ahead, else the next epoch's; :data:`IN_FLIGHT`
    for a sample drawn and not yet trained, :data:`NOT_READ` for one neither epoch reads.
    ``consumed[i]``: this epoch has trained sample ``i`` (every copy of it) and not read it since."""

    next_use: np.ndarray
    consumed: np.ndarray


@dataclass(frozen=True)
class EpochOrder:
    """One run's plan for its epoch and the next, flattened: ``idx_now[j]`` is read at per-rank position
    ``pos_now[j]`` this epoch (likewise next epoch); ``length`` samples per rank this epoch. Computed once
    per (run, epoch, owners) -- two :func:`~datacache.epoch_plan.plan_epoch` calls -- and reused while only
    the progress changes."""

    n: int
    length: int
    idx_now: np.ndarray
    pos_now: np.ndarray
    idx_next: np.ndarray
    pos_next: np.ndarray


def epoch_order(rec: RunRecord, owners: np.ndarray) -> EpochOrder:
    """The :class:`EpochOrder` of ``rec`` with ``owners`` (whose digest the caller checked)."""
    kw: dict[str, Any] = dict(seed=rec.seed, exchange=rec.exchange, drop_last=rec.drop_last)
    now = plan_epoch(owners, rec.node_of_rank, epoch=rec.epoch, **kw).per_rank
    nxt = plan_epoch(owners, rec.node_of_rank, epoch=rec.epoch + 1, **kw).per_rank
    length = len(now[0])
    return EpochOrder(n=len(owners), length=length,
                      idx_now=np.concatenate(now).astype(np.int64),
                      pos_now=np.concatenate([np.arange(len(p), dtype=np.int64) for p in now]),
                      idx_next=np.concatenate(nxt).astype(np.int64),
                      pos_next=np.concatenate([np.arange(len(p), dtype=np.int64) for p in nxt]))


def uses_at(order: EpochOrder, trained: int, drawn: int) -> Uses:
    """The :class:`Uses` of a run at progress (``trained``, ``drawn``) per rank.

    Distances are in per-rank samples: ranks step in lockstep, so position ``p`` of any rank is read at
    about the same time. A padded sample (two copies in one epoch) takes its earliest copy."""
    n, pos, idx = order.n, order.pos_now, order.idx_now
    dist = np.where(pos >= drawn, pos - drawn, np.where(pos >= trained, IN_FLIGHT, NOT_READ))
    next_use = np.full(n, NOT_READ, dtype=np.int64)
    np.minimum.at(next_use, idx, dist)
    unread = np.zeros(n, dtype=bool)
    unread[idx[pos >= trained]] = True
    in_epoch = np.zeros(n, dtype=bool)
    in_epoch[idx] = True
    consumed = in_epoch & ~unread  # every copy trained: the next read is in the next epoch
    later = np.full(n, NOT_READ, dtype=np.int64)
    np.minimum.at(later, order.idx_next, (order.length - drawn) + order.pos_next)
    next_use = np.where(consumed | ~in_epoch, np.minimum(next_use, later), next_use)
    return Uses(next_use=next_use, consumed=consumed)


def run_uses(rec: RunRecord, owners: np.ndarray) -> Uses:
    """:func:`uses_at` of ``rec``'s own progress (its plan recomputed with ``owners``)."""
    return uses_at(epoch_order(rec, owners), rec.trained, rec.drawn)


def combine(uses: Sequence[Uses], n: int) -> Uses:
    """Several live runs on one dataset (a sweep): a sample's next use is the earliest over the runs, and
    it counts as consumed only when EVERY run has consumed it (what one run still needs is never
    deleted for another)."""
    if not uses:
        return Uses(np.full(n, NOT_READ, dtype=np.int64), np.zeros(n, dtype=bool))
    nu = np.full(n, NOT_READ, dtype=np.int64)
    in_flight = np.zeros(n, dtype=bool)
    consumed = np.ones(n, dtype=bool)
    for u in uses:  # (order-free: the same answer whatever order the slots were read in)
        in_flight |= u.next_use == IN_FLIGHT
        nu = np.minimum(nu, np.where(u.next_use == IN_FLIGHT, NOT_READ, u.next_use))
        # a sample one run never reads (this epoch or the next) does not block the others from deleting it
        consumed &= u.consumed | (u.next_use == NOT_READ)
    nu[in_flight] = IN_FLIGHT
    return Uses(nu, consumed)
