"""Dev-only tooling: never imported by the library, the client, the daemon or the trainer (tested in
``tests/test_hygiene.py``).

* :mod:`~datacache.devtools.slowfs` -- ``slowfile://``, the NFS stand-in of tests and benchmarks (fsspec
  finds it through the package's ``fsspec.specs`` entry point);
* :mod:`~datacache.devtools.synth` -- synthetic ImageFolders (the demo's dataset, test fixtures);
* :mod:`~datacache.devtools.redis_local` -- real ``redis-server`` processes on loopback (tests,
  benchmarks, ``deploy/local-cluster.sh``), and :mod:`~datacache.devtools.local_status`, its ``status``;
* :mod:`~datacache.devtools.torchvision_shim` -- torchvision's pure-Python ``datasets``/``transforms`` without
  its package ``__init__`` (the drop-in tests' and benchmark's reference on a CPU-only torch).

``redis_local`` and ``local_status`` import the standard library only (``local-cluster.sh`` runs them
with any python3), so this package's ``__init__`` imports nothing.
"""
