"""Run plans (datacache/run_plan.py) and their publisher (client/run_publisher.py).

* ``parse_record``: a valid record round-trips; every hostile input (oversized, not JSON, non-ASCII,
  wrong types, out-of-range numbers, deep nesting, ...) is a PlanRecordError and nothing else; a seeded
  byte-level fuzz of a valid record gives PlanRecordError or a record that re-encodes to itself.
* ``uses_at`` / ``run_uses`` against a plain-Python walk of the plan (``plan_epoch`` of this epoch and the
  next: the sampler's definition, taken as input), padded and drop_last epochs included.
* ``combine``: earliest next use, IN_FLIGHT wins, consumed only when every run consumed it.
* ``PlanPublisher`` against a real redis-server: slots claimed with SET NX PX, refreshed with SET XX PX
  GET, a slot taken over by another run is given back, close() expires only its own record, and
  ``LocalitySampler(..., publisher=)`` reports epoch, drawn and trained.
* The ACL roles (datacache/redis_roles.py) on a real server: trainers may write ``dcp:*`` only, daemons
  may read (GETRANGE/PTTL) but not write it, and may DEL samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from client.locality_sampler import LocalitySampler
from client.run_publisher import PlanPublisher
from datacache.epoch_plan import plan_epoch
from datacache.run_plan import (
    IN_FLIGHT,
    MAX_RECORD_BYTES,
    MAX_RUNS,
    NOT_READ,
    PlanRecordError,
    RunRecord,
    Uses,
    combine,
    epoch_order,
    parse_record,
    run_uses,
    slot_key,
    slot_keys,
    uses_at,
)

FP, TAG = "0123456789abcdef", "t160"
MASTERS = ["127.0.0.1:7000", "127.0.0.1:7001"]


def record(**kw: Any) -> RunRecord:
    base: dict[str, Any] = dict(run="00112233445566ff", seed=7, epoch=3, exchange=0.25, drop_last=False,
                                node_of_rank=[0, 0, 1, 1], masters=list(MASTERS),
                                owners_digest="a1b2c3d4e5f60718", samples=10, trained=1, drawn=2, rate=12.5,
                                replanned=False, seq=4)
    base.update(kw)
    return RunRecord(**base)


def fields(**kw: Any) -> dict[str, Any]:
    """A valid record as a JSON object (dict), with ``kw`` replacing fields."""
    d = json.loads(record().encode())
    d.update(kw)
    return d


def raw_of(d: dict[str, Any]) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode("ascii")


def refused(raw: Any) -> str:
    """parse_record(raw) must raise PlanRecordError (and nothing else); its message."""
    try:
        got = parse_record(raw)
    except PlanRecordError as e:
        return str(e)
    raise AssertionError(f"accepted {raw[:120]!r} as {got}")


# ============================================================================== parse_record
def test_a_valid_record_round_trips() -> None:
    for rec in (record(), record(drop_last=True, replanned=True, trained=0, drawn=0, rate=0.0, seq=0),
                record(node_of_rank=[3, 0, 2, 1, 1], masters=["h1:1", "h2:2", "[::1]:6379", "a.b-c_d:9"],
                       samples=2**40, trained=2**40 // 5, drawn=2**40 // 5, seed=2**63 - 1, epoch=2**31,
                       exchange=1, seq=2**62)):
        raw = rec.encode()
        assert isinstance(raw, bytes) and len(raw) <= MAX_RECORD_BYTES
        got = parse_record(raw)
        assert got == rec
        assert isinstance(got.exchange, float) and isinstance(got.rate, float)
        assert parse_record(bytearray(raw)) == rec  # any bytes-like value a client returns


def test_size_limit_is_on_the_raw_bytes_at_the_boundary() -> None:
    raw = record().encode()
    padded = raw + b" " * (MAX_RECORD_BYTES - len(raw))  # JSON allows trailing whitespace
    assert len(padded) == MAX_RECORD_BYTES and parse_record(padded) == record()
    assert "larger" in refused(padded + b" ")
    assert "larger" in refused(raw + b" " * 100_000)


def test_encode_refuses_a_record_too_large_for_a_slot() -> None:
    big = record(node_of_rank=list(range(256)) * 4, masters=[f"host-{i:04d}.example.internal:6379"
                                                            for i in range(256)], samples=4096)
    with pytest.raises(PlanRecordError, match="exceeds"):
        big.encode()


HOSTILE: dict[str, Any] = {
    # raw bytes
    "none": None,
    "empty": b"",
    "not json": b"run=1;seed=2",
    "truncated": record().encode()[:-1],
    "json array": b"[1,2,3]",
    "json null": b"null",
    "json number": b"17",
    "json string": b'"0123456789abcdef"',
    "non-ascii utf8": record().encode().replace(b"127.0.0.1", "127.0.0.\u00e9".encode()),
    "latin1 byte": record().encode().replace(b"127.0.0.1", b"127.0.0.\xe9"),
    "nul byte": record().encode().replace(b"127.0.0.1", b"127.0.0.\x00"),
    "NaN exchange": record().encode().replace(b'"exchange":0.25', b'"exchange":NaN'),
    "Infinity rate": record().encode().replace(b'"rate":12.5', b'"rate":Infinity'),
    "-Infinity rate": record().encode().replace(b'"rate":12.5', b'"rate":-Infinity'),
    "1e999 exchange": record().encode().replace(b'"exchange":0.25', b'"exchange":1e999'),
    "1e999 rate": record().encode().replace(b'"rate":12.5', b'"rate":1e999'),
    "1e999 seed": record().encode().replace(b'"seed":7', b'"seed":1e999'),
    "5000-digit seed": record().encode().replace(b'"seed":7', b'"seed":' + b"9" * 5000),
    "deep nesting in a field": b'{"run":' + b"[" * 4000 + b"]" * 4000 + b"}",
    "deep nesting in v": b'{"v":' + b"[" * 4000 + b"]" * 4000 + b"}",
    "deep object nesting": b'{"masters":' + b'{"a":' * 1300 + b"1" + b"}" * 1300 + b"}",
    # structure
    "unknown field": fields(extra=1),
    "unknown long field": fields(**{"x" * 5000: 1}),
    "missing run": {k: v for k, v in fields().items() if k != "run"},
    "missing v": {k: v for k, v in fields().items() if k != "v"},
    "missing samples": {k: v for k, v in fields().items() if k != "samples"},
    "missing rate": {k: v for k, v in fields().items() if k != "rate"},
    "v 2": fields(v=2),
    "v 0": fields(v=0),
    "v string": fields(v="1"),
    "v null": fields(v=None),
    # run id / digest
    "run uppercase": fields(run="00112233445566FF"),
    "run 15 hex": fields(run="00112233445566f"),
    "run 17 hex": fields(run="00112233445566ff0"),
    "run non-hex": fields(run="00112233445566fg"),
    "run int": fields(run=112233445566),
    "run list": fields(run=["00112233445566ff"]),
    "digest short": fields(owners_digest="abc"),
    "digest null": fields(owners_digest=None),
    # numbers
    "seed negative": fields(seed=-1),
    "seed 2**63": fields(seed=2**63),
    "seed float": fields(seed=7.0),
    "seed string": fields(seed="7"),
    "epoch negative": fields(epoch=-1),
    "epoch huge": fields(epoch=2**31 + 1),
    "exchange negative": fields(exchange=-0.1),
    "exchange > 1": fields(exchange=1.0000001),
    "exchange 2": fields(exchange=2),
    "exchange string": fields(exchange="0.1"),
    "rate negative": fields(rate=-1.0),
    "seq negative": fields(seq=-1),
    "seq huge": fields(seq=2**62 + 1),
    "samples 0": fields(samples=0, trained=0, drawn=0),
    "samples negative": fields(samples=-4, trained=0, drawn=0),
    "samples huge": fields(samples=2**40 + 1, trained=0, drawn=0),
    "samples below ranks with drop_last": fields(samples=3, drop_last=True, trained=0, drawn=0),
    # bools given as ints and ints given as bools
    "drop_last 1": fields(drop_last=1),
    "drop_last 0": fields(drop_last=0),
    "drop_last string": fields(drop_last="true"),
    "replanned 0": fields(replanned=0),
    "replanned null": fields(replanned=None),
    "seed true": fields(seed=True),
    "epoch false": fields(epoch=False),
    "trained true": fields(trained=True),
    "samples true": fields(samples=True),
    "exchange true": fields(exchange=True),
    "rate false": fields(rate=False),
    "node true": fields(node_of_rank=[True, 0, 1, 1]),
    # node_of_rank
    "nodes empty": fields(node_of_rank=[]),
    "nodes too long": fields(node_of_rank=[0] * 1025, samples=1025, trained=0, drawn=0),
    "nodes negative": fields(node_of_rank=[0, -1, 1, 1]),
    "node 256": fields(node_of_rank=[0, 256, 1, 1]),
    "node without a master": fields(node_of_rank=[0, 0, 1, 2]),
    "node float": fields(node_of_rank=[0, 0.0, 1, 1]),
    "node string": fields(node_of_rank=[0, "1", 1, 1]),
    "nodes not a list": fields(node_of_rank={"0": 0}),
    "nodes nested": fields(node_of_rank=[[0], 0, 1, 1]),
    # masters
    "masters empty": fields(masters=[]),
    "masters 257": fields(node_of_rank=[0], masters=["h:1"] * 257, samples=1, trained=0, drawn=0),
    "master with a space": fields(masters=["127.0.0.1 :7000", "127.0.0.1:7001"]),
    "master with a leading space": fields(masters=[" 127.0.0.1:7000", "127.0.0.1:7001"]),
    "master empty string": fields(masters=["", "127.0.0.1:7001"]),
    "master 301 bytes": fields(masters=["a" * 301, "127.0.0.1:7001"]),
    "master escaped non-ascii": fields(masters=["127.0.0.\u00e9:7000", "127.0.0.1:7001"]),
    "master with a slash": fields(masters=["127.0.0.1/7000", "127.0.0.1:7001"]),
    "master int": fields(masters=[7000, "127.0.0.1:7001"]),
    "masters string": fields(masters="127.0.0.1:7000"),
    # progress (samples 10 on 4 ranks: 3 per rank, 2 with drop_last)
    "trained > per rank": fields(trained=4, drawn=4),
    "trained > per rank with drop_last": fields(drop_last=True, trained=3, drawn=3),
    "drawn > per rank": fields(trained=1, drawn=4),
    "drawn < trained": fields(trained=2, drawn=1),
    "trained negative": fields(trained=-1, drawn=0),
    "drawn missing": {k: v for k, v in fields().items() if k != "drawn"},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_records_are_refused_with_plan_record_error(case: str) -> None:
    v = HOSTILE[case]
    raw = raw_of(v) if isinstance(v, dict) else v
    if isinstance(v, dict):
        assert len(raw) <= MAX_RECORD_BYTES or case == "unknown long field", case  # refused for its content
    refused(raw)


def test_boundaries_of_progress_and_samples_are_accepted() -> None:
    # 10 samples on 4 ranks: 3 per rank (padded), 2 with drop_last; trained == drawn == per rank is the end
    assert parse_record(raw_of(fields(trained=3, drawn=3))).drawn == 3
    assert parse_record(raw_of(fields(trained=0, drawn=3))).trained == 0
    assert parse_record(raw_of(fields(drop_last=True, trained=2, drawn=2))).trained == 2
    assert parse_record(raw_of(fields(samples=1, trained=1, drawn=1))).samples == 1  # padded: 1 per rank
    assert parse_record(raw_of(fields(samples=4, drop_last=True, trained=1, drawn=1))).samples == 4
    ok = fields(node_of_rank=[0] * 1024, masters=["h:1"], samples=1024, trained=0, drawn=0)
    assert len(parse_record(raw_of(ok)).node_of_rank) == 1024
    ok = fields(node_of_rank=[255], masters=[f"h{i}:1" for i in range(256)], samples=1, trained=0, drawn=0)
    assert parse_record(raw_of(ok)).node_of_rank == [255]
    assert parse_record(raw_of(fields(masters=["a" * 300, "b:1"]))).masters[0] == "a" * 300
    assert parse_record(raw_of(fields(exchange=0, rate=0))).exchange == 0.0


@pytest.mark.parametrize("k", ["exchange", "rate"])
def test_a_huge_integer_rate_or_exchange_is_a_plan_record_error(k: str) -> None:
    raw = record().encode().replace(b'"exchange":0.25' if k == "exchange" else b'"rate":12.5',
                                    f'"{k}":'.encode() + b"1" + b"0" * 400)
    assert len(raw) <= MAX_RECORD_BYTES
    refused(raw)


@pytest.mark.parametrize("kw", [{"run": "00112233445566ff\n"}, {"owners_digest": "a1b2c3d4e5f60718\n"},
                                {"masters": ["127.0.0.1:7000\n", "127.0.0.1:7001"]}], ids=str)
def test_a_trailing_newline_is_not_hex_nor_an_address(kw: dict[str, Any]) -> None:
    refused(raw_of(fields(**kw)))


@pytest.mark.parametrize("v", [True, 1.0], ids=str)
def test_format_version_must_be_the_integer_1(v: Any) -> None:
    refused(raw_of(fields(v=v)))


_TOKENS = [b"-", b"0", b"9", b"1e999", b"NaN", b"true", b"null", b"[", b"]", b"{", b"}", b",", b":", b'"',
           b"\\", b"\\u00e9", b"\xc3\xa9", b"\xff", b"99999999999999999999", b'"x":1,', b"\\n", b"-1", b"."]


def _mutate(rng: np.random.Generator, raw: bytes) -> bytes:
    b = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 6))
        p = int(rng.integers(0, len(b) + 1))
        if op == 0 and b:  # flip bits of one byte
            b[min(p, len(b) - 1)] ^= int(rng.integers(1, 256))
        elif op == 1:  # insert a random byte
            b[p:p] = bytes([int(rng.integers(0, 256))])
        elif op == 2:  # delete a range
            b[p:p + int(rng.integers(1, 12))] = b""
        elif op == 3:  # insert a JSON-ish token
            b[p:p] = _TOKENS[int(rng.integers(0, len(_TOKENS)))]
        elif op == 4:  # replace a digit run's end with another digit
            if p < len(b) and chr(b[p]).isdigit():
                b[p] = ord(str(int(rng.integers(0, 10))))
        else:  # duplicate a range
            q = p + int(rng.integers(1, 40))
            b[p:p] = b[p:q]
    return bytes(b)


def test_fuzzed_records_give_plan_record_error_or_a_consistent_record() -> None:
    rng = np.random.default_rng(20240611)
    seeds = [record().encode(), record(drop_last=True, trained=0, drawn=2, node_of_rank=[1, 0, 1],
                                       samples=7).encode()]
    accepted = 0
    for i in range(4000):
        raw = _mutate(rng, seeds[i % 2])
        try:
            rec = parse_record(raw)
        except PlanRecordError:
            continue
        accepted += 1
        world = len(rec.node_of_rank)
        per_rank = rec.samples // world if rec.drop_last else -(-rec.samples // world)
        assert 0 <= rec.trained <= rec.drawn <= per_rank and per_rank >= 1, raw
        assert 0 <= max(rec.node_of_rank) < len(rec.masters) and 0 <= rec.exchange <= 1, raw
        assert parse_record(rec.encode()) == rec, raw
    assert 0 < accepted < 4000  # both outcomes were exercised


# ============================================================================== slot keys
def test_slot_keys_share_one_hash_tag() -> None:
    assert slot_key(FP, TAG, 7) == b"dcp:{0123456789abcdef:t160}:07"
    keys = slot_keys(FP, TAG)
    assert len(keys) == MAX_RUNS == 16 and len(set(keys)) == 16
    assert keys[0].endswith(b":00") and keys[15].endswith(b":15")
    for k in keys:  # Redis Cluster hashes only what is between the first '{' and the next '}'
        s = k.decode()
        assert s[s.index("{") + 1:s.index("}")] == f"{FP}:{TAG}"


# ============================================================================== uses_at: a reference
def reference_uses(now: list[np.ndarray], nxt: list[np.ndarray], n: int, trained: int,
                   drawn: int) -> tuple[list[int], list[bool]]:
    """Walk the per-rank lists position by position: each sample's distance (in per-rank positions) of
    its next read from the loaders' frontier ``drawn``, and whether every copy of it was trained."""
    length = len(now[0])
    copies_now: list[list[int]] = [[] for _ in range(n)]
    copies_next: list[list[int]] = [[] for _ in range(n)]
    for lst in now:
        for p, i in enumerate(lst.tolist()):
            copies_now[i].append(p)
    for lst in nxt:
        for p, i in enumerate(lst.tolist()):
            copies_next[i].append(p)
    next_use, consumed = [], []
    for i in range(n):
        ps = copies_now[i]
        done = bool(ps) and all(p < trained for p in ps)
        consumed.append(done)
        ahead = []
        for p in ps:
            if p >= drawn:
                ahead.append(p - drawn)
            elif p >= trained:
                ahead.append(IN_FLIGHT)
        if ahead:
            next_use.append(min(ahead))
        elif copies_next[i]:
            next_use.append(min((length - drawn) + p for p in copies_next[i]))
        else:
            next_use.append(NOT_READ)
    return next_use, consumed


CASES = [  # n, node_of_rank, owners' nodes, seed, exchange, drop_last
    (40, [0, 0, 1, 1], 2, 0, 0.0, False),
    (37, [0, 0, 1, 1], 2, 1, 0.3, False),  # padded: 3 copies repeated
    (37, [0, 0, 1, 1], 2, 1, 0.3, True),  # 1 dropped per epoch
    (23, [1, 0, 1], 2, 5, 0.5, False),
    (23, [1, 0, 1], 3, 5, 0.0, True),  # owners on a node without ranks
    (11, [0], 1, 2, 0.0, False),
    (5, [0, 1, 0, 1], 2, 9, 1.0, False),  # 8 positions for 5 samples
    (61, [0, 0, 0, 1, 2], 3, 42, 0.1, True),
]


def _owners(n: int, nodes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + seed)
    return rng.integers(-1, nodes, size=n).astype(np.int16)


@pytest.mark.parametrize("n,layout,nodes,seed,exchange,drop_last", CASES)
def test_uses_at_matches_a_sequential_walk_of_the_plan(n: int, layout: list[int], nodes: int, seed: int,
                                                      exchange: float, drop_last: bool) -> None:
    owners = _owners(n, nodes, seed)
    epoch = 4
    kw = dict(seed=seed, exchange=exchange, drop_last=drop_last)
    now = plan_epoch(owners, layout, epoch=epoch, **kw).per_rank
    nxt = plan_epoch(owners, layout, epoch=epoch + 1, **kw).per_rank
    length = len(now[0])
    flat = np.concatenate(now)
    if not drop_last and len(layout) * length > n:
        assert len(np.unique(flat)) < len(flat)  # the padded case has repeated samples
    if drop_last and n % len(layout):
        assert len(np.unique(flat)) < n  # the drop_last case leaves samples out of this epoch
    rec = RunRecord(run="0" * 16, seed=seed, epoch=epoch, exchange=exchange, drop_last=drop_last,
                    node_of_rank=list(layout), masters=[f"h{m}:1" for m in range(max(layout) + 1)],
                    owners_digest="0" * 16, samples=n)
    order = epoch_order(rec, owners)
    assert order.n == n and order.length == length
    rng = np.random.default_rng(seed)
    progress = {(0, 0), (0, length), (length, length), (0, 1), (length - 1, length)}
    progress |= {(t, t) for t in range(length + 1)}
    for _ in range(6):
        t = int(rng.integers(0, length + 1))
        progress.add((t, int(rng.integers(t, length + 1))))
    for trained, drawn in sorted(progress):
        want_next, want_consumed = reference_uses(now, nxt, n, trained, drawn)
        got = uses_at(order, trained, drawn)
        assert got.next_use.dtype == np.int64 and got.next_use.shape == (n,)
        assert got.next_use.tolist() == want_next, (trained, drawn)
        assert got.consumed.tolist() == want_consumed, (trained, drawn)
    # run_uses: the same from the record's own progress
    rec.trained, rec.drawn = 1, min(3, length)
    want_next, want_consumed = reference_uses(now, nxt, n, rec.trained, rec.drawn)
    got = run_uses(rec, owners)
    assert got.next_use.tolist() == want_next and got.consumed.tolist() == want_consumed


def test_uses_at_by_hand_on_one_rank() -> None:
    # one rank, no owners: plan_epoch is a seeded shuffle; check a few samples by their positions
    owners = np.full(6, -1, dtype=np.int16)
    rec = RunRecord(run="0" * 16, seed=3, epoch=0, exchange=0.0, drop_last=False, node_of_rank=[0],
                    masters=["h:1"], owners_digest="0" * 16, samples=6)
    now = plan_epoch(owners, [0], seed=3, epoch=0).per_rank[0].tolist()
    nxt = plan_epoch(owners, [0], seed=3, epoch=1).per_rank[0].tolist()
    u = uses_at(epoch_order(rec, owners), trained=2, drawn=4)
    assert u.next_use[now[0]] == 6 - 4 + nxt.index(now[0]) and u.consumed[now[0]]
    assert u.next_use[now[1]] == 6 - 4 + nxt.index(now[1]) and u.consumed[now[1]]
    assert u.next_use[now[2]] == IN_FLIGHT and u.next_use[now[3]] == IN_FLIGHT
    assert u.next_use[now[4]] == 0 and u.next_use[now[5]] == 1
    assert not u.consumed[now[2:]].any()


# ============================================================================== combine
def ref_combine(uses: list[Uses], n: int) -> tuple[list[int], list[bool]]:
    nu, cons = [], []
    for i in range(n):
        vals = [int(u.next_use[i]) for u in uses]
        nu.append(IN_FLIGHT if IN_FLIGHT in vals else min(vals, default=NOT_READ))
        cons.append(bool(uses) and all(bool(u.consumed[i]) or int(u.next_use[i]) == NOT_READ for u in uses))
    return nu, cons


def test_combine_of_real_runs_matches_the_rule() -> None:
    n, layout = 29, [0, 0, 1]
    owners = _owners(n, 2, 3)
    runs = []
    for seed, (t, d) in zip((1, 2, 3), ((3, 4), (5, 7), (10, 10))):
        rec = RunRecord(run=f"{seed:016x}", seed=seed, epoch=seed, exchange=0.2, drop_last=False,
                        node_of_rank=layout, masters=["a:1", "b:1"], owners_digest="0" * 16, samples=n,
                        trained=t, drawn=d)
        runs.append(run_uses(rec, owners))
    for k in range(1, 4):
        got = combine(runs[:k], n)
        want_nu, want_cons = ref_combine(runs[:k], n)
        assert got.next_use.tolist() == want_nu and got.consumed.tolist() == want_cons
    got = combine(runs, n)
    assert (got.next_use == IN_FLIGHT).any() and got.consumed.any() and not got.consumed.all()
    # combining never changes its inputs
    again = combine(runs, n)
    assert again.next_use.tolist() == got.next_use.tolist()


def test_combine_by_hand() -> None:
    u = lambda nu, c: Uses(np.array(nu, dtype=np.int64), np.array(c, dtype=bool))  # noqa: E731
    R = NOT_READ
    a = u([5, IN_FLIGHT, 3, 9, 7, 2], [False, False, False, True, True, True])
    b = u([2, 8, IN_FLIGHT, 4, R, R], [False, False, False, True, False, True])
    got = combine([a, b], 6)
    assert got.next_use.tolist() == [2, IN_FLIGHT, IN_FLIGHT, 4, 7, 2]
    # sample 4: b never reads it (next use NOT_READ) so it does not block a's deletion
    assert got.consumed.tolist() == [False, False, False, True, True, True]
    one = combine([a], 6)
    assert one.next_use.tolist() == a.next_use.tolist() and one.consumed.tolist() == a.consumed.tolist()
    none = combine([], 4)
    assert none.next_use.tolist() == [R] * 4 and none.consumed.tolist() == [False] * 4
    # a run still reading a sample keeps it, whichever order the runs come in
    c = u([R, 1, R, 6, 0, 1], [True, False, True, False, False, True])
    for runs in ([a, b, c], [c, a, b], [b, c, a]):
        got = combine(runs, 6)
        assert got.consumed.tolist() == [False, False, False, False, False, True]
        assert got.next_use.tolist() == [2, IN_FLIGHT, IN_FLIGHT, 4, 0, 1]


def test_combine_does_not_depend_on_the_order_of_the_runs() -> None:
    u = lambda nu, c: Uses(np.array(nu, dtype=np.int64), np.array(c, dtype=bool))  # noqa: E731
    never = u([NOT_READ], [False])  # this run never reads sample 0 (dropped both epochs)
    done = u([12], [True])  # this run trained it this epoch
    assert combine([done, never], 1).consumed.tolist() == [True]
    assert combine([never, done], 1).consumed.tolist() == [True]


# ============================================================================== PlanPublisher (real Redis)
class ManualPublisher(PlanPublisher):
    """No writer thread: the test calls publish() itself, so every step is deterministic."""

    def start(self) -> None:
        pass


def wait_until(cond: Callable[[], Any], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"not within {deadline_s} s: {what}"
        time.sleep(0.01)


def publisher(store: Any, cls: type = ManualPublisher, **kw: Any) -> PlanPublisher:
    base: dict[str, Any] = dict(seed=7, exchange=0.1, drop_last=False, node_of_rank=[0, 0, 1, 1],
                                masters=MASTERS, ttl=30.0, interval=3600.0)
    base.update(kw)
    return cls(store, FP, TAG, **base)


OWNERS = np.array([0, 1, -1, 1, 0, 0, 1, 1, -1, 0, 1, 0, 0], dtype=np.int16)  # 13 samples: 4 per rank


@pytest.fixture
def store(redis_url: str) -> Any:
    from datacache.stores import open_store

    s = open_store(redis_url)
    yield s
    close = getattr(s, "close", None)
    if close:
        close()


def slot_value(store: Any, slot: int) -> bytes | None:
    return store.client_for(slot_key(FP, TAG, 0)).get(slot_key(FP, TAG, slot))


def slot_pttl(store: Any, slot: int) -> int:
    return int(store.client_for(slot_key(FP, TAG, 0)).pttl(slot_key(FP, TAG, slot)))


def test_publish_claims_a_slot_with_a_ttl_and_reports_progress(store: Any) -> None:
    pub = publisher(store)
    assert pub.publish() is False and pub.slot is None  # no epoch yet: nothing to say
    pub.epoch(2, OWNERS)
    assert pub.publish() is True and pub.slot == 0
    rec = parse_record(slot_value(store, 0))
    assert (rec.run, rec.epoch, rec.samples, rec.trained, rec.drawn) == (pub.record.run, 2, 13, 0, 0)
    assert rec.node_of_rank == [0, 0, 1, 1] and rec.masters == MASTERS and rec.seed == 7
    assert rec.owners_digest == hashlib.blake2b(OWNERS.astype(np.int16).tobytes(), digest_size=8).hexdigest()
    assert 0 < slot_pttl(store, 0) <= 30_000
    seq0 = rec.seq
    pub.progress(trained=1, drawn=3)
    assert pub.publish() is True and pub.slot == 0
    rec = parse_record(slot_value(store, 0))
    assert (rec.trained, rec.drawn) == (1, 3) and rec.seq > seq0
    pub.progress(trained=2)  # drawn never falls below trained, nor goes back by itself
    pub.publish()
    assert (parse_record(slot_value(store, 0)).trained, parse_record(slot_value(store, 0)).drawn) == (2, 3)
    pub.progress(trained=100, drawn=100)  # clipped to this epoch's 4 per rank: still a valid record
    pub.publish()
    rec = parse_record(slot_value(store, 0))
    assert (rec.trained, rec.drawn) == (4, 4)
    pub.epoch(3, OWNERS[:9])  # a new epoch starts from zero
    pub.publish()
    rec = parse_record(slot_value(store, 0))
    assert (rec.epoch, rec.samples, rec.trained, rec.drawn) == (3, 9, 0, 0)
    # the daemons' bounded read (GETRANGE) gives the same record, and recomputes the same plan
    raw = store.client_for(slot_key(FP, TAG, 0)).getrange(slot_key(FP, TAG, 0), 0, MAX_RECORD_BYTES)
    assert parse_record(raw) == rec
    assert [slot_value(store, s) for s in range(1, MAX_RUNS)] == [None] * (MAX_RUNS - 1)
    assert pub.errors == 0
    pub.close()


def test_two_publishers_take_different_slots(store: Any) -> None:
    a, b = publisher(store), publisher(store, seed=8)
    a.epoch(0, OWNERS)
    b.epoch(0, OWNERS)
    assert a.publish() and b.publish() and a.publish() and b.publish()
    assert {a.slot, b.slot} == {0, 1}
    assert parse_record(slot_value(store, a.slot)).run == a.record.run
    assert parse_record(slot_value(store, b.slot)).run == b.record.run
    assert a.record.run != b.record.run
    a.close()
    b.close()


def test_all_slots_taken_publish_fails_and_overwrites_nothing(store: Any) -> None:
    others = []
    for i in range(MAX_RUNS):
        p = publisher(store, seed=i)
        p.epoch(0, OWNERS)
        assert p.publish() and p.slot == i
        others.append(p)
    before = [slot_value(store, s) for s in range(MAX_RUNS)]
    late = publisher(store)
    late.epoch(0, OWNERS)
    assert late.publish() is False and late.slot is None and late.errors == 1
    assert late.publish() is False and late.errors == 2
    assert [slot_value(store, s) for s in range(MAX_RUNS)] == before
    assert all(slot_pttl(store, s) > 0 for s in range(MAX_RUNS))
    late.close()  # holds no slot: touches nothing
    assert [slot_value(store, s) for s in range(MAX_RUNS)] == before
    others[5].close()  # a slot frees up: the late run gets it
    wait_until(lambda: slot_value(store, 5) is None, "slot 5 expired after close()")
    assert late.publish() is True and late.slot == 5
    assert parse_record(slot_value(store, 5)).run == late.record.run
    for p in others:
        p.close()
    late.close()


def test_a_slot_taken_over_after_expiry_is_given_back(store: Any) -> None:
    a = publisher(store)
    a.epoch(0, OWNERS)
    assert a.publish() and a.slot == 0
    client = store.client_for(slot_key(FP, TAG, 0))
    client.delete(slot_key(FP, TAG, 0))  # a's record expired (a frozen trainer)
    b = publisher(store, seed=99)
    b.epoch(1, OWNERS)
    assert b.publish() and b.slot == 0  # and another run claimed the free slot
    b_value = slot_value(store, 0)
    a.progress(trained=2, drawn=3)
    assert a.publish() is True
    assert a.slot == 1  # a moved to another slot ...
    assert slot_value(store, 0) == b_value and slot_pttl(store, 0) > 0  # ... and b's record is back
    rec = parse_record(slot_value(store, 1))
    assert (rec.run, rec.trained, rec.drawn) == (a.record.run, 2, 3)
    assert b.publish() and b.slot == 0  # b never noticed
    # a slot that expired with nobody taking it: a claims a free one again
    client.delete(slot_key(FP, TAG, 1))
    assert a.publish() is True and a.slot == 1
    assert parse_record(slot_value(store, 1)).run == a.record.run
    a.close()
    b.close()


def test_close_removes_its_own_record_and_never_another_runs(store: Any) -> None:
    a = publisher(store)
    a.epoch(0, OWNERS)
    assert a.publish() and a.slot == 0
    a.close()
    # ttl is 30 s: gone within the deadline means close() expired it, not the TTL
    wait_until(lambda: slot_value(store, 0) is None, "a closed run's record gone")
    assert a.slot is None
    # a's slot expired and b took it: a.close() must leave b's record
    a = publisher(store)
    a.epoch(0, OWNERS)
    assert a.publish() and a.slot == 0
    store.client_for(slot_key(FP, TAG, 0)).delete(slot_key(FP, TAG, 0))
    b = publisher(store, seed=5)
    b.epoch(0, OWNERS)
    assert b.publish() and b.slot == 0
    b_value = slot_value(store, 0)
    a.close()
    time.sleep(0.05)  # past a 1 ms expiry, were it set
    assert slot_value(store, 0) == b_value and slot_pttl(store, 0) > 0
    assert b.publish() and parse_record(slot_value(store, 0)).run == b.record.run
    b.close()
    wait_until(lambda: slot_value(store, 0) is None, "b's record gone after its close()")


def test_the_writer_thread_refreshes_and_close_stops_it(store: Any) -> None:
    pub = publisher(store, cls=PlanPublisher, interval=0.02)
    pub.epoch(0, OWNERS)
    wait_until(lambda: slot_value(store, 0) is not None, "the thread's first publish")
    first = parse_record(slot_value(store, 0)).seq
    pub.progress(trained=1, drawn=2)
    wait_until(lambda: (r := parse_record(slot_value(store, 0))).seq > first and r.drawn == 2,
               "a refresh with the progress")
    pub.close()
    assert pub._thread is not None and not pub._thread.is_alive()
    wait_until(lambda: slot_value(store, 0) is None, "record gone after close()")
    n = pub.published
    time.sleep(0.1)  # several intervals: nothing published after close()
    assert pub.published == n and slot_value(store, 0) is None


def test_publishing_errors_never_raise() -> None:
    class Broken:
        def client_for(self, name: bytes) -> Any:
            raise ConnectionError("no route to host")

    pub = publisher(Broken())
    pub.epoch(0, OWNERS)
    assert pub.publish() is False and pub.errors == 1
    pub.close()  # holds no slot: nothing to do, no exception


def test_a_layout_too_large_for_a_record_is_refused_at_construction() -> None:
    with pytest.raises(PlanRecordError):
        PlanPublisher(None, FP, TAG, seed=0, exchange=0.0, drop_last=False,
                      node_of_rank=list(range(256)) * 4,
                      masters=[f"host-{i:04d}.example.internal:6379" for i in range(256)])


def test_locality_sampler_tells_the_publisher_epoch_drawn_and_trained(store: Any) -> None:
    layout = [0, 0, 1, 1]
    pub = publisher(store, seed=11, exchange=0.2, node_of_rank=layout)
    sampler = LocalitySampler(OWNERS, layout, 0, seed=11, exchange=0.2, publisher=pub)
    sampler.set_epoch(5, OWNERS)
    it = iter(sampler)
    got = [next(it) for _ in range(3)]
    assert got == plan_epoch(OWNERS, layout, seed=11, epoch=5, exchange=0.2).per_rank[0][:3].tolist()
    sampler.mark_trained(1)
    assert pub.publish()
    rec = parse_record(slot_value(store, pub.slot))
    assert (rec.epoch, rec.samples, rec.drawn, rec.trained) == (5, len(OWNERS), 3, 1)
    assert (rec.seed, rec.exchange, rec.node_of_rank) == (11, 0.2, layout)
    assert rec.owners_digest == hashlib.blake2b(OWNERS.tobytes(), digest_size=8).hexdigest()
    sampler.mark_trained(2)
    pub.publish()
    rec = parse_record(slot_value(store, pub.slot))
    assert (rec.drawn, rec.trained) == (3, 3)
    # the daemons recompute this run's plan from the record alone: the sample at position 3 is next
    u = run_uses(rec, OWNERS)
    nxt = plan_epoch(OWNERS, layout, seed=11, epoch=5, exchange=0.2).per_rank  # this epoch's
    assert all(u.next_use[int(r[3])] == 0 for r in nxt)
    positions: dict[int, list[int]] = {}
    for r in nxt:
        for p, i in enumerate(r.tolist()):
            positions.setdefault(i, []).append(p)
    assert u.consumed.tolist() == [all(p < 3 for p in positions[i]) for i in range(len(OWNERS))]
    state = sampler.state_dict()
    # a new epoch resets the progress
    sampler.set_epoch(6)
    pub.publish()
    rec = parse_record(slot_value(store, pub.slot))
    assert (rec.epoch, rec.drawn, rec.trained) == (6, 0, 0)
    # a resumed sampler reports the restored trained count
    pub2 = publisher(store, seed=11, exchange=0.2, node_of_rank=layout)
    resumed = LocalitySampler(OWNERS, layout, 0, seed=11, exchange=0.2, publisher=pub2)
    resumed.load_state_dict(state)
    assert pub2.publish()
    rec2 = parse_record(slot_value(store, pub2.slot))
    assert (rec2.epoch, rec2.trained, rec2.drawn) == (5, 3, 3) and pub2.slot != pub.slot
    assert next(iter(resumed)) == nxt[0][3]
    pub2.publish()
    assert parse_record(slot_value(store, pub2.slot)).drawn == 4
    pub.close()
    pub2.close()


# ============================================================================== ACL roles (real server)
@pytest.fixture(scope="module")
def roles_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from datacache.devtools.redis_local import start_server
    from datacache.make_secrets import ensure_passwords
    from tests.redis_utils import SKIP

    if SKIP:
        pytest.skip(SKIP)
    tmp = tmp_path_factory.mktemp("plan_roles")
    sec = ensure_passwords(str(tmp / "secrets"))
    srv = start_server(str(tmp / "srv"), roles=sec.passwords)
    yield srv, sec
    srv.stop()


def _as(roles_server: Any, role: str) -> Any:
    import redis

    srv, sec = roles_server
    return redis.Redis(host="127.0.0.1", port=srv.port, username=role, password=sec.passwords[role])


def _noperm(fn: Callable[[], Any]) -> None:
    import redis

    with pytest.raises(redis.exceptions.NoPermissionError):  # the server's NOPERM reply
        fn()


def test_trainer_role_writes_run_plans_only(roles_server: Any) -> None:
    from datacache.redis_roles import ADMIN, TRAINER

    admin, t = _as(roles_server, ADMIN), _as(roles_server, TRAINER)
    key = slot_key(FP, TAG, 3)
    assert t.set(key, b"v1", nx=True, px=30_000) is True
    assert t.get(key) == b"v1"
    assert t.set(key, b"v2", xx=True, px=30_000, get=True) == b"v1"  # the publisher's refresh
    assert t.set(key, b"v3", nx=True, px=30_000) is None  # taken
    assert admin.get(key) == b"v2"
    admin.set(b"dc:f:v:1", b"sample")
    _noperm(lambda: t.set(b"dc:f:v:1", b"poison"))
    _noperm(lambda: t.set(b"dc:f:v:2", b"poison", nx=True, px=1000))
    _noperm(lambda: t.delete(key))
    _noperm(lambda: t.delete(b"dc:f:v:1"))
    _noperm(lambda: t.set(b"dcq:0123456789abcdef:x", b"bad"))
    _noperm(lambda: t.set(b"dcd:datasets", b"x"))
    _noperm(lambda: t.set(b"dcd:fill:0123456789abcdef:t160", b"x"))
    _noperm(lambda: t.set(b"other:key", b"x"))
    assert admin.get(b"dc:f:v:1") == b"sample" and admin.get(key) == b"v2"
    assert admin.exists(b"dc:f:v:2", b"dcq:0123456789abcdef:x", b"other:key") == 0
    admin.delete(key, b"dc:f:v:1")


def test_daemon_role_reads_run_plans_and_deletes_samples(roles_server: Any) -> None:
    from datacache.redis_roles import ADMIN, DAEMON

    admin, d = _as(roles_server, ADMIN), _as(roles_server, DAEMON)
    key = slot_key(FP, TAG, 0)
    raw = record().encode()
    admin.set(key, raw, px=30_000)
    assert parse_record(d.getrange(key, 0, MAX_RECORD_BYTES)) == record()
    assert 0 < d.pttl(key) <= 30_000
    _noperm(lambda: d.set(key, b"forged"))
    _noperm(lambda: d.set(slot_key(FP, TAG, 1), b"forged", nx=True, px=1000))
    _noperm(lambda: d.delete(key))
    assert admin.get(key) == raw and admin.exists(slot_key(FP, TAG, 1)) == 0
    assert d.set(b"dc:f:v:9", b"sample") is True
    assert d.delete(b"dc:f:v:9") == 1 and admin.exists(b"dc:f:v:9") == 0
    admin.delete(key)


def test_publisher_works_as_the_trainer_role(roles_server: Any) -> None:
    from datacache.make_secrets import password_file
    from datacache.redis_roles import ADMIN, DAEMON, TRAINER
    from datacache.stores import open_store

    srv, sec = roles_server
    s = open_store(f"redis://{TRAINER}@{srv.addr}/0?password_file={password_file(sec.dir, TRAINER)}")
    admin, d = _as(roles_server, ADMIN), _as(roles_server, DAEMON)
    admin.delete(*slot_keys(FP, TAG))
    a, b = publisher(s), publisher(s, seed=3)
    a.epoch(0, OWNERS)
    b.epoch(0, OWNERS)
    assert a.publish() and b.publish() and a.publish() and {a.slot, b.slot} == {0, 1}
    assert a.errors == 0 and b.errors == 0
    got = [parse_record(d.getrange(k, 0, MAX_RECORD_BYTES)).run for k in slot_keys(FP, TAG)[:2]]
    assert sorted(got) == sorted([a.record.run, b.record.run])
    a_slot = a.slot
    a.close()
    wait_until(lambda: admin.exists(slot_key(FP, TAG, a_slot)) == 0, "a's record gone")
    assert admin.exists(*slot_keys(FP, TAG)) == 1
    assert parse_record(admin.get(slot_key(FP, TAG, b.slot))).run == b.record.run
    b.close()
    wait_until(lambda: admin.exists(*slot_keys(FP, TAG)) == 0, "b's record gone")
    assert os.path.exists(password_file(sec.dir, TRAINER))


def test_publishers_on_a_redis_cluster_keep_every_slot_on_one_master(cluster_url: str, redis_cluster) -> None:
    from datacache.stores import open_store
    from tests.redis_utils import cli

    s = open_store(cluster_url)
    a, b = publisher(s), publisher(s, seed=2)
    a.epoch(0, OWNERS)
    b.epoch(0, OWNERS)
    assert a.publish() and b.publish() and a.publish() and {a.slot, b.slot} == {0, 1}
    assert a.errors == 0 and b.errors == 0
    # Redis's own CLUSTER KEYSLOT: the 16 slot keys hash to one cluster slot, held by one master
    port = redis_cluster.masters[0].port
    assert len({cli(port, "cluster", "keyslot", k.decode()) for k in slot_keys(FP, TAG)}) == 1
    key0 = slot_key(FP, TAG, 0).decode()
    holders = [m for m in redis_cluster.masters if cli(m.port, "exists", key0) == "1"]
    assert len(holders) == 1
    assert cli(holders[0].port, "exists", slot_key(FP, TAG, 1).decode()) == "1"
    got = {parse_record(s.client_for(k).get(k)).run for k in slot_keys(FP, TAG)[:2]}
    assert got == {a.record.run, b.record.run}
    a.close()
    b.close()
    wait_until(lambda: all(cli(holders[0].port, "exists", k.decode()) == "0" for k in slot_keys(FP, TAG)[:2]),
               "both records gone after close()")
