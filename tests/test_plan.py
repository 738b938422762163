"""datacache plan: sizes from real decodes, Redis per-key cost measured on a real redis-server."""

from __future__ import annotations

import os

import pytest

from datacache.cli import main
from datacache.config import Variant
from datacache.decode import decode_image
from datacache.plan import jemalloc_class, measure_redis_overhead, plan, redis_bytes_per_key
from datacache.record import encode_record
from tests.redis_utils import needs_redis


def test_jemalloc_size_classes() -> None:
    # jemalloc's documented classes: 16-byte steps to 128, then 4 classes per doubling
    assert [jemalloc_class(n) for n in (1, 9, 100, 129, 160, 161, 1025, 49169, 77017, 65537)] == \
        [8, 16, 112, 160, 160, 192, 1280, 57344, 81920, 81920]


def test_plan_numbers_and_recommendations(imagefolder_factory, capsys) -> None:
    root = imagefolder_factory(classes=2, per_class=10, size=(500, 375))
    # an independent size: decode one file to the variant and encode its record
    with open(os.path.join(root, "c000", sorted(os.listdir(os.path.join(root, "c000")))[0]), "rb") as f:
        px = decode_image(f.read(), Variant(short_side=96))
    one = len(encode_record(px, 0, Variant(short_side=96), key=b"dc:0123456789abcdef:s96m192bilinear-raw:0"))
    big = plan(root, nodes=2, memory_per_node=64 << 20, short_side=96, sample=20)
    raw, jpeg, files = big["layouts"]
    assert abs(raw["per_sample"] - redis_bytes_per_key(one)) < 0.02 * raw["per_sample"]
    assert raw["total"] == pytest.approx(raw["per_sample"] * 20) and raw["fits"]
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    assert files["total"] >= on_disk
    assert jpeg["per_sample"] < raw["per_sample"] / 3 and big["recommendation"].startswith("encoding='raw'")
    # memory for ~10 raw samples: jpeg fits, raw does not
    tight = plan(root, nodes=1, memory_per_node=int(raw["per_sample"] * 10 / 0.9), short_side=96, sample=20)
    assert [lay["fits"] for lay in tight["layouts"][:2]] == [False, True]
    assert tight["recommendation"].startswith("encoding='jpeg'")
    # the hit ratio to expect when raw records do not all fit: MinIO keeps f, a rolling fill min(1, f + B/R)
    f = tight["capacity"] / tight["layouts"][0]["total"]
    assert tight["hit_ratio"]["minio"] == pytest.approx(f) and 0.4 < f < 0.6
    assert tight["hit_ratio"]["rolling"] is None  # no training rate given: not guessed
    rated = plan(root, nodes=1, memory_per_node=int(raw["per_sample"] * 10 / 0.9), short_side=96, sample=20,
                 train_rate=100.0, fill_rate=25.0)
    assert rated["hit_ratio"]["rolling"] == pytest.approx(f + 0.25)
    fast = plan(root, nodes=1, memory_per_node=int(raw["per_sample"] * 10 / 0.9), short_side=96, sample=20,
                train_rate=100.0, fill_rate=80.0)
    assert fast["hit_ratio"]["rolling"] == 1.0
    measured = plan(root, nodes=2, memory_per_node=int(raw["per_sample"] * 10 / 0.9), short_side=96,
                    sample=20, train_rate=100.0, fill_workers=3)
    h = measured["hit_ratio"]
    assert h["fill_rate"] == pytest.approx(h["decode_rate_per_process"] * 3 * 2) and h["fill_rate"] > 0
    assert main(["plan", root, "--nodes", "1", "--memory-per-node", str(int(raw["per_sample"] * 10 / 0.9)),
                 "--short-side", "96", "--train-rate", "100", "--fill-rate", "25"]) == 0
    assert f"min(1, f + B/R) = {f + 0.25:.2f}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", root, "--nodes", "1", "--memory-per-node", "1GiB", "--train-rate", "0"])
    assert "--train-rate" in capsys.readouterr().err
    none = plan(root, nodes=1, memory_per_node=int(jpeg["per_sample"] * 5), short_side=96, sample=20)
    assert none["recommendation"].startswith("nothing fits") and "MinIO" in none["recommendation"]
    assert main(["plan", root, "--nodes", "2", "--memory-per-node", "64MiB", "--short-side", "96"]) == 0
    out = capsys.readouterr().out
    assert "raw" in out and "jpeg" in out and "files" in out and "recommendation: encoding='raw'" in out
    with pytest.raises(SystemExit) as ei:  # usage error: exit 2 naming the option
        main(["plan", root, "--nodes", "0", "--memory-per-node", "1GiB"])
    assert ei.value.code == 2 and "--nodes" in capsys.readouterr().err


@needs_redis
@pytest.mark.parametrize("value_bytes", [11_000, 77_000])
def test_redis_per_key_model_matches_a_real_server(value_bytes: int) -> None:
    m = measure_redis_overhead(value_bytes, n=400)
    assert abs(m["per_key"] - m["model"]) < 0.03 * m["per_key"], m
    assert m["overhead"] > 0
