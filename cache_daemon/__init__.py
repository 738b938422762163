"""Per-node cache daemon (ingest ahead of jobs). Thin for now: see `datacache warm`."""
