"""The manifest: one listing of the dataset (paths, labels, sizes, mtimes, versions) and its fingerprint.

Sources (walked by :mod:`datacache.listing`)
    * an **ImageFolder tree** (any fsspec URL): ``root/<class>/**/<file>``, in exactly the order of
      torchvision's ``make_dataset`` (classes sorted; each class folder walked as
      ``sorted(os.walk(...))``). A file is an image when its extension is in :data:`IMG_EXTENSIONS`
      (case-insensitive); other files are counted in ``ignored["non_image"]``, files directly under
      the root in ``ignored["outside_class"]``. An empty class folder keeps its class index
      (torchvision's ``allow_empty=True``), counted in ``ignored["empty_class"]``. A dangling
      symlink with an image extension stays listed (as in torchvision); reading it fails later
      with a :class:`~datacache.source.SourceError` naming the file.
    * a **file list** (``.txt`` / ``.csv``): one ``relpath`` or ``relpath,label`` per line, relative
      to the list's directory (``#`` comments and a ``path,label`` header are skipped). Without labels
      the class is the first path component; integer labels are used as given; other labels are
      class names indexed by sorted name. Missing files are counted in ``ignored["missing"]`` and
      logged as one warning per listing (the count and the first few lines).
      ``root`` is then the list's directory and ``listed`` the list file itself. An entry that is
      absolute (``/x``, ``C:\\x``), a URL, climbs (a ``..`` segment) or holds a NUL or a backslash, and a
      numeric label that is negative or not below ``max(rows, 65536)``, is a :class:`ManifestError`
      naming the list's line (never its text: :func:`datacache.filelist.list_entry_problem`). Every read
      of a list is bounded (:class:`~datacache.filelist.ListLimits`: 1 GiB, 33,554,432 lines, 8,192
      characters an entry line) and streamed; the rows are kept compact while the list is read.

Memory of a listing
    Class folders are listed concurrently, but each folder's fsspec info dicts (~1 KB per file) are
    turned into compact columns as soon as it arrives, with at most ``workers`` folders in flight,
    and the manifest is saved field by field from the columns' own memory: the peak of a listing is
    a small multiple of the manifest, not of the fsspec dicts (bench/results/NOTES.md#listing-memory).

Memory (what travels to every spawn DataLoader worker)
    Columns are numpy arrays -- ``labels`` int32, ``sizes`` int64 (-1 = unknown), ``mtimes``
    float64, ``versions`` uint64 -- and the relative paths one packed UTF-8 blob with offsets
    (:class:`~datacache.columns.PackedStrings`, as FFCV does). ``paths`` and ``targets`` are cheap
    read-only sequence views. ImageNet's 1.28M entries take ~80 MB (``nbytes``), pickle as a few
    buffers, and are measured by ``python -m bench.manifest_scale``.

Identity and fingerprint
    A file's identity is (path, size, mtime, version) (:meth:`Manifest.identity`); T1 entries and
    remembered decode failures are keyed by it. The fingerprint (16 hex chars, xxh3_64 over the
    classes and every column) changes when any file is added, removed, resized, touched or
    relabelled, and with it every cache key, so no stale sample is served once the change is seen.

Persistence and revalidation (``persist_dir``), costs for 1.28M files in 1,000 folders
    :meth:`Manifest.build` saves a msgpack copy in ``persist_dir`` (one file per source URL) and on
    the next start checks it with ``revalidate``:

    * ``"dirs"`` (default): re-stat every *directory* seen by the walk (one request per directory,
      concurrent: ~1,000 for ImageNet; bench/results/NOTES.md#listing-memory) and compare its mtime. A
      directory whose recorded mtime is at least ``RACY_MARGIN_S`` (10 s) older than the listing's
      start (``listed_at``) is *settled*: an unchanged mtime proves its entries unchanged, since
      adding, removing or renaming an entry sets a newer one. A directory changed closer to the
      listing is *racy* (git's word for the same problem: a second change in the same timestamp tick
      -- 1-2 s on some filesystems -- or a file server whose clock lags keeps the mtime), so its entries
      are also counted (a name listing, no per-file stat) -- as every directory is for a manifest saved
      without ``listed_at``; once counted unchanged it is recorded as settled. It **detects** files
      added, removed, renamed or atomically replaced (write to a temp file + rename, as rsync does by
      default: the directory's mtime changes) and a rewritten file list. It **does not detect** a
      file rewritten in place (``open(f, "wb")``, ``touch``, ``rsync --inplace``): that changes the
      file's mtime, not its directory's -- nor an entry change whose directory mtime was set back
      (``touch -d``, ``rsync -t`` of directories) -- use ``"full"`` after such edits. Filesystems
      without directory mtimes (S3, HTTP) fall back to ``"full"``.
    * ``"full"``: re-list everything (one listing per directory, as the first start) and compare
      fingerprints: detects every change of size, mtime or version.
    * ``"none"``: trust the saved copy made for the same URL (no request at all).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec
import msgpack
import numpy as np
import xxhash

from datacache.columns import ArrayView, PackedStrings
from datacache.filelist import ListLimits, list_file, validate_file_list
from datacache.listing import (
    IMG_EXTENSIONS,
    LIST_EXTENSIONS,
    Listing,
    ManifestError,
    dirs_changed,
    is_image,
    list_folder,
    mtime_of,
    open_source_fs,
)

__all__ = ["IMG_EXTENSIONS", "REVALIDATE_CHOICES", "ListLimits", "Manifest", "ManifestError", "is_image",
           "validate_file_list"]

log = logging.getLogger("datacache.manifest")

REVALIDATE_CHOICES = ("dirs", "full", "none")
MANIFEST_FORMAT = 2
_COLUMNS = (("labels", np.int32), ("sizes", np.int64), ("mtimes", np.float64), ("versions", np.uint64))
COLUMNS = tuple(name for name, _ in _COLUMNS)  # the numpy columns, besides the packed paths


def check_revalidate(revalidate: str) -> str:
    """``revalidate`` if valid, else a ManifestError listing the choices."""
    if revalidate not in REVALIDATE_CHOICES:
        raise ManifestError(f"revalidate={revalidate!r} is not valid; choose one of "
                            f"{', '.join(REVALIDATE_CHOICES)} "
                            "(dirs: detects added/removed/replaced files; full: also in-place rewrites; "
                            "none: trust the saved listing)")
    return revalidate


def _le(a: np.ndarray, dtype: Any) -> np.ndarray:
    """``a`` as a contiguous little-endian array: ``a`` itself when it is one already (no copy)."""
    return np.ascontiguousarray(a, dtype=np.dtype(dtype))


@dataclass(eq=False)
class Manifest:
    """Listing of one dataset (see the module docstring). Build with :meth:`build` or :meth:`from_lists`."""

    root: str
    packed: PackedStrings
    labels: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray
    versions: np.ndarray
    classes: list[str]
    fingerprint: str = ""
    ignored: dict[str, int] = field(default_factory=dict)
    # recorded for cheap revalidation: relative dir (or list file) -> [mtime, entry count]
    dirstate: dict[str, list[float]] = field(default_factory=dict)
    kind: str = "folder"  # "folder" or "list"
    listed: str = ""  # the URL that was listed: ``root`` itself, or the .txt/.csv file for a list
    listed_at: float = 0.0  # wall-clock start of the listing (0 = unknown): the "racy" rule of "dirs"

    def __post_init__(self) -> None:
        n = len(self.packed)
        for name, dtype in _COLUMNS:
            col = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            if col.shape != (n,):
                raise ValueError(f"Manifest.{name} must have {n} entries, got shape {col.shape}")
            col.flags.writeable = False
            setattr(self, name, col)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        if not self.fingerprint:
            self.fingerprint = self.compute_fingerprint()
        if not self.listed:
            self.listed = self.root

    @classmethod
    def from_lists(cls, root: str, listing: Listing, **kw: Any) -> Manifest:
        """The manifest of a walk's compact blocks (consumed: the listing is empty afterwards)."""
        blob, offsets, labels, sizes, mtimes, versions = listing.columns()
        packed = PackedStrings(np.frombuffer(blob, dtype=np.uint8), offsets)  # a view of the joined paths
        return cls(root=root, packed=packed, labels=labels, sizes=sizes, mtimes=mtimes, versions=versions,
                   classes=list(listing.classes), ignored=dict(listing.ignored),
                   dirstate=dict(listing.dirstate), listed_at=listing.listed_at, **kw)

    # ------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.packed)

    @property
    def paths(self) -> PackedStrings:
        """Relative paths (a read-only sequence view of the packed blob)."""
        return self.packed

    @property
    def targets(self) -> ArrayView:
        """Labels as a read-only sequence of ints (``np.asarray(targets)`` is the int32 array)."""
        return ArrayView(self.labels)

    def identity(self, i: int) -> str:
        """``size:mtime:version`` of entry ``i``: what T1 entries and remembered failures are keyed by."""
        return f"{int(self.sizes[i])}:{float(self.mtimes[i])!r}:{int(self.versions[i]):x}"

    @property
    def nbytes(self) -> int:
        """Bytes held by the columns (the packed paths included)."""
        return self.packed.nbytes + sum(getattr(self, n).nbytes for n, _ in _COLUMNS)

    def compute_fingerprint(self) -> str:
        h = xxhash.xxh3_64()
        h.update(b"datacache-manifest-2\x1e" + "\x1f".join(self.classes).encode("utf-8") + b"\x1e")
        # the columns' own memory through the buffer protocol (a copy only on a big-endian machine):
        # hashing a 1.28M-file manifest used to copy all of it once more
        h.update(_le(self.packed.offsets, "<i8"))
        h.update(self.packed.blob)
        for name, dtype in _COLUMNS:
            h.update(_le(getattr(self, name), np.dtype(dtype).newbyteorder("<")))
        return h.hexdigest()

    def class_counts(self) -> dict[str, int]:
        counts = np.bincount(self.labels, minlength=len(self.classes)) if len(self) else [0] * len(
            self.classes)
        return {c: int(n) for c, n in zip(self.classes, counts)}

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, source: str, *, storage_options: dict | None = None, persist_dir: str | None = None,
              revalidate: str = "dirs", workers: int = 32, reuse: Manifest | None = None,
              list_limits: ListLimits | None = None) -> Manifest:
        """List ``source`` (ImageFolder tree or .txt/.csv list), reusing a persisted copy when valid.

        ``list_limits``: how much of a .txt/.csv list is read (default :class:`ListLimits`: 1 GiB,
        33,554,432 lines), on the first listing and on every re-listing alike.

        ``reuse``: a manifest of the same source already in memory (the cache daemon's, between its
        passes): revalidated instead of reading the persisted copy again, which at ImageNet scale costs
        more CPU than the revalidation and twice the manifest's memory while it lasts."""
        check_revalidate(revalidate)
        fs, path, url = open_source_fs(source, storage_options)
        try:
            info = fs.info(path)
        except FileNotFoundError as e:
            raise ManifestError(f"{url}: dataset source does not exist; pass an ImageFolder directory "
                                "(root/<class>/<image>) or a .txt/.csv file list that exists") from e
        except OSError as e:
            raise ManifestError(f"{url}: cannot stat the dataset source ({e}); check the path, "
                                "permissions and storage_options") from e
        saved_path = cls.persist_path(persist_dir, url) if persist_dir else None
        man: Manifest | None = None
        old: Manifest | None = None
        if reuse is not None and reuse.listed == url:
            old = reuse
        elif saved_path and os.path.exists(saved_path):
            old = cls._try_load(saved_path, url)
        if old is not None:
            listed_at = old.listed_at
            man = old._revalidated(fs, path, revalidate, workers, list_limits)
            if man is old:
                (log.debug if old is reuse else log.info)(
                    "manifest %s: reusing %s (%d files, revalidate=%s)", url,
                    "the copy in memory" if old is reuse else saved_path, len(old), revalidate)
                if saved_path and old.listed_at != listed_at:  # racy directories settled: save that
                    with contextlib.suppress(OSError):
                        old.save(saved_path)
                return old
        if man is None:
            man = cls._list(fs, path, url, info, workers, list_limits)
        if not len(man):
            raise ManifestError(f"{url}: no images found (extensions {', '.join(IMG_EXTENSIONS)}; "
                                f"ignored: {man.ignored}); check the layout root/<class>/<image>")
        if saved_path:
            try:
                man.save(saved_path)
            except OSError as e:  # a read-only cache dir must not stop training: re-list next time
                log.warning("manifest %s: cannot persist to %s (%s); it will be re-listed next start",
                            url, saved_path, e)
        return man

    @classmethod
    def _list(cls, fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict, workers: int,
              list_limits: ListLimits | None = None) -> Manifest:
        if info.get("type") == "directory":
            return cls.from_lists(url, list_folder(fs, path, url, workers=workers), kind="folder")
        if path.lower().endswith(LIST_EXTENSIONS):
            # root = the directory the listed paths are relative to, so Source(root).read(path) works
            return cls.from_lists(fs.unstrip_protocol(posixpath.dirname(path)),
                                  list_file(fs, path, url, info, workers=workers, limits=list_limits),
                                  kind="list", listed=url)
        raise ManifestError(f"{url}: not a directory nor a .txt/.csv file list; pass an ImageFolder "
                            "root directory or a file list")

    # ------------------------------------------------------------ revalidate
    def _revalidated(self, fs: fsspec.AbstractFileSystem, path: str, mode: str, workers: int,
                     list_limits: ListLimits | None = None) -> Manifest | None:
        """``self`` when still valid under ``mode``; the fresh listing when ``full`` re-listed a changed
        dataset (never listed twice); None when the dataset must be re-listed."""
        if mode == "none":
            return self
        if mode == "dirs" and self.dirstate and all(v[0] for v in self.dirstate.values()):
            keys = list(self.dirstate)
            start = time.time()
            try:
                if self.kind == "list" and "" in self.dirstate:
                    i = fs.info(path)
                    if [mtime_of(i), float(i.get("size") or 0)] != self.dirstate[""]:
                        return None
                    keys.remove("")
                changed, racy = dirs_changed(fs, [(self._dir_url(path, k), self.dirstate[k]) for k in keys],
                                             self.listed_at, workers=workers)
            except OSError:
                return None
            if changed:
                return None
            if racy:
                # every racy directory was counted unchanged as of `start`: as good as a listing that
                # started then, so later revalidations may treat them by their age against `start`
                self.listed_at = start
            return self
        # "full" (or no usable directory mtimes): re-list and compare fingerprints
        listed = self._list(fs, path, self.listed, fs.info(path), workers, list_limits)
        return self if listed.fingerprint == self.fingerprint else listed

    def _dir_url(self, path: str, key: str) -> str:
        if self.kind == "list":
            d = key[4:]
            return posixpath.join(posixpath.dirname(path), d) if d else posixpath.dirname(path)
        return posixpath.join(path, key) if key else path

    # ---------------------------------------------------------- persistence
    @staticmethod
    def persist_path(persist_dir: str, url: str) -> str:
        """File in ``persist_dir`` holding the manifest of ``url``."""
        if persist_dir.startswith("file://"):
            persist_dir = persist_dir[len("file://"):]
        return os.path.join(persist_dir, f"manifest-{xxhash.xxh3_64_hexdigest(url.encode())}.msgpack")

    def _fields(self) -> dict[str, Any]:
        """What :meth:`save` writes: the columns as little-endian arrays (no copy where they are)."""
        cols = {n: _le(getattr(self, n), np.dtype(d).newbyteorder("<")) for n, d in _COLUMNS}
        return {"format": MANIFEST_FORMAT, "root": self.root, "classes": self.classes,
                "blob": self.packed.blob, "offsets": _le(self.packed.offsets, "<i8"),
                **cols, "fingerprint": self.fingerprint, "ignored": self.ignored, "dirstate": self.dirstate,
                "kind": self.kind, "listed": self.listed, "listed_at": self.listed_at}

    def to_dict(self) -> dict[str, Any]:
        """The persisted fields, the columns as ``bytes``."""
        return {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in self._fields().items()}

    def save(self, path: str) -> None:
        """Write a msgpack copy atomically (temp file + rename: concurrent jobs never see half a file).

        Streamed: the map is written field by field and each column as a msgpack ``bin 32`` header
        followed by the array's own memory, so saving a 1.28M-file manifest allocates nothing of its
        size (``msgpack.packb`` of the whole dict needed two more copies of it)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        fields = self._fields()
        packer = msgpack.Packer(use_bin_type=True)
        with open(tmp, "wb") as f:
            f.write(packer.pack_map_header(len(fields)))
            for key, value in fields.items():
                f.write(packer.pack(key))
                if isinstance(value, np.ndarray):
                    view = memoryview(value).cast("B")
                    f.write(b"\xc6" + len(view).to_bytes(4, "big"))  # msgpack bin 32: 0xc6 + length
                    f.write(view)
                else:
                    f.write(packer.pack(value))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Manifest:
        """Read a copy written by :meth:`save`; raises ManifestError if it is not one."""
        try:
            with open(path, "rb") as f:
                d = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
            if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT:
                raise ValueError("unknown format")
            cols = {n: np.frombuffer(d[n], dtype=np.dtype(t).newbyteorder("<")) for n, t in _COLUMNS}
            packed = PackedStrings(np.frombuffer(d["blob"], dtype=np.uint8),
                                   np.frombuffer(d["offsets"], "<i8"))
            man = cls(root=d["root"], packed=packed, classes=list(d["classes"]), fingerprint="",
                      ignored=dict(d["ignored"]), dirstate={k: list(v) for k, v in d["dirstate"].items()},
                      kind=d["kind"], listed=d["listed"], listed_at=float(d.get("listed_at", 0.0)), **cols)
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise ManifestError(f"{path}: not a readable datacache manifest ({e}); "
                                "delete it to re-list") from e
        if man.fingerprint != d["fingerprint"]:
            raise ManifestError(f"{path}: stored fingerprint does not match its listing; "
                                "delete it to re-list")
        return man

    @classmethod
    def _try_load(cls, path: str, url: str) -> Manifest | None:
        try:
            man = cls.load(path)
        except ManifestError as e:
            log.warning("%s", e)
            return None
        return man if man.listed == url else None
