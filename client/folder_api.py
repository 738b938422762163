"""torchvision's ImageFolder / DatasetFolder surface for :class:`client.dataset.CachedImageNet`.

What lives here (the dataset class wires it in):

* :func:`find_classes` / :func:`make_dataset` -- torchvision's functions, same signatures and rules
  (sorted class folders, ``sorted(os.walk(..., followlinks=True))``, ``extensions`` xor ``is_valid_file``,
  ``FileNotFoundError`` for empty classes unless ``allow_empty``), for local paths and fsspec URLs. The
  dataset itself lists through the manifest (:mod:`datacache.listing`, same order); these run only when
  a user calls them or a subclass overrides them.
* :func:`default_loader` / :func:`pil_loader` and :func:`check_loader`: which ``loader=`` the cache can
  stand in for (torchvision's ``default_loader``/``pil_loader`` or these: Pillow decodes; the cache stores
  Pillow-decoded variants) and the refusal, with the reason, for any other.
* :class:`StandardTransform` -- what torchvision's ``VisionDataset.transforms`` holds.
* :class:`Selection` + :class:`PathIndex` -- assigned or filtered ``samples``: position -> manifest index
  (+ the label of the assigned pair), so cache keys follow the sample's path, never its position.
* :class:`SamplesView` -- ``samples`` / ``imgs`` as a read-only sequence of ``(path, label)`` built on
  access (no list of 1.28M tuples is held or pickled into workers).
* :func:`pil_image` -- the PIL image over a record's pixels handed to ImageFolder-style transforms.
"""

from __future__ import annotations

import itertools
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from PIL import Image

from datacache.config import ConfigError
from datacache.listing import IMG_EXTENSIONS
from datacache.redact import redact

__all__ = ["IMG_EXTENSIONS", "PathIndex", "SamplesView", "Selection", "StandardTransform", "check_loader",
           "default_loader", "find_classes", "make_dataset", "pil_image", "pil_loader"]


# ------------------------------------------------------------------ listing helpers (torchvision's rules)
def _is_url(path: str) -> bool:
    return "://" in path


def find_classes(directory: str | os.PathLike[str], storage_options: dict | None = None
                 ) -> tuple[list[str], dict[str, int]]:
    """torchvision's ``find_classes``: the sorted sub-directory names of ``directory`` and their indices;
    FileNotFoundError when there is none. Local paths use ``os.scandir`` (as torchvision), URLs fsspec."""
    d = os.fspath(directory)
    if _is_url(d):
        import fsspec

        fs, path = fsspec.core.url_to_fs(d, **(storage_options or {}))
        classes = sorted(os.path.basename(e["name"].rstrip("/")) for e in fs.ls(path, detail=True)
                         if e["type"] == "directory")
    else:
        classes = sorted(e.name for e in os.scandir(d) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {d}.")
    return classes, {c: i for i, c in enumerate(classes)}


def _walk(target_dir: str) -> list[tuple[str, list[str]]]:
    """``[(dir, sorted file names)]`` in ``sorted(os.walk(target_dir, followlinks=True))`` order."""
    if not _is_url(target_dir):
        return [(r, sorted(f)) for r, _, f in sorted(os.walk(target_dir, followlinks=True))]
    import fsspec

    fs, path = fsspec.core.url_to_fs(target_dir)
    out = [(fs.unstrip_protocol(r), sorted(f)) for r, _, f in fs.walk(path)]
    return sorted(out)


def make_dataset(directory: str | os.PathLike[str], class_to_idx: dict[str, int] | None = None,
                 extensions: str | tuple[str, ...] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None,
                 allow_empty: bool = False) -> list[tuple[str, int]]:
    """torchvision's ``make_dataset``: ``(path, class_index)`` of every file of the class folders in
    ``class_to_idx`` that ``extensions`` (a suffix or tuple of suffixes, case-insensitive) or
    ``is_valid_file(path)`` accepts -- exactly one of them -- in torchvision's order; a class without any
    such file raises FileNotFoundError naming it unless ``allow_empty``."""
    directory = os.path.expanduser(os.fspath(directory))
    if class_to_idx is None:
        _, class_to_idx = find_classes(directory)
    elif not class_to_idx:
        raise ValueError("'class_to_index' must have at least one entry to collect any samples.")
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    if extensions is not None:
        suffixes = (extensions,) if isinstance(extensions, str) else tuple(extensions)

        def is_valid_file(x: str) -> bool:
            return x.lower().endswith(suffixes)

    is_valid_file = cast(Callable[[str], bool], is_valid_file)
    instances: list[tuple[str, int]] = []
    available: set[str] = set()
    for target_class in sorted(class_to_idx):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not (_is_url(target_dir) or os.path.isdir(target_dir)):
            continue
        for root, fnames in _walk(target_dir):
            for fname in fnames:
                path = os.path.join(root, fname)
                if is_valid_file(path):
                    instances.append((path, class_index))
                    available.add(target_class)
    empty = set(class_to_idx) - available
    if empty and not allow_empty:
        raise FileNotFoundError(empty_classes_message(empty, extensions))
    return instances


def empty_classes_message(empty: Iterable[str], extensions: str | tuple[str, ...] | None) -> str:
    """torchvision's message for class folders without a valid file, plus what to do."""
    msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
    if extensions is not None:
        msg += ("Supported extensions are: "
                f"{extensions if isinstance(extensions, str) else ', '.join(extensions)}")
    return msg + " (pass allow_empty=True to keep such classes with no samples, as torchvision does)"


# ------------------------------------------------------------------ loaders
def pil_loader(path: str | os.PathLike[str]) -> Image.Image:
    """torchvision's ``pil_loader``: the file opened with Pillow, converted to RGB (fsspec URLs too)."""
    p = os.fspath(path)
    if _is_url(p):
        import fsspec

        with fsspec.open(p, "rb") as f:
            return Image.open(f).convert("RGB")
    with open(p, "rb") as f:
        return Image.open(f).convert("RGB")


def default_loader(path: str | os.PathLike[str]) -> Image.Image:
    """torchvision's ``default_loader`` without accimage: :func:`pil_loader`."""
    return pil_loader(path)


_PIL_LOADERS = {(m, n) for m in ("torchvision.datasets.folder", __name__)
                for n in ("default_loader", "pil_loader")}


def check_loader(loader: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """The loader to expose as ``ds.loader``: ``loader`` when the cache can stand in for it (a Pillow RGB
    loader: torchvision's ``default_loader``/``pil_loader`` or this module's), else ConfigError saying why
    and what to do."""
    if loader is None:
        return default_loader
    ident = (getattr(loader, "__module__", None), getattr(loader, "__qualname__", None))
    if ident in _PIL_LOADERS:
        return loader
    name = f"{ident[0]}.{ident[1]}" if ident[1] else repr(type(loader).__name__)
    raise ConfigError(
        f"loader={name} cannot be served from the cache: CachedImageNet stores each image decoded by Pillow "
        "(RGB) and resized to the cached variant (datacache.decode), so a custom loader's output is never "
        "what it returns. Drop loader= (transforms receive a PIL RGB image, as with torchvision's "
        "default_loader), move the custom step into transform=, or keep torchvision's ImageFolder for "
        "this loader")


# ------------------------------------------------------------------ transforms
class StandardTransform:
    """torchvision's ``StandardTransform``: ``(x, y) -> (transform(x), target_transform(y))``."""

    def __init__(self, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None) -> None:
        self.transform = transform
        self.target_transform = target_transform

    def __call__(self, input: Any, target: Any) -> tuple[Any, Any]:
        if self.transform is not None:
            input = self.transform(input)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return input, target

    def __repr__(self) -> str:
        body = [type(self).__name__]
        for head, t in (("Transform: ", self.transform), ("Target transform: ", self.target_transform)):
            if t is not None:
                lines = repr(t).splitlines()
                body += [f"{head}{lines[0]}"] + [" " * len(head) + line for line in lines[1:]]
        return "\n".join(body)


def pil_image(pixels: np.ndarray) -> Image.Image:
    """A PIL RGB image of a record's HWC uint8 pixels, without decoding anything.

    The pixels are usually a read-only view into a store buffer. Pillow keeps RGB as 4 bytes per pixel
    (RGBX), so it cannot map a 3-byte-per-pixel buffer (``Image.frombuffer`` maps only L/P/I;16): the
    image is built by one copy into Pillow's own memory, and writing to it (``paste``, ``putpixel``, an
    in-place transform) can never reach the cached record."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected HWC uint8 RGB pixels, got {pixels.dtype} {pixels.shape}")
    h, w = int(pixels.shape[0]), int(pixels.shape[1])
    return Image.frombuffer("RGB", (w, h), np.ascontiguousarray(pixels), "raw", "RGB", 0, 1)


# ------------------------------------------------------------------ samples: positions -> manifest indices
@dataclass
class Selection:
    """Assigned / filtered samples: ``index[k]`` is the manifest index of position ``k``; ``labels[k]`` the
    label of its pair (None: every label equals the manifest's)."""

    index: np.ndarray  # int64
    labels: np.ndarray | None  # int64


class PathIndex:
    """``relative path -> manifest index`` for a manifest's packed paths: the paths' hashes sorted once
    (16 bytes per file; built in the process that assigns ``samples``, never pickled: ``hash`` of a str
    differs between processes), a hit confirmed by comparing the path's bytes (a hash collision can never
    map a path to another file)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = paths
        hashes = np.fromiter((hash(p) for p in paths), dtype=np.int64, count=len(paths))
        self.order = np.argsort(hashes, kind="stable")
        self.sorted = hashes[self.order]

    def find(self, rel: str) -> int:
        """The manifest index of ``rel``, or -1."""
        return int(self.find_many([rel])[0])

    def _slow(self, rel: str, h: int) -> int:
        """Every entry with hash ``h``, compared as strings (hash collisions)."""
        k = int(np.searchsorted(self.sorted, h))
        while k < len(self.sorted) and int(self.sorted[k]) == h:
            i = int(self.order[k])
            if self.paths[i] == rel:
                return i
            k += 1
        return -1

    def find_many(self, rels: Sequence[str]) -> np.ndarray:
        """The manifest index of each of ``rels`` (-1 where absent), batched: one ``searchsorted`` for all,
        then a byte comparison per path against the packed blob (no string is built)."""
        n = len(rels)
        out = np.full(n, -1, dtype=np.int64)
        if not n or not len(self.sorted):
            return out
        h = np.fromiter((hash(r) for r in rels), dtype=np.int64, count=n)
        k = np.minimum(np.searchsorted(self.sorted, h), len(self.sorted) - 1)
        hit = self.sorted[k] == h
        out[hit] = self.order[k[hit]]
        blob = getattr(self.paths, "blob", None)
        offsets = getattr(self.paths, "offsets", None)
        cand = out.tolist()
        if blob is not None and offsets is not None:  # PackedStrings: compare bytes in place
            mem = memoryview(np.ascontiguousarray(blob)).cast("B")
            safe = np.maximum(out, 0)
            starts, ends = offsets[safe].tolist(), offsets[safe + 1].tolist()
            for j, (c, a, b, rel) in enumerate(zip(cand, starts, ends, rels)):
                if c >= 0 and mem[a:b] != rel.encode("utf-8", "surrogateescape"):
                    out[j] = self._slow(rel, int(h[j]))
        else:
            for j, (c, rel) in enumerate(zip(cand, rels)):
                if c >= 0 and self.paths[c] != rel:
                    out[j] = self._slow(rel, int(h[j]))
        return out


def _label(value: Any, where: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise ConfigError(f"{where}: the label must be an int class index, got {type(value).__name__}; "
                          "map other labels with target_transform=")
    return int(value)


def select(pairs: Iterable[Any], prefixes: Sequence[str], lookup: Callable[[], PathIndex],
           manifest_labels: np.ndarray, root: str) -> Selection:
    """The :class:`Selection` of assigned ``(path, label)`` pairs. A path must name a file of the listing
    (under one of ``prefixes``: the root as given, or its absolute form); anything else is a ConfigError
    with the position, the path and the reason."""
    rels: list[str] = []
    labels: list[int] = []
    shown: list[str] = []
    for k, pair in enumerate(pairs):
        where = f"samples[{k}]"
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ConfigError(f"{where}: expected a (path, class_index) pair as in torchvision's "
                              f"ImageFolder, got {type(pair).__name__}")
        path, label = pair
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"{where}: the path must be a str or os.PathLike, got {type(path).__name__}")
        p = os.fspath(path)
        rel = next((p[len(pre):] for pre in prefixes if p.startswith(pre)), None)
        if rel is None:
            what = redact(p) if "://" in p else p  # a URL's userinfo is never printed
            raise ConfigError(f"{where}: {what!r} is not under the dataset root {root!r}; CachedImageNet "
                              "serves only the files it listed there (build another CachedImageNet for other "
                              "files)")
        rels.append(rel)
        shown.append(p)
        labels.append(_label(label, where))
    idx = lookup().find_many(rels) if rels else np.zeros(0, dtype=np.int64)
    missing = np.flatnonzero(idx < 0)
    if len(missing):
        k = int(missing[0])
        what = redact(shown[k]) if "://" in shown[k] else shown[k]
        raise ConfigError(
            f"samples[{k}]: {what!r} is not in the listing of {root!r} ({len(missing)} such path(s) in all): "
            f"the listing holds files with an image extension ({', '.join(IMG_EXTENSIONS)}) inside class "
            "folders, as of the last (re)validation (a file added since: construct the dataset again, "
            "revalidate='full' after in-place edits)")
    lab = np.asarray(labels, dtype=np.int64)
    same = bool(np.array_equal(lab, manifest_labels[idx])) if len(idx) else True
    return Selection(idx, None if same else lab)


# ------------------------------------------------------------------ the samples view
class SamplesView(Sequence[tuple[str, int]]):
    """``(prefix + path, label)`` pairs built on access, over the manifest's packed paths and an optional
    :class:`Selection` (torchvision's ``ImageFolder.samples`` shape; read-only: assign a new list to
    ``ds.samples`` to change the dataset). ``view + list`` and ``list + view`` give lists."""

    def __init__(self, prefix: str, paths: Sequence[str], labels: np.ndarray,
                 index: np.ndarray | None = None, override: np.ndarray | None = None) -> None:
        self.prefix = prefix
        self.paths = paths
        self.labels = labels
        self.index = index
        self.override = override

    def __len__(self) -> int:
        return len(self.paths) if self.index is None else len(self.index)

    def _one(self, k: int) -> tuple[str, int]:
        i = k if self.index is None else int(self.index[k])
        lab = self.labels[i] if self.override is None else self.override[k]
        return self.prefix + self.paths[i], int(lab)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self._one(j) for j in range(*k.indices(len(self)))]
        n = len(self)
        j = int(k) + n if int(k) < 0 else int(k)
        if not 0 <= j < n:
            raise IndexError(f"samples index {k} out of range for {n} samples")
        return self._one(j)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        if self.index is None:
            return ((self.prefix + p, t) for p, t in zip(self.paths, self.labels.tolist()))
        labs = (self.labels[self.index] if self.override is None else self.override).tolist()
        return ((self.prefix + self.paths[i], t) for i, t in zip(self.index.tolist(), labs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == tuple(b) if isinstance(b, list) else a == b
                                               for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # a mutable-looking sequence, like list

    def __add__(self, other: Iterable[Any]) -> list[Any]:
        return list(itertools.chain(self, other))

    def __radd__(self, other: Iterable[Any]) -> list[Any]:
        return list(itertools.chain(other, self))

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:2])
        return f"SamplesView([{head}{', ...' if len(self) > 2 else ''}], n={len(self)})"
