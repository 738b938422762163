"""The ``datacache`` command line: ``demo``, ``warm`` and ``stats``.

Exit codes: 0 ok, 2 usage error (argparse), 1 any other error, reported as one line
(``datacache: error: ...``) without a traceback (``-v`` shows the traceback too).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from collections.abc import Sequence

EPILOG = textwrap.dedent("""\
    examples:
      datacache demo                                  # generated dataset, fresh cache, 3 epochs
      datacache demo --source /mnt/nfs/imagenet/train --cache lmdb:///var/cache/datacache --epochs 2
      datacache warm /mnt/nfs/imagenet/train --cache lmdb:///var/cache/datacache --workers 8
      datacache stats --cache lmdb:///var/cache/datacache
      datacache plan /mnt/nfs/imagenet/train --nodes 16 --memory-per-node 256GiB --short-side 160

    The default cache is lmdb://$XDG_CACHE_HOME/datacache/lmdb (~/.cache when unset).
    In Python: from datacache import CachedImageNet; ds = CachedImageNet(source, cache=...)
    """)


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def _positive(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of samples/s, got {text!r}")
    return v


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _byte_size(text: str) -> int:
    from datacache.cacheurl import parse_bytes

    v = parse_bytes(text)
    if v is None or v < 1:
        raise argparse.ArgumentTypeError(f"expected a byte size such as 50GiB, 500M or 1000000, got {text!r}")
    return v


def _cache_url(text: str) -> str:
    """Parse and check the cache URL while parsing arguments: a bad one is a usage error (exit 2)."""
    from datacache.cacheurl import parse_cache_url
    from datacache.config import ConfigError

    try:
        return parse_cache_url(text, check=True).secret_url  # re-parsed by the command (passwords kept)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_source_options(p: argparse.ArgumentParser) -> None:
    """Options shared by demo and warm: how the listing is revalidated and the T1 disk cache."""
    p.add_argument("--revalidate", choices=("dirs", "full", "none"), default="dirs",
                   help="how a saved listing is checked at start: dirs (default) re-stats directories and "
                        "detects added/removed/atomically replaced files; full re-lists and also detects "
                        "files rewritten in place; none trusts the saved listing")
    p.add_argument("--t1-dir", default="default", metavar="DIR",
                   help="raw-bytes disk cache (T1) for remote sources "
                        "(default: <user cache dir>/datacache/t1; "
                        "'none' disables it)")
    p.add_argument("--t1-max-bytes", type=_byte_size, metavar="SIZE",
                   help="size cap of T1 with LRU trimming, e.g. 50GiB (default: no cap)")
    p.add_argument("--record-key-file", metavar="FILE",
                   help="file holding the cache's record key (the daemons' record_key_file): records and "
                        "quarantine entries carry a keyed MAC and anything else is a miss (default: "
                        "$DATACACHE_RECORD_KEY_FILE if set, else no key; make one with (umask 077; head -c "
                        "32 /dev/urandom | base64 > FILE))")


def _t1_dir(text: str) -> str | None:
    return None if text.lower() == "none" else text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="datacache",
        description="Decode-once sample cache for PyTorch training: JPEGs are read and decoded in the "
                    "first epoch and served from a local LMDB (or Redis) cache afterwards.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser(
        "demo", help="cold -> warm epochs through a DataLoader, with samples/s and hit ratios",
        description="Run a few epochs of CachedImageNet through torch's DataLoader (random-resized-crop + "
                    "flip to uint8 batches in the workers) and print samples/s, hit ratio per tier, "
                    "decode count and the warm-over-cold speed-up. Without --source it generates a small "
                    "ImageNet-like dataset once (~1,000 JPEGs, 500x375) and uses its own LMDB cache, "
                    "cleared at start so the cold epoch always shows.",
        epilog="examples:\n  datacache demo\n  datacache demo --epochs 5 --workers 4 --image-size 224\n"
               "  datacache demo --source /data/train --cache lmdb:///var/cache/datacache",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--source", help="dataset URL/path (ImageFolder or .txt/.csv list); default: generated")
    d.add_argument("--cache", type=_cache_url,
                   help="cache URL (lmdb:///dir[?readonly=1], memory://); default: the demo's own LMDB dir "
                        "(cleared at start)")
    d.add_argument("--epochs", type=_positive, default=3, help="epochs to run (default 3)")
    d.add_argument("--batch-size", type=_positive, default=64, help="batch size (default 64)")
    d.add_argument("--workers", type=_non_negative, default=2, help="DataLoader worker processes (default 2)")
    d.add_argument("--image-size", type=_positive, default=128, help="output crop size in px (default 128)")
    d.add_argument("--short-side", type=_positive, default=160, help="cached short side in px (default 160)")
    d.add_argument("--keep-cache", action="store_true", help="do not clear the demo's own cache at start")
    d.add_argument("--start-method", choices=("fork", "spawn", "forkserver"),
                   help="DataLoader worker start method (default: the platform's)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_source_options(d)
    # hidden: tiny generated datasets for tests
    d.add_argument("--images", type=_positive, default=1000, help=argparse.SUPPRESS)
    d.add_argument("--classes", type=_positive, default=10, help=argparse.SUPPRESS)
    d.add_argument("--gen-size", type=_positive, nargs=2, default=(500, 375), help=argparse.SUPPRESS)

    w = sub.add_parser(
        "warm", help="fill the cache ahead of training (resumable)",
        description="Decode every sample of SOURCE that the cache does not hold yet and write it there, "
                    "with a process pool and a progress bar. Resumable: cached samples are skipped. "
                    "Undecodable files are reported (and remembered, so they are not retried).",
        epilog="example:\n  datacache warm /mnt/nfs/imagenet/train --cache lmdb:///var/cache/datacache "
               "--workers 8",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("source", metavar="SOURCE", help="dataset URL/path (ImageFolder or .txt/.csv list)")
    w.add_argument("--cache", type=_cache_url,
                   help="cache URL (default: lmdb://<user cache dir>/datacache/lmdb)")
    w.add_argument("--workers", type=_positive, default=os.cpu_count() or 1,
                   help="decode processes (default: all cores)")
    w.add_argument("--short-side", type=_positive, default=160, help="cached short side in px (default 160)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    w.add_argument("--via-daemon", metavar="URL",
                   help="do not decode here: register SOURCE with the cache daemons (POST URL/datasets, e.g. "
                        "http://127.0.0.1:8470); every daemon then ingests its own share. Sends the "
                        "daemon's API token from --api-token-file or $DATACACHE_DAEMON_API_TOKEN")
    w.add_argument("--api-token-file", metavar="FILE",
                   help="file holding the daemon's API token (with --via-daemon; default: "
                        "$DATACACHE_DAEMON_API_TOKEN)")
    _add_source_options(w)

    pl = sub.add_parser(
        "plan", help="will the dataset fit the cluster's memory, raw or re-encoded?",
        description="Print bytes per sample and in total for raw-pixel records (with Redis's per-key cost), "
                    "re-encoded JPEG records and the raw files, whether each fits NODES x MEMORY "
                    "(90 %% usable), "
                    "and the recommended encoding. Sizes come from decoding a sample of the files.",
        epilog="example:\n  datacache plan /mnt/nfs/imagenet/train --nodes 16 --memory-per-node 256GiB "
               "--short-side 160",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("source", metavar="SOURCE", help="dataset URL/path (ImageFolder or .txt/.csv list)")
    pl.add_argument("--nodes", type=_positive, required=True, help="cache nodes (Redis masters)")
    pl.add_argument("--memory-per-node", type=_byte_size, required=True, metavar="SIZE",
                    help="memory for the cache on each node, e.g. 256GiB")
    pl.add_argument("--short-side", type=_positive, default=160, help="cached short side in px (default 160)")
    pl.add_argument("--sample", type=_positive, default=64,
                    help="files decoded to measure sizes (default 64)")
    pl.add_argument("--measure-redis", action="store_true",
                    help="also measure the per-key cost on a throwaway redis-server (needs redis-server)")
    pl.add_argument("--train-rate", type=_rate, default=None, metavar="SAMPLES/S",
                    help="the training job's samples/s: the hit ratio to expect with a rolling fill, "
                         "min(1, f + B/R) (docs/cluster.md)")
    pl.add_argument("--fill-rate", type=_rate, default=None, metavar="SAMPLES/S",
                    help="the daemons' fill rate, all nodes together (default: the decode rate measured "
                         "here x --fill-workers x --nodes)")
    pl.add_argument("--fill-workers", type=_positive, default=8,
                    help="decode processes per daemon for the default --fill-rate (default 8)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")

    s = sub.add_parser(
        "stats", help="show what a cache holds",
        description="Print the store's statistics (entries, bytes, map size) and the dataset manifests "
                    "persisted next to it.",
        epilog="example:\n  datacache stats --cache lmdb:///var/cache/datacache",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--cache", type=_cache_url,
                   help="cache URL (default: lmdb://<user cache dir>/datacache/lmdb)")
    return p


def _cmd_demo(args: argparse.Namespace) -> int:
    from datacache.demo import DemoConfig, run_demo

    cfg = DemoConfig(source=args.source, cache=args.cache, epochs=args.epochs, batch_size=args.batch_size,
                     workers=args.workers, image_size=args.image_size, short_side=args.short_side,
                     keep_cache=args.keep_cache, images=args.images, classes=args.classes,
                     gen_size=tuple(args.gen_size), start_method=args.start_method,
                     progress=not args.no_progress, revalidate=args.revalidate, t1_dir=_t1_dir(args.t1_dir),
                     t1_max_bytes=args.t1_max_bytes, record_key_file=args.record_key_file)
    run_demo(cfg)
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    from datacache.config import default_cache_url
    from datacache.heap import keep_freed_heap
    from datacache.warm import warm_cache

    if args.via_daemon:
        return _register_with_daemon(args)
    cache = args.cache or default_cache_url()
    # this process (the LMDB writer) and its decode pool (forked below: inherited) fill batch after batch
    keep_freed_heap()
    rep = warm_cache(args.source, cache, workers=args.workers, short_side=args.short_side,
                     revalidate=args.revalidate, t1_dir=_t1_dir(args.t1_dir), t1_max_bytes=args.t1_max_bytes,
                     progress=not args.no_progress, record_key_file=args.record_key_file)
    print(f"warmed {cache}: {rep.total} samples, decoded {rep.decoded}, skipped {rep.skipped} "
          f"(already cached), quarantined {len(rep.quarantined)}, read {rep.bytes_read / 1e6:.1f} MB"
          + (f", NOT cached: {rep.write_errors} write errors (see the warning above)"
             if rep.write_errors else ""))
    for rel, reason in sorted(rep.quarantined.items())[:20]:
        print(f"  quarantined {rel}: {reason}")
    if len(rep.quarantined) > 20:
        print(f"  ... and {len(rep.quarantined) - 20} more")
    return 0


def _register_with_daemon(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    url = args.via_daemon.rstrip("/") + "/datasets"
    body = json.dumps({"source": args.source, "short_side": args.short_side,
                       "revalidate": args.revalidate}).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get("DATACACHE_DAEMON_API_TOKEN", "")
    if args.api_token_file:
        try:
            with open(args.api_token_file, encoding="utf-8") as f:
                token = f.read(4097).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise OSError(f"{args.api_token_file}: cannot read the API token ({type(e).__name__})") from None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            reply = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise OSError(f"{url}: the daemon refused the dataset ({e.code}: {e.read().decode(errors='replace')})"
                      ) from None
    except urllib.error.URLError as e:
        raise OSError(f"{url}: no daemon answers there ({e.reason}); is datacache-daemon running?") from None
    print(f"registered {reply['registered']} with the daemons at {args.via_daemon}; follow the fill at "
          f"{args.via_daemon.rstrip('/')}/status (CachedImageNet.wait_warm() blocks until it is full)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from datacache.plan import format_plan, plan

    p = plan(args.source, nodes=args.nodes, memory_per_node=args.memory_per_node, short_side=args.short_side,
             sample=args.sample, measure_redis=args.measure_redis, train_rate=args.train_rate,
             fill_rate=args.fill_rate, fill_workers=args.fill_workers)
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from datacache.cacheurl import parse_cache_url
    from datacache.config import default_cache_url
    from datacache.manifest import Manifest, ManifestError
    from datacache.readthrough import manifest_dir_for, shared_store
    from datacache.redact import redact_text

    cache = args.cache or default_cache_url()
    spec = parse_cache_url(cache).store
    if spec.scheme == "lmdb" and not os.path.isdir(spec.location):
        raise FileNotFoundError(f"{cache}: no LMDB cache there yet "
                                f"(run `datacache warm SOURCE --cache {cache}`)")
    store = shared_store(spec)
    st = store.stats()
    if "error" in st:
        raise OSError(f"{spec.url}: cannot read the store ({st['error']})")
    print(f"store {st.get('url', cache)} ({st.get('backend', spec.scheme)})")
    print(f"  entries  {st.get('entries')}")
    if "bytes" in st:
        print(f"  bytes    {int(st['bytes']) / 2**20:.1f} MiB")
    if "map_size" in st:
        print(f"  map size {int(st['map_size']) / 2**30:.2f} GiB")
    mdir = manifest_dir_for(spec)
    files = sorted(f for f in os.listdir(mdir) if f.endswith(".msgpack")) if os.path.isdir(mdir) else []
    print(f"manifests in {mdir}: {len(files)}")
    for f in files:
        try:
            m = Manifest.load(os.path.join(mdir, f))
        except ManifestError as e:
            print(f"  {f}: unreadable ({redact_text(str(e))})")
            continue
        # a source's credentials (user:password@, a SAS sig=...) are never printed
        print(f"  {redact_text(m.root)}: {len(m)} files, {len(m.classes)} classes, fingerprint "
              f"{m.fingerprint}" + (f", ignored {m.ignored}" if m.ignored else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``datacache`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with code 2 on usage errors
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from datacache.redact import install_scrub_filter, redact_text

    install_scrub_filter()  # URL passwords and secrets read from files masked in every log line
    handlers = {"demo": _cmd_demo, "warm": _cmd_warm, "plan": _cmd_plan, "stats": _cmd_stats}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("datacache: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line, no traceback unless -v
        if args.verbose:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not isinstance(e, _user_errors()):
            msg = f"{type(e).__name__}: {msg} (unexpected; run with -v for the traceback)"
        print(f"datacache: error: {redact_text(msg)}", file=sys.stderr)
        return 1


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the input (bad source, cache URL, option, file): reported as one line."""
    from datacache.config import ConfigError
    from datacache.decode import DecodeError
    from datacache.manifest import ManifestError
    from datacache.source import SourceError

    errors: tuple[type[BaseException], ...] = (ManifestError, ConfigError, SourceError, DecodeError, OSError)
    dataset = sys.modules.get("client.dataset")  # only if loaded: importing it would import torch
    return (*errors, dataset.DatasetError) if dataset is not None else errors


if __name__ == "__main__":
    sys.exit(main())
