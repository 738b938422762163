"""Per-node cache daemon: ingest (ownership -> read -> decode pool -> batched writes), fill reports,
/health /status /metrics over HTTP, TOML config. Run ``datacache-daemon --help``."""
