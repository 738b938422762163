"""Quarantine reports stay small whatever the number of bad files (daemon /status, fill logs)."""

from __future__ import annotations

import json
import logging
import os
import threading

from datacache.quarantine_summary import MAX_EXAMPLES, MAX_KINDS, QuarantineSummary, reason_kind
from datacache.stores import open_store

SHORT = 16


def test_reason_kind_drops_per_file_details() -> None:
    r = "cannot decode: not a decodable image (1011 bytes); remove the file or replace it with a valid image"
    assert reason_kind(r) == "cannot decode: not a decodable image"
    r2 = "cannot read the file: [Errno 2] No such file or directory: '/data/x/n01/a b.JPEG'"
    assert reason_kind(r2) == "cannot read the file: [Errno 2] No such file or directory:"
    assert reason_kind("") == "unknown" and len(reason_kind("x" * 500)) == 100


def test_summary_dedupes_caps_examples_and_kinds() -> None:
    q = QuarantineSummary()
    assert q.add({f"c/{i}.JPEG": f"cannot decode: bad ({i} bytes)" for i in range(50)}) == 50
    assert q.add({f"c/{i}.JPEG": "cannot decode: bad (1 bytes)" for i in range(40, 60)}) == 10  # 40..49 seen
    assert len(q) == 60 and q.by_reason == {"cannot decode: bad": 60}
    assert list(q.examples) == [f"c/{i}.JPEG" for i in range(MAX_EXAMPLES)]  # the first seen, full reasons
    assert q.examples["c/3.JPEG"] == "cannot decode: bad (3 bytes)"
    q.add({f"k/{i}": f"kind {i}" for i in range(MAX_KINDS + 5)})
    assert len(q.by_reason) == MAX_KINDS + 1 and q.by_reason["other"] == 6  # 20 kinds + "other"


def test_summary_counts_each_file_once_across_its_merged_and_recent_hashes() -> None:
    """Hashes move from a small set into a sorted array every MERGE_AT files: a file seen again is
    found in either, in any order of arrival (the reference: a set of the paths)."""
    import random

    from datacache.quarantine_summary import MERGE_AT

    rng = random.Random(5)
    paths = [f"n{rng.randrange(10**6):07d}/{i}.JPEG" for i in range(3 * MERGE_AT + 17)]
    q, ref = QuarantineSummary(), set()
    for start in range(0, len(paths), 1000):
        batch = paths[start:start + 1000] + rng.sample(paths[:start + 1000], 300)  # repeats, old and new
        want = len(set(batch) - ref)
        assert q.add(dict.fromkeys(batch, "cannot decode: bad")) == want
        ref |= set(batch)
        assert len(q) == len(ref)
    assert q.add(dict.fromkeys(paths, "x")) == 0 and q.by_reason == {"cannot decode: bad": len(ref)}
    assert q.as_json()["count"] == len(ref)


def _dataset_with_bad_files(factory, bad: int) -> str:
    root = factory(classes=2, per_class=3, size=(40, 30))
    for i in range(bad):
        with open(os.path.join(root, f"c00{i % 2}", f"bad{i:04d}.JPEG"), "wb") as f:
            # Text, not random bytes: 200 random files once gave one whose first bytes matched an
            # image plugin's loose signature (a different reason). Still a different size each.
            f.write((b"this is not an image file; " * 20)[: 300 + i])
    return root


def _pass_status(root: str, url: str, caplog) -> tuple[dict, int]:
    from cache_daemon.daemon_config import DaemonConfig, DatasetSpec
    from cache_daemon.ingest import DatasetState, ingest_pass
    from datacache.cacheurl import parse_cache_url

    cfg = DaemonConfig(cache=url, node="n0", ownership="all", workers=1, t1_dir="none")
    store = open_store(parse_cache_url(url).tiers[-1])
    state = DatasetState(DatasetSpec(root, short_side=SHORT))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="datacache.warm"):
        ingest_pass(cfg, state, store, decoder=None, stop=threading.Event(), progress=False)
    store.close()
    assert state.status == "full", state.error
    lines = [r for r in caplog.records if "quarantined" in r.getMessage()]
    return state.as_json(), len(lines)


def test_status_size_and_log_lines_do_not_grow_with_bad_files(imagefolder_factory, tmp_path, caplog) -> None:
    few = _dataset_with_bad_files(imagefolder_factory, 20)
    many = _dataset_with_bad_files(imagefolder_factory, 200)
    st_few, log_few = _pass_status(few, f"lmdb://{tmp_path}/a", caplog)
    st_many, log_many = _pass_status(many, f"lmdb://{tmp_path}/b", caplog)
    assert st_few["quarantined_count"] == 20 and st_many["quarantined_count"] == 200
    assert st_many["quarantined_by_reason"] == {"cannot decode: not a decodable image": 200}
    assert len(st_many["quarantined"]) == MAX_EXAMPLES
    assert all(r.startswith("cannot decode") for r in st_many["quarantined"].values())
    size_few, size_many = len(json.dumps(st_few)), len(json.dumps(st_many))
    assert abs(size_many - size_few) <= 40, (size_few, size_many)  # digits of counts and sizes only
    assert log_few == 20 and log_many == 21  # 20 files one by one, then one summary line
