from __future__ import annotations

import pytest

from datacache.config import (
    ENCODING_CHOICES,
    RESAMPLE_CHOICES,
    ConfigError,
    Variant,
    default_cache_url,
    default_t1_dir,
)
from datacache.keys import parse_key, sample_key


def test_variant_defaults_and_tag() -> None:
    v = Variant()
    assert (v.short_side, v.long_cap, v.resample, v.encoding) == (160, 320, "bilinear", "raw")
    assert v.tag() == "s160m320bilinear-raw"
    assert Variant(short_side=96, max_long_side=200, resample="lanczos", encoding="jpeg",
                   jpeg_quality=85).tag() == "s96m200lanczos-jpeg85"
    tags = {Variant(short_side=s, resample=r).tag() for s in (96, 160) for r in RESAMPLE_CHOICES}
    assert len(tags) == 2 * len(RESAMPLE_CHOICES)  # every field that changes pixels changes the tag


@pytest.mark.parametrize("kwargs, needle", [
    ({"resample": "cubic"}, "bilinear"),
    ({"encoding": "png"}, ", ".join(ENCODING_CHOICES)),
    ({"short_side": 0}, "positive"),
    ({"short_side": 160, "max_long_side": 100}, ">= short_side"),
    ({"jpeg_quality": 0}, "1..100"),
])
def test_variant_errors_list_choices(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        Variant(**kwargs)


def test_default_locations_follow_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_url() == f"lmdb://{tmp_path}/datacache/lmdb"
    assert default_t1_dir() == f"{tmp_path}/datacache/t1"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_url().endswith("/.cache/datacache/lmdb")


def test_keys_roundtrip_and_validation() -> None:
    k = sample_key("0123456789abcdef", "s160m320bilinear-raw", 42)
    assert k == b"dc:0123456789abcdef:s160m320bilinear-raw:42"
    assert parse_key(k) == ("dc", "0123456789abcdef", "s160m320bilinear-raw", 42)
    assert parse_key(memoryview(sample_key("ff", "t", 7, prefix="q"))) == ("q", "ff", "t", 7)
    for bad in (b"dc:ff:t", b"dc:ff:t:x", "a:b:c:d:1"):
        with pytest.raises(ValueError):
            parse_key(bad)
    with pytest.raises(ValueError):
        sample_key("ff", "a:b", 1)
    with pytest.raises(ValueError):
        sample_key("ff", "t", -1)
