"""How the suite is spread over pytest-xdist workers, and what must not run beside what.

``./quickstart.sh test`` runs ``pytest -n N --dist loadgroup`` (docs/internals.md, "The test suite").
This plugin (loaded by tests/conftest.py) shapes that run; without xdist (``-p no:xdist``) it only
keeps the exclusive lock below, and the order stays the files' own.

* **Units.** A test that uses a module- or class-scoped fixture (a Redis Cluster, an emulated cluster,
  the results of one 4-rank gloo run) is put in its module's ``xdist_group``, so that fixture is built
  once, on one worker. Every other test is a unit of its own, free to run on any worker.
* **Order: longest first.** Units are sent to workers in decreasing expected duration (the greedy
  longest-processing-time rule), from ``tests/durations.json`` (seconds per test, measured by
  ``pytest --record-durations tests/durations.json``; a test not listed counts ``DEFAULT_S``). A long
  test started last would otherwise run alone at the end. The file only orders the run: a stale or
  missing entry changes how long the run takes, never what it checks.
* **The heavy lane.** Units expected to take ``HEAVY_S`` or more (the benchmarks' smoke runs, the
  bf16 training run: a third of the suite's time in five tests) all go to one group, ``heavy-lane``,
  so one worker runs them one after another while the others take everything else. Started side by
  side on 2 cores they would each run at a third of their speed for the first half hour and end
  together, no sooner; in one lane each keeps most of a core and the other workers fill the rest.
* **Network namespaces.** Tests that build emulated clusters (``@pytest.mark.netns``) hold a shared
  lock for their module; a test that removes *every* emulated cluster of the machine
  (``@pytest.mark.netns_exclusive``: ``bench.emucluster down --cleanup``) holds it exclusively, so it
  never runs while another worker -- or another pytest run on the machine -- has a cluster up. The
  lock prefers the writer (a waiting exclusive test lets no new module in), and the exclusive tests
  are short, so by the longest-first order they come after the long namespace modules have ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_S = 0.2
HEAVY_S = 90.0
HEAVY_LANE = "heavy-lane"
GROUPED_SCOPES = ("module", "class", "package")
# machine-wide: `down --cleanup` removes the emulated clusters of every run on the machine
NETNS_LOCK = "/tmp/datacache-tests-netns.lock"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--expected-durations", metavar="PATH", default=str(DURATIONS),
                     help="seconds per test that order a parallel run (default: tests/durations.json)")
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's measured seconds (setup + call + teardown) into PATH as JSON "
                          "(merged with what PATH already holds): the order of the next parallel run")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: builds network namespaces (an emulated cluster); holds the "
                                       "shared namespace lock for its module")
    config.addinivalue_line("markers", "netns_exclusive: removes every emulated cluster of the machine; runs "
                                       "only while no netns test runs anywhere")
    if getattr(config.option, "dist", "no") == "loadgroup":
        # our order is the point: xdist would otherwise re-sort the groups by their number of tests
        config.option.loadscopereorder = False


def _base_id(nodeid: str) -> str:
    """The test's id without the ``@group`` suffix that ``--dist loadgroup`` appends."""
    at, bracket = nodeid.rfind("@"), nodeid.rfind("]")
    return nodeid[:at] if at > bracket else nodeid


def _expected(durations: dict[str, float], nodeid: str) -> float:
    return float(durations.get(nodeid, DEFAULT_S))


def _uses_shared_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        if name in INFRASTRUCTURE:
            continue
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in GROUPED_SCOPES:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node-id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the files' own order
        return
    try:
        durations = json.loads(Path(config.getoption("--expected-durations")).read_text())
    except (OSError, ValueError):
        durations = {}
    units: dict[str, list[pytest.Item]] = {}
    own: set[str] = set()  # the groups this hook made (a test file's own xdist_group stays as it is)
    for item in items:
        group = next((m.args[0] if m.args else m.kwargs.get("name", "default")
                      for m in item.iter_markers("xdist_group")), None)
        if group is None and _uses_shared_fixture(item):
            group = item.nodeid.split("::", 1)[0]
            own.add(f"group:{group}")
        key = f"group:{group}" if group else f"test:{item.nodeid}"
        if key.startswith("test:"):
            own.add(key)
        units.setdefault(key, []).append(item)

    def seconds(unit: list[pytest.Item]) -> float:
        return sum(_expected(durations, it.nodeid) for it in unit)

    # (lists, not sets, where order matters: every worker must compute the same order, and a set of
    # strings iterates in an order that differs between processes)
    lane_keys = [key for key, unit in units.items() if key in own and seconds(unit) >= HEAVY_S]
    for key, unit in units.items():
        if key in lane_keys:
            name = HEAVY_LANE  # the lane's units stay whole: a module's shared fixture is still built once
        elif key in own and key.startswith("group:"):
            name = key[len("group:"):]
        else:
            continue
        for item in unit:
            item.add_marker(pytest.mark.xdist_group(name))
    ordered = sorted((u for k, u in units.items() if k not in lane_keys), key=seconds, reverse=True)
    if lane_keys:
        # the lane is one unit to xdist, longest first inside, sent first: its worker starts on it at once
        lane = sorted((units[k] for k in lane_keys), key=seconds, reverse=True)
        ordered.insert(0, [it for unit in lane for it in unit])
    # sorted() is stable and every worker collects the same items: every worker computes this order
    items[:] = [it for unit in ordered for it in unit]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # runs in the controller under xdist (every worker's reports arrive there) and in a plain run
    store = _durations_store
    if store is not None:
        key = _base_id(report.nodeid)
        store[key] = store.get(key, 0.0) + report.duration


_durations_store: dict[str, float] | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _durations_store
    if session.config.getoption("--record-durations") and not hasattr(session.config, "workerinput"):
        _durations_store = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--record-durations")
    if not path or hasattr(session.config, "workerinput") or _durations_store is None:
        return
    target = Path(path)
    try:
        merged = json.loads(target.read_text())
    except (OSError, ValueError):
        merged = {}
    merged.update({k: round(v, 2) for k, v in _durations_store.items()})
    target.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # a planted symlink is refused


class NetnsLock:
    """The machine-wide namespace lock of this process, a readers-writer lock that prefers the writer.

    * shared: take the turnstile, take the main lock shared, let the turnstile go;
    * exclusive: take the turnstile and keep it (no new reader gets in), then the main lock exclusive
      (waits for the readers that hold it now).

    One open file per process for the main lock: the exclusive test of a module that holds the shared
    lock converts that lock, because flock(2) on a second file of the same process would wait for
    itself. Closing a file -- or the process dying -- releases what it held."""

    def __init__(self) -> None:
        self.fd: int | None = None

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        turnstile = _open_lock(NETNS_LOCK + ".turnstile")
        self.fd = _open_lock(NETNS_LOCK)
        try:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # a waiting writer holds it: readers queue behind it
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            os.close(turnstile)
            turnstile = -1
            yield
        finally:
            if turnstile >= 0:
                os.close(turnstile)
            os.close(self.fd)
            self.fd = None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        turnstile = _open_lock(NETNS_LOCK + ".turnstile")
        own = self.fd is None
        fd = _open_lock(NETNS_LOCK) if own else self.fd
        assert fd is not None
        try:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_EX)  # converts this module's shared lock where it holds one
            yield
        finally:
            if own:
                os.close(fd)
            else:
                fcntl.flock(fd, fcntl.LOCK_SH)  # back to what the module held
            os.close(turnstile)


_LOCK = NetnsLock()
INFRASTRUCTURE = frozenset({"_netns_module_lock"})  # autouse everywhere: never a reason to group


@pytest.fixture(scope="module", autouse=True)
def _netns_module_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module marked ``netns`` holds the shared lock from before its first fixture to after its last."""
    if request.node.get_closest_marker("netns") is None:
        yield
        return
    with _LOCK.shared():
        yield


@pytest.fixture(autouse=True)
def _netns_exclusive_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("netns_exclusive") is None:
        yield
        return
    with _LOCK.exclusive():
        yield
