"""The two-command quick start (issue 9, item 11): a project-local .venv unless a venv is active."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _base_python() -> str:
    """An interpreter outside any virtual environment (what a fresh machine has)."""
    for name in ("python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        p = os.path.join(sys.base_prefix, "bin", name)
        if os.path.exists(p):
            return p
    pytest.skip("no base interpreter found next to sys.base_prefix")


def _run(workdir: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(workdir, "quickstart.sh"), "python"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_quickstart_creates_reuses_or_respects_a_venv(tmp_path) -> None:
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copy(os.path.join(REPO, "quickstart.sh"), work)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHON"] = _base_python()
    first = _run(str(work), env)
    assert first.returncode == 0, first.stderr
    venv_py = str(work / ".venv" / "bin" / "python")
    assert first.stdout.strip() == venv_py and "creating .venv" in first.stderr
    check = subprocess.run([venv_py, "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                           capture_output=True, text=True)
    assert check.stdout.strip() == "True"
    marker = work / ".venv" / "marker"
    marker.write_text("kept")
    second = _run(str(work), env)
    assert second.stdout.strip() == venv_py and "reusing .venv" in second.stderr and marker.exists()
    # inside an active virtual environment nothing is created: that environment is used
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(os.path.join(REPO, "quickstart.sh"), other)
    third = _run(str(other), {**env, "VIRTUAL_ENV": str(work / ".venv")})
    assert third.returncode == 0 and third.stdout.strip() == venv_py and not (other / ".venv").exists()
    fourth = _run(str(other), {**env, "PYTHON": venv_py})  # python3 itself runs in a venv (not activated)
    assert fourth.returncode == 0 and "active virtual environment" in fourth.stderr
    assert not (other / ".venv").exists()


def test_ci_goes_through_quickstart_and_pins_are_exact() -> None:
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "./quickstart.sh test" in f.read()
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        text = f.read()
    test_extra = re.search(r"^test = \[(.*?)\]", text, re.M | re.S)
    assert test_extra, "no test extra"
    deps = test_extra.group(1)
    assert re.search(r'"ruff==\d+\.\d+\.\d+"', deps), deps  # a new ruff release cannot turn CI red
    assert '"simplejpeg' in deps  # the simplejpeg backend is tested in CI
    with open(os.path.join(REPO, ".gitignore")) as f:
        assert ".venv/" in f.read().split()
    with open(os.path.join(REPO, "quickstart.sh")) as f:
        qs = f.read()
    assert "torch==2.13.0" in qs and "pip install -q torch\n" not in qs
