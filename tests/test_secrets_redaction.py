"""Secrets never printed: a Redis password with ``/ , @ : % #`` and spaces is hidden everywhere.

Unit level: :func:`datacache.redact.redact` against an independent statement of what the password is
(the characters between the userinfo's first ``:`` and the tier's last ``@``, percent-decoded -- what
redis-py is given); every ConfigError of the URL parser. For real: a ``redis-server`` whose ACL user
has such a password, a real cache daemon (subprocess) given the URL through its environment, and every
output a person or a scraper can see -- ``/status``, ``/health``, ``/livez``, ``/readyz``, ``/metrics``,
the start log, ``--check``, a config error -- scanned for the password in every spelling. The
``?password_file=`` option keeps the password out of URLs, command lines and ``ps`` altogether.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError
from datacache.redact import redact, redact_text
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every character the issue names, and a space; long enough to be unmistakable in any output
NASTY = "Pa/ss,w@rd:50%#x y-Zq7"
PASSWORDS = [NASTY, "p@ss", "a/b", "c,d", "e:f", "100%", "h#i", "j k", "@@@", "::", "x?y", "%41%2F"]


def spellings(pw: str) -> list[str]:
    """Every way the password may show up in text: raw, percent-encoded (two styles), decoded."""
    forms = {pw, urllib.parse.quote(pw, safe=""), urllib.parse.quote(pw), urllib.parse.unquote(pw)}
    return sorted(f for f in forms if len(f) >= 2)


def _assert_hidden(text: str, pw: str) -> None:
    for form in spellings(pw):
        assert form not in text, f"password spelling {form!r} found in: {text[:500]!r}"


# ------------------------------------------------------------------------------------ redact()
@pytest.mark.parametrize("pw", PASSWORDS)
@pytest.mark.parametrize("encoded", [False, True])
def test_redact_hides_the_password_in_every_tier(pw: str, encoded: bool) -> None:
    written = urllib.parse.quote(pw, safe="") if encoded else pw
    for url in (f"redis://user:{written}@127.0.0.1:6379/0",
                f"redis+cluster://user:{written}@h1:7000,h2:7001",
                f"lmdb:///local/cache::redis+cluster://user:{written}@h1:7000,h2:7001",
                f"rediss://:{written}@h:6380/2?ssl_cert_reqs=none"):
        shown = redact(url)
        assert "***@" in shown
        if pw != "::":  # "::" unencoded is a tier separator, not a password: the URL is malformed
            _assert_hidden(shown, pw)
            assert shown.endswith(("h1:7000,h2:7001", "127.0.0.1:6379/0", "h:6380/2?ssl_cert_reqs=none"))
        assert redact(shown) == shown  # idempotent
        assert ("user:***@" in shown) == ("user:" in url)


@pytest.mark.parametrize("pw", PASSWORDS)
def test_the_hidden_password_is_the_one_sent_to_redis(pw: str) -> None:
    """Percent-encoded, every password parses; the store is given exactly it (the reference is the
    password itself), and the canonical URL shows none of it."""
    from datacache.stores.redis_common import connection_kwargs

    url = f"redis+cluster://user:{urllib.parse.quote(pw, safe='')}@h1:7000,h2:7001"
    spec = parse_cache_url(url).store
    assert connection_kwargs(spec, tls=False)["password"] == pw
    if len(pw) >= 2:
        _assert_hidden(spec.url, pw)


def test_redact_keeps_what_is_not_secret() -> None:
    assert redact("lmdb:///var/cache/dc?readonly=1") == "lmdb:///var/cache/dc?readonly=1"
    assert redact("redis+cluster://datacache@h1:7000?password_file=/run/s/p") == \
        "redis+cluster://datacache@h1:7000?password_file=/run/s/p"  # a user name alone is no secret
    assert redact("/mnt/nfs/a@b/train") == "/mnt/nfs/a@b/train"
    # source URLs follow RFC 3986: an "@" in the path after the authority is not userinfo
    assert redact("https://host:8443/sets/img@2x/") == "https://host:8443/sets/img@2x/"
    assert redact("https://u:pw@host:8443/sets/img@2x/") == "https://u:***@host:8443/sets/img@2x/"
    assert redact("redis://u:a/b@c@h:1/0?client_name=x") == "redis://u:***@h:1/0?client_name=x"


def test_redact_text_masks_urls_and_registered_secrets() -> None:
    from datacache.redact import register_secret

    msg = f"ConnectionError: redis://u:{NASTY}@h:1 refused; also http://a:b1234@x/y"
    out = redact_text(msg)
    assert "b1234" not in out and "u:***@" in out
    register_secret("tok-3f9c2a7e61")
    assert redact_text("header Authorization: Bearer tok-3f9c2a7e61") == "header Authorization: Bearer ***"


# ------------------------------------------------------------------------------ parser errors
@pytest.mark.parametrize("pw", PASSWORDS)
@pytest.mark.parametrize("tail", ["?bogus=1", "?socket_timeout=soon", "?fetch_bytes=0",
                                  "?client_name=a&client_name=b", ",h2", "/zero", "?", "::lmdb:///a::lmdb:///a",
                                  "::bogus://x", "::lmdb:///1::lmdb:///2::lmdb:///3::lmdb:///4"])
def test_every_url_error_hides_the_password(pw: str, tail: str) -> None:
    for encoded in (False, True):
        written = urllib.parse.quote(pw, safe="") if encoded else pw
        scheme = "redis+cluster" if tail == ",h2" else "redis"
        url = f"{scheme}://user:{written}@127.0.0.1:6379{tail}"
        try:
            parse_cache_url(url)
        except ConfigError as e:
            if len(pw) >= 3:
                _assert_hidden(str(e), pw)
        # a URL that happens to parse has nothing to report; its .url must still be redacted
        else:
            if len(pw) >= 3:
                _assert_hidden(parse_cache_url(url).url, pw)


def test_password_and_password_file_together_are_refused(tmp_path) -> None:
    from datacache.stores.redis_common import connection_kwargs

    f = tmp_path / "pw"
    f.write_text("from-the-file\n")
    os.chmod(f, 0o600)  # a secret file must be private (read_secret_file refuses 0644)
    spec = parse_cache_url(f"redis://u:inline@h:1/0?password_file={f}").store
    with pytest.raises(ConfigError, match="at once"):
        connection_kwargs(spec, tls=False)
    kw = connection_kwargs(parse_cache_url(f"redis://u@h:1/0?password_file={f}").store, tls=False)
    assert kw["username"] == "u" and kw["password"] == "from-the-file"  # trailing newline stripped
    missing = parse_cache_url(f"redis://u@h:1/0?password_file={tmp_path / 'nope'}").store
    with pytest.raises(ConfigError, match="cannot read the secret file") as ei:
        connection_kwargs(missing, tls=False)
    assert str(tmp_path / "nope") in str(ei.value)
    (tmp_path / "empty").write_text("\n")
    os.chmod(tmp_path / "empty", 0o600)
    with pytest.raises(ConfigError, match="empty"):
        connection_kwargs(parse_cache_url(f"redis://u@h:1/0?password_file={tmp_path / 'empty'}").store,
                          tls=False)


# ---------------------------------------------------------------------- real server, real daemon
@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    """A redis-server whose ``dcuser`` has the nasty password (set through redis-py: any byte works)."""
    import redis

    from datacache.devtools.redis_local import start_server

    srv = start_server(str(tmp_path_factory.mktemp("acl")))
    r = redis.Redis(host="127.0.0.1", port=srv.port)
    r.execute_command("ACL", "SETUSER", "dcuser", "on", f">{NASTY}", "~dc:*", "~dcq:*", "~dcd:*", "+@all")
    r.close()
    yield srv
    srv.stop()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_DAEMON_")}
    env.update(PYTHONPATH=REPO, **extra)
    return env


@needs_redis
def test_password_file_authenticates_and_never_appears(acl_server, tmp_path, small_imagefolder) -> None:
    from client.dataset import CachedImageNet

    pw_file = tmp_path / "redis-password"
    pw_file.write_text(NASTY + "\n")
    os.chmod(pw_file, 0o600)
    url = f"redis://dcuser@{acl_server.addr}/0?password_file={pw_file}"
    ds = CachedImageNet(small_imagefolder, cache=url, short_side=32)  # PINGs: a wrong password would raise
    img, _ = ds[0]
    assert img.shape[0] == 3 and ds.stats()["decoded"] >= 1
    _assert_hidden(repr(ds) + json.dumps(ds.stats(), default=str) + ds.cache_url, NASTY)
    pw_file.write_text("wrong-password\n")
    with pytest.raises(ConfigError) as ei:
        CachedImageNet(small_imagefolder, cache=url, short_side=32)
    assert "wrong-password" not in str(ei.value)


@needs_redis
def test_daemon_outputs_never_show_the_password(acl_server, tmp_path, small_imagefolder) -> None:
    from datacache.devtools.redis_local import free_port

    written = urllib.parse.quote(NASTY, safe="/,@: ")  # "/ , @ :" and the space raw; "%" and "#" encoded
    url = f"redis://dcuser:{written}@{acl_server.addr}/0"
    port = free_port()
    env = _env(DATACACHE_DAEMON_CACHE=url)
    base = [sys.executable, "-m", "cache_daemon", "--node", "n1", "--dataset", small_imagefolder,
            "--short-side", "32", "--workers", "1", "--no-progress", "--poll-interval", "1"]
    check = subprocess.run([*base, "--check"], capture_output=True, text=True, timeout=60, env=env)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "dcuser:***@" in check.stdout
    _assert_hidden(check.stdout + check.stderr, NASTY)
    # a config error that quotes the URL (an unknown option)
    bad = subprocess.run([*base, "--check"], capture_output=True, text=True, timeout=60,
                         env=_env(DATACACHE_DAEMON_CACHE=url + "?bogus=1"))
    assert bad.returncode == 2 and "bogus" in bad.stderr
    _assert_hidden(bad.stdout + bad.stderr, NASTY)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*base, "--http-port", str(port), "-v"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                code, body = _get(port, "/status")
                if code == 200 and [d["status"] for d in json.loads(body)["datasets"]] == ["full"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        seen = []
        for path in ("/status", "/health", "/livez", "/readyz", "/metrics", "/nope"):
            code, body = _get(port, path)
            seen.append(body)
        status = json.loads(seen[0])
        assert status["cache"].startswith("redis://dcuser:***@")
        assert "registration" in status and status["datasets"][0]["status"] == "full"
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "dcuser:***@" in text  # the start log names the cache, redacted
    for body in [*seen, text]:
        _assert_hidden(body, NASTY)


def test_source_passwords_are_hidden_in_status_metrics_check_and_run_files(tmp_path) -> None:
    """A dataset source may carry credentials (``https://user:pw@host/...``): /status, the /metrics
    labels, ``--check`` and the trainer's run files (metrics.jsonl, checkpoints) show it redacted."""
    from cache_daemon.__main__ import shown_config
    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.ingest import DatasetState
    from trainer.train_config import TrainConfig

    src = f"https://reader:{urllib.parse.quote(NASTY, safe='')}@data.example.com/sets/train"
    state = DatasetState(DatasetSpec(source=src))
    shown = json.dumps(state.as_json())
    assert "reader:***@data.example.com" in shown
    _assert_hidden(shown, NASTY)

    class _Daemon:  # what make_metrics reads at scrape time
        def snapshot(self):
            return [state.as_json()]

        def store_health(self):
            return {"ok": True}

        liveness = readiness = store_health

    from prometheus_client import generate_latest

    from cache_daemon.http import make_metrics

    text = generate_latest(make_metrics(_Daemon())).decode()
    assert "reader:***@data.example.com" in text
    _assert_hidden(text, NASTY)
    cfg = DaemonConfig(cache=f"redis://u:{urllib.parse.quote(NASTY, safe='')}@127.0.0.1:1/0", node="n",
                       datasets=(DatasetSpec(source=src),), allowed_sources=(src,))
    _assert_hidden(json.dumps(shown_config(cfg), default=str), NASTY)
    run_cfg = TrainConfig(data=src, cache=cfg.cache).to_dict()
    _assert_hidden(json.dumps(run_cfg), NASTY)
    assert run_cfg["cache"] == "redis://u:***@127.0.0.1:1/0"


def test_registering_a_source_with_a_password_is_refused(tmp_path) -> None:
    """The registry is readable by every cache client: a credential in a registered source would be
    handed to all of them, so POST /datasets refuses it (without echoing it)."""
    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.service import Daemon

    d = Daemon(DaemonConfig(cache="memory://", node="n", allowed_sources=("https://data.example.com/sets",),
                            api_token="t" * 32), progress=False)
    with pytest.raises(ConfigError) as ei:
        d.register({"source": "https://u:hunter22secret@data.example.com/sets/a"})
    assert "hunter22secret" not in str(ei.value) and "password" in str(ei.value)


def test_log_handlers_mask_secrets_read_from_files(tmp_path) -> None:
    """The scrub filter the daemon and the CLIs install: a secret read from a file (the password of
    ``?password_file=``, an API token file) is masked in any log line, raw or percent-encoded, and so is
    a URL's password -- also inside an exception's traceback."""
    import io
    import logging

    from datacache.redact import install_scrub_filter
    from datacache.secretfile import read_secret_file

    f = tmp_path / "token"
    f.write_text("tok/en with spaces 9f3c7a\n")
    os.chmod(f, 0o600)
    secret = read_secret_file(str(f), what="test")
    buf = io.StringIO()
    logger = logging.getLogger("datacache.test.scrub")
    logger.propagate = False
    handler = logging.StreamHandler(buf)
    logger.addHandler(handler)
    try:
        install_scrub_filter(logger)
        logger.warning("sent %s and %s", secret, urllib.parse.quote(secret, safe=""))
        logger.warning("cache redis://u:%s@h:1/0", NASTY)
        try:
            raise ConnectionError(f"refused: {secret}")
        except ConnectionError:
            logger.exception("store failed")
    finally:
        logger.removeHandler(handler)
    out = buf.getvalue()
    assert "sent *** and ***" in out and "u:***@h:1/0" in out and "store failed" in out
    _assert_hidden(out, secret)
    _assert_hidden(out, NASTY)
