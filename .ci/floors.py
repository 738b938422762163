"""Check that the dependency floors declared in pyproject.toml are true.

For every requirement ``name>=X`` of the core dependencies and of the extras named in ``EXTRAS``, the
exact floor ``name==X`` is installed (binary wheels only, no dependencies) into a scratch directory
that is put in front of the test interpreter's own packages; then the tests that exercise those
packages run against the floors. A floor that does not install on this Python, or that breaks a test,
fails this check: raise the floor in pyproject.toml to the lowest version that passes.

Not installed here, and why (docs/internals.md says the same):

* ``torch``: its floor comes from an audit of the torch APIs the code calls (e.g.
  ``torch.amp.GradScaler(device)`` needs torch 2.3); the registries reachable here serve no CPU wheel of
  older releases, only CUDA builds of several GB.
* Python itself: ``requires-python`` is the interpreter CI runs on (3.11: ``tomllib``).

Usage: ``python .ci/floors.py [--dir DIR]`` (``.ci/run`` calls it after the test suite).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("redis", "daemon")  # the extras whose floors are installed as well as the core ones
NOT_INSTALLED = {"torch": "floor from an API audit; no CPU wheel of old releases is reachable here"}
TESTS = ["tests/test_record.py", "tests/test_stores.py", "tests/test_manifest.py", "tests/test_decode.py",
         "tests/test_source.py", "tests/test_redis_stores.py", "tests/test_tiered.py", "tests/test_warm.py",
         "tests/test_dataset.py", "tests/test_daemon.py"]
FLOOR = re.compile(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)$")


def declared_floors() -> dict[str, str]:
    """``{name: floor}`` of the core dependencies and ``EXTRAS`` (each must be ``name>=X``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    floors: dict[str, str] = {}
    for req in reqs:
        m = FLOOR.match(req.strip())
        if not m:
            raise SystemExit(f"floors: {req!r} in pyproject.toml has no plain 'name>=X' floor; declare one")
        floors[m.group(1).lower()] = m.group(2)
    return floors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where to install the floors (default: a fresh temporary directory)")
    args = ap.parse_args()
    target = Path(args.dir or tempfile.mkdtemp(prefix="datacache-floors-"))
    floors = declared_floors()
    pins = [f"{n}=={v}" for n, v in sorted(floors.items()) if n not in NOT_INSTALLED]
    for name, why in NOT_INSTALLED.items():
        print(f"[floors] {name}>={floors.get(name, '?')}: not installed ({why})", flush=True)
    print(f"[floors] installing {' '.join(pins)} into {target}", flush=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary", ":all:", "--target",
           str(target), *pins]
    if subprocess.run(pip).returncode != 0:
        print("[floors] a declared floor does not install on this Python (no binary wheel): raise it in "
              "pyproject.toml to the lowest release that installs", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    names = sorted(n for n in floors if n not in NOT_INSTALLED)
    probe = f"import importlib.metadata as m; print(' '.join(f'{{d}}=={{m.version(d)}}' for d in {names!r}))"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)  # what the tests really import
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                          env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
