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
import posixpath
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
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
class Listing:
    """What a walk found, as plain lists (packed into a Manifest afterwards)."""

    paths: list[str] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mtimes: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    dirstate: dict[str, list[float]] = field(default_factory=dict)

    def add(self, rel: str, target: int, info: dict[str, Any]) -> None:
        self.paths.append(rel)
        self.targets.append(target)
        self.sizes.append(size_of(info))
        self.mtimes.append(mtime_of(info))
        self.versions.append(version_of(info))

    def count(self, what: str, n: int = 1) -> None:
        self.ignored[what] = self.ignored.get(what, 0) + n


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


def _find_all(fs: fsspec.AbstractFileSystem, dirs: list[str], workers: int) -> list[dict[str, dict]]:
    """``fs.find(d, withdirs=True, detail=True)`` for every directory, concurrently."""
    if getattr(fs, "async_impl", False) and hasattr(fs, "_find"):
        sem_size = max(1, workers)

        async def gather() -> list[dict[str, dict]]:
            sem = asyncio.Semaphore(sem_size)

            async def one(d: str) -> dict[str, dict]:
                async with sem:
                    return await fs._find(d, withdirs=True, detail=True)

            return list(await asyncio.gather(*(one(d) for d in dirs)))

        return fsspec.asyn.sync(fs.loop, gather)
    return map_concurrent(lambda d: fs.find(d, withdirs=True, detail=True), dirs, workers=workers,
                          desc="listing class folders")


def list_folder(fs: fsspec.AbstractFileSystem, path: str, url: str, *, workers: int = 32) -> Listing:
    """Walk an ImageFolder tree (see the module docstring for the order)."""
    out = Listing()
    top = fs.ls(path, detail=True)
    out.dirstate[""] = [mtime_of(fs.info(path)), float(len(top))]
    out.classes = sorted(posixpath.basename(e["name"].rstrip("/")) for e in top if e["type"] == "directory")
    n_outside = sum(1 for e in top if e["type"] != "directory")
    if n_outside:
        out.count("outside_class", n_outside)
    cdirs = [posixpath.join(path, c) for c in out.classes]
    skip = len(path.rstrip("/")) + 1  # length of "<path>/"
    for target, (c, cdir, found) in enumerate(zip(out.classes, cdirs, _find_all(fs, cdirs, workers))):
        found = {n.rstrip("/"): i for n, i in found.items()}
        subdirs = [cdir] + [n for n, i in found.items() if i["type"] == "directory" and n != cdir]
        counts = dict.fromkeys(subdirs, 0)
        for n in found:
            parent = n.rpartition("/")[0]  # string ops, not posixpath: this loop runs once per file
            if n != cdir and parent in counts:
                counts[parent] += 1
        for d in subdirs:  # (mtime, entry count) per directory, from the walk itself
            state = [mtime_of(found.get(d) or fs.info(d)), float(counts[d])]
            out.dirstate[posixpath.relpath(d, path)] = state
        files: list[tuple[str, str, dict]] = []
        for name, info in found.items():
            if info["type"] == "directory":
                continue
            if not is_image(name):
                out.count("non_image")
                continue
            d, _, base = name.rpartition("/")
            files.append((d, base, info))
        # torchvision: sorted(os.walk(class_dir)) -> directories in string order, files sorted in each
        files.sort(key=lambda e: (e[0], e[1]))
        for d, n, info in files:  # every name lies under cdir = path/<class>: relative by slicing
            out.add(f"{d}/{n}"[skip:], target, info)
        if not files:
            out.count("empty_class")
            log.warning("manifest %s: class folder %r has no images; it keeps class index %d", url, c, target)
    return out


def _parse_list(text: str) -> list[tuple[str, str | None]]:
    rows: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines()):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if n == 0 and parts[0].lower() in ("path", "relpath", "file", "filename"):
            continue
        rows.append((parts[0].lstrip("/"), parts[1] if len(parts) > 1 and parts[1] else None))
    return rows


def _labels(rows: list[tuple[str, str | None]], url: str) -> tuple[list[str], list[int]]:
    labels = [lab for _, lab in rows]
    if any(lab is None for lab in labels):
        names = [r.split("/", 1)[0] for r, _ in rows]
        classes = sorted(set(names))
        idx = {c: i for i, c in enumerate(classes)}
        return classes, [idx[nm] for nm in names]
    if all(lab.lstrip("-").isdigit() for lab in labels if lab is not None):
        ints = [int(lab) for lab in labels if lab is not None]
        if min(ints, default=0) < 0:
            raise ManifestError(f"{url}: negative label in file list")
        return [str(i) for i in range(max(ints, default=-1) + 1)], ints
    classes = sorted({lab for lab in labels if lab is not None})
    idx = {c: i for i, c in enumerate(classes)}
    return classes, [idx[lab] for lab in labels if lab is not None]


def list_file(fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict, *,
              workers: int = 32) -> Listing:
    """Read a .txt/.csv file list; one (concurrent) directory listing per distinct parent directory."""
    base = posixpath.dirname(path)
    rows = _parse_list(fs.cat_file(path).decode("utf-8-sig"))
    out = Listing()
    out.classes, targets = _labels(rows, url)
    out.dirstate[""] = [mtime_of(info), float(info.get("size") or 0)]
    dirs = sorted({posixpath.dirname(rel) for rel, _ in rows})

    def listdir(d: str) -> tuple[dict[str, dict], list[float] | None]:
        full_d = posixpath.join(base, d) if d else base
        try:
            ents = fs.ls(full_d, detail=True)
        except FileNotFoundError:
            return {}, None
        return ({posixpath.basename(e["name"].rstrip("/")): e for e in ents},
                [mtime_of(fs.info(full_d)), float(len(ents))])

    listings = dict(zip(dirs, map_concurrent(listdir, dirs, workers=workers)))
    for d, (_, state) in listings.items():
        if state is not None:
            out.dirstate["dir:" + d] = state
    for (rel, _), t in zip(rows, targets):
        ent = listings[posixpath.dirname(rel)][0].get(posixpath.basename(rel))
        if ent is None:
            out.count("missing")
            log.warning("manifest %s: listed file %r does not exist; skipped", url, rel)
            continue
        if not is_image(rel):
            out.count("non_image")
            continue
        out.add(rel, t, ent)
    return out


def dir_states(fs: fsspec.AbstractFileSystem, fulls: Iterable[str], *,
               workers: int = 32) -> list[list[float]]:
    """``[mtime, entry count]`` of each directory (two requests each), concurrently."""
    def state(full: str) -> list[float]:
        return [mtime_of(fs.info(full)), float(len(fs.ls(full, detail=False)))]

    return map_concurrent(state, list(fulls), workers=workers, desc="revalidating directories")
