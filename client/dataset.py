"""CachedImageNet: torchvision's ImageFolder, served from the datacache -- a map-style torch Dataset.

A drop-in for ``torchvision.datasets.ImageFolder``: same constructor (``root, transform=None,
target_transform=None, loader=None, is_valid_file=None, allow_empty=False``; every cache option is
keyword-only), same attributes (``root``, ``classes``, ``class_to_idx``, ``samples``, ``imgs``, ``targets``,
``extensions``, ``loader``, ``transform``, ``target_transform``, ``transforms``) and methods
(``find_classes``, ``make_dataset``; both honoured when a subclass overrides them). Differences are
listed in the class docstring.

Everything about where a sample comes from -- keys, tiers, bad records, the fill from T1/T0,
write-back and remembered bad files -- is :class:`datacache.readthrough.ReadThrough`, shared with
``datacache warm`` and the cache daemon. This class is a *reader*: trainers read, daemons write, so a
shared (Redis) tier is never written from here unless its URL says ``?write_back=1``; the embedded LMDB
is. This class adds what torch needs:

* ``__getitems__`` (DataLoader calls it with the whole batch): one ``ReadThrough.load_many`` per
  batch; each hit is handed on as the ``output`` mode says: ``"tensor"`` -- a ``uint8 [3, H, W]`` tensor
  *view* of the record (``torch.from_numpy`` + ``permute``; read-only, clone before modifying in place;
  the fast path of ``AugmentCollate`` and the trainer) -- or ``"pil"`` -- a PIL RGB image built over the
  record's pixels (no decode; :func:`client.folder_api.pil_image`), what ImageFolder's transforms expect.
  ``"auto"`` (default): ``"pil"`` when the dataset has a ``transform``, else ``"tensor"``;
* the stored resolution: without ``short_side``/``variant`` it is derived from the transform
  (:mod:`client.transform_size`: ``Resize(256)`` -> 256, ``RandomResizedCrop(224)`` -> 256, nothing found
  -> 160, logged); an explicit ``short_side`` below what the transform asks for logs one warning;
* ``samples`` assigned or filtered like a list: positions map to the manifest index of their path
  (:class:`client.folder_api.Selection`, shared-memory ``int64`` tensors), so cache keys follow the files;
* the failure policy ``on_error``: ``"substitute"`` (default) quarantines the file -- recorded in
  :attr:`CachedImageNet.quarantined` (relpath -> reason), counted, logged once -- and the next
  position (wrapping) that loads stands in, so batch sizes stay equal; ``"raise"`` raises
  :class:`DatasetError` naming the file, the cause and what to do;
* statistics of every DataLoader worker in one shared-memory table (:mod:`client.stats`), with the
  hit ratio per tier for a chained cache (``lmdb:///local::redis+cluster://...``);
* :meth:`CachedImageNet.wait_warm`: block until the cache daemons report the dataset full.

The cache URL is parsed and checked when the dataset is constructed (in the parent): a bad URL, an
LMDB directory on a network filesystem, or a wrong Redis password raises ConfigError right there.

Per-process state (fork/spawn boundary): the read-through opens its store and source lazily in the
process that uses them (pid check), so every DataLoader worker opens its own LMDB environment and
Redis connections after the fork. Pickling the dataset for spawn carries the parsed cache spec,
the config, the transforms and shared-memory tensors -- the manifest's columns
(:mod:`client.shared_manifest`), statistics, quarantine flags and a selection of samples -- which torch's
ForkingPickler passes as file descriptors rather than copies. The path index built to map assigned
samples is per process and never pickled. In the main process (``num_workers=0``) misses of a batch are
decoded by a few threads at once; in a worker, one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from client import folder_api
from client.folder_api import PathIndex
from client.folder_face import FolderFace
from client.shared_manifest import share_manifest
from client.stats import PLACEMENT, PLACEMENT_COUNTERS, SharedCounters, format_stats
from client.tensor_view import to_chw_tensor
from client.transform_size import required_short_side
from datacache.cacheurl import parse_cache_url
from datacache.config import ConfigError, Variant, default_cache_url
from datacache.fillstatus import sample_missing, wait_until_warm
from datacache.listing import IMG_EXTENSIONS
from datacache.manifest import Manifest, check_revalidate
from datacache.options import choice
from datacache.readthrough import COUNTERS, SOURCE_FAILURE, Failure, ReadThrough, manifest_dir_for
from datacache.record import load_record_key, resolve_record_key_file
from datacache.redact import redact

log = logging.getLogger("client.dataset")

ON_ERROR_CHOICES = ("substitute", "raise")
OUTPUT_CHOICES = ("auto", "pil", "tensor")
DEFAULT_SHORT_SIDE = 160  # when neither short_side/variant nor the transform says (datacache.config)
_DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))  # main process only: a worker decodes in one thread
_PSNR_NOTE = ("the transform then upscales the cached images: a lower effective resolution than "
              "ImageFolder's (Resize(256)+CenterCrop(224) from 160-px images measured 24-36 dB PSNR against "
              "ImageFolder, exact from 256-px ones for 4:3 photos up to 2x that size; tests/test_dropin.py)")


class DatasetError(Exception):
    """A sample could not be loaded and ``on_error="raise"``; the message names the file."""


class TransformError(RuntimeError):
    """The user's ``transform`` raised on a dataset item; the message names the dataset, the item and
    which ``output`` mode the transform probably needs. The original exception is chained."""


class ArgumentError(ConfigError, TypeError):
    """A constructor argument of the wrong kind (a ConfigError that is also a TypeError)."""


class CachedImageNet(FolderFace, Dataset):
    """torchvision's ``ImageFolder`` served from the datacache (see the module docstring).

    Args (ImageFolder's, positional as there):
        root: ImageFolder root -- a path (``str`` or ``os.PathLike``, ``~`` expanded) or any fsspec URL --
            or a ``.txt``/``.csv`` file list (:mod:`datacache.manifest`).
        transform: applied to each image: a PIL RGB image (``output="auto"``/``"pil"``) or a
            ``uint8 [3, H, W]`` tensor (``"tensor"``; ``"auto"`` without a transform).
        target_transform: applied to each label.
        loader: None, or torchvision's ``default_loader``/``pil_loader`` (the cache decodes with Pillow
            too); any other loader is refused with the reason (:func:`client.folder_api.check_loader`).
            Exposed as ``ds.loader`` (default: :func:`client.folder_api.default_loader`).
        is_valid_file: ``is_valid_file(path) -> bool`` filters the listed files (their paths as in
            ``samples``). Unlike torchvision it sees only files the listing keeps -- image extensions
            (``IMG_EXTENSIONS``), inside class folders -- so it can drop files, never add other ones.
        allow_empty: as torchvision: a class folder without any (valid) image raises FileNotFoundError
            naming it unless True (then the class keeps its index, with no samples). ImageFolder trees
            only; a file list's classes come from its rows.

    Keyword-only (the cache):
        cache: cache URL (``lmdb:///path``, ``lmdb://~/dir?readonly=1``, ``memory://``,
            ``redis://host:6379``, ``redis+cluster://h1:7000,h2:7000``, or tiers chained with ``::``
            such as ``lmdb:///local::redis+cluster://h1:7000``); default
            :func:`datacache.config.default_cache_url`. Parsed and checked here.
        short_side: short side of the cached variant; None: derived from ``transform``
            (:func:`client.transform_size.required_short_side`; 160 when nothing is found). Ignored when
            ``variant`` is given.
        variant: full :class:`~datacache.config.Variant`.
        output: ``"auto"`` (default), ``"pil"`` or ``"tensor"`` (module docstring).
        on_error: ``"substitute"`` or ``"raise"`` (see the module docstring).
        revalidate: how a persisted listing is checked at start: ``"dirs"`` (default; detects
            added, removed and atomically replaced files), ``"full"`` (re-list: also detects files
            rewritten in place) or ``"none"`` (see :mod:`datacache.manifest`).
        t1_dir: T1 raw-bytes cache dir for remote sources (``"default"``, a path, or None).
        t1_max_bytes: size cap of T1 (LRU trim); None = no cap.
        storage_options: fsspec options for the source.
        record_key_file: file holding the cache's record key (the daemons' ``record_key_file``): records
            and quarantine entries must carry its keyed MAC, anything else is a miss (see
            :mod:`datacache.record`). None: ``$DATACACHE_RECORD_KEY_FILE`` if set; ``""``: no key.
            Read here (ConfigError naming the file); workers get the path, never the key bytes.

    Items are ``(image, label)``: ``transform(image)`` and ``target_transform(label)`` when given. Without a
    transform the images are ``uint8 [3, H, W]`` tensors whose sizes differ between samples: use
    :class:`client.augment.AugmentCollate` (or a transform producing a fixed size) with a DataLoader.

    Differences from torchvision's ImageFolder (each tested in tests/test_dropin.py):
        * the images are the cached variant (short side ``short_side``, long side capped at 2x, Pillow
          bilinear, transparency over white; :mod:`datacache.decode`), not the files at full resolution;
        * ``samples``/``imgs`` are read-only sequence views (assign a new list to change the dataset;
          ``view + list`` works, ``.append`` does not); ``imgs`` is ``samples`` (torchvision binds both to
          one list at construction); ``targets`` follows an assigned ``samples`` until ``targets`` itself
          is assigned (torchvision leaves it stale);
        * assigned samples must name files of the listing (ConfigError with the position and reason); their
          labels must be ints;
        * ``is_valid_file`` sees only the listed image files (above).
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None,
                 loader: Callable[[str], Any] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False, *,
                 cache: str | None = None, short_side: int | None = None, variant: Variant | None = None,
                 output: str = "auto", on_error: str = "substitute", revalidate: str = "dirs",
                 t1_dir: str | None = "default", t1_max_bytes: int | None = None,
                 storage_options: dict | None = None, record_key_file: str | None = None) -> None:
        _check_callables(root, transform, target_transform, is_valid_file)
        self.loader = folder_api.check_loader(loader)
        choice("output", output, OUTPUT_CHOICES)
        choice("on_error", on_error, ON_ERROR_CHOICES)
        if t1_max_bytes is not None and int(t1_max_bytes) < 1:
            raise ConfigError(f"t1_max_bytes must be a positive number of bytes or None, "
                              f"got {t1_max_bytes!r}")
        check_revalidate(revalidate)
        key_file = resolve_record_key_file(record_key_file)
        if key_file:
            load_record_key(key_file)  # a bad key file fails here, before the listing (read once per process)
        # torchvision's VisionDataset: a str root is ~-expanded, a Path kept as given
        self.root: str | os.PathLike[str] = os.path.expanduser(root) if isinstance(root, str) else root
        self.transform = transform
        self.target_transform = target_transform
        self.output = output
        self.extensions: tuple[str, ...] | None = IMG_EXTENSIONS if is_valid_file is None else None
        self.variant = _pick_variant(transform, short_side, variant)
        # parsed and checked here, in the parent, never first inside a DataLoader worker
        self.cache_spec = parse_cache_url(cache or default_cache_url(), check=True)
        self.cache_url = self.cache_spec.url
        self.on_error = on_error
        self.revalidate = revalidate
        # columns in shared memory: spawn/forkserver workers map them instead of receiving a copy
        self.manifest = share_manifest(Manifest.build(os.fspath(self.root), storage_options=storage_options,
                                                      persist_dir=self.manifest_dir, revalidate=revalidate))
        self.reader = ReadThrough(self.manifest, self.variant, self.cache_spec, t1_dir=t1_dir,
                                  t1_max_bytes=int(t1_max_bytes) if t1_max_bytes is not None else None,
                                  storage_options=storage_options,
                                  record_key_file=key_file)
        self._tag = self.variant.tag()
        self._counters = SharedCounters((*COUNTERS, *PLACEMENT_COUNTERS))
        self._qflags = torch.zeros(len(self.manifest), dtype=torch.uint8).share_memory_()
        self._storage_options = storage_options
        self._sel_index: torch.Tensor | None = None  # position -> manifest index (None: the identity)
        self._sel_labels: torch.Tensor | None = None  # position -> label (None: the manifest's)
        self._classes: list[str] | None = None  # assigned / found by an overriding find_classes
        self._class_to_idx: dict[str, int] | None = None
        self._targets: Any = None  # what the user assigned to ds.targets
        self._path_index: PathIndex | None = None  # per process, never pickled
        self._build_samples(is_valid_file, allow_empty)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_path_index"] = None  # per process: rebuilt on demand (str hashes differ between processes)
        return state

    # ------------------------------------------------------------ ImageFolder face
    @property
    def manifest_dir(self) -> str:
        return manifest_dir_for(self.cache_spec)

    def __len__(self) -> int:
        return len(self.manifest) if self._sel_index is None else int(self._sel_index.numel())

    def __repr__(self) -> str:
        root = os.fspath(self.root)
        return (f"CachedImageNet(root={redact(root) if '://' in root else root!r}, n={len(self)}, "
                f"classes={len(self.classes)}, cache={self.cache_url!r}, variant={self._tag!r}, "
                f"output={self.output!r}, on_error={self.on_error!r})")

    @property
    def quarantine_local(self) -> dict[str, str]:
        """Files quarantined in *this* process (see :attr:`quarantined` for all workers)."""
        return self.reader.quarantine_local

    @property
    def store(self) -> Any:
        """This process's store (one tier, or a TieredStore), opened on first use."""
        return self.reader.store

    def key(self, index: int) -> bytes:
        """The cache key of item ``index`` (the manifest entry its sample names)."""
        return self.reader.key(self._indices([self._check_index(index)])[0])

    # ------------------------------------------------------------ the read path
    def _indices(self, positions: Sequence[int]) -> list[int]:
        """Manifest indices of dataset positions (the identity unless samples were assigned)."""
        if self._sel_index is None:
            return list(positions)
        return self._sel_index.numpy()[np.asarray(positions, dtype=np.int64)].tolist()

    def _placement_tiers(self) -> list[tuple[int, Any]]:
        """``(tier number, store)`` of the tiers that count where their bytes came from (a Redis
        Cluster: local / remote master); this process's stores."""
        store = self.reader.store
        tiers = list(getattr(store, "tiers", None) or [store])
        return [(i, t) for i, t in enumerate(tiers) if "local_bytes" in t.counters()]

    def _load_many(self, indices: Sequence[int], counts: dict[str, int]) -> list[Any]:
        """Per manifest index: ``(HWC uint8 pixels, label)`` or a :class:`~datacache.readthrough.Failure`."""
        in_worker = torch.utils.data.get_worker_info() is not None
        placed = self._placement_tiers()
        before = [t.counters() for _, t in placed]
        try:
            out: list[Any] = self.reader.load_many(indices, counts,
                                                   threads=1 if in_worker else _DECODE_THREADS,
                                                   on_ack=self._on_writeback_ack)
        finally:  # the tiers' local/remote counters are per process: add this batch's deltas
            for (i, t), old in zip(placed, before):
                new = t.counters()
                for what in PLACEMENT:
                    counts[f"tier{i}_{what}"] += new.get(what, 0) - old.get(what, 0)
        for pos, item in enumerate(out):
            if isinstance(item, Failure):
                self._qflags[indices[pos]] = item.code
        return out

    def _on_writeback_ack(self, written: int, present: int, errors: int) -> None:
        """A queued write-back batch was answered by the remote tier (writer thread of this process):
        count what the server acknowledged (``stats()['t2']['written']``), found present, or refused."""
        self._counters.add({"t2_written": written, "t2_writeback_present": present,
                            "t2_writeback_errors": errors})

    def __getitems__(self, positions: Sequence[int]) -> list[tuple[Any, Any]]:
        """Load a whole batch with one store round trip (DataLoader calls this per batch)."""
        positions = [self._check_index(p) for p in positions]
        indices = self._indices(positions)
        counts = dict.fromkeys(self._counters.names, 0)
        served = list(positions)  # the position whose sample stands at each place (a substitute's)
        try:
            out = self._load_many(indices, counts)
            for k, item in enumerate(out):
                if isinstance(item, Failure):
                    rel = self.manifest.paths[indices[k]]
                    if self.on_error == "raise":
                        raise DatasetError(
                            f"{self.manifest.root}/{rel}: {item.reason}. Fix or remove this file (the "
                            "manifest is re-listed when files change), or use on_error='substitute' to skip "
                            "bad samples.")
                    out[k], served[k] = self._substitute(positions[k], counts)
            counts["samples"] += len(positions)
        finally:
            self._counters.add(counts)
        if self._sel_labels is not None:  # assigned samples: their labels (the record's is the manifest's)
            labels = self._sel_labels.numpy()[np.asarray(served, dtype=np.int64)].tolist()
            out = [(pixels, lab) for (pixels, _), lab in zip(out, labels)]
        return [self._finish(pixels, label, p) for (pixels, label), p in zip(out, served)]

    def _finish(self, pixels: np.ndarray, label: Any, position: int) -> tuple[Any, Any]:
        """The item at ``position``: its image in the output mode, transformed; its label, transformed."""
        mode = self.output if self.output != "auto" else ("pil" if self.transform is not None else "tensor")
        img: Any = folder_api.pil_image(pixels) if mode == "pil" else to_chw_tensor(pixels)
        if self.transform is not None:
            try:
                img = self.transform(img)
            except Exception as e:
                raise TransformError(self._transform_hint(e, mode, self._indices([position])[0])) from e
        if self.target_transform is not None:
            label = self.target_transform(label)
        return img, label

    def _transform_hint(self, e: Exception, mode: str, index: int) -> str:
        """The message of a transform's failure: which dataset and item, and the output mode to try.
        Names the exception's type only (its text may quote pixel values; it is chained below)."""
        root = os.fspath(self.root)
        where = (f"CachedImageNet(root={redact(root) if '://' in root else root!r}) item "
                 f"{self.manifest.paths[index]!r}")
        if mode == "pil":
            return (f"{where}: transform {_describe(self.transform)} raised {type(e).__name__} on a "
                    "PIL RGB image (output='pil', what ImageFolder's default_loader gives); for "
                    "torchvision.transforms.v2 / tensor transforms pass output='tensor' (a uint8 [3, H, W] "
                    "tensor). The original exception is chained above.")
        return (f"{where}: transform {_describe(self.transform)} raised {type(e).__name__} on a uint8 "
                "[3, H, W] tensor (output='tensor'); for transforms written for ImageFolder (PIL input: "
                "ToTensor(), PIL-only steps) pass output='pil' or leave output='auto'. The original "
                "exception is chained above.")

    def _substitute(self, position: int, counts: dict[str, int]) -> tuple[Any, int]:
        """The next position (wrapping) that loads stands in for a quarantined one: ``(item, position)``."""
        n = len(self)
        for step in range(1, min(n, 1 + 256)):
            p = (position + step) % n
            item = self._load_many(self._indices([p]), counts)[0]
            if not isinstance(item, Failure):
                counts["substituted"] += 1
                return item, p
        rel = self.manifest.paths[self._indices([position])[0]]
        raise DatasetError(f"{self.manifest.root}: sample {rel} failed and none of the next 256 samples "
                           "could be loaded either; check the source (see ds.quarantined)")

    def _check_index(self, i: int) -> int:
        i = int(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} samples")
        return i

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.__getitems__([index])[0]

    # ------------------------------------------------------------ reporting
    @property
    def quarantined(self) -> dict[str, str]:
        """relpath -> reason for every sample quarantined so far, in this process or any worker."""
        result = dict(self.reader.quarantine_local)
        flagged = torch.nonzero(self._qflags).flatten().tolist()
        missing = [i for i in flagged if self.manifest.paths[i] not in result]
        if missing:
            known = self.reader.store.get_many([self.reader.qkey(i) for i in missing])
            for i, q in zip(missing, known):
                reason = self.reader.parse_known_bad(i, q)
                if reason is None:
                    code = int(self._qflags[i])
                    what = "cannot read the file" if code == SOURCE_FAILURE else "cannot decode"
                    reason = f"{what} (in a DataLoader worker; see its log)"
                result[self.manifest.paths[i]] = reason
        return result

    def stats(self) -> dict[str, Any]:
        """Totals over the main process and all DataLoader workers since creation / reset_stats().

        ``hits``/``misses`` are cache lookups (any tier), ``tiers`` the hits, misses, bytes and hit
        ratio of each tier of a chained cache (nearest first) with ``local_hits``/``local_bytes`` and
        ``remote_hits``/``remote_bytes`` -- what the master on this node served and what crossed to
        another node, counted by a ``redis+cluster://...?local=host:port`` tier (0 for the others) and
        summed over the tiers at the top level, ``t2.invalid_rewritten`` counts bad
        records that were rewritten, ``t2.read_errors``/``t2.write_errors``/``t2.unavailable`` store
        failures that were turned into misses / skipped writes, ``t1`` is the raw-bytes disk cache
        (remote sources only), ``t0`` the source itself (``bytes_read`` = bytes read from T1/T0).
        """
        return format_stats(self._counters.totals(), quarantined=int(torch.count_nonzero(self._qflags)),
                            processes=self._counters.active_rows(), store=self.cache_url,
                            tier_urls=[t.url for t in self.cache_spec.tiers])

    def reset_stats(self) -> None:
        """Zero the counters (all processes). Quarantine flags are kept."""
        self._counters.reset()

    def wait_warm(self, timeout: float | None = None, *, poll: float = 0.5) -> dict[str, Any]:
        """Block until the cache daemons report this dataset and variant fully ingested (their fill
        reports in Redis, :mod:`datacache.fillstatus`); returns the last report. Raises TimeoutError
        after ``timeout`` seconds (None: wait forever) and ConfigError when the cache has no Redis
        tier for daemons to report in. Reports that say "full" are checked against the cache itself
        (``EXISTS`` of 256 random samples, :func:`~datacache.fillstatus.sample_missing`): a node restarted
        empty makes this wait again until its keys are refilled. The whole listing counts, whatever
        ``samples`` selects (daemons fill the listing)."""
        reader = self.reader
        total = len(self.manifest)

        def verify() -> dict[str, int]:
            return sample_missing(reader.store, total, reader.keys,
                                  lambda idx: [reader.qkey(i) for i in idx], reader.parse_known_bad)

        return wait_until_warm(reader.store, self.manifest.fingerprint, self._tag, total,
                               timeout=timeout, poll=poll, verify=verify)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this process's queued write-backs to remote tiers are written (also done at exit
        and when a DataLoader worker exits); True when nothing is left queued."""
        flush = getattr(self.reader.store, "flush", None)
        return True if flush is None else bool(flush(timeout))


def _describe(fn: Any) -> str:
    """A callable's name for a message: its qualified name (``Compose``, ``my_tf``, ``<lambda>``)."""
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


def _check_callables(root: Any, transform: Any, target_transform: Any, is_valid_file: Any) -> None:
    """ImageFolder's positional order, with the errors of old call sites that passed the cache second."""
    if not isinstance(root, (str, os.PathLike)):
        raise ArgumentError(f"root must be a path (str or os.PathLike) or an fsspec URL, got "
                            f"{type(root).__name__}")
    if isinstance(transform, (str, bytes, os.PathLike)):
        shown = redact(os.fsdecode(transform)) if isinstance(transform, (str, bytes)) else "a path"
        raise ArgumentError(
            f"CachedImageNet(root, {shown!r}): the second positional argument is `transform`, as in "
            "torchvision's ImageFolder(root, transform=None, target_transform=None, loader=..., "
            "is_valid_file=None, allow_empty=False); pass the cache URL by keyword: "
            f"CachedImageNet(root, cache={shown!r})")
    for name, value in (("transform", transform), ("target_transform", target_transform),
                        ("is_valid_file", is_valid_file)):
        if value is not None and not callable(value):
            raise ArgumentError(f"{name} must be callable or None, got {type(value).__name__}")


def _pick_variant(transform: Any, short_side: int | None, variant: Variant | None) -> Variant:
    """The cached variant: ``variant``, else ``short_side``, else the short side the transform needs (160
    when it names none); one warning when the chosen short side is below what the transform asks for."""
    need = required_short_side(transform) if transform is not None else None
    if variant is not None:
        chosen, what = variant, f"variant short side {variant.short_side}"
    elif short_side is not None:
        chosen, what = Variant(short_side=short_side), f"short_side={short_side}"
    elif need is not None:
        log.info("cached short side %d, derived from the transform's %s (pass short_side= to choose)",
                 need.short_side, need.step)
        return Variant(short_side=need.short_side)
    else:
        log.info("cached short side %d (the default: %s; pass short_side= to choose)", DEFAULT_SHORT_SIDE,
                 "no transform" if transform is None else "the transform names no Resize/crop size")
        return Variant(short_side=DEFAULT_SHORT_SIDE)
    if need is not None and chosen.short_side < need.short_side:
        log.warning("%s is below the %d px the transform asks for (%s): %s. Leave short_side out to derive "
                    "it from the transform, or pass short_side=%d", what, need.short_side, need.step,
                    _PSNR_NOTE, need.short_side)
    return chosen
