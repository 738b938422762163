"""Listing a dataset source (ImageFolder tree or .txt/.csv file list) through fsspec.

Order (ImageFolder): exactly torchvision's ``make_dataset``: classes are the sorted sub-directory
names of the root; for each class in that order, the class folder is walked like
``sorted(os.walk(class_dir, followlinks=True))`` and each directory's files are taken in sorted
order. So ``a/2.jpg, a/sub/1.jpg`` (class ``a``) come before ``a-b/3.jpg`` (class ``a-b``) although
``"a-b/3.jpg" < "a/sub/1.jpg"`` as strings, and within a class ``sub/x`` comes before ``sub-x/y``
before ``sub/deeper/z`` only in the order ``os.walk`` roots sort (``"sub" < "sub-x" < "sub/deeper"``).

Speed: class folders are listed **concurrently** -- fsspec's async ``_find`` gathered on its event
loop when the filesystem is async (http, s3, gcs), a thread pool of ``workers`` threads otherwise --
so per-request latency (NFS, object stores) overlaps. A listing request returns sizes and mtimes in
bulk (NFS READDIRPLUS, S3 ListObjectsV2); ``slowfile://`` charges one latency per directory listing
accordingly. A progress bar shows classes listed when stderr is a terminal.

Each entry's identity is (path, size, mtime, version): ``version`` is a 64-bit hash of the
object's ETag / version id / generation where the protocol reports one (0 otherwise).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import numpy as np
import xxhash

log = logging.getLogger("datacache.manifest")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LIST_EXTENSIONS = (".txt", ".csv")
_VERSION_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash")
_T = TypeVar("_T")
_R = TypeVar("_R")


class ManifestError(Exception):
    """The dataset cannot be listed; the message names the URL and what to do."""


def is_image(name: str) -> bool:
    """True when ``name`` has an image extension (case-insensitive)."""
    return name.lower().endswith(IMG_EXTENSIONS)


def mtime_of(info: dict[str, Any]) -> float:
    """A file's modification time as a float from any fsspec ``info`` dict (0.0 if unknown)."""
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(k)
        if v is None:
            continue
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return 0.0


def version_of(info: dict[str, Any]) -> int:
    """64-bit hash of the object's ETag / version id / generation, or 0 when the protocol has none."""
    for k in _VERSION_KEYS:
        v = info.get(k)
        if v not in (None, ""):
            return xxhash.xxh3_64_intdigest(str(v).encode())
    return 0


def size_of(info: dict[str, Any]) -> int:
    s = info.get("size")
    return int(s) if isinstance(s, (int, float)) and s >= 0 else -1  # -1: unknown


@dataclass
class Block:
    """Files of one class folder (or of a file list), compact: ~40 bytes per file plus its path, the
    fsspec info dicts (~1 KB per file) already dropped."""

    paths: bytes  # relative paths, UTF-8 (surrogateescape), back to back
    lengths: np.ndarray  # int64: byte length of each path
    targets: np.ndarray  # int32
    sizes: np.ndarray  # int64 (-1 = unknown)
    mtimes: np.ndarray  # float64
    versions: np.ndarray  # uint64

    @classmethod
    def of(cls, rels: Sequence[str], targets: Sequence[int], infos: Sequence[dict[str, Any]]) -> Block:
        enc = [r.encode("utf-8", "surrogateescape") for r in rels]
        n = len(enc)
        return cls(b"".join(enc), np.fromiter((len(e) for e in enc), np.int64, n),
                   np.asarray(targets, dtype=np.int32).reshape(n),
                   np.fromiter((size_of(i) for i in infos), np.int64, n),
                   np.fromiter((mtime_of(i) for i in infos), np.float64, n),
                   np.fromiter((version_of(i) for i in infos), np.uint64, n))


@dataclass
class Listing:
    """What a walk found: compact :class:`Block` s in listing order (packed into a Manifest afterwards).
    ``listed_at``: wall-clock time at which the walk started (revalidation's "racy" rule)."""

    classes: list[str] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    dirstate: dict[str, list[float]] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)
    listed_at: float = 0.0

    def count(self, what: str, n: int = 1) -> None:
        self.ignored[what] = self.ignored.get(what, 0) + n

    def columns(self) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(paths blob, offsets, labels, sizes, mtimes, versions)`` of every block, in order; the blocks
        are released column by column, so the peak is the result plus one column of the blocks."""
        blocks, self.blocks = self.blocks, []
        blob = b"".join(b.paths for b in blocks)
        for b in blocks:
            b.paths = b""
        lengths = np.concatenate([b.lengths for b in blocks]) if blocks else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        cols = []
        for name, dtype in (("targets", np.int32), ("sizes", np.int64), ("mtimes", np.float64),
                            ("versions", np.uint64)):
            cols.append(np.concatenate([getattr(b, name) for b in blocks]) if blocks
                        else np.zeros(0, dtype))
            for b in blocks:
                setattr(b, name, None)
        return (blob, offsets, *cols)  # type: ignore[return-value]


def map_concurrent(fn: Callable[[_T], _R], items: Sequence[_T], *, workers: int = 32,
                   desc: str | None = None) -> list[_R]:
    """``[fn(x) for x in items]`` on a thread pool (I/O-bound requests overlap), in input order.

    Process boundary note: the pool is created and shut down inside this call, so no thread
    outlives it (threads do not survive a fork)."""
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
    from tqdm import tqdm

    out: list[Any] = [None] * len(items)
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="datacache-list")
    bar = tqdm(total=len(items), desc=desc, unit="dir", disable=None if desc else True, leave=False)
    with pool, bar:
        futs = {pool.submit(fn, x): k for k, x in enumerate(items)}
        for f in as_completed(futs):
            out[futs[f]] = f.result()
            bar.update(1)
    return out


@dataclass
class _ClassResult:
    block: Block
    # (mtime, entry count) of the class folder itself, then ``(relative dir, mtime, count)`` of each of
    # its sub-directories (rare). Plain floats, no dict: the dirstate dict is built after the walk (see
    # list_folder's memory note)
    state: tuple[float, float]
    subdirs: list[tuple[str, float, float]]
    non_image: int


def _class_result(fs: fsspec.AbstractFileSystem, path: str, cdir: str, target: int,
                  found: dict[str, dict]) -> _ClassResult:
    """One class folder's ``find`` result turned into a compact block (runs in a listing thread, so the
    info dicts of at most ``workers`` folders are alive at once)."""
    skip = len(path.rstrip("/")) + 1  # length of "<path>/"
    found = {n.rstrip("/"): i for n, i in found.items()}
    subdirs = [cdir] + [n for n, i in found.items() if i["type"] == "directory" and n != cdir]
    counts = dict.fromkeys(subdirs, 0)
    for n in found:
        parent = n.rpartition("/")[0]  # string ops, not posixpath: this loop runs once per file
        if n != cdir and parent in counts:
            counts[parent] += 1
    # (mtime, entry count) per directory, from the walk itself
    state = (mtime_of(found.get(cdir) or fs.info(cdir)), float(counts[cdir]))
    extra = [(posixpath.relpath(d, path), mtime_of(found.get(d) or fs.info(d)), float(counts[d]))
             for d in subdirs[1:]]
    files: list[tuple[str, str, dict]] = []
    non_image = 0
    for name, info in found.items():
        if info["type"] == "directory":
            continue
        if not is_image(name):
            non_image += 1
            continue
        d, _, base = name.rpartition("/")
        files.append((d, base, info))
    # torchvision: sorted(os.walk(class_dir)) -> directories in string order, files sorted in each
    files.sort(key=lambda e: (e[0], e[1]))
    # every name lies under cdir = path/<class>: relative by slicing
    block = Block.of([f"{d}/{n}"[skip:] for d, n, _ in files], [target] * len(files),
                     [i for _, _, i in files])
    return _ClassResult(block, state, extra, non_image)


def _walk_classes(fs: fsspec.AbstractFileSystem, path: str, cdirs: list[str],
                  workers: int) -> list[_ClassResult]:
    """:func:`_class_result` of every class folder, concurrently, in class order. Memory: the raw
    listings of at most ``workers`` folders (sync filesystems: one per thread) or of one chunk of
    ``4 * workers`` folders (async filesystems) exist at once, never all of them."""
    def find(d: str) -> dict[str, dict]:
        return fs.find(d, withdirs=True, detail=True)

    if getattr(fs, "async_impl", False) and hasattr(fs, "_find"):
        sem_size, step = max(1, workers), max(1, 4 * workers)
        out: list[_ClassResult] = []
        for c0 in range(0, len(cdirs), step):
            chunk = cdirs[c0:c0 + step]

            async def gather(chunk: list[str] = chunk) -> list[dict[str, dict]]:
                sem = asyncio.Semaphore(sem_size)

                async def one(d: str) -> dict[str, dict]:
                    async with sem:
                        return await fs._find(d, withdirs=True, detail=True)

                return list(await asyncio.gather(*(one(d) for d in chunk)))

            founds = fsspec.asyn.sync(fs.loop, gather)
            out.extend(_class_result(fs, path, d, c0 + k, f) for k, (d, f) in enumerate(zip(chunk, founds)))
            del founds
        return out
    return _bounded_map(find, cdirs, lambda k, found: _class_result(fs, path, cdirs[k], k, found),
                        workers=workers, desc="listing class folders")


def _bounded_map(fetch: Callable[[_T], Any], items: Sequence[_T], convert: Callable[[int, Any], _R], *,
                 workers: int, desc: str) -> list[_R]:
    """``[convert(k, fetch(x)) ...]`` in input order: ``fetch`` (I/O) on a thread pool with at most
    ``workers`` requests in flight, ``convert`` in this thread as each arrives -- so at most ``workers``
    raw results exist at once and the CPU-bound conversion never competes for the GIL with itself.

    Process boundary note: the pool lives only inside this call (threads do not survive a fork)."""
    if len(items) <= 1 or workers <= 1:
        return [convert(k, fetch(x)) for k, x in enumerate(items)]
    from concurrent.futures import FIRST_COMPLETED, wait

    from tqdm import tqdm

    out: list[Any] = [None] * len(items)
    todo = iter(enumerate(items))
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="datacache-list")
    bar = tqdm(total=len(items), desc=desc, unit="dir", disable=None if desc else True, leave=False)
    with pool, bar:
        running = {}
        for k, x in todo:
            running[pool.submit(fetch, x)] = k
            if len(running) >= workers:
                break
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                k = running.pop(f)
                out[k] = convert(k, f.result())
                bar.update(1)
                nxt = next(todo, None)
                if nxt is not None:
                    running[pool.submit(fetch, nxt[1])] = nxt[0]
    return out


def list_folder(fs: fsspec.AbstractFileSystem, path: str, url: str, *, workers: int = 32) -> Listing:
    """Walk an ImageFolder tree (see the module docstring for the order)."""
    out = Listing(listed_at=time.time())  # before the first request: a change during the walk is "racy"
    top = fs.ls(path, detail=True)
    out.dirstate[""] = [mtime_of(fs.info(path)), float(len(top))]
    out.classes = sorted(posixpath.basename(e["name"].rstrip("/")) for e in top if e["type"] == "directory")
    n_outside = sum(1 for e in top if e["type"] != "directory")
    if n_outside:
        out.count("outside_class", n_outside)
    cdirs = [posixpath.join(path, c) for c in out.classes]
    results = _walk_classes(fs, path, cdirs, workers)
    # Memory: the walk churns through ~1 KB of short-lived fsspec objects per file; a long-lived small
    # object allocated in the middle of that churn pins its allocator arena, and at 1.28M files that
    # kept tens of MB resident after the walk. So the walk's results hold only numpy arrays, bytes and
    # floats, and the dirstate dict (strings and lists that live as long as the manifest) is built here,
    # after the churn.
    for target, (c, res) in enumerate(zip(out.classes, results)):
        out.dirstate[c] = list(res.state)
        for rel, mtime, count in res.subdirs:
            out.dirstate[rel] = [mtime, count]
        if res.non_image:
            out.count("non_image", res.non_image)
        out.blocks.append(res.block)
        if not len(res.block.lengths):
            out.count("empty_class")
            log.warning("manifest %s: class folder %r has no images; it keeps class index %d", url, c, target)
    return out


def open_source_fs(source: str, storage_options: dict | None) -> tuple[fsspec.AbstractFileSystem, str, str]:
    """(filesystem, path inside it, normalised URL) for ``source``."""
    if "::" in source:
        raise ManifestError(f"{source}: list the original source, not a chained (cached) URL")
    if "://" not in source:
        source = os.path.abspath(os.path.expanduser(source))
    try:
        fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
    except (ValueError, ImportError) as e:
        raise ManifestError(f"{source}: cannot open this URL with fsspec ({e}); "
                            "check the scheme and the storage_options") from e
    path = path.rstrip("/") or "/"
    return fs, path, fs.unstrip_protocol(path)


# A directory whose recorded mtime is at least this much older than the listing's start is "settled":
# its mtime alone proves its entries unchanged (any later add/remove/rename sets a newer mtime). Closer
# to the listing, a change in the same timestamp tick could keep the mtime (1-2 s granularity on some
# filesystems; Linux's coarse clock ticks are a few milliseconds) or the file server's clock may lag
# ours: such "racy" directories (git's term for the same problem) also have their entries counted.
# 10 s covers 2 s granularity plus 8 s of clock skew between a client and an NFS server.
RACY_MARGIN_S = 10.0


def dirs_changed(fs: fsspec.AbstractFileSystem, dirs: Sequence[tuple[str, list[float]]], listed_at: float, *,
                 workers: int = 32) -> tuple[bool, int]:
    """``(any changed, racy directories counted)`` for ``(url, [mtime, entry count])`` pairs recorded by a
    listing that started at ``listed_at`` (0 = unknown: every directory is racy). A settled directory
    costs one stat; a racy one also a name listing (no per-file stat)."""
    def check(item: tuple[str, list[float]]) -> tuple[bool, bool]:
        full, (mtime, count) = item
        if mtime_of(fs.info(full)) != mtime:
            return True, False
        if mtime < listed_at - RACY_MARGIN_S:
            return False, False
        return float(len(fs.ls(full, detail=False))) != count, True

    got = map_concurrent(check, list(dirs), workers=workers, desc="revalidating directories")
    return any(c for c, _ in got), sum(1 for _, r in got if r)
