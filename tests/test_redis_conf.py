"""deploy/redis/redis.conf for real: one Redis role per credential, no working default password.

* The template as shipped does not start (its password hashes are placeholders redis-server refuses),
  and its ACL rules are those of :mod:`datacache.redis_roles`.
* Filled by ``python -m datacache.make_secrets`` (generated passwords), three real redis-server masters
  start with it and form a cluster as ``admin``. Then, as each role, every path its real code sends
  works with no ACL denial at all (``ACL LOG`` stays empty on every master): the store, fill reports,
  the registry and a real cache daemon as ``datacache-daemon``; ``CachedImageNet`` (reads, misses served
  without a write, known-bad files, ``wait_warm``) and ``datacache stats`` as ``datacache``.
* Trainers read, daemons write: the trainers' role is allowed exactly its read commands (the server's
  whole command table through ``ACL DRYRUN``), cannot poison, fill, expire or erase samples or
  quarantine entries (for real, as a compromised job would try), nor write the registry or fill
  reports; a daemon re-checks quarantine entries it did not make; neither role can list keys or
  destroy data, and the old default passwords open nothing.
* The daemon caps what it READS from the registry (40 direct HSETs -> at most ``max_registrations``),
  and a forged 18 MB fill report leaves ``/status`` small (a real daemon, real HTTP).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import msgpack
import pytest

from datacache.devtools.redis_local import RedisServer, free_port, free_ports
from datacache.make_secrets import ensure_passwords, password_file
from datacache.redis_roles import ADMIN, DAEMON, RULES, TRAINER, acl_lines, fill_template, template_rules
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "deploy", "redis", "redis.conf")

FORBIDDEN = [
    ["scan", "0"], ["keys", "*"], ["cluster", "getkeysinslot", "0", "10"], ["script", "flush"],
    ["eval", "return 1", "0"], ["flushall"], ["flushdb"], ["config", "get", "maxmemory"],
    ["debug", "sleep", "0"], ["unlink", "dc:x"], ["monitor"], ["client", "list"],
    ["client", "kill", "127.0.0.1:1"], ["acl", "list"], ["acl", "setuser", "evil", "on", ">x", "~*", "+@all"],
    ["shutdown", "nosave"], ["cluster", "reset"], ["cluster", "nodes"], ["randomkey"],
    ["object", "encoding", "dc:x"], ["save"], ["bgsave"], ["hkeys", "dcd:datasets"],
]
# what a trainer must not do to the daemons' keys (the registry, fill reports, samples): their role may
# (DEL dc:x: the daemons' rolling fill deletes what every run has read; a trainer never deletes)
TRAINER_NO_WRITE = [
    ["del", "dc:x"], ["del", "dcp:{x}:00"], ["set", "dc:x", "x"],
    ["hset", "dcd:datasets", "/data|t160", "x"], ["hdel", "dcd:datasets", "/data|t160"],
    ["hset", "dcd:fill:0123456789abcdef:t160", "n1", "x"], ["hdel", "dcd:fill:0123456789abcdef:t160", "n1"],
    ["set", "dcd:datasets", "x"], ["set", "dcd:fill:x", "x"], ["hsetnx", "dcd:datasets", "f", "x"],
]


@dataclass
class RoleCluster:
    masters: list[RedisServer]
    secrets: str  # the directory make_secrets wrote

    def password(self, role: str) -> str:
        with open(password_file(self.secrets, role)) as f:
            return f.read().strip()

    def url(self, role: str) -> str:
        """The role's cache URL with its password read from its file (as deployments write it)."""
        return (f"redis+cluster://{role}@" + ",".join(m.addr for m in self.masters)
                + f"?password_file={password_file(self.secrets, role)}")


def _cli(rc: RoleCluster | None, port: int, role: str | None, *args: str, password: str | None = None) -> str:
    """redis-cli as ``role`` (password through REDISCLI_AUTH, never an argument); no role: no login."""
    auth = ["--user", role, "--no-auth-warning"] if role else []
    env = dict(os.environ)
    if role:
        env["REDISCLI_AUTH"] = password if password is not None else rc.password(role)  # type: ignore[union-attr]
    out = subprocess.run(["redis-cli", "-p", str(port), *auth, *args], capture_output=True, text=True,
                         timeout=15, env=env)
    return out.stdout + out.stderr


def _start_masters(conf: str, tmp, n: int = 3) -> list[RedisServer]:
    masters: list[RedisServer] = []
    try:
        for _ in range(n):
            port = free_port()
            args = [conf, "--port", str(port), "--bind", "127.0.0.1", "--maxmemory", "64mb",
                    "--cluster-config-file", f"nodes-{port}.conf"]
            masters.append(RedisServer(port, str(tmp / f"n{port}"), args).start())
    except BaseException:
        for m in masters:
            m.stop()
        raise
    return masters


@pytest.fixture(scope="module")
def roles_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conf")
    sec = ensure_passwords(str(tmp / "secrets"))
    filled = tmp / "redis.conf"
    with open(CONF) as f:
        filled.write_text(fill_template(f.read(), sec.passwords))
    masters = _start_masters(str(filled), tmp)
    rc = RoleCluster(masters, sec.dir)
    try:
        out = subprocess.run(["redis-cli", "--user", ADMIN, "--no-auth-warning", "--cluster", "create",
                              *[m.addr for m in masters], "--cluster-yes"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "REDISCLI_AUTH": rc.password(ADMIN)})
        assert "[OK] All 16384 slots covered" in out.stdout, out.stdout + out.stderr
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in _cli(rc, m.port, ADMIN, "cluster", "info") for m in masters):
            assert time.monotonic() < deadline, "cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        yield rc
    finally:
        for m in masters:
            m.stop()


def _reset_acl_log(rc: RoleCluster) -> None:
    for m in rc.masters:
        _cli(rc, m.port, ADMIN, "acl", "log", "reset")


def _acl_denials(rc: RoleCluster) -> dict[int, str]:
    logs = {m.port: _cli(rc, m.port, ADMIN, "acl", "log").strip() for m in rc.masters}
    return {p: log for p, log in logs.items() if log}


# ------------------------------------------------------------------------------ the template itself
@needs_redis
def test_the_template_as_shipped_does_not_start(tmp_path) -> None:
    port = free_port()
    srv = RedisServer(port, str(tmp_path / "n"), [CONF, "--port", str(port), "--bind", "127.0.0.1"])
    with pytest.raises(RuntimeError, match=r"exited at start(?s:.*)password hash must be exactly 64"):
        srv.start()
    with open(CONF) as f:
        live = [ln for ln in f.read().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    # no password in the file at all: no ">password" rule, no requirepass/masterauth line
    assert not any(tok.startswith(">") for ln in live for tok in ln.split())
    assert not any(ln.split()[0] in ("requirepass", "masterauth") for ln in live)


def test_template_rules_are_the_roles_of_redis_roles() -> None:
    with open(CONF) as f:
        text = f.read()
    assert template_rules(text) == RULES  # the file and the code that fills it agree, role by role
    assert "user default off" in text.splitlines()


@needs_redis
def test_output_buffers_for_normal_clients_are_bounded(roles_cluster) -> None:
    limits = _cli(roles_cluster, roles_cluster.masters[0].port, ADMIN, "config", "get",
                  "client-output-buffer-limit")
    assert "normal 268435456 67108864 60" in limits, limits


@needs_redis
def test_no_default_or_old_password_opens_anything(roles_cluster) -> None:
    port = roles_cluster.masters[0].port
    assert "NOAUTH" in _cli(None, port, None, "ping")  # the default user is off
    for role, old in ((ADMIN, "CHANGE_ME_ADMIN"), (TRAINER, "CHANGE_ME"), (DAEMON, "CHANGE_ME"),
                      ("default", "x")):
        assert "WRONGPASS" in _cli(roles_cluster, port, role, "ping", password=old), role
    assert "PONG" in _cli(roles_cluster, port, TRAINER, "ping")  # the generated one works


# ------------------------------------------------------------------------------ each role's real paths
@needs_redis
def test_daemon_role_store_fill_registry_and_a_real_daemon_work(roles_cluster, tmp_path) -> None:
    from datacache.devtools import synth
    from datacache.fillstatus import read_fill, report_fill, summarize
    from datacache.stores import open_store

    rc = roles_cluster
    _reset_acl_log(rc)
    url = rc.url(DAEMON)
    s = open_store(url)
    try:
        # 40 x 100 KB: get_many's replies span several fetch_bytes (2 MiB) round trips per master
        items = [(b"dc:f:v:%d" % i, os.urandom(100_000)) for i in range(40)]
        assert s.put_many(items) == 40
        assert [bytes(v) for v in s.get_many([k for k, _ in items])] == [v for _, v in items]
        assert s.contains([b"dc:f:v:0", b"dc:f:v:missing"]) == [True, False]
        assert s.put_many(items[:3]) == 0  # SET NX: already there
        assert s.health()["ok"] and s.stats()["entries"] >= 40
        report_fill(s, "0123456789abcdef", "t160", "n1", owned=10, done=4, quarantined=0, total=20, rate=1.5)
        fill = read_fill(s, "0123456789abcdef", "t160")
        assert fill["n1"]["done"] == 4 and summarize(fill, 20)["done"] == 4
        # the registry of POST / DELETE /datasets (HSET, HGETALL, HDEL on dcd:datasets)
        from cache_daemon.daemon_config import DatasetSpec
        from cache_daemon.registry import register, registered, unregister

        spec = DatasetSpec(source=str(tmp_path / "reg"))
        register(s, spec, max_registrations=4)
        assert [d.ident() for d in registered(s, (str(tmp_path),))] == [spec.ident()]
        assert unregister(s, spec.ident()) and registered(s, (str(tmp_path),)) == []
        assert s.counters()["write_errors"] == 0 and s.counters()["read_errors"] == 0
    finally:
        s.close()
    # a real cache daemon as datacache-daemon fills its node's share of a small dataset and exits
    src = str(tmp_path / "ds")
    synth.make_imagefolder(src, classes=2, per_class=6, size=(120, 90))
    http = free_ports(1)
    out = subprocess.run(
        [sys.executable, "-m", "cache_daemon", "--cache", url, "--redis-node", rc.masters[0].addr,
         "--node", "n0", "--dataset", src, "--http-port", str(http), "--workers", "1", "--once",
         "--no-progress", "--poll-interval", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NOPERM" not in out.stderr and rc.password(DAEMON) not in out.stderr + out.stdout
    # the idle pass's presence stamp (INFO sections, COUNTKEYSINSLOT) works as that role: a second pass
    # over the full share skips the per-key check
    import threading

    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.ingest import DatasetState, ingest_pass

    cfg = DaemonConfig(cache=url, node="n0", redis_node=rc.masters[0].addr, workers=1, t1_dir="none")
    state, s = DatasetState(DatasetSpec(source=src)), open_store(url)
    try:
        for _ in range(2):
            ingest_pass(cfg, state, s, decoder=None, stop=threading.Event(), progress=False)
    finally:
        s.close()
    assert state.status == "full" and state.shortcut_passes == 1, state
    # nothing any of that sent was refused by the ACL on any master
    assert _acl_denials(rc) == {}


@needs_redis
def test_trainer_role_reads_serves_misses_and_waits_warm(roles_cluster, tmp_path) -> None:
    """Trainers read, daemons write: as the trainer, CachedImageNet serves misses decoded locally and
    sends no write at all (the ACL log stays empty, no write error); ``datacache warm`` as the daemons'
    role fills the cache and remembers the bad file; then the trainer hits, knows the bad file, waits warm
    and runs ``datacache stats``; and ``datacache warm`` as the trainer says which credential it needs."""
    from client.dataset import CachedImageNet
    from datacache.devtools import synth
    from datacache.fillstatus import report_fill
    from datacache.stores import open_store

    rc = roles_cluster
    _reset_acl_log(rc)
    src = str(tmp_path / "ds")
    synth.make_imagefolder(src, classes=2, per_class=5, size=(96, 80), seed=3)
    (tmp_path / "ds" / "c000" / "bad.JPEG").write_bytes(b"not a jpeg at all")  # quarantined (dcq:)
    url = rc.url(TRAINER)
    ds = CachedImageNet(src, cache=url, short_side=32, t1_dir=None)  # PING / CLUSTER SLOTS at construction
    n = len(ds)
    assert len(ds.__getitems__(list(range(n)))) == n  # misses: decoded locally and served, never written
    assert ds.flush(timeout=30) and ds.quarantined
    st = ds.stats()
    assert st["decoded"] >= n - 1 and st["t2"]["written"] == 0, st
    assert ds.store.counters().get("write_errors", 0) == 0  # not even tried
    env = {**os.environ, "PYTHONPATH": REPO}
    # `datacache warm` as the trainer: every write refused; the warning says whose credential it takes
    out = subprocess.run([sys.executable, "-m", "datacache.cli", "warm", src, "--cache", url, "--short-side",
                          "32", "--workers", "1", "--t1-dir", "none", "--no-progress"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert "NOT cached" in out.stdout and "datacache-daemon" in out.stderr, out.stdout + out.stderr
    assert rc.password(TRAINER) not in out.stdout + out.stderr
    _reset_acl_log(rc)
    # the operator warms with the daemons' credential
    out = subprocess.run([sys.executable, "-m", "datacache.cli", "warm", src, "--cache", rc.url(DAEMON),
                          "--short-side", "32", "--workers", "1", "--t1-dir", "none", "--no-progress"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "NOT cached" not in out.stdout, out.stdout + out.stderr
    again = CachedImageNet(src, cache=url, short_side=32, t1_dir=None)
    again.__getitems__(list(range(n)))
    st = again.stats()
    assert st["hits"] == n and st["decoded"] == 0, st  # GET pipelines (n - 1 + the bad one's substitute)
    assert st["t2"]["known_bad"] == 1 and list(again.quarantined) == ["c000/bad.JPEG"]  # warm's dcq: entry
    # wait_warm as the trainer: HGETALL of the daemons' reports, then EXISTS of sampled keys
    daemon = open_store(rc.url(DAEMON))
    try:
        report_fill(daemon, ds.manifest.fingerprint, ds.variant.tag(), "n0", owned=n, done=n, quarantined=1,
                    total=n, rate=1.0)
    finally:
        daemon.close()
    summary = again.wait_warm(timeout=30, poll=0.1)
    assert summary["full"] and summary["verified"]["missing"] == 0
    out = subprocess.run([sys.executable, "-m", "datacache.cli", "stats", "--cache", url],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert rc.password(TRAINER) not in out.stdout + out.stderr
    assert _acl_denials(rc) == {}


def _command_names(admin) -> list[str]:
    """Every command and subcommand of the server (``COMMAND``), as ``name`` or ``name|sub``."""
    names: dict[str, int] = {}
    for name, info in admin.command().items():
        names[str(name)] = int(info.get("arity", 1))
        for sub in info.get("subcommands", []) or []:  # raw COMMAND rows: [name, arity, flags, ...]
            names[str(sub[0]).lower()] = int(sub[1])
    return sorted(names.items())


# exactly what the trainers' code sends; ``ACL DRYRUN`` of every other command of the server is refused
TRAINER_ALLOWED = {"get", "exists", "hgetall", "info", "dbsize", "ping", "auth", "hello", "cluster|slots",
                   "cluster|shards", "cluster|info", "client|setname",
                   # never subject to the ACL: they only close / reset the caller's own connection
                   "quit", "reset"}


@needs_redis
def test_trainer_role_is_allowed_exactly_its_read_commands_command_by_command(roles_cluster) -> None:
    """The server's whole command table, subcommands included, one ``ACL DRYRUN`` each as the trainer on
    a sample key: the allowed set is exactly :data:`TRAINER_ALLOWED` -- no write, expiry or delete."""
    import redis

    rc = roles_cluster
    admin = redis.Redis(port=rc.masters[0].port, username=ADMIN, password=rc.password(ADMIN),
                        decode_responses=True)
    try:
        allowed, checked = set(), 0
        for full, arity in _command_names(admin):
            top, _, sub = full.partition("|")
            given = [top] + ([sub] if sub else [])
            # the arity (at least that many for a negative one), every argument a sample key
            args = given + ["dc:0123456789abcdef:t32:0"] * max(abs(arity) - len(given), 0)
            try:
                reply = admin.execute_command("ACL", "DRYRUN", TRAINER, *args)
            except redis.ResponseError as e:  # a malformed probe is a refusal of nothing: count it apart
                reply = str(e)
            checked += 1
            if str(reply) == "OK":
                allowed.add(full)
        assert checked > 200, checked  # Redis 7 has ~240 commands and subcommands: the table was walked
        assert allowed == TRAINER_ALLOWED, sorted(allowed ^ TRAINER_ALLOWED)
    finally:
        admin.close()


@needs_redis
def test_a_compromised_trainer_cannot_poison_fill_or_erase_samples(roles_cluster, tmp_path) -> None:
    """Issue 35, reproduction 2 and 3 as the trainer's credential: a green image under a red cat's key
    (a valid record), a forged quarantine entry for a good file, junk filling the node, ``SET ... PX 1``
    and every other way to write, expire or delete -- all NOPERM for real on the master that owns the
    key; a fresh victim process still gets the red cat from the cache, and the good file is not skipped."""
    import numpy as np
    import redis

    from client.dataset import CachedImageNet
    from datacache.quarantine import quarantine_value
    from datacache.record import encode_record
    from datacache.warm import warm_cache

    rc = roles_cluster
    src = tmp_path / "ds"
    for c, rgb in (("cat", (220, 20, 20)), ("dog", (20, 20, 220))):
        (src / c).mkdir(parents=True)
        for i in range(2):
            from PIL import Image

            Image.new("RGB", (64, 48), rgb).save(src / c / f"{i}.png")
    rep = warm_cache(str(src), rc.url(DAEMON), workers=1, short_side=32, t1_dir=None, progress=False)
    assert rep.decoded == 4 and rep.write_errors == 0
    victim_view = CachedImageNet(str(src), cache=rc.url(TRAINER), short_side=32, t1_dir=None)
    key, qkey = victim_view.key(0), victim_view.reader.qkey(1)
    green = np.zeros((32, 42, 3), np.uint8)
    green[..., 1] = 255
    forged = encode_record(green, 0, victim_view.variant, key=key)  # a valid (unkeyed) record
    forged_q = quarantine_value(victim_view.manifest.paths[1], victim_view.manifest.identity(1), "forged")
    # one connection per master (the ACL is checked before the slot's owner: every master refuses)
    attackers = [redis.Redis(port=m.port, username=TRAINER, password=rc.password(TRAINER))
                 for m in rc.masters]
    try:
        attempts = [("SET", key, forged), ("SET", qkey, forged_q), ("SET", key, b"x", "PX", "1"),
                    ("SET", b"dc:junk:1", b"\0" * 100_000), ("GETEX", key, "PX", "1"), ("GETDEL", key),
                    ("PEXPIRE", key, "1"), ("EXPIRE", key, "1"), ("APPEND", key, b"x"),
                    ("SETRANGE", key, "0", b"x"), ("PSETEX", key, "1", b"x"), ("SETEX", key, "1", b"x"),
                    ("MSET", key, b"x"), ("SETNX", b"dc:junk:2", b"x"), ("DEL", key), ("UNLINK", key),
                    ("RESTORE", b"dc:junk:3", "0", b"x"), ("COPY", key, b"dc:junk:4"), ("PERSIST", key),
                    ("INCR", b"dc:junk:5"), ("LPUSH", b"dc:junk:6", b"x"), ("HSET", b"dcq:junk", "a", "b")]
        for attacker in attackers:
            for cmd in attempts:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    attacker.execute_command(*cmd)
    finally:
        for attacker in attackers:
            attacker.close()
    victim = CachedImageNet(str(src), cache=rc.url(TRAINER), short_side=32, t1_dir=None)
    out = victim.__getitems__([0, 1, 2, 3])
    cat = out[0][0].permute(1, 2, 0).numpy()
    assert out[0][1] == 0 and (cat[..., 0] > 200).all() and (cat[..., 1] < 40).all()  # red, not green
    st = victim.stats()
    assert st["hits"] == 4 and st["decoded"] == 0 and not victim.quarantined, st


@needs_redis
def test_the_daemon_rechecks_a_quarantine_entry_it_did_not_make(roles_cluster, tmp_path) -> None:
    """A valid-looking quarantine entry for a good file (written here as admin: a stale verdict, or one
    from a writer gone wrong) does not count as done for a daemon: it decodes the file itself, fills the
    sample, and the trainer reads it; a really bad file is remembered and counted once."""
    import redis

    from client.dataset import CachedImageNet
    from datacache.devtools import synth
    from datacache.quarantine import quarantine_value

    rc = roles_cluster
    src = str(tmp_path / "ds")
    synth.make_imagefolder(src, classes=2, per_class=3, size=(96, 80), seed=5)
    (tmp_path / "ds" / "c001" / "zz-bad.JPEG").write_bytes(b"\xff\xd8\xff\xe0" + b"\x13" * 500)
    ds = CachedImageNet(src, cache=rc.url(TRAINER), short_side=32, t1_dir=None)
    man = ds.manifest
    admin = redis.cluster.RedisCluster(host="127.0.0.1", port=rc.masters[0].port, username=ADMIN,
                                       password=rc.password(ADMIN))
    try:
        for i in range(len(ds)):  # every file "known bad", good ones included
            stale = quarantine_value(man.paths[i], man.identity(i), "cannot decode: stale")
            admin.set(ds.reader.qkey(i), stale)
    finally:
        admin.close()
    out = subprocess.run(
        [sys.executable, "-m", "cache_daemon", "--cache", rc.url(DAEMON), "--node", "n0", "--dataset", src,
         "--short-side", "32", "--http-port", "0", "--workers", "1", "--once", "--no-progress",
         "--poll-interval", "1", "--ownership", "all"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    victim = CachedImageNet(src, cache=rc.url(TRAINER), short_side=32, t1_dir=None)
    victim.__getitems__(list(range(len(ds))))
    st = victim.stats()
    assert st["decoded"] == 0 and st["t2"]["known_bad"] == 1 and st["substituted"] == 1, st
    assert list(victim.quarantined) == ["c001/zz-bad.JPEG"]
    assert "stale" not in victim.quarantined["c001/zz-bad.JPEG"]  # the daemon's own verdict replaced it


@needs_redis
def test_trainer_role_cannot_write_the_registry_or_fill_reports(roles_cluster, tmp_path) -> None:
    from cache_daemon.daemon_config import DatasetSpec
    from cache_daemon.registry import REGISTRY_KEY, register
    from datacache.fillstatus import report_fill
    from datacache.stores import open_store

    rc = roles_cluster
    port = rc.masters[0].port
    for cmd in TRAINER_NO_WRITE:
        dry = _cli(rc, port, ADMIN, "acl", "dryrun", TRAINER, *cmd)
        assert "no permissions" in dry, (cmd, dry)
        if cmd[0] in ("hset", "hdel"):  # what the daemons' role exists for
            assert "OK" in _cli(rc, port, ADMIN, "acl", "dryrun", DAEMON, *cmd), cmd
    for m in rc.masters:  # for real, on every master (whichever serves the key's slot)
        for cmd in TRAINER_NO_WRITE:
            reply = _cli(rc, m.port, TRAINER, *cmd)
            assert "NOPERM" in reply or "MOVED" in reply, (cmd, reply)
    # and through the real code: register() / report_fill() as the trainer are refused (NOPERM)
    s = open_store(rc.url(TRAINER))
    try:
        from redis.exceptions import NoPermissionError

        with pytest.raises(NoPermissionError, match="no permissions to run the 'hset'"):
            register(s, DatasetSpec(source=str(tmp_path / "x")), max_registrations=8)
        with pytest.raises(NoPermissionError, match="no permissions to run the 'hset'"):
            report_fill(s, "0123456789abcdef", "t160", "forged", owned=1, done=1, quarantined=0, total=1,
                        rate=0.0)
        assert s.status_get(REGISTRY_KEY) is not None  # reading is allowed (HGETALL)
    finally:
        s.close()


@needs_redis
def test_no_write_command_of_this_server_reaches_the_daemons_keys_as_the_trainer(roles_cluster) -> None:
    """A fuzz over the server's whole command table (``COMMAND`` as admin): every command flagged
    ``write`` whose first argument is a key, aimed at the registry and a fill report with arguments of
    its arity, is refused to the trainers' role by ``ACL DRYRUN`` -- not just the HSET/HDEL the code
    sends (e.g. HINCRBY, HSETEX, RENAME, COPY, RESTORE, SORT ... STORE, OBJECT, EXPIRE)."""
    import redis

    rc = roles_cluster
    port = rc.masters[0].port
    admin = redis.Redis(port=port, username=ADMIN, password=rc.password(ADMIN), decode_responses=True)
    try:
        table = admin.command()
        checked = 0
        for name, info in sorted(table.items()):
            flags = {str(f) for f in info.get("flags", [])}
            if "write" not in flags or int(info.get("first_key_pos", 0)) != 1 or "|" in name:
                continue
            arity = int(info["arity"])
            n = max(abs(arity), 2)
            for key in ("dcd:datasets", "dcd:fill:0123456789abcdef:t160"):
                args = [key] + ["1"] * (n - 2)  # the first argument is the key; the rest of the arity
                reply = admin.execute_command("ACL", "DRYRUN", TRAINER, name, *args)
                assert "no permissions" in str(reply), (name, args, reply)
                checked += 1
        assert checked > 60, checked  # Redis 7 has ~100 such commands: the table was really walked
    finally:
        admin.close()


@needs_redis
@pytest.mark.parametrize("role", [DAEMON, TRAINER])
@pytest.mark.parametrize("cmd", FORBIDDEN, ids=[" ".join(c[:2]) for c in FORBIDDEN])
def test_datacache_roles_are_refused_what_lists_keys_or_destroys(roles_cluster, role: str,
                                                                 cmd: list[str]) -> None:
    rc = roles_cluster
    port = rc.masters[0].port
    # the ACL itself denies it (asked of the server without running it) ...
    dry = _cli(rc, port, ADMIN, "acl", "dryrun", role, *cmd)
    assert "no permissions" in dry, (cmd, dry)
    # ... and sent for real as the role it is refused (DEBUG is refused even before the ACL)
    reply = _cli(rc, port, role, *cmd)
    assert "NOPERM" in reply or (cmd[0] == "debug" and "not allowed" in reply), (cmd, reply)
    assert rc.masters[0].proc is not None and rc.masters[0].proc.poll() is None  # shutdown refused
    assert "evil" not in _cli(rc, port, ADMIN, "acl", "users")


@needs_redis
@pytest.mark.parametrize("role", [DAEMON, TRAINER])
def test_datacache_roles_keys_outside_their_prefixes_are_refused(roles_cluster, role: str) -> None:
    port = roles_cluster.masters[0].port
    assert "NOPERM" in _cli(roles_cluster, port, role, "get", "other:key")
    assert "NOPERM" in _cli(roles_cluster, port, role, "set", "other:key", "1")


@needs_redis
def test_aclfile_instead_of_the_user_lines(tmp_path) -> None:
    # the documented alternative: delete the template's four user lines, point Redis at users.acl
    sec = ensure_passwords(str(tmp_path / "secrets"))
    acl = tmp_path / "users.acl"
    acl.write_text("\n".join(acl_lines(sec.passwords)) + "\n")
    with open(CONF) as f:
        kept = [ln for ln in f.read().splitlines() if not ln.startswith("user ")]
    conf = tmp_path / "redis.conf"
    conf.write_text("\n".join(kept) + f"\naclfile {acl}\n")
    [srv] = _start_masters(str(conf), tmp_path, 1)
    try:
        rc = RoleCluster([srv], sec.dir)
        assert "NOAUTH" in _cli(None, srv.port, None, "ping")
        assert "PONG" in _cli(rc, srv.port, DAEMON, "ping") and "PONG" in _cli(rc, srv.port, TRAINER, "ping")
        assert "NOPERM" in _cli(rc, srv.port, TRAINER, "hset", "dcd:datasets", "a", "b")
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ limits on what is read
@needs_redis
def test_registry_read_is_capped_at_max_registrations(roles_cluster, tmp_path, caplog) -> None:
    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.registry import REGISTRY_KEY
    from cache_daemon.service import Daemon
    from datacache.stores import open_store

    rc = roles_cluster
    allowed = tmp_path / "sets"
    allowed.mkdir()
    specs = [DatasetSpec(source=str(allowed / f"d{i:02d}"), short_side=32) for i in range(40)]
    w = open_store(rc.url(DAEMON))  # a leaked daemon password, bypassing POST's cap: 40 direct HSETs
    try:
        for sp in specs:
            w.status_set(REGISTRY_KEY, sp.ident(), msgpack.packb(sp.__dict__))
        assert len(w.status_get(REGISTRY_KEY)) == 40
    finally:
        w.close()
    cfg = DaemonConfig(cache=rc.url(DAEMON), node="n0", redis_node=rc.masters[0].addr, workers=1,
                       t1_dir="none", allowed_sources=(str(allowed),), max_registrations=8)
    daemons = [Daemon(cfg, progress=False), Daemon(cfg, progress=False)]
    try:
        with caplog.at_level("WARNING", logger="cache_daemon.registry"):
            for _ in range(3):
                for d in daemons:
                    d._sync_registry()
        tracked = [sorted(d.states) for d in daemons]
        # at most max_registrations, the first in field-name order, the same on every daemon
        assert tracked[0] == tracked[1] == sorted(sp.ident() for sp in specs)[:8]
        over = [r for r in caplog.records if "not used" in r.getMessage()]
        assert len(over) == 1 and "holds 40 entries: 32 not used" in over[0].getMessage()  # once, counted
    finally:
        for d in daemons:
            d.store.close()
        c = open_store(rc.url(DAEMON))
        try:
            for sp in specs:
                c.status_del(REGISTRY_KEY, sp.ident())
        finally:
            c.close()


@needs_redis
def test_registry_skips_are_logged_once_and_bounded(roles_cluster, tmp_path, caplog) -> None:
    from cache_daemon.registry import MAX_EXAMINED, MAX_LOGGED_PER_READ, REGISTRY_KEY, registered
    from datacache.stores import open_store

    rc = roles_cluster
    allowed = tmp_path / "ok"
    allowed.mkdir()
    s = open_store(rc.url(DAEMON))
    names = [f"bad-{i:05d}" for i in range(MAX_EXAMINED + 500)]  # junk, more than a read parses
    try:
        for name in names:
            s.status_set(REGISTRY_KEY, name, b"\xc1 not msgpack")
        big = {"source": str(allowed / "x"), "short_side": 32, "encoding": "raw", "revalidate": "dirs",
               "pad": "p" * 9000}
        s.status_set(REGISTRY_KEY, "a-big", msgpack.packb(big))  # over 8 KB: skipped unparsed
        with caplog.at_level("WARNING", logger="cache_daemon.registry"):
            for _ in range(3):
                assert registered(s, (str(allowed),), max_registrations=8) == []
        msgs = [r.getMessage() for r in caplog.records]
        one_by_one = [m for m in msgs if m.startswith("skipping registry entry")]
        assert len(one_by_one) == MAX_LOGGED_PER_READ  # the first 10 of the first read, none repeated
        assert "a-big" in one_by_one[0] and "more than 8192" in one_by_one[0]
        summary = [m for m in msgs if "entries skipped as invalid" in m]
        assert len(summary) == 1 and f"{MAX_EXAMINED} entries skipped" in summary[0]
        over = [m for m in msgs if "not used" in m]
        assert len(over) == 1 and "501 not used" in over[0] and "parses at most 4096" in over[0]
        assert len(msgs) == MAX_LOGGED_PER_READ + 2  # bounded, whatever the registry holds
    finally:
        for name in [*names, "a-big"]:
            s.status_del(REGISTRY_KEY, name)
        s.close()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


@needs_redis
def test_a_forged_18mb_fill_report_leaves_status_small(roles_cluster, tmp_path) -> None:
    from datacache.devtools import synth
    from datacache.fillstatus import MAX_REPORTS, status_key
    from datacache.stores import open_store

    rc = roles_cluster
    _reset_acl_log(rc)
    src = str(tmp_path / "ds")
    synth.make_imagefolder(src, classes=2, per_class=4, size=(96, 80), seed=5)
    http = free_ports(1)
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.Popen([sys.executable, "-m", "cache_daemon", "--cache", rc.url(DAEMON), "--redis-node",
                          rc.masters[0].addr, "--node", "n0", "--dataset", src, "--http-port", str(http),
                          "--workers", "1", "--no-progress", "--poll-interval", "1", "--ownership", "all"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    w = open_store(rc.url(DAEMON))
    try:
        deadline = time.monotonic() + 120
        ds: dict = {}
        while time.monotonic() < deadline:  # the daemon's own report is in: its dataset is full
            assert p.poll() is None, p.stderr.read()[-3000:] if p.stderr else ""
            try:
                ds = json.loads(_get(f"http://127.0.0.1:{http}/status"))["datasets"][0]
                if ds["status"] == "full" and ds["cluster"]["nodes"]:
                    break
            except (OSError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.2)
        assert ds.get("status") == "full", ds
        before = len(_get(f"http://127.0.0.1:{http}/status"))
        key = status_key(ds["fingerprint"], ds["variant"])
        good = {"owned": 1, "done": 1, "quarantined": 0, "total": 8, "rate": 1.0, "updated": time.time()}
        # forged as the daemons' role (the trainers' cannot write dcd:*): 18 MB of junk in one report that
        # type-checks, small reports with extra fields, thousands of node names, bad numbers
        w.status_set(key, "forged-big", msgpack.packb({**good, "junk": "x" * (18 << 20)}))
        extra = {**good, "note": "y" * 500, "nested": {"a": [1] * 50}}  # under the size bound
        w.status_set(key, "forged-extra", msgpack.packb(extra))
        w.status_set(key, "forged-nan", msgpack.packb({**good, "rate": float("nan")}))
        w.status_set(key, "forged-huge", msgpack.packb({**good, "total": 2**62}))
        w.status_set(key, "forged-bool", msgpack.packb({**good, "done": True}))
        w.status_set(key, "z" * 5000, msgpack.packb(good))  # a 5000-byte node name
        for i in range(3000):  # names sorting after the real node's ("n0"): the bound keeps the first
            w.status_set(key, f"x-flood-{i:05d}", msgpack.packb(good))
        body = _get(f"http://127.0.0.1:{http}/status")
        print(f"/status: {len(body)} bytes after the forgery, {before} before")  # shown with -s
        doc = json.loads(body)
        nodes = doc["datasets"][0]["cluster"]["nodes"]
        assert len(nodes) == MAX_REPORTS and "forged-big" not in nodes  # over the size bound: ignored
        assert nodes["n0"]["done"] == nodes["n0"]["owned"] == 8  # the real report is still read
        assert nodes["forged-extra"] == good  # only the known fields, copied into a new dict
        assert not {"forged-nan", "forged-huge", "forged-bool", "z" * 5000} & set(nodes)
        # bounded: ~200 bytes per considered report, whatever the hash holds (18 MB + 3000 fields)
        assert len(body) < before + MAX_REPORTS * 256, (len(body), before)
        assert len(body) < 400_000
        # the daemon's HTTP paths as its role (each asks Redis something): nothing refused by the ACL
        for path in ("/health", "/livez", "/readyz", "/metrics"):
            assert _get(f"http://127.0.0.1:{http}{path}")
        assert _acl_denials(rc) == {}
    finally:
        w.close()
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        if ds.get("fingerprint"):  # the forged hash goes (as admin: the datacache roles cannot DEL)
            forged = status_key(ds["fingerprint"], ds["variant"]).decode()
            _cli(rc, rc.masters[0].port, ADMIN, "-c", "del", forged)
