#!/usr/bin/env bash
# Quick start for a fresh machine. Two commands:
#   ./quickstart.sh demo [ARGS...]   install, then run the main job (`datacache demo`) on the embedded LMDB cache
#   ./quickstart.sh test [ARGS...]   install (with test extras and redis-server), then run ruff + the test suite
# Installs into the current Python environment. It never lets pip pull a CUDA torch:
# when no torch is importable it installs the pinned CPU wheel `torch==2.13.0` first.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
cmd="${1:-demo}"; shift || true

ensure_torch() {
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[quickstart] installing torch==2.13.0 (CPU wheel)"
    "$PY" -m pip install -q torch==2.13.0
  fi
}

ensure_redis() {
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    echo "[quickstart] installing redis-server (apt)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
}

case "$cmd" in
  demo)
    ensure_torch
    "$PY" -m pip install -q -e .
    exec "$PY" -m datacache.cli demo "$@"
    ;;
  test)
    ensure_torch
    ensure_redis
    "$PY" -m pip install -q -e '.[test]'
    "$PY" -m ruff check .
    exec "$PY" -m pytest -q "$@"
    ;;
  *)
    echo "usage: ./quickstart.sh demo|test [ARGS...]" >&2; exit 2;;
esac
