"""The ``fashion`` recipe and its benchmark's smoke run (``python -m bench.fashion --quick``): the model
size the README states, the CLI, and the whole table's machinery on real data (Debian's
``dataset-fashion-mnist``, which ``./quickstart.sh test`` installs) for one short epoch per row."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.models import build_model
from trainer.train_config import make_config

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(not os.path.isdir(FASHION), reason="Debian's dataset-fashion-mnist is not "
                                   "installed (apt-get install dataset-fashion-mnist; ./quickstart.sh test "
                                   "installs it)")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# upper bounds that only catch a hang: the quick benchmark takes ~6 min alone on 2 cores, several times
# that beside the rest of a parallel suite or a busy machine
HANG_S = 3000


def _params(width: int) -> int:
    return sum(p.numel() for p in build_model("small_resnet_cifar", 10, width=width).parameters())


def test_recipe_model_sizes_are_the_readme_s() -> None:
    cfg = make_config("fashion")
    assert (cfg.model, cfg.width, cfg.augment, cfg.resolution, cfg.epochs) == (
        "small_resnet_cifar", 8, "padcrop", "28", 20)
    assert _params(cfg.width) == 78_002 < 100_000  # the published row's size class: < 100K parameters
    assert _params(16) == 308_826
    assert cfg.global_batch(0, 4) == 256 and cfg.normalization == ((0.286,) * 3, (0.353,) * 3)


def test_fashion_command_help_and_missing_source_in_one_line(tmp_path) -> None:
    run = [sys.executable, "-m", "trainer", "fashion"]
    out = subprocess.run([*run, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120)
    text = " ".join(out.stdout.split())  # argparse wraps the description
    assert out.returncode == 0 and "--from DIR" in text and "official 10,000-image test split" in text
    bad = subprocess.run([*run, str(tmp_path / "out"), "--from", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("datacache-train: error: ") and "nowhere" in lines[0]
    assert not (tmp_path / "out").exists()


@needs_fashion
@pytest.mark.timeout(HANG_S + 300)
def test_quick_benchmark_runs_every_kind_of_row(tmp_path) -> None:
    """bench.fashion --quick: the cache-fed dense run, the torchvision reference and a sparse method, each
    a 2 nodes x 2 gloo ranks job for 40 steps, the elastic row (the same 40 steps over 2 x 2, 1 x 2 and
    2 x 2 ranks), then the JSON with the issue's ratio names."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache-home")}
    res = subprocess.run([sys.executable, "-m", "bench.fashion", "--quick", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_S)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "fashion_quick.json").read_text())
    rows = doc["results"]["rows"]
    assert set(rows) == {"dense_s0", "reference_s0", "hitopk_1pct_s0", "elastic_s0"}
    for name, r in rows.items():
        # 40 steps: the training loss is well below chance's ln(10) = 2.30 on every row; the held-out
        # accuracy of so young a network swings with its BatchNorm statistics (a sparse method's lags)
        assert r["epochs"] == 1 and r["samples_per_s_median"] > 0 and r["loss_curve"][-1] < 2.15, (name, r)
        # ... so held-out, each row only has to beat chance (10 %) by 5 standard errors of a 10,000-image
        # test split: at 40 steps the torchvision reference has measured 0.146 and > 0.25 at equal
        # training loss; the pipelines' parity is the full benchmark's row (parity_minus_reference_pp)
        assert r["top1"] > 0.10 + 5 * math.sqrt(0.10 * 0.90 / 10_000), (name, r["top1"])
    assert rows["reference_s0"]["pipeline"] == "torchvision reference"
    assert rows["hitopk_1pct_s0"]["comm_method"] == "hitopk"
    runs = tmp_path / "cache-home" / "datacache" / "bench" / "fashion" / "runs"
    said = [(runs / f"elastic_s0.phase{k}.node0.log").read_text() for k in range(3)]
    assert "stopped after global step 13" in said[0] and "stopped after global step 27" in said[1]
    assert "epoch 1, step 13; epoch 1 was planned for 4 ranks" in said[1] and "over 2 ranks" in said[1]
    assert "epoch 1, step 27; epoch 1 was planned for 2 ranks" in said[2] and "over 4 ranks" in said[2]
    assert "elastic_minus_dense_pp" in doc["ratios"]
    for k in ("dense_top1_pct", "parity_minus_reference_pp", "sparse_worst_minus_dense_pp_1pct",
              "sparse_worst_minus_dense_pp_0.1pct", "local_minus_global_pp", "hitopk_1pct_minus_dense_pp"):
        assert k in doc["ratios"]
    assert doc["ratios"]["dense_top1_pct"] == pytest.approx(100 * rows["dense_s0"]["top1"])
    assert doc["published"]["2 conv layers < 100K parameters, no augmentation"] == 0.925
    assert (tmp_path / "fashion_quick.png").stat().st_size > 10_000


def _doc_commands() -> list[list[str]]:
    """The shell commands of docs/training.md's Fashion-MNIST block, continuation lines joined, comments
    dropped, each split like the shell would."""
    import shlex

    from tests.test_docs import DOCS, fenced_blocks, section

    blocks = fenced_blocks(section((DOCS / "training.md").read_text(encoding="utf-8"), "Real data: Fashion"))
    assert len(blocks) == 1 and blocks[0][0] == "bash"
    text = blocks[0][1].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in text.splitlines()]
    return [c for c in commands if c]


@needs_fashion
@pytest.mark.timeout(HANG_S + 300)
def test_the_documented_commands_run_as_written(tmp_path) -> None:
    """docs/training.md's block, run with /tmp/ moved under tmp_path and each training run cut to 2 steps:
    rendered data served from the NFS stand-in (epoch 1 decodes through slowfile://) and from a cache the
    daemon filled (epoch 1 has no miss)."""
    tools = {"datacache-train": [sys.executable, "-m", "trainer"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "datacache-daemon": [sys.executable, "-m", "cache_daemon"]}
    commands = _doc_commands()
    assert [c[0] for c in commands] == ["datacache-train", "torchrun", "datacache-daemon", "torchrun"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for cmd in commands:
        argv = [*tools[cmd[0]], *(a.replace("/tmp/", f"{tmp_path}/").replace("runs/", f"{tmp_path}/runs/")
                                  for a in cmd[1:])]
        if cmd[0] == "torchrun":
            argv += ["--epochs", "1", "--steps-per-epoch", "2", "--val-every", "0", "--no-progress"]
        res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=HANG_S / 2)
        assert res.returncode == 0, (argv, res.stdout[-2000:], res.stderr[-2000:])

    def first_epoch(run: str) -> dict:
        with open(tmp_path / "runs" / run / "metrics.jsonl") as f:
            return next(r for r in map(json.loads, f) if r["event"] == "epoch")
    nfs, daemon = first_epoch("fashion-nfs"), first_epoch("fashion")
    assert nfs["cache_misses"] == nfs["decoded"] == 2 * 256 and nfs["cache_hits"] == 0
    assert daemon["cache_misses"] == 0 and daemon["cache_hits"] == 2 * 256


def test_readme_accuracy_section_is_the_json() -> None:
    """Every number of README's "Accuracy on real data" equals bench/results/fashion.json (ours) or
    Zalando's published table as bench.fashion records it (theirs)."""
    import re

    from bench.fashion import PUBLISHED
    from tests.test_docs import README, section
    from trainer.models import resnet18

    body = section(README.read_text(encoding="utf-8"), "Accuracy on real data")
    doc = json.loads((Path(REPO) / "bench" / "results" / "fashion.json").read_text(encoding="utf-8"))
    rows = doc["results"]["rows"]
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
             if line.startswith("|")][2:]
    ours = 0
    for label, params, epochs, top1, wall, row in table:
        if label.startswith("published: "):
            key = label[len("published: "):]
            assert key in PUBLISHED, label
            assert top1 == f"{100 * PUBLISHED[key]:.1f} %", label
            if label.startswith("published: ResNet18"):
                assert params == f"{sum(p.numel() for p in resnet18(10).parameters()) / 1e6:.1f}M"
            continue
        r = rows[row.strip("`")]
        ours += 1
        width = int(r["args"][r["args"].index("--width") + 1]) if "--width" in r["args"] else 8
        assert params == f"{_params(width):,}", label
        assert (int(epochs), top1, wall) == (r["epochs"], f"{100 * r['top1']:.2f} %",
                                             f"{r['seconds'] / 60:.1f} min"), label
    assert ours >= 4
    prose = " ".join(body.split())
    ratios, extra = doc["ratios"], doc["results"]
    assert f"{ratios['parity_minus_reference_pp']:+.2f} pp over the torchvision pipeline" in prose
    assert f"spread {extra['dense_spread_pp']:.2f} / {extra['reference_spread_pp']:.2f} pp" in prose
    assert f"{ratios['cache_vs_reference_samples_per_s']:.2f}x as many samples per second" in prose
    assert re.search(r"ResNet18.*\| 11\.2M \|", body)


def _row(top1: float) -> dict:
    """A measured row as ratios_of reads it (top-1 and a rate)."""
    return {"top1": top1, "samples_per_s_median": 1.0}


def test_warmup_rows_cover_every_sparse_method_and_their_worst() -> None:
    """``--rows warmup``: 2 dense epochs then each sparse method at 0.1 %; the worst of the four is
    reported only once every one is measured."""
    from bench.fashion import SPARSE, ratios_of, rows_of

    rows = rows_of("warmup", quick=False)
    assert sorted(rows) == sorted(f"{m}_0.1pct_warm2_s0" for m in SPARSE)
    for m, (launcher, args) in rows.items():
        method = SPARSE[m.split("_")[0]]
        assert launcher == "trainer" and args[args.index("--comm") + 1] == f"0:allreduce,2:{method[1]}"
        assert args[args.index("--selector") + 1] == method[3] and "0.001" in args

    some = {"dense_s0": _row(0.9), "topk_0.1pct_warm2_s0": _row(0.895), "dgc_0.1pct_warm2_s0": _row(0.893)}
    ratios, _, _ = ratios_of(some)
    assert round(ratios["topk_0.1pct_warm2_minus_dense_pp"], 6) == -0.5
    assert "sparse_worst_warm2_minus_dense_pp_0.1pct" not in ratios
    every = {**some, "mstopk_0.1pct_warm2_s0": _row(0.899), "hitopk_0.1pct_warm2_s0": _row(0.901)}
    ratios, _, _ = ratios_of(every)
    assert round(ratios["sparse_worst_warm2_minus_dense_pp_0.1pct"], 6) == -0.7


def test_seed1_rows_repeat_the_1pct_pair_and_the_ratio_averages_the_seeds() -> None:
    """``--rows seed1``: TopK and MSTopK at 1 % with seed 1; ``mstopk_minus_topk_pp_1pct`` is the mean of
    the per-seed differences once both seeds are measured (seed 0 alone before)."""
    from bench.fashion import SPARSE, ratios_of, rows_of

    rows = rows_of("seed1", quick=False)
    assert sorted(rows) == ["mstopk_1pct_s1", "topk_1pct_s1"]
    for name, (launcher, args) in rows.items():
        method = SPARSE[name.split("_")[0]]
        assert launcher == "trainer" and args[:4] == method
        assert args[args.index("--seed") + 1] == "1" and args[args.index("--density") + 1] == "0.01"
        assert "--error-feedback" in args

    one = {"dense_s0": _row(0.92), "topk_1pct_s0": _row(0.915), "mstopk_1pct_s0": _row(0.914)}
    ratios, extra, _ = ratios_of(one)
    assert round(ratios["mstopk_minus_topk_pp_1pct"], 6) == -0.1
    assert "mstopk_minus_topk_per_seed_pp_1pct" not in extra
    both = {**one, "topk_1pct_s1": _row(0.910), "mstopk_1pct_s1": _row(0.913)}
    ratios, extra, _ = ratios_of(both)
    assert round(ratios["mstopk_minus_topk_pp_1pct"], 6) == 0.1  # mean of -0.1 and +0.3
    assert {k: round(v, 6) for k, v in extra["mstopk_minus_topk_per_seed_pp_1pct"].items()} == \
        {"s0": -0.1, "s1": 0.3}
