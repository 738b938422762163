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

import os
import shutil
import signal
from collections.abc import Callable, Iterator

import pytest

from datacache.devtools.synth import make_imagefolder, write_bad_inputs

pytest_plugins = ["tests.redis_utils"]  # real redis-server fixtures: redis_url, cluster_url, fresh_cluster

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
    plus a warm LMDB cache URL holding both (short side 32). Read-only for tests. Needs scikit-learn
    (in the test extra)."""
    from client.dataset import CachedImageNet
    from trainer.digits import render

    base = tmp_path_factory.mktemp("digits")
    split = render(str(base / "data"))
    cache = "lmdb://" + str(base / "cache")
    for root in (split.train, split.val):
        ds = CachedImageNet(root, cache=cache, short_side=32)
        ds.__getitems__(list(range(len(ds))))
    return {"train": split.train, "val": split.val, "cache": cache}


def pytest_unconfigure(config: pytest.Config) -> None:
    """Last line of defence for the exit: multiprocessing's exit handler SIGTERMs and then joins every
    child still alive, and a child that ignores SIGTERM (a decode worker) would hold pytest -- and CI --
    for ever. SIGKILL whatever a test left behind first."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
