"""Shared pytest fixtures: small generated datasets (nothing binary is committed).

* ``small_imagefolder`` (session): ``root/c000..c002/*.JPEG``, 3 classes x 8 textured
  200x150 JPEGs. Shared by many tests: **do not modify it** (use ``imagefolder_factory``).
* ``imagefolder_factory`` (function): ``make(classes=3, per_class=4, size=(200, 150), **kw)``
  writes a fresh ImageFolder under ``tmp_path`` and returns its root (str).
* ``bad_imagefolder`` (session) and ``bad_cases``: ``small_imagefolder``'s images plus every
  case of :func:`datacache.devtools.synth.write_bad_inputs` and three more that ``bad_cases``
  names: ``dangling_symlink`` (an image-named symlink to nothing: listed, unreadable),
  ``directory_named_jpeg`` (a directory ``x.JPEG``: walked into like torchvision, never a
  sample) and ``empty_class`` (an empty class folder ``c999_empty``, which keeps its index).
  Do not modify it either.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Triton's interpreter runs the fused top-k kernels (trainer/comm/radix_select_triton.py) on CPU tensors:
# tests/test_radix_select_triton.py checks them so on a machine without CUDA. Triton reads the switch when it
# is imported, so it is set here, before any test module can import it, for the whole session (a machine
# with CUDA runs the compiled kernels on the GPU instead).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from datacache.devtools.synth import make_imagefolder, write_bad_inputs
from tests.shared_dirs import built_once

# real redis-server fixtures (redis_url, cluster_url, fresh_cluster); how xdist spreads the suite
pytest_plugins = ["tests.redis_utils", "tests.scheduling"]

_GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SESSION_HANDLERS = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}


@pytest.fixture(autouse=True)
def _no_leaked_signal_handler() -> Iterator[None]:
    """A test that leaves a SIGTERM/SIGINT handler behind fails (and the handler is put back): every
    child forked later in this pytest process would inherit it and ignore ``Process.terminate()`` --
    a CI run once hung for an hour at exit that way (multiprocessing joins its daemonic children).
    Putting back pytest's own handler is no leak (a test that stops a module fixture's cluster)."""
    before = {sig: signal.getsignal(sig) for sig in _GUARDED_SIGNALS}
    yield
    leaked = {sig: h for sig in _GUARDED_SIGNALS
              if (h := signal.getsignal(sig)) is not before[sig] and h is not _SESSION_HANDLERS[sig]}
    for sig in leaked:
        signal.signal(sig, before[sig])
    assert not leaked, f"the test left signal handlers installed: {leaked}"


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """A test that leaves torch.distributed's default process group initialised fails (and the group is
    destroyed): the next test of the same process that initialises one would fail with "trying to
    initialize the default process group twice" -- which test that is depends on how the suite was
    split over workers. Only looked at where torch.distributed was already imported."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left torch.distributed's default process group initialised "
                    "(destroy_process_group() in a finally)")


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def in_process_training() -> Iterator[None]:
    """For a test that calls ``trainer.run.train`` in the pytest process itself: by design train()
    initialises (or reuses) a one-rank default process group and sets the torchrun variables, so that a
    caller may train again; after the test both are undone, and no later test of this worker inherits
    them (torn down before ``_no_leaked_process_group`` looks)."""
    saved = {k: os.environ.get(k) for k in _TORCHRUN_VARS}
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def small_imagefolder(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("small_imagefolder") / "train")
    make_imagefolder(root, classes=3, per_class=8, size=(200, 150), seed=0)
    return root


@pytest.fixture
def imagefolder_factory(tmp_path) -> Callable[..., str]:
    counter = {"n": 0}

    def make(classes: int = 3, per_class: int = 4, size: tuple[int, int] = (200, 150), **kw) -> str:
        counter["n"] += 1
        root = str(tmp_path / f"imagefolder{counter['n']}")
        make_imagefolder(root, classes=classes, per_class=per_class, size=size, **kw)
        return root

    return make


@pytest.fixture(scope="session")
def _bad_build(tmp_path_factory: pytest.TempPathFactory,
               small_imagefolder: str) -> tuple[str, dict[str, str]]:
    root = str(tmp_path_factory.mktemp("bad_imagefolder") / "train")
    shutil.copytree(small_imagefolder, root)
    cases = write_bad_inputs(root)
    os.symlink(os.path.join(root, "does-not-exist.JPEG"), os.path.join(root, "c000", "dangling.JPEG"))
    cases["dangling_symlink"] = "c000/dangling.JPEG"
    os.makedirs(os.path.join(root, "c001", "x.JPEG"))
    cases["directory_named_jpeg"] = "c001/x.JPEG"
    os.makedirs(os.path.join(root, "c999_empty"))
    cases["empty_class"] = "c999_empty"
    return root, cases


@pytest.fixture(scope="session")
def bad_imagefolder(_bad_build: tuple[str, dict[str, str]]) -> str:
    return _bad_build[0]


@pytest.fixture(scope="session")
def bad_cases(_bad_build: tuple[str, dict[str, str]]) -> dict[str, str]:
    return dict(_bad_build[1])


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """scikit-learn's digits rendered as ``train``/``val`` ImageFolders of 32x32 PNGs (trainer.digits)
    plus a warm LMDB cache URL holding both (short side 32), built once per test run for every worker
    (tests/shared_dirs.py). Read-only for tests: a test that needs to change them copies them first.
    Needs scikit-learn (in the test extra)."""
    from client.dataset import CachedImageNet
    from trainer.digits import render

    def build(base: Path) -> None:
        split = render(str(base / "data"))
        cache = "lmdb://" + str(base / "cache")
        for root in (split.train, split.val):
            ds = CachedImageNet(root, cache=cache, short_side=32)
            ds.__getitems__(list(range(len(ds))))
        paths = {"train": split.train, "val": split.val, "cache": cache}
        (base / "digits.json").write_text(json.dumps(paths))

    base = built_once(tmp_path_factory, "digits", {"short_side": 32}, build)
    return json.loads((base / "digits.json").read_text())


def pytest_unconfigure(config: pytest.Config) -> None:
    """Last line of defence for the exit: multiprocessing's exit handler SIGTERMs and then joins every
    child still alive, and a child that ignores SIGTERM (a decode worker) would hold pytest -- and CI --
    for ever. SIGKILL whatever a test left behind first."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
