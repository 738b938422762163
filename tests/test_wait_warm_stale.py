"""wait_warm does not trust stale fill reports: a master restarted empty makes it wait (real cluster)."""

from __future__ import annotations

import pytest

from client.dataset import CachedImageNet
from datacache.fillstatus import report_fill, status_key
from tests.redis_utils import needs_redis, private

pytestmark = needs_redis


def _fill(ds: CachedImageNet) -> None:
    ds.__getitems__(list(range(len(ds))))  # every sample decoded once and written back
    assert ds.flush(timeout=30)


def test_master_restarted_empty_makes_wait_warm_wait(fresh_cluster, imagefolder_factory) -> None:
    root = imagefolder_factory(classes=3, per_class=20, size=(64, 48))
    ds = CachedImageNet(root, cache=private(fresh_cluster.url), short_side=32, t1_dir=None)
    n = len(ds)
    store = ds.store.tiers[0]
    fp, tag = ds.manifest.fingerprint, ds.variant.tag()
    _fill(ds)
    # the daemon's report (one node owning everything, all done), as cache_daemon writes it
    report_fill(ds.store, fp, tag, "node-a", owned=n, done=n, quarantined=0, total=n, rate=1.0)
    assert ds.wait_warm(timeout=5, poll=0.1)["full"]

    # restart a master that does NOT hold the report (so only the samples are lost, not the report)
    report_master = store.master_of([status_key(fp, tag)])[0]
    owners = store.master_of(ds.reader.keys(range(n)))
    victim = next(i for i, m in enumerate(fresh_cluster.masters)
                  if m.addr != report_master and m.addr in owners)
    fresh_cluster.restart_empty(victim)
    with pytest.raises(TimeoutError, match="sampled keys are not in the cache"):
        ds.wait_warm(timeout=1.5, poll=0.1)

    # a warm run refills (a private cluster: the client writes back)
    _fill(CachedImageNet(root, cache=private(fresh_cluster.url), short_side=32, t1_dir=None))
    report = ds.wait_warm(timeout=10, poll=0.1)
    assert report["full"] and report["verified"]["missing"] == 0 and report["oldest_report_s"] is not None
