"""ImageFolder's face of :class:`client.dataset.CachedImageNet`: classes, samples, targets, imgs,
transforms, find_classes and make_dataset -- torchvision's attributes, over the manifest.

:class:`FolderFace` is a mixin: the dataset sets ``manifest``, ``root``, ``transform``,
``target_transform``, ``extensions``, ``_storage_options`` and the selection fields (``_sel_index``,
``_sel_labels``, ``_classes``, ``_class_to_idx``, ``_targets``, ``_path_index``) in its ``__init__``,
then calls :meth:`FolderFace._build_samples`. Assigned samples become a *selection*: position ->
manifest index (and label), in shared-memory tensors, so the cache keys follow the paths, never the
positions (:mod:`client.folder_api`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from client import folder_api
from client.folder_api import PathIndex, SamplesView, Selection, StandardTransform
from datacache.columns import ArrayView
from datacache.redact import redact

log = logging.getLogger("client.dataset")


def _share(a: np.ndarray) -> torch.Tensor:
    """``a`` as an int64 tensor in shared memory (spawn workers map it); private memory if that fails."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64).copy())
    try:
        return t.share_memory_()
    except (RuntimeError, OSError) as e:  # e.g. a small /dev/shm: workers receive a copy each
        log.warning("sample selection of %d entries stays in private memory (shared memory failed: %s)",
                    len(a), e)
        return t


class FolderFace:
    """torchvision's ``ImageFolder`` attributes over the manifest (see the module docstring)."""

    manifest: Any
    root: str | os.PathLike[str]
    transform: Callable[[Any], Any] | None
    target_transform: Callable[[Any], Any] | None
    extensions: tuple[str, ...] | None
    _storage_options: dict | None
    _sel_index: torch.Tensor | None
    _sel_labels: torch.Tensor | None
    _classes: list[str] | None
    _class_to_idx: dict[str, int] | None
    _targets: Any
    _path_index: PathIndex | None

    # ------------------------------------------------------------ construction helpers
    def _build_samples(self, is_valid_file: Callable[[str], bool] | None, allow_empty: bool) -> None:
        """torchvision's ``find_classes`` + ``make_dataset`` over the manifest: the listing itself when
        neither is overridden, an overriding subclass's results mapped onto it otherwise."""
        cls = type(self)
        if cls.find_classes is not FolderFace.find_classes:
            self._classes, self._class_to_idx = self.find_classes(self.root)
        if cls.make_dataset is not FolderFace.make_dataset:
            # called as torchvision's DatasetFolder calls it (keywords: an override may rename nothing else)
            self.samples = self.make_dataset(self.root, class_to_idx=self.class_to_idx,
                                             extensions=self.extensions, is_valid_file=is_valid_file,
                                             allow_empty=allow_empty)
            return
        man = self.manifest
        labels = man.labels.astype(np.int64)
        keep = np.ones(len(man), dtype=bool)
        if self._class_to_idx is not None:  # an overriding find_classes: its classes, its indices
            remap = np.array([self._class_to_idx.get(c, -1) for c in man.classes], dtype=np.int64)
            labels = remap[labels] if len(man.classes) else labels
            keep &= labels >= 0
        if is_valid_file is not None:  # called with each listed file's path, as in samples
            prefix = self._prefixes()[0]
            keep &= np.fromiter((bool(is_valid_file(prefix + p)) for p in man.paths), dtype=bool,
                                count=len(man))
        if self._class_to_idx is not None or is_valid_file is not None:
            idx = np.flatnonzero(keep).astype(np.int64)
            same = self._class_to_idx is None or bool(np.array_equal(labels[idx], man.labels[idx]))
            self._set_selection(Selection(idx, None if same else labels[idx]))
        if man.kind == "folder" and not allow_empty:
            present = set(np.unique(np.asarray(self.targets, dtype=np.int64)).tolist())
            empty = [c for c, i in self.class_to_idx.items() if i not in present]
            if empty:
                raise FileNotFoundError(folder_api.empty_classes_message(empty, self.extensions))

    def _prefixes(self) -> list[str]:
        """What sample paths start with: the root as given (``os.path.join(root, rel)``, as torchvision's
        samples), then the listing's absolute form (also accepted when samples are assigned)."""
        mroot = self.manifest.root
        base = mroot[len("file://"):] if mroot.startswith("file://") else mroot
        absolute = base.rstrip("/") + "/"
        given = os.fspath(self.root)
        if self.manifest.kind == "folder" and "://" not in given:
            shown = os.path.join(given, "")
            return [shown] if shown == absolute else [shown, absolute]
        return [absolute]

    def _set_selection(self, sel: Selection | None) -> None:
        if sel is None:
            self._sel_index = self._sel_labels = None
            return
        self._sel_index = _share(sel.index)
        self._sel_labels = None if sel.labels is None else _share(sel.labels)

    def _lookup(self) -> PathIndex:
        if self._path_index is None:
            self._path_index = PathIndex(self.manifest.paths)
        return self._path_index

    @property
    def classes(self) -> list[str]:
        return self._classes if self._classes is not None else self.manifest.classes

    @classes.setter
    def classes(self, value: list[str]) -> None:
        self._classes = value  # as torchvision: an attribute; loading does not depend on it

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self._class_to_idx if self._class_to_idx is not None else self.manifest.class_to_idx

    @class_to_idx.setter
    def class_to_idx(self, value: dict[str, int]) -> None:
        self._class_to_idx = value

    @property
    def samples(self) -> SamplesView:
        """``(path, label)`` pairs as torchvision's ImageFolder (paths joined to ``root`` as given), a
        read-only view built on access; assign a list of such pairs (e.g. a filtered copy) to change which
        files the dataset serves and with which labels."""
        idx = None if self._sel_index is None else self._sel_index.numpy()
        over = None if self._sel_labels is None else self._sel_labels.numpy()
        return SamplesView(self._prefixes()[0], self.manifest.paths, self.manifest.labels, idx, over)

    @samples.setter
    def samples(self, pairs: Iterable[Any]) -> None:
        if isinstance(pairs, SamplesView) and pairs.paths is self.manifest.paths:  # our own view, reassigned
            sel = None if pairs.index is None else Selection(np.asarray(pairs.index, np.int64),
                                                             None if pairs.override is None
                                                             else np.asarray(pairs.override, np.int64))
        else:
            shown = redact(os.fspath(self.root)) if "://" in os.fspath(self.root) else os.fspath(self.root)
            sel = folder_api.select(pairs, self._prefixes(), self._lookup, self.manifest.labels, shown)
            if sel.labels is None and np.array_equal(sel.index, np.arange(len(self.manifest))):
                sel = None  # the whole listing in order: back to the no-copy path
        self._set_selection(sel)

    @property
    def imgs(self) -> SamplesView:
        """``samples`` (torchvision binds ``imgs`` and ``samples`` to one list)."""
        return self.samples

    @imgs.setter
    def imgs(self, pairs: Iterable[Any]) -> None:
        self.samples = pairs

    @property
    def targets(self) -> Any:
        """Labels: what was assigned to ``targets``; otherwise those of ``samples``, a read-only int
        sequence view (of the manifest's int32 column when nothing was assigned: no list is built)."""
        if self._targets is not None:
            return self._targets
        if self._sel_labels is not None:
            return ArrayView(self._sel_labels.numpy())
        if self._sel_index is not None:
            return ArrayView(self.manifest.labels[self._sel_index.numpy()])
        return self.manifest.targets

    @targets.setter
    def targets(self, value: Sequence[Any]) -> None:
        """As torchvision: an attribute for samplers and statistics; the labels returned with the images
        come from ``samples``. Integer sequences are kept as an int64 array view."""
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):
            arr = None
        if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
            self._targets = ArrayView(arr.astype(np.int64))
        else:
            self._targets = list(value)

    @property
    def transforms(self) -> StandardTransform | None:
        """torchvision's ``VisionDataset.transforms``: both transforms in one callable (None without any)."""
        if self.transform is None and self.target_transform is None:
            return None
        return StandardTransform(self.transform, self.target_transform)

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        """torchvision's ``DatasetFolder.find_classes`` (lists ``directory``; a subclass may override it:
        its classes and indices are then used, the files still served from the cache)."""
        return folder_api.find_classes(directory, self._storage_options)

    @staticmethod
    def make_dataset(directory: str | os.PathLike[str], class_to_idx: dict[str, int],
                     extensions: tuple[str, ...] | None = None,
                     is_valid_file: Callable[[str], bool] | None = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:
        """torchvision's ``DatasetFolder.make_dataset`` (walks ``directory``; a subclass may override it:
        the pairs it returns become ``samples``, and must name files of the listing)."""
        if class_to_idx is None:
            raise ValueError("The class_to_idx parameter cannot be None.")
        return folder_api.make_dataset(directory, class_to_idx, extensions=extensions,
                                       is_valid_file=is_valid_file, allow_empty=allow_empty)

