#!/usr/bin/env bash
# A local 3-node datacache cluster in one command: 3 Redis Cluster masters (real redis-server processes
# on 127.0.0.1:PORT..PORT+2, no persistence), one cache daemon per master, and `datacache demo` against it.
#
#   deploy/local-cluster.sh            # = demo: start everything (if not running), run the demo, leave it up
#   deploy/local-cluster.sh up         # start the cluster and the 3 daemons only
#   deploy/local-cluster.sh status     # the daemons' /status (fill per node)
#   deploy/local-cluster.sh down       # stop the daemons and the cluster
#
# Environment: PYTHON (interpreter with datacache installed: ./quickstart.sh demo installs it; default
# python3), PORT (first Redis port, default 7000), DIR (state and logs, default
# /tmp/datacache-local-cluster), IMAGES (size of the generated demo dataset, default 1000),
# MAXMEMORY (per master, default 1gb), HTTP_PORT (first daemon HTTP port, default 8470).
# Extra arguments of `demo` go to `datacache demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PORT="${PORT:-7000}"
DIR="${DIR:-/tmp/datacache-local-cluster}"
IMAGES="${IMAGES:-1000}"
MAXMEMORY="${MAXMEMORY:-1gb}"
HTTP_PORT="${HTTP_PORT:-8470}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
URL="redis+cluster://127.0.0.1:$PORT,127.0.0.1:$((PORT + 1)),127.0.0.1:$((PORT + 2))"
cmd="${1:-demo}"; shift || true

dataset() {
  "$PY" -c "from datacache.demo import DemoConfig, ensure_dataset; print(ensure_dataset(DemoConfig(images=$IMAGES, progress=False)))" | tail -1
}

up() {
  if [ -f "$DIR/cluster.json" ]; then echo "[local-cluster] already up: $URL" >&2; return; fi
  mkdir -p "$DIR"
  "$PY" -m datacache.redis_local up --dir "$DIR" --base-port "$PORT" --maxmemory "$MAXMEMORY" >/dev/null
  local src; src="$(dataset)"
  for i in 0 1 2; do
    "$PY" -m cache_daemon --cache "$URL" --redis-node "127.0.0.1:$((PORT + i))" --node "node-$i" \
      --dataset "$src" --http-port "$((HTTP_PORT + i))" --poll-interval 5 --no-progress \
      >"$DIR/daemon-$i.log" 2>&1 &
    echo $! >"$DIR/daemon-$i.pid"
  done
  echo "[local-cluster] up: $URL; daemons on http://127.0.0.1:$HTTP_PORT..$((HTTP_PORT + 2)) (logs in $DIR)" >&2
}

down() {
  for i in 0 1 2; do
    if [ -f "$DIR/daemon-$i.pid" ]; then
      kill -TERM "$(cat "$DIR/daemon-$i.pid")" 2>/dev/null || true
      rm -f "$DIR/daemon-$i.pid"
    fi
  done
  "$PY" -m datacache.redis_local down --dir "$DIR"
}

status() {
  for i in 0 1 2; do
    "$PY" -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$((HTTP_PORT + i))/status', timeout=5).read().decode())" || true
  done
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  demo)
    up
    src="$(dataset)"
    echo "[local-cluster] datacache demo --source $src --cache $URL $*" >&2
    "$PY" -m datacache.cli demo --source "$src" --cache "$URL" "$@"
    echo "[local-cluster] still running; 'deploy/local-cluster.sh status' shows the fill per node, 'down' stops it" >&2
    ;;
  *) echo "usage: deploy/local-cluster.sh [demo|up|status|down]" >&2; exit 2 ;;
esac
