"""Credentials in a URL's QUERY are never printed (issue 35, item 7): SAS/presigned sources, ``?password=``.

* Unit level, parameter by parameter: every credential parameter the issue names (an independent list,
  written here, not imported) is masked by :func:`datacache.redact.redact` -- any case, its name
  percent-encoded, repeated, its value percent-encoded -- with the name kept (``sig=***``); parameters
  that are not secret (Azure SAS ``sv``/``se``/``sp``..., the cache URL's options) are kept as they are;
  free text (:func:`~datacache.redact.redact_text`, what every log line and error goes through) and the
  JSON of every HTTP answer (:func:`~datacache.redact.redact_json`).
* Every config-error path the issue tried with a cache URL holding ``?password=SECRET``: the daemon's
  ``--check`` with the URL from the environment, from ``--cache``, beside a bad option; ``datacache
  stats --cache``; a ``CachedImageNet`` construction error -- none prints the secret, raw,
  percent-encoded or decoded.
* For real: a ``redis-server``, a cache daemon (subprocess) with a config dataset whose source is an
  Azure-SAS-style ``...list.txt?sv=...&sig=SECRET`` served by a local HTTP server, a registry entry with
  such a source written to Redis directly (as an old version or an admin would), and a ``POST
  /datasets`` of one (refused: the registry is readable by every cache client); ``/status``,
  ``/health``, ``/livez``, ``/readyz``, ``/metrics``, an error answer, the daemon's log, ``--check`` and
  the registry are scanned for the signature in every spelling.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict
from functools import partial

import pytest

from datacache.config import ConfigError
from datacache.redact import is_credential_param, redact, redact_json, redact_text
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a signature as Azure/S3 make them (base64: "+", "/", "="), long enough to be unmistakable
SECRET = "SECRETsig+4f9a/Zq7Xk=="
TOKEN = "t" * 32

# the list (item 5 / item 7) and the presigned-URL forms of S3 (SigV2, SigV4), GCS (V2, V4),
# Azure SAS and CloudFront -- written here independently of datacache.redact's own list
CREDENTIAL_NAMES = [
    "password", "passwd", "pass", "pwd", "token", "access_token", "refresh_token", "id_token", "api_key",
    "apikey", "key", "secret", "client_secret", "sig", "signature", "Signature", "X-Amz-Signature",
    "X-Amz-Credential", "X-Amz-Security-Token", "X-Amz-Anything", "X-Goog-Signature", "X-Goog-Credential",
    "GoogleAccessId", "AWSAccessKeyId", "Key-Pair-Id", "sas_token", "auth", "db_password", "session_token",
    "subscription-key", "private_key", "credential",
]
# not secret: kept so an operator can read them (an expired SAS: se=) and the cache URL stays usable
PUBLIC_NAMES = ["sv", "se", "st", "sp", "sr", "ss", "srt", "spr", "Expires", "Policy", "versionId",
                "prefix", "password_file", "ssl_keyfile", "ssl_certfile", "client_name", "readonly",
                "socket_timeout", "write_back", "map_size"]


def spellings(secret: str) -> list[str]:
    """Every way a secret may show up in text: raw, percent-encoded (two styles), decoded, "+" decoded."""
    forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote(secret),
             urllib.parse.quote_plus(secret), urllib.parse.unquote(secret), urllib.parse.unquote_plus(secret)}
    return sorted(f for f in forms if len(f) >= 6)


def assert_hidden(text: str, secret: str = SECRET) -> None:
    for form in spellings(secret):
        assert form not in text, f"secret spelling {form!r} found in: {text[:800]!r}"
    assert "SECRETsig" not in text, text[:800]  # any fragment of it


def _encode_all(name: str) -> str:
    return "".join(f"%{ord(c):02X}" for c in name)


# ------------------------------------------------------------------------------------ the list
@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
@pytest.mark.parametrize("spelling", ["as-is", "lower", "upper", "percent-encoded", "double-encoded"])
def test_every_credential_parameter_is_masked_keeping_its_name(name: str, spelling: str) -> None:
    written = {"as-is": name, "lower": name.lower(), "upper": name.upper(),
               "percent-encoded": _encode_all(name),
               "double-encoded": _encode_all(name).replace("%", "%25")}[spelling]
    assert is_credential_param(written)
    for value in (SECRET, urllib.parse.quote(SECRET, safe=""), urllib.parse.quote_plus(SECRET)):
        url = f"https://acct.example.com/c/list.txt?sv=2024-08-04&{written}={value}&se=2030-01-01"
        shown = redact(url)
        assert shown == f"https://acct.example.com/c/list.txt?sv=2024-08-04&{written}=***&se=2030-01-01"
        assert_hidden(shown)
        assert redact(shown) == shown  # idempotent


@pytest.mark.parametrize("name", PUBLIC_NAMES)
def test_parameters_that_are_not_secret_are_kept(name: str) -> None:
    assert not is_credential_param(name)
    url = f"https://h.example.com/d/list.txt?{name}=v1&sig={SECRET}"
    assert redact(url) == f"https://h.example.com/d/list.txt?{name}=v1&sig=***"


def test_repeated_parameters_fragments_and_separators_all_masked() -> None:
    url = f"https://h/d?sig={SECRET}&sv=1&SIG={SECRET}&sig=&sig={SECRET}#frag"
    assert redact(url) == "https://h/d?sig=***&sv=1&SIG=***&sig=***&sig=***"  # the fragment with it
    # a ";" some servers take as a separator: the rest of the piece is hidden, never shown
    shown = redact(f"https://h/d?a=1;sig={SECRET}&b=2")
    assert shown == "https://h/d?a=1;sig=***&b=2"
    # a raw "&"-free secret containing "=" and "?" stays one value
    assert redact("https://h/d?token=a=b?c=d&x=1") == "https://h/d?token=***&x=1"
    assert redact("https://h/d?sv=1&sig") == "https://h/d?sv=1&sig"  # no value: nothing to hide
    assert redact("/local/path?sig=x") == "/local/path?sig=x"  # a path, not a URL: unchanged by redact()


def test_unusual_spellings_of_a_credential_parameter_are_masked() -> None:
    """What a server may still read as the credential: an "=" percent-encoded (``sig%3D...``, once or
    twice), an array suffix (``sig[]=``), a path's matrix parameter (``;sig=``); and ``password_file`` (a
    path) is not taken for ``password``."""
    cases = {
        f"https://h/l.txt?sig%3D{SECRET}": "https://h/l.txt?sig%3D***",
        f"https://h/l.txt?sv=1&SIG%3d{SECRET}&b=2": "https://h/l.txt?sv=1&SIG%3d***&b=2",
        f"https://h/l.txt?sv=1&sig%253D{SECRET}": "https://h/l.txt?sv=1&sig%253D***",
        f"https://h/l.txt?sig[]={SECRET}": "https://h/l.txt?sig[]=***",
        f"https://h/l.txt?token%5B0%5D={SECRET}": "https://h/l.txt?token%5B0%5D=***",
        f"https://h/l.txt;sig={SECRET}": "https://h/l.txt;sig=***",
        f"https://h/a;v=1/l.txt;X-Amz-Signature={SECRET}?sv=1": "https://h/a;v=1/l.txt;X-Amz-Signature=***?sv=1",
        f"redis://h:1/0?password_file=/run/secrets/p&password={SECRET}":
            "redis://h:1/0?password_file=/run/secrets/p&password=***",
        f"redis://u:{SECRET}@h:1/0?password_file=/run/p;x": "redis://u:***@h:1/0?password_file=/run/p;x",
    }
    for url, want in cases.items():
        assert redact(url) == want, url
        assert redact(want) == want
    for url in ("https://h/l.txt?abc%3Dsig", "https://h/l.txt?%7Euser", "lmdb:///var/c;x=1",
                "https://h/l.txt?password_file=/p&passwordfile=/q&bypass=1&keyfile=/k"):
        assert redact(url) == url
    # free text (a log line, an error): the same forms outside a URL, and a query quoted twice
    twice = urllib.parse.quote(urllib.parse.quote(f"https://h/l.txt?sv=1&sig={SECRET}&x=1", safe=""), safe="")
    for text in (f"cannot read /mnt/l.txt?sig%3D{urllib.parse.quote(SECRET, safe='')} now",
                 f"a?x=1&Token%253D{urllib.parse.quote(SECRET, safe='')}",
                 f'"GET /datasets/{twice} HTTP/1.1" 404'):
        out = redact_text(text)
        assert_hidden(out)
        assert "***" in out
    assert redact_text("a?abc%3Dsig and ?password_file=/p") == "a?abc%3Dsig and ?password_file=/p"


def test_userinfo_and_query_together_and_every_tier() -> None:
    url = (f"lmdb:///var/c?readonly=1::redis://u:pw{SECRET}@h:1/0?password={SECRET}&client_name=n"
           f"::redis+cluster://h1:7000,h2:7000?token={urllib.parse.quote(SECRET, safe='')}")
    shown = redact(url)
    assert shown == ("lmdb:///var/c?readonly=1::redis://u:***@h:1/0?password=***&client_name=n"
                     "::redis+cluster://h1:7000,h2:7000?token=***")
    assert_hidden(shown)
    src = f"https://reader:pw@s3.example.com/b/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature={SECRET}"
    assert redact(src) == "https://reader:***@s3.example.com/b/k?X-Amz-Credential=***&X-Amz-Signature=***"


def test_free_text_and_json_answers() -> None:
    msg = (f"ManifestError: https://h/d/list.txt?sv=2024&sig={SECRET}: not found; also "
           f"'/mnt/list.txt?token={SECRET}' and <gs://b/o?X-Goog-Signature={SECRET}> "
           f"url=http://x/y?a=1&Signature={urllib.parse.quote(SECRET, safe='')}")
    out = redact_text(msg)
    assert_hidden(out)
    assert "sv=2024&sig=***" in out and "list.txt?token=***" in out and "X-Goog-Signature=***" in out
    quoted = urllib.parse.quote(f"https://h/d/l.txt?sv=1&sig={urllib.parse.quote(SECRET, safe='')}|s32",
                                safe="")
    out = redact_text(f'"DELETE /datasets/{quoted} HTTP/1.1" 404 -')  # a request path, logged
    assert_hidden(out)
    assert "%3Fsv%3D1%26sig%3D***" in out
    obj = {"source": f"https://h/l.txt?sig={SECRET}", "loop": {"current": {
        "dataset": f"https://h/l.txt?sv=1&sig={SECRET}|160-raw"}}, f"https://h/?key={SECRET}": [
        f"x?pwd={SECRET}", 3, None, True]}
    shown = redact_json(obj)
    assert_hidden(json.dumps(shown))
    assert shown["loop"]["current"]["dataset"].startswith("https://h/l.txt?sv=1&sig=***")


def test_registering_a_source_with_a_credential_query_is_refused() -> None:
    """The registry (dcd:datasets) is readable by every cache client: a presigned/SAS source would hand
    its signature to all of them, so POST /datasets refuses it like a user:password@ -- without echoing
    it. (A dataset in the daemon's own config file may carry one: it is shown redacted, below.)"""
    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.service import Daemon

    d = Daemon(DaemonConfig(cache="memory://", node="n", allowed_sources=("https://data.example.com/sets",),
                            api_token=TOKEN), progress=False)
    try:
        for q in (f"sv=2024&sig={SECRET}", f"X-Amz-Signature={SECRET}", f"p%61ssword={SECRET}"):
            with pytest.raises(ConfigError) as ei:
                d.register({"source": f"https://data.example.com/sets/a/list.txt?{q}"})
            assert_hidden(str(ei.value))
    finally:
        d.store.close()


# -------------------------------------------------------------------------- config-error paths
PW_URLS = [f"redis://127.0.0.1:1/0?password={urllib.parse.quote(SECRET, safe='')}&bogus=1",  # a bad option
           f"redis://127.0.0.1:1/0?client_name=x&PassWord={urllib.parse.quote(SECRET, safe='')}",
           f"redis+cluster://127.0.0.1:1,127.0.0.1:2?p%61ssword={urllib.parse.quote(SECRET, safe='')}",
           f"lmdb:///tmp/nowhere-dc::redis://127.0.0.1:1/0?token={urllib.parse.quote(SECRET, safe='')}"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_DAEMON_")}
    env.update(PYTHONPATH=REPO, **extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=REPO)


@pytest.mark.parametrize("url", PW_URLS)
def test_daemon_check_never_prints_a_query_password(url: str, tmp_path) -> None:
    daemon = ["-m", "cache_daemon", "--node", "n1", "--no-progress", "--check"]
    env = _env(XDG_CACHE_HOME=str(tmp_path))
    runs = {
        "environment": _run(daemon, _env(DATACACHE_DAEMON_CACHE=url, XDG_CACHE_HOME=str(tmp_path))),
        "--cache": _run([*daemon, "--cache", url], env),
        "beside a bad option": _run([*daemon, "--cache", url, "--ownership", "bogus"], env),
        "beside a bad env option": _run([*daemon, "--cache", url],
                                        _env(DATACACHE_DAEMON_WORKERS="-3", XDG_CACHE_HOME=str(tmp_path))),
        "beside a usage error": _run([*daemon, "--cache", url, "--rank", "x"], env),
    }
    for what, r in runs.items():
        assert r.returncode == 2, (what, r.stdout[-500:], r.stderr[-1500:])
        assert_hidden(r.stdout + r.stderr)
        assert "Traceback" not in r.stderr, (what, r.stderr[-1500:])
    # the message stays useful: redaction hides the value, not the reason (nothing eaten up to an "@")
    for what in ("environment", "--cache"):
        assert "unknown option" in runs[what].stderr and "password_file" in runs[what].stderr, (
            what, runs[what].stderr[-1500:])


@pytest.mark.parametrize("url", PW_URLS)
def test_datacache_stats_and_cachedimagenet_never_print_a_query_password(url: str, tmp_path,
                                                                         small_imagefolder) -> None:
    r = _run(["-c", "import sys; from datacache.cli import main; sys.exit(main())", "stats", "--cache", url],
             _env(XDG_CACHE_HOME=str(tmp_path)))
    assert r.returncode != 0
    assert_hidden(r.stdout + r.stderr)
    from client.dataset import CachedImageNet

    with pytest.raises(Exception) as ei:
        CachedImageNet(small_imagefolder, cache=url, short_side=32)
    assert_hidden(f"{ei.value!s} {ei.value!r}")


def test_check_shows_a_config_source_with_its_signature_masked(tmp_path) -> None:
    src = f"https://acct.blob.example.com/c/list.txt?sv=2024-08-04&se=2030-01-01&sp=r&sig={SECRET}"
    r = _run(["-m", "cache_daemon", "--node", "n1", "--no-progress", "--cache", f"lmdb://{tmp_path}/c",
              "--dataset", src, "--check"], _env(XDG_CACHE_HOME=str(tmp_path),
                                                 DATACACHE_DAEMON_ALLOWED_SOURCES=src))
    assert r.returncode == 0, r.stderr[-1500:]
    shown = json.loads(r.stdout)
    assert shown["datasets"][0]["source"].endswith("sv=2024-08-04&se=2030-01-01&sp=r&sig=***")
    assert shown["allowed_sources"][0].endswith("&sig=***")
    assert_hidden(r.stdout + r.stderr)


# ---------------------------------------------------------------------- real server, real daemon
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # not on the test's stderr
        pass


@pytest.fixture
def data_server(tmp_path):
    """A local HTTP server for the dataset (it ignores the query string, as a SAS-less test stand-in)."""
    root = tmp_path / "www"
    (root / "d").mkdir(parents=True)
    (root / "d" / "list.txt").write_text("a.jpg 0\nb.jpg 1\n")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _request(port: int, path: str, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {TOKEN}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


@needs_redis
def test_a_sas_source_is_masked_in_every_daemon_output_and_never_registered(redis_server, data_server,
                                                                            tmp_path) -> None:
    import msgpack
    import redis as redis_py

    from cache_daemon.daemon_config import DatasetSpec
    from datacache.devtools.redis_local import free_port
    from tests.redis_utils import flushall

    flushall(redis_server.port)
    sig = urllib.parse.quote(SECRET, safe="")
    config_src = f"{data_server}/d/list.txt?sv=2024-08-04&se=2030-01-01&sp=r&sig={sig}"
    planted_src = f"{data_server}/d/other.txt?sv=2024-08-04&X-Amz-Signature={sig}&token={sig}"
    posted_src = f"{data_server}/d/list.txt?sv=2024-08-04&sig={sig}"
    r = redis_py.Redis(host="127.0.0.1", port=redis_server.port)
    planted = DatasetSpec(source=planted_src, short_side=32)
    # an entry written to the registry directly (an older version, an admin): shown masked, like any
    r.hset("dcd:datasets", planted.ident(), msgpack.packb(asdict(planted)))
    port = free_port()
    env = _env(DATACACHE_DAEMON_ALLOWED_SOURCES=f"{data_server}/d", DATACACHE_DAEMON_API_TOKEN=TOKEN,
               XDG_CACHE_HOME=str(tmp_path / "xdg"))
    base = [sys.executable, "-m", "cache_daemon", "--node", "n1", "--cache",
            f"redis://127.0.0.1:{redis_server.port}/0", "--dataset", config_src, "--short-side", "32",
            "--workers", "1", "--no-progress", "--poll-interval", "1"]
    check = subprocess.run([*base, "--check"], capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 0, check.stderr[-2000:]
    log = tmp_path / "daemon.log"
    seen: dict[str, str] = {"--check": check.stdout + check.stderr}
    with open(log, "wb") as out:
        proc = subprocess.Popen([*base, "--http-port", str(port), "-v"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        deadline = time.monotonic() + 90
        while True:  # both datasets went through at least one pass (each fails: no such list)
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(OSError, ValueError):
                code, body = _request(port, "/status")
                ds = json.loads(body)["datasets"]
                if code == 200 and len(ds) == 2 and all(d["passes"] >= 1 or d["error"] for d in ds):
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        code, body = _request(port, "/datasets", "POST", {"source": posted_src, "short_side": 32})
        assert code == 400, body
        seen["POST /datasets"] = body
        for path in ("/status", "/health", "/livez", "/readyz", "/metrics", f"/nope?sig={sig}"):
            seen[path] = _request(port, path)[1]
        # an id quoted as a whole (its "?" and "&" percent-encoded): the answer and the request's log line
        code, body = _request(port, "/datasets/" + urllib.parse.quote(planted.ident() + "x", safe=""),
                              "DELETE")
        assert code == 404
        seen["DELETE"] = body
        status = json.loads(seen["/status"])
        sources = sorted(d["source"] for d in status["datasets"])
        assert sources == sorted([redact(config_src), redact(planted_src)])
        assert f"{data_server}/d/list.txt?sv=2024-08-04&se=2030-01-01&sp=r&sig=***" in sources
        assert 'sig=***' in seen["/metrics"] and "sv=2024-08-04" in seen["/metrics"]
    finally:
        proc.terminate()
        proc.wait(60)
    seen["log"] = log.read_text()
    assert "sig=***" in seen["log"]
    # the registry holds the planted entry only: the POST added nothing
    registry = r.hgetall("dcd:datasets")
    assert list(registry) == [planted.ident().encode()]
    r.close()
    for where, text in seen.items():
        try:
            assert_hidden(text)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
