"""The Redis ACL roles of a datacache cluster: one role per credential, each allowed what its code sends.

* ``admin`` -- cluster creation (``redis-cli --cluster create``), resharding, replication: everything.
  Operators only; no datacache process holds it.
* ``datacache-daemon`` -- the cache daemons: samples (``GET``/``SET``/``EXISTS`` on ``dc:*``, and ``DEL``:
  the rolling fill's evictions), remembered bad files (``dcq:*``), fill reports and the dataset registry
  (``HSET``/``HGETALL``/``HDEL`` on ``dcd:*``), the trainers' run plans read-only (``GETRANGE``/``PTTL``
  on ``dcp:*``: a bounded read, and the record's expiry), and the read-only cluster/info commands of
  their health checks, memory budget and idle passes (``INFO``, ``DBSIZE``,
  ``CLUSTER SLOTS|SHARDS|INFO|COUNTKEYSINSLOT``).
* ``datacache`` -- trainers (``CachedImageNet``, ``datacache stats``, ``wait_warm``, a run's plan):
  ``GET``/``EXISTS`` on samples (``dc:*``) and remembered bad files (``dcq:*``), ``HGETALL`` on fill
  reports (``dcd:*``), all ``%R~`` (read-only), and ``SET``/``GET`` on run plans (``dcp:*``,
  :mod:`datacache.run_plan`), the one pattern it may write. So a compromised training job cannot poison
  or erase what other jobs read: a miss is decoded locally and served, filling is the daemons' job (and
  ``datacache warm`` run by an operator with the daemons' credential). What it can write is plan
  records: at worst a forged plan changes which samples a rolling fill keeps (the hit ratio), or
  junk under ``dcp:*`` uses memory up to ``maxmemory`` (the daemons' writes then fail and are counted);
  never a sample's bytes.

Neither datacache role may list key names (``SCAN``, ``KEYS``, ``CLUSTER GETKEYSINSLOT``), flush
(``FLUSH*``), run scripts, change the config or manage users; only the daemons may ``DEL`` (the rolling
fill deletes samples this epoch has read). ``-@all`` comes first so commands added by later Redis
versions are never granted by accident.

``deploy/redis/redis.conf`` carries the same rules (``tests/test_redis_conf.py`` checks they agree and
runs every role's real code path against servers started with the file) with placeholder password
hashes that ``redis-server`` refuses at start. :func:`fill_template` puts real ``#<sha256>`` hashes
there; :mod:`datacache.make_secrets` generates the passwords. Stdlib only: the local-cluster launcher
runs it with any python3.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

ADMIN = "admin"
DAEMON = "datacache-daemon"
TRAINER = "datacache"
ROLES = (ADMIN, DAEMON, TRAINER)

_CONNECT = "+ping +auth +hello +client|setname"  # redis-py's connection set-up and health pings
_CLUSTER_READ = "+info +dbsize +cluster|slots +cluster|shards +cluster|info"
RULES: dict[str, str] = {
    ADMIN: "~* &* +@all",
    DAEMON: ("resetchannels ~dc:* ~dcq:* ~dcd:* %R~dcp:* -@all +get +set +exists +del +hset +hgetall +hdel "
             f"+getrange +pttl {_CLUSTER_READ} +cluster|countkeysinslot {_CONNECT}"),
    # read-only key patterns (%R~) on everything but its run plans (dcp:*, SET only): a trainer cannot
    # write a sample, a quarantine entry or a fill report
    TRAINER: f"resetchannels %R~dc:* %R~dcq:* %R~dcd:* %RW~dcp:* -@all +get +exists +hgetall +set "
             f"{_CLUSTER_READ} {_CONNECT}",
}
PLACEHOLDER = "CHANGE_ME"  # in a template's password hashes, and refused in any password the daemon uses
# a template's ACL line: "user NAME on #CHANGE_ME... RULES" -- redis-server refuses to start with it (a
# password hash must be exactly 64 lowercase hex characters), so a template never runs with a known password
_USER_LINE = re.compile(r"^user\s+(\S+)\s+on\s+#(\S+)\s+(.*?)\s*$", re.MULTILINE)


class RolesError(ValueError):
    """A template or a password that cannot be used, with the file/role and what to do."""


def password_hash(password: str) -> str:
    """The ``#<hash>`` Redis stores for ``password`` (SHA-256, lowercase hex): safe to show, since the
    passwords :mod:`datacache.make_secrets` generates are 256-bit random."""
    return hashlib.sha256(password.encode("utf-8")).hexdigest()


def acl_line(role: str, password: str) -> str:
    """``user ROLE on #<sha256> RULES`` -- a redis.conf / ACL-file line that never holds the password."""
    return f"user {role} on #{password_hash(password)} {RULES[role]}"


def acl_lines(passwords: Mapping[str, str]) -> list[str]:
    """The ACL file for ``passwords`` (every role): the default user off, then one line per role."""
    missing = [r for r in ROLES if not passwords.get(r)]
    if missing:
        raise RolesError(f"no password for role(s) {', '.join(missing)}")
    return ["user default off", *(acl_line(r, passwords[r]) for r in ROLES)]


def server_acl_args(passwords: Mapping[str, str]) -> list[str]:
    """``redis-server`` command-line arguments defining every role: hashes only, never a password (the
    command line is public in ``ps``)."""
    args: list[str] = []
    for line in acl_lines(passwords):
        args += ["--user", *line.split()[1:]]
    return args


def template_rules(text: str) -> dict[str, str]:
    """role -> rules of the ``user`` lines of a redis.conf text (for the drift check of the tests)."""
    return {m.group(1): m.group(3) for m in _USER_LINE.finditer(text)}


def fill_template(text: str, passwords: Mapping[str, str], *, where: str = "redis.conf") -> str:
    """``text`` (a redis.conf template) with each role's placeholder hash replaced by its real hash.

    Every role of :data:`ROLES` must have a ``user ROLE on #CHANGE_ME...`` line; RolesError when one is
    missing, when a line's hash is neither a placeholder nor a real hash, or when a placeholder is left
    anywhere outside comments afterwards."""
    seen: set[str] = set()

    def sub(m: re.Match[str]) -> str:
        role, token, rules = m.group(1), m.group(2), m.group(3)
        if role not in passwords:
            return m.group(0)
        if not token.startswith(PLACEHOLDER):
            raise RolesError(f"{where}: the line of user {role!r} has no #{PLACEHOLDER}... placeholder to "
                             "fill (it already carries a hash?); start from deploy/redis/redis.conf")
        seen.add(role)
        return f"user {role} on #{password_hash(passwords[role])} {rules}"

    out = _USER_LINE.sub(sub, text)
    missing = [r for r in passwords if r not in seen]
    if missing:
        raise RolesError(f"{where}: expected the placeholder line 'user {missing[0]} on #{PLACEHOLDER}... "
                         f"RULES' (ACL passwords) and did not find it; start from deploy/redis/redis.conf")
    left = [n for n, ln in enumerate(out.splitlines(), 1)
            if PLACEHOLDER in ln and not ln.lstrip().startswith("#")]
    if left:
        raise RolesError(f"{where}: line {left[0]} still holds a {PLACEHOLDER} placeholder after filling; "
                         "set that password too (python -m datacache.make_secrets DIR)")
    return out


def placeholder_password(cache_url: str) -> str | None:
    """The first Redis tier of ``cache_url`` whose password (inline, or read from ``?password_file=``)
    contains :data:`PLACEHOLDER`, redacted, or None. ConfigError when the password file cannot be read."""
    from datacache.cacheurl import parse_cache_url, redact
    from datacache.stores.redis_common import password_of, split_userinfo

    for tier in parse_cache_url(cache_url).tiers:
        if tier.scheme not in ("redis", "rediss", "redis+cluster"):
            continue
        _user, inline, _rest = split_userinfo(tier.location, tier.url)
        password = password_of(tier, inline)
        if password and PLACEHOLDER in password:
            return redact(tier.url)
    return None
