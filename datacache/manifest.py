"""The manifest: one listing of the dataset (paths, labels, sizes, mtimes) and its fingerprint.

Sources
    * an **ImageFolder tree** (any fsspec URL): ``root/<class>/**/<file>``. Labels follow
      torchvision's ``ImageFolder`` exactly: ``classes`` = sorted sub-directory names of the
      root, files found recursively (symlinks included, like ``os.walk(followlinks=True)``)
      and ordered by (directory, file name). A file is an image when its extension is in
      :data:`IMG_EXTENSIONS` (case-insensitive); other files are skipped and counted in
      ``ignored["non_image"]``, files directly under the root in ``ignored["outside_class"]``.
      An empty class folder keeps its class index (torchvision's ``allow_empty=True``), is
      logged and counted in ``ignored["empty_class"]``. A dangling symlink with an image
      extension stays in the listing (as in torchvision); reading it fails later with a
      :class:`~datacache.source.SourceError` naming the file.
    * a **file list** (``.txt`` / ``.csv``): one ``relpath`` or ``relpath,label`` per line,
      paths relative to the list's directory; ``#`` comments and a header line
      (``path,label``) are skipped. Without labels the class is the first path component
      (sorted like ImageFolder); integer labels are used as given (``classes`` = ``"0".."N-1"``);
      other labels are class names, indexed by sorted name. Listed files that do not exist are
      skipped, logged and counted in ``ignored["missing"]``. ``Manifest.root`` is then the
      list's directory (what the paths are relative to, so ``Source(root)`` reads them) and
      ``Manifest.listed`` the list file itself.

Fingerprint
    xxh3_64 (16 hex chars) over the classes and every (relpath, size, mtime, label). Any file
    added, removed, resized or touched changes it, and with it every cache key.

Persistence and cheap revalidation (``persist_dir``)
    Walking 1.28M files on NFS costs minutes, so :meth:`Manifest.build` saves a msgpack copy
    in ``persist_dir`` (one file per source URL) and, on the next start, revalidates it:

    * ``revalidate="dirs"`` (default): re-stat every *directory* seen by the walk (root,
      class folders, their sub-folders; for a file list: the list file itself and the
      directories of the listed files) and compare (mtime, entry count) with the recorded
      values; ~2 calls per directory instead of one stat per file. It **catches** files
      added, removed or renamed (they change the parent directory's mtime and entry count)
      and a rewritten file list. It **does not catch** a file rewritten in place
      (``open(f, "wb")``, ``touch``, rsync ``--inplace``): that changes the file's mtime but
      not its directory's. Use ``"full"`` after such edits. Filesystems that report no
      directory mtime (S3, HTTP) fall back to ``"full"``.
    * ``revalidate="full"``: re-walk (the fingerprint then is always right).
    * ``revalidate="none"``: trust the saved copy if it was made for the same URL.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

import fsspec
import msgpack
import xxhash

log = logging.getLogger("datacache.manifest")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LIST_EXTENSIONS = (".txt", ".csv")
REVALIDATE_CHOICES = ("dirs", "full", "none")
MANIFEST_FORMAT = 1


class ManifestError(Exception):
    """The dataset cannot be listed; the message names the URL and what to do."""


def is_image(name: str) -> bool:
    """True when ``name`` has an image extension (case-insensitive)."""
    return name.lower().endswith(IMG_EXTENSIONS)


def _mtime(info: dict[str, Any]) -> float:
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


def _open_fs(source: str, storage_options: dict | None) -> tuple[fsspec.AbstractFileSystem, str, str]:
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


@dataclass
class Manifest:
    """Listing of one dataset (see the module docstring)."""

    root: str
    paths: list[str]
    targets: list[int]
    sizes: list[int]
    mtimes: list[float]
    classes: list[str]
    class_to_idx: dict[str, int]
    fingerprint: str = ""
    ignored: dict[str, int] = field(default_factory=dict)
    # recorded for cheap revalidation: relative dir (or list file) -> [mtime, entry count]
    dirstate: dict[str, list[float]] = field(default_factory=dict)
    kind: str = "folder"  # "folder" or "list"
    listed: str = ""  # the URL that was listed: ``root`` itself, or the .txt/.csv file for a list

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = self.compute_fingerprint()
        if not self.listed:
            self.listed = self.root

    def __len__(self) -> int:
        return len(self.paths)

    def compute_fingerprint(self) -> str:
        h = xxhash.xxh3_64()
        h.update("\x1f".join(self.classes).encode("utf-8") + b"\x1e")
        for p, s, m, t in zip(self.paths, self.sizes, self.mtimes, self.targets):
            h.update(f"{p}\x1f{s}\x1f{m:.6f}\x1f{t}\x1e".encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, source: str, *, storage_options: dict | None = None, persist_dir: str | None = None,
              revalidate: str = "dirs") -> Manifest:
        """List ``source`` (ImageFolder tree or .txt/.csv list), reusing a persisted copy when valid."""
        if revalidate not in REVALIDATE_CHOICES:
            raise ManifestError(f"revalidate={revalidate!r} is not valid; choose one of "
                                f"{', '.join(REVALIDATE_CHOICES)}")
        fs, path, url = _open_fs(source, storage_options)
        try:
            info = fs.info(path)
        except FileNotFoundError as e:
            raise ManifestError(f"{url}: dataset source does not exist; pass an ImageFolder directory "
                                "(root/<class>/<image>) or a .txt/.csv file list that exists") from e
        except OSError as e:
            raise ManifestError(f"{url}: cannot stat the dataset source ({e}); check the path, "
                                "permissions and storage_options") from e
        saved_path = cls.persist_path(persist_dir, url) if persist_dir else None
        if saved_path and os.path.exists(saved_path):
            old = cls._try_load(saved_path, url)
            if old is not None and old._still_valid(fs, path, revalidate):
                log.info("manifest %s: reusing %s (%d files, revalidate=%s)", url, saved_path, len(old),
                         revalidate)
                return old
        if info.get("type") == "directory":
            man = cls._from_folder(fs, path, url)
        elif path.lower().endswith(LIST_EXTENSIONS):
            man = cls._from_list(fs, path, url, info)
        else:
            raise ManifestError(f"{url}: not a directory nor a .txt/.csv file list; pass an ImageFolder "
                                "root directory or a file list")
        if not man.paths:
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
    def _from_folder(cls, fs: fsspec.AbstractFileSystem, path: str, url: str) -> Manifest:
        ignored: dict[str, int] = {}
        dirstate: dict[str, list[float]] = {}
        top = fs.ls(path, detail=True)
        dirstate[""] = [_mtime(fs.info(path)), float(len(top))]
        classes = sorted(posixpath.basename(e["name"].rstrip("/")) for e in top if e["type"] == "directory")
        n_outside = sum(1 for e in top if e["type"] != "directory")
        if n_outside:
            ignored["outside_class"] = n_outside
        class_to_idx = {c: i for i, c in enumerate(classes)}
        entries: list[tuple[str, str, int, float, int]] = []
        for c in classes:
            cdir = posixpath.join(path, c)
            found = fs.find(cdir, withdirs=True, detail=True)
            subdirs = [cdir] + [n for n, i in found.items() if i["type"] == "directory" and n != cdir]
            counts = dict.fromkeys(subdirs, 0)
            for n in found:
                parent = posixpath.dirname(n)
                if n != cdir and parent in counts:
                    counts[parent] += 1
            for d in subdirs:  # (mtime, entry count) per directory, from the walk itself
                rel = posixpath.relpath(d, path)
                dirstate[rel] = [_mtime(found.get(d) or fs.info(d)), float(counts[d])]
            n_before = len(entries)
            for name, i in found.items():
                if i["type"] == "directory":
                    continue
                rel = posixpath.relpath(name, path)
                if not is_image(name):
                    ignored["non_image"] = ignored.get("non_image", 0) + 1
                    continue
                entries.append((posixpath.dirname(rel), posixpath.basename(rel), int(i.get("size") or 0),
                                _mtime(i), class_to_idx[c]))
            if len(entries) == n_before:
                ignored["empty_class"] = ignored.get("empty_class", 0) + 1
                log.warning("manifest %s: class folder %r has no images; it keeps class index %d",
                            url, c, class_to_idx[c])
        entries.sort(key=lambda e: (e[0], e[1]))  # torchvision: sorted(os.walk) then sorted(fnames)
        return cls(root=url, paths=[posixpath.join(d, n) for d, n, *_ in entries],
                   targets=[e[4] for e in entries], sizes=[e[2] for e in entries],
                   mtimes=[e[3] for e in entries], classes=classes, class_to_idx=class_to_idx,
                   ignored=ignored, dirstate=dirstate, kind="folder")

    @classmethod
    def _from_list(cls, fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict) -> Manifest:
        base = posixpath.dirname(path)
        text = fs.cat_file(path).decode("utf-8-sig")
        rows: list[tuple[str, str | None]] = []
        for n, line in enumerate(text.splitlines()):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split(",")]
            if n == 0 and parts[0].lower() in ("path", "relpath", "file", "filename"):
                continue
            rows.append((parts[0].lstrip("/"), parts[1] if len(parts) > 1 and parts[1] else None))
        labels = [lab for _, lab in rows]
        if any(lab is None for lab in labels):
            names = [r.split("/", 1)[0] for r, _ in rows]
            classes = sorted(set(names))
            idx = {c: i for i, c in enumerate(classes)}
            targets_all = [idx[nm] for nm in names]
        elif all(lab.lstrip("-").isdigit() for lab in labels if lab is not None):
            ints = [int(lab) for lab in labels if lab is not None]
            if min(ints, default=0) < 0:
                raise ManifestError(f"{url}: negative label in file list")
            classes = [str(i) for i in range(max(ints, default=-1) + 1)]
            targets_all = ints
        else:
            classes = sorted({lab for lab in labels if lab is not None})
            idx = {c: i for i, c in enumerate(classes)}
            targets_all = [idx[lab] for lab in labels if lab is not None]
        # one directory listing per distinct parent dir instead of one stat per file
        listings: dict[str, dict[str, dict]] = {}
        dirstate: dict[str, list[float]] = {"": [_mtime(info), float(info.get("size") or 0)]}
        paths, targets, sizes, mtimes = [], [], [], []
        ignored: dict[str, int] = {}
        for (rel, _), t in zip(rows, targets_all):
            d = posixpath.dirname(rel)
            if d not in listings:
                full_d = posixpath.join(base, d) if d else base
                try:
                    ents = fs.ls(full_d, detail=True)
                    listings[d] = {posixpath.basename(e["name"].rstrip("/")): e for e in ents}
                    dirstate["dir:" + d] = [_mtime(fs.info(full_d)), float(len(ents))]
                except FileNotFoundError:
                    listings[d] = {}
            ent = listings[d].get(posixpath.basename(rel))
            if ent is None:
                ignored["missing"] = ignored.get("missing", 0) + 1
                log.warning("manifest %s: listed file %r does not exist; skipped", url, rel)
                continue
            if not is_image(rel):
                ignored["non_image"] = ignored.get("non_image", 0) + 1
                continue
            paths.append(rel)
            targets.append(t)
            sizes.append(int(ent.get("size") or 0))
            mtimes.append(_mtime(ent))
        # root = the directory the listed paths are relative to, so Source(root).read(path) works
        return cls(root=fs.unstrip_protocol(base), paths=paths, targets=targets, sizes=sizes, mtimes=mtimes,
                   classes=classes, class_to_idx={c: i for i, c in enumerate(classes)}, ignored=ignored,
                   dirstate=dirstate, kind="list", listed=url)

    # ------------------------------------------------------------ revalidate
    def _still_valid(self, fs: fsspec.AbstractFileSystem, path: str, mode: str) -> bool:
        if mode == "none":
            return True
        if mode == "dirs" and self.dirstate and all(v[0] for v in self.dirstate.values()):
            try:
                return all(self._dir_state(fs, path, k) == v for k, v in self.dirstate.items())
            except OSError:
                return False
        # "full" (or no usable directory mtimes): re-list and compare fingerprints
        if self.kind == "folder":
            fresh = self._from_folder(fs, path, self.root)
        else:
            fresh = self._from_list(fs, path, self.listed, fs.info(path))
        return fresh.fingerprint == self.fingerprint

    def _dir_state(self, fs: fsspec.AbstractFileSystem, path: str, key: str) -> list[float]:
        if self.kind == "list":
            if key == "":
                i = fs.info(path)
                return [_mtime(i), float(i.get("size") or 0)]
            d = key[4:]
            full = posixpath.join(posixpath.dirname(path), d) if d else posixpath.dirname(path)
        else:
            full = posixpath.join(path, key) if key else path
        return [_mtime(fs.info(full)), float(len(fs.ls(full, detail=False)))]

    # ---------------------------------------------------------- persistence
    @staticmethod
    def persist_path(persist_dir: str, url: str) -> str:
        """File in ``persist_dir`` holding the manifest of ``url``."""
        if persist_dir.startswith("file://"):
            persist_dir = persist_dir[len("file://"):]
        return os.path.join(persist_dir, f"manifest-{xxhash.xxh3_64_hexdigest(url.encode())}.msgpack")

    def to_dict(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "root": self.root, "paths": self.paths, "targets": self.targets,
                "sizes": self.sizes, "mtimes": self.mtimes, "classes": self.classes,
                "fingerprint": self.fingerprint, "ignored": self.ignored, "dirstate": self.dirstate,
                "kind": self.kind, "listed": self.listed}

    def save(self, path: str) -> None:
        """Write a msgpack copy atomically (temp file + rename: concurrent jobs never see half a file)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(self.to_dict(), use_bin_type=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Manifest:
        """Read a copy written by :meth:`save`; raises ManifestError if it is not one."""
        try:
            with open(path, "rb") as f:
                d = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
            if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT:
                raise ValueError("unknown format")
            classes = list(d["classes"])
            man = cls(root=d["root"], paths=list(d["paths"]), targets=list(d["targets"]),
                      sizes=list(d["sizes"]), mtimes=[float(m) for m in d["mtimes"]], classes=classes,
                      class_to_idx={c: i for i, c in enumerate(classes)}, fingerprint="",
                      ignored=dict(d["ignored"]), dirstate={k: list(v) for k, v in d["dirstate"].items()},
                      kind=d.get("kind", "folder"), listed=d.get("listed", ""))
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

    def class_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.classes, 0)
        for t in self.targets:
            counts[self.classes[t]] += 1
        return counts
