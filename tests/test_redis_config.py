"""Misconfigured Redis URLs are refused when the URL is checked, with one line that says what to fix."""

from __future__ import annotations

import pytest

from datacache.config import ConfigError
from datacache.stores import open_store
from tests.redis_utils import needs_redis

pytestmark = needs_redis


def test_cluster_url_on_a_standalone_server_is_a_config_error(redis_server, small_imagefolder: str) -> None:
    from client.dataset import CachedImageNet

    url = f"redis+cluster://{redis_server.addr}"
    pattern = r"not in cluster mode.*redis://host:port.*cluster-enabled yes"
    with pytest.raises(ConfigError, match=pattern) as ei:
        CachedImageNet(small_imagefolder, cache=url, short_side=32, t1_dir=None)
    assert "\n" not in str(ei.value)


def test_cluster_url_on_a_real_cluster_is_accepted(cluster_url: str, small_imagefolder: str) -> None:
    from client.dataset import CachedImageNet

    ds = CachedImageNet(small_imagefolder, cache=cluster_url, short_side=32, t1_dir=None)
    assert ds[0][1] == ds[0][1]


@pytest.mark.parametrize("option", ["socket_timeout", "connect_timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "0.0", "7200", "inf", "nan"])
def test_timeouts_must_be_finite_and_positive(redis_server, option: str, value: str) -> None:
    for url in (f"redis://{redis_server.addr}/0?{option}={value}",
                f"redis+cluster://{redis_server.addr}?{option}={value}"):
        with pytest.raises(ConfigError, match=rf"{option}") as ei:
            open_store(url)
        msg = str(ei.value)
        assert "\n" not in msg and (("> 0" in msg and "3600" in msg) or "number" in msg), msg


def test_valid_timeouts_are_used(redis_server) -> None:
    store = open_store(f"redis://{redis_server.addr}/0?socket_timeout=0.25&connect_timeout=1.5")
    try:
        kw = store.client().connection_pool.connection_kwargs
        assert kw["socket_timeout"] == 0.25 and kw["socket_connect_timeout"] == 1.5
    finally:
        store.close()
