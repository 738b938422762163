"""File lists (``.txt``/``.csv``): the one set of rules for every reader of one.

``CachedImageNet``, ``datacache warm``, the daemon's listing and its ``POST /datasets`` check all read a
list through :func:`iter_list_rows`: one ``relpath`` or ``relpath,label`` per line, relative to the list's
directory (``#`` comments, blank lines and a ``path,label`` header on line 1 skipped). An entry that
could name a file elsewhere (:func:`list_entry_problem`) and a numeric label beyond
``max(rows, MIN_LABEL_BOUND)`` (:class:`LabelCheck`) are a :class:`~datacache.listing.ManifestError`
naming the list's 1-based line. :func:`list_file` lists a list's files (one concurrent directory listing
per parent directory); :func:`validate_file_list` checks a whole list streamed, at most
:data:`MAX_LIST_BYTES`, before anything is registered.
"""

from __future__ import annotations

import codecs
import logging
import posixpath
import re
import time
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec

from datacache.listing import (
    LIST_EXTENSIONS,
    Block,
    Listing,
    ManifestError,
    is_image,
    map_concurrent,
    mtime_of,
    open_source_fs,
)

log = logging.getLogger("datacache.manifest")

# File lists (``.txt``/``.csv``): one rule for every reader (CachedImageNet, warm, the daemon's listing and
# its POST /datasets check). An entry is a path RELATIVE to the list's directory; anything that could name
# a file elsewhere is refused with the list's 1-based line number. Messages never quote the entry or a
# label: a list is file content (a registered "list" could be any file under allowed_sources).
LIST_HEADER_NAMES = ("path", "relpath", "file", "filename")
MIN_LABEL_BOUND = 65_536  # numeric labels must be < max(rows, this): ImageNet-21k's 21,841 classes fit
_INT_LABEL = re.compile(r"-?[0-9]+")  # ASCII digits only (str.isdigit also takes "²", which int() refuses)
_DRIVE = re.compile(r"[A-Za-z]:")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # universal newlines: the line numbers an editor shows


def list_entry_problem(rel: str) -> str | None:
    """Why a file-list entry is refused, or None when it is a plain relative path: absolute (``/x``,
    ``C:\\x``, ``C:x``), a URL or chained URL (``scheme://``, ``::``), a ``..`` segment anywhere, a NUL or a
    backslash (a Windows separator, or an escape some servers decode)."""
    if not (rel[:1] == "/" or ".." in rel or ":" in rel or "\\" in rel or "\x00" in rel):
        return None  # the common case, in one pass of cheap tests (a list may have millions of lines)
    if "\x00" in rel:
        return "the entry contains a NUL character"
    if "\\" in rel:
        return "the entry contains a backslash (separate directories with '/')"
    if "://" in rel or "::" in rel:
        return "the entry is a URL; entries must be paths relative to the list's directory"
    if rel.startswith("/") or _DRIVE.match(rel):
        return "the entry is an absolute path; entries must be relative to the list's directory"
    if ".." in rel.split("/"):
        return "the entry climbs out of the list's directory (a '..' path segment)"
    return None


class LabelCheck:
    """Streaming checks of a list's labels: negative and too-large numeric labels, with the line that holds
    them. Numeric labels are used as class indices, so the class list is ``range(max label + 1)``: the
    bound keeps one line (``x.jpg,20000000``) from costing gigabytes (20M class names)."""

    def __init__(self) -> None:
        self.rows = 0
        self.numeric = True  # every row has an integer label (else: class names, or the first path part)
        self.max, self.max_line = -1, 0
        self.min, self.min_line = 0, 0

    def add(self, label: str | None, line: int) -> None:
        self.rows += 1
        if not self.numeric:
            return
        if label is None or not _INT_LABEL.fullmatch(label):
            self.numeric = False
            return
        # at most 18 digits through int(): a 5,000-digit label would raise (Python's int-conversion limit)
        v = int(label) if len(label) <= 18 else (-1 if label.startswith("-") else 1) * 10**18
        if v > self.max:
            self.max, self.max_line = v, line
        if v < self.min:
            self.min, self.min_line = v, line

    @property
    def bound(self) -> int:
        return max(self.rows, MIN_LABEL_BOUND)

    def check(self, url: str) -> None:
        """ManifestError naming the line of a negative or too-large numeric label."""
        if not self.numeric or not self.rows:
            return
        if self.min < 0:
            raise ManifestError(f"{url}: line {self.min_line}: negative label; numeric labels are class "
                                "indices 0, 1, 2, ...")
        if self.max >= self.bound:
            raise ManifestError(f"{url}: line {self.max_line}: numeric label too large: labels must be < "
                                f"max(number of rows, {MIN_LABEL_BOUND}) = {self.bound} (they are class "
                                "indices); renumber the classes 0..n-1, or write class names instead of "
                                "numbers")


def iter_list_rows(lines: Iterable[str], url: str, labels: LabelCheck | None = None
                   ) -> Iterator[tuple[str, str | None, int]]:
    """``(relpath, label or None, line number)`` of each entry of a file list given line by line (``#``
    comments, blank lines and a ``path,label`` header on line 1 skipped); ManifestError naming the line of
    the first refused entry (:func:`list_entry_problem`). ``labels`` is fed every row."""
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if n == 1 and parts[0].lower() in LIST_HEADER_NAMES:
            continue
        rel = parts[0]
        why = list_entry_problem(rel)
        if why is not None:
            raise ManifestError(f"{url}: line {n}: {why}; fix or remove that line")
        label = parts[1] if len(parts) > 1 and parts[1] else None
        if labels is not None:
            labels.add(label, n)
        yield rel, label, n


def split_lines(text: str) -> list[str]:
    """``text``'s lines as an editor numbers them (``\\n``, ``\\r\\n`` or ``\\r``)."""
    return _LINE_BREAK.split(text)


def parse_list(text: str, url: str = "file list") -> tuple[list[tuple[str, str | None]], array]:
    """Rows ``(relpath, label)`` of a whole list and their line numbers (compact: 4 bytes a row)."""
    check = LabelCheck()
    rows: list[tuple[str, str | None]] = []
    line_of = array("I")
    for rel, label, n in iter_list_rows(split_lines(text), url, check):
        rows.append((rel, label))
        line_of.append(n)
    check.check(url)
    return rows, line_of


def labels_of(rows: list[tuple[str, str | None]], url: str) -> tuple[list[str], list[int]]:
    """Classes and targets (rows already passed :class:`LabelCheck`: numeric labels are bounded)."""
    labels = [lab for _, lab in rows]
    if any(lab is None for lab in labels):
        names = [r.split("/", 1)[0] for r, _ in rows]
        classes = sorted(set(names))
        idx = {c: i for i, c in enumerate(classes)}
        return classes, [idx[nm] for nm in names]
    if all(_INT_LABEL.fullmatch(lab) for lab in labels if lab is not None):
        ints = [int(lab) for lab in labels if lab is not None]
        return [str(i) for i in range(max(ints, default=-1) + 1)], ints
    classes = sorted({lab for lab in labels if lab is not None})
    idx = {c: i for i, c in enumerate(classes)}
    return classes, [idx[lab] for lab in labels if lab is not None]


def list_file(fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict, *,
              workers: int = 32) -> Listing:
    """Read a .txt/.csv file list; one (concurrent) directory listing per distinct parent directory."""
    base = posixpath.dirname(path)
    out = Listing(listed_at=time.time())
    rows, line_of = parse_list(fs.cat_file(path).decode("utf-8-sig"), url)
    out.classes, targets = labels_of(rows, url)
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
    rels: list[str] = []
    tgts: list[int] = []
    infos: list[dict] = []
    for k, ((rel, _), t) in enumerate(zip(rows, targets)):
        ent = listings[posixpath.dirname(rel)][0].get(posixpath.basename(rel))
        if ent is None:
            out.count("missing")
            # the line, not the entry: a list's text is file content (module note above _parse_list)
            log.warning("manifest %s: the file listed on line %d does not exist; skipped", url, line_of[k])
            continue
        if not is_image(rel):
            out.count("non_image")
            continue
        rels.append(rel)
        tgts.append(t)
        infos.append(ent)
    out.blocks.append(Block.of(rels, tgts, infos))
    return out


MAX_LIST_BYTES = 1 << 30  # what validate_file_list reads at most (ImageNet-21k's 14M-line list: ~0.6 GB)


def validate_file_list(source: str, *, storage_options: dict | None = None,
                       max_bytes: int = MAX_LIST_BYTES) -> int:
    """When ``source`` is a ``.txt``/``.csv`` file list: read it (streamed, at most ``max_bytes``) and apply
    the listing's own rules to every line (:func:`iter_list_rows`, the label bound);
    returns its number of entries, 0 for any other source (a directory, a path that is not a list).
    Raises :class:`ManifestError` naming the line and the reason -- never the line's text -- or saying
    that the list cannot be read or is larger than ``max_bytes``. The cache daemon runs it on
    ``POST /datasets`` (after the ``allowed_sources`` check), so a bad list is refused at registration."""
    fs, path, url = open_source_fs(source, storage_options)
    if not path.lower().endswith(LIST_EXTENSIONS):
        return 0
    try:
        info = fs.info(path)
        if info.get("type") == "directory":
            return 0
        size = info.get("size")
        if isinstance(size, (int, float)) and size > max_bytes:
            raise ManifestError(f"{url}: the file list is {int(size)} bytes, more than the {max_bytes} bytes "
                                "checked here; split it, or list the dataset in the daemon's config file")
        check = LabelCheck()
        rows = 0
        with fs.open(path, "rb") as f:
            for _ in iter_list_rows(_stream_lines(f, max_bytes, url), url, check):
                rows += 1
        check.check(url)
    except ManifestError:
        raise
    except Exception as e:  # not found, permission, network: the type only (no file content in errors)
        raise ManifestError(f"{url}: cannot read the file list ({type(e).__name__}); check that it exists "
                            "and is readable by the daemon") from None
    return rows


def _stream_lines(f: Any, max_bytes: int, url: str) -> Any:
    """The lines of a binary file, decoded as UTF-8 (a BOM skipped), split like
    :func:`split_lines`; ManifestError past ``max_bytes`` or on invalid UTF-8. Holds one
    1 MiB chunk (and a partial line) at a time."""
    dec = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    carry, total = "", 0
    while True:
        chunk = f.read(1 << 20)
        total += len(chunk)
        if total > max_bytes:
            raise ManifestError(f"{url}: the file list is larger than the {max_bytes} bytes checked here; "
                                "split it, or list the dataset in the daemon's config file")
        try:
            text = carry + dec.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            raise ManifestError(f"{url}: the file list is not UTF-8 text (byte {total - len(chunk)} onwards)"
                                ) from None
        if not chunk:
            yield from split_lines(text) if text else ()
            return
        lines = split_lines(text)
        # the last piece may be an unfinished line; a trailing "\r" may be half of "\r\n"
        carry = lines.pop()
        if text.endswith("\r") and not carry:
            carry = lines.pop() + "\r"
        yield from lines
