#!/usr/bin/env bash
# Quick start for a fresh machine. Two commands:
#   ./quickstart.sh demo [ARGS...]   install, then run the main job (`datacache demo`) on the embedded LMDB cache
#   ./quickstart.sh test [ARGS...]   install (with test extras and redis-server), then run ruff + the test suite
#                                    (EXTRAS=dali also installs DALI, so its CPU tests run instead of skipping)
#   ./quickstart.sh python           print the interpreter the two commands use (creates .venv if needed)
#
# Where it installs: into the active virtual environment when there is one (VIRTUAL_ENV is set,
# or `python3` itself runs inside a venv: sys.prefix != sys.base_prefix); otherwise into a
# project-local .venv, created on first use and reused afterwards. So it works on Debian 12 /
# Ubuntu 24.04 system Python (PEP 668 "externally managed"), where pip refuses to install into
# the system interpreter. PYTHON=/path/to/python3 picks the interpreter that creates the venv.
# It never lets pip pull a CUDA torch: the pinned CPU wheel `torch==2.13.0` is installed first.
set -euo pipefail
cd "$(dirname "$0")"
BASE_PY="${PYTHON:-python3}"
cmd="${1:-demo}"; shift || true

in_venv() {
  [ -n "${VIRTUAL_ENV:-}" ] || "$BASE_PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'
}

ensure_python() {
  if in_venv; then
    PY="$(command -v "$BASE_PY")"
    [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ] && PY="$VIRTUAL_ENV/bin/python"
    echo "[quickstart] using the active virtual environment: $PY" >&2
    return
  fi
  if [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "[quickstart] reusing .venv" >&2
  else
    echo "[quickstart] creating .venv with $BASE_PY" >&2
    rm -rf .venv
    if ! "$BASE_PY" -m venv .venv >/dev/null 2>&1; then
      # Debian/Ubuntu ship venv's ensurepip separately (python3-venv / python3.X-venv)
      ver="$("$BASE_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
      echo "[quickstart] '$BASE_PY -m venv' failed; installing python3-venv (apt)" >&2
      if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
      rm -rf .venv
      $SUDO apt-get update -qq && { $SUDO apt-get install -y -qq "python${ver}-venv" >/dev/null 2>&1 ||
                                    $SUDO apt-get install -y -qq python3-venv >/dev/null; }
      "$BASE_PY" -m venv .venv
    fi
  fi
  PY="$PWD/.venv/bin/python"
}

ensure_torch() {
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[quickstart] installing torch==2.13.0 (CPU wheel)" >&2
    "$PY" -m pip install -q torch==2.13.0
  fi
}

ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    echo "[quickstart] installing redis-server (apt)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
}

ensure_fashion() {
  # Zalando's Fashion-MNIST (MIT, 30 MB) for the real-data tests; the tests skip with the command where
  # neither root nor sudo can install it
  if [ ! -d /usr/share/datasets/fashion-mnist ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else return 0; fi
    echo "[quickstart] installing dataset-fashion-mnist (apt)" >&2
    $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 ||
      { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null; } ||
      echo "[quickstart] could not install dataset-fashion-mnist; its tests will skip" >&2
  fi
}

case "$cmd" in
  python)
    ensure_python
    echo "$PY"
    ;;
  demo)
    ensure_python
    ensure_torch
    "$PY" -m pip install -q -e .
    exec "$PY" -m datacache.cli demo "$@"
    ;;
  test)
    ensure_python
    ensure_torch
    ensure_redis
    ensure_fashion
    # EXTRAS=dali adds DALI's CPU decoder tests (nvidia-dali-cuda120, ~1 GB installed; CI sets it)
    "$PY" -m pip install -q -e ".[test${EXTRAS:+,$EXTRAS}]"
    "$PY" -m ruff check .
    # in parallel (pytest-xdist; docs/internals.md, "The test suite"): DATACACHE_TEST_WORKERS workers
    # (default 3: on 2 cores most tests wait on processes, servers and rendezvous), --dist loadgroup so
    # the tests sharing a module-scoped server stay on one worker. Naming -n or -p no:xdist yourself
    # (e.g. `./quickstart.sh test -p no:xdist` for a serial run) replaces this default.
    par=(-n "${DATACACHE_TEST_WORKERS:-3}" --dist loadgroup)
    for a in "$@"; do
      case "$a" in -n|-n*|--numprocesses*|no:xdist|-pno:xdist) par=();; esac
    done
    exec "$PY" -m pytest -q "${par[@]}" "$@"
    ;;
  *)
    echo "usage: ./quickstart.sh demo|test|python [ARGS...]" >&2; exit 2;;
esac
