"""Repository rules that a fresh machine enforces: no bare ``python`` from PATH.

A fresh Debian/Ubuntu machine has only ``python3`` (and it lacks the project's packages: PEP 668);
a test, benchmark or tool that runs ``python`` passes only where someone installed packages by hand.
Every subprocess must run ``sys.executable`` (or the project interpreter of ``./quickstart.sh python``).
CI also shadows ``python`` on PATH with a command that fails (``.ci/run``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
BARE = {"python", "python3"}


def _files(suffix: str) -> list[Path]:
    return [p for p in ROOT.rglob(f"*{suffix}") if not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def _bare_argv(tree: ast.AST) -> list[int]:
    """Lines of calls whose first argument is an argv starting with 'python'/'python3', or a command
    line ``"python ..."`` (``subprocess.run([...])``, ``Popen("python -c ...", shell=True)``,
    ``os.execvp``)."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        a = node.args[0]
        if isinstance(a, (ast.List, ast.Tuple)) and a.elts:
            a = a.elts[0]
        if isinstance(a, ast.Constant) and isinstance(a.value, str) and re.match(r"python3?(\s|$)", a.value):
            out.append(node.lineno)
    return out


def test_no_python_file_runs_a_bare_python() -> None:
    found = []
    for path in _files(".py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found += [f"{path.relative_to(ROOT)}:{line}" for line in _bare_argv(tree)]
    assert not found, f"use sys.executable, not a bare python: {found}"


def test_the_checker_finds_a_bare_python() -> None:  # the rule above would catch the old defect
    old = 'import subprocess\nsubprocess.run(["python", "-c", "print(1)"], check=True)\n'
    assert _bare_argv(ast.parse(old)) == [2]
    good = 'import sys, subprocess\nsubprocess.run([sys.executable, "-c", "1"])\n'
    assert _bare_argv(ast.parse(good)) == []


def test_shell_scripts_use_the_project_interpreter() -> None:
    """Shell scripts call ``$PY``/``$PYTHON`` (resolved like ``./quickstart.sh python``), never ``python``."""
    found = []
    for path in _files(".sh"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = re.sub(r'"[^"]*"|\'[^\']*\'', '""', line.split("#", 1)[0])  # not inside strings
            default = re.search(r":-python3?}", line)  # PY="${PYTHON:-python3}": whatever python3 is
            if "# stdlib-only" in line:  # a stdlib-only module: any python3 runs it (checked below)
                continue
            if (default or re.search(r'(^|[\s;&|(`])python3?(\s|$)', code)) and "BASE_PY" not in code:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, f"shell scripts must use the project interpreter: {found}"


def test_dev_only_tooling_stays_out_of_the_production_import_path() -> None:
    """The NFS stand-in, the synthetic-data generator and the local Redis launcher are dev tooling:
    importing the production modules (library, client, daemon, trainer, CLIs) must not import them.
    ``slowfile://`` still works: fsspec finds it through the package's entry point."""
    import subprocess
    import sys

    code = """
import sys
import datacache, datacache.cli, client.dataset, client.crop, client.augment
import cache_daemon.service, cache_daemon.http, cache_daemon.__main__, trainer.run, trainer.cli
dev = ("datacache.devtools.slowfs", "datacache.devtools.synth", "datacache.devtools.redis_local",
       "datacache.devtools.torchvision_shim", "torchvision", "bench")
print(",".join(m for m in dev if m in sys.modules))
import fsspec
fs = fsspec.filesystem("slowfile", latency_ms=0)
print(type(fs).__module__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, module = out.stdout.splitlines()
    assert imported == "", f"dev-only modules imported by production code: {imported}"
    assert module == "datacache.devtools.slowfs"


def test_stdlib_only_modules_run_on_a_bare_python3() -> None:
    """What local-cluster.sh runs with any python3 (``# stdlib-only``) imports only the standard library:
    run it with ``-S`` (no site-packages at all)."""
    import subprocess
    import sys

    code = "import datacache.devtools.redis_local, datacache.devtools.local_status; print('ok')"
    boot = f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
    out = subprocess.run([sys.executable, "-S", "-c", boot + code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
