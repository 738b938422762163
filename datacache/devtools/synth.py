"""Dataset generators for tests, the demo and benchmarks (no binaries are committed).

:func:`make_imagefolder` writes an ImageNet-like ImageFolder of *textured* JPEGs: a smooth
random colour field (a tiny random image upscaled bicubically), a mid-frequency layer, a
few filled shapes and per-pixel noise. Flat colours would compress to a few KB and make
decode/IO benchmarks meaningless; this mix gives q90 500x375 files of ~60–150 KB like
ImageNet's, with a per-class colour bias so a small model can learn something. Everything
is drawn from ``numpy.random.default_rng((seed, class, index))``: same seed, same bytes.
Noise is generated at uint8 on the full image but everything else at low resolution,
so ~2,000 images take well under a minute on one core.

:func:`ensure_imagefolder` publishes a generated tree atomically for callers that share it (the demo,
the benchmarks): it is built in a private temp directory beside its final path and renamed into place,
so a concurrent run sees either nothing or the complete tree, never a half-written one.

``include_real_photos=True`` also copies the sample photos shipped by installed packages
(scikit-image's ``data`` folder when installed, matplotlib's ``mpl-data/sample_data``, e.g.
``grace_hopper.jpg``), round-robin into the class folders, as ``real_<name>``.

:func:`write_bad_inputs` adds one file per bad-input case (see its docstring).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable, Iterable

import numpy as np
from PIL import Image, ImageDraw

from datacache.manifest import is_image


def _class_names(n: int) -> list[str]:
    return [f"c{i:03d}" for i in range(n)]


def synth_image(rng: np.random.Generator, size: tuple[int, int], bias: np.ndarray) -> Image.Image:
    """One textured RGB image of ``size`` = (width, height)."""
    w, h = size
    coarse = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    coarse = np.clip(coarse.astype(np.int16) // 2 + bias, 0, 255).astype(np.uint8)
    base = Image.fromarray(coarse, "RGB").resize((w, h), Image.Resampling.BILINEAR)
    mid = rng.integers(0, 256, size=(max(2, h // 12), max(2, w // 12), 3), dtype=np.uint8)
    mid_img = Image.fromarray(mid, "RGB").resize((w, h), Image.Resampling.BILINEAR)
    img = Image.blend(base, mid_img, 0.25)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 8))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(w // 10, w // 2)), y0 + int(rng.integers(h // 10, h // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    arr = np.asarray(img).astype(np.int16)
    arr += rng.integers(-18, 19, size=(h, w, 1), dtype=np.int16)  # luminance grain
    arr += rng.integers(-5, 6, size=(h, w, 3), dtype=np.int16)  # colour grain
    np.clip(arr, 0, 255, out=arr)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def _pillow_decodes(path: str) -> bool:
    """Whether this Pillow decodes ``path`` completely (a shipped TIFF may need a codec it lacks)."""
    try:
        with Image.open(path) as im:
            im.load()
    except Exception:  # any failure: not a valid image for this Pillow, leave it out
        return False
    return True


def real_photo_files() -> list[str]:
    """Image files shipped by installed packages (scikit-image data, matplotlib sample_data) that this
    Pillow decodes: they stand for valid real photos (bad inputs are :func:`write_bad_inputs`' job), and
    which files a package ships and which codecs a Pillow build has differ from machine to machine."""
    dirs: list[str] = []
    for pkg, sub in (("skimage", "data"), ("matplotlib", os.path.join("mpl-data", "sample_data"))):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                d = os.path.join(loc, sub)
                if os.path.isdir(d):
                    dirs.append(d)
    files = []
    for d in dirs:
        files += sorted(os.path.join(d, f) for f in os.listdir(d) if is_image(f))
    return [f for f in files if _pillow_decodes(f)]


def _progress(it: Iterable, total: int, enabled: bool) -> Iterable:
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, total=total, desc="synth images", unit="img")


def _write_one(job: tuple[str, str, int, int, tuple[int, int], int, int]) -> str:
    root, name, ci, i, size, quality, seed = job
    rng = np.random.default_rng((seed, ci, i))
    bias = np.array([(ci * 53) % 128, (ci * 97) % 128, (ci * 31) % 128], dtype=np.int16)
    rel = f"{name}/{i:05d}.JPEG"
    synth_image(rng, size, bias).save(os.path.join(root, rel), format="JPEG", quality=quality)
    return rel


def make_imagefolder(root: str, *, classes: int = 10, per_class: int = 20, size: tuple[int, int] = (500, 375),
                     quality: int = 90, seed: int = 0, include_real_photos: bool = False,
                     progress: bool = False, workers: int = 1) -> list[str]:
    """Write ``root/<class>/<i>.JPEG`` (classes ``c000``...) and return the relative paths written.
    ``workers`` > 1: that many forked processes write the images (each image depends only on
    ``(seed, class, i)``: the same files whatever the count)."""
    names = _class_names(classes)
    for c in names:
        os.makedirs(os.path.join(root, c), exist_ok=True)
    jobs = [(root, names[ci], ci, i, size, quality, seed) for ci in range(classes) for i in range(per_class)]
    if workers > 1:
        import multiprocessing

        # (fork: the workers need nothing but this module; the parent holds no threads or locks here)
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            written = list(_progress(pool.imap(_write_one, jobs, chunksize=16), len(jobs), progress))
    else:
        written = [_write_one(j) for j in _progress(jobs, len(jobs), progress)]
    if include_real_photos:
        for k, src in enumerate(real_photo_files()):
            rel = f"{names[k % classes]}/real_{os.path.basename(src)}"
            shutil.copyfile(src, os.path.join(root, rel))
            written.append(rel)
    return written


def publish_dir(root: str, build: Callable[[str], object]) -> bool:
    """Make ``root`` exist with what ``build(tmp)`` writes, atomically; False when it already existed.

    ``build`` writes into a fresh directory ``<root>.tmp-<pid>-<random>`` beside ``root`` (same file
    system), which is then renamed to ``root`` in one step. When another process published ``root``
    first, its tree is kept and only this process's temp directory is removed; an interrupted build
    leaves only its own temp directory, never a partial ``root``. Nothing but that temp directory is
    ever deleted here."""
    if os.path.isdir(root):
        return False
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(root)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        build(tmp)
        try:
            os.rename(tmp, root)  # atomic; fails when root appeared meanwhile (a non-empty directory)
        except OSError:
            if not os.path.isdir(root):
                raise
            return False  # lost the race: the winner's tree is complete, use it
        return True
    finally:
        if os.path.isdir(tmp):
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)  # our own temp dir only (lost race or failed build)


def ensure_imagefolder(root: str, *, progress: bool = False, **kw: object) -> bool:
    """Generate :func:`make_imagefolder`'s tree at ``root`` once, published atomically (see
    :func:`publish_dir`); True when this call generated it, False when it was there already."""
    return publish_dir(root, lambda tmp: make_imagefolder(tmp, progress=progress, **kw))  # type: ignore[arg-type]


def _jpeg_bytes(img: Image.Image, **kw: object) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **kw)
    return buf.getvalue()


def write_bad_inputs(root: str) -> dict[str, str]:
    """Write one file per bad-input case into the class folders of ``root``; ``{case: relpath}``.

    Cases: ``corrupt`` (JPEG marker + garbage), ``truncated`` (first half of a JPEG),
    ``zero_byte``, ``cmyk`` / ``palette`` (with a transparent index) / ``rgba``: pure red
    images, ``gray`` (L, value 128), ``sixteen_bit`` (16-bit PNG, left half 65535, right half
    16384 -> 255 / 64 after scaling), ``png_named_jpeg`` (a green PNG named ``.JPEG``),
    ``exif_rotated`` (200x100 stored, left half red / right half blue, EXIF orientation 6:
    decodes 100x200 with red on top), ``one_by_one`` (1x1 blue), ``huge`` (10000x8000 JPEG,
    flat grey so it is cheap to write), ``non_image`` (a ``.txt``), ``unicode`` (a valid JPEG
    with a non-ASCII name).
    """
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) if os.path.isdir(
        root) else []
    if not classes:
        classes = ["c000"]
        os.makedirs(os.path.join(root, "c000"), exist_ok=True)
    good = synth_image(np.random.default_rng(12345), (200, 150), np.zeros(3, dtype=np.int16))
    good_jpeg = _jpeg_bytes(good)
    red = (255, 0, 0)
    half = np.zeros((100, 200, 3), dtype=np.uint8)
    half[:, :100] = red
    half[:, 100:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    sixteen = np.full((32, 64), 16384, dtype=np.uint16)
    sixteen[:, :32] = 65535
    pal = Image.new("P", (48, 32), 1)
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0, 0, 0] * 254)
    pal.info["transparency"] = 0
    import io

    def png(img: Image.Image) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    def jpeg(img: Image.Image, **kw: object) -> bytes:
        return _jpeg_bytes(img, **kw)

    cases: dict[str, tuple[str, object]] = {
        "corrupt": ("bad_corrupt.JPEG", b"\xff\xd8\xff\xe0" + bytes(np.random.default_rng(1).integers(
            0, 256, 4000, dtype=np.uint8))),
        "truncated": ("bad_truncated.JPEG", good_jpeg[: len(good_jpeg) // 2]),
        "zero_byte": ("bad_zero.JPEG", b""),
        "cmyk": ("odd_cmyk.JPEG", lambda: jpeg(Image.new("CMYK", (64, 48), (0, 255, 255, 0)))),
        "gray": ("odd_gray.JPEG", lambda: jpeg(Image.new("L", (64, 48), 128))),
        "palette": ("odd_palette.png", lambda: png(pal)),
        "rgba": ("odd_rgba.png", lambda: png(Image.new("RGBA", (64, 48), (255, 0, 0, 255)))),
        "sixteen_bit": ("odd_16bit.png", lambda: png(Image.fromarray(sixteen))),
        "png_named_jpeg": ("odd_png_named.JPEG", lambda: png(Image.new("RGB", (64, 48), (0, 255, 0)))),
        "exif_rotated": ("odd_exif6.JPEG", lambda: jpeg(Image.fromarray(half), exif=exif.tobytes())),
        "one_by_one": ("odd_1x1.JPEG", lambda: jpeg(Image.new("RGB", (1, 1), (0, 0, 255)))),
        "huge": ("odd_huge.JPEG", lambda: _jpeg_bytes_q(Image.new("RGB", (10000, 8000), (120, 120, 120)))),
        "non_image": ("notes.txt", b"not an image\n"),
        "unicode": ("ünïcødé_名前.JPEG", good_jpeg),
    }
    out: dict[str, str] = {}
    for k, (case, (fname, data)) in enumerate(cases.items()):
        rel = f"{classes[k % len(classes)]}/{fname}"
        payload = data() if callable(data) else data
        with open(os.path.join(root, rel), "wb") as f:
            f.write(payload)  # type: ignore[arg-type]
        out[case] = rel
    return out


def _jpeg_bytes_q(img: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=50)
    return buf.getvalue()
