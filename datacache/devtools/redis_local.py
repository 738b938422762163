"""Real ``redis-server`` processes on loopback: one standalone server, or an N-master Redis Cluster.

Used by the tests (fixtures start and stop their own servers on free ports), the cluster benchmark
and ``deploy/local-cluster.sh`` (``python -m datacache.devtools.redis_local up``), so every local cluster is
built the same way: ``redis-server`` per master with ``cluster-enabled yes`` in its own directory,
then ``redis-cli --cluster create ... --cluster-yes`` and a wait until ``cluster_state:ok``.
Nothing here is a mock: these are the Debian ``redis-server`` 7 binaries.

``up`` uses only a new or empty directory, or one carrying its marker file from an earlier ``up``
(a non-empty directory without it is refused, untouched), and ``down`` removes only the files ``up``
wrote there. The directory (default ``<tmp>/datacache-local-cluster-<uid>``, :func:`default_dir`) must
be this user's, not writable by others, under no directory others can write without the sticky bit
(:mod:`datacache.ownership`); logs, marker and state are opened without following symlinks, and
``down`` signals a recorded pid only when it is this user's redis-server in that node's directory.
``status`` prints one line per node (:mod:`datacache.devtools.local_status`).

The ``up`` cluster has no password-less access: its masters run with the default user off and the three
roles of :mod:`datacache.redis_roles` (``admin``, ``datacache-daemon``, ``datacache``), whose random
passwords :mod:`datacache.make_secrets` keeps in ``DIR/secrets/<role>.pass`` (mode 0600, directory 0700;
reused by a later ``up``, removed by ``down`` when ``up`` created them). Only SHA-256 hashes reach the
``redis-server`` command lines, the admin password reaches ``redis-cli`` through ``REDISCLI_AUTH``, and
clients name the file (``?password_file=``, see ``url``): no password on any command line.

Servers run with no persistence (``save ""``, ``appendonly no``): a restarted master comes back
empty, which is exactly the "node lost its memory" case the fault tests exercise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

from datacache.make_secrets import ensure_passwords, password_file
from datacache.ownership import (
    ancestors_problem,
    dir_problem,
    ensure_private_dir,
    open_private_append,
    open_private_read,
    pid_is_ours,
)
from datacache.redis_roles import ADMIN, ROLES, RolesError, server_acl_args


def _ephemeral_low() -> int:
    """The first port the kernel hands out to client sockets (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive free loopback ports whose cluster-bus ports (+ 10000) are
    free too.

    Picked below the kernel's ephemeral range, bus ports included, where that range allows
    (Linux's default 32768-60999 leaves bases 10000-22767): a port picked *inside* it can be
    taken by any client socket's ephemeral port between this check and the server's bind (a
    parallel test's connection), which made a cluster master fail to start once in a few hundred
    runs. Outside it only another deliberate listener can collide."""
    low = _ephemeral_low()
    rng = random.Random()  # its own RNG: tests seed the global one
    top = low - 10000 - n
    candidates = [rng.randrange(10000, top) for _ in range(200)] if top > 10000 else []
    for base in candidates:
        if all(_bindable(p) and _bindable(p + 10000) for p in range(base, base + n)):
            return base
    for _ in range(200):  # an unusual ephemeral range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n - 1 + 10000 <= 65535 and all(
                _bindable(p) and _bindable(p + 10000) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} free consecutive loopback ports (with their bus ports + 10000) found")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 whose cluster-bus port (+ 10000) is free too (see :func:`free_ports`)."""
    return free_ports(1)


def redis_available() -> str | None:
    """Why real Redis tests cannot run here, or None when redis-server and redis-cli exist."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(missing)} not installed (apt-get install redis-server)" if missing else None


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port`` (see :func:`start_server`)."""

    port: int
    workdir: str
    args: list[str]
    proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        _, why = ensure_private_dir(self.workdir, what="redis-server directory")
        if why:
            raise RuntimeError(why)
        # O_NOFOLLOW + owner check on the descriptor: a redis.log symlink planted here must never make
        # us (root, say) append the server's log to the file it names
        log = open_private_append(os.path.join(self.workdir, "redis.log"), what="redis-server log")
        try:
            self.proc = subprocess.Popen(["redis-server", *self.args], cwd=self.workdir, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with os.fdopen(open_private_read(os.path.join(self.workdir, "redis.log")), "rb") as f:
                    tail = f.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} exited at start:\n{tail}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):  # up (an ACL server answers NOAUTH)
                    return self
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default: the node dies with its memory) and reap the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def server_args(port: int, *, cluster: bool = False, maxmemory: str | None = None,
                policy: str = "noeviction", password: str | None = None, user: str | None = None,
                roles: Mapping[str, str] | None = None, extra: list[str] | None = None) -> list[str]:
    """Command-line config of a cache node: loopback, no persistence, optional memory cap, and either the
    datacache roles (``roles``: role -> password, :mod:`datacache.redis_roles`; only their hashes are on
    the command line) or one ACL user with every command on the datacache prefixes (``user`` +
    ``password``, for tests of wrong credentials)."""
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "yes", "--maxmemory-policy", policy, "--daemonize", "no"]
    if maxmemory:
        args += ["--maxmemory", maxmemory]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                 "--cluster-allow-reads-when-down", "yes"]
    if roles:
        args += server_acl_args(roles)  # default user off; hashes only (ps shows this command line)
    elif user and password:  # an ACL user limited to the datacache key prefixes; default user off
        args += ["--user", user, "on", f">{password}", "~dc:*", "~dcq:*", "~dcd:*", "+@all",
                 "--user", "default", "off"]
    elif password:
        args += ["--requirepass", password]
    return args + list(extra or [])


BIND_RETRIES = 5  # a port picked free can still be taken before the server binds it (another listener)


def _bind_retrying(start: Callable[[int], RedisServer], port: int | None) -> RedisServer:
    """``start(port)``; without a port, ``start`` on a picked one, and on another when a different process
    bound it first (between the check and redis' bind: parallel tests pick ports too), up to
    ``BIND_RETRIES`` times. A port given is used or fails."""
    for attempt in range(BIND_RETRIES):
        p = port or free_port()
        try:
            return start(p)
        except RuntimeError as e:
            if port or attempt == BIND_RETRIES - 1 or "Address already in use" not in str(e):
                raise
    raise AssertionError("unreachable")


def start_server(workdir: str, *, port: int | None = None, **kw: object) -> RedisServer:
    """Start one standalone ``redis-server`` (``kw`` goes to :func:`server_args`; port: see
    :func:`_bind_retrying`)."""
    return _bind_retrying(lambda p: RedisServer(p, workdir, server_args(p, **kw)).start(),  # type: ignore[arg-type]
                          port)


@dataclass
class LocalCluster:
    """``n`` Redis Cluster masters on loopback, created with ``redis-cli --cluster create``."""

    masters: list[RedisServer] = field(default_factory=list)
    workdir: str = ""
    admin_password: str = field(default="", repr=False)  # set when the masters run with the roles

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(m.addr for m in self.masters)

    def role_url(self, role: str, secrets_dir: str) -> str:
        """The cluster's URL for ``role`` with its password read from ``secrets_dir`` (no secret in it)."""
        return role_url(role, [m.port for m in self.masters], secrets_dir)

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every live master reports ``cluster_state:ok`` and knows every slot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [_cli(m.port, "cluster", "info", admin_password=self.admin_password)
                      for m in self.masters if m.proc is not None and m.proc.poll() is None]
            if states and all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s
                              for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster at {self.url} did not reach cluster_state:ok in {timeout} s")

    def wait_agreed(self, timeout: float = 30.0) -> None:
        """Wait until ``redis-cli --cluster check`` finds every slot covered, no slot open (migrating or
        importing) and every node agreeing on the slot map: a reshard has fully settled."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            res = subprocess.run(["redis-cli", *_admin_auth(self.admin_password), "--cluster", "check",
                                  self.masters[0].addr], capture_output=True, text=True, timeout=30,
                                 env=_admin_env(self.admin_password))
            out = res.stdout + res.stderr
            if (res.returncode == 0 and "[OK] All nodes agree about slots configuration." in out
                    and "[OK] All 16384 slots covered." in out and "[WARNING]" not in out):
                self.wait_ok(max(1.0, deadline - time.monotonic()))
                return
            time.sleep(0.2)
        raise RuntimeError(f"cluster at {self.url} did not settle in {timeout} s:\n{out}")

    def restart_empty(self, i: int) -> None:
        """Restart master ``i`` on its port with its cluster config but no data (it lost its memory)."""
        m = self.masters[i]
        m.kill()
        m.start()
        self.wait_ok()

    def stop(self) -> None:
        for m in self.masters:
            m.stop()


def _admin_auth(admin_password: str) -> list[str]:
    return ["--user", ADMIN, "--no-auth-warning"] if admin_password else []


def _admin_env(admin_password: str) -> dict[str, str] | None:
    """redis-cli reads the password from REDISCLI_AUTH: never on its command line (``ps`` shows those)."""
    return {**os.environ, "REDISCLI_AUTH": admin_password} if admin_password else None


def _cli(port: int, *args: str, timeout: float = 10.0, admin_password: str = "") -> str:
    out = subprocess.run(["redis-cli", "-p", str(port), *_admin_auth(admin_password), *args],
                         capture_output=True, text=True, timeout=timeout, env=_admin_env(admin_password))
    return out.stdout + out.stderr


def role_url(role: str, ports: list[int], secrets_dir: str) -> str:
    """``redis+cluster://ROLE@127.0.0.1:P1,...?password_file=SECRETS_DIR/ROLE.pass`` (path quoted)."""
    path = quote(password_file(os.path.abspath(secrets_dir), role), safe="/")
    return f"redis+cluster://{role}@" + ",".join(f"127.0.0.1:{p}" for p in ports) + f"?password_file={path}"


def start_cluster(workdir: str, n: int = 3, *, ports: list[int] | None = None, **kw: object) -> LocalCluster:
    """Start ``n`` masters (no replicas) and join them into one cluster covering all 16384 slots. With
    ``roles=`` (role -> password) the masters run with the datacache roles and the cluster is created as
    ``admin``."""
    roles = kw.get("roles")
    admin = str(roles[ADMIN]) if isinstance(roles, Mapping) else ""
    cl = LocalCluster(workdir=workdir, admin_password=admin)
    try:
        for i in range(n if ports is None else len(ports)):
            cl.masters.append(_bind_retrying(
                lambda p: start_server(os.path.join(workdir, f"node-{p}"), port=p, cluster=True, **kw),
                None if ports is None else ports[i]))
        out = subprocess.run(["redis-cli", *_admin_auth(admin), "--cluster", "create",
                              *[m.addr for m in cl.masters], "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60, env=_admin_env(admin))
        if out.returncode != 0 or "[OK] All 16384 slots covered" not in out.stdout:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        cl.wait_ok()
    except BaseException:
        cl.stop()
        raise
    return cl


MARKER = ".datacache-local-cluster"  # written by `up` into DIR: proof that DIR is ours to clean
STATE = "cluster.json"
SECRETS = "secrets"  # DIR/secrets/<role>.pass (0600), made by `up` unless already there
_SECRET_NAMES = frozenset(os.path.basename(password_file("", r)) for r in ROLES)  # what down may remove


def default_dir() -> str:
    """The default cluster directory: ``<temporary directory>/datacache-local-cluster-<uid>``.

    Per user (never one fixed name in the shared ``/tmp`` that another user could create first and fill
    with a marker, passwords and symlinks), and the same in every context of that user (login shell,
    sudo -u, cron, CI), which ``$XDG_RUNTIME_DIR`` is not: it is unset outside login sessions and removed
    at logout while the servers keep running. The name is predictable, so another user can still create
    it first: :func:`claim_dir` then refuses it (owner check), and DIR / --dir picks another."""
    return os.path.join(tempfile.gettempdir(), f"datacache-local-cluster-{os.geteuid()}")


def _load(path: str) -> dict:
    """A JSON state file of ours (no symlink followed, owned by this user); OSError otherwise."""
    with os.fdopen(open_private_read(path, what="local cluster state file"), "rb") as f:
        got = json.loads(f.read(1 << 20))
    if not isinstance(got, dict):
        raise ValueError(f"{path}: not a JSON object")
    return got


def _is_our_server(pid: object, path: str, port: int) -> bool:
    """Whether ``pid`` (read from cluster.json: anything) is the redis-server we started for ``port``: a
    live process of this user whose program is redis-server and whose working directory is that node's
    directory. A pid someone wrote into the state file, or one the kernel reused, is never signalled."""
    return pid_is_ours(pid, exe_name="redis-server", cwd=os.path.join(path, f"node-{port}"))


def _pings(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    return False


def _dir_refusal(path: str) -> str | None:
    """Why ``path`` is not a directory this user alone controls (one line), or None."""
    why = ancestors_problem(path, what="the local cluster directory") or \
        dir_problem(path, what="the local cluster directory")
    return f"{why} (set DIR / --dir to another directory)" if why else None


def claim_dir(path: str) -> str | None:
    """Make ``path`` the cluster's directory, or say why not (one line).

    A directory is used only when it is owned by this user, not writable by group or others, reached
    through no directory another user can write (:func:`ancestors_problem`), and new, empty, or carrying
    :data:`MARKER` (a regular file of ours) from an earlier `up`: the tool never writes into (let alone
    cleans) a directory holding someone else's files, nor one another user prepared -- with its own
    marker, password files and symlinks. A new directory is created mode 0700. The marker records
    whether `up` created the directory, so `down` removes the directory itself only then."""
    why = ancestors_problem(path, what="the local cluster directory")
    if why:
        return f"{why} (set DIR / --dir to another directory)"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    why = ancestors_problem(path, what="the local cluster directory")  # again: parents made just now
    if why:
        return f"{why} (set DIR / --dir to another directory)"
    created, why = ensure_private_dir(path, what="the local cluster directory")
    if why:
        return f"{why} (set DIR / --dir to another directory)"
    marker = os.path.join(path, MARKER)
    if not created:
        if os.path.lexists(marker):
            try:
                os.close(open_private_read(marker, what="the local cluster marker"))
            except OSError as e:
                return f"{e.strerror or e} (set DIR / --dir to another directory)"
            return None
        if os.listdir(path):
            return (f"{path} is not empty and was not created by the local cluster (no {MARKER} in it); "
                    f"refusing to use it: set DIR / --dir to a new or empty directory")
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"created_dir": created}, f)
    return None


def _remove_own_nodes(path: str, ports: list[int]) -> None:
    """The node directories' files `up` wrote (log, cluster config); a directory only once empty."""
    for p in ports:
        node = os.path.join(path, f"node-{p}")
        for name in ("redis.log", "nodes.conf"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(node, name))
        with contextlib.suppress(OSError):
            os.rmdir(node)  # only if empty: a file someone put there keeps it


def _remove_own(path: str, ports: list[int], secrets: list[str] | None = None,
                secrets_dir_created: bool = False) -> None:
    """Remove only the files `up` wrote (state, node logs and cluster configs, the password files it
    created, marker); directories only when they are empty afterwards and were ours. Anything else found
    in ``path`` stays."""
    _remove_own_nodes(path, ports)
    sdir = os.path.join(path, SECRETS)
    for name in secrets or []:
        if name in _SECRET_NAMES:  # only our own file names, whatever a tampered state file says
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(sdir, name))
    if secrets_dir_created:
        with contextlib.suppress(OSError):
            os.rmdir(sdir)  # only if empty
    for name in (STATE, STATE + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, name))
    marker = os.path.join(path, MARKER)
    try:
        created = bool(_load(marker).get("created_dir"))
    except (OSError, ValueError, AttributeError):
        created = False
    with contextlib.suppress(FileNotFoundError):
        os.remove(marker)
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _ports_of(rec: dict) -> list[int]:
    """The recorded ports that are ports (a tampered "../x" must never become a path to remove)."""
    return [p for p in rec.get("ports", [])
            if isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536]


def _down(path: str) -> int:
    state = os.path.join(path, STATE)
    if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)
                                     and not os.path.lexists(os.path.join(path, MARKER))):
        print(f"no local cluster in {path} (no {MARKER}); nothing stopped or removed")
        return 0
    why = _dir_refusal(path)
    if why:  # another user's directory (or one others can write): stop nothing, remove nothing
        print(why, file=sys.stderr)
        return 2
    try:
        os.close(open_private_read(os.path.join(path, MARKER), what="the local cluster marker"))
        rec = _load(state) if os.path.lexists(state) else {"pids": [], "ports": []}
    except (OSError, ValueError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{msg}; nothing stopped or removed", file=sys.stderr)
        return 2
    ports = _ports_of(rec)
    # signal only a pid proven ours: this user's redis-server running in that port's node directory
    pids = [(pid, port) for pid, port in zip(rec.get("pids", []), ports, strict=False)
            if _is_our_server(pid, path, port)]
    for pid, _ in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(_is_our_server(p, path, port) for p, port in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait for the exit, so the node files can go and the ports are free again
    _remove_own(path, ports, list(rec.get("secrets", [])), bool(rec.get("secrets_dir_created")))
    print("stopped the local cluster")
    return 0


def _up(path: str, masters: int, base_port: int, maxmemory: str) -> int:
    missing = redis_available()
    if missing:
        print(f"cannot start the local cluster: {missing}", file=sys.stderr)
        return 1
    why = claim_dir(path)
    if why:
        print(why, file=sys.stderr)
        return 2
    state = os.path.join(path, STATE)
    ports = [base_port + i for i in range(masters)]
    try:
        rec = _load(state) if os.path.lexists(state) else {}
        sec = ensure_passwords(os.path.join(path, SECRETS))  # reused when there, else made (0600)
    except (RolesError, OSError, ValueError) as e:
        msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"cannot start the local cluster: {msg}", file=sys.stderr)
        return 1
    own = {"secrets": sorted(set(rec.get("secrets", [])) | set(sec.created)),
           "secrets_dir_created": bool(rec.get("secrets_dir_created")) or sec.created_dir}
    if rec.get("pids"):
        if rec.get("ports") != ports:
            print(f"{path} holds a local cluster on ports {rec.get('ports')}, not {ports}: run `down` first "
                  "or use another directory", file=sys.stderr)
            return 1
        old = list(rec["pids"])[:len(ports)]
        old += [0] * (len(ports) - len(old))
        alive = [_is_our_server(pid, path, port) and _pings(port)
                 for pid, port in zip(old, ports, strict=True)]
        if all(alive):
            print(rec["url"])
            print(f"all {len(ports)} masters already running: {rec['url']}", file=sys.stderr)
            return 0
        # some masters died: start each again on its port with its nodes.conf (it keeps its slots and
        # rejoins; its memory is gone, which its daemon refills)
        cl = LocalCluster(workdir=path, admin_password=sec.passwords[ADMIN])
        pids = old
        for i, port in enumerate(ports):
            srv = RedisServer(port, os.path.join(path, f"node-{port}"),
                              server_args(port, cluster=True, maxmemory=maxmemory, roles=sec.passwords))
            if not alive[i]:
                srv.start()
                pids[i] = srv.proc.pid if srv.proc else 0
                print(f"restarted the redis-server on 127.0.0.1:{port}", file=sys.stderr)
            cl.masters.append(srv)
        _write_state(state, cl.url, pids, ports, own)
        cl.wait_ok()
        print(cl.url)
        return 0
    if _ports_of(rec):  # an earlier `up` failed before its cluster existed: start over on our own files
        _remove_own_nodes(path, _ports_of(rec))
    # the ports (and our password files) first, so `down` finds the files of a failed start
    _write_state(state, "", [], ports, own)
    cl = start_cluster(path, masters, ports=ports, maxmemory=maxmemory, roles=sec.passwords)
    _write_state(state, cl.url, [m.proc.pid for m in cl.masters if m.proc], ports, own)
    print(cl.url)
    return 0


def _write_state(state: str, url: str, pids: list[int], ports: list[int], own: dict | None = None) -> None:
    tmp = state + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # a leftover (or a planted link): removed, never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pids": pids, "ports": ports, **(own or {})}, f)
    os.replace(tmp, state)


def main(argv: list[str] | None = None) -> int:
    """``python -m datacache.devtools.redis_local up|down|status|url``: a local N-master cluster for the
    local-cluster demo (docs/cluster.md); ``url --role ROLE`` prints the cluster's URL for that role
    (password read from its file)."""
    ap = argparse.ArgumentParser(prog="python -m datacache.devtools.redis_local",
                                 description="Start (up) or stop (down) a local Redis Cluster of real "
                                             "redis-server processes on 127.0.0.1 (no persistence). `up` "
                                             "uses only a new or empty directory (or its own from an "
                                             "earlier `up`); `down` removes only the files `up` wrote.")
    ap.add_argument("action", choices=("up", "down", "status", "url"))
    ap.add_argument("--dir", default=default_dir(),
                    help="working directory (state file, logs, nodes.conf); default "
                         "<tmp>/datacache-local-cluster-<uid>; it must be this user's and not writable by "
                         "others")
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=7000, help="masters on base-port .. base-port+N-1")
    ap.add_argument("--maxmemory", default="1gb", help="memory budget per master (default 1gb)")
    ap.add_argument("--http-port", type=int, default=8470,
                    help="status: the first cache daemon's HTTP port (one daemon per master)")
    ap.add_argument("--json", action="store_true", help="status: the daemons' full /status JSON")
    ap.add_argument("--role", choices=ROLES, default="datacache",
                    help="url: whose URL (datacache = trainers, datacache-daemon = the daemons)")
    args = ap.parse_args(argv)
    path = os.path.abspath(args.dir)
    if args.action == "url":
        ports = [args.base_port + i for i in range(args.masters)]
        print(role_url(args.role, ports, os.path.join(path, SECRETS)))
        return 0
    if args.action == "down":
        return _down(path)
    if args.action == "status":
        from datacache.devtools.local_status import print_status

        return print_status(path, [args.base_port + i for i in range(args.masters)],
                            [args.http_port + i for i in range(args.masters)], as_json=args.json)
    try:
        return _up(path, args.masters, args.base_port, args.maxmemory)
    except RuntimeError as e:  # a server that exits at start (port taken, bad option) or a cluster not ok
        print(f"cannot start the local cluster: {str(e).splitlines()[0]} (the redis.log files under {path} "
              "say why; `down` cleans up)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
