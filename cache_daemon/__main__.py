"""``datacache-daemon`` / ``python -m cache_daemon``: the per-node cache daemon.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT drain, or ``--once`` done), 2 for a configuration
error (one line naming the key and the valid values), 3 for a forced stop (the drain did not finish
within ``drain_timeout``, or a second signal: the decode workers were killed), 1 for anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

EPILOG = """\
examples:
  datacache-daemon --config /etc/datacache/daemon.toml
  datacache-daemon --cache redis+cluster://127.0.0.1:7000 --redis-node 127.0.0.1:7000 \\
                   --dataset /mnt/nfs/imagenet/train --short-side 160
  DATACACHE_DAEMON_HTTP_PORT=9000 datacache-daemon --config daemon.toml
  curl -s 127.0.0.1:8470/status; curl -s 127.0.0.1:8470/metrics
  datacache warm /mnt/nfs/imagenet/train --via-daemon http://127.0.0.1:8470   # register at run time

Config keys (TOML, or DATACACHE_DAEMON_<KEY> in the environment): cache, node, redis_node, ownership
(cluster|hash|all), rank, world_size, workers, decoder (pillow|dali), memory_budget, http_host, http_port,
poll_interval, t1_dir, t1_max_bytes, pass_timeout, drain_timeout, verify_interval (seconds an idle pass
trusts "nothing was removed" without checking every key; 0 = always check), api_token / api_token_file,
allowed_sources (URL prefixes POST /datasets may register; comma-separated in the environment),
max_registrations, and [[datasets]] tables (source, short_side 1..2048, encoding, revalidate).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datacache-daemon", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Per-node cache daemon: keeps datasets decoded in the cluster's memory. It ingests the "
                    "samples whose keys this node's Redis master serves (read through T1 -> decode in a "
                    "process pool -> batched writes), resumes where it stopped, stops filling at the node's "
                    "memory budget, reports fill %% per node in Redis, and serves /health, /status and "
                    "/metrics on 127.0.0.1.")
    p.add_argument("--config", help="TOML config file (default /etc/datacache/daemon.toml when it exists)")
    p.add_argument("--cache", help="cache URL, e.g. redis+cluster://h1:7000,h2:7000")
    p.add_argument("--redis-node", help="host:port of the Redis master on this node (cluster ownership)")
    p.add_argument("--node", help="node name in reports (default: the hostname)")
    p.add_argument("--ownership", help="cluster | hash | all")
    p.add_argument("--rank", type=int, help="this daemon's rank (hash ownership)")
    p.add_argument("--world-size", type=int, help="number of daemons (hash ownership)")
    p.add_argument("--workers", type=int, help="decode processes (default: all cores)")
    p.add_argument("--decoder", help="pillow | dali")
    p.add_argument("--memory-budget", help="stop filling this node at this many bytes (e.g. 200GiB)")
    p.add_argument("--http-host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, help="HTTP port (default 8470; 0 = any free port)")
    p.add_argument("--poll-interval", type=float, help="seconds between fill passes (default 30)")
    p.add_argument("--dataset", action="append", default=[], metavar="SOURCE",
                   help="a dataset to keep warm (repeatable; adds to the config's [[datasets]])")
    p.add_argument("--short-side", type=int, default=160,
                   help="short side of --dataset variants (default 160)")
    p.add_argument("--once", action="store_true", help="exit 0 once every dataset is full (or at the budget)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="print the effective configuration as JSON and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def shown_config(cfg: Any) -> dict[str, Any]:
    """``--check``'s view of the effective config: every URL redacted, the API token only as set/unset."""
    from datacache.redact import redact

    shown = asdict(cfg)
    shown["api_token"] = "<set>" if cfg.api_token else ""  # never print the secret itself
    shown["cache"] = redact(cfg.cache)
    shown["allowed_sources"] = [redact(s) for s in cfg.allowed_sources]
    for d in shown["datasets"]:
        d["source"] = redact(d["source"])
    return shown


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from datacache.redact import install_scrub_filter, redact_text

    install_scrub_filter()  # every log line: URL passwords and the secrets read so far masked
    from cache_daemon.daemon_config import DEFAULT_CONFIG, DatasetSpec, load_config
    from datacache.config import ConfigError

    path = args.config or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    keys = ("cache", "redis_node", "node", "ownership", "rank", "world_size", "workers", "decoder",
            "memory_budget", "http_host", "http_port", "poll_interval")
    overrides = {k: getattr(args, k) for k in keys}
    try:
        cfg = load_config(path, overrides=overrides)
        extra = tuple(DatasetSpec.from_dict({"source": s, "short_side": args.short_side}, "--dataset")
                      for s in args.dataset)
        cfg = replace(cfg, datasets=cfg.datasets + extra)
        from datacache.heap import keep_switch

        keep_switch(os.environ)  # DATACACHE_KEEP_FREED_HEAP, read by the decode workers (datacache.heap)
        if args.check:
            print(json.dumps(shown_config(cfg), indent=1, default=str))
            return 0
        from cache_daemon.heap import limit_heap_growth
        from cache_daemon.service import Daemon

        tuned = limit_heap_growth()  # before any thread starts (cache_daemon.heap)
        logging.getLogger("cache_daemon").info("allocator: %s", tuned or "left as is")
        daemon = Daemon(cfg, progress=False if args.no_progress else None)
    except ConfigError as e:
        print(f"datacache-daemon: config error: {redact_text(str(e))}", file=sys.stderr)
        return 2
    return daemon.run(once=args.once)


if __name__ == "__main__":
    sys.exit(main())
