#!/usr/bin/env bash
# A local 3-node datacache cluster in one command: 3 Redis Cluster masters (real redis-server processes
# on 127.0.0.1:PORT..PORT+2, no persistence), one cache daemon per master, and `datacache demo` against it.
#
#   deploy/local-cluster.sh            # = demo: start what is not running, run the demo, leave it up
#   deploy/local-cluster.sh up         # start the cluster and the 3 daemons only (restarts what died)
#   deploy/local-cluster.sh status     # one line per node (redis, daemon health, fill); --json: full JSON
#   deploy/local-cluster.sh down       # stop the daemons and the cluster, remove the files it wrote
#
# Environment: PYTHON (interpreter; default: the one `./quickstart.sh python` picks, i.e. the active
# venv or the project's .venv; the [daemon] extra is pip-installed into it when missing), PORT (first
# Redis port, default 7000), DIR (state and logs, default ${TMPDIR:-/tmp}/datacache-local-cluster-<uid>;
# must be yours, not writable by others, and new, empty or made by an earlier `up`: nothing else in it
# is ever touched, and no symlink in it is written through), IMAGES (size of the generated
# demo dataset, default 1000), MAXMEMORY (per master, default 1gb), HTTP_PORT (first daemon HTTP port,
# default 8470), HEALTH_WAIT (seconds to wait for each daemon's /health, default 60), DOWN_WAIT (seconds
# `down` lets a daemon drain after SIGTERM before it kills its process group, default 30).
# Extra arguments of `demo` go to `datacache demo`.
#
# No password-less access: the masters run with the default user off and three ACL roles (admin,
# datacache-daemon for the daemons, datacache for trainers; deploy/redis/redis.conf says what each may
# do). Their random passwords live in $DIR/secrets/<role>.pass (mode 0600, directory 0700; made by the
# first `up`, reused later, removed by `down`). Every URL names its file, never the password:
#   redis+cluster://datacache@127.0.0.1:7000,...?password_file=$DIR/secrets/datacache.pass
# (`up` prints it; so does `python -m datacache.devtools.redis_local url --dir $DIR --role datacache`).
set -euo pipefail
# noclobber: `>` never truncates an existing file, and never writes through a symlink (bash opens a new
# file with O_EXCL); every file this script writes is removed first (rm removes a link, not its target)
set -o noclobber
cd "$(dirname "$0")/.."
PORT="${PORT:-7000}"
# per user, as redis_local's default_dir (python's tempfile.gettempdir() honours TMPDIR the same way)
DIR="${DIR:-${TMPDIR:-/tmp}/datacache-local-cluster-$(id -u)}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac  # absolute: the URLs' password_file= must not depend on cwd
IMAGES="${IMAGES:-1000}"
MAXMEMORY="${MAXMEMORY:-1gb}"
HTTP_PORT="${HTTP_PORT:-8470}"
HEALTH_WAIT="${HEALTH_WAIT:-60}"
DOWN_WAIT="${DOWN_WAIT:-30}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cmd="${1:-demo}"; shift || true

say() { echo "[local-cluster] $*" >&2; }
die() { say "$*"; exit 1; }

pick_python() {
  # the interpreter ./quickstart.sh uses (same rules: active venv, else the project's .venv);
  # PYTHON=... overrides it
  if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; else PY="$(./quickstart.sh python)"; fi
}

ensure_deps() {
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "installing torch==2.13.0 (CPU wheel) into $PY"  # as ./quickstart.sh: never a CUDA torch
    "$PY" -m pip install -q torch==2.13.0
  fi
  if ! "$PY" -c "import datacache, PIL, redis, prometheus_client" >/dev/null 2>&1; then
    say "installing datacache with the [daemon] extra (redis, prometheus_client) into $PY"
    "$PY" -m pip install -q -e ".[daemon]"
  fi
  if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      say "installing redis-server (apt-get)"
      apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
      die "redis-server / redis-cli not found: run 'sudo apt-get install redis-server' (or put them on PATH), then retry"
    fi
  fi
}

# the cluster's URL for a role: user@hosts?password_file=$DIR/secrets/<role>.pass (no password in it)
role_url() {
  "$PY" -m datacache.devtools.redis_local url --dir "$DIR" --base-port "$PORT" --role "$1"
}

dataset() {
  "$PY" -c "from datacache.demo import DemoConfig, ensure_dataset; print(ensure_dataset(DemoConfig(images=$IMAGES, progress=False)))" | tail -1
}

# a daemon counts as running when its recorded pid is alive, is OURS (-O: /proc/PID owned by this
# user), runs cache_daemon and writes to node $1's log in this DIR (its stdout): never a reused pid or
# one someone wrote into the pid file, which `down` would otherwise signal
daemon_alive() {
  local f="$DIR/daemon-$1.pid" pid dir
  [ -f "$f" ] && [ ! -L "$f" ] || return 1
  pid="$(head -c 20 "$f")"
  case "$pid" in ''|*[!0-9]*) return 1 ;; esac
  [ "$pid" -gt 1 ] && [ -O "/proc/$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "cache_daemon" || return 1
  dir="$(cd "$DIR" 2>/dev/null && pwd -P)" || return 1
  [ "$(readlink "/proc/$pid/fd/1" 2>/dev/null)" = "$dir/daemon-$1.log" ]
}

# a file this script is about to (re)write in DIR: refused when it is a symlink or not a regular file
# (never written through, never truncated), else removed so noclobber's O_EXCL open creates it afresh
fresh_file() {
  if [ -L "$1" ] || { [ -e "$1" ] && [ ! -f "$1" ]; }; then
    die "$1 is a symbolic link or not a regular file: refusing to write through it (remove it)"
  fi
  rm -f "$1"
}

daemon_healthy() {
  "$PY" -c "import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:$((HTTP_PORT + $1))/health', timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)"
}

# wait for daemon $1's /health; if it exits or never answers, show its log tail and fail
wait_daemon() {
  local i="$1" deadline=$((SECONDS + HEALTH_WAIT)) pid
  pid="$(head -c 20 "$DIR/daemon-$i.pid" 2>/dev/null || echo 0)"
  while [ "$SECONDS" -lt "$deadline" ]; do
    # alive = the process we started still exists (kill -0). daemon_alive's cmdline check would race
    # here: between the fork and setsid's exec, our child's cmdline is still this script's
    if ! kill -0 "$pid" 2>/dev/null; then
      say "daemon node-$i exited at start; the end of $DIR/daemon-$i.log:"
      tail -n 20 "$DIR/daemon-$i.log" >&2 || true
      rm -f "$DIR/daemon-$i.pid"
      return 1
    fi
    if daemon_healthy "$i"; then return 0; fi
    sleep 0.5
  done
  say "daemon node-$i did not answer http://127.0.0.1:$((HTTP_PORT + i))/health within ${HEALTH_WAIT} s; the end of $DIR/daemon-$i.log:"
  tail -n 20 "$DIR/daemon-$i.log" >&2 || true
  return 1
}

up() {
  pick_python
  ensure_deps
  # redis_local refuses a DIR it did not create (non-empty without its marker) and restarts dead masters
  "$PY" -m datacache.devtools.redis_local up --dir "$DIR" --base-port "$PORT" --maxmemory "$MAXMEMORY" >/dev/null
  local src started=() i daemon_url
  daemon_url="$(role_url datacache-daemon)"
  for i in 0 1 2; do
    daemon_alive "$i" && continue
    fresh_file "$DIR/daemon-$i.log"  # before anything slow: a planted link stops the start at once
    fresh_file "$DIR/daemon-$i.pid"
    [ -n "${src:-}" ] || src="$(dataset)"
    # setsid: each daemon leads its own process group (with its decode pool), so `down` can kill the
    # whole group if a drain hangs, and a Ctrl-C in this terminal does not reach it
    # the URL names the daemons' password file: nothing secret on this command line (ps shows it)
    setsid "$PY" -m cache_daemon --cache "$daemon_url" --redis-node "127.0.0.1:$((PORT + i))" --node "node-$i" \
      --dataset "$src" --http-port "$((HTTP_PORT + i))" --poll-interval 5 --no-progress \
      >"$DIR/daemon-$i.log" 2>&1 &
    echo $! >"$DIR/daemon-$i.pid"
    started+=("$i")
  done
  local failed=0
  for i in 0 1 2; do
    wait_daemon "$i" || failed=1
  done
  [ "$failed" = 0 ] || die "not up: a cache daemon failed (see above); 'deploy/local-cluster.sh down' stops the rest"
  local url
  url="$(role_url datacache)"
  if [ "${#started[@]}" = 0 ]; then
    say "already up: $url; daemons on http://127.0.0.1:$HTTP_PORT..$((HTTP_PORT + 2))"
  else
    say "up: $url; daemons on http://127.0.0.1:$HTTP_PORT..$((HTTP_PORT + 2)) (started node ${started[*]}; logs in $DIR)"
  fi
}

# down and status need only the standard library (redis_local, local_status): any python3 will do, and
# they must not create or install anything
down() {
  PY="${PYTHON:-python3}"  # stdlib-only: redis_local/local_status import nothing else (tested)
  local i pid
  for i in 0 1 2; do
    if daemon_alive "$i"; then
      pid="$(head -c 20 "$DIR/daemon-$i.pid")"  # proven ours by daemon_alive
      kill -TERM "$pid" 2>/dev/null || true  # SIGTERM drains: chunks in flight are written, then it exits
      for _ in $(seq $((DOWN_WAIT * 10))); do daemon_alive "$i" || break; sleep 0.1; done
      if daemon_alive "$i"; then
        say "daemon node-$i did not exit within ${DOWN_WAIT} s of SIGTERM: killing its process group"
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
    # only the files up wrote, and only in a DIR that up claimed (it holds redis_local's marker) and
    # that is ours (-O: owned by this user; redis_local down refuses, in one line, any other)
    if [ ! -L "$DIR" ] && [ -O "$DIR" ] && [ -f "$DIR/.datacache-local-cluster" ] \
        && [ ! -L "$DIR/.datacache-local-cluster" ] && [ -O "$DIR/.datacache-local-cluster" ]; then
      rm -f "$DIR/daemon-$i.pid" "$DIR/daemon-$i.log"
    fi
  done
  "$PY" -m datacache.devtools.redis_local down --dir "$DIR"
}

status() {
  PY="${PYTHON:-python3}"  # stdlib-only: redis_local/local_status import nothing else (tested)
  "$PY" -m datacache.devtools.redis_local status --dir "$DIR" --base-port "$PORT" --http-port "$HTTP_PORT" "$@"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status "$@" ;;
  demo)
    up
    src="$(dataset)"
    url="$(role_url datacache)"  # the trainers' role: reads, writes back samples, no registry writes
    say "datacache demo --source $src --cache $url $*"
    "$PY" -m datacache.cli demo --source "$src" --cache "$url" "$@"
    say "still running; 'deploy/local-cluster.sh status' shows the fill per node, 'down' stops it"
    ;;
  *) echo "usage: deploy/local-cluster.sh [demo|up|status [--json]|down]" >&2; exit 2 ;;
esac
