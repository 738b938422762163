"""One command for the first GPU: every CUDA-only test and every GPU benchmark, in one go, within 10 minutes.

``python -m bench.gpu`` runs these checks in this order (priority: the GPU benchmarks no CPU can stand
in for, then correctness, then the rest), each in its own process group with its own timeout, inside one
global budget (``--budget``, default 540 s; a check that no longer fits is reported ``not run: budget``,
one that the budget ends while it runs ``stopped: budget``; neither counts as a failure). GPU time comes
in short windows: one call gives ``gpu-input``, ``train-gpu``, ``topk`` and, as the budget allows,
``cuda-tests``; a second call (``--only`` with the names it did not run) finishes the rest:

* ``gpu-input`` -- ``python -m bench.gpu_input``: ResNet-50 at 224 px fed by torchvision's ImageFolder,
  datacache cold, warm with the same transforms and the warm fast path (issue 38): writes
  ``gpu_input_gpu.json``/``.png``.
* ``train-gpu`` -- the prefetcher benchmark, :func:`bench.train_gpu.gpu_part` (ResNet-50 at 128 px,
  fp16, batch 256, without the prefetcher and with it staging inline and on a thread) on the
  2,000-image dataset of ``bench.train``, started alone in a fresh process: writes ``train_gpu.json``.
* ``topk`` -- ``python -m bench.topk`` full (d = 1M, 8M, 25M, 7 reps; ``--quick`` stops at 1M and
  the GPU target is at 25M): writes ``topk_gpu.json``/``topk_gpu.png``.
* ``cuda-tests`` -- every test whose ``skipif`` reason names CUDA, a GPU or NCCL in the test files
  that have such skips (found by scanning ``tests/``; ``tests/test_dali.py`` is the ``dali`` check's),
  except the multi-GPU ones. ``pytest -rs`` with a ``--junitxml`` that is parsed: each test is
  reported passed, failed or skipped with its reason; a CUDA test that still skips on a GPU is a
  reported problem ("skipped on a GPU: <reason>"), not a failure of this tool.
* ``nccl-multi-gpu`` -- the tests that need 2+ CUDA devices (NCCL on every visible GPU, up to 4
  ranks); skipped where fewer than 2 GPUs are visible.
* ``dali`` -- all of ``tests/test_dali.py`` (DALI CPU and mixed/nvJPEG decode); only where
  ``nvidia.dali`` imports (it is not fetched: hundreds of MB).
* ``kernels`` -- ``python -m bench.gpu_kernels``: CUDA kernels per call of the foreach forms the
  optimizers use, LARS/LAMB steps and device augmentation: writes ``gpu_kernels_gpu.json``/``.png``.
* ``train-quick`` -- ``python -m bench.train --quick``: the documented path (CPU part, then the GPU
  part in the same process) runs through; its numbers are a smoke run's and are not kept.
* ``cuda-files-rest`` -- the other tests of the CUDA test files, under the CUDA build of torch
  (fake-CUDA and device-choice code behaves differently there); last, so the budget cuts it first.

A benchmark also rewrites its CPU results (``topk.json``, ``train.json``, ...): those files are
restored after each check (the GPU machine's versions are kept in the log folder, ``displaced/``),
so only ``gpu.json`` and the ``*_gpu.*`` files change in ``bench/results``.

Writes ``bench/results/gpu.json`` (``--out`` elsewhere): the machine (:func:`bench.common.machine_info`),
torch and CUDA versions, the device names, the wheels installed, and per check its command, status,
wall time, exit code, the tail of its output on failure, its tests' outcomes and the result files it
wrote. Exit status: 0 when nothing failed, 1 when a check failed or hit its own timeout, 2 when there
is no CUDA here.

The GPU image (CUDA torch, Python 3.12, no package registry) lacks some of the project's packages
(lmdb, msgpack, xxhash, ...). Here, with network::

    python -m bench.gpu --fetch-wheels bench/.gpu-wheels

downloads cp312 manylinux wheels of the project's runtime dependencies and of what the checks need
(pytest, pytest-timeout, matplotlib, redis; pinned to this venv's versions, ``--no-deps`` over the
whole closure, torch excluded). On the GPU box, from the repository root::

    python -m bench.gpu --wheels bench/.gpu-wheels

installs (``pip install --no-index --no-deps --target bench/.gpu-wheels/site-py312``; never into the
image's site-packages, so its torch stays as it is) only the wheels whose modules fail to import, and
runs every check with ``PYTHONPATH=<repo root>:<that folder>``. Through the device tool, whose
machine sends back only ``$OUT``: command ``python -m bench.gpu --wheels bench/.gpu-wheels --export
"$OUT"``, carry ``["bench/.gpu-wheels"]``, timeout 600 s; then copy ``$OUT/results/*`` into
``bench/results/``.

``--dry-run`` (any machine, CI included): collects every test the checks would run and prints, per
check, its command and that it is skipped and why (no CUDA here); writes ``gpu.json`` only to
``--out`` when given, never to ``bench/results``; exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.gpu_wheels import ensure_project_metadata, fetch_wheels, install_wheels

ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = ROOT / "tests"
RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_WHEELS = ROOT / "bench" / ".gpu-wheels"
RESULT_FILE = "gpu.json"
DEFAULT_BUDGET_S = 540.0
DALI_FILES = ("tests/test_dali.py",)

log = logging.getLogger("bench.gpu")

# A skipif reason that names CUDA, a GPU or NCCL marks a CUDA-only test ("nvidia-dali-cuda120 is not
# installed" does not: no word boundary after "cuda"); "2+ CUDA devices" marks a multi-GPU one.
CUDA_REASON = re.compile(r"\b(cuda|gpus?|nccl)\b", re.IGNORECASE)
MULTI_REASON = re.compile(r"\b[2-9]\+ (cuda devices|gpus)\b", re.IGNORECASE)
# what a test file with CUDA-only tests contains (the condition of its skipif)
CUDA_SKIPIF = re.compile(r"skipif\(\s*(not\s+)?(torch\.cuda\.(is_available|device_count)|gpu_available)\(")



# ------------------------------------------------------------------------------------------- checks
@dataclasses.dataclass(frozen=True)
class Check:
    """One thing to run. ``argv`` is complete except, for ``kind == "test"``, the junit/manifest
    paths that the runner appends. ``needs``: ``cuda``, ``dali``, ``multi-gpu``. ``expect_s``: the
    estimated wall time on one H100 box; ``min_s``: not started with less budget left than this.
    ``writes``: the files in ``bench/results`` the check owns (kept; anything else it rewrites there
    is restored). ``files``/``select``: for a test check, its files and ``--gpu-select`` category."""

    name: str
    kind: str  # "test" | "bench"
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ("cuda",)
    timeout_s: float = 300.0
    expect_s: float = 60.0
    min_s: float = 20.0
    writes: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    select: str = "all"
    note: str = ""


def cuda_test_files(tests_dir: Path = TESTS_DIR) -> list[str]:
    """Test files (repo-relative) with a CUDA ``skipif`` condition, the DALI file excluded."""
    out = []
    for path in sorted(tests_dir.glob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        if rel not in DALI_FILES and CUDA_SKIPIF.search(path.read_text(encoding="utf-8")):
            out.append(rel)
    return out


def selection_argv(files: Sequence[str], select: str) -> tuple[str, ...]:
    """The pytest command of a test check (``-p bench.gpu`` selects by skip reason, see the plugin below)."""
    return (sys.executable, "-m", "pytest", "-rs", "-q", "-p", "no:cacheprovider", "-p", "bench.gpu",
            "--gpu-select", select, *files)


def build_checks() -> list[Check]:
    """The checks, in priority order (see the module docstring)."""
    files = tuple(cuda_test_files())
    py = sys.executable
    return [
        Check("gpu-input", "bench", (py, "-m", "bench.gpu_input"), timeout_s=360, expect_s=150,
              writes=("gpu_input_gpu.json", "gpu_input_gpu.png"),
              note="ResNet-50 at 224 px fed by ImageFolder, datacache cold, warm with transforms and the "
                   "warm fast path (issue 38): generates 12,000 JPEGs with every core first"),
        Check("train-gpu", "bench", (py, "-m", "bench.gpu", "--run-train-gpu"), timeout_s=300, expect_s=120,
              writes=("train_gpu.json",),
              note="bench.train_gpu.gpu_part alone (prefetcher inline and thread vs none, ResNet-50 128 px "
                   "fp16, batch 256, 2,000 images); no --quick exists or is needed"),
        Check("topk", "bench", (py, "-m", "bench.topk"), timeout_s=300, expect_s=120,
              writes=("topk_gpu.json", "topk_gpu.png"),
              note="full run (d = 1M, 8M, 25M, 7 reps): --quick stops at 1M, the GPU target is at 25M; "
                   "rows mstopk_vs_topk_{1M,25M}_{k0.1pct,k1pct}[_fp16|_bf16], mstopk_read_passes_25M "
                   "(MSTopK's fused Triton path, issue 37); the CPU part's topk.json/png are restored"),
        Check("cuda-tests", "test", selection_argv(files, "cuda"), timeout_s=300, expect_s=90,
              files=files, select="cuda",
              note="tests whose skipif reason names CUDA/GPU/NCCL, multi-GPU ones excluded"),
        Check("nccl-multi-gpu", "test", selection_argv(files, "multi"), needs=("cuda", "multi-gpu"),
              timeout_s=180, expect_s=40, files=files, select="multi",
              note="NCCL ranks on every visible GPU (up to 4); needs 2+ GPUs"),
        Check("dali", "test", selection_argv(DALI_FILES, "all"), needs=("cuda", "dali"), timeout_s=180,
              expect_s=60, files=DALI_FILES, select="all",
              note="DALI CPU and mixed (nvJPEG) decode vs Pillow; only where nvidia.dali imports"),
        Check("kernels", "bench", (py, "-m", "bench.gpu_kernels"), timeout_s=120, expect_s=30,
              writes=("gpu_kernels_gpu.json", "gpu_kernels_gpu.png"),
              note="CUDA kernels per call (profiler): foreach forms with 0-d lists, LARS/LAMB steps, "
                   "device augmentation of 256 and 32 images"),
        Check("train-quick", "bench", (py, "-m", "bench.train", "--quick"), timeout_s=240, expect_s=120,
              note="--quick: only that `python -m bench.train` reaches and finishes its GPU part; its "
                   "files (train_quick.*, a 300-image train_gpu.json) are not kept"),
        Check("cuda-files-rest", "test", selection_argv(files, "rest"), timeout_s=300, expect_s=150, min_s=60,
              files=files, select="rest",
              note="the CPU tests of the CUDA test files, under the CUDA build of torch"),
    ]


def environment() -> dict[str, Any]:
    """What this machine offers the checks: torch, CUDA devices, DALI."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        import torch
    except ImportError as e:
        env.update(torch=None, cuda=False, device_count=0, devices=[], why=f"torch does not import: {e}")
        return env
    cuda = bool(torch.cuda.is_available())
    env.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=cuda,
               device_count=torch.cuda.device_count() if cuda else 0)
    env["devices"] = [torch.cuda.get_device_name(i) for i in range(env["device_count"])]
    env["device"] = env["devices"][0] if env["devices"] else None
    try:
        env["dali"] = importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        env["dali"] = False
    return env


def unmet_needs(check: Check, env: Mapping[str, Any]) -> list[str]:
    """Why ``check`` cannot run here (empty: it can)."""
    why = []
    if "cuda" in check.needs and not env.get("cuda"):
        why.append(f"no CUDA here (torch {env.get('torch')}: torch.cuda.is_available() is False)")
    if "multi-gpu" in check.needs and env.get("device_count", 0) < 2:
        why.append(f"needs 2+ CUDA devices, {env.get('device_count', 0)} visible")
    if "dali" in check.needs and not env.get("dali"):
        why.append("nvidia.dali does not import (nvidia-dali-cuda120 not installed)")
    return why


# ---------------------------------------------------------------------------- pytest plugin (-p bench.gpu)
def reason_category(reasons: Iterable[str]) -> str:
    """``multi`` (a reason asks for 2+ GPUs), ``cuda`` (a reason names CUDA/GPU/NCCL) or ``rest``."""
    reasons = list(reasons)
    if any(MULTI_REASON.search(r) for r in reasons):
        return "multi"
    return "cuda" if any(CUDA_REASON.search(r) for r in reasons) else "rest"


def classify_item(item: Any) -> dict[str, Any]:
    """A collected pytest item's id, file, CUDA skip reasons, category and whether it skips here."""
    marks = [(m.args[0] if m.args else True, str(m.kwargs.get("reason", "")))
             for m in item.iter_markers("skipif")]
    marks += [(True, str(m.kwargs.get("reason", m.args[0] if m.args else "")))
              for m in item.iter_markers("skip")]
    cuda = [r for _, r in marks if CUDA_REASON.search(r)]
    # a string condition is evaluated by pytest only when the test runs: not known here
    skip = next((r for c, r in marks if c is True or (not isinstance(c, str) and bool(c))), None)
    return {"id": item.nodeid, "file": item.nodeid.split("::")[0], "category": reason_category(cuda),
            "reasons": cuda, "skips_here": skip is not None, "skip_reason": skip}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("bench.gpu", "test selection of python -m bench.gpu")
    group.addoption("--gpu-select", default=None, choices=("cuda", "multi", "rest", "all"),
                    help="keep only the tests of this category (by their skipif reasons)")
    group.addoption("--gpu-manifest", default=None, help="write the kept tests (JSON) to this file")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    select = config.getoption("--gpu-select")
    if select is None:
        return
    rows = [classify_item(it) for it in items]
    keep = [select == "all" or r["category"] == select for r in rows]
    dropped = [it for it, k in zip(items, keep) if not k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it, k in zip(items, keep) if k]
    path = config.getoption("--gpu-manifest")
    if path:
        Path(path).write_text(json.dumps([r for r, k in zip(rows, keep) if k], indent=1))


# ------------------------------------------------------------------------------------------- junit
@dataclasses.dataclass
class JunitCase:
    id: str
    outcome: str  # passed | failed | error | skipped | xfailed
    message: str = ""
    time_s: float = 0.0


def junit_nodeid(classname: str, name: str) -> str:
    """pytest's junit ``classname``/``name`` back to a node id: ``tests.test_x.TestY`` + ``test_z[1]``
    -> ``tests/test_x.py::TestY::test_z[1]`` (a part starting with a capital is a class)."""
    parts = [p for p in classname.split(".") if p]
    cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])


def parse_junit(source: str | Path) -> list[JunitCase]:
    """Every ``testcase`` of a pytest junit XML (a path, or the XML text itself)."""
    text = Path(source).read_text(encoding="utf-8") if isinstance(source, Path) else source
    if not text.lstrip().startswith("<"):
        text = Path(text).read_text(encoding="utf-8")
    out = []
    for case in ET.fromstring(text).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
                break
            if child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        out.append(JunitCase(junit_nodeid(case.get("classname", ""), case.get("name", "")), outcome,
                               message, float(case.get("time") or 0.0)))
    return out


# ------------------------------------------------------------------------------------------- running
def run_command(argv: Sequence[str], *, timeout_s: float, log_path: Path,
                env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> tuple[int | None, float, bool]:
    """Run ``argv`` in its own process group, output (both streams) to ``log_path``. Returns
    ``(rc, wall_s, timed_out)``. On timeout the whole group gets SIGINT (pytest still writes its junit
    XML, Python prints where it was), then SIGTERM after 10 s, then SIGKILL after 5 more."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(env) if env is not None else None, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(0.1, timeout_s))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _kill_group(proc)
        except BaseException:
            _kill_group(proc)
            raise
    return rc, time.monotonic() - t0, timed_out


def _kill_group(proc: subprocess.Popen[bytes]) -> int | None:
    for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # the group this runner created for this check (start_new_session)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def _rel(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-chars:].decode("utf-8", "replace")


def _snapshot(results_dir: Path | None) -> dict[str, bytes]:
    if results_dir is None or not results_dir.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in results_dir.iterdir() if p.is_file()}


def _restore(results_dir: Path | None, before: Mapping[str, bytes], keep: Iterable[str],
             displaced: Path) -> list[str]:
    """Put back every file of ``results_dir`` that the check rewrote or created outside ``keep``; the
    check's versions go to ``displaced``. Returns their names."""
    if results_dir is None or not results_dir.is_dir():
        return []
    moved, owned = [], set(keep)
    for p in sorted(results_dir.iterdir()):
        if not p.is_file() or p.name in owned:
            continue
        old = before.get(p.name)
        new = p.read_bytes()
        if old == new:
            continue
        displaced.mkdir(parents=True, exist_ok=True)
        (displaced / p.name).write_bytes(new)
        if old is None:
            p.unlink()
        else:
            p.write_bytes(old)
        moved.append(p.name)
    for name, old in before.items():  # deleted by the check
        if name not in owned and not (results_dir / name).exists():
            (results_dir / name).write_bytes(old)
    return moved


def _test_summary(check: Check, junit: Path, manifest: Path, res: dict[str, Any]) -> None:
    """Fill ``res`` (a test check's record) from its junit XML and manifest."""
    selected = {}
    if manifest.exists():
        selected = {r["id"]: r for r in json.loads(manifest.read_text())}
    outcomes = parse_junit(junit) if junit.exists() else []
    tests = []
    for o in outcomes:
        row = {"id": o.id, "outcome": o.outcome, "time_s": round(o.time_s, 2)}
        if o.message:
            row["message"] = o.message
        info = selected.get(o.id)
        if info:
            row["category"] = info["category"]
        tests.append(row)
        if o.outcome == "skipped" and check.select != "rest":  # a CUDA test (or DALI's) skipped on a GPU
            res["problems"].append(f"skipped on a GPU: {o.id}: {o.message}")
    res["tests"] = tests
    kinds = ("passed", "failed", "error", "skipped", "xfailed")
    counts = {k: sum(t["outcome"] == k for t in tests) for k in kinds}
    res["counts"] = {k: v for k, v in counts.items() if v}
    missing = sorted(set(selected) - {t["id"] for t in tests})
    if missing:
        res["not_reported"] = missing


def run_checks(checks: Sequence[Check], *, budget_s: float, log_dir: Path, env: Mapping[str, Any],
               child_env: Mapping[str, str] | None = None, results_dir: Path | None = None,
               cwd: Path = ROOT, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``checks`` in order within ``budget_s`` seconds; one record per check (see the module
    docstring). ``results_dir``: where benchmarks write (their other files there are restored)."""
    t_start = time.monotonic()
    records = []
    n = len(checks)
    for i, check in enumerate(checks, 1):
        res: dict[str, Any] = {"name": check.name, "kind": check.kind, "needs": list(check.needs),
                               "timeout_s": check.timeout_s, "expect_s": check.expect_s, "note": check.note,
                               "argv": list(check.argv), "problems": []}
        records.append(res)
        left = budget_s - (time.monotonic() - t_start)
        why = unmet_needs(check, env)
        if why:
            res.update(status="skipped", reason="; ".join(why))
        elif left <= 0 or left < check.min_s:
            res.update(status="not run: budget",
                       reason=f"{max(0.0, left):.0f} s of the {budget_s:.0f} s budget left "
                              f"(needs at least {check.min_s:.0f} s, ~{check.expect_s:.0f} s expected)")
        if "status" in res:
            progress(f"[{i}/{n}] {check.name:<16} {res['status']}: {res['reason']}")
            log.info("%s: %s (%s)", check.name, res["status"], res["reason"])
            continue
        timeout = min(check.timeout_s, left)
        argv = list(check.argv)
        junit = log_dir / f"{check.name}.junit.xml"
        manifest = log_dir / f"{check.name}.manifest.json"
        if check.kind == "test":
            argv += [f"--junitxml={junit}", f"--gpu-manifest={manifest}"]
            res["argv"] = argv
        log_path = log_dir / f"{check.name}.log"
        shown = " ".join(argv[1:] if argv and argv[0] == sys.executable else argv)
        progress(f"[{i}/{n}] {check.name:<16} running (timeout {timeout:.0f} s, {left:.0f} s of budget "
                 f"left): {shown}")
        log.info("%s: %s", check.name, argv)
        before = _snapshot(results_dir)
        t0 = time.time()
        rc, wall, timed_out = run_command(argv, timeout_s=timeout, log_path=log_path, env=child_env, cwd=cwd)
        res.update(rc=rc, wall_s=round(wall, 1), log=str(log_path))
        if check.kind == "test":
            _test_summary(check, junit, manifest, res)
        if timed_out and timeout < check.timeout_s:
            res.update(status="stopped: budget", reason=f"the budget ran out after {wall:.0f} s")
        elif timed_out:
            res.update(status="timeout", reason=f"its own timeout of {check.timeout_s:.0f} s")
        elif rc == 0:
            res["status"] = "passed"
        elif rc == 5 and check.kind == "test":
            res.update(status="passed", reason="no tests selected")
            res["problems"].append(f"{check.name}: no tests selected")
        else:
            res.update(status="failed", reason=f"exit status {rc}")
        if check.kind == "bench":
            written = [results_dir / w for w in check.writes] if results_dir else []
            fresh = [p for p in written if p.exists() and p.stat().st_mtime >= t0 - 1]
            res["results"] = [_rel(p) for p in fresh]
            missing = [p.name for p in written if p not in fresh]
            if missing and res["status"] == "passed":
                res.update(status="failed", reason=f"exited 0 but did not write {', '.join(missing)}")
            displaced = _restore(results_dir, before, check.writes, log_dir / "displaced" / check.name)
            if displaced:
                res["displaced"] = displaced
                log.info("%s: restored %s in %s (its versions: %s)", check.name, ", ".join(displaced),
                         results_dir, log_dir / "displaced" / check.name)
        if res["status"] != "passed":
            res["output_tail"] = tail(log_path)
        counts = res.get("counts")
        detail = ", ".join(f"{v} {k}" for k, v in counts.items()) if counts else res.get("reason", "")
        progress(f"[{i}/{n}] {check.name:<16} {res['status']} in {wall:.1f} s (rc {rc})"
                 + (f": {detail}" if detail else ""))
        for p in res["problems"]:
            progress(f"      problem: {p}")
    return records


# ------------------------------------------------------------------------------------------- dry run
def collect(files: Sequence[str], *, child_env: Mapping[str, str] | None = None,
            timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Collect (not run) ``files`` with the selection plugin: one row per test (:func:`classify_item`)."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-collect-") as tmp:
        manifest = Path(tmp) / "manifest.json"
        argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                "-p", "bench.gpu", "--gpu-select", "all", f"--gpu-manifest={manifest}", *files]
        rc, _, timed_out = run_command(argv, timeout_s=timeout_s, log_path=Path(tmp) / "collect.log",
                                       env=child_env)
        if rc != 0 or timed_out or not manifest.exists():
            raise RuntimeError(f"collecting {' '.join(files)} failed (rc {rc}):\n"
                               + tail(Path(tmp) / "collect.log"))
        return json.loads(manifest.read_text())


def check_test_files(checks: Sequence[Check]) -> list[str]:
    """Every test file of the test checks."""
    return sorted({f for c in checks if c.kind == "test" for f in c.files})


def dry_run(checks: Sequence[Check], env: Mapping[str, Any], *, rows: list[dict[str, Any]] | None = None,
            child_env: Mapping[str, str] | None = None,
            progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One record per check, status ``skipped`` with why, and the tests it would run (``rows``:
    :func:`collect` of :func:`check_test_files`, collected here when None)."""
    if rows is None:
        files = check_test_files(checks)
        rows = collect(files, child_env=child_env) if files else []
    records = []
    n = len(checks)
    for i, check in enumerate(checks, 1):
        why = unmet_needs(check, env)
        reason = "dry run: not executed; " + ("; ".join(why) if why else "would run here (all needs met)")
        res: dict[str, Any] = {"name": check.name, "kind": check.kind, "needs": list(check.needs),
                               "timeout_s": check.timeout_s, "expect_s": check.expect_s, "note": check.note,
                               "argv": list(check.argv), "status": "skipped", "reason": reason}
        progress(f"[{i}/{n}] {check.name:<16} skipped: {reason}")
        progress(f"      {check.kind}, needs {'+'.join(check.needs) or 'nothing'}, timeout "
                 f"{check.timeout_s:.0f} s, ~{check.expect_s:.0f} s on one H100; {check.note}")
        progress("      command: " + " ".join(check.argv))
        if check.kind == "test":
            tests = [r for r in rows if r["file"] in check.files
                     and (check.select == "all" or r["category"] == check.select)]
            res["tests"] = tests
            progress(f"      would run {len(tests)} test(s) from {len(check.files)} file(s)")
            if check.select != "rest":
                for r in tests:
                    here = f"skips here: {r['skip_reason']}" if r["skips_here"] else "runs here"
                    progress(f"        {r['id']}  ({here})")
        else:
            res["writes"] = [_rel(RESULTS_DIR / w) for w in check.writes]
            if check.writes:
                progress("      writes: " + ", ".join(f"bench/results/{w}" for w in check.writes))
        records.append(res)
    return records


# ------------------------------------------------------------------------------------------- train-gpu
def train_gpu_standalone(images: int = 2000) -> None:  # pragma: no cover - GPU only
    """:func:`bench.train_gpu.gpu_part` alone, on ``bench.train``'s dataset and NFS stand-in."""
    from bench.common import machine_info, print_machine
    from bench.loader import ensure_dataset
    from bench.train import LATENCY_MS, MBPS
    from bench.train_gpu import gpu_part
    from datacache.config import user_cache_dir

    machine = print_machine(machine_info())
    root = ensure_dataset(images)
    cache_dir = os.path.join(user_cache_dir(), "datacache", "bench", "train-gpu-lmdb")
    shutil.rmtree(cache_dir, ignore_errors=True)
    gpu_part(f"slowfile://{root}", "lmdb://" + cache_dir, {"latency_ms": LATENCY_MS, "mbps": MBPS}, machine)


# ------------------------------------------------------------------------------------------- main
def _child_env(site: Path | None) -> dict[str, str]:
    path = [str(ROOT)] + ([str(site)] if site else []) + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def _write(doc: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="collect what would run, report every check skipped and why; run nothing")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for all checks together (default {DEFAULT_BUDGET_S:.0f})")
    ap.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (names: see --dry-run)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu.json (default bench/results; in a dry run: none, nothing written)")
    ap.add_argument("--export", type=Path, default=None,
                    help="also copy gpu.json, the result files the checks wrote and the logs here "
                         "(DIR/results, DIR/logs); for a machine that sends back only one folder")
    default = DEFAULT_WHEELS.relative_to(ROOT)
    ap.add_argument("--wheels", type=Path, nargs="?", const=DEFAULT_WHEELS, default=None, metavar="DIR",
                    help="install what fails to import from the wheels in DIR (no registry needed) "
                         f"into DIR/site-pyXY, used through PYTHONPATH (DIR default: {default})")
    ap.add_argument("--fetch-wheels", type=Path, nargs="?", const=DEFAULT_WHEELS, default=None,
                    metavar="DIR", help="(run here, with network) download the wheels for the GPU image "
                                        f"into DIR (default {default}) and exit")
    ap.add_argument("--python-version", default="3.12", help="the GPU image's Python, for --fetch-wheels")
    ap.add_argument("--run-train-gpu", action="store_true", help=argparse.SUPPRESS)  # the train-gpu check
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels.resolve(), args.python_version)
    if args.run_train_gpu:
        train_gpu_standalone()
        return 0
    t0 = time.monotonic()
    wheels_report = None
    site: Path | None = None
    if args.wheels:
        site = args.wheels.resolve() / f"site-py{sys.version_info.major}{sys.version_info.minor}"
        try:
            wheels_report = install_wheels(args.wheels.resolve(), site)
        except (OSError, RuntimeError) as e:
            log.error("installing the wheels failed: %s", e)
            return 2
    if not args.dry_run:
        site = ensure_project_metadata(site, [ROOT, *([site] if site else [])]) or site
    for p in (site, ROOT):
        if p and str(p) not in sys.path:
            sys.path.insert(0, str(p))
    child_env = _child_env(site)
    checks = build_checks()
    if args.only:
        unknown = set(args.only) - {c.name for c in checks}
        if unknown:
            known = ", ".join(c.name for c in checks)
            print(f"unknown check(s): {', '.join(sorted(unknown))}; known: {known}", file=sys.stderr)
            return 2
        checks = [c for c in checks if c.name in args.only]
    collecting = None
    if args.dry_run and check_test_files(checks):  # collect while this process imports torch
        pool = ThreadPoolExecutor(1)
        collecting = pool.submit(collect, check_test_files(checks), child_env=child_env)
        pool.shutdown(wait=False)

    from bench.common import machine_info, print_machine

    env = environment()
    machine = print_machine(machine_info())
    doc: dict[str, Any] = {
        "machine": machine, "torch": env.get("torch"), "cuda_build": env.get("cuda_build"),
        "device": env.get("device"), "devices": env.get("devices"), "dali": env.get("dali"),
        "mode": "dry-run" if args.dry_run else "run", "budget_s": args.budget,
        "expected_s": sum(c.expect_s for c in checks),
        "expected_here_s": sum(c.expect_s for c in checks if not unmet_needs(c, env)),
        "wheels": wheels_report}
    print(f"device: {env.get('device') or 'none (no CUDA)'}; torch {env.get('torch')}; {len(checks)} checks, "
          f"~{doc['expected_s']:.0f} s expected on one H100 if all run ({doc['expected_here_s']:.0f} s of "
          f"them can run here), budget {args.budget:.0f} s")
    if args.dry_run:
        try:
            rows = collecting.result() if collecting else []
            doc["checks"] = dry_run(checks, env, rows=rows, child_env=child_env)
        except RuntimeError as e:
            log.error("%s", e)
            return 1
        if args.out:
            _write(doc, args.out / RESULT_FILE)
        return 0
    if not env.get("cuda"):
        print("no CUDA device here: nothing to run (python -m bench.gpu --dry-run lists the checks)",
              file=sys.stderr)
        return 2
    log_dir = (args.export / "logs") if args.export else Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log.info("logs in %s", log_dir)
    records = run_checks(checks, budget_s=args.budget, log_dir=log_dir, env=env, child_env=child_env,
                         results_dir=RESULTS_DIR)
    doc["checks"] = records
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["problems"] = [p for r in records for p in r["problems"]]
    doc["failed"] = [r["name"] for r in records if r["status"] in ("failed", "timeout")]
    doc["not_run"] = [r["name"] for r in records if r["status"] in ("skipped", "not run: budget")]
    doc["stopped"] = [r["name"] for r in records if r["status"] == "stopped: budget"]
    out = (args.out or RESULTS_DIR) / RESULT_FILE
    _write(doc, out)
    if args.export:
        (args.export / "results").mkdir(parents=True, exist_ok=True)
        for f in [out, *(ROOT / p for r in records for p in r.get("results", []))]:
            shutil.copy2(f, args.export / "results" / f.name)
        print(f"exported gpu.json, the result files and the logs to {args.export}")
    print(f"\n{len(records)} checks in {doc['wall_s']:.0f} s: "
          + ", ".join(f"{r['name']} {r['status']}" for r in records))
    for p in doc["problems"]:
        print(f"problem: {p}")
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
