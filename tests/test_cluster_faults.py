"""A Redis Cluster losing a master in the middle of an epoch read through a DataLoader with workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from torch.utils.data import DataLoader

from client.dataset import CachedImageNet
from datacache.decode import decode_image
from tests.redis_utils import cli, needs_redis

pytestmark = needs_redis
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 32


def as_list(batch: list) -> list:
    return batch


def reference(ds: CachedImageNet, i: int) -> torch.Tensor:
    """A direct decode of the file (Pillow), independent of every cache."""
    with open(os.path.join(ds.root[len("file://"):], ds.manifest.paths[i]), "rb") as f:
        return torch.from_numpy(decode_image(f.read(), ds.variant)).permute(2, 0, 1)


def epoch_in_new_process(root: str, url: str) -> dict:
    """One epoch with 2 DataLoader workers in a fresh interpreter; returns its stats()."""
    code = textwrap.dedent(f"""
        import json, sys
        from torch.utils.data import DataLoader
        from client.dataset import CachedImageNet
        ds = CachedImageNet({root!r}, {url!r}, short_side={SHORT}, t1_dir=None)
        n = sum(len(b) for b in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=lambda b: b))
        assert n == len(ds)
        print(json.dumps(ds.stats()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_master_killed_mid_epoch_then_restarted_empty(fresh_cluster, imagefolder_factory) -> None:
    root = imagefolder_factory(classes=3, per_class=16, size=(80, 60))
    url = fresh_cluster.url
    ds = CachedImageNet(root, url, short_side=SHORT, t1_dir=None)
    n = len(ds)
    keys = [ds.key(i) for i in range(n)]
    owner = ds.store.tiers[0].master_of(keys)
    victim = fresh_cluster.masters[1]
    share = [i for i in range(n) if owner[i] == victim.addr]
    assert 0 < len(share) < n

    first = epoch_in_new_process(root, url)  # run 1 fills the cluster (write-back from the workers)
    assert first["decoded"] == n
    assert sum(int(cli(m.port, "dbsize")) for m in fresh_cluster.masters) == n  # flushed at worker exit

    # the victim dies with its memory after 3 batches of an epoch read by 2 workers
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=as_list, shuffle=False)
    seen: list[tuple[torch.Tensor, int]] = []
    for b, batch in enumerate(loader):
        seen.extend((img.clone(), label) for img, label in batch)
        if b == 2:
            victim.kill()
    assert len(seen) == n  # the epoch completes
    for i, (img, label) in enumerate(seen):
        assert label == ds.targets[i] and torch.equal(img, reference(ds, i)), i
    st = ds.stats()
    lost_after_kill = [i for i in share if i >= 3 * 4 + 2 * 4 * 2]  # not yet prefetched at the kill
    assert len(lost_after_kill) <= st["decoded"] <= len(share)  # only the dead master's share was decoded
    assert st["t2"]["unavailable"] >= st["decoded"] > 0

    fresh_cluster.restart_empty(1)  # it comes back empty
    again = epoch_in_new_process(root, url)  # a new process decodes exactly the lost share ...
    assert again["decoded"] == len(share) and again["hits"] == n - len(share)
    assert int(cli(victim.port, "dbsize")) == len(share)  # ... and refills it
    warm = epoch_in_new_process(root, url)  # a second run on a warm cluster: 0 decodes
    assert warm["decoded"] == 0 and warm["hits"] == n and warm["hit_ratio"] == 1.0
