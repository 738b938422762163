"""CachedImageNet in one process: ImageFolder face, hits/misses, invalid records, bad inputs, errors."""

from __future__ import annotations

import os
import pickle
from typing import ClassVar

import numpy as np
import pytest
import torch

from client.dataset import CachedImageNet, DatasetError
from datacache.cacheurl import OptionSpec, SchemeSpec, register_scheme
from datacache.config import ConfigError
from datacache.devtools import synth
from datacache.readthrough import manifest_dir_for
from datacache.stores import MemoryStore

SHORT = 48


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("ds") / "train")
    synth.make_imagefolder(root, classes=3, per_class=5, size=(120, 90), seed=3)
    return root


@pytest.fixture(scope="module")
def bad_folder(bad_imagefolder: str, bad_cases: dict[str, str]) -> tuple[str, dict[str, str]]:
    """conftest's shared bad-input tree (read-only): every synth bad case, a dangling symlink,
    a directory named like a JPEG and an empty class folder."""
    return bad_imagefolder, bad_cases


def _lmdb(tmp_path) -> str:
    return f"lmdb://{tmp_path}/cache"


def test_imagefolder_face_and_hits(folder: str, tmp_path) -> None:
    ds = CachedImageNet(folder, cache=_lmdb(tmp_path), short_side=SHORT, t1_dir=None)
    classes = sorted(os.listdir(folder))
    assert ds.classes == classes and ds.class_to_idx == {c: i for i, c in enumerate(classes)}
    expect = [(os.path.join(folder, c, f), i) for i, c in enumerate(classes)
              for f in sorted(os.listdir(os.path.join(folder, c)))]
    assert ds.samples == expect and ds.targets == [t for _, t in expect] and len(ds) == len(expect)

    cold = ds.__getitems__(list(range(len(ds))))
    st = ds.stats()
    assert (st["misses"], st["hits"], st["decoded"], st["t2"]["written"]) == (len(ds), 0, len(ds), len(ds))
    assert st["bytes_read"] == sum(os.path.getsize(p) for p, _ in expect)
    for (img, label), (_, t) in zip(cold, expect):
        assert img.dtype == torch.uint8 and img.shape[0] == 3 and min(img.shape[1:]) == SHORT
        assert label == t
    ds.reset_stats()
    warm = [ds[i] for i in range(len(ds))]
    st = ds.stats()
    assert (st["hits"], st["misses"], st["decoded"], st["bytes_read"]) == (len(ds), 0, 0, 0)
    for (a, la), (b, lb) in zip(cold, warm):
        assert la == lb and torch.equal(a, b)
    assert ds[-1][1] == ds.targets[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]
    # the manifest is persisted next to the cache
    assert any(f.endswith(".msgpack") for f in os.listdir(manifest_dir_for(ds.cache_url)))


def test_transform_and_bad_option(folder: str) -> None:
    ds = CachedImageNet(folder, cache="memory://", short_side=SHORT, t1_dir=None, output="tensor",
                        transform=lambda x: x[:, :SHORT, :SHORT].float() / 255)
    img, _ = ds[2]
    assert img.dtype == torch.float32 and img.shape == (3, SHORT, SHORT) and float(img.max()) <= 1.0
    with pytest.raises(ConfigError, match=r"substitute.*raise"):
        CachedImageNet(folder, cache="memory://", on_error="skip")


def test_pickles_cheaply_without_handles(folder: str, tmp_path) -> None:
    ds = CachedImageNet(folder, cache=_lmdb(tmp_path), short_side=SHORT, t1_dir=None)
    ds[0]  # opens the store and the source in this process
    blob = pickle.dumps(ds)
    assert len(blob) < 40_000  # manifest + config + two tiny counter tensors, no env handles
    clone = pickle.loads(blob)
    assert clone.reader._store is None and clone.reader._source is None
    assert torch.equal(clone[0][0], ds[0][0])


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "wrong_label", "foreign_key"])
def test_invalid_record_is_a_miss_and_rewritten(folder: str, tmp_path, damage: str) -> None:
    ds = CachedImageNet(folder, cache=_lmdb(tmp_path), short_side=SHORT, t1_dir=None)
    good, label = ds[4]
    good = good.clone()
    store = ds.store  # the process-wide handle (LMDB allows one per environment and process)
    key = ds.key(4)
    orig = bytes(store.get_many([key])[0])
    rec = bytearray(orig)
    if damage == "truncate":
        bad = bytes(rec[: len(rec) // 2])
    elif damage == "bitflip":
        rec[-10] ^= 0x01
        bad = bytes(rec)
    elif damage == "foreign_key":  # a valid record of another sample (same label) under this key
        j = next(j for j in range(len(ds)) if j != 4 and ds.targets[j] == label)
        ds[j]
        bad = bytes(store.get_many([ds.key(j)])[0])
    else:
        from datacache.record import decode_record, encode_record

        pixels, lab = decode_record(bytes(rec), key)
        bad = encode_record(np.ascontiguousarray(pixels), lab + 1, key=key)
    assert store.put_many([(key, bad)], overwrite=True) == 1
    ds.reset_stats()
    img, lab2 = ds[4]
    st = ds.stats()
    assert (st["misses"], st["t2"]["invalid_rewritten"], st["decoded"], st["t2"]["written"]) == (1, 1, 1, 1)
    assert lab2 == label and torch.equal(img, good)
    assert bytes(store.get_many([key])[0]) == orig  # the same record as before the damage
    ds.reset_stats()
    ds[4]
    assert ds.stats()["hits"] == 1  # repaired record now serves


def test_bad_inputs_substitute(bad_folder, tmp_path) -> None:
    root, cases = bad_folder
    ds = CachedImageNet(root, cache=_lmdb(tmp_path), short_side=SHORT, t1_dir=None,
                        allow_empty=True)  # the tree has an empty class folder (torchvision: same flag)
    failing = {cases[k] for k in ("corrupt", "truncated", "zero_byte", "dangling_symlink")}
    assert cases["non_image"] not in ds.manifest.paths  # skipped by the listing, counted
    assert ds.manifest.ignored.get("non_image") == 1
    assert not any(p.startswith(cases["directory_named_jpeg"] + "/") or p == cases["directory_named_jpeg"]
                   for p in ds.manifest.paths)
    assert cases["empty_class"] in ds.classes  # keeps its index, like torchvision(allow_empty=True)
    idx = list(range(len(ds)))
    batch = ds.__getitems__(idx)
    assert len(batch) == len(ds)  # batch size unchanged
    q = ds.quarantined
    assert set(q) == failing
    assert "decode" in q[cases["corrupt"]] and "read" in q[cases["dangling_symlink"]]
    st = ds.stats()
    assert st["quarantined"] == 4 and st["substituted"] == 4 and st["errors"] >= 4
    # deterministic stand-in: the next index that loads
    paths = ds.manifest.paths
    for i in idx:
        if paths[i] in failing:
            j = (i + 1) % len(ds)
            while paths[j] in failing:
                j = (j + 1) % len(ds)
            assert torch.equal(batch[i][0], batch[j][0]) and batch[i][1] == batch[j][1]
    # odd-but-valid images decode correctly
    by_rel = {p: k for k, p in enumerate(paths)}
    exif = batch[by_rel[cases["exif_rotated"]]][0]
    assert exif.shape[1] > exif.shape[2]  # rotated: portrait
    uni = batch[by_rel[cases["unicode"]]][0]
    assert min(uni.shape[1:]) == SHORT and cases["unicode"] not in q
    # a second dataset on the same cache does not re-read files known to be undecodable
    ds2 = CachedImageNet(root, cache=_lmdb(tmp_path), short_side=SHORT, t1_dir=None, allow_empty=True)
    ds2.__getitems__(idx)
    st2 = ds2.stats()
    # corrupt, truncated and zero-byte are remembered; the dangling link (a read error) is retried
    assert st2["t2"]["known_bad"] == 3
    # the 4 bad samples miss (their substitutes are extra lookups); nothing is read or decoded
    assert st2["misses"] >= 4 and (st2["decoded"], st2["bytes_read"]) == (0, 0)
    assert set(ds2.quarantined) == failing


@pytest.mark.parametrize("case", ["corrupt", "truncated", "zero_byte", "dangling_symlink"])
def test_bad_inputs_raise_names_the_file(bad_folder, case: str) -> None:
    root, cases = bad_folder
    ds = CachedImageNet(root, cache="memory://", short_side=SHORT, t1_dir=None, on_error="raise",
                        allow_empty=True)
    i = ds.manifest.paths.index(cases[case])
    with pytest.raises(DatasetError) as ei:
        ds[i]
    msg = str(ei.value)
    assert cases[case] in msg and "on_error='substitute'" in msg
    assert ds.stats()["errors"] == 1


class _CountingStore(MemoryStore):
    """A process-local store recording the size of every backend read (a network store's round trips)."""

    calls: ClassVar[list[int]] = []

    def _get_many(self, keys):  # type: ignore[override]
        _CountingStore.calls.append(len(keys))
        return super()._get_many(keys)


def test_store_reads_are_chunked_by_bytes_inside_the_store(folder: str) -> None:
    register_scheme(SchemeSpec(
        "counting", lambda spec: _CountingStore(spec.url, fetch_bytes=spec.option("fetch_bytes")),
        options={"fetch_bytes": OptionSpec("bytes")}))
    # ~9 KB expected per 48-px record -> 20 KB per round trip = 2 keys per read
    ds = CachedImageNet(folder, cache="counting://t?fetch_bytes=20000", short_side=SHORT, t1_dir=None)
    ds.__getitems__(list(range(6)))  # cold: writes the records
    _CountingStore.calls.clear()
    out = ds.__getitems__(list(range(6)))
    assert ds.stats()["hits"] == 6 and len(out) == 6
    assert _CountingStore.calls == [2, 2, 2]


def test_jpeg_encoded_variant_serves_the_same_pixels_cold_and_warm(folder: str) -> None:
    from datacache.config import Variant

    ds = CachedImageNet(folder, cache="memory://", variant=Variant(short_side=SHORT, encoding="jpeg"),
                        t1_dir=None)
    cold = ds.__getitems__([0, 1])
    warm = ds.__getitems__([0, 1])
    assert ds.stats()["hits"] == 2 and ds.stats()["decoded"] == 2
    for (a, la), (b, lb) in zip(cold, warm):
        assert la == lb and torch.equal(a, b) and min(a.shape[1:]) == SHORT
