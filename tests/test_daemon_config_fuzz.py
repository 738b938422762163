"""Daemon config range checks (each a one-line ConfigError naming the key) and a loader fuzz."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from cache_daemon.daemon_config import DaemonConfig, load_config
from datacache.config import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = 'cache = "redis://127.0.0.1:6399"\n'

BAD = [  # (toml after BASE, words the error must contain)
    ('http_port = 99999\n', ["http_port", "0..65535"]),
    ('http_port = -1\n', ["http_port", "0..65535"]),
    ('node = ""\n', ["node", "non-empty"]),
    ('node = "   "\n', ["node", "non-empty"]),
    ('http_host = ""\n', ["http_host", "non-empty"]),
    ('poll_interval = nan\n', ["poll_interval", "finite"]),
    ('poll_interval = inf\n', ["poll_interval", "finite"]),
    ('poll_interval = 0\n', ["poll_interval", "> 0"]),
    ('pass_timeout = -3.0\n', ["pass_timeout", ">= 0"]),
    ('drain_timeout = inf\n', ["drain_timeout", "finite"]),
    ('world_size = 0\n', ["world_size", ">= 1"]),
    ('max_registrations = 0\n', ["max_registrations", "1..1024"]),
    ('allowed_sources = "x"\nallowed_sources2 = 1\n', ["unknown key", "allowed_sources2"]),
    ('allowed_sources = [1]\n', ["allowed_sources", "list of non-empty strings"]),
    ('api_token = "short"\n', ["token", "16"]),
    ('api_token_file = "/nonexistent/token"\n', ["api_token_file", "/nonexistent/token"]),
    ('redis_node = "host"\n', ["redis_node", "host:port"]),
    ('redis_node = "h:70000"\n', ["redis_node", "1..65535"]),
    ('memory_budget = -5\n', ["memory_budget"]),
    ('[[datasets]]\nsource = "/d"\nrevalidate = ["a"]\n', ["datasets[0]", "revalidate", "dirs, full, none"]),
    ('[[datasets]]\nsource = "/d"\nencoding = 5\n', ["datasets[0]", "encoding", "raw, jpeg"]),
    ('[[datasets]]\nsource = "/d"\nshort_side = 5000\n', ["short_side", "1..2048"]),
    ('[[datasets]]\nsource = "/d"\nshort_side = 2.5\n', ["short_side", "1..2048"]),
    ('[[datasets]]\nsource = ["/d"]\n', ["source", "non-empty string"]),
    ('datasets = [1]\n', ["datasets[0]", "table"]),
]


@pytest.mark.parametrize("toml,words", BAD, ids=[b[0].strip()[:40] for b in BAD])
def test_bad_values_are_one_line_config_errors_naming_the_key(tmp_path, toml: str, words: list[str]) -> None:
    path = tmp_path / "d.toml"
    path.write_text(BASE + toml)
    with pytest.raises(ConfigError) as ei:
        load_config(str(path), env={})
    msg = str(ei.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_env_values_are_checked_like_the_file() -> None:
    for var, value, word in [("HTTP_PORT", "99999", "http_port"), ("POLL_INTERVAL", "nan", "poll_interval"),
                             ("POLL_INTERVAL", "1e999", "poll_interval"), ("NODE", "", "node"),
                             ("MAX_REGISTRATIONS", "x", "max_registrations")]:
        with pytest.raises(ConfigError, match=word):
            load_config(None, env={"DATACACHE_DAEMON_CACHE": "redis://h:1", f"DATACACHE_DAEMON_{var}": value})
    cfg = load_config(None, env={"DATACACHE_DAEMON_CACHE": "redis://h:1",
                                 "DATACACHE_DAEMON_ALLOWED_SOURCES": "/data/a, s3://b/c",
                                 "DATACACHE_DAEMON_API_TOKEN": "t" * 20, "DATACACHE_DAEMON_HTTP_PORT": "0"})
    assert cfg.allowed_sources == ("/data/a", "s3://b/c") and cfg.api_token == "t" * 20 and cfg.http_port == 0


def test_token_file_is_read_and_never_printed(tmp_path) -> None:
    tok = tmp_path / "token"
    tok.write_text("file-token-0123456789\n")
    os.chmod(tok, 0o600)  # a secret file must be private (read_secret_file refuses 0644)
    cfg_path = tmp_path / "d.toml"
    cfg_path.write_text(BASE + f'api_token_file = "{tok}"\nallowed_sources = ["/data"]\n')
    assert load_config(str(cfg_path), env={}).api_token == "file-token-0123456789"
    over = load_config(str(cfg_path), env={"DATACACHE_DAEMON_API_TOKEN": "env-token-0123456789"})
    assert over.api_token == "env-token-0123456789"  # the environment overrides the file
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_DAEMON_")}
    out = subprocess.run([sys.executable, "-m", "cache_daemon", "--config", str(cfg_path), "--check"],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "file-token-0123456789" not in out.stdout and '"api_token": "<set>"' in out.stdout


@pytest.mark.parametrize("toml", ['http_port = 99999\n', 'node = ""\n', 'poll_interval = nan\n',
                                  '[[datasets]]\nsource = "/d"\nrevalidate = ["a"]\n',
                                  '[[datasets]]\nsource = "/d"\nencoding = 5\n'])
def test_check_refuses_the_same(tmp_path, toml: str) -> None:
    path = tmp_path / "d.toml"
    path.write_text(BASE + toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_DAEMON_")}
    out = subprocess.run([sys.executable, "-m", "cache_daemon", "--config", str(path), "--check"],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "config error" in out.stderr


def _toml_value(rng: random.Random, depth: int = 0) -> str:
    choices = ['""', '"x"', '"127.0.0.1"', '"h:7000"', '"/data"', '"redis://127.0.0.1:1"', "0", "1", "-1",
               "65536", "99999999999999999999", "1.5", "-0.0", "nan", "inf", "-inf", "true", "false",
               '"1GiB"', '"abc"', '"raw"', '"jpeg"', '"dirs"', '"bogus"', '"\\u0000"', "1979-05-27"]
    if depth < 2 and rng.random() < 0.2:
        return "[" + ", ".join(_toml_value(rng, depth + 1) for _ in range(rng.randrange(3))) + "]"
    if depth < 2 and rng.random() < 0.1:
        return "{" + ", ".join(f"{rng.choice(['a', 'source'])} = {_toml_value(rng, depth + 1)}"
                               for _ in range(rng.randrange(2))) + "}"
    return rng.choice(choices)


def test_fuzzed_configs_are_a_config_or_a_config_error(tmp_path) -> None:
    keys = ["cache", "node", "redis_node", "ownership", "rank", "world_size", "workers", "decoder",
            "memory_budget", "http_host", "http_port", "poll_interval", "t1_dir", "t1_max_bytes",
            "pass_timeout", "drain_timeout", "api_token", "api_token_file", "allowed_sources",
            "max_registrations", "datasets", "bogus"]
    ds_keys = ["source", "short_side", "encoding", "revalidate", "x"]
    rng = random.Random(20261123)
    path = tmp_path / "d.toml"
    outcomes = {"config": 0, "error": 0}
    for i in range(3000):
        lines = ['cache = "redis://127.0.0.1:1"'] if rng.random() < 0.8 else []
        for key in rng.sample(keys, rng.randrange(4)):
            if key != "cache" or not lines:
                lines.append(f"{key} = {_toml_value(rng)}")
        for _ in range(rng.randrange(3)):
            lines.append("[[datasets]]")
            lines += [f"{k} = {_toml_value(rng)}" for k in rng.sample(ds_keys, rng.randrange(1, 4))]
        path.write_text("\n".join(lines) + "\n")
        env = {}
        if rng.random() < 0.3:
            env[f"DATACACHE_DAEMON_{rng.choice(keys).upper()}"] = rng.choice(
                ["", "0", "x", "nan", "1e999", "-1", "70000", "a,b", "/data", "h:1", "9" * 400])
        try:
            cfg = load_config(str(path), env=env)
        except ConfigError as e:
            assert "\n" not in str(e) and "Traceback" not in str(e), (i, path.read_text(), env)
            outcomes["error"] += 1
        except Exception as e:  # any other exception is the bug this test is for
            raise AssertionError(f"case {i}: {type(e).__name__}: {e}\n{path.read_text()}\nenv={env}") from e
        else:
            assert isinstance(cfg, DaemonConfig)
            outcomes["config"] += 1
    assert outcomes["config"] > 50 and outcomes["error"] > 50, outcomes  # the fuzz reaches both outcomes
