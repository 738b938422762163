"""Render Zalando's Fashion-MNIST as a real ImageFolder (``python -m trainer fashion OUT [--from DIR]``).

Source: Fashion-MNIST by Zalando Research (https://github.com/zalandoresearch/fashion-mnist, MIT
licence): 70,000 real 28x28 grayscale photos of clothing in 10 classes, 60,000 for training and
10,000 for testing, exactly 6,000 / 1,000 per class. Debian ships Zalando's original IDX files in the
package ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``), under
:data:`DEFAULT_DIR`; ``--from DIR`` (``source=``) reads the same four files from elsewhere, each
gzip-compressed or not (told apart by the gzip magic bytes ``1f 8b``, not by the file name).

Output::

    OUT/train/<class>/<index:05d>.png    the 60,000 training images (train-*-ubyte)
    OUT/val/<class>/<index:05d>.png      the official 10,000-image test split (t10k-*-ubyte)
    OUT/.fashion-mnist-complete          completion marker (JSON), written last

``<class>`` is one of :data:`CLASS_NAMES` (``0_tshirt_top`` ... ``9_ankle_boot``): readable names
whose sort order is the label order, so an ImageFolder's class index equals Fashion-MNIST's label.
``<index>`` is the image's position in its IDX file. Every file is an 8-bit grayscale PNG (Pillow
opens it in mode ``L``) holding exactly the file's pixel values (PNG is lossless; no scaling, no
inversion: ink/cloth is bright on a black background, as Zalando stores it).

Reading is strict: :func:`read_idx` checks the IDX magic (two zero bytes, type byte ``0x08`` =
unsigned byte, the number of dimensions) and that the data is exactly as long as the header's
dimensions say; it never reads more than that plus one byte, and a header claiming more than
``max_items`` 28x28 items is refused before anything is allocated. :func:`load` then checks 28x28
images, as many labels as images, labels in 0..9 and equal per-class counts (Fashion-MNIST is
exactly balanced). Every problem is one line of :class:`~datacache.config.ConfigError` that names the
file, what is wrong and what to do.

Writing is all-or-nothing. :func:`render` builds the whole tree in a sibling directory
``OUT.partial-<pid>-<random>`` that carries a tag file (``.fashion-mnist-partial``: this program,
its pid and host), writes the marker inside it last (format version, counts, and the SHA-256 of
each source file's decompressed content) and then renames it to ``OUT`` in one ``os.rename``, which
succeeds only while ``OUT`` is absent or an empty directory. So ``OUT`` is either missing or
complete; a run killed half-way leaves only its partial directory, which a later run removes once
that pid is dead on this host (a partial directory without the tag, or of a live process, is never
touched). A second run reuses a complete ``OUT`` whose marker matches the sources (``reused=True``,
no file rewritten); a non-empty ``OUT`` without that marker -- or with one from other source files --
is refused, never deleted. Two runs started at once each build their own partial directory; the
loser's rename fails, it finds the winner's marker, removes its own partial directory and returns
``reused=True``. (All-or-nothing against a process dying; files are not fsync'ed, so a power cut
right after a render may still need ``rm -r OUT`` and a rerun.)
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace

import numpy as np

from datacache.config import ConfigError

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
INSTALL_HINT = "apt-get install dataset-fashion-mnist"
# Folder names: sorted order == label order (Zalando's label numbers 0..9).
CLASS_NAMES = ("0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat",
               "5_sandal", "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot")
SIDE = 28
# split -> (images file, labels file, the official number of items: the cap read_idx enforces)
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
FILE_NAMES = tuple(name for images, labels, _ in SPLITS.values() for name in (images, labels))
MARKER = ".fashion-mnist-complete"
PARTIAL_TAG = ".fashion-mnist-partial"
FORMAT = "datacache fashion-mnist imagefolder"
FORMAT_VERSION = 1
_MADE_BY = "trainer.fashion (python -m trainer fashion)"
_REFETCH = "re-download the file or reinstall the package (apt-get install --reinstall dataset-fashion-mnist)"
_CHUNK = 2_000  # images per writer task
_WORKERS = min(8, (os.cpu_count() or 1) + 2)  # threads: zlib and file I/O release the GIL


@dataclass(frozen=True)
class FashionSplit:
    """What :func:`render` made (or found): the two ImageFolder roots, their sizes, and whether an
    existing complete tree was reused instead of written."""

    train: str
    val: str
    n_train: int
    n_val: int
    reused: bool


# ---------------------------------------------------------------------------------------------- reading


def _read_idx(path: str, *, expect_dims: int, max_items: int) -> tuple[np.ndarray, str]:
    """:func:`read_idx` plus the SHA-256 (hex) of the file's decompressed content."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; gzip wraps it)
    except OSError as e:
        raise ConfigError(f"cannot open {path}: {e.strerror}; check that it exists and is readable") from e
    gzipped = False
    with contextlib.ExitStack() as files:
        files.enter_context(f)
        try:
            gzipped = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            stream = files.enter_context(gzip.GzipFile(fileobj=f, mode="rb")) if gzipped else f
            head = stream.read(4)
            if len(head) < 4:
                raise ConfigError(f"{path} is {len(head)} bytes long (after decompression), too short for an "
                                  f"IDX header; {_REFETCH}")
            kind = "images" if expect_dims == 3 else "labels" if expect_dims == 1 else f"{expect_dims}-d"
            want = f"0x000008{expect_dims:02x} ({kind})"
            if head[:2] != b"\0\0":
                raise ConfigError(f"{path} is not an IDX file: magic number 0x{head.hex()}, expected {want}; "
                                  f"{_REFETCH}")
            if head[2] != 0x08:
                raise ConfigError(f"{path}: IDX data type 0x{head[2]:02x}, expected 0x08 (unsigned byte) as "
                                  f"in Fashion-MNIST; {_REFETCH}")
            if head[3] != expect_dims:
                raise ConfigError(f"{path}: IDX magic 0x{head.hex()} says {head[3]} dimension(s), expected "
                                  f"{want}: is it the right file (images vs labels)? {_REFETCH}")
            dim_bytes = stream.read(4 * expect_dims)
            if len(dim_bytes) < 4 * expect_dims:
                raise ConfigError(f"{path}: IDX header truncated ({4 + len(dim_bytes)} of "
                                  f"{4 + 4 * expect_dims} bytes); {_REFETCH}")
            dims = struct.unpack(f">{expect_dims}I", dim_bytes)
            size = 1
            for d in dims:
                size *= d
            cap = max_items * SIDE * SIDE
            if dims[0] > max_items or size > cap:
                raise ConfigError(f"{path}: IDX header claims shape {'x'.join(map(str, dims))} "
                                  f"({size:,} bytes), more than this split's {max_items:,} items of at most "
                                  f"{SIDE}x{SIDE} ({cap:,} bytes): the file is damaged or not Fashion-MNIST; "
                                  + _REFETCH)
            payload = stream.read(size + 1)  # never more than the header promises plus one byte
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            what = "gzip stream is damaged" if gzipped else "read failed"
            raise ConfigError(f"{path}: {what} ({e}); {_REFETCH}") from e
    if len(payload) < size:
        raise ConfigError(f"{path} is truncated: its header promises {size:,} data bytes "
                          f"(shape {'x'.join(map(str, dims))}), the file holds {len(payload):,}; {_REFETCH}")
    if len(payload) > size:
        raise ConfigError(f"{path} has data after the {size:,} bytes its header promises "
                          f"(shape {'x'.join(map(str, dims))}); {_REFETCH}")
    digest = hashlib.sha256(head + dim_bytes + payload).hexdigest()
    return np.frombuffer(payload, dtype=np.uint8).reshape(dims).copy(), digest


def read_idx(path: str, *, expect_dims: int, max_items: int) -> np.ndarray:
    """One IDX file (gzip or plain, told by its first two bytes) as a uint8 array of the header's shape.

    Checks the magic (``00 00 08 <expect_dims>``), that the first dimension is at most ``max_items``
    and the whole at most ``max_items * 28 * 28`` bytes (checked before reading, so a hostile header
    allocates nothing), and that the data is exactly that long. ConfigError (one line) otherwise.
    """
    return _read_idx(path, expect_dims=expect_dims, max_items=max_items)[0]


def _install_hint(directory: str) -> str:
    if os.path.abspath(directory) == os.path.abspath(DEFAULT_DIR):
        return f"install the Debian package: {INSTALL_HINT} (or pass --from DIR for a copy elsewhere)"
    return (f"put Zalando's four Fashion-MNIST IDX files there (gzip or not), or drop --from to use "
            f"{DEFAULT_DIR} ({INSTALL_HINT})")


def find_files(directory: str) -> dict[str, str]:
    """``{'train-images-idx3-ubyte': path, ...}`` for the four IDX files in ``directory``.

    Each may be named with or without ``.gz`` (the plain name wins when both exist; the content decides
    whether it is decompressed). ConfigError naming what is missing and how to get it otherwise.
    """
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise ConfigError(f"Fashion-MNIST directory {directory} {what}; {_install_hint(directory)}")
    found: dict[str, str] = {}
    for name in FILE_NAMES:
        for candidate in (name, name + ".gz"):
            path = os.path.join(directory, candidate)
            if os.path.isfile(path):
                found[name] = path
                break
    missing = [f"{name}[.gz]" for name in FILE_NAMES if name not in found]
    if missing:
        raise ConfigError(f"Fashion-MNIST directory {directory} lacks {', '.join(missing)}; "
                          f"{_install_hint(directory)}")
    return found


def _load(directory: str) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, str]]:
    files = find_files(directory)
    data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    digests: dict[str, str] = {}
    for split, (images_name, labels_name, max_items) in SPLITS.items():
        ip, lp = files[images_name], files[labels_name]
        images, digests[images_name] = _read_idx(ip, expect_dims=3, max_items=max_items)
        labels, digests[labels_name] = _read_idx(lp, expect_dims=1, max_items=max_items)
        if images.shape[1:] != (SIDE, SIDE):
            raise ConfigError(f"{ip} holds {images.shape[1]}x{images.shape[2]} images, Fashion-MNIST's are "
                              f"{SIDE}x{SIDE}; {_REFETCH}")
        if len(images) != len(labels):
            raise ConfigError(f"{ip} holds {len(images):,} images but {lp} holds {len(labels):,} labels: "
                              f"both must be the same split's; {_REFETCH}")
        if len(labels) == 0:
            raise ConfigError(f"{lp} holds no labels (and {ip} no images); {_REFETCH}")
        if int(labels.max()) >= len(CLASS_NAMES):
            at = int(np.argmax(labels >= len(CLASS_NAMES)))
            raise ConfigError(f"{lp}: label {int(labels[at])} at index {at} is outside 0..9; {_REFETCH}")
        counts = np.bincount(labels, minlength=len(CLASS_NAMES)).tolist()
        if len(set(counts)) != 1:
            raise ConfigError(f"{lp}: class counts {counts} are unequal, but Fashion-MNIST has exactly "
                              f"{len(labels) / len(CLASS_NAMES):g} per class in its {len(labels):,} labels; "
                              f"{_REFETCH}")
        data[split] = (images, labels.astype(np.int64))
    return data, digests


def load(directory: str = DEFAULT_DIR) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{'train': (images uint8 [N, 28, 28], labels int64 [N]), 'val': (...)}``; ``val`` is t10k.

    All checks of the module docstring; ConfigError (one line, naming the file) on any problem.
    """
    return _load(directory)[0]


# ---------------------------------------------------------------------------------------------- writing


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_END = _png_chunk(b"IEND", b"")


def _png(image: np.ndarray) -> bytes:
    """A minimal 8-bit grayscale PNG of ``image`` (uint8 [H, W]); several times faster than Pillow's
    encoder for tiny images. Each scanline gets filter byte 0 (none); the pixels go through zlib
    unchanged, so a decoder returns exactly ``image``."""
    h, w = image.shape
    rows = np.zeros((h, w + 1), dtype=np.uint8)
    rows[:, 1:] = image
    # 8 bits per pixel, grayscale, deflate, filter method 0, no interlace
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (_PNG_SIGNATURE + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _PNG_END)


def _write_chunk(root: str, split: str, images: np.ndarray, labels: np.ndarray, start: int, stop: int) -> int:
    for i in range(start, stop):
        path = os.path.join(root, split, CLASS_NAMES[labels[i]], f"{i:05d}.png")
        with open(path, "xb") as f:
            f.write(_png(images[i]))
    return stop - start


def _write_tree(root: str, data: dict[str, tuple[np.ndarray, np.ndarray]], progress: bool) -> None:
    from tqdm import tqdm

    for split in data:
        for name in CLASS_NAMES:
            os.makedirs(os.path.join(root, split, name))
    total = sum(len(labels) for _, labels in data.values())
    # disable=None: a bar only when stderr is a terminal
    with tqdm(total=total, desc="fashion-mnist", unit="img", file=sys.stderr,
              disable=None if progress else True) as bar, ThreadPoolExecutor(_WORKERS) as pool:
        try:
            jobs = [pool.submit(_write_chunk, root, split, images, labels, start,
                                min(start + _CHUNK, len(labels)))
                    for split, (images, labels) in data.items() for start in range(0, len(labels), _CHUNK)]
            for job in as_completed(jobs):
                bar.update(job.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we wrote: keep the directory
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove_stale_partials(out: str) -> None:
    """Remove ``OUT.partial-<pid>-*`` directories that carry our tag, name this host and whose pid is dead."""
    parent, base = os.path.split(out)
    pattern = re.compile(re.escape(base) + r"\.partial-(\d+)-[0-9a-zA-Z]+")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    host = socket.gethostname()
    for name in names:
        m = pattern.fullmatch(name)
        path = os.path.join(parent, name)
        if not m or os.path.islink(path) or not os.path.isdir(path):
            continue
        tag = _read_json(os.path.join(path, PARTIAL_TAG))
        pid = int(m.group(1))
        if (tag is None or tag.get("made_by") != _MADE_BY or tag.get("host") != host or tag.get("pid") != pid
                or _alive(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _check_existing(out: str, expected: dict) -> bool:
    """True: ``out`` is a complete tree of these sources (reuse). False: absent or an empty directory.
    ConfigError for anything else (which is never touched)."""
    if not os.path.lexists(out):
        return False
    if not os.path.isdir(out):
        raise ConfigError(f"{out} exists and is not a directory; remove it or choose another OUT")
    if not os.listdir(out):
        return False
    marker = _read_json(os.path.join(out, MARKER))
    if marker is None:
        raise ConfigError(f"{out} is not empty and is not a completed Fashion-MNIST tree from this command "
                          f"(no readable {MARKER}); remove it or choose another OUT")
    if marker != expected:
        raise ConfigError(f"{out} is not a completed Fashion-MNIST tree from this command and these source "
                          f"files (its {MARKER} records other sources, counts or format version); remove it "
                          "or choose another OUT")
    per_class = expected["per_class"]
    for split in SPLITS:
        for name in CLASS_NAMES:
            folder = os.path.join(out, split, name)
            try:
                n = sum(1 for e in os.listdir(folder) if e.endswith(".png"))
            except OSError:
                n = 0
            if n != per_class[split]:
                raise ConfigError(f"{out} is marked complete but {folder} holds {n} PNG files, expected "
                                  f"{per_class[split]}: files changed after rendering; remove {out} and "
                                  "render again")
    return True


def render(out: str, *, source: str = DEFAULT_DIR, progress: bool = True) -> FashionSplit:
    """Write ``out/train`` and ``out/val`` (all-or-nothing; see the module docstring) or reuse them."""
    if not out:
        raise ConfigError("OUT is empty; name the directory to render Fashion-MNIST into")
    out = os.path.normpath(out)
    data, digests = _load(source)
    counts = {split: len(labels) for split, (_, labels) in data.items()}
    result = FashionSplit(os.path.join(out, "train"), os.path.join(out, "val"),
                          counts["train"], counts["val"], reused=False)
    expected = {"format": FORMAT, "version": FORMAT_VERSION, "classes": list(CLASS_NAMES), "counts": counts,
                "per_class": {split: n // len(CLASS_NAMES) for split, n in counts.items()},
                "sha256": dict(sorted(digests.items()))}
    target = os.path.abspath(out)
    _remove_stale_partials(target)
    if _check_existing(target, expected):
        return replace(result, reused=True)

    parent = os.path.dirname(target)
    tmp = f"{target}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        raise ConfigError(f"cannot create {tmp} next to OUT: {e.strerror}; choose an OUT in a writable "
                          "directory") from e
    try:
        with open(os.path.join(tmp, PARTIAL_TAG), "w", encoding="utf-8") as f:
            json.dump({"made_by": _MADE_BY, "pid": os.getpid(), "host": socket.gethostname(),
                       "out": target}, f)
        _write_tree(tmp, data, progress)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:  # last: it means "complete"
            json.dump(expected, f, indent=1)
            f.write("\n")
        os.rename(tmp, target)  # only while OUT is absent or an empty directory
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # another run finished first (or someone filled OUT meanwhile): reuse or refuse like a rerun
        lost_race = e.errno in (errno.ENOTEMPTY, errno.EEXIST) and e.filename == tmp
        if lost_race and _check_existing(target, expected):
            return replace(result, reused=True)
        raise ConfigError(f"cannot write Fashion-MNIST to {out}: {e.strerror or e} ({e.filename}); check "
                          "free space and permissions") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # the tree is complete without it; a leftover tag is harmless
        os.unlink(os.path.join(target, PARTIAL_TAG))
    return result
