"""How tests/scheduling.py spreads a parallel run, on a small suite of its own run by a real
``pytest -n 2 --dist loadgroup``: the tests sharing a module-scoped fixture stay on one worker (the
fixture is built once), the heavy tests form one lane started first, and the grouping really reaches
xdist (on pytest 9.2, xdist 3.8's loadgroup silently ignores groups: pytest-dev/pytest-xdist#1386)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LOG = """
import os, time

def log(what):
    with open(os.environ["SCHED_LOG"], "a") as f:
        f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {time.monotonic():.6f} {what}\\n")
"""


def _suite(root: Path) -> None:
    (root / "logutil.py").write_text(LOG)
    (root / "test_shared.py").write_text(textwrap.dedent("""
        import pytest
        from logutil import log

        @pytest.fixture(scope="module")
        def server():
            log("built server")
            return object()

        @pytest.mark.parametrize("k", range(4))
        def test_uses_it(server, k):
            log(f"shared {k}")
    """))
    for name in ("h1", "h2"):
        (root / f"test_{name}.py").write_text(textwrap.dedent(f"""
            import time
            from logutil import log

            def test_heavy():
                log("heavy {name}")
                time.sleep(0.3)
        """))
    for k in range(6):
        (root / f"test_light{k}.py").write_text(textwrap.dedent(f"""
            from logutil import log

            def test_light():
                log("light {k}")
        """))
    durations = {"test_h1.py::test_heavy": 300.0, "test_h2.py::test_heavy": 200.0}
    (root / "durations.json").write_text(json.dumps(durations))


def test_shared_fixtures_stay_together_and_heavy_tests_share_one_lane_started_first(tmp_path) -> None:
    _suite(tmp_path)
    log = tmp_path / "log"
    env = {**os.environ, "SCHED_LOG": str(log), "PYTHONPATH": str(tmp_path) + os.pathsep + str(REPO)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "tests.scheduling", "-p", "no:cacheprovider",
                          "--expected-durations", str(tmp_path / "durations.json"), str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "12 passed" in res.stdout
    # the group reached xdist: grouped node ids carry it (nothing else would tell that they were ignored)
    assert "test_shared.py::test_uses_it[0]@test_shared.py" in res.stdout
    assert "test_h1.py::test_heavy@heavy-lane" in res.stdout

    lines = [line.split(maxsplit=2) for line in log.read_text().splitlines()]
    worker_of = {what: worker for worker, _, what in lines}
    assert sum(what == "built server" for _, _, what in lines) == 1  # one worker, one module fixture
    assert len({worker_of[f"shared {k}"] for k in range(4)}) == 1
    lane = worker_of["heavy h1"]
    assert worker_of["heavy h2"] == lane
    first = min((float(t), what) for worker, t, what in lines if worker == lane)[1]
    assert first == "heavy h1"  # the longest unit goes first, on the lane's worker
