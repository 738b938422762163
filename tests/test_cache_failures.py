"""End to end through CachedImageNet: what the cache serves is what the source holds now, and the
cache can never take the training loop down (read-only cache, full disk, unreadable store, files
that change under the job, failures inside DataLoader workers)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from client.dataset import CachedImageNet
from datacache.config import Variant
from datacache.decode import decode_image
from datacache.devtools import synth

SHORT = 48


def as_list(batch: list) -> list:
    return batch


def _jpeg(seed: int, size: tuple[int, int] = (120, 90)) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1] // 6, size[0] // 6, 3), dtype=np.uint8)).resize(size)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _same_size_pair() -> tuple[bytes, bytes]:
    """Two different valid JPEGs of exactly the same length (padding after EOI is ignored)."""
    a, b = _jpeg(1), _jpeg(2)
    n = max(len(a), len(b))
    return a + b"\0" * (n - len(a)), b + b"\0" * (n - len(b))


def _pixels(data: bytes) -> torch.Tensor:
    return torch.from_numpy(decode_image(data, Variant(short_side=SHORT))).permute(2, 0, 1)


@pytest.fixture
def tree(tmp_path) -> str:
    root = str(tmp_path / "train")
    synth.make_imagefolder(root, classes=2, per_class=4, size=(120, 90), seed=7)
    return root


def test_replaced_file_is_never_served_from_an_old_t1_copy(tree: str, tmp_path) -> None:
    old, new = _same_size_pair()
    victim = os.path.join(tree, "c001", "00002.JPEG")
    with open(victim, "wb") as f:
        f.write(old)
    os.utime(victim, (1_000_000, 1_000_000))
    url = f"slowfile://{tree}?latency_ms=0&mbps=0"  # remote-like: goes through T1
    kw = dict(short_side=SHORT, t1_dir=str(tmp_path / "t1"))
    ds = CachedImageNet(url, cache=f"lmdb://{tmp_path}/c", **kw)
    i = list(ds.manifest.paths).index("c001/00002.JPEG")
    assert torch.equal(ds[i][0], _pixels(old)) and ds.stats()["t1"]["misses"] >= 1
    tmp = victim + ".tmp"
    with open(tmp, "wb") as f:  # rsync: write a temp file, then rename it over the old one
        f.write(new)
    os.replace(tmp, victim)
    ds2 = CachedImageNet(url, cache=f"lmdb://{tmp_path}/c", **kw)  # "dirs" sees the rename: new fingerprint
    assert ds2.manifest.fingerprint != ds.manifest.fingerprint
    img, _ = ds2[i]
    assert torch.equal(img, _pixels(new)) and not torch.equal(img, _pixels(old))
    assert ds2.stats()["t1"]["hits"] == 0


def test_in_place_rewrite_needs_revalidate_full(tree: str, tmp_path) -> None:
    old, new = _same_size_pair()
    victim = os.path.join(tree, "c000", "00001.JPEG")
    with open(victim, "wb") as f:
        f.write(old)
    cache = f"lmdb://{tmp_path}/c"
    ds = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    i = list(ds.manifest.paths).index("c000/00001.JPEG")
    assert torch.equal(ds[i][0], _pixels(old))
    d = os.path.dirname(victim)
    dir_st = os.stat(d)
    with open(victim, "r+b") as f:  # rewritten in place: the directory's mtime does not change
        f.write(new)
    os.utime(d, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))
    # "dirs": documented not to see it
    stale = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    assert stale.manifest.fingerprint == ds.manifest.fingerprint
    full = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None, revalidate="full")
    assert full.manifest.fingerprint != ds.manifest.fingerprint
    assert torch.equal(full[i][0], _pixels(new))


def _cold_and_count(ds: CachedImageNet) -> list:
    out = ds.__getitems__(list(range(len(ds))))
    assert len(out) == len(ds) and all(img.dtype == torch.uint8 for img, _ in out)
    return out


def test_readonly_cache_serves_and_counts_skipped_writes(tree: str, tmp_path, caplog) -> None:
    path = tmp_path / "c"
    first = CachedImageNet(tree, cache=f"lmdb://{path}", short_side=SHORT, t1_dir=None)
    first.__getitems__(list(range(4)))  # half of the samples cached
    ro = CachedImageNet(tree, cache=f"lmdb://{path}?readonly=1", short_side=SHORT, t1_dir=None)
    assert ro.manifest_dir == os.path.join(str(path), "manifests")  # the option is not part of the path
    with caplog.at_level(logging.WARNING, logger="datacache.stores"):
        out = _cold_and_count(ro)
        _cold_and_count(ro)
    st = ro.stats()
    assert st["hits"] == 8 and st["decoded"] == 8 and st["t2"]["write_errors"] == 8
    assert st["t2"]["written"] == 0 and st["quarantined"] == 0
    warnings = [r for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warnings) == 1 and "read-only" in warnings[0].getMessage()
    assert [label for _, label in out] == list(ro.targets)


def _mount(args: list[str]) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def _mounted(args: list[str], where: str):
    if not _mount([*args, where]):
        pytest.skip("needs root and mount(8) to create a tmpfs / read-only bind mount")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True)


def test_read_only_filesystem_cache_serves_hits_and_skips_writes(tree: str, tmp_path) -> None:
    src = tmp_path / "c"
    first = CachedImageNet(tree, cache=f"lmdb://{src}", short_side=SHORT, t1_dir=None)
    first.__getitems__([0, 1, 2])
    first.store.close()  # the same files must not be open twice in one process (LMDB's rule)
    ro = tmp_path / "ro"
    ro.mkdir()
    with _mounted(["--bind", str(src)], str(ro)):
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True)
        assert remount.returncode == 0, remount.stderr
        ds = CachedImageNet(tree, cache=f"lmdb://{ro}", short_side=SHORT, t1_dir=None)
        _cold_and_count(ds)
        st = ds.stats()
        assert st["hits"] == 3 and st["decoded"] == len(ds) - 3
        assert st["t2"]["write_errors"] == len(ds) - 3 and st["t2"]["read_errors"] == 0


@pytest.mark.parametrize("how", ["tmpfs", "max_map_size"])
def test_full_disk_or_map_serves_every_sample(small_imagefolder: str, tmp_path, how: str) -> None:
    """~100 KB records (short side 160) x 24 samples do not fit 2 MB: writes fail part-way."""
    disk = tmp_path / "disk"
    disk.mkdir()
    url = f"lmdb://{disk}/c" + ("?max_map_size=1MiB&map_size=256KiB" if how == "max_map_size" else "")
    ctx = _mounted(["-t", "tmpfs", "-o", "size=2m", "tmpfs"], str(disk)) if how == "tmpfs" \
        else contextlib.nullcontext()
    with ctx:
        ds = CachedImageNet(small_imagefolder, cache=url, short_side=160, t1_dir=None)
        first = [x for s in range(0, len(ds), 4) for x in ds.__getitems__(list(range(s, s + 4)))]
        st = ds.stats()
        assert 0 < st["t2"]["written"] < len(ds) and st["t2"]["write_errors"] == len(ds) - st["t2"]["written"]
        ds.reset_stats()
        second = [x for s in range(0, len(ds), 4) for x in ds.__getitems__(list(range(s, s + 4)))]
        st2 = ds.stats()
        assert st2["hits"] == st["t2"]["written"] and st2["decoded"] == len(ds) - st["t2"]["written"]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, second))
        ds.store.close()


def test_unreadable_store_and_short_reads_inside_dataloader_workers(tree: str, tmp_path) -> None:
    """A store that cannot be opened at all is misses + counters in the workers, never an exception;
    a file that is shorter than listed is skipped for this run only, never remembered as bad."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # the LMDB directory path is a file: the store cannot be opened
    ds = CachedImageNet(tree, cache=f"lmdb://{blocker}/c", short_side=SHORT, t1_dir=None)
    loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="fork", collate_fn=as_list)
    got = [item for batch in loader for item in batch]
    st = ds.stats()
    assert len(got) == len(ds) and st["decoded"] == len(ds) and st["processes"] == 2
    assert st["t2"]["read_errors"] >= len(ds) and st["t2"]["write_errors"] == len(ds)

    cache = f"lmdb://{tmp_path}/c2"
    victim = os.path.join(tree, "c000", "00003.JPEG")
    ds1 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    with open(victim, "rb") as f:
        good = f.read()
    st0 = os.stat(victim)
    with open(victim, "r+b") as f:
        f.truncate(len(good) // 2)  # shorter than the manifest says: a cut-short read
    loader = DataLoader(ds1, batch_size=3, num_workers=2, multiprocessing_context="fork", collate_fn=as_list)
    assert sum(len(b) for b in loader) == len(ds1)
    q = ds1.quarantined
    assert list(q) == ["c000/00003.JPEG"] and "cannot read" in q["c000/00003.JPEG"]
    assert "listing says" in ds1.quarantine_local.get("c000/00003.JPEG", "listing says")
    with open(victim, "wb") as f:  # the file is back, same size and mtime: same fingerprint
        f.write(good)
    os.utime(victim, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    ds2 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None, revalidate="full")
    assert ds2.manifest.fingerprint == ds1.manifest.fingerprint
    ds2.__getitems__(list(range(len(ds2))))
    assert ds2.quarantined == {} and ds2.stats()["t2"]["known_bad"] == 0


def test_out_of_memory_is_transient_and_a_fixed_file_is_retried(tree: str, tmp_path, monkeypatch) -> None:
    from PIL import ImageFile

    monkeypatch.setenv("DATACACHE_DECODER", "pil")
    cache = f"lmdb://{tmp_path}/c"
    real_load = ImageFile.ImageFile.load
    calls = {"n": 0}

    def load_once_oom(self):  # the first decode of the process runs out of memory
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load_once_oom)
    ds = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    ds[0]
    assert "out of memory" in ds.quarantined[ds.manifest.paths[0]]
    monkeypatch.setattr(ImageFile.ImageFile, "load", real_load)
    ds2 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    ds2[0]
    assert ds2.quarantined == {} and ds2.stats()["decoded"] == 1

    victim = os.path.join(tree, "c001", "00000.JPEG")  # genuinely corrupt, complete bytes: remembered
    with open(victim, "wb") as f:
        f.write(b"\xff\xd8" + b"garbage" * 100)
    ds3 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None, revalidate="full")  # in-place edit
    j = list(ds3.manifest.paths).index("c001/00000.JPEG")
    ds3[j]
    ds4 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None)
    ds4[j]
    assert ds4.stats()["t2"]["known_bad"] == 1 and ds4.stats()["bytes_read"] < 1000
    with open(victim, "wb") as f:  # fixed: a new identity clears the verdict
        f.write(_jpeg(5))
    ds5 = CachedImageNet(tree, cache=cache, short_side=SHORT, t1_dir=None, revalidate="full")
    img, _ = ds5[j]
    assert ds5.quarantined == {} and torch.equal(img, _pixels(_jpeg(5)))
