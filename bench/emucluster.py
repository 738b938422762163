"""An emulated N-node datacache cluster on one machine: network namespaces, shaped links, real services.

``sudo python -m bench.emucluster up [--rate-gbit 1 | --fast] [--dir D] [--images N]`` builds:

* a "switch" namespace ``dce-<tag>-sw`` holding a bridge ``dce<tag>br`` (nothing in the host's
  namespace is created or touched);
* per node ``i`` a namespace ``dce-<tag>-n<i>`` with its own address ``10.214.X.(i+1)/24`` on a veth
  ``dce<tag>n<i>`` whose peer ``dce<tag>s<i>`` sits on the bridge. Both directions of the node's link
  are capped with a ``tbf`` qdisc: the node side's egress (node -> switch) and the switch side's egress
  (switch -> node). ``--fast`` leaves the links unshaped. This kernel has no ``netem``: no delay is
  added; the veths add only their own few tens of microseconds;
* per node a Redis Cluster master bound to the node's address (``deploy/redis/redis.conf`` filled per
  node: port, bind, ``cluster-announce-ip``, and the SHA-256 hashes of three generated passwords in place
  of the template's placeholders -- a placeholder left over is refused), the three formed into one
  cluster with ``redis-cli --cluster create`` as ``admin`` run inside node 0's namespace;
* per node a ``datacache-daemon`` (``sys.executable -m cache_daemon``; ``deploy/daemon.toml`` filled per
  node: node name, cache URL as the ``datacache-daemon`` role, ``redis_node``, datasets; the file mode
  0600) whose HTTP listens on the loopback inside its own namespace. Trainers get the ``datacache``
  role's URL (:meth:`EmuCluster.cache_url`, ``node_env``'s ``EMUCLUSTER_CACHE_URL``).

The NFS stand-in is ``slowfile://`` (:mod:`datacache.devtools.slowfs`): namespaces share the filesystem, so
every node reads the same files through it (``--images N`` generates one under ``D/dataset-N``).

``status`` prints per node: redis alive, cluster state, daemon ``/health`` (queried from inside the
node's namespace); ``counters`` the veths' byte counters; ``links`` one TCP stream's rate per link.
``down`` stops every process in our namespaces and deletes them; ``--cleanup`` does the same for
leftovers of any run (only names starting with ``dce-`` / ``dce``). ``up`` tears down what it built
when it fails or is interrupted (atexit + SIGINT/SIGTERM/SIGHUP handlers).

State (tag, names, addresses, passwords, ports) lives in ``D/emucluster.json`` next to a marker file
``D/.datacache-emucluster``; a directory with other content and no marker is refused.

Library use (benches, tests)::

    with EmuCluster(EmuConfig(rate_gbit=1.0, images=60, state_dir=d)) as c:
        c.run_on(0, [sys.executable, "train.py"])   # in node 0's namespace, GLOO_SOCKET_IFNAME set
        c.link_counters()                           # per-node veth byte counters

Network safety: every address this module connects to (or hands to a process it starts) is checked
with :func:`bench.netns.check_target` against the node addresses; the /24 is drawn from
10.214.0.0/16, never overlapping a network of the host, and exists only inside our namespaces.
Needs root and iproute2 (``ip``, ``tc``), ``redis-server`` and ``redis-cli``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from bench.netns import check_target
from datacache.redis_roles import ADMIN, DAEMON, TRAINER, RolesError, fill_template

PREFIX = "dce-"   # namespace names: dce-<tag>-n<i>, dce-<tag>-sw (distinct from bench.netns's "dc-")
IF_PREFIX = "dce"  # interface names: dce<tag>n<i>, dce<tag>s<i>, dce<tag>br (IFNAMSIZ: 15 chars)
POOL = ipaddress.ip_network("10.214.0.0/16")  # the /24 is drawn from here (bench.netns uses 10.213/16)
MARKER = ".datacache-emucluster"
STATE = "emucluster.json"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REDIS_TEMPLATE = os.path.join(REPO, "deploy", "redis", "redis.conf")
DAEMON_TEMPLATE = os.path.join(REPO, "deploy", "daemon.toml")
DEFAULT_DIR = "/tmp/datacache-emucluster"
MAX_NODES = 16


class EmuError(RuntimeError):
    """A clear one-line reason why the emulated cluster could not be built, queried or removed."""


def _run(cmd: Sequence[str], *, check: bool = True, timeout: float = 60.0,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                           env=None if env is None else dict(env))
    except FileNotFoundError:
        raise EmuError(f"{cmd[0]}: not installed (needs iproute2, redis-server, redis-cli)") from None
    except subprocess.TimeoutExpired:
        raise EmuError(f"command timed out after {timeout:g} s: {' '.join(cmd[:6])} ...") from None
    if check and r.returncode != 0:
        err = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise EmuError(f"command failed ({r.returncode}): {' '.join(cmd)}: {err[-1] if err else ''}")
    return r


def why_unavailable() -> str | None:
    """Why namespaces cannot be built here (for tests to skip), or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    missing = [b for b in ("ip", "tc", "redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, redis-server)"
    return None


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class EmuConfig:
    """What ``up`` builds. ``rate_gbit=None`` = fast mode (unshaped links)."""

    state_dir: str = DEFAULT_DIR
    nodes: int = 3
    rate_gbit: float | None = 1.0
    redis_port: int = 7000
    http_port: int = 8470
    maxmemory: str = "256mb"
    images: int = 0                       # > 0: generate a dataset of about this many JPEGs
    datasets: tuple[str, ...] = ()        # extra dataset sources for the daemons
    short_side: int = 64
    workers: int = 1                      # decode processes per daemon (the machine is shared)
    poll_interval: float = 2.0
    redis_template: str = REDIS_TEMPLATE
    daemon_template: str = DAEMON_TEMPLATE
    timeout: float = 60.0                 # seconds for each wait (redis up, cluster ok, daemon healthy)

    def __post_init__(self) -> None:
        if not 3 <= self.nodes <= MAX_NODES:  # a Redis Cluster needs 3 masters
            raise EmuError(f"nodes must be 3..{MAX_NODES} (a Redis Cluster needs 3 masters), "
                           f"got {self.nodes}")
        if self.rate_gbit is not None and not self.rate_gbit > 0:
            raise EmuError(f"rate_gbit must be > 0 Gbit/s (or use fast mode), got {self.rate_gbit}")
        for name, port in (("redis_port", self.redis_port), ("http_port", self.http_port)):
            if not 1 <= port <= 65535:
                raise EmuError(f"{name} must be 1..65535, got {port}")
        if self.redis_port + 10000 > 65535:
            raise EmuError(f"redis_port {self.redis_port}: its cluster bus port (+10000) exceeds 65535; "
                           "use a port <= 55535")
        if self.http_port in (self.redis_port, self.redis_port + 10000):
            raise EmuError(f"http_port {self.http_port} collides with the redis port or its bus port")
        if self.images < 0 or self.workers < 0 or self.short_side < 1 or self.poll_interval <= 0:
            raise EmuError("images and workers must be >= 0, short_side >= 1, poll_interval > 0")


# ---------------------------------------------------------------------------------------------- helpers
def _pick_subnet() -> ipaddress.IPv4Network:
    used = []
    for line in _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    for _ in range(200):
        net = ipaddress.ip_network(f"10.214.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net  # type: ignore[return-value]
    raise EmuError(f"no /24 in {POOL} is free of the host's networks")


def fill_redis_conf(template: str, *, addr: str, port: int, workdir: str, maxmemory: str,
                    admin_pass: str, user_pass: str, daemon_pass: str) -> str:
    """The redis.conf template with this node's settings: the roles' placeholder password hashes replaced
    by the hashes of ``admin_pass`` / ``daemon_pass`` (datacache-daemon) / ``user_pass`` (datacache), then
    port/bind/announce/... appended (a later directive overrides an earlier one in redis.conf). A template
    without the placeholders, or with one left after filling, is an EmuError."""
    with open(template) as f:
        text = f.read()
    try:
        text = fill_template(text, {ADMIN: admin_pass, DAEMON: daemon_pass, TRAINER: user_pass},
                             where=template)
    except RolesError as e:
        raise EmuError(str(e)) from None
    return text + (
        "\n# ---- bench/emucluster.py: this node's settings (override the template's lines above)\n"
        f"port {port}\nbind {addr}\ncluster-announce-ip {addr}\n"
        f"cluster-config-file nodes-{port}.conf\ndir {workdir}\nmaxmemory {maxmemory}\n"
        "daemonize no\nlogfile \"\"\n")


def _toml_scalar(key: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "[" + ", ".join(json.dumps(x) for x in v) + "]"  # e.g. allowed_sources
    raise EmuError(f"daemon template: key {key!r} has a value of type {type(v).__name__} that "
                   "bench/emucluster.py cannot write back (scalars, lists of strings and [[datasets]] "
                   "tables only)")


def fill_daemon_toml(template: str, overrides: Mapping[str, Any],
                     datasets: Sequence[Mapping[str, Any]]) -> str:
    """The daemon.toml template with ``overrides`` set and its ``[[datasets]]`` replaced by ``datasets``."""
    try:
        with open(template, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise EmuError(f"{template}: cannot read the daemon template ({type(e).__name__})") from None
    raw.pop("datasets", None)
    raw.update(overrides)
    lines = ["# written by bench/emucluster.py from " + template]
    lines += [f"{k} = {_toml_scalar(k, v)}" for k, v in raw.items()]
    for d in datasets:
        lines += ["", "[[datasets]]"] + [f"{k} = {_toml_scalar(k, v)}" for k, v in d.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- cluster
class EmuCluster:
    """The emulated cluster; see the module docstring. ``state`` is what ``emucluster.json`` holds."""

    def __init__(self, cfg: EmuConfig | None = None, *, state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg or EmuConfig()
        self.state: dict[str, Any] = state or {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: dict[int, str] = {}  # pid of a service this object started -> its log
        self._old_handlers: dict[int, Any] = {}
        self._armed = False
        self._down_lock = threading.Lock()

    # ------------------------------------------------------------------ names
    @property
    def dir(self) -> str:
        return str(self.state.get("dir", self.cfg.state_dir))

    @property
    def addrs(self) -> list[str]:
        return list(self.state["addrs"])

    def ns(self, node: int) -> str:
        return str(self.state["namespaces"][node])

    def ifname(self, node: int) -> str:
        """The node-side veth (inside the node's namespace): GLOO_SOCKET_IFNAME for its ranks."""
        return str(self.state["ifnames"][node])

    def check_target(self, addr: str) -> str:
        return check_target(addr, self.addrs)

    def redis_addr(self, node: int) -> str:
        return f"{self.check_target(self.addrs[node])}:{self.state['redis_port']}"

    def cache_url(self, *, user: str = TRAINER) -> str:
        """``redis+cluster://`` URL of the cluster as ``user``: ``datacache`` (trainers, the default),
        ``datacache-daemon`` (the daemons) or ``admin``."""
        key = {TRAINER: "user_pass", DAEMON: "daemon_pass", ADMIN: "admin_pass"}.get(user)
        if key is None:
            raise EmuError(f"no role {user!r}: choose one of {TRAINER}, {DAEMON}, {ADMIN}")
        pw = self.state[key]
        return f"redis+cluster://{user}:{pw}@" + ",".join(self.redis_addr(i) for i in range(len(self.addrs)))

    # ------------------------------------------------------------------ state dir
    def _prepare_dir(self) -> None:
        d = self.cfg.state_dir
        if os.path.isdir(d) and os.listdir(d) and not os.path.exists(os.path.join(d, MARKER)):
            raise EmuError(f"{d}: exists, is not empty and was not made by bench/emucluster.py "
                           f"(no {MARKER}); pick another --dir")
        if os.path.exists(os.path.join(d, STATE)):
            raise EmuError(f"{d}: an emulated cluster is already up (run 'down --dir {d}' first)")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, MARKER), "w") as f:
            f.write("made by bench/emucluster.py; 'python -m bench.emucluster down' removes what it made\n")

    def _save(self) -> None:
        path = os.path.join(self.dir, STATE)
        tmp = path + ".tmp"
        # the state holds the cluster's passwords: owner-only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.state, f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: str = DEFAULT_DIR) -> EmuCluster:
        """The cluster that ``up`` left running in ``state_dir``."""
        path = os.path.join(state_dir, STATE)
        if not os.path.exists(os.path.join(state_dir, MARKER)):
            raise EmuError(f"{state_dir}: no emulated cluster here (no {MARKER})")
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            raise EmuError(f"{state_dir}: no emulated cluster is up (no {STATE})") from None
        except json.JSONDecodeError:
            raise EmuError(f"{path}: not valid JSON; use 'down --cleanup' to remove leftovers") from None
        tag = str(state.get("tag", ""))
        names = [*state.get("namespaces", []), state.get("switch", "")]
        if not all(isinstance(n, str) and n.startswith(f"{PREFIX}{tag}-") for n in names) or not tag:
            raise EmuError(f"{path}: namespace names do not carry our prefix {PREFIX}{tag}-; "
                           "refusing to use it")
        net = ipaddress.ip_network(state.get("subnet", "0.0.0.0/32"))
        if not net.subnet_of(POOL) or not all(ipaddress.ip_address(a) in net for a in state.get("addrs", [])):
            raise EmuError(f"{path}: addresses outside {POOL}; refusing to use them")
        return cls(EmuConfig(state_dir=state_dir), state=state)

    # ------------------------------------------------------------------ lifecycle
    def _arm(self) -> None:
        """Tear down on interpreter exit and on SIGINT/SIGTERM/SIGHUP until disarmed (see :meth:`up`)."""
        atexit.register(self.down)
        # signal handlers can only be installed from the main thread; elsewhere only atexit covers us
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._armed = True

    def disarm(self) -> None:
        """Leave the cluster running when this process exits (the CLI's ``up`` does this on success)."""
        with contextlib.suppress(ValueError):
            atexit.unregister(self.down)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        self._armed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # runs in the main thread between bytecodes: down() is idempotent and guarded by a lock
        self.down()
        raise SystemExit(128 + signum)

    def up(self) -> EmuCluster:
        """Build everything; on any failure (or a signal) tear down what was built, then re-raise."""
        why = why_unavailable()
        if why:
            raise EmuError(f"cannot build the emulated cluster: {why}")
        cfg = self.cfg
        self._prepare_dir()
        sources = self._datasets()  # before any namespace exists: nothing to undo if it fails
        tag = secrets.token_hex(3)
        net = _pick_subnet()
        hosts = list(net.hosts())
        self.state = {
            "dir": os.path.abspath(cfg.state_dir), "tag": tag, "subnet": str(net),
            "switch": f"{PREFIX}{tag}-sw", "bridge": f"{IF_PREFIX}{tag}br",
            "namespaces": [f"{PREFIX}{tag}-n{i}" for i in range(cfg.nodes)],
            "ifnames": [f"{IF_PREFIX}{tag}n{i}" for i in range(cfg.nodes)],
            "switch_ifnames": [f"{IF_PREFIX}{tag}s{i}" for i in range(cfg.nodes)],
            "addrs": [str(hosts[i]) for i in range(cfg.nodes)],
            "rate_gbit": cfg.rate_gbit, "redis_port": cfg.redis_port, "http_port": cfg.http_port,
            "admin_pass": secrets.token_hex(16), "user_pass": secrets.token_hex(16),
            "daemon_pass": secrets.token_hex(16),
            "created": [], "pids": {}, "datasets": sources, "up": False,
        }
        self._arm()
        try:
            self._save()
            self._build_network()
            self._start_redis()
            self._create_cluster()
            self._start_daemons()
            self.state["up"] = True
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _datasets(self) -> list[str]:
        cfg = self.cfg
        sources = list(cfg.datasets)
        if cfg.images > 0:
            from datacache.devtools.synth import make_imagefolder

            root = os.path.join(os.path.abspath(cfg.state_dir), f"dataset-{cfg.images}")
            if not os.path.isdir(root):
                classes = min(10, cfg.images)
                tmp = root + ".tmp"
                shutil.rmtree(tmp, ignore_errors=True)  # ours: a half-written dataset of a killed run
                make_imagefolder(tmp, classes=classes, per_class=max(1, cfg.images // classes),
                                 size=(160, 120))
                os.replace(tmp, root)
            sources.append(f"slowfile://{root}")  # the NFS stand-in, reached from every namespace
        return sources

    def _build_network(self) -> None:
        s = self.state
        sw, br = s["switch"], s["bridge"]
        _run(["ip", "netns", "add", sw])
        s["created"].append(sw)
        self._save()
        _run(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", br, "up"])
        for i, (ns, ifn, sif, addr) in enumerate(zip(s["namespaces"], s["ifnames"], s["switch_ifnames"],
                                                     s["addrs"])):
            _run(["ip", "netns", "add", ns])
            s["created"].append(ns)
            self._save()
            # both ends are created directly inside our namespaces: nothing appears in the host's
            _run(["ip", "-n", ns, "link", "add", ifn, "type", "veth", "peer", "name", sif, "netns", sw])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{ipaddress.ip_network(s['subnet']).prefixlen}",
                  "dev", ifn])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", ifn, "up"])
            _run(["ip", "-n", sw, "link", "set", sif, "master", br])
            _run(["ip", "-n", sw, "link", "set", sif, "up"])
            if s["rate_gbit"] is not None:
                self._shape(i, float(s["rate_gbit"]))

    def _shape(self, node: int, rate_gbit: float) -> None:
        """tbf on both directions of node's link (burst: 4 ms of traffic, >= 128 KiB, as bench.netns)."""
        rate_bytes = rate_gbit * 1e9 / 8
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        for ns, dev in ((self.ns(node), self.ifname(node)),
                        (self.state["switch"], self.state["switch_ifnames"][node])):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                  "rate", f"{int(rate_gbit * 1000)}mbit", "burst", str(burst), "latency", "50ms"])

    def set_rate(self, rate_gbit: float | None) -> None:
        """Re-shape every link to ``rate_gbit`` (both directions); ``None``: unshaped (fast mode)."""
        if rate_gbit is not None and not rate_gbit > 0:
            raise EmuError(f"rate must be > 0 Gbit/s (or None: unshaped), got {rate_gbit}")
        for i in range(len(self.addrs)):
            if rate_gbit is None:
                for ns, dev in ((self.ns(i), self.ifname(i)),
                                (self.state["switch"], self.state["switch_ifnames"][i])):
                    # check=False: a link that was never shaped has no root qdisc to delete
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                self._shape(i, rate_gbit)
        self.state["rate_gbit"] = rate_gbit
        self._save()

    def _spawn(self, node: int, argv: Sequence[str], log: str, env: Mapping[str, str] | None = None) -> int:
        with open(log, "ab") as out:
            # start_new_session: the services outlive `up` and a Ctrl-C on its terminal reaches only `up`
            # (whose handler then stops them explicitly); 'ip netns exec' execs, so the pid is the service's
            p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        self._procs.append(p)
        self._logs[p.pid] = log
        self.state["pids"].setdefault(str(node), []).append(p.pid)
        self._save()
        return p.pid

    def redis_cli(self, node: int, *args: str, timeout: float = 10.0, check: bool = False
                  ) -> subprocess.CompletedProcess[str]:
        """``redis-cli`` as the admin user against node's master, run inside node's namespace (the
        password goes through REDISCLI_AUTH, not the command line that ``ps`` shows)."""
        host = self.check_target(self.addrs[node])
        return _run(["ip", "netns", "exec", self.ns(node), "redis-cli", "-h", host,
                     "-p", str(self.state["redis_port"]), "--user", "admin", "--no-auth-warning", *args],
                    check=check, timeout=timeout,
                    env={**os.environ, "REDISCLI_AUTH": self.state["admin_pass"]})

    def _start_redis(self) -> None:
        s = self.state
        for i, addr in enumerate(self.addrs):
            wd = os.path.join(self.dir, f"node{i}")
            shutil.rmtree(wd, ignore_errors=True)  # ours (under our marked dir): a previous run's node
            os.makedirs(wd)
            conf = os.path.join(wd, "redis.conf")
            text = fill_redis_conf(self.cfg.redis_template, addr=self.check_target(addr),
                                   port=s["redis_port"], workdir=wd, maxmemory=self.cfg.maxmemory,
                                   admin_pass=s["admin_pass"], user_pass=s["user_pass"],
                                   daemon_pass=s["daemon_pass"])
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds passwords
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self._spawn(i, ["redis-server", conf], os.path.join(wd, "redis.log"))
        for i in range(len(self.addrs)):
            self._wait(lambda i=i: self.redis_cli(i, "ping").stdout.strip() == "PONG",
                       f"redis on node {i} ({self.redis_addr(i)}) did not answer PING", os.path.join(
                           self.dir, f"node{i}", "redis.log"), node=i)

    def _wait(self, ok: Any, what: str, log: str, node: int) -> None:
        deadline = time.monotonic() + self.cfg.timeout
        while time.monotonic() < deadline:
            if ok():
                return
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.2)
        dead_procs = [p for p in self._procs if p.poll() is not None]
        if dead_procs:  # a service that exited says why in ITS log (another node's, maybe: they start alike)
            log = self._logs.get(dead_procs[0].pid, log)
        tail = ""
        with contextlib.suppress(OSError), open(log, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
            tail = lines[-1][:300] if lines else ""
        dead = [p.args[4] for p in dead_procs]
        raise EmuError(f"{what} within {self.cfg.timeout:g} s" + (f" ({dead[0]} exited)" if dead else "")
                       + (f"; last log line of {log}: {tail}" if tail else ""))

    def _create_cluster(self) -> None:
        r = self.redis_cli(0, "--cluster", "create", *[self.redis_addr(i) for i in range(len(self.addrs))],
                           "--cluster-yes", timeout=60)
        if "All 16384 slots covered" not in r.stdout:
            last = (r.stderr.strip() or r.stdout.strip()).splitlines()
            raise EmuError(f"redis-cli --cluster create failed: {last[-1] if last else r.returncode}")
        for i in range(len(self.addrs)):
            self._wait(lambda i=i: "cluster_state:ok" in self.redis_cli(i, "cluster", "info").stdout,
                       f"node {i} did not report cluster_state:ok", os.path.join(self.dir, f"node{i}",
                                                                                 "redis.log"), node=i)

    def _daemon_env(self) -> dict[str, str]:
        # the daemon reads DATACACHE_DAEMON_* overrides: ours come from the filled TOML, not this shell
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_DAEMON_")}
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def _start_daemons(self) -> None:
        s = self.state
        url = self.cache_url(user=DAEMON)  # the daemons' role: fill reports and the registry
        datasets = [{"source": src, "short_side": self.cfg.short_side} for src in s["datasets"]]
        for i in range(len(self.addrs)):
            wd = os.path.join(self.dir, f"node{i}")
            conf = os.path.join(wd, "daemon.toml")
            text = fill_daemon_toml(self.cfg.daemon_template, {
                "node": f"node-{i}", "cache": url, "redis_node": self.redis_addr(i), "ownership": "cluster",
                "workers": self.cfg.workers, "http_host": "127.0.0.1", "http_port": s["http_port"],
                "poll_interval": self.cfg.poll_interval, "t1_dir": os.path.join(wd, "t1")}, datasets)
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the cache password
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self._spawn(i, [sys.executable, "-m", "cache_daemon", "--config", conf, "--no-progress"],
                        os.path.join(wd, "daemon.log"), env=self._daemon_env())
        for i in range(len(self.addrs)):
            self._wait(lambda i=i: self.daemon_health(i) is True,
                       f"daemon on node {i} did not become healthy",
                       os.path.join(self.dir, f"node{i}", "daemon.log"), node=i)

    # ------------------------------------------------------------------ faults (tests, benches)
    def _service_pid(self, node: int, which: int) -> int:
        if not 0 <= node < len(self.addrs):
            raise EmuError(f"node must be 0..{len(self.addrs) - 1}, got {node}")
        return int(self.state["pids"][str(node)][which])

    def _kill(self, node: int, which: int, sig: int) -> None:
        pid = self._service_pid(node, which)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        for p in self._procs:  # our child (library use): reap it so the pid is really gone
            if p.pid == pid:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(15)
        # forget it: _wait() gives up early when one of self._procs has exited
        self._procs = [p for p in self._procs if p.pid != pid]

    def _respawn(self, node: int, which: int, argv: Sequence[str], log: str,
                 env: Mapping[str, str] | None = None) -> int:
        pid = self._spawn(node, argv, log, env)
        pids = self.state["pids"][str(node)]
        pids[which] = pids.pop()  # _spawn appended the new pid: it replaces the dead one in its slot
        self._save()
        return pid

    def kill_master(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Kill ``node``'s redis-server (SIGKILL by default: a crash, nothing flushed)."""
        self._kill(node, 0, sig)

    def restart_master(self, node: int) -> int:
        """Start ``node``'s redis-server again from its config. Its ``nodes-PORT.conf`` is kept, so it
        rejoins the cluster with its id and slots, empty (the template persists nothing). Waits until the
        node answers PING and reports ``cluster_state:ok``; returns the new pid."""
        wd = os.path.join(self.dir, f"node{node}")
        pid = self._respawn(node, 0, ["redis-server", os.path.join(wd, "redis.conf")],
                            os.path.join(wd, "redis.log"))
        self._wait(lambda: "cluster_state:ok" in self.redis_cli(node, "cluster", "info").stdout,
                   f"restarted redis on node {node} did not report cluster_state:ok",
                   os.path.join(wd, "redis.log"), node=node)
        return pid

    def kill_daemon(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Kill ``node``'s datacache-daemon (SIGKILL by default: no shutdown path runs)."""
        self._kill(node, 1, sig)

    def restart_daemon(self, node: int) -> int:
        """Start ``node``'s daemon again with its config; waits for ``/health``; returns the new pid."""
        wd = os.path.join(self.dir, f"node{node}")
        pid = self._respawn(node, 1, [sys.executable, "-m", "cache_daemon", "--config",
                                      os.path.join(wd, "daemon.toml"), "--no-progress"],
                            os.path.join(wd, "daemon.log"), env=self._daemon_env())
        self._wait(lambda: self.daemon_health(node) is True, f"restarted daemon on node {node} did not "
                   "become healthy", os.path.join(wd, "daemon.log"), node=node)
        return pid

    def link_down(self, node: int) -> None:
        """Cut ``node``'s link (its veth, node side, set down): the node reaches nobody and nobody reaches
        it. Its processes keep running; 127.0.0.1 in it (its daemon's HTTP) keeps answering."""
        self._service_pid(node, 0)  # checks the node number
        _run(["ip", "-n", self.ns(node), "link", "set", self.ifname(node), "down"])

    def link_up(self, node: int) -> None:
        """Restore ``node``'s link (the address and tbf qdisc stay configured while it is down)."""
        self._service_pid(node, 0)
        _run(["ip", "-n", self.ns(node), "link", "set", self.ifname(node), "up"])

    # ------------------------------------------------------------------ queries
    def daemon_get(self, node: int, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        """GET the daemon's ``path`` from inside node's namespace (its HTTP is on that loopback)."""
        code = ("import json, sys, urllib.request, urllib.error\n"
                "try:\n"
                f"    r = urllib.request.urlopen('http://127.0.0.1:{int(self.state['http_port'])}{path}', "
                f"timeout={timeout})\n"
                "    print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n"
                "    print(e.code); print(e.read().decode())\n"
                "except OSError as e:\n"
                "    print(0); print(json.dumps({'error': str(e)}))\n")
        r = _run(["ip", "netns", "exec", self.ns(node), sys.executable, "-c", code], check=False,
                 timeout=timeout + 20)
        head, _, body = r.stdout.partition("\n")
        try:
            return int(head), json.loads(body) if body.strip() else None
        except ValueError:
            return 0, {"error": (r.stderr.strip().splitlines() or ["no answer"])[-1]}

    def daemon_health(self, node: int) -> bool | None:
        code, body = self.daemon_get(node, "/health")
        return None if code == 0 else bool(code == 200 and isinstance(body, dict) and body.get("ok"))

    def status(self) -> list[dict[str, Any]]:
        """Per node: namespace, address, redis alive, cluster state, daemon /health."""
        out = []
        for i, addr in enumerate(self.addrs):
            alive = self.redis_cli(i, "ping", timeout=5).stdout.strip() == "PONG"
            info = self.redis_cli(i, "cluster", "info", timeout=5).stdout if alive else ""
            state = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                          if ln.startswith("cluster_state:")), "unknown")
            health = self.daemon_health(i)
            out.append({"node": i, "namespace": self.ns(i), "addr": addr, "redis": alive,
                        "cluster_state": state, "daemon_health": health,
                        "ok": bool(alive and state == "ok" and health)})
        return out

    def cluster_masters(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` masters as seen from node 0: addr and number of slots served."""
        out = []
        for ln in self.redis_cli(0, "cluster", "nodes", check=True).stdout.splitlines():
            parts = ln.split()
            if len(parts) < 8 or "master" not in parts[2].split(","):
                continue
            slots = 0
            for r in parts[8:]:
                if r.startswith("["):
                    continue  # a slot being migrated
                lo, _, hi = r.partition("-")
                slots += int(hi or lo) - int(lo) + 1
            out.append({"addr": parts[1].split("@")[0], "slots": slots})
        return out

    def link_counters(self) -> dict[int, dict[str, int]]:
        """Per node, its veth's byte/packet counters (``tx`` = node -> switch, ``rx`` = switch -> node)."""
        out = {}
        for i in range(len(self.addrs)):
            r = _run(["ip", "-j", "-s", "-n", self.ns(i), "link", "show", "dev", self.ifname(i)])
            st = json.loads(r.stdout)[0]["stats64"]
            out[i] = {"rx_bytes": int(st["rx"]["bytes"]), "tx_bytes": int(st["tx"]["bytes"]),
                      "rx_packets": int(st["rx"]["packets"]), "tx_packets": int(st["tx"]["packets"])}
        return out

    def node_env(self, node: int) -> dict[str, str]:
        """What a training rank on ``node`` needs: gloo's interface, the rendezvous address, the cache."""
        return {"GLOO_SOCKET_IFNAME": self.ifname(node), "NCCL_SOCKET_IFNAME": self.ifname(node),
                "MASTER_ADDR": self.check_target(self.addrs[0]), "NODE_RANK": str(node),
                "NNODES": str(len(self.addrs)), "EMUCLUSTER_NODE_ADDR": self.addrs[node],
                "EMUCLUSTER_CACHE_URL": self.cache_url()}

    def run_on(self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
               **popen_kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``node``'s namespace with os.environ + repo on PYTHONPATH + :meth:`node_env`
        + ``env``. The caller owns (waits for) the process; ``down`` kills whatever is left in the namespace.
        For ``torchrun --nnodes N --node-rank node --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:PORT``."""
        if not 0 <= node < len(self.addrs):
            raise EmuError(f"node must be 0..{len(self.addrs) - 1}, got {node}")
        full = {**self._daemon_env(), **self.node_env(node), **(env or {})}
        return subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=full, **popen_kw)

    def torchrun_argv(self, node: int, script_argv: Sequence[str], *, nproc_per_node: int = 1,
                      rdzv_port: int = 29400, rdzv_id: str | None = None, nnodes: str | None = None,
                      launcher: Sequence[str] = ()) -> list[str]:
        """``torchrun`` argv for ``node``'s agent: ``--nnodes N``, c10d rendezvous on node 0's address.
        Node 0's agent hosts the store (``is_host`` explicit: torchrun's own guess compares the endpoint
        with the hostname's addresses, and the hostname resolves to 127.0.0.1 in every namespace).
        Start it with :meth:`run_on` on every node. An elastic job: ``nnodes="MIN:MAX"`` and torchrun's
        own options in ``launcher`` (e.g. ``--max-restarts=3``; a ``--rdzv-conf=`` there is merged)."""
        if not 1 <= rdzv_port <= 65535:
            raise EmuError(f"rdzv_port must be 1..65535, got {rdzv_port}")
        host = self.check_target(self.addrs[0])
        conf = [f"is_host={int(node == 0)}"]
        extra = []
        for a in launcher:
            if a.startswith("--rdzv-conf="):
                conf.append(a.split("=", 1)[1])
            else:
                extra.append(a)
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or len(self.addrs)}",
                f"--nproc-per-node={nproc_per_node}", f"--node-rank={node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{rdzv_port}", f"--rdzv-id={rdzv_id or self.state['tag']}",
                f"--rdzv-conf={','.join(conf)}", f"--local-addr={self.addrs[node]}", *extra, *script_argv]

    def throughput_gbit(self, src: int, dst: int, nbytes: int = 16 << 20, port: int = 29411) -> float:
        """One TCP stream ``src`` -> ``dst`` across the switch (a self-test of the shaping)."""
        from bench.netns import _CLIENT, _SERVER

        if nbytes < 1:
            raise EmuError(f"nbytes must be >= 1, got {nbytes}")
        addr = self.check_target(self.addrs[dst])
        srv = self.run_on(dst, [sys.executable, "-c", _SERVER, addr, str(port)], stdout=subprocess.PIPE,
                          text=True)
        try:
            if srv.stdout is None or not srv.stdout.readline().startswith("ready"):
                raise EmuError(f"throughput server on node {dst} did not start")
            cli = self.run_on(src, [sys.executable, "-c", _CLIENT, addr, str(port), str(int(nbytes))],
                              stdout=subprocess.PIPE, text=True)
            out, _ = cli.communicate(timeout=120)
            return float(out.strip())
        finally:
            srv.wait(timeout=30)

    # ------------------------------------------------------------------ teardown
    def down(self) -> list[str]:
        """Stop every process in our namespaces, delete the namespaces (and with them every veth and the
        bridge) and the state file. Idempotent; safe after a partial ``up``. Returns what was removed."""
        if not self._down_lock.acquire(blocking=False):
            # a signal arrived while down() already runs: its handler's SystemExit unwinds that down(),
            # and the still-registered atexit hook (disarm() comes last) runs down() again at exit
            return []
        try:
            removed = []
            names = [*self.state.get("namespaces", []), self.state.get("switch", "")]
            tag = self.state.get("tag", "")
            ours = [n for n in names if tag and n.startswith(f"{PREFIX}{tag}-")]
            removed += _kill_and_delete(ours)
            for p in self._procs:  # reap our children (a CLI 'down' has none: they were reparented)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            self._procs.clear()
            if self.state:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.dir, STATE))
                self.state["up"] = False
            if self._armed:
                self.disarm()
            return removed
        finally:
            self._down_lock.release()

    def __enter__(self) -> EmuCluster:
        return self.up()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()


def _ns_pids(ns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]


def _kill_and_delete(namespaces: Sequence[str]) -> list[str]:
    """SIGTERM every process in these (our) namespaces, SIGKILL after 10 s, then delete the namespaces."""
    existing = set(_list_namespaces())
    todo = [n for n in namespaces if n in existing]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        pids = [p for n in todo for p in _ns_pids(n)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            for pid in pids:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # a child of ours (library use) must be reaped to vanish
            pids = [p for p in pids if os.path.exists(f"/proc/{p}") and not _is_zombie(p)]
        if not pids:
            break
    for n in todo:
        _run(["ip", "netns", "del", n], check=False)
    return todo


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.split()]


def cleanup() -> list[str]:
    """Remove leftovers of any run: processes in and namespaces named ``dce-*``, host links named ``dce*``
    (none is ever created there; a crash of an older version could leave one)."""
    removed = _kill_and_delete([n for n in _list_namespaces() if n.startswith(PREFIX)])
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        ifname = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        tag = ifname[len(IF_PREFIX):len(IF_PREFIX) + 6]
        rest = ifname[len(IF_PREFIX) + 6:]
        if (ifname.startswith(IF_PREFIX) and len(tag) == 6 and all(c in "0123456789abcdef" for c in tag)
                and (rest == "br" or (rest[:1] in ("n", "s") and rest[1:].isdigit()))):
            _run(["ip", "link", "del", ifname], check=False)
            removed.append(ifname)
    return removed


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.emucluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the cluster and leave it running")
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--rate-gbit", type=float, default=1.0, help="tbf rate of each link (default 1)")
    mode.add_argument("--fast", action="store_true", help="unshaped links")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--redis-port", type=int, default=7000)
    up.add_argument("--http-port", type=int, default=8470, help="daemon HTTP port (loopback in each node)")
    up.add_argument("--maxmemory", default="256mb", help="per master (default 256mb)")
    up.add_argument("--images", type=int, default=0, help="generate a dataset of ~N JPEGs for the daemons")
    up.add_argument("--dataset", action="append", default=[], metavar="SOURCE",
                    help="dataset for the daemons")
    up.add_argument("--short-side", type=int, default=64)
    up.add_argument("--workers", type=int, default=1, help="decode processes per daemon (default 1)")
    up.add_argument("--redis-template", default=REDIS_TEMPLATE)
    up.add_argument("--daemon-template", default=DAEMON_TEMPLATE)
    up.add_argument("--timeout", type=float, default=60.0, help="seconds for each wait (default 60)")
    st = sub.add_parser("status", help="per node: redis, cluster state, daemon /health (JSON)")
    ct = sub.add_parser("counters", help="per-node veth byte counters (JSON)")
    lk = sub.add_parser("links", help="measure one TCP stream node i -> node i+1 for every node (JSON)")
    lk.add_argument("--mb", type=int, default=32, help="MiB per stream (default 32)")
    dn = sub.add_parser("down", help="stop everything and delete the namespaces")
    dn.add_argument("--cleanup", action="store_true", help="also remove leftovers of any run (dce-* names)")
    for p in (up, st, ct, lk, dn):
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"state directory (default {DEFAULT_DIR})")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            cfg = EmuConfig(state_dir=a.dir, nodes=a.nodes, rate_gbit=None if a.fast else a.rate_gbit,
                            redis_port=a.redis_port, http_port=a.http_port, maxmemory=a.maxmemory,
                            images=a.images, datasets=tuple(a.dataset), short_side=a.short_side,
                            workers=a.workers, redis_template=a.redis_template,
                            daemon_template=a.daemon_template, timeout=a.timeout)
            c = EmuCluster(cfg).up()
            c.disarm()  # success: the services outlive this command
            nodes = [{"namespace": c.ns(i), "addr": c.addrs[i], "ifname": c.ifname(i)}
                     for i in range(len(c.addrs))]
            print(json.dumps({"dir": c.dir, "cache": c.cache_url(), "nodes": nodes,
                "rate_gbit": c.state["rate_gbit"], "datasets": c.state["datasets"]}, indent=1))
        elif a.cmd == "status":
            nodes = EmuCluster.load(a.dir).status()
            print(json.dumps(nodes, indent=1))
            return 0 if all(n["ok"] for n in nodes) else 1
        elif a.cmd == "counters":
            print(json.dumps(EmuCluster.load(a.dir).link_counters(), indent=1))
        elif a.cmd == "links":
            c = EmuCluster.load(a.dir)
            if a.mb < 1:
                raise EmuError(f"--mb must be >= 1, got {a.mb}")
            n = len(c.addrs)
            links = [{"src": i, "dst": (i + 1) % n,
                      "gbit_s": round(c.throughput_gbit(i, (i + 1) % n, a.mb << 20), 3)} for i in range(n)]
            print(json.dumps({"rate_gbit": c.state["rate_gbit"], "links": links}, indent=1))
        else:
            removed: list[str] = []
            with contextlib.suppress(EmuError):
                removed += EmuCluster.load(a.dir).down()
            if a.cleanup:
                if os.geteuid() != 0:
                    raise EmuError("--cleanup needs root (ip netns)")
                removed += cleanup()
            print("removed:", ", ".join(removed) or "nothing")
    except EmuError as e:
        print(f"emucluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
