"""File lists (``.txt``/``.csv``): the one set of rules for every reader of one.

``CachedImageNet``, ``datacache warm``, the daemon's listing and its ``POST /datasets`` check all read a
list through :func:`iter_list_rows`: one ``relpath`` or ``relpath,label`` per line, relative to the list's
directory (``#`` comments, blank lines and a ``path,label`` header on line 1 skipped). An entry that
could name a file elsewhere (:func:`list_entry_problem`) and a numeric label beyond
``max(rows, MIN_LABEL_BOUND)`` (:class:`LabelCheck`) are a :class:`~datacache.listing.ManifestError`
naming the list's 1-based line. :func:`list_file` lists a list's files (one concurrent directory listing
per parent directory); :func:`validate_file_list` checks a whole list streamed before anything is
registered.

Bounds (:class:`ListLimits`, the same for every read of a list: ``POST /datasets``, each daemon pass, a
``daemon.toml`` dataset, ``CachedImageNet``, ``datacache warm``): at most :data:`MAX_LIST_BYTES` (1 GiB)
and :data:`MAX_LIST_LINES` (33,554,432) lines -- ImageNet-21k's 14.2M-line list (~0.6 GB) fits with
room to spare -- and :data:`MAX_LINE_LENGTH` (8,192) characters an entry line. The daemon reads the
first two from ``daemon.toml`` (``max_list_bytes``, ``max_list_lines``). A list is never read whole:
:func:`_stream_lines` reads 1 MiB chunks, linear in the input, and the size is checked before the first
byte and again as the bytes arrive (a list that grew past the limit after registration is refused by
name, size and limit). Rows are kept compact (:class:`ParsedList`: ~20 bytes a row plus the path);
missing entries are one warning per listing (a count and the first lines), not one per entry.
"""

from __future__ import annotations

import codecs
import logging
import posixpath
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from datacache.listing import (
    LIST_EXTENSIONS,
    Block,
    Listing,
    ManifestError,
    is_image,
    map_concurrent,
    mtime_of,
    open_source_fs,
    size_of,
    version_of,
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


# ---------------------------------------------------------------------------------------------- limits
MAX_LIST_BYTES = 1 << 30  # 1 GiB: ImageNet-21k's 14.2M-line list is ~0.6 GB (ImageNet-1k's 1.28M: ~45 MB)
MAX_LIST_LINES = 1 << 25  # 33,554,432 lines: 2.4x ImageNet-21k's 14.2M
MAX_LINE_LENGTH = 8192  # characters of one entry line (Linux's PATH_MAX is 4096); comment lines are exempt
LIST_BYTES_RANGE = (1 << 10, 1 << 34)  # what max_list_bytes may be set to (1 KiB .. 16 GiB)
LIST_LINES_RANGE = (1, (1 << 32) - 1)  # what max_list_lines may be set to (line numbers are 32-bit)
_CHUNK = 1 << 20  # bytes read at a time


@dataclass(frozen=True)
class ListLimits:
    """How much of a file list is read: at most ``max_bytes`` bytes and ``max_lines`` lines (every reader:
    ``POST /datasets``, each daemon pass, a ``daemon.toml`` dataset, ``CachedImageNet``, ``datacache warm``).
    The daemon takes both from ``daemon.toml`` (``max_list_bytes``, ``max_list_lines``)."""

    max_bytes: int = MAX_LIST_BYTES
    max_lines: int = MAX_LIST_LINES

    def __post_init__(self) -> None:
        why = list_limits_problem(self.max_bytes, self.max_lines)
        if why:
            raise ValueError(why)


def list_limits_problem(max_bytes: Any, max_lines: Any) -> str | None:
    """Why ``(max_bytes, max_lines)`` are not valid list limits, or None."""
    for name, v, (lo, hi) in (("max_list_bytes", max_bytes, LIST_BYTES_RANGE),
                              ("max_list_lines", max_lines, LIST_LINES_RANGE)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            return f"'{name}' must be an integer in {lo}..{hi}, got {v!r}"
    return None


def _too_big(url: str, size: int | None, max_bytes: int) -> str:
    what = f"is {size} bytes, more than" if size is not None else "is larger than"
    return (f"{url}: the file list {what} the {max_bytes} bytes allowed (max_list_bytes; a list registered "
            "smaller may have grown since); split it into several lists, or raise max_list_bytes in the "
            "daemon's config file")


# ------------------------------------------------------------------------------------------- streaming
def _stream_lines(f: Any, max_bytes: int, url: str, max_lines: int = MAX_LIST_LINES,
                  max_line: int = MAX_LINE_LENGTH, chunk_size: int = _CHUNK) -> Iterator[str]:
    """The lines of a binary file, decoded as UTF-8 (a BOM skipped), split like :func:`split_lines`;
    ManifestError past ``max_bytes`` bytes or ``max_lines`` lines, on invalid UTF-8, or naming the line of
    an entry longer than ``max_line`` characters. A comment line (``#``) may be longer: it is skipped as it
    streams (yielded as ``"#"``, so the line numbers stay right).

    Linear in the input: each chunk is split once, an unfinished line is kept as pieces (never re-scanned)
    and dropped or refused once it passes ``max_line``; holds one chunk plus one line at a time."""
    dec = codecs.getincrementaldecoder("utf-8-sig")(errors="strict")
    pending: list[str] = []  # pieces of the unfinished line
    pending_len = 0
    comment = False  # the unfinished line is a long comment: its pieces are dropped
    hold = ""  # a "\r" that ended the previous chunk: maybe half of "\r\n"
    total = n = 0

    def finish(line: str) -> str:
        nonlocal n
        n += 1
        if n > max_lines:
            raise ManifestError(f"{url}: the file list has more than {max_lines} lines (max_list_lines); "
                                "split it into several lists, or raise max_list_lines in the daemon's config "
                                "file")
        if len(line) > max_line:
            if _is_comment(line) or not line.strip():
                return "#"
            raise ManifestError(f"{url}: line {n}: longer than {max_line} characters (an entry is a path "
                                "and a label); fix or remove that line")
        return line

    while True:
        chunk = f.read(chunk_size)
        total += len(chunk)
        if total > max_bytes:
            raise ManifestError(_too_big(url, None, max_bytes))
        final = not chunk
        try:
            text = dec.decode(chunk, final=final)
        except UnicodeDecodeError:
            raise ManifestError(f"{url}: the file list is not UTF-8 text (byte {total - len(chunk)} onwards)"
                                ) from None
        if hold:
            text, hold = hold + text, ""  # one character prepended: O(chunk)
        if not final and text.endswith("\r"):
            text, hold = text[:-1], "\r"
        parts = split_lines(text)
        if len(parts) > 1:
            yield finish("#" if comment else "".join(pending) + parts[0])
            pending, pending_len, comment = [], 0, False
            for line in parts[1:-1]:
                yield finish(line)
        last = parts[-1]
        if not comment and last:
            pending.append(last)
            pending_len += len(last)
            if pending_len > max_line:  # decide now, before the line grows: a long comment or an error
                head = "".join(pending)
                if _is_comment(head):
                    pending, pending_len, comment = ["#"], 1, True
                elif head.strip():
                    raise ManifestError(f"{url}: line {n + 1}: longer than {max_line} characters (an entry "
                                        "is a path and a label); fix or remove that line")
                else:  # blank so far: keep nothing
                    pending, pending_len = [], 0
        if final:
            if pending:
                yield finish("".join(pending))
            return


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


# ---------------------------------------------------------------------------------------- the rows kept
@dataclass
class ParsedList:
    """A list's entries in compact form (~20 bytes a row plus the path's UTF-8 bytes; a list of tuples of
    ``str`` cost ~15x the list): the relative paths back to back in one ``bytearray`` with their end
    offsets, each row's 1-based line number, its target (class index) and the class names."""

    blob: bytearray
    ends: array  # "q": end offset of row k's path in blob (row k is blob[ends[k-1]:ends[k]])
    lines: array  # "I": the list's line of each row
    targets: np.ndarray  # int32
    classes: list[str]
    dirs: list[str]  # distinct parent directories of the entries, sorted

    def __len__(self) -> int:
        return len(self.ends)

    def rel(self, k: int) -> str:
        a = self.ends[k - 1] if k else 0
        return self.blob[a:self.ends[k]].decode("utf-8", "surrogateescape")

    def rels(self) -> Iterator[str]:
        blob, a = self.blob, 0
        for b in self.ends:
            yield blob[a:b].decode("utf-8", "surrogateescape")
            a = b


def parse_list(lines: str | Iterable[str], url: str = "file list") -> ParsedList:
    """The rows of a whole list (given as text, or line by line as :func:`_stream_lines` yields them), their
    line numbers and targets: without labels the class is the first path component; integer labels are
    used as given (classes ``0..max``); other labels are class names indexed by sorted name. Streaming:
    memory is the :class:`ParsedList` plus one entry per distinct label and directory."""
    check = LabelCheck()
    blob = bytearray()
    ends = array("q")
    line_of = array("I")
    label_ids: dict[str | None, int] = {}  # label (None: none) -> first-seen id
    lab = array("i")
    dirs: set[str] = set()
    for rel, label, n in iter_list_rows(_iter_split(lines) if isinstance(lines, str) else lines, url, check):
        blob += rel.encode("utf-8", "surrogateescape")
        ends.append(len(blob))
        line_of.append(n)
        lid = label_ids.get(label)
        if lid is None:
            lid = label_ids[label] = len(label_ids)
        lab.append(lid)
        dirs.add(rel.rpartition("/")[0])
    check.check(url)
    ids = np.frombuffer(lab, dtype=np.int32) if len(lab) else np.zeros(0, np.int32)
    out = ParsedList(blob, ends, line_of, ids, [], sorted(dirs))
    if None in label_ids:  # some row has no label: every row's class is its first path component
        comp_ids: dict[str, int] = {}
        comps = array("i")
        for rel in out.rels():
            c = rel.partition("/")[0]
            cid = comp_ids.get(c)
            if cid is None:
                cid = comp_ids[c] = len(comp_ids)
            comps.append(cid)
        out.classes, out.targets = _ranked(comp_ids, np.frombuffer(comps, dtype=np.int32))
    elif check.numeric and label_ids:  # integer labels, bounded by LabelCheck: classes 0..max
        value = np.array([int(k) for k in label_ids if k is not None], dtype=np.int64)
        out.targets = value[ids].astype(np.int32)
        out.classes = [str(i) for i in range(int(value.max()) + 1)]
    else:
        out.classes, out.targets = _ranked(label_ids, ids)  # type: ignore[arg-type]
    return out


def _iter_split(text: str) -> Iterator[str]:
    """:func:`split_lines` one line at a time (no list of every line)."""
    start = 0
    for m in _LINE_BREAK.finditer(text):
        yield text[start:m.start()]
        start = m.end()
    yield text[start:]


def _ranked(first_seen: dict[str, int], ids: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Sorted class names and each row's index among them, from names numbered in first-seen order."""
    names = sorted(first_seen)
    rank = np.empty(len(first_seen), dtype=np.int32)
    for i, name in enumerate(names):
        rank[first_seen[name]] = i
    return names, rank[ids] if len(ids) else np.zeros(0, np.int32)


def read_list(fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict,
              limits: ListLimits | None = None) -> ParsedList:
    """:func:`parse_list` of the list file ``path``, streamed and bounded by ``limits`` (its size as
    ``info`` reports it first, then the bytes and lines really read: a size unknown or stale is no way
    around the limit)."""
    limits = limits or ListLimits()
    size = info.get("size")
    if isinstance(size, (int, float)) and size > limits.max_bytes:
        raise ManifestError(_too_big(url, int(size), limits.max_bytes))
    with fs.open(path, "rb") as f:
        return parse_list(_stream_lines(f, limits.max_bytes, url, limits.max_lines), url)


# ------------------------------------------------------------------------------------- missing entries
MISSING_EXAMPLES = 5  # line numbers quoted in the one warning a listing gives about missing entries
_missing_said: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()  # url -> last summary
_missing_lock = threading.Lock()


def _log_missing(url: str, count: int, first: list[int]) -> None:
    """One WARNING per listing for its missing entries: the count and the first few lines (never the
    entries: a list's text is file content). The same summary for the same list again (an unchanged list
    re-listed every pass) is logged at DEBUG: a list with 100,000 missing files costs one line, once."""
    key = (count, tuple(first))
    with _missing_lock:
        same = _missing_said.get(url) == key
        _missing_said[url] = key
        _missing_said.move_to_end(url)
        while len(_missing_said) > 256:
            _missing_said.popitem(last=False)
    where = (f"line {first[0]}" if count == 1 else
             f"lines {', '.join(map(str, first))}" + (f" and {count - len(first)} more" if count > len(first)
                                                      else ""))
    (log.debug if same else log.warning)(
        "manifest %s: %d listed file(s) do not exist (%s); skipped%s", url, count, where,
        " (unchanged since the last listing)" if same else "")


def list_file(fs: fsspec.AbstractFileSystem, path: str, url: str, info: dict, *,
              workers: int = 32, limits: ListLimits | None = None) -> Listing:
    """Read a .txt/.csv file list (bounded by ``limits``: :func:`read_list`); one (concurrent) directory
    listing per distinct parent directory; missing entries counted in ``ignored["missing"]`` and logged as
    one summary (:func:`_log_missing`)."""
    base = posixpath.dirname(path)
    out = Listing(listed_at=time.time())
    parsed = read_list(fs, path, url, info, limits)
    out.classes = parsed.classes
    out.dirstate[""] = [mtime_of(info), float(info.get("size") or 0)]

    def listdir(d: str) -> tuple[dict[str, tuple[int, float, int]], list[float] | None]:
        full_d = posixpath.join(base, d) if d else base
        try:
            ents = fs.ls(full_d, detail=True)
        except FileNotFoundError:
            return {}, None
        # (size, mtime, version) only: the fsspec info dicts (~1 KB a file) are not kept
        return ({posixpath.basename(e["name"].rstrip("/")): (size_of(e), mtime_of(e), version_of(e))
                 for e in ents}, [mtime_of(fs.info(full_d)), float(len(ents))])

    listings = dict(zip(parsed.dirs, map_concurrent(listdir, parsed.dirs, workers=workers)))
    for d, (_, state) in listings.items():
        if state is not None:
            out.dirstate["dir:" + d] = state
    blob = bytearray()
    lengths, sizes, mtimes, versions, keep = array("q"), array("q"), array("d"), array("Q"), array("q")
    missing: list[int] = []
    n_missing = 0
    for k, rel in enumerate(parsed.rels()):
        d, _, name = rel.rpartition("/")
        ent = listings[d][0].get(name)
        if ent is None:
            n_missing += 1
            if len(missing) < MISSING_EXAMPLES:
                missing.append(parsed.lines[k])
            continue
        if not is_image(rel):
            out.count("non_image")
            continue
        enc = rel.encode("utf-8", "surrogateescape")
        blob += enc
        lengths.append(len(enc))
        sizes.append(ent[0])
        mtimes.append(ent[1])
        versions.append(ent[2])
        keep.append(k)
    del listings
    if n_missing:
        out.count("missing", n_missing)
        _log_missing(url, n_missing, missing)
    out.blocks.append(Block(bytes(blob), _np(lengths, np.int64),
                            parsed.targets[_np(keep, np.int64)].astype(np.int32), _np(sizes, np.int64),
                            _np(mtimes, np.float64), _np(versions, np.uint64)))
    return out


def _np(a: array, dtype: Any) -> np.ndarray:
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)


def validate_file_list(source: str, *, storage_options: dict | None = None,
                       max_bytes: int = MAX_LIST_BYTES, max_lines: int = MAX_LIST_LINES) -> int:
    """When ``source`` is a ``.txt``/``.csv`` file list: read it (streamed, at most ``max_bytes`` and
    ``max_lines``: the same :class:`ListLimits` as every listing of it) and apply the listing's own rules to
    every line (:func:`iter_list_rows`, the label bound); returns its number of entries, 0 for any other
    source (a directory, a path that is not a list). Raises :class:`ManifestError` naming the line and the
    reason -- never the line's text -- or saying that the list cannot be read or is over a limit. The cache
    daemon runs it on ``POST /datasets`` (after the ``allowed_sources`` check), so a bad list is refused at
    registration. Memory: one chunk and one line (no row is kept)."""
    fs, path, url = open_source_fs(source, storage_options)
    if not path.lower().endswith(LIST_EXTENSIONS):
        return 0
    try:
        info = fs.info(path)
        if info.get("type") == "directory":
            return 0
        size = info.get("size")
        if isinstance(size, (int, float)) and size > max_bytes:
            raise ManifestError(_too_big(url, int(size), max_bytes))
        check = LabelCheck()
        rows = 0
        with fs.open(path, "rb") as f:
            for _ in iter_list_rows(_stream_lines(f, max_bytes, url, max_lines), url, check):
                rows += 1
        check.check(url)
    except ManifestError:
        raise
    except Exception as e:  # not found, permission, network: the type only (no file content in errors)
        raise ManifestError(f"{url}: cannot read the file list ({type(e).__name__}); check that it exists "
                            "and is readable by the daemon") from None
    return rows
