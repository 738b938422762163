"""Fashion-MNIST as an ImageFolder (:mod:`trainer.fashion`) on the real files of the Debian package
``dataset-fashion-mnist``.

* The real 70,000 images rendered once (module fixture) and checked against an independent IDX reader
  written here (gzip + struct + np.frombuffer, not ``read_idx``): counts, folder order, file names,
  pixels, the completion marker; a second render reuses the tree.
* All-or-nothing writing on small subsets of the real data (first 20 per class of train, 5 of t10k):
  a crashed render's partial directory is removed (only with our tag, only when its pid is dead), a
  foreign OUT is refused and left untouched, two renders at once (two processes) and a lost rename race
  (in process) both end with one complete tree.
* Damaged inputs, gzip and plain: each is one line of ConfigError naming the file.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from datacache.config import ConfigError
from trainer import fashion
from trainer.fashion import CLASS_NAMES, FashionSplit, find_files, load, read_idx, render

ROOT = Path(__file__).resolve().parents[1]
SRC = "/usr/share/datasets/fashion-mnist"
pytestmark = pytest.mark.skipif(
    not os.path.isdir(SRC),
    reason=f"{SRC} is missing: the Fashion-MNIST tests need the Debian package "
           "(apt-get install dataset-fashion-mnist)")
NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
MARKER = ".fashion-mnist-complete"
TAG = ".fashion-mnist-partial"
Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


# ------------------------------------------------------------------------------------------- helpers


def _ref_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def _ref_read(path: str) -> np.ndarray:
    """Independent IDX reader (deliberately not trainer.fashion.read_idx)."""
    raw = _ref_bytes(path)
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    assert (zero, dtype) == (0, 8), path
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    assert data.size == int(np.prod(dims)), path
    return data.reshape(dims)


def _src_path(name: str) -> str:
    for candidate in (name + ".gz", name):
        if os.path.isfile(os.path.join(SRC, candidate)):
            return os.path.join(SRC, candidate)
    pytest.skip(f"{SRC} lacks {name}[.gz]: reinstall dataset-fashion-mnist")


def idx_bytes(arr: np.ndarray, *, dims: tuple[int, ...] | None = None, type_byte: int = 8) -> bytes:
    """An IDX file's content: ``00 00 <type> <ndim>``, big-endian uint32 dims, then the bytes."""
    dims = tuple(arr.shape) if dims is None else dims
    return (struct.pack(">HBB", 0, type_byte, len(dims)) + struct.pack(f">{len(dims)}I", *dims)
            + np.ascontiguousarray(arr, dtype=np.uint8).tobytes())


def write_file(path: str | Path, data: bytes, gz: bool) -> None:
    Path(path).write_bytes(gzip.compress(data, mtime=0) if gz else data)


def write_source(directory: str | Path, arrays: Arrays, *, gz: bool = True) -> str:
    """The four IDX files of ``arrays`` (named ``*.gz`` when ``gz``) in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    for split, pair in arrays.items():
        for name, arr in zip(NAMES[split], pair):
            write_file(os.path.join(directory, name + (".gz" if gz else "")), idx_bytes(arr), gz)
    return str(directory)


def _subset(images: np.ndarray, labels: np.ndarray, per_class: int, *, last: bool = False
            ) -> tuple[np.ndarray, np.ndarray]:
    picks = [np.flatnonzero(labels == k) for k in range(10)]
    idx = np.sort(np.concatenate([p[-per_class:] if last else p[:per_class] for p in picks]))
    return images[idx], labels[idx]


def _files(root: str | Path) -> dict[str, bytes]:
    """Every file under ``root``: relative path -> content."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = Path(path).read_bytes()
    return out


def _assert_complete(out: str | Path, arrays: Arrays) -> None:
    """OUT holds exactly the tree of ``arrays``: folders in label order, one PNG per index, right pixels."""
    assert sorted(os.listdir(out)) == [MARKER, "train", "val"]
    for split, (images, labels) in arrays.items():
        root = os.path.join(out, split)
        assert sorted(os.listdir(root)) == list(CLASS_NAMES)
        for k, name in enumerate(CLASS_NAMES):
            want = [f"{i:05d}.png" for i in np.flatnonzero(labels == k)]
            assert sorted(os.listdir(os.path.join(root, name))) == want
        for i in (0, len(labels) - 1):
            with Image.open(os.path.join(root, CLASS_NAMES[labels[i]], f"{i:05d}.png")) as im:
                np.testing.assert_array_equal(np.asarray(im), images[i])


def _partials(parent: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".partial-" in n)


def _one_line_error(call: Callable[[], object], *must_name: str) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for text in must_name:
        assert text in msg, (text, msg)
    return msg


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def reference() -> Arrays:
    return {split: (_ref_read(_src_path(i)), _ref_read(_src_path(lab))) for split, (i, lab) in NAMES.items()}


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, FashionSplit]:
    """The real Fashion-MNIST rendered once (70,000 PNGs). Read-only for tests."""
    out = str(tmp_path_factory.mktemp("fashion_real") / "fm")
    return out, render(out, source=SRC, progress=False)


@pytest.fixture(scope="module")
def subset(reference: Arrays) -> Arrays:
    """Balanced real subset: first 20 per class of train, first 5 per class of t10k."""
    return {"train": _subset(*reference["train"], 20), "val": _subset(*reference["val"], 5)}


@pytest.fixture
def src(tmp_path: Path, subset: Arrays) -> str:
    return write_source(tmp_path / "src", subset)


# --------------------------------------------------------------------------------- the real data set


def test_class_names_are_readable_and_sort_in_label_order() -> None:
    assert CLASS_NAMES == ("0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat", "5_sandal",
                           "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot")
    assert sorted(CLASS_NAMES) == list(CLASS_NAMES)
    assert fashion.DEFAULT_DIR == SRC


def test_real_render_counts_and_folders(real_tree: tuple[str, FashionSplit], reference: Arrays) -> None:
    out, res = real_tree
    assert res == FashionSplit(os.path.join(out, "train"), os.path.join(out, "val"), 60_000, 10_000, False)
    assert [len(labels) for _, labels in reference.values()] == [60_000, 10_000]
    assert sorted(os.listdir(out)) == [MARKER, "train", "val"]
    assert _partials(os.path.dirname(out)) == []
    for split, per_class in (("train", 6_000), ("val", 1_000)):
        labels = reference[split][1]
        root = os.path.join(out, split)
        assert sorted(os.listdir(root)) == list(CLASS_NAMES)  # ImageFolder's class index == label
        for k, name in enumerate(sorted(os.listdir(root))):
            names = sorted(os.listdir(os.path.join(root, name)))
            assert len(names) == per_class
            assert names == [f"{i:05d}.png" for i in np.flatnonzero(labels == k)]  # name = index in the file


def test_real_pixels_match_an_independent_reader(real_tree: tuple[str, FashionSplit],
                                                 reference: Arrays) -> None:
    out, _ = real_tree
    rng = np.random.default_rng(0)
    for split, (images, labels) in reference.items():
        sample = [0, len(labels) - 1, *rng.choice(len(labels), 50, replace=False).tolist()]
        for i in sample:
            path = os.path.join(out, split, CLASS_NAMES[labels[i]], f"{i:05d}.png")
            with Image.open(path) as im:
                assert (im.format, im.mode, im.size) == ("PNG", "L", (28, 28)), path
                np.testing.assert_array_equal(np.asarray(im), images[i], err_msg=path)


def test_real_marker_records_counts_and_source_digests(real_tree: tuple[str, FashionSplit]) -> None:
    out, _ = real_tree
    marker = json.loads(Path(out, MARKER).read_text())
    assert marker["counts"] == {"train": 60_000, "val": 10_000}
    assert marker["classes"] == list(CLASS_NAMES)
    want = {name: hashlib.sha256(_ref_bytes(_src_path(name))).hexdigest()
            for pair in NAMES.values() for name in pair}
    assert marker["sha256"] == want  # of the decompressed content


def test_load_equals_the_independent_reader(reference: Arrays) -> None:
    data = load(SRC)
    assert list(data) == ["train", "val"]
    for split, (images, labels) in data.items():
        assert images.dtype == np.uint8 and labels.dtype == np.int64
        np.testing.assert_array_equal(images, reference[split][0])
        np.testing.assert_array_equal(labels, reference[split][1])


def test_second_render_reuses_the_tree_untouched(real_tree: tuple[str, FashionSplit],
                                                 reference: Arrays) -> None:
    out, first = real_tree
    labels = reference["train"][1]
    watched = [os.path.join(out, MARKER), os.path.join(out, "train"),
               os.path.join(out, "val", CLASS_NAMES[3])]
    watched += [os.path.join(out, "train", CLASS_NAMES[labels[i]], f"{i:05d}.png")
                for i in range(0, 60_000, 997)]
    before = {p: os.stat(p).st_mtime_ns for p in watched}
    again = render(out, source=SRC, progress=False)
    assert again.reused is True
    assert (again.train, again.val, again.n_train, again.n_val) == (first.train, first.val, 60_000, 10_000)
    assert {p: os.stat(p).st_mtime_ns for p in watched} == before
    assert _partials(os.path.dirname(out)) == []


# ------------------------------------------------------------------------------ all-or-nothing output


def test_gzip_is_told_by_content_and_the_digest_by_decompressed_bytes(tmp_path: Path, subset: Arrays) -> None:
    gz = write_source(tmp_path / "gz", subset, gz=True)
    plain = write_source(tmp_path / "plain", subset, gz=False)
    swapped = tmp_path / "swapped"  # gzip data under plain names, plain data under .gz names
    swapped.mkdir()
    for split, pair in subset.items():
        for name, arr in zip(NAMES[split], pair):
            write_file(swapped / name, idx_bytes(arr), gz=True)
            write_file(swapped / (name + ".gz"), idx_bytes(arr), gz=False)
    assert find_files(str(swapped))["t10k-images-idx3-ubyte"] == str(swapped / "t10k-images-idx3-ubyte")
    for directory in (gz, plain, str(swapped)):
        data = load(directory)
        for split, (images, labels) in subset.items():
            np.testing.assert_array_equal(data[split][0], images)
            np.testing.assert_array_equal(data[split][1], labels)
    out = tmp_path / "fm"
    assert render(str(out), source=gz, progress=False).reused is False
    _assert_complete(out, subset)
    # the same decompressed content from plain files: the tree is the same one
    assert render(str(out), source=plain, progress=False).reused is True


def test_empty_out_directory_is_filled(tmp_path: Path, src: str, subset: Arrays) -> None:
    out = tmp_path / "fm"
    out.mkdir()
    res = render(str(out) + "/", source=src, progress=False)
    assert (res.n_train, res.n_val, res.reused) == (200, 50, False)
    assert res.train == str(out / "train")
    _assert_complete(out, subset)
    assert _partials(tmp_path) == []


def _crashed_partial(tmp_path: Path, src: str, out: Path) -> Path:
    """A real half-written tree: a render that dies (os._exit, no cleanup) after writing one chunk."""
    code = ("import os, sys\nfrom trainer import fashion\nreal = fashion._write_chunk\n"
            "def crash(*a):\n    real(*a)\n    os._exit(3)\n"
            "fashion._write_chunk = crash\nfashion.render(sys.argv[1], source=sys.argv[2], progress=False)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(out), src], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    (name,) = _partials(tmp_path)
    partial = tmp_path / name
    assert name.startswith(f"{out.name}.partial-")
    assert (partial / TAG).is_file() and not (partial / MARKER).exists() and not out.exists()
    assert any(p.suffix == ".png" for p in partial.rglob("*.png"))
    return partial


def test_crashed_render_is_cleaned_up_and_never_used(tmp_path: Path, src: str, subset: Arrays) -> None:
    out = tmp_path / "fm"
    partial = _crashed_partial(tmp_path, src, out)
    sentinel = partial / "train" / CLASS_NAMES[0] / "99999.png"
    sentinel.write_bytes(b"from the crashed run")
    res = render(str(out), source=src, progress=False)
    assert res.reused is False
    assert not partial.exists()
    assert not (out / "train" / CLASS_NAMES[0] / "99999.png").exists()
    assert not (out / TAG).exists()
    _assert_complete(out, subset)
    assert _partials(tmp_path) == []


def test_partials_without_our_tag_or_of_a_live_process_are_left_alone(tmp_path: Path, src: str,
                                                                      subset: Arrays) -> None:
    out = tmp_path / "fm"
    crashed = _crashed_partial(tmp_path, src, out)
    dead_pid = int(crashed.name.split("-")[1])
    tag = json.loads((crashed / TAG).read_text())
    kept = []

    def variant(pid: int, edit: Callable[[Path], None]) -> None:
        path = tmp_path / f"fm.partial-{pid}-{len(kept):08x}"
        shutil.copytree(crashed, path)
        edit(path)
        kept.append(path)

    variant(dead_pid, lambda p: (p / TAG).unlink())  # no tag file
    variant(dead_pid, lambda p: (p / TAG).write_text("not ours"))  # a file of that name, not our tag
    other_host = json.dumps({**tag, "host": socket.gethostname() + "-x"})
    variant(dead_pid, lambda p: (p / TAG).write_text(other_host))  # its pid may be alive over there
    live = os.getppid()
    variant(live, lambda p: (p / TAG).write_text(json.dumps({**tag, "pid": live})))  # its process runs
    snapshot = {p: _files(p) for p in kept}
    render(str(out), source=src, progress=False)
    assert not crashed.exists()  # ours, pid dead: removed
    assert {p: _files(p) for p in kept} == snapshot
    _assert_complete(out, subset)


def test_foreign_out_is_refused_and_untouched(tmp_path: Path, src: str) -> None:
    out = tmp_path / "photos"
    (out / "train").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "train" / "a.png").write_bytes(b"not fashion")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    msg = _one_line_error(lambda: render(str(out), source=src, progress=False), str(out))
    assert "remove it or choose another OUT" in msg
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.rglob("*")) == ["a.png", "notes.txt", "train"]
    assert _partials(tmp_path) == []
    (tmp_path / "afile").write_text("x")
    _one_line_error(lambda: render(str(tmp_path / "afile"), source=src, progress=False), "afile")
    assert (tmp_path / "afile").read_text() == "x"


def test_tree_of_other_sources_is_refused_and_untouched(tmp_path: Path, src: str, reference: Arrays) -> None:
    out = tmp_path / "fm"
    render(str(out), source=src, progress=False)
    before = _files(out)
    other = {"train": _subset(*reference["train"], 20, last=True),
             "val": _subset(*reference["val"], 5, last=True)}
    other_src = write_source(tmp_path / "other", other)
    msg = _one_line_error(lambda: render(str(out), source=other_src, progress=False), str(out), MARKER)
    assert "remove it or choose another OUT" in msg
    assert _files(out) == before
    assert _partials(tmp_path) == []


def test_a_failed_render_leaves_nothing(tmp_path: Path, src: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = itertools.count()
    real_png = fashion._png

    def failing(image: np.ndarray) -> bytes:
        if next(calls) == 30:
            raise RuntimeError("disk on fire")
        return real_png(image)

    monkeypatch.setattr(fashion, "_png", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        render(str(tmp_path / "fm"), source=src, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_losing_the_rename_race_reuses_the_winners_tree(tmp_path: Path, src: str, subset: Arrays,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    out = str(tmp_path / "fm")
    real_rename = os.rename
    ours: list[str] = []

    def rename(a: str, b: str) -> None:
        if not ours:  # our partial tree is complete; another run renames its own first
            ours.append(a)
            assert os.path.basename(a).startswith("fm.partial-") and (Path(a) / MARKER).is_file()
            # (the other run leaves our partial directory alone: its pid is alive)
            assert render(out, source=src, progress=False).reused is False
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    res = render(out, source=src, progress=False)
    assert res.reused is True
    assert not os.path.exists(ours[0])
    assert sorted(os.listdir(tmp_path)) == ["fm", "src"]
    _assert_complete(out, subset)


def test_losing_the_race_to_foreign_files_is_refused(tmp_path: Path, src: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "fm"
    real_rename = os.rename

    def rename(a: str, b: str) -> None:
        out.mkdir()
        (out / "mine.txt").write_text("someone else's")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    _one_line_error(lambda: render(str(out), source=src, progress=False), str(out))
    assert sorted(os.listdir(tmp_path)) == ["fm", "src"]
    assert sorted(os.listdir(out)) == ["mine.txt"] and (out / "mine.txt").read_text() == "someone else's"


CHILD = """
import json, os, sys, time
from trainer.fashion import render
out, src, gate = sys.argv[1:4]
open(os.path.join(gate, f"ready-{os.getpid()}"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(gate, "go")) and time.monotonic() < deadline:
    time.sleep(0.002)
r = render(out, source=src, progress=False)
print(json.dumps([r.reused, r.n_train, r.n_val]))
"""


def test_two_renders_at_once_both_succeed_with_one_complete_tree(tmp_path: Path, reference: Arrays) -> None:
    arrays = {"train": _subset(*reference["train"], 100), "val": _subset(*reference["val"], 20)}
    src = write_source(tmp_path / "src", arrays)
    gate = tmp_path / "gate"
    gate.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    out = work / "fm"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(out), src, str(gate)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(gate)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        (gate / "go").touch()  # both are imported and waiting: release them together
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
    outcomes = sorted(json.loads(stdout) for stdout, _ in results)
    assert outcomes == [[False, 1_000, 200], [True, 1_000, 200]]  # one wrote it, the other reused it
    assert sorted(os.listdir(work)) == ["fm"]  # the loser removed its partial directory
    _assert_complete(out, arrays)
    ref = tmp_path / "ref"
    render(str(ref), source=src, progress=False)
    assert _files(out) == _files(ref)  # byte for byte what a lone render writes


# ----------------------------------------------------------------------------------- damaged inputs


def _labels(s: Arrays, edit: Callable[[np.ndarray], None]) -> np.ndarray:
    labels = s["train"][1].copy()
    edit(labels)
    return labels


def _move_one_to_class_1(labels: np.ndarray) -> None:
    labels[int(np.flatnonzero(labels == 0)[0])] = 1  # class 0 loses one, class 1 gains one


def _bad_gzip(data: bytes) -> bytes:
    z = bytearray(gzip.compress(data, mtime=0))
    z[len(z) // 2: len(z) // 2 + 64] = bytes(64)
    return bytes(z)


# case -> (file to damage, its new decompressed content from the subset, what the message says)
CASES: dict[str, tuple[str, Callable[[Arrays], bytes], str]] = {
    "wrong_magic": ("train-images-idx3-ubyte", lambda s: b"\x12\x34" + idx_bytes(s["train"][0])[2:],
                    "not an IDX file"),
    "wrong_type": ("t10k-images-idx3-ubyte", lambda s: idx_bytes(s["val"][0], type_byte=0x0D),
                   "data type 0x0d"),
    "images_as_labels": ("train-labels-idx1-ubyte", lambda s: idx_bytes(s["train"][0]), "3 dimension(s)"),
    "empty": ("t10k-labels-idx1-ubyte", lambda s: b"", "too short"),
    "short_header": ("train-images-idx3-ubyte", lambda s: idx_bytes(s["train"][0])[:10], "header truncated"),
    "truncated": ("train-images-idx3-ubyte", lambda s: idx_bytes(s["train"][0])[:-100], "truncated"),
    "trailing_data": ("t10k-labels-idx1-ubyte", lambda s: idx_bytes(s["val"][1]) + b"\0", "data after"),
    "claims_2**31_items": ("train-labels-idx1-ubyte",
                           lambda s: struct.pack(">HBBI", 0, 8, 1, 2**31) + bytes(200), "2147483648"),
    "claims_huge_images": ("train-images-idx3-ubyte",
                           lambda s: struct.pack(">HBB3I", 0, 8, 3, 10, 2**16, 2**16) + bytes(64), "65536"),
    "not_28x28": ("t10k-images-idx3-ubyte", lambda s: idx_bytes(s["val"][0].reshape(-1, 56, 14)), "56x14"),
    "count_mismatch": ("train-labels-idx1-ubyte", lambda s: idx_bytes(s["train"][1][:-1]), "199 labels"),
    "label_10": ("train-labels-idx1-ubyte", lambda s: idx_bytes(_labels(s, lambda x: x.__setitem__(7, 10))),
                 "label 10 at index 7"),
    "unbalanced": ("train-labels-idx1-ubyte", lambda s: idx_bytes(_labels(s, _move_one_to_class_1)),
                   "[19, 21, 20, 20, 20, 20, 20, 20, 20, 20]"),
}


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
@pytest.mark.parametrize("case", list(CASES))
def test_damaged_input_is_one_line_naming_the_file(tmp_path: Path, subset: Arrays, case: str,
                                                    gz: bool) -> None:
    name, content, says = CASES[case]
    directory = write_source(tmp_path / "src", subset, gz=gz)
    path = os.path.join(directory, name + (".gz" if gz else ""))
    write_file(path, content(subset), gz)
    msg = _one_line_error(lambda: load(directory), path, says)
    assert "reinstall" in msg  # what to do
    _one_line_error(lambda: render(str(tmp_path / "fm"), source=directory, progress=False), path)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing written


def test_damaged_gzip_stream_names_the_file(tmp_path: Path, subset: Arrays) -> None:
    directory = write_source(tmp_path / "src", subset)
    path = os.path.join(directory, "train-images-idx3-ubyte.gz")
    Path(path).write_bytes(_bad_gzip(idx_bytes(subset["train"][0])))
    _one_line_error(lambda: load(directory), path, "gzip")
    Path(path).write_bytes(gzip.compress(idx_bytes(subset["train"][0]), mtime=0)[:-40])  # cut short
    _one_line_error(lambda: load(directory), path, "gzip")


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_hostile_header_fails_fast_without_allocating(tmp_path: Path, gz: bool) -> None:
    cases = [(tmp_path / "labels", 1, struct.pack(">HBBI", 0, 8, 1, 2**31) + bytes(4096)),
             (tmp_path / "images", 3, struct.pack(">HBB3I", 0, 8, 3, 2**31, 28, 28) + bytes(4096)),
             (tmp_path / "wide", 3, struct.pack(">HBB3I", 0, 8, 3, 1, 2**31, 2**31) + bytes(4096))]
    for path, ndim, data in cases:
        write_file(path, data, gz)
        tracemalloc.start()
        try:
            _one_line_error(lambda p=path, n=ndim: read_idx(str(p), expect_dims=n, max_items=60_000),
                            str(path))
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 4 << 20, (path.name, peak)  # refused from the header alone


def test_missing_default_directory_names_the_debian_package(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    missing = str(tmp_path / "fashion-mnist")
    monkeypatch.setattr(fashion, "DEFAULT_DIR", missing)  # the real one is installed here
    for call in (lambda: find_files(missing), lambda: load(missing),
                 lambda: render(str(tmp_path / "fm"), source=missing, progress=False)):
        _one_line_error(call, missing, "does not exist", "apt-get install dataset-fashion-mnist", "--from")
    assert sorted(os.listdir(tmp_path)) == []


def test_missing_file_in_the_default_directory_names_it_and_the_package(
        tmp_path: Path, src: str, monkeypatch: pytest.MonkeyPatch) -> None:
    os.remove(os.path.join(src, "t10k-labels-idx1-ubyte.gz"))
    monkeypatch.setattr(fashion, "DEFAULT_DIR", src)
    _one_line_error(lambda: render(str(tmp_path / "fm"), source=src, progress=False), src,
                    "t10k-labels-idx1-ubyte", "apt-get install dataset-fashion-mnist")
    monkeypatch.undo()  # elsewhere: how to fill that directory, or drop --from
    msg = _one_line_error(lambda: find_files(src), src, "t10k-labels-idx1-ubyte", "--from")
    assert "train-labels" not in msg
    assert sorted(os.listdir(tmp_path)) == ["src"]
