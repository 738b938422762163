from __future__ import annotations

import os
import shutil
import time

import pytest

from datacache.devtools import slowfs
from datacache.manifest import IMG_EXTENSIONS, Manifest, ManifestError
from datacache.source import Source


def reference_imagefolder(root: str) -> tuple[list[str], list[int], list[str]]:
    """What torchvision's ImageFolder(allow_empty=True) lists, re-implemented with os.walk."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths, targets = [], []
    for i, c in enumerate(classes):
        for d, _, files in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.relpath(os.path.join(d, f), root))
                    targets.append(i)
    return paths, targets, classes


def test_imagefolder_matches_torchvision_semantics(bad_imagefolder: str, bad_cases: dict) -> None:
    m = Manifest.build(bad_imagefolder)
    paths, targets, classes = reference_imagefolder(bad_imagefolder)
    assert m.paths == paths and m.targets == targets and m.classes == classes
    assert m.class_to_idx == {c: i for i, c in enumerate(classes)}
    assert m.root == "file://" + bad_imagefolder
    assert len(m) == len(paths) == len(m.sizes) == len(m.mtimes)
    # documented skips are counted: the .txt, and the empty class (which keeps its index)
    assert m.ignored["non_image"] == 1 and m.ignored["empty_class"] == 1
    assert "c999_empty" in m.classes and m.class_counts()["c999_empty"] == 0
    assert bad_cases["non_image"] not in m.paths
    # unicode names and dangling symlinks are listed (reading them is the Source's business)
    assert bad_cases["unicode"] in m.paths and bad_cases["dangling_symlink"] in m.paths
    assert not any(p.startswith(bad_cases["directory_named_jpeg"] + "/") or p == bad_cases[
        "directory_named_jpeg"] for p in m.paths)
    assert len(m.fingerprint) == 16 and int(m.fingerprint, 16) >= 0


def test_extensions_case_insensitive_nested_and_outside(tmp_path) -> None:
    root = tmp_path / "ds"
    for rel in ("b/x.JpG", "b/sub/y.PNG", "b/z.webp", "a/q.tiff", "a/readme.md", "loose.jpg"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 10)
    m = Manifest.build(str(root))
    assert m.classes == ["a", "b"]
    assert m.paths == ["a/q.tiff", "b/x.JpG", "b/z.webp", "b/sub/y.PNG"]
    assert m.targets == [0, 1, 1, 1]
    assert m.ignored == {"non_image": 1, "outside_class": 1}


def test_missing_source_names_url(tmp_path) -> None:
    url = str(tmp_path / "nope")
    with pytest.raises(ManifestError, match=r"nope.*does not exist"):
        Manifest.build(url)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="no images found"):
        Manifest.build(str(tmp_path / "empty"))
    with pytest.raises(ManifestError, match="revalidate"):
        Manifest.build(str(tmp_path / "empty"), revalidate="sometimes")


def test_file_lists_txt_and_csv(imagefolder_factory) -> None:
    root = imagefolder_factory(classes=3, per_class=3)
    ref = Manifest.build(root)
    lst = os.path.join(root, "list_nolabel.txt")
    with open(lst, "w") as f:
        f.write("# comment\n" + "\n".join(ref.paths) + "\nc000/missing.JPEG\n")
    m = Manifest.build(lst)
    assert m.paths == ref.paths and m.targets == ref.targets and m.classes == ref.classes
    assert list(m.sizes) == list(ref.sizes) and m.ignored == {"missing": 1}
    assert m.root == ref.root and m.listed == "file://" + os.path.abspath(lst)  # root: what paths are under
    assert Source(m.root).read(m.paths[0]) == Source(ref.root).read(ref.paths[0])
    csv = os.path.join(root, "list_labels.csv")
    with open(csv, "w") as f:
        f.write("path,label\n" + "\n".join(f"{p},{(t + 1) % 3}" for p, t in zip(ref.paths, ref.targets)))
    m2 = Manifest.build(csv)
    assert m2.targets == [(t + 1) % 3 for t in ref.targets] and m2.classes == ["0", "1", "2"]
    assert m2.fingerprint != m.fingerprint  # labels are part of the fingerprint
    names = os.path.join(root, "list_names.csv")
    with open(names, "w") as f:
        f.write("\n".join(f"{p},{'zebra' if t else 'ant'}" for p, t in zip(ref.paths, ref.targets)))
    m3 = Manifest.build(names)
    assert m3.classes == ["ant", "zebra"] and m3.targets == [1 if t else 0 for t in ref.targets]
    # persisted list manifests are reused until the list (or a listed directory) changes
    pdir = os.path.join(root, "..", "persist")
    assert Manifest.build(names, persist_dir=pdir).fingerprint == m3.fingerprint
    assert Manifest.load(Manifest.persist_path(pdir, m3.listed)).listed == m3.listed
    with open(names, "a") as f:
        f.write("\nc000/00000.JPEG,ant\n")
    m4 = Manifest.build(names, persist_dir=pdir)
    assert len(m4) == len(m3) + 1 and m4.fingerprint != m3.fingerprint


def test_fingerprint_tracks_size_and_mtime(imagefolder_factory) -> None:
    root = imagefolder_factory(classes=2, per_class=2)
    fp = Manifest.build(root).fingerprint
    assert Manifest.build(root).fingerprint == fp  # deterministic
    p = os.path.join(root, "c001", "00001.JPEG")
    st = os.stat(p)
    os.utime(p, (st.st_atime, st.st_mtime + 5))
    assert Manifest.build(root).fingerprint != fp


def test_persist_and_revalidate(imagefolder_factory, tmp_path, monkeypatch) -> None:
    root = imagefolder_factory(classes=2, per_class=3)
    pdir = str(tmp_path / "persist")
    m1 = Manifest.build(root, persist_dir=pdir)
    saved = Manifest.persist_path(pdir, m1.root)
    assert os.path.exists(saved)
    loaded = Manifest.load(saved)
    assert loaded.paths == m1.paths and loaded.fingerprint == m1.fingerprint and loaded.ignored == m1.ignored

    # "dirs" catches an added file (the class folder's mtime and entry count change)
    time.sleep(0.01)
    shutil.copyfile(os.path.join(root, "c000", "00000.JPEG"), os.path.join(root, "c000", "new.JPEG"))
    m2 = Manifest.build(root, persist_dir=pdir)
    assert "c000/new.JPEG" in m2.paths and m2.fingerprint != m1.fingerprint
    # ... and a removed file
    os.remove(os.path.join(root, "c001", "00002.JPEG"))
    m3 = Manifest.build(root, persist_dir=pdir)
    assert "c001/00002.JPEG" not in m3.paths

    # documented limit: an in-place rewrite keeps directory mtimes -> "dirs" misses it, "full" catches it
    victim = os.path.join(root, "c001", "00000.JPEG")
    dir_st = os.stat(os.path.dirname(victim))
    with open(victim, "r+b") as f:
        f.seek(0, 2)
        f.write(b"\0" * 10)
    os.utime(os.path.dirname(victim), (dir_st.st_atime, dir_st.st_mtime))
    assert Manifest.build(root, persist_dir=pdir).fingerprint == m3.fingerprint  # stale, as documented
    listings = []
    real_list = Manifest._list.__func__

    def counted(cls, *a, **kw):  # the real listing, counted
        listings.append(1)
        return real_list(cls, *a, **kw)

    monkeypatch.setattr(Manifest, "_list", classmethod(counted))
    m4 = Manifest.build(root, persist_dir=pdir, revalidate="full")
    assert m4.fingerprint != m3.fingerprint
    assert len(listings) == 1  # the re-listing that found the change is the one used (not listed twice)
    assert Manifest.build(root, persist_dir=pdir, revalidate="full").fingerprint == m4.fingerprint
    assert len(listings) == 2  # unchanged: one listing, the saved copy reused
    assert Manifest.load(saved).fingerprint == m4.fingerprint  # the changed listing was persisted
    monkeypatch.undo()
    assert m4.sizes[m4.paths.index("c001/00000.JPEG")] == os.path.getsize(victim)

    # "none" trusts the saved copy even after a change
    os.remove(os.path.join(root, "c000", "new.JPEG"))
    assert "c000/new.JPEG" in Manifest.build(root, persist_dir=pdir, revalidate="none").paths

    # a damaged persisted copy is ignored and rewritten
    with open(saved, "wb") as f:
        f.write(b"\x93garbage")
    m5 = Manifest.build(root, persist_dir=pdir)
    assert "c000/new.JPEG" not in m5.paths and Manifest.load(saved).fingerprint == m5.fingerprint


def test_revalidation_is_cheaper_than_a_walk_on_slow_fs(imagefolder_factory, tmp_path) -> None:
    root = imagefolder_factory(classes=3, per_class=6)
    url = "slowfile://" + root + "?latency_ms=0&mbps=0"
    pdir = str(tmp_path / "p")
    slowfs.reset_counters()
    m1 = Manifest.build(url, persist_dir=pdir)
    walk_requests = slowfs.COUNTERS["requests"]
    assert m1.root == "slowfile://" + root + "?latency_ms=0&mbps=0" and len(m1) == 18
    slowfs.reset_counters()
    m2 = Manifest.build(url, persist_dir=pdir)
    assert m2.fingerprint == m1.fingerprint
    # two requests per directory (stat + names), none per file, and no file is opened
    assert slowfs.COUNTERS["requests"] <= 2 * len(m1.dirstate) + 1 <= walk_requests + len(m1.dirstate)
    assert slowfs.COUNTERS["opens"] == 0


def test_synth_is_deterministic_realistic_and_ships_real_photos(tmp_path) -> None:
    from datacache.devtools.synth import make_imagefolder, real_photo_files

    a = make_imagefolder(str(tmp_path / "a"), classes=2, per_class=2, seed=3)
    b = make_imagefolder(str(tmp_path / "b"), classes=2, per_class=2, seed=3)
    c = make_imagefolder(str(tmp_path / "c"), classes=2, per_class=2, seed=4)
    assert a == b == c == ["c000/00000.JPEG", "c000/00001.JPEG", "c001/00000.JPEG", "c001/00001.JPEG"]
    for rel in a:
        ba, bb, bc = (raw_bytes(tmp_path / d / rel) for d in "abc")
        assert ba == bb and ba != bc
        assert 60_000 <= len(ba) <= 150_000  # textured, like an ImageNet JPEG at 500x375 q90
    photos = real_photo_files()
    assert any(p.endswith("grace_hopper.jpg") for p in photos)  # matplotlib is a test dependency
    written = make_imagefolder(str(tmp_path / "d"), classes=2, per_class=1, size=(64, 48),
                               include_real_photos=True)
    assert len(written) == 2 + len(photos)
    assert any(w.endswith("/real_grace_hopper.jpg") for w in written)
    m = Manifest.build(str(tmp_path / "d"))
    assert sorted(m.paths) == sorted(written)


def test_shipped_files_this_pillow_cannot_decode_are_not_real_photos(tmp_path, monkeypatch) -> None:
    """scikit-image ships TIFFs some Pillow builds cannot decode (the GPU image's could not): such a
    file is left out, so a benchmark's naive Pillow baseline never meets it (it crashed on one)."""
    import importlib.machinery
    import importlib.util
    import shutil

    from datacache.devtools import synth

    pkg = tmp_path / "skimage"
    (pkg / "data").mkdir(parents=True)
    good = next(p for p in synth.real_photo_files() if p.endswith("grace_hopper.jpg"))
    shutil.copy(good, pkg / "data" / "photo.jpg")
    (pkg / "data" / "multipage.tif").write_bytes(b"II*\x00" + bytes(64))  # a TIFF header, no decodable page
    (pkg / "data" / "cut.png").write_bytes(raw_bytes(good)[:2000])         # cut short: fails in load()
    real_find = importlib.util.find_spec

    def find(name: str, *a, **kw):  # only scikit-image is redirected; matplotlib stays the real one
        if name == "skimage":
            spec = importlib.machinery.ModuleSpec("skimage", None, is_package=True)
            spec.submodule_search_locations = [str(pkg)]
            return spec
        return real_find(name, *a, **kw)

    monkeypatch.setattr(synth.importlib.util, "find_spec", find)
    files = synth.real_photo_files()
    assert str(pkg / "data" / "photo.jpg") in files
    assert not any(f.endswith(("multipage.tif", "cut.png")) for f in files)


def raw_bytes(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def test_order_matches_torchvision_make_dataset_on_nested_folders(tmp_path) -> None:
    """Names that sort differently as paths and as strings: ``a-b`` < ``a/`` as strings, but class
    ``a`` (and its sub-folders) comes first; within a class, ``sub`` < ``sub-x`` < ``sub/deeper``
    is the order of sorted os.walk roots."""
    root = tmp_path / "ds"
    rels = ["a/2.jpg", "a/sub/1.jpg", "a-b/3.jpg", "a/sub-x/0.jpg", "a/sub/deeper/9.jpg", "a/sub/0.jpg",
            "a/10.jpg", "a.b/5.jpg", "b/z/0.jpg", "b/y-z/1.jpg", "b/y/2.jpg"]
    for rel in rels:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    m = Manifest.build(str(root))
    paths, targets, classes = reference_imagefolder(str(root))
    assert classes == ["a", "a-b", "a.b", "b"]
    assert paths[:2] == ["a/10.jpg", "a/2.jpg"] and paths.index("a/sub/1.jpg") < paths.index("a-b/3.jpg")
    assert list(m.paths) == paths and list(m.targets) == targets and m.classes == classes
    assert sorted(paths) != paths  # the walk order is not plain string order of the paths


def test_listing_charges_one_request_per_directory_and_lists_concurrently(imagefolder_factory) -> None:
    counts = []
    for per_class in (1, 5):
        root = imagefolder_factory(classes=6, per_class=per_class, size=(16, 12))
        slowfs.reset_counters()
        m = Manifest.build(f"slowfile://{root}?latency_ms=40&mbps=0")
        assert len(m) == 6 * per_class
        counts.append(dict(slowfs.COUNTERS))
    # requests do not grow with the number of files (a listing returns sizes and mtimes in bulk)
    assert counts[0]["requests"] == counts[1]["requests"] and counts[1]["listings"] == 1 + 6
    assert counts[1]["max_concurrent_listings"] > 1  # class folders were listed concurrently


def _age_tree(root: str, seconds: float) -> None:
    """Every directory's mtime set ``seconds`` into the past (a dataset written long before it is listed)."""
    t = time.time() - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))


def test_settled_directories_cost_one_stat_and_still_catch_changes(imagefolder_factory, tmp_path) -> None:
    root = imagefolder_factory(classes=3, per_class=4, size=(16, 12))
    _age_tree(root, 3600)
    url = f"slowfile://{root}?latency_ms=0&mbps=0"
    pdir = str(tmp_path / "p")
    m1 = Manifest.build(url, persist_dir=pdir)
    assert m1.listed_at > 0 and Manifest.load(Manifest.persist_path(pdir, m1.root)).listed_at == m1.listed_at
    slowfs.reset_counters()
    assert Manifest.build(url, persist_dir=pdir).fingerprint == m1.fingerprint
    assert slowfs.COUNTERS["listings"] == 0  # every directory settled: a stat each, no name listing
    # a file added to a settled directory changes its mtime: caught by the stat alone
    shutil.copyfile(os.path.join(root, "c001", "00000.JPEG"), os.path.join(root, "c001", "new.JPEG"))
    slowfs.reset_counters()
    m2 = Manifest.build(url, persist_dir=pdir)
    assert "c001/new.JPEG" in m2.paths
    # documented limit (as for in-place rewrites): an entry change whose directory keeps its old mtime
    _age_tree(root, 3600)
    m3 = Manifest.build(url, persist_dir=pdir)  # re-listed (the mtimes moved), settled again
    st = os.stat(os.path.join(root, "c002"))
    os.remove(os.path.join(root, "c002", "00003.JPEG"))
    os.utime(os.path.join(root, "c002"), (st.st_atime, st.st_mtime))
    assert Manifest.build(url, persist_dir=pdir).fingerprint == m3.fingerprint  # "dirs" cannot see it
    assert "c002/00003.JPEG" not in Manifest.build(url, persist_dir=pdir, revalidate="full").paths


def test_racy_directories_are_counted_then_settle(imagefolder_factory, tmp_path, monkeypatch) -> None:
    from datacache import listing

    root = imagefolder_factory(classes=2, per_class=3, size=(16, 12))  # written just now: racy
    url = f"slowfile://{root}?latency_ms=0&mbps=0"
    pdir = str(tmp_path / "p")
    m1 = Manifest.build(url, persist_dir=pdir)
    # a change in the same timestamp tick as the listing: the entry set changes, the mtime does not
    victim = os.path.join(root, "c000")
    st = os.stat(victim)
    shutil.copyfile(os.path.join(victim, "00000.JPEG"), os.path.join(victim, "same-tick.JPEG"))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    slowfs.reset_counters()
    m2 = Manifest.build(url, persist_dir=pdir)
    assert "c000/same-tick.JPEG" in m2.paths and m2.fingerprint != m1.fingerprint  # counted: caught
    # unchanged racy directories are counted once, then the persisted copy records them as settled
    monkeypatch.setattr(listing, "RACY_MARGIN_S", 0.05)
    time.sleep(0.1)
    slowfs.reset_counters()
    m3 = Manifest.build(url, persist_dir=pdir)
    assert m3.fingerprint == m2.fingerprint and slowfs.COUNTERS["listings"] == len(m3.dirstate)
    assert Manifest.load(Manifest.persist_path(pdir, m3.root)).listed_at == m3.listed_at > m2.listed_at
    slowfs.reset_counters()
    assert Manifest.build(url, persist_dir=pdir).fingerprint == m3.fingerprint
    assert slowfs.COUNTERS["listings"] == 0


def test_a_manifest_saved_without_listed_at_still_revalidates(imagefolder_factory, tmp_path) -> None:
    import msgpack

    root = imagefolder_factory(classes=2, per_class=3, size=(16, 12))
    _age_tree(root, 3600)
    pdir = str(tmp_path / "p")
    m1 = Manifest.build(root, persist_dir=pdir)
    path = Manifest.persist_path(pdir, m1.root)
    with open(path, "rb") as f:
        d = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
    del d["listed_at"]  # what an older datacache wrote
    with open(path, "wb") as f:
        f.write(msgpack.packb(d, use_bin_type=True))
    assert Manifest.load(path).listed_at == 0.0 and Manifest.load(path).fingerprint == m1.fingerprint
    slowfs.reset_counters()
    url_root = root
    assert Manifest.build(url_root, persist_dir=pdir).fingerprint == m1.fingerprint  # counted, valid
    os.remove(os.path.join(root, "c001", "00001.JPEG"))
    assert "c001/00001.JPEG" not in Manifest.build(url_root, persist_dir=pdir).paths


def test_reuse_revalidates_the_copy_in_memory_without_reading_the_file(imagefolder_factory, tmp_path,
                                                                      monkeypatch) -> None:
    root = imagefolder_factory(classes=2, per_class=3, size=(16, 12))
    _age_tree(root, 3600)
    pdir = str(tmp_path / "p")
    m1 = Manifest.build(root, persist_dir=pdir)
    monkeypatch.setattr(Manifest, "load", classmethod(lambda cls, p: pytest.fail("read the file")))
    assert Manifest.build(root, persist_dir=pdir, reuse=m1) is m1
    shutil.copyfile(os.path.join(root, "c000", "00000.JPEG"), os.path.join(root, "c000", "x.JPEG"))
    m2 = Manifest.build(root, persist_dir=pdir, reuse=m1)  # changed: listed again
    assert m2 is not m1 and "c000/x.JPEG" in m2.paths
    other = imagefolder_factory(classes=1, per_class=2, size=(16, 12))
    assert Manifest.build(other, reuse=m1).root != m1.root  # another source's copy is not used


def test_saved_file_is_plain_msgpack_with_the_same_fields(imagefolder_factory, tmp_path) -> None:
    import msgpack

    m = Manifest.build(imagefolder_factory(classes=2, per_class=3, size=(16, 12)))
    path = str(tmp_path / "m.msgpack")
    m.save(path)
    with open(path, "rb") as f:
        d = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)  # an independent reader
    assert d == m.to_dict()


# ------------------------------------------------------------------ file-list rules (issue 22)
_ESCAPES = {  # entry -> what the error says (it never quotes the entry: "zz_mark" must not appear)
    "/abs/zz_mark.JPEG": "absolute",
    "C:zz_mark.JPEG": "absolute",
    "C:\\zz_mark.JPEG": "backslash",
    "c000\\zz_mark.JPEG": "backslash",
    "s3://bucket/zz_mark.JPEG": "URL",
    "simplecache::zz_mark.JPEG": "URL",
    "../zz_mark.JPEG": "'..'",
    "c000/../../zz_mark.JPEG": "'..'",
    "c000/..": "'..'",
    "c000/zz_mark\x00.JPEG": "NUL",
}


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_file_list_entries_that_escape_are_refused_with_their_line(imagefolder_factory, tmp_path,
                                                                  newline: str) -> None:
    """Absolute, URL, climbing, NUL and backslash entries: a ManifestError naming the list's line (as an
    editor counts it: the header and comments and blank lines count), for Manifest.build and
    CachedImageNet alike; a name merely containing '..' is fine."""
    from client.dataset import CachedImageNet

    root = imagefolder_factory(classes=1, per_class=2, size=(16, 12))
    shutil.copyfile(os.path.join(root, "c000", "00000.JPEG"), os.path.join(root, "c000", "a..b.JPEG"))
    lst = os.path.join(root, "train.csv")
    head = ["path,label", "# comment", "c000/a..b.JPEG,0", ""]
    for entry, why in _ESCAPES.items():
        with open(lst, "w", newline="") as f:
            f.write(newline.join([*head, f"{entry},0", "c000/00001.JPEG,0"]) + newline)
        with pytest.raises(ManifestError) as ei:
            Manifest.build(lst)
        msg = str(ei.value)
        assert "line 5:" in msg and why in msg and "zz_mark" not in msg, (entry, msg)
        with pytest.raises(ManifestError, match="line 5:"):
            CachedImageNet(lst, cache=f"lmdb://{tmp_path}/lmdb", short_side=16, t1_dir=None)
    with open(lst, "w", newline="") as f:
        f.write(newline.join([*head, "c000/00001.JPEG,0"]))
    assert list(Manifest.build(lst).paths) == ["c000/a..b.JPEG", "c000/00001.JPEG"]


def test_a_missing_listed_file_is_logged_by_its_line_not_its_name(imagefolder_factory, caplog) -> None:
    root = imagefolder_factory(classes=1, per_class=2, size=(16, 12))
    lst = os.path.join(root, "l.txt")
    with open(lst, "w") as f:
        f.write("c000/00000.JPEG\nc000/zz_gone.JPEG\n")
    with caplog.at_level("WARNING", logger="datacache.manifest"):
        m = Manifest.build(lst)
    assert m.ignored == {"missing": 1} and "line 2" in caplog.text and "zz_gone" not in caplog.text


def test_numeric_labels_are_bounded_and_a_huge_one_costs_no_memory(imagefolder_factory) -> None:
    """A label is a class index: it must be < max(rows, 65536), else a ManifestError naming the line and the
    bound. Reproduced: label 20,000,000 made range(20M) class names (3 GB); now refused with a flat peak."""
    import tracemalloc

    root = imagefolder_factory(classes=1, per_class=2, size=(16, 12))
    lst = os.path.join(root, "l.csv")

    def listing(labels: tuple[str, str]) -> Manifest:
        with open(lst, "w") as f:
            f.write(f"path,label\nc000/00000.JPEG,{labels[0]}\nc000/00001.JPEG,{labels[1]}\n")
        return Manifest.build(lst)

    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match=r"line 3: numeric label too large.*= 65536") as ei:
            listing(("0", "20000000"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the 20M class names alone would be ~1.3 GB
    assert "20000000" not in str(ei.value)
    with pytest.raises(ManifestError, match="line 2: numeric label too large"):
        listing(("65536", "1"))
    with pytest.raises(ManifestError, match="line 3: numeric label too large"):
        listing(("0", "9" * 5000))  # past Python's int-conversion limit: still a clean error
    with pytest.raises(ManifestError, match="line 3: negative label"):
        listing(("1", "-2"))
    m = listing(("65535", "0"))  # just under the bound: a big label space's small subset still works
    assert len(m.classes) == 65536 and list(m.targets) == [65535, 0]
    assert listing(("ant", "20000000")).classes == ["20000000", "ant"]  # not all numeric: names


def test_the_label_bound_grows_with_the_rows() -> None:
    from datacache.filelist import LabelCheck, iter_list_rows

    for top, ok in ((69_999, True), (70_000, False)):
        check = LabelCheck()
        lines = [f"d/{i}.JPEG,{i}" for i in range(69_999)] + [f"d/x.JPEG,{top}"]
        assert sum(1 for _ in iter_list_rows(lines, "l.txt", check)) == 70_000
        if ok:
            check.check("l.txt")
        else:
            with pytest.raises(ManifestError, match=r"line 70000: .* = 70000"):
                check.check("l.txt")


def test_a_streamed_list_counts_lines_like_the_listing(imagefolder_factory) -> None:
    """validate_file_list (the daemon's registration check) reads 1 MiB chunks: a "\\r\\n" split across
    two chunks is one line break, so it names the same line as the listing does."""
    from datacache.manifest import validate_file_list

    root = imagefolder_factory(classes=1, per_class=1, size=(16, 12))
    lst = os.path.join(root, "l.txt")
    with open(lst, "wb") as f:
        f.write(b"#" + b"x" * ((1 << 20) - 2) + b"\r\n")  # "\r" ends the first chunk, "\n" starts the next
        f.write(b"c000/00000.JPEG,0\r\n../c000/00000.JPEG,0\r\n")
    for check in (validate_file_list, Manifest.build):
        with pytest.raises(ManifestError, match="line 3: the entry climbs"):
            check(lst)
