"""``python -m bench.dropin``: the smoke run's JSON and PNG (every ratio named, every number finite, the warm
epochs really served from the cache and the cold one really decoded), the fast path's normalisation recipe
against the literal expression, and the argument checks. Never a timing assert: the machine is shared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
RATIOS = {"dropin_warm_vs_imagefolder", "dropin_fastpath_vs_imagefolder", "dropin_cold_vs_imagefolder"}
PIPELINES = ("imagefolder_fresh", "dropin_cold", "imagefolder", "dropin_warm", "fastpath")


def _torchvision_missing() -> str | None:
    from datacache.devtools.torchvision_shim import ShimUnavailable, install

    try:
        install()
    except ShimUnavailable as e:
        return str(e)
    return None


SKIP = _torchvision_missing()


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.dropin", *args], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=timeout)


@pytest.mark.skipif(SKIP is not None, reason=f"torchvision: {SKIP}")
def test_quick_run_writes_every_ratio_and_finite_numbers(tmp_path) -> None:
    r = _run(["--quick", "--out-dir", str(tmp_path)], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads((tmp_path / "dropin_quick.json").read_text())
    assert (tmp_path / "dropin_quick.png").stat().st_size > 0
    assert set(doc) == {"machine", "config", "results", "ratios", "notes"}
    assert set(doc["ratios"]) == RATIOS
    assert all(_finite(v) and v > 0 for v in doc["ratios"].values()), doc["ratios"]
    cfg, res = doc["config"], doc["results"]
    n = cfg["images"]
    assert cfg["quick"] is True and cfg["short_side"] == 256  # derived from RandomResizedCrop(224)
    rounds, warm = cfg["rounds"], cfg["warm_epochs_per_round"]
    for name in PIPELINES:
        eps = res[name]["epochs"]
        assert len(eps) == (rounds if name in ("imagefolder_fresh", "dropin_cold") else rounds * warm)
        assert res[name]["per_epoch"] == [e["samples_per_s"] for e in eps]
        assert _finite(res[name]["samples_per_s"]) and res[name]["samples_per_s"] > 0
        for e in eps:
            assert e["samples"] == n and _finite(e["samples_per_s"]) and _finite(e["cpu_seconds"])
            assert e["cpu_seconds"] > 0, (name, e)
    # what each pipeline measured is what it claims: cold epochs decode every sample, warm ones none
    for e in res["dropin_cold"]["epochs"]:
        assert e["misses"] == e["decoded"] == n and e["hits"] == 0
    for name in ("dropin_warm", "fastpath"):
        for e in res[name]["epochs"]:
            assert e["hits"] == n and e["misses"] == e["decoded"] == 0, (name, e)
    assert {k: len(v) for k, v in res["pair_ratios"].items()} == {
        "dropin_cold_vs_imagefolder": rounds, "dropin_warm_vs_imagefolder": rounds * warm,
        "dropin_fastpath_vs_imagefolder": rounds * warm}
    for group in ("ratio_of_totals", "per_cpu_second_ratios"):
        assert set(res[group]) == RATIOS and all(_finite(v) for v in res[group].values())
    stages = res["per_sample_ms"]
    for key in ("imagefolder_pil_loader", "imagefolder_RandomResizedCrop", "cold_decode_image",
                "cold_replica_resize_to_variant", "cold_lmdb_put_many_commit", "warm_getitems_total",
                "fastpath_augment_collate", "fastpath_normalize", "imagefolder_total", "dropin_cold_total"):
        assert key in stages, key
    assert all(_finite(v) and v >= 0 for v in stages.values()), stages
    assert "Traceback" not in r.stderr


def test_normalize_recipe_equals_the_literal_expression() -> None:
    from bench.dropin import MEAN, STD, Normalize

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 9, 9, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)  # NHWC memory
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    want = (x.float() / 255 - mean) / std
    before = x.clone()
    norm = Normalize(torch.device("cpu"), size=9)
    for batch in (x, x.contiguous()):  # AugmentCollate's channels_last batches, and plain NCHW ones
        got = norm(batch)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert torch.equal(x, before)  # the uint8 batch is untouched (AugmentCollate reuses its buffer)


@pytest.mark.parametrize("args, words", [
    (["--rounds", "0"], ["--rounds", ">= 1"]),
    (["--images", "0"], ["--images", ">= 1"]),
    (["--workers", "-1"], ["--workers", ">= 0"]),
    (["--short-side", "0"], ["--short-side", ">= 1"]),
])
def test_bad_arguments_are_one_line_errors(args: list[str], words: list[str]) -> None:
    r = _run(args, timeout=120)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert all(w in last for w in words), r.stderr
    assert "Traceback" not in r.stderr
