"""Wheels for the GPU image (``python -m bench.gpu --fetch-wheels / --wheels``): which packages the
project needs there, downloading them here for the image's Python, installing only what fails to import
into a ``--target`` folder (never over the image's torch), and the project's entry points where it is not
installed. Split from :mod:`bench.gpu`, which runs the checks."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.gpu")

# wheels for the GPU image: pyproject's runtime dependencies plus what the checks import
WHEEL_EXTRA_ROOTS = ("pytest", "pytest-timeout", "matplotlib", "redis")
WHEEL_EXCLUDE = ("torch",)  # the image's own CUDA build: never shadowed
# torch's CUDA wheels need glibc >= 2.28, so manylinux_2_28 wheels (numpy, pillow) install there too
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
CARRY_LIMIT_MIB = 64  # what the device tool carries along with the work tree


def _project() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins(python_version: str = "3.12") -> list[str]:
    """``name==version`` (this venv's versions) for the closure of pyproject's runtime dependencies and
    :data:`WHEEL_EXTRA_ROOTS`, dependency markers evaluated for Linux x86-64 CPython ``python_version``;
    torch excluded. A dependency not installed here is listed unpinned (with a warning)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    marker_env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "extra": ""}
    todo = [Requirement(r) for r in _project()["dependencies"]] + [Requirement(r) for r in WHEEL_EXTRA_ROOTS]
    pins: dict[str, str] = {}
    while todo:
        req = todo.pop(0)
        name = _canon(req.name)
        if name in pins or name in WHEEL_EXCLUDE or (req.marker and not req.marker.evaluate(marker_env)):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            log.warning("%s is not installed here: fetched unpinned", req.name)
            pins[name] = str(req.name)
            continue
        pins[name] = f"{name}=={dist.version}"
        for r in dist.requires or []:
            dep = Requirement(r)
            if dep.marker is None or dep.marker.evaluate(marker_env):
                todo.append(dep)
    return sorted(pins.values())


def fetch_wheels(dest: Path, python_version: str = "3.12") -> int:
    """Download :func:`wheel_pins` as binary wheels for the GPU image into ``dest`` (here, with network)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = wheel_pins(python_version)
    base = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version",
            python_version, *[a for p in WHEEL_PLATFORMS for a in ("--platform", p)], "--no-deps",
            "-d", str(dest)]
    log.info("fetching %d wheels into %s: %s", len(pins), dest, " ".join(pins))
    failed = []
    # one call; on a failure, one by one to name the culprits
    if subprocess.run([*base, *pins]).returncode != 0:
        for pin in pins:
            if subprocess.run([*base, pin], capture_output=True).returncode != 0:
                failed.append(pin)
    (dest / "pins.txt").write_text("\n".join(pins) + "\n")
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size:.1f} MiB in {dest}")
    if size > CARRY_LIMIT_MIB - 4:
        log.warning("%.1f MiB: close to or over the device tool's %d MiB carry limit", size, CARRY_LIMIT_MIB)
    if failed:
        log.error("could not fetch: %s", ", ".join(failed))
        return 1
    shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
    print(f"on the GPU box, from the repository root: python -m bench.gpu --wheels {shown}")
    return 0


def wheel_modules(wheel: Path) -> list[str]:
    """The top-level import names a wheel's files provide (its ``top_level.txt`` can be stale: lmdb's
    names ``cpython``, xxhash's ``_xxhash``, neither importable)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    mods = set()
    for n in names:
        first, _, rest = n.partition("/")
        if n.endswith("/") or first.endswith((".dist-info", ".data")):  # folder entries name no module
            continue
        mods.add(first if rest else first.split(".", 1)[0])  # a package folder, or a module file
    return sorted(m for m in mods if m.isidentifier() and m != "__pycache__")


def failing_imports(modules: Iterable[str], path: Sequence[Path | str] = ()) -> dict[str, str]:
    """Which of ``modules`` fail to import in a fresh interpreter with ``path`` in front of sys.path."""
    code = ("import importlib, json, sys\nbad = {}\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as e:\n"
            "        bad[m] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(bad))\n")
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                         env=_pythonpath(path), timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"import probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _unpack_wheel(wheel: Path, site: Path) -> None:
    """Install without pip: a wheel is a zip of site-packages (``*.data/{purelib,platlib}`` moved up)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode)


def install_wheels(wheels_dir: Path, site: Path, *, use_pip: bool | None = None) -> dict[str, Any]:
    """Install into ``site`` (a ``--target`` folder, never the interpreter's site-packages) the wheels of
    ``wheels_dir`` whose modules fail to import; ``--no-index --no-deps``. ``use_pip=None``: pip when
    ``python -m pip`` works, else unzip."""
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {wheels_dir} (fetch them first: --fetch-wheels {wheels_dir})")
    mods = {w: wheel_modules(w) for w in wheels}
    bad = failing_imports(sorted({m for ms in mods.values() for m in ms}), [site, ROOT])
    need = [w for w in wheels if any(m in bad for m in mods[w])]
    report: dict[str, Any] = {"dir": str(wheels_dir), "site": str(site), "wheels": len(wheels),
                              "failed_to_import": bad, "installed": [w.name for w in need]}
    if not need:
        log.info("wheels: every module of the %d wheels in %s imports: nothing to install", len(wheels),
                 wheels_dir)
        return report
    site.mkdir(parents=True, exist_ok=True)
    log.info("wheels: %s fail to import: installing %s into %s", ", ".join(sorted(bad)),
             ", ".join(w.name for w in need), site)
    if use_pip is None:
        probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
        use_pip = probe.returncode == 0
    if use_pip:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels_dir),
               "--no-deps", "--upgrade", "--target", str(site), *map(str, need)]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
        if done.returncode != 0:
            raise RuntimeError(f"pip install into {site} failed:\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-2000:]}")
    else:
        for w in need:
            _unpack_wheel(w, site)
    report["method"] = "pip" if use_pip else "unzip"
    still = failing_imports(sorted({m for w in need for m in mods[w]}), [site, ROOT])
    if still:
        report["still_failing"] = still
        log.warning("wheels: still failing to import after the install: %s", still)
    return report


def _pythonpath(path: Sequence[Path | str]) -> dict[str, str]:
    parts = [*map(str, path), *[p for p in [os.environ.get("PYTHONPATH")] if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}


def ensure_project_metadata(site: Path | None, path: Sequence[Path] = ()) -> Path | None:
    """``slowfile://`` (the NFS stand-in) is found by fsspec through the package's entry point, which
    exists only where the project is installed: without it, write a minimal ``datacache`` dist-info
    (pyproject's entry points) into ``site`` (a new temporary folder when None). Returns the folder
    written to, None when nothing was needed."""
    code = ("from importlib.metadata import entry_points\n"
            "print(any(e.name == 'slowfile' for e in entry_points(group='fsspec.specs')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_pythonpath(path),
                         timeout=120)
    if out.stdout.strip() == "True":
        return None
    site = site or Path(tempfile.mkdtemp(prefix="bench-gpu-site-"))
    info = write_project_metadata(site)
    log.info("wrote %s: the project's entry points (fsspec finds slowfile:// through them)", info)
    return site


def write_project_metadata(site: Path) -> Path:
    """A minimal ``<name>-<version>.dist-info`` (METADATA, entry_points.txt from pyproject) in ``site``."""
    proj = _project()
    info = site / f"{proj['name']}-{proj['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\n"
                                   f"Version: {proj['version']}\n")
    groups = {"console_scripts": proj.get("scripts", {}), **proj.get("entry-points", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    return info
