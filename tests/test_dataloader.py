"""CachedImageNet with torch's DataLoader: workers (fork, spawn), DistributedSampler, a second process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from client.augment import AugmentCollate
from client.dataset import CachedImageNet
from datacache.devtools import synth

SHORT = 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_list(batch: list) -> list:
    """collate_fn keeping variable-size samples as a list (module level: picklable for spawn)."""
    return batch


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("dl") / "train")
    synth.make_imagefolder(root, classes=3, per_class=4, size=(80, 60), seed=5)
    return root


def _run(ds: CachedImageNet, **kw) -> list[tuple[torch.Tensor, int]]:
    loader = DataLoader(ds, batch_size=4, shuffle=False, collate_fn=as_list, **kw)
    return [(img.clone(), label) for batch in loader for img, label in batch]


def test_workers_fork_spawn_identical_and_stats_shared(folder: str, tmp_path) -> None:
    ds = CachedImageNet(folder, cache=f"lmdb://{tmp_path}/c", short_side=SHORT, t1_dir=None)
    n = len(ds)
    cold = _run(ds, num_workers=2, multiprocessing_context="fork")  # cold epoch in 2 forked workers
    st = ds.stats()  # the parent sees what both workers counted
    assert (st["samples"], st["misses"], st["decoded"], st["t2"]["written"]) == (n, n, n, n)
    assert st["processes"] == 2 and st["bytes_read"] > 0

    ds.reset_stats()
    ref = _run(ds, num_workers=0)
    assert ds.stats()["hits"] == n and ds.stats()["processes"] == 1
    assert [lab for _, lab in ref] == ds.targets
    assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(cold, ref))

    ds.reset_stats()
    spawned = _run(ds, num_workers=2, multiprocessing_context="spawn")
    assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(spawned, ref))
    st = ds.stats()  # counters written by spawned workers land in the parent's shared tensor
    assert (st["samples"], st["hits"], st["misses"], st["decoded"], st["bytes_read"]) == (n, n, 0, 0, 0)
    assert st["processes"] == 2


def test_distributed_sampler_two_ranks(folder: str) -> None:
    ds = CachedImageNet(folder, cache="memory://", short_side=SHORT, t1_dir=None)
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=1)
        sampler.set_epoch(3)
        order = list(sampler)
        got = [item for batch in DataLoader(ds, batch_size=3, sampler=sampler, collate_fn=as_list)
               for item in batch]
        assert len(got) == len(ds) // 2
        for i, (img, label) in zip(order, got):
            assert label == ds.targets[i] and torch.equal(img, ds[i][0])
        seen.append(set(order))
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(len(ds)))


def test_substitute_keeps_batches_full_across_workers(tmp_path) -> None:
    root = str(tmp_path / "train")
    synth.make_imagefolder(root, classes=2, per_class=4, size=(80, 60), seed=6)
    bad = synth.write_bad_inputs(root)
    ds = CachedImageNet(root, cache=f"lmdb://{tmp_path}/c", short_side=SHORT, t1_dir=None)
    loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context="fork",
                        collate_fn=AugmentCollate(24, seed=0), drop_last=False,
                        generator=torch.Generator().manual_seed(0))
    sizes = [int(y.numel()) for x, y in loader]
    assert sum(sizes) == len(ds) and all(s == 5 for s in sizes[:-1])
    q = ds.quarantined  # failures happened in the workers; the parent still knows file and reason
    assert set(q) == {bad["corrupt"], bad["truncated"], bad["zero_byte"]}
    assert all(reason.startswith("cannot decode") for reason in q.values())
    assert ds.stats()["substituted"] == 3


SECOND_RUN = textwrap.dedent("""
    import json, sys
    from datacache.manifest import Manifest

    def no_walk(*a, **k):
        raise AssertionError("the second run re-walked the source")

    Manifest._from_folder = classmethod(no_walk)  # the persisted manifest must be reused
    from datacache import CachedImageNet
    ds = CachedImageNet(sys.argv[1], cache=sys.argv[2], short_side=int(sys.argv[3]), t1_dir=None)
    for i in range(0, len(ds), 5):
        ds.__getitems__(list(range(i, min(len(ds), i + 5))))
    print(json.dumps(ds.stats()))
""")


def test_second_process_gets_only_hits(folder: str, tmp_path) -> None:
    cache = f"lmdb://{tmp_path}/c"
    first = CachedImageNet(folder, cache=cache, short_side=SHORT, t1_dir=None)
    first.__getitems__(list(range(len(first))))
    assert first.stats()["decoded"] == len(first)
    proc = subprocess.run([sys.executable, "-c", SECOND_RUN, folder, cache, str(SHORT)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    st = json.loads(proc.stdout.strip().splitlines()[-1])
    assert st["hits"] == len(first) and st["misses"] == 0
    assert st["decoded"] == 0 and st["bytes_read"] == 0 and st["samples"] == len(first)


class _ManifestProbe(torch.utils.data.Dataset):
    """Returns what a worker sees of the dataset's manifest (module level: picklable for spawn)."""

    def __init__(self, ds: CachedImageNet) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> tuple:
        m = self.ds.manifest
        return list(m.paths), m.labels.tolist(), m.sizes.tolist(), m.fingerprint, type(m).__name__


def test_manifest_columns_travel_to_spawn_workers_as_shared_memory(folder: str, tmp_path) -> None:
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    from client.shared_manifest import share_manifest
    from datacache.columns import PackedStrings
    from datacache.manifest import Manifest

    # ImageNet-sized columns: what DataLoader sends to a spawn/forkserver worker (ForkingPickler) is
    # a few file descriptors, not the bytes; a plain pickle still carries every byte.
    n = 200_000
    paths = PackedStrings.pack([f"c/{i:07d}.JPEG" for i in range(n)])
    large = share_manifest(Manifest(root="file:///d", packed=paths,
                                    labels=np.arange(n, dtype=np.int32) % 7, sizes=np.ones(n, np.int64),
                                    mtimes=np.zeros(n), versions=np.zeros(n, np.uint64), classes=["c"]))
    assert large.nbytes > 8_000_000
    assert len(bytes(ForkingPickler.dumps(large))) < 8192
    assert len(pickle.dumps(large)) >= large.nbytes
    back = pickle.loads(pickle.dumps(large))
    assert back.fingerprint == large.compute_fingerprint() == back.compute_fingerprint()

    ds = CachedImageNet(folder, cache=f"lmdb://{tmp_path}/c", short_side=SHORT, t1_dir=None)
    man = ds.manifest
    got = next(iter(DataLoader(_ManifestProbe(ds), batch_size=None, num_workers=1,
                               multiprocessing_context="spawn")))
    assert tuple(got) == (list(man.paths), man.labels.tolist(), man.sizes.tolist(), man.fingerprint,
                          "SharedManifest")
