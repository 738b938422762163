"""Daemon configuration: a TOML file (``/etc/datacache/daemon.toml``) with environment overrides.

Example (``deploy/daemon.toml`` is the documented template)::

    node = "node-1"                              # name in fill reports (default: the hostname)
    cache = "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
    redis_node = "10.0.0.1:7000"                 # the master on THIS node: ingest the keys it serves
    ownership = "cluster"                        # cluster | hash | all
    workers = 8                                  # decode processes (default: all cores)
    decoder = "pillow"                           # pillow | dali
    decoder_device = "auto"                      # dali: auto | cpu | gpu (auto: GPU when NVML sees one)
    gpu_decode_workers = 0                       # dali on GPU: decode processes (0 = one per visible GPU)
    memory_budget = "200GiB"                     # MinIO policy: stop filling this node's master here
    http_host = "127.0.0.1"
    http_port = 8470
    poll_interval = 30.0                         # seconds between fill passes / registry checks
    pass_timeout = 0                             # a pass running longer fails /health (0 = from the work)
    drain_timeout = 30.0                         # SIGTERM: drain at most this long, then kill the pool
    verify_interval = 600.0                      # an idle pass trusts "nothing removed" this long (0 = never)
    rolling_fill = true                          # fill in the order live runs will read (their plans)

    api_token_file = "/etc/datacache/api-token"  # or api_token = "..."; needed for POST/DELETE /datasets
    allowed_sources = ["/mnt/nfs/imagenet"]      # URL prefixes that POST /datasets may register from
    max_registrations = 16                       # registrations kept in Redis at most
    max_list_bytes = "1GiB"                      # a .txt/.csv file list: read at most this (every pass)
    max_list_lines = 33554432                    # ... and at most this many lines
    record_key_file = "/etc/datacache/record-key"  # optional: keyed MAC on records (trainers use the same)

    [[datasets]]
    source = "/mnt/nfs/imagenet/train"
    short_side = 160                             # 1..2048

Every top-level key can be overridden by ``DATACACHE_DAEMON_<KEY>`` (upper case), e.g.
``DATACACHE_DAEMON_CACHE=redis://127.0.0.1:6379``, ``DATACACHE_DAEMON_HTTP_PORT=9000``. An unknown key,
a wrong type or an invalid choice is a :class:`~datacache.config.ConfigError` that names the key
(and where it came from) and lists the valid keys or values.

Ownership (see :mod:`cache_daemon.ownership`): ``cluster`` -- the keys whose slots ``redis_node``
serves (Redis Cluster); ``hash`` -- ``xxh3_64(key) % world_size == rank`` for a plain node list;
``all`` -- every key (one daemon).
"""

from __future__ import annotations

import math
import os
import posixpath
import socket
import tomllib
import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any

from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError, Variant
from datacache.filelist import MAX_LIST_BYTES, MAX_LIST_LINES, ListLimits, list_limits_problem
from datacache.options import choice, parse_hostport, parse_size
from datacache.redact import redact, register_secret
from datacache.secretfile import read_secret_file

OWNERSHIP_CHOICES = ("cluster", "hash", "all")
DECODER_CHOICES = ("pillow", "dali")
DECODER_DEVICE_CHOICES = ("auto", "cpu", "gpu")
ENV_PREFIX = "DATACACHE_DAEMON_"
DEFAULT_CONFIG = "/etc/datacache/daemon.toml"
SHORT_SIDE_MAX = 2048  # a 2048-px raw record is ~25 MB; larger is a mistake, not a variant
MAX_REGISTRATIONS_MAX = 1024
BYTES = {"kind": "bytes"}  # field metadata: a byte size (200GiB) in TOML and the environment
SECRET_KEYS = ("api_token", "cache")  # values never echoed in an error (the cache URL may hold a password)


def normalize_source(url: str) -> tuple[str, str, str]:
    """(scheme, host, path) of a source for prefix checks: local paths resolved (``..``, symlinks),
    URL paths normalised (``..`` removed), scheme and host lower-cased. Raises ConfigError for junk."""
    if not isinstance(url, str) or not url or "\x00" in url:
        raise ConfigError(f"source {redact(url)!r} must be a non-empty path or URL")
    if "://" not in url or url.startswith("file://"):
        path = url[len("file://"):] if url.startswith("file://") else url
        return "file", "", os.path.realpath(os.path.abspath(path))
    try:
        u = urllib.parse.urlsplit(url)
        host = (u.hostname or "").lower()
        port = f":{u.port}" if u.port is not None else ""
    except ValueError as e:
        raise ConfigError(f"source {redact(url)!r} is not a valid URL ({e})") from None
    if "%" in u.path or "\\" in u.path or ";" in u.path:
        # a server may decode %2e%2e / %2f (or treat "\\" or ";" specially) after our check: refuse them
        raise ConfigError(f"source {redact(url)!r}: percent-encoded characters, backslashes and ';' "
                          "parameters are not allowed in a source URL's path (write the path plainly)")
    path = posixpath.normpath("/" + u.path.lstrip("/")) if u.path else "/"
    return u.scheme.lower(), host + port, path.replace("//", "/")


def source_allowed(source: str, allowed: tuple[str, ...]) -> bool:
    """True when ``source`` lies under one of the ``allowed`` prefixes (same scheme and host, path equal
    or below on a segment boundary: ``/data/imagenet-evil`` is not under ``/data/imagenet``)."""
    try:
        scheme, host, path = normalize_source(source)
    except ConfigError:
        return False
    for prefix in allowed:
        ps, ph, pp = normalize_source(prefix)
        if (ps, ph) == (scheme, host) and (path == pp or path.startswith(pp.rstrip("/") + "/")):
            return True
    return False


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset to keep warm: its source URL and the cached variant."""

    source: str
    short_side: int = 160
    encoding: str = "raw"
    revalidate: str = "dirs"

    def variant(self) -> Variant:
        return Variant(short_side=self.short_side, encoding=self.encoding)

    def ident(self) -> str:
        return f"{self.source}|{self.variant().tag()}"

    @classmethod
    def from_dict(cls, d: Any, where: str) -> DatasetSpec:
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: a dataset must be a table with source = \"...\", got a "
                              f"{type(d).__name__}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ConfigError(f"{where}: unknown dataset key(s) {', '.join(unknown)}; valid keys: "
                              f"{', '.join(sorted(valid))}")
        if not isinstance(d.get("source"), str) or not d["source"]:
            raise ConfigError(f"{where}: dataset key 'source' must be a non-empty string (a path or fsspec "
                              "URL)")
        if len(d["source"]) > 4096 or "\x00" in d["source"]:
            raise ConfigError(f"{where}: dataset key 'source' must be a path or URL of at most 4096 "
                              "characters")
        short = d.get("short_side", 160)
        if not isinstance(short, int) or isinstance(short, bool) or not 1 <= short <= SHORT_SIDE_MAX:
            raise ConfigError(f"{where}: dataset key 'short_side' must be an integer in 1..{SHORT_SIDE_MAX}, "
                              f"got {short!r}")
        from datacache.config import ENCODING_CHOICES
        from datacache.manifest import REVALIDATE_CHOICES

        for key, default, choices in (("encoding", "raw", ENCODING_CHOICES),
                                      ("revalidate", "dirs", REVALIDATE_CHOICES)):
            choice(f"{where}: dataset key {key}", d.get(key, default), choices)
        return cls(source=d["source"], short_side=short, encoding=d.get("encoding", "raw"),
                   revalidate=d.get("revalidate", "dirs"))


@dataclass(frozen=True)
class DaemonConfig:
    """Typed daemon configuration (see the module docstring)."""

    cache: str = ""
    node: str = field(default_factory=socket.gethostname)
    redis_node: str = ""
    ownership: str = ""  # "" = cluster for redis+cluster:// caches, all otherwise
    rank: int = 0
    world_size: int = 1
    workers: int = 0  # 0 = all cores
    decoder: str = "pillow"
    decoder_device: str = "auto"  # dali only: auto | cpu | gpu
    gpu_decode_workers: int = 0  # dali on a GPU: decode processes (0 = one per visible GPU)
    memory_budget: int = field(default=0, metadata=BYTES)  # 0 = the master's maxmemory (or no budget)
    http_host: str = "127.0.0.1"
    http_port: int = 8470
    poll_interval: float = 30.0
    pass_timeout: float = 0.0  # seconds a pass may run before /health fails; 0 = derived from the work
    drain_timeout: float = 30.0  # seconds SIGTERM waits for the drain before it kills the decode pool
    verify_interval: float = 600.0  # seconds an idle pass may trust "nothing removed" (0 = check every key)
    # datasets with a live run plan (datacache.run_plan): fill in the order the runs will read, delete what
    # every run has read this epoch (cache_daemon.rolling); false = MinIO for every dataset
    rolling_fill: bool = True
    t1_dir: str = "default"
    t1_max_bytes: int = field(default=0, metadata=BYTES)
    api_token: str = field(default="", repr=False)
    api_token_file: str = ""
    record_key_file: str = ""  # secret for the records' keyed MAC (datacache.record); "" = unkeyed xxh3
    allowed_sources: tuple[str, ...] = ()
    max_registrations: int = 16
    # every read of a .txt/.csv list (POST /datasets, each pass): datacache.filelist.ListLimits
    max_list_bytes: int = field(default=MAX_LIST_BYTES, metadata=BYTES)
    max_list_lines: int = MAX_LIST_LINES
    datasets: tuple[DatasetSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.cache:
            raise ConfigError("daemon config: key 'cache' is required (e.g. cache = "
                              "\"redis+cluster://10.0.0.1:7000,10.0.0.2:7000\")")
        spec = parse_cache_url(self.cache)
        _refuse_placeholder_password(self.cache)
        own = self.ownership or ("cluster" if spec.tiers[-1].scheme == "redis+cluster" else "all")
        object.__setattr__(self, "ownership", own)
        choice("daemon config: key ownership", own, OWNERSHIP_CHOICES)
        choice("daemon config: key decoder", self.decoder, DECODER_CHOICES)
        choice("daemon config: key decoder_device", self.decoder_device, DECODER_DEVICE_CHOICES)
        if own == "cluster" and spec.tiers[-1].scheme != "redis+cluster":
            raise ConfigError("daemon config: ownership = \"cluster\" needs a redis+cluster:// cache; "
                              f"got {spec.url} (use ownership = \"hash\" with rank/world_size, or \"all\")")
        if own == "cluster" and not self.redis_node:
            raise ConfigError("daemon config: key 'redis_node' is required with ownership = \"cluster\": the "
                              "host:port of the Redis master on this node (its keys are ingested here)")
        if own == "hash" and not 0 <= self.rank < self.world_size:
            raise ConfigError(f"daemon config: rank must be in 0..world_size-1 "
                              f"(world_size={self.world_size}), got {self.rank}")
        for name in ("workers", "gpu_decode_workers", "memory_budget", "t1_max_bytes", "rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"daemon config: key {name!r} must be >= 0, got {getattr(self, name)}")
        if self.world_size < 1:
            raise ConfigError(f"daemon config: key 'world_size' must be >= 1, got {self.world_size}")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"daemon config: key 'http_port' must be in 0..65535 (0 = any free port), "
                              f"got {self.http_port}")
        if not 1 <= self.max_registrations <= MAX_REGISTRATIONS_MAX:
            raise ConfigError(f"daemon config: key 'max_registrations' must be in "
                              f"1..{MAX_REGISTRATIONS_MAX}, got {self.max_registrations}")
        why = list_limits_problem(self.max_list_bytes, self.max_list_lines)
        if why:
            raise ConfigError(f"daemon config: key {why} (a .txt/.csv list larger than this is refused)")
        for name in ("node", "http_host"):
            if not getattr(self, name).strip():
                raise ConfigError(f"daemon config: key {name!r} must be a non-empty string")
        from datacache.fillstatus import MAX_NODE_NAME

        if len(self.node.encode("utf-8", "replace")) > MAX_NODE_NAME:  # readers drop longer report names
            raise ConfigError(f"daemon config: key 'node' must be at most {MAX_NODE_NAME} bytes (it names "
                              f"this daemon's fill reports), got {len(self.node.encode('utf-8', 'replace'))}")
        if self.redis_node:
            parse_hostport(self.redis_node, "daemon config: key 'redis_node'")
        v = self.poll_interval
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"daemon config: key 'poll_interval' must be a finite number of seconds > 0, "
                              f"got {v}")
        hints = {"pass_timeout": " (0 = derived from the work)", "verify_interval": " (0 = check every key "
                 "every pass)"}
        for name, low in (("pass_timeout", 0.0), ("drain_timeout", 0.1), ("verify_interval", 0.0)):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= low):
                hint = hints.get(name, "")
                raise ConfigError(f"daemon config: key {name!r} must be a finite number of seconds >= "
                                  f"{low:g}{hint}, got {v}")
        for prefix in self.allowed_sources:
            try:
                normalize_source(prefix)
            except ConfigError as e:
                raise ConfigError(f"daemon config: key 'allowed_sources': {e}") from None
        # api_token (e.g. from DATACACHE_DAEMON_API_TOKEN) wins over api_token_file; the file's token is
        # stored in api_token, so dataclasses.replace() keeps it without reading the file again
        if self.api_token_file and not self.api_token:
            token = read_secret_file(self.api_token_file, what="daemon config: key 'api_token_file'")
            object.__setattr__(self, "api_token", token)
        if self.api_token and not 16 <= len(self.api_token) <= 4096:
            raise ConfigError("daemon config: the API token must be 16..4096 characters "
                              "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        register_secret(self.api_token)  # (a valid one only) masked in any log line that quotes it
        if self.record_key_file:  # read and checked at start (ConfigError naming the file, never the key)
            from datacache.record import load_record_key

            try:
                load_record_key(self.record_key_file)
            except ConfigError as e:
                raise ConfigError(f"daemon config: key 'record_key_file': {e}") from None


def list_limits(cfg: DaemonConfig) -> ListLimits:
    """The bounds of every read of a file list by this daemon (registration and each pass alike)."""
    return ListLimits(cfg.max_list_bytes, cfg.max_list_lines)


def _refuse_placeholder_password(cache: str) -> None:
    """A template's placeholder password (``CHANGE_ME``, inline or in the ``?password_file=``) never runs:
    ConfigError naming the key and how to generate real ones (never the password itself)."""
    from datacache.redis_roles import placeholder_password

    try:
        tier = placeholder_password(cache)
    except ConfigError as e:  # the password file cannot be read: say which key it came from
        raise ConfigError(f"daemon config: key 'cache': {e} (the cluster's passwords come from `python -m "
                          "datacache.make_secrets DIR`: the daemons use DIR/datacache-daemon.pass)") from None
    if tier:
        raise ConfigError(f"daemon config: key 'cache': the Redis password of {tier} is a template "
                          "placeholder (it contains CHANGE_ME); generate real ones with `python -m "
                          "datacache.make_secrets /etc/datacache/secrets` and name the daemons' file instead "
                          "of a password: cache = "
                          "\"redis+cluster://datacache-daemon@h1:7000,h2:7000?password_file=/etc/datacache/"
                          "secrets/datacache-daemon.pass\"")


# The TOML / environment kind of every top-level key, derived from DaemonConfig's fields (their annotation,
# or metadata["kind"] for byte sizes): a new field is a config key without being written down twice.
_ANNOTATION_KINDS: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool,
                                     "tuple[str, ...]": "list"}
_KINDS: dict[str, Any] = {f.name: f.metadata.get("kind") or _ANNOTATION_KINDS[str(f.type)]
                          for f in fields(DaemonConfig) if f.name != "datasets"}


def _coerce(key: str, value: Any, where: str) -> Any:
    kind = _KINDS[key]
    if kind == "list":  # a TOML array of strings, or a comma-separated string (environment)
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
            raise ConfigError(f"{where}: key {key!r} must be a list of non-empty strings (URL prefixes), "
                              f"got {value!r}")
        return tuple(x.strip() for x in items)
    if kind == "bytes":
        v = parse_size(value)
        if v is None or v < 0:
            raise ConfigError(f"{where}: key {key!r} must be a byte size such as 200GiB or 1000000, "
                              f"got {value!r}")
        return v
    if kind is bool:  # TOML true/false; the environment's 1/0, true/false, yes/no
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: key {key!r} must be true or false, got {value!r}")
    if kind is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: key {key!r} must be an integer, got {value!r}") from None
    if kind is float and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):
            raise ConfigError(f"{where}: key {key!r} must be a number of seconds, got {value!r}") from None
    if not isinstance(value, kind) or isinstance(value, bool):
        got = f"a {type(value).__name__}" if key in SECRET_KEYS else repr(value)  # never echo a secret
        raise ConfigError(f"{where}: key {key!r} must be {kind.__name__}, got {got}")
    return value


def load_config(path: str | None = None, *, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """TOML file (optional) <- ``DATACACHE_DAEMON_*`` environment <- ``overrides`` (command line)."""
    env = dict(os.environ if env is None else env)
    raw: dict[str, Any] = {}
    where = "daemon config"
    if path:
        where = path
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found (see deploy/daemon.toml for a template)"
                              ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    valid = sorted([*_KINDS, "datasets"])
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    values: dict[str, Any] = {k: _coerce(k, v, where) for k, v in raw.items() if k != "datasets"}
    for key in _KINDS:
        if ENV_PREFIX + key.upper() in env:
            var = ENV_PREFIX + key.upper()
            values[key] = _coerce(key, env[var], f"environment {var}")
    unknown_env = sorted(k for k in env
                         if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() not in _KINDS)
    if unknown_env:
        raise ConfigError(f"environment: unknown variable(s) {', '.join(unknown_env)}; valid: "
                          f"{', '.join(ENV_PREFIX + k.upper() for k in _KINDS)}")
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, "command line")
    ds = raw.get("datasets", [])
    if not isinstance(ds, list):
        raise ConfigError(f"{where}: 'datasets' must be an array of tables ([[datasets]])")
    values["datasets"] = tuple(DatasetSpec.from_dict(d, f"{where}: datasets[{i}]") for i, d in enumerate(ds))
    return DaemonConfig(**values)
