"""The rolling fill's choice of what it can still fill in time (:func:`cache_daemon.rolling.reachable`),
against a step-by-step re-statement: one fill every ``per`` seconds, in next-use order, of exactly the
candidates that land ``SLACK_S`` before their reader; a candidate left to the reader costs no fill time."""

from __future__ import annotations

import numpy as np
import pytest

from cache_daemon.rolling import SLACK_S, reachable


def walk(until: list[float], per: float, want: int) -> tuple[list[int], list[float]]:
    clock = 0.0  # seconds of filling done so far
    kept: list[int] = []
    slack: list[float] = []
    for j, t in enumerate(until):
        if len(kept) == want:
            break
        done = clock + per  # this one would land then
        if t - done > SLACK_S:
            kept.append(j)
            slack.append(t - done)
            clock = done
    return kept, slack


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_step_by_step_fill(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    until = np.sort(rng.exponential(3.0, size=n))
    per = float(rng.choice([0.0, 0.01, 0.05, 0.2]))
    want = int(rng.integers(1, 400))
    cand = rng.permutation(10_000)[:n].astype(np.int64)
    got, slack = reachable(until, per, want, cand)
    kept, ref_slack = walk(until.tolist(), per, want)
    assert got.tolist() == cand[kept].tolist()
    np.testing.assert_allclose(slack, ref_slack)
    assert (slack > SLACK_S).all() and len(got) <= want


def test_a_slow_fill_still_reaches_what_is_far_enough_ahead() -> None:
    # 100 samples the readers reach at once, then one in 10 s, at 2 fills/s: the 100 are left to the
    # readers and cost no fill time, so the far one is filled (counting them as queued would skip it too)
    until = np.array([0.1] * 100 + [10.0])
    got, slack = reachable(until, 0.5, 64, np.arange(101))
    assert got.tolist() == [100] and slack.tolist() == [9.5]


def test_nothing_to_fill() -> None:
    got, slack = reachable(np.empty(0), 0.1, 8, np.empty(0, dtype=np.int64))
    assert got.dtype == np.int64 and len(got) == 0 and len(slack) == 0
