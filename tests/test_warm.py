"""``fill_missing`` / ``warm_cache``: what the report counts."""

from __future__ import annotations

import os

from datacache.warm import warm_cache


def test_warm_report_counts_each_source_byte_once(imagefolder_factory, tmp_path) -> None:
    """Two reader threads share one Source: the report's bytes_read is what was read, not the
    sum of per-chunk snapshots of the shared counter (each of which also held the other thread's bytes)."""
    root = imagefolder_factory(classes=4, per_class=24)  # 96 files: 6 chunks, both readers busy
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    kw = {"workers": 2, "short_side": 32, "t1_dir": None, "progress": False}
    rep = warm_cache(root, f"lmdb://{tmp_path}/cache", **kw)
    assert (rep.total, rep.decoded, rep.written) == (96, 96, 96)
    assert rep.bytes_read == total
    again = warm_cache(root, f"lmdb://{tmp_path}/cache", **kw)
    assert (again.skipped, again.bytes_read) == (96, 0)
