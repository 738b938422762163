"""Render scikit-learn's bundled ``digits`` (1,797 real 8x8 handwritten digits, UCI) as ImageFolders.

``python -m trainer digits OUT`` writes ``OUT/train/<0..9>/<id>.png`` and ``OUT/val/<0..9>/<id>.png``
(a seeded per-class hold-out, 20 % by default). Each 8x8 image (values 0..16, ink = high) is
scaled to 0..255 (``round(v * 255 / 16)``), inverted to dark ink on white paper, and enlarged
``scale`` times with nearest-neighbour (so every source pixel is a ``scale x scale`` block: the
file holds exactly the dataset's values), as grayscale PNG -- or JPEG (``--format jpeg``, lossy).
The file name is the sample's index in ``load_digits()``. Needs scikit-learn (the ``train`` extra).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from datacache.config import ConfigError

FORMAT_CHOICES = ("png", "jpeg")


@dataclass(frozen=True)
class DigitsSplit:
    train: str
    val: str
    n_train: int
    n_val: int


def load() -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [1797, 8, 8] in 0..255 with dark ink, labels int [1797])``."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ConfigError("the digits dataset needs scikit-learn, which the 'train' extra installs: "
                          "pip install 'datacache[train]' (from a checkout: pip install -e '.[train]')"
                          ) from e
    d = load_digits()
    values = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)
    return 255 - values, d.target.astype(np.int64)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def render(out: str, *, scale: int = 4, val_fraction: float = 0.2, seed: int = 0,
           fmt: str = "png") -> DigitsSplit:
    """Write the train/val ImageFolders under ``out`` (idempotent: identical files are left alone)."""
    if fmt not in FORMAT_CHOICES:
        raise ConfigError(f"format={fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")
    if scale < 1 or not 0 < val_fraction < 1:
        raise ConfigError(f"need scale >= 1 and 0 < val_fraction < 1, got {scale}, {val_fraction}")
    from trainer.data import split_indices

    images, labels = load()
    train_idx, val_idx = split_indices(labels.tolist(), val_fraction, seed)
    ext = "png" if fmt == "png" else "jpg"
    for split, idx in (("train", train_idx), ("val", val_idx)):
        for c in range(10):
            os.makedirs(os.path.join(out, split, str(c)), exist_ok=True)
        for i in idx:
            big = np.kron(images[i], np.ones((scale, scale), dtype=np.uint8))  # nearest-neighbour
            path = os.path.join(out, split, str(int(labels[i])), f"{i:04d}.{ext}")
            buf = io.BytesIO()
            Image.fromarray(big).save(buf, format="PNG" if fmt == "png" else "JPEG", quality=95)
            data = buf.getvalue()
            if os.path.exists(path) and _read(path) == data:
                continue  # unchanged: keep the file (and its mtime, so a cache of it stays valid)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
    return DigitsSplit(os.path.join(out, "train"), os.path.join(out, "val"), len(train_idx), len(val_idx))
