"""The ``datacache`` command line: help, usage errors, demo, warm + stats, a missing source."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from datacache.cli import main
from datacache.devtools import synth

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datacache.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, **(env or {})})


def test_help_and_usage_errors(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for word in ("demo", "warm", "stats", "examples:"):
        assert word in out
    with pytest.raises(SystemExit) as ei:
        main(["demo", "--epochs", "0"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main(["frobnicate"])
    assert ei.value.code == 2


def test_missing_source_is_a_clear_one_line_error(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "no" / "such" / "train")
    proc = _cli("warm", missing, "--cache", f"lmdb://{tmp_path}/c")  # the real console process
    assert proc.returncode == 1
    assert missing in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert main(["demo", "--source", missing, "--cache", f"lmdb://{tmp_path}/c"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("datacache: error: ") and missing in err and err.strip().count("\n") == 0


def test_demo_tiny_two_epochs(tmp_path) -> None:
    # the demo's own dataset and cache live under the user cache dir -> point it at tmp
    proc = _cli("demo", "--epochs", "2", "--images", "24", "--classes", "3", "--gen-size", "96", "72",
                "--batch-size", "8", "--image-size", "32", "--short-side", "48", "--no-progress",
                env={"XDG_CACHE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    n = 24 + len(synth.real_photo_files())
    m1 = re.search(r"epoch 1: .*T2 hit (\d+)% .*decoded (\d+)", out)
    m2 = re.search(r"epoch 2: .*T2 hit (\d+)% .*decoded (\d+)", out)
    assert m1 and m2, out
    assert (m1.group(1), int(m1.group(2))) == ("0", n)
    assert (m2.group(1), int(m2.group(2))) == ("100", 0)
    assert "the first (cold) epoch" in out
    assert os.path.isdir(tmp_path / "datacache" / "demo" / "lmdb")


def test_warm_then_stats(tmp_path, capsys: pytest.CaptureFixture) -> None:
    src = str(tmp_path / "train")
    synth.make_imagefolder(src, classes=2, per_class=5, size=(96, 72), seed=9)
    bad = synth.write_bad_inputs(src)
    cache = f"lmdb://{tmp_path}/cache"
    n_images = 10 + len(bad) - 1  # the .txt is not an image
    assert main(["warm", src, "--cache", cache, "--workers", "2", "--short-side", "48", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{n_images} samples, decoded {n_images - 3}, skipped 0" in out and "quarantined 3" in out
    assert bad["corrupt"] in out
    # resumable: a second run decodes nothing (cached and known-bad samples are skipped)
    assert main(["warm", src, "--cache", cache, "--workers", "2", "--short-side", "48", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"decoded 0, skipped {n_images}" in out
    assert main(["stats", "--cache", cache]) == 0
    out = capsys.readouterr().out
    assert f"entries  {n_images}" in out  # records + 3 remembered-bad markers
    assert "manifests in" in out and f"{n_images} files" in out
    # the warmed cache serves CachedImageNet without decoding
    from client.dataset import CachedImageNet

    ds = CachedImageNet(src, cache=cache, short_side=48, t1_dir=None)
    ds.__getitems__(list(range(len(ds))))
    st = ds.stats()
    assert st["decoded"] == 0 and st["bytes_read"] == 0 and st["t2"]["known_bad"] == 3


def test_revalidate_and_t1_cap_are_reachable(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from client.dataset import CachedImageNet

    src = str(tmp_path / "train")
    synth.make_imagefolder(src, classes=2, per_class=6, size=(96, 72), seed=3)
    with pytest.raises(SystemExit) as ei:
        main(["warm", "--help"])
    assert ei.value.code == 0
    helptext = capsys.readouterr().out
    assert "--revalidate" in helptext and "in place" in helptext and "--t1-max-bytes" in helptext
    with pytest.raises(SystemExit) as ei:
        main(["warm", src, "--revalidate", "sometimes"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit) as ei:
        main(["warm", src, "--t1-max-bytes", "lots"])
    assert ei.value.code == 2
    slow = f"slowfile://{src}?latency_ms=0&mbps=0"  # remote-like source: goes through T1
    t1 = tmp_path / "t1"
    cap = 3 * max(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(src) for f in files)
    assert main(["warm", slow, "--cache", f"lmdb://{tmp_path}/c", "--workers", "1", "--short-side", "32",
                 "--revalidate", "full", "--t1-dir", str(t1), "--t1-max-bytes", str(cap),
                 "--no-progress"]) == 0
    assert "decoded 12" in capsys.readouterr().out
    assert 0 < sum(f.stat().st_size for f in t1.iterdir()) <= cap  # the cap held during the warm
    t1b = tmp_path / "t1b"
    ds = CachedImageNet(slow, cache="memory://", short_side=32, t1_dir=str(t1b), t1_max_bytes=cap,
                        revalidate="full")
    ds.__getitems__(list(range(len(ds))))
    assert ds.revalidate == "full" and 0 < sum(f.stat().st_size for f in t1b.iterdir()) <= cap
    assert main(["demo", "--source", src, "--cache", "memory://", "--epochs", "1", "--workers", "0",
                 "--batch-size", "4", "--image-size", "16", "--short-side", "32", "--no-progress",
                 "--revalidate", "none", "--t1-dir", "none"]) == 0
