"""The scale rehearsal (bench.scale) and its dataset generator (bench.scale_data).

* the generator: distinct, decodable 64x48 JPEGs (COM segment per file), exactly the designated 1 %
  corrupt; two generators started at once produce one complete tree; a generator killed mid-build
  leaves no tree and the next one completes it;
* ``python -m bench.scale`` end to end on two tiny sizes (real 3-master Redis Cluster, real daemons,
  two rank processes, a master killed mid-epoch and refilled): the JSON has every phase and ratio.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from bench import scale_data
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def _files(root: str) -> list[str]:
    out = []
    for d in sorted(os.listdir(root)):
        out.extend(os.path.join(root, d, f) for f in sorted(os.listdir(os.path.join(root, d))))
    return out


def _index(path: str) -> int:
    """Global generation index of a generated file: read back from its COM segment."""
    with open(path, "rb") as f:
        head = f.read(22)
    assert head[:4] == b"\xff\xd8\xff\xfe", path
    return int.from_bytes(head[6:14], "big", signed=True)


def check_tree(root: str, n: int, classes: int) -> None:
    """Every file is present once: n files in ``classes`` folders; the corrupt ones are exactly 1 in 100
    (by the generator's own rule, checked independently by decoding every file)."""
    files = _files(root)
    assert len(files) == n and len(os.listdir(root)) == classes
    digests, indices, bad = set(), set(), 0
    for p in files:
        with open(p, "rb") as f:
            data = f.read()
        digests.add(hashlib.sha256(data).digest())
        try:
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                assert im.size == scale_data.SIZE and im.mode == "RGB"
            indices.add(_index(p))
        except OSError:
            bad += 1
    assert len(digests) == n  # every file's bytes differ
    assert bad == sum(1 for i in range(n) if i % 100 == 37)
    assert indices == {i for i in range(n) if i % 100 != 37}


def test_comment_segment_keeps_pixels() -> None:
    base = scale_data.base_jpegs(variants=2)
    marked = scale_data.with_comment(base[0], b"\x00" * 16)
    assert marked != base[0]
    a, b = Image.open(io.BytesIO(base[0])), Image.open(io.BytesIO(marked))
    assert a.tobytes() == b.tobytes()
    with pytest.raises(ValueError, match="not a JPEG"):
        scale_data.with_comment(b"GIF89a", b"x")


def test_per_class_counts_and_bad_sizes() -> None:
    assert scale_data.per_class_counts(1003, 1000)[:4] == [2, 2, 2, 1]
    assert sum(scale_data.per_class_counts(1_281_167, 1000)) == 1_281_167
    assert scale_data.per_class_counts(5, 1000) == [1] * 5
    res = subprocess.run([sys.executable, "-m", "bench.scale_data", "0"], capture_output=True, text=True,
                         env=ENV, timeout=60)
    assert res.returncode == 2 and "need n >= 1" in res.stderr and "Traceback" not in res.stderr


def test_two_generators_at_once_build_one_tree(tmp_path) -> None:
    n, classes = 2500, 25
    cmd = [sys.executable, "-m", "bench.scale_data", str(n), "--dir", str(tmp_path), "--classes",
           str(classes)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    roots = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(roots) == 1
    root = roots.pop()
    assert sum("generating" in o for o, _ in outs) == 1  # one built, the other waited and reused it
    assert os.path.exists(root + ".complete")
    assert not [e for e in os.listdir(tmp_path) if ".tmp-" in e]
    check_tree(root, n, classes)


def test_killed_generator_leaves_no_tree_and_the_next_completes(tmp_path) -> None:
    n, classes = 40_000, 40
    root = scale_data.dataset_root(n, str(tmp_path), classes)
    p = subprocess.Popen([sys.executable, "-m", "bench.scale_data", str(n), "--dir", str(tmp_path),
                          "--classes", str(classes), "--workers", "1"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL,
                         env=ENV, start_new_session=True)
    tmp = root + f".tmp-{p.pid}"
    deadline = time.monotonic() + 60
    while not (os.path.isdir(tmp) and len(os.listdir(tmp)) >= 2):  # mid-build: some classes written
        assert p.poll() is None and time.monotonic() < deadline, "generator ended before it could be killed"
        time.sleep(0.01)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)
    assert not os.path.exists(root) and not os.path.exists(root + ".complete")
    assert os.path.isdir(tmp)  # its half-built tree, never visible under the real name
    got = scale_data.ensure_scale_dataset(n, str(tmp_path), classes=classes, progress=False)
    assert got == root and os.path.exists(root + ".complete") and not os.path.exists(tmp)
    assert len(_files(root)) == n


@needs_redis
def test_quick_rehearsal_end_to_end(tmp_path) -> None:
    out = tmp_path / "out"
    sizes = (300, 900)
    res = subprocess.run([sys.executable, "-m", "bench.scale", "--quick", "--sizes", f"{sizes[0]},{sizes[1]}",
                          "--classes", "10", "--batch-size", "8", "--data-dir", str(tmp_path / "data"),
                          "--out-dir", str(out),
                          "--ffcv-size", "0", "--timeout", "60"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "scale_quick.json").read_text())
    assert set(doc) == {"machine", "config", "results", "ratios", "notes"}
    assert (out / "scale_quick.png").stat().st_size > 0
    for n, r in zip(sizes, doc["results"]["sizes"]):
        bad = sum(1 for i in range(n) if i % 100 == 37)
        assert r["files"] == n and r["listing"]["files"] == n
        assert r["fill"]["quarantined"] == bad and sum(r["fill"]["owned"]) == n
        assert r["wait_warm"]["full"]
        assert r["redis"]["keys"] >= n  # records + quarantine records + fill reports
        for ep in ("epoch1", "epoch2", "kill_epoch"):
            assert r[ep]["samples"] == n + n % 2  # DistributedSampler pads to a multiple of 2 ranks
        warm = r["epoch2"]["ranks"]  # served from the cluster, nothing decoded
        assert sum(x["hits"] for x in warm) >= n - bad and sum(x["decoded"] for x in warm) == 0
        assert r["kill_epoch"]["master_killed"]
        if n == sizes[-1]:  # 57 batches a rank, killed after 30 %: later batches read around the dead master
            assert sum(x["decoded"] for x in r["kill_epoch"]["ranks"]) > 0
        assert (("keys_after" in r["refill"] and r["refill"]["keys_after"] >= r["refill"]["owned"] - bad)
                or "thread wait channels" in r["refill"]["error"])
        assert r["status"]["bytes"] > 0 and r["metrics"]["bytes"] > 0
        # the idle pass is measured, or -- a known daemon bug, see docs/benchmarks.md "Scale": a fill pass
        # forks a process pool from the threaded daemon and can hang joining it -- diagnosed, not crashed on
        assert r["idle_pass"].get("cpu_s_max", 0) > 0 or "thread wait channels" in r["idle_pass"]["error"]
        assert r["plan"]["predicted_bytes"] > 0 and r["plan"]["measured_bytes"] > 0
    ratios = doc["ratios"]
    for ph in ("listing", "fill", "wait_warm", "idle_pass", "plan", "epoch1", "epoch2", "kill_epoch",
               "refill"):
        assert ratios[f"scale_cost_ratio_{ph}"] is not None and ratios[f"scale_cost_ratio_{ph}"] > 0
    assert ratios["plan_memory_error"] is not None and "idle_pass_cpu_s" in ratios


def test_bad_sizes_are_one_line_errors() -> None:
    res = subprocess.run([sys.executable, "-m", "bench.scale", "--sizes", "12k,5"], capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert res.returncode == 2 and "--sizes must be comma-separated integers" in res.stderr
    assert "Traceback" not in res.stderr


# ------------------------------------------------------------------ the FFCV peer (bench.loader)
def test_ffcv_missing_is_skipped_with_the_reason() -> None:
    # sys.modules['ffcv'] = None: "import ffcv" raises ImportError, as on a machine without it
    code = ("import sys; sys.modules['ffcv'] = None\n"
            "from bench.loader import ffcv_available; print(ffcv_available())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ffcv is not importable" in res.stdout and "--install-peers" in res.stdout


def test_pil_files_reads_through_fsspec_and_blanks_undecodable(tmp_path) -> None:
    from bench.loader import PILFiles

    root = scale_data.ensure_scale_dataset(200, str(tmp_path), classes=4, progress=False)
    files = PILFiles(f"slowfile://{root}?latency_ms=0&mbps=0")
    assert len(files) == 200
    images = [files[i] for i in range(len(files))]
    assert files.bad == 2  # indices 37 and 137: garbage files become black fallback images
    assert all(img.size == scale_data.SIZE and img.mode == "RGB" for img, _ in images)
    assert sum(1 for img, _ in images if img.getbbox() is None) == 2
    assert [lab for _, lab in images] == [int(t) for t in files.labels]


@pytest.mark.skipif(__import__("importlib").util.find_spec("ffcv") is None, reason="ffcv not installed")
def test_ffcv_and_ours_first_epoch_from_slowfile(tmp_path) -> None:
    from bench.loader import ffcv_first_epoch_from_slowfile, ours_first_epoch_from_slowfile

    root = scale_data.ensure_scale_dataset(300, str(tmp_path), classes=3, progress=False)
    src = f"slowfile://{root}?latency_ms=0&mbps=0"
    ours = ours_first_epoch_from_slowfile(src, str(tmp_path / "lmdb"), 32, 64)
    assert ours["samples"] == 300 and ours["decoded"] == 297 and ours["quarantined"] == 3
    theirs = ffcv_first_epoch_from_slowfile(src, str(tmp_path / "x.beton"), 32, 64)
    assert theirs["samples"] == 300 and theirs["beton_bytes"] > 0 and theirs["convert_s"] > 0
