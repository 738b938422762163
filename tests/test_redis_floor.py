"""The declared redis-py floor (``redis>=5.0``) works: the read path passes ``command_name`` to
``ConnectionPool.get_connection`` where the installed version's signature requires it (5.0-5.2) and
leaves it out where it is optional and deprecated (5.3+).

The guard runs the real read path against a real redis-server with a pool class whose
``get_connection`` has the 5.0-5.2 signature (a required ``command_name``), and with one that has the
5.3+ signature, so it fails on code that assumes either version whatever redis-py CI installs.
Verified by hand with redis-py 5.0.8, 5.2.1 and 8.1.0 (tests/test_redis_stores.py passes with each).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from datacache.stores import open_store
from tests.redis_utils import needs_redis

pytestmark = needs_redis


def _pool_class(required: bool) -> type:
    import redis

    base = redis.ConnectionPool
    # the installed redis-py's own requirement, for the call the fake pools forward to it
    base_param = inspect.signature(base.get_connection).parameters["command_name"]
    base_args = ("GET",) if base_param.default is inspect.Parameter.empty else ()

    if required:
        class OldPool(base):  # redis-py 5.0-5.2: get_connection(self, command_name, *keys, **options)
            def get_connection(self, command_name, *keys, **options):  # type: ignore[override]
                assert isinstance(command_name, str) and command_name, "command_name is required"
                return super().get_connection(*base_args)
        return OldPool

    class NewPool(base):  # redis-py 5.3+: command_name optional, passing it is deprecated
        def get_connection(self, command_name=None, *keys, **options):  # type: ignore[override]
            if command_name is not None:
                warnings.warn("command_name is deprecated", DeprecationWarning, stacklevel=2)
            return super().get_connection(*base_args)
    return NewPool


@pytest.mark.parametrize("required", [True, False], ids=["redis5.0-5.2", "redis5.3+"])
def test_reads_work_with_either_get_connection_signature(redis_url: str, redis_server,
                                                        required: bool) -> None:
    import redis

    store = open_store(redis_url)
    try:
        store.put_many([(b"dc:floor:%d" % i, b"v%d" % i) for i in range(5)])
        client: Any = store.client()
        cls = _pool_class(required)
        client.connection_pool = cls(host="127.0.0.1", port=redis_server.port, db=0)
        assert isinstance(client.connection_pool, redis.ConnectionPool)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            got = store.get_many([b"dc:floor:%d" % i for i in range(6)])
        assert [None if g is None else bytes(g) for g in got] == [b"v%d" % i for i in range(5)] + [None]
    finally:
        store.close()
