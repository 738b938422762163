"""``python -m bench.gpu``: the dry run (what CI can check without a GPU: every check listed and
skipped for want of CUDA, the CUDA test files it names really hold CUDA-only tests), and the runner's
parts on tiny stand-ins: junit parsing, the budget, timeouts that kill a process group, restoring the
result files a benchmark rewrote, installing wheels without a registry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from bench import gpu, gpu_wheels
from bench.gpu import Check

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# the CUDA test files known when bench.gpu was written: its discovery must keep finding them
KNOWN_CUDA_FILES = {f"tests/test_{n}.py" for n in ("prefetch", "train_dist", "comm_safety", "selectors",
                                                   "crop", "comm_overlap", "fake_cuda")}


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The dry run and, at the same time, a plain ``pytest --collect-only -q`` of the CUDA test files."""
    out = tmp_path_factory.mktemp("dry")
    files = gpu.cuda_test_files()
    results = gpu.RESULTS_DIR / gpu.RESULT_FILE
    before = results.read_bytes() if results.exists() else None
    run = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out)], cwd=REPO,
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    col = subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            *files], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    stdout, stderr = run.communicate(timeout=240)
    col_out, col_err = col.communicate(timeout=240)
    assert col.returncode == 0, col_out[-2000:] + col_err[-2000:]
    after = results.read_bytes() if results.exists() else None
    return {"rc": run.returncode, "stdout": stdout, "stderr": stderr, "files": files,
            "doc": json.loads((out / gpu.RESULT_FILE).read_text()) if run.returncode == 0 else None,
            "collected": [ln for ln in col_out.splitlines() if "::" in ln],
            "results_untouched": before == after}


def _check(dry: dict, name: str) -> dict:
    return next(c for c in dry["doc"]["checks"] if c["name"] == name)


def test_dry_run_lists_every_check_skipped_for_want_of_cuda(dry: dict) -> None:
    assert dry["rc"] == 0, dry["stdout"][-3000:] + dry["stderr"][-3000:]
    doc = dry["doc"]
    assert doc["mode"] == "dry-run" and doc["device"] is None and doc["machine"]["cuda"] is None
    names = [c.name for c in gpu.build_checks()]
    assert [c["name"] for c in doc["checks"]] == names
    assert {"cuda-tests", "nccl-multi-gpu", "dali", "topk", "train-gpu", "train-quick"} <= set(names)
    for c in doc["checks"]:
        assert c["status"] == "skipped" and re.search(r"no CUDA|no GPU", c["reason"]), c
        assert c["argv"][0] == sys.executable, c  # never a bare python
        assert re.search(rf"\] {re.escape(c['name'])} +skipped: .*no CUDA here", dry["stdout"]), c["name"]
    assert dry["results_untouched"], "a dry run must not write bench/results/gpu.json"


def test_the_cuda_test_files_hold_cuda_only_tests(dry: dict) -> None:
    """Each file the dry run names has tests (plain --collect-only) and CUDA-only tests among them, which
    skip here for want of CUDA and carry a CUDA skip in their own source."""
    cuda, multi = _check(dry, "cuda-tests"), _check(dry, "nccl-multi-gpu")
    files = [a for a in cuda["argv"] if a.endswith(".py")]
    assert files == dry["files"] and set(files) >= KNOWN_CUDA_FILES
    collected = set(dry["collected"])
    selected = cuda["tests"] + multi["tests"]
    for f in files:
        assert any(i.startswith(f + "::") for i in collected), f
        mine = [t for t in selected if t["file"] == f]
        assert mine, f"{f}: no CUDA-only test selected"
        source = (REPO / f).read_text(encoding="utf-8")
        for t in mine:
            assert t["id"] in collected, t
            assert t["skips_here"] and re.search(r"\b(CUDA|GPU)", t["skip_reason"], re.I), t
            name = t["id"].split("::")[-1].split("[")[0]
            decorators = source[:source.index(f"def {name}(")].rsplit("\n\n", 1)[-1]
            assert re.search("cuda", decorators, re.I), (t["id"], decorators)
    assert all(t["category"] == "cuda" for t in cuda["tests"])
    nccl = "tests/test_comm_safety.py::test_replicas_bit_identical_on_cuda"
    assert nccl in {t["id"] for t in multi["tests"]}
    rest = {t["id"] for t in _check(dry, "cuda-files-rest")["tests"]}
    assert rest and not rest & {t["id"] for t in selected} and rest | {t["id"] for t in selected} == collected
    dali = _check(dry, "dali")["tests"]
    assert "tests/test_dali.py::test_dali_gpu_mixed_decoder_matches_pillow" in {t["id"] for t in dali}


def test_parse_junit_and_node_ids(tmp_path: Path) -> None:
    xml = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.test_a" name="test_ok" time="0.5" />
<testcase classname="tests.test_a" name="test_bad[1-x]" time="1.25">
  <failure message="assert 1 == 2">tb</failure></testcase>
<testcase classname="tests.test_b" name="test_gpu" time="0"><skipped type="pytest.skip"
 message="no CUDA device on this machine">tests/test_b.py:3: no CUDA device on this machine</skipped>
</testcase>
<testcase classname="tests.test_b.TestK" name="test_m" time="0.1"><error message="fixture boom">e</error>
</testcase>
<testcase classname="tests.sub.test_c" name="test_x" time="0"><skipped type="pytest.xfail" message="later" />
</testcase>
<testcase classname="tests.test_b" name="test_also_ok" time="0.2"><system-out>hello</system-out></testcase>
</testsuite></testsuites>"""
    path = tmp_path / "j.xml"
    path.write_text(xml)
    got = [(o.id, o.outcome, o.message) for o in gpu.parse_junit(path)]
    assert got == [("tests/test_a.py::test_ok", "passed", ""),
                   ("tests/test_a.py::test_bad[1-x]", "failed", "assert 1 == 2"),
                   ("tests/test_b.py::test_gpu", "skipped", "no CUDA device on this machine"),
                   ("tests/test_b.py::TestK::test_m", "error", "fixture boom"),
                   ("tests/sub/test_c.py::test_x", "xfailed", "later"),
                   ("tests/test_b.py::test_also_ok", "passed", "")]
    assert [o.id for o in gpu.parse_junit(xml)] == [g[0] for g in got]  # the text itself works too
    assert gpu.parse_junit(path)[1].time_s == 1.25


def test_skip_reasons_sort_tests_into_categories() -> None:
    cat = gpu.reason_category
    assert cat(["no CUDA device on this machine"]) == "cuda"
    assert cat(["pinned memory needs a CUDA device"]) == "cuda"
    assert cat(["no CUDA GPU on this machine: DALI's mixed (nvJPEG) decoder needs one"]) == "cuda"
    assert cat(["needs 2+ CUDA devices (NCCL ranks need one each)"]) == "multi"
    assert cat(["nvidia-dali-cuda120 is not installed (pip install 'datacache[dali]')"]) == "rest"
    assert cat(["Debian's dataset-fashion-mnist is not installed"]) == cat([]) == "rest"


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_budget_cuts_the_rest_and_kills_the_whole_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    slow = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(20)\n")
    checks = [Check("slow", "bench", _py(slow), needs=(), timeout_s=30, min_s=0),
              Check("later", "bench", _py("pass"), needs=(), min_s=0),
              Check("gpu-only", "bench", _py("pass")),
              Check("last", "test", _py("pass"), needs=(), min_s=0)]
    lines: list[str] = []
    t0 = time.monotonic()
    recs = gpu.run_checks(checks, budget_s=2.0, log_dir=tmp_path, env={"cuda": False, "torch": "x"},
                          progress=lines.append)
    assert time.monotonic() - t0 < 15
    assert [r["status"] for r in recs] == ["stopped: budget", "not run: budget", "skipped", "not run: budget"]
    assert "budget ran out" in recs[0]["reason"] and recs[0]["wall_s"] < 12
    assert "KeyboardInterrupt" in recs[0]["output_tail"]  # SIGINT first: Python says where it was
    assert "no CUDA here" in recs[2]["reason"]
    for _ in range(50):  # the grandchild went with its group
        if _gone(int(pidfile.read_text())):
            break
        time.sleep(0.1)
    assert _gone(int(pidfile.read_text()))
    # one line per check, two for the one that ran
    assert len([ln for ln in lines if ln.startswith("[")]) == 5


def test_outcomes_timeouts_and_output_tails(tmp_path: Path) -> None:
    checks = [Check("ok", "bench", _py("print('fine')"), needs=()),
              Check("bad", "bench", _py("import sys; print('went wrong'); sys.exit(3)"), needs=()),
              Check("hangs", "bench", _py("import time; print('waiting', flush=True); time.sleep(30)"),
                    needs=(), timeout_s=1.0, min_s=0)]
    recs = gpu.run_checks(checks, budget_s=120, log_dir=tmp_path, env={}, progress=lambda _: None)
    ok, bad, hangs = recs
    assert (ok["status"], ok["rc"]) == ("passed", 0) and "output_tail" not in ok
    assert (bad["status"], bad["rc"]) == ("failed", 3) and "went wrong" in bad["output_tail"]
    assert hangs["status"] == "timeout" and "own timeout" in hangs["reason"]
    assert "waiting" in hangs["output_tail"]
    assert Path(ok["log"]).read_text().strip() == "fine"


FAKE_TESTS = """
import pytest

HERE = True  # stands for "no CUDA here"


@pytest.mark.skipif(HERE, reason="no CUDA device on this machine")
def test_gpu_only():
    pass


@pytest.mark.skipif(False, reason="needs a CUDA device")
def test_gpu_runs():
    pass


@pytest.mark.skipif(False, reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1])
def test_gpu_fails(n):
    assert n == 2, "wrong on the GPU"


@pytest.mark.skipif(HERE, reason="needs 2+ CUDA devices (NCCL ranks need one each)")
def test_multi():
    pass


def test_cpu():
    pass
"""


def test_a_test_check_reports_each_test_and_the_cuda_tests_that_still_skip(tmp_path: Path) -> None:
    """The selection plugin, junit and manifest end to end on a stand-in test file whose 'CUDA' tests
    run, fail or skip: a CUDA test that skips where the check runs is a problem, named with its reason."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake_gpu.py").write_text(FAKE_TESTS)
    files = ("tests/test_fake_gpu.py",)
    checks = [Check("cuda", "test", gpu.selection_argv(files, "cuda"), needs=(), files=files, select="cuda"),
              Check("rest", "test", gpu.selection_argv(files, "rest"), needs=(), files=files, select="rest")]
    cuda, rest = gpu.run_checks(checks, budget_s=120, log_dir=tmp_path / "logs", env={}, child_env=ENV,
                                cwd=tmp_path, progress=lambda _: None)
    outcome = {t["id"].split("::")[-1]: (t["outcome"], t.get("message", "")) for t in cuda["tests"]}
    assert outcome == {"test_gpu_only": ("skipped", "no CUDA device on this machine"),
                       "test_gpu_runs": ("passed", ""),
                       "test_gpu_fails[1]": ("failed", outcome["test_gpu_fails[1]"][1])}
    assert "wrong on the GPU" in outcome["test_gpu_fails[1]"][1]
    assert (cuda["status"], cuda["rc"]) == ("failed", 1) and "not_reported" not in cuda
    assert cuda["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert len(cuda["problems"]) == 1 and cuda["problems"][0].startswith("skipped on a GPU: ")
    assert cuda["problems"][0].endswith("test_gpu_only: no CUDA device on this machine")
    assert all(t["category"] == "cuda" for t in cuda["tests"])
    assert (rest["status"], [t["id"].split("::")[-1] for t in rest["tests"]]) == ("passed", ["test_cpu"])
    assert rest["problems"] == []


def test_a_benchmark_keeps_only_its_own_result_files(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "x_gpu.json").write_text("old gpu")
    (results / "x.json").write_text("committed cpu")
    (results / "y.json").write_text("untouched")
    code = (f"from pathlib import Path\nd = Path({str(results)!r})\n"
            "(d / 'x_gpu.json').write_text('new gpu')\n(d / 'x.json').write_text('gpu box cpu')\n"
            "(d / 'x_quick.json').write_text('smoke')\n")
    check = Check("x", "bench", _py(code), needs=(), writes=("x_gpu.json", "x_gpu.png"))
    (rec,) = gpu.run_checks([check], budget_s=60, log_dir=tmp_path / "logs", env={}, results_dir=results,
                            progress=lambda _: None)
    assert rec["status"] == "failed" and "x_gpu.png" in rec["reason"]  # exited 0 without all it owns
    assert rec["results"] == [str(results / "x_gpu.json")]
    assert sorted(p.name for p in results.iterdir()) == ["x.json", "x_gpu.json", "y.json"]
    assert (results / "x.json").read_text() == "committed cpu"
    assert (results / "x_gpu.json").read_text() == "new gpu"
    assert sorted(rec["displaced"]) == ["x.json", "x_quick.json"]
    assert (tmp_path / "logs" / "displaced" / "x" / "x.json").read_text() == "gpu box cpu"


def test_a_run_writes_gpu_json_and_exports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path of ``main`` with the device and the checks stood in for: gpu.json names the device and
    each check's outcome; --export gets it, the files the benchmarks own and the logs."""
    results = tmp_path / "results"
    results.mkdir()
    code = f"from pathlib import Path\n(Path({str(results)!r}) / 'z_gpu.json').write_text('{{}}')\n"
    checks = [Check("z", "bench", _py(code), writes=("z_gpu.json",)),
              Check("pair", "test", _py("pass"), needs=("cuda", "multi-gpu"))]
    monkeypatch.setattr(gpu, "RESULTS_DIR", results)
    monkeypatch.setattr(gpu, "build_checks", lambda: checks)
    monkeypatch.setattr(gpu, "environment", lambda: {"torch": "2.11.0+cu128", "cuda": True, "device_count": 1,
                                                     "devices": ["NVIDIA H100 80GB HBM3"],
                                                     "device": "NVIDIA H100 80GB HBM3", "dali": False})
    assert gpu.main(["--export", str(tmp_path / "out"), "--budget", "60"]) == 0
    doc = json.loads((results / "gpu.json").read_text())
    assert doc["mode"] == "run" and doc["device"] == "NVIDIA H100 80GB HBM3" and doc["failed"] == []
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [("z", "passed"), ("pair", "skipped")]
    assert doc["checks"][1]["reason"] == "needs 2+ CUDA devices, 1 visible" and doc["not_run"] == ["pair"]
    assert doc["checks"][0]["results"] == [str(results / "z_gpu.json")]
    assert sorted(p.name for p in (tmp_path / "out" / "results").iterdir()) == ["gpu.json", "z_gpu.json"]
    assert (tmp_path / "out" / "logs" / "z.log").exists()


def _fake_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench_gpu_fake_pkg-1.0-py3-none-any.whl"
    di = "bench_gpu_fake_pkg-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("bench_gpu_fake_pkg/__init__.py", "VALUE = 42\n")
        z.writestr(f"{di}/METADATA", "Metadata-Version: 2.1\nName: bench_gpu_fake_pkg\nVersion: 1.0\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                                  "Tag: py3-none-any\n")
        z.writestr(f"{di}/top_level.txt", "bench_gpu_fake_pkg\n")
        z.writestr(f"{di}/RECORD", f"bench_gpu_fake_pkg/__init__.py,,\n{di}/METADATA,,\n{di}/WHEEL,,\n"
                                   f"{di}/top_level.txt,,\n{di}/RECORD,,\n")
    return path


@pytest.mark.parametrize("use_pip", [True, False])
def test_install_wheels_installs_only_what_fails_to_import(tmp_path: Path, use_pip: bool) -> None:
    wheel = _fake_wheel(tmp_path / "wheels")
    assert gpu_wheels.wheel_modules(wheel) == ["bench_gpu_fake_pkg"]
    site = tmp_path / "site"
    rep = gpu_wheels.install_wheels(tmp_path / "wheels", site, use_pip=use_pip)
    assert rep["installed"] == [wheel.name] and rep["method"] == ("pip" if use_pip else "unzip")
    assert "still_failing" not in rep
    out = subprocess.run([sys.executable, "-c", "import bench_gpu_fake_pkg as m; print(m.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "42", out.stderr
    assert gpu_wheels.install_wheels(tmp_path / "wheels", site)["installed"] == []  # imports now


def test_project_metadata_gives_fsspec_the_slowfile_entry_point(tmp_path: Path) -> None:
    from importlib import metadata

    info = gpu_wheels.write_project_metadata(tmp_path)
    (dist,) = metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "datacache" and info.name.endswith(".dist-info")
    eps = {e.name: e.value for e in dist.entry_points if e.group == "fsspec.specs"}
    assert eps == {"slowfile": "datacache.devtools.slowfs:SlowFileSystem"}
    assert gpu_wheels.ensure_project_metadata(None, [REPO]) is None  # installed here: nothing written


def test_wheel_pins_cover_what_the_gpu_image_lacks() -> None:
    from importlib import metadata

    pins = dict(p.split("==") for p in gpu_wheels.wheel_pins("3.12"))
    for name in ("lmdb", "msgpack", "xxhash", "redis", "pytest", "pytest-timeout", "matplotlib", "numpy"):
        assert pins[name] == metadata.version(name), name
    assert "torch" not in pins and not any(n.startswith("nvidia") for n in pins)


def test_help_explains_itself() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu", "--help"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for word in ("--dry-run", "--fetch-wheels", "--wheels", "--budget", "--export", "gpu.json", "cuda-tests"):
        assert word in out.stdout, word
