"""Stand-in ``nvidia`` package for tests (a regular package, so it shadows an installed
``nvidia-dali`` whose ``nvidia`` is one too): see ``nvidia.dali`` here."""
