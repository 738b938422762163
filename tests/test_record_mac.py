"""The optional record key (issue 22, item 4): a keyed MAC on records and quarantine entries.

Key files (clear errors naming the file, never its content; a warning when others may read it), the MAC
itself (restated here from docs/using-the-cache.md as the independent reference: BLAKE2b keyed with a key
derived from the file), what keyed and unkeyed readers accept, the key kept out of reprs and pickles,
and -- against a
real redis-server -- unkeyed, wrongly keyed and forged values written with the trainers' credential being
misses that are repaired, forged quarantine entries not skipping good samples, and a real daemon filling
Redis with the key for CachedImageNet.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import msgpack
import numpy as np
import pytest

from datacache.config import ConfigError, Variant
from datacache.keys import sample_key
from datacache.quarantine import parse_quarantine, quarantine_key, quarantine_value
from datacache.record import decode_record, encode_record, load_record_key
from tests.daemon_procs import daemon_procs, spawn_daemon  # noqa: F401 (autouse fixture)
from tests.redis_utils import needs_redis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = Variant(short_side=16)
VJ = Variant(short_side=16, encoding="jpeg")
K = sample_key("0123456789abcdef", V.tag(), 5)
MATERIAL_A = "Zm9vYmFyYmF6cXV4LXJlY29yZC1rZXktQS0xMjM0NTY3OA=="  # 48 characters
MATERIAL_B = "b3RoZXIta2V5LWZvci10aGUtc2FtZS1jYWNoZS1CLTk4NzY="


def key_file(path, material: str = MATERIAL_A, mode: int = 0o600) -> str:
    path.write_text(material + "\n")
    os.chmod(path, mode)
    return str(path)


def reference_mac(material: str, key: bytes, hdr: dict, payload: bytes) -> bytes:
    """docs/using-the-cache.md: BLAKE2b-128 keyed with BLAKE2b-256(material, person "dc-record-key"),
    personalised "dc-record-v3", over len(key):key, "v:h:w:c:uint8:label:enc:n:" and the payload."""
    k = hashlib.blake2b(material.encode(), digest_size=32, person=b"dc-record-key").digest()
    m = hashlib.blake2b(key=k, digest_size=16, person=b"dc-record-v3")
    m.update(b"%d:" % len(key) + key)
    fields = (hdr["v"], hdr["h"], hdr["w"], hdr["c"], "uint8", hdr["label"], hdr["enc"], hdr["n"])
    m.update("".join(f"{x}:" for x in fields).encode())
    m.update(payload)
    return m.digest()


def split(rec: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(rec[:4], "little")
    return msgpack.unpackb(rec[4:4 + n]), rec[4 + n:]


def join(hdr: dict, payload: bytes) -> bytes:
    h = msgpack.packb(hdr, use_bin_type=True)
    return len(h).to_bytes(4, "little") + h + payload


# ------------------------------------------------------------------------------------ key files
def test_key_file_errors_name_the_file_never_the_content(tmp_path) -> None:
    short = key_file(tmp_path / "short", "s3cr3t-but-only-31-characters!!")
    with pytest.raises(ConfigError) as ei:
        load_record_key(short)
    msg = str(ei.value)
    assert short in msg and "head -c 32 /dev/urandom" in msg and "s3cr3t" not in msg
    with pytest.raises(ConfigError, match="cannot read it"):
        load_record_key(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a regular file"):
        load_record_key(str(tmp_path))
    big = tmp_path / "big"
    big.write_text("x" * 5000)
    with pytest.raises(ConfigError) as ei:
        load_record_key(str(big))
    assert "xxxx" not in str(ei.value)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    result: list[BaseException] = []
    def refuse() -> None:
        with pytest.raises(ConfigError) as e:
            load_record_key(fifo)
        result.append(e.value)

    t = threading.Thread(target=refuse, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and "not a regular file" in str(result[0])  # refused, never blocks on the FIFO
    open_to_all = key_file(tmp_path / "shared", mode=0o644)  # refused (issue 35), no longer a warning
    with pytest.raises(ConfigError) as ei:
        load_record_key(open_to_all)
    msg = str(ei.value)
    assert open_to_all in msg and "chmod 600" in msg and "\n" not in msg and MATERIAL_A not in msg


def test_key_material_is_stripped_and_read_once_per_process(tmp_path) -> None:
    a = load_record_key(key_file(tmp_path / "a", "  " + MATERIAL_A + " \n\n"))
    b = load_record_key(key_file(tmp_path / "b", MATERIAL_A))
    c = load_record_key(key_file(tmp_path / "c", MATERIAL_B))
    assert a == b and a.key_id == b.key_id and a != c
    (tmp_path / "a").write_text(MATERIAL_B)  # changed after the first read: this process keeps its key
    assert load_record_key(str(tmp_path / "a")) is a


def test_key_bytes_stay_out_of_repr_and_pickles(tmp_path, small_imagefolder) -> None:
    from client.dataset import CachedImageNet

    path = key_file(tmp_path / "k")
    rk = load_record_key(path)
    derived = hashlib.blake2b(MATERIAL_A.encode(), digest_size=32, person=b"dc-record-key").digest()
    for text in (repr(rk), str(rk)):
        assert MATERIAL_A not in text and derived.hex() not in text and path in text
    ds = CachedImageNet(small_imagefolder, cache=f"lmdb://{tmp_path}/c", short_side=16, t1_dir=None,
                        record_key_file=path)
    for obj in (rk, ds.reader, ds):
        blob = pickle.dumps(obj)
        assert MATERIAL_A.encode() not in blob and derived not in blob and path.encode() in blob
    assert pickle.loads(pickle.dumps(rk)) == rk and pickle.loads(pickle.dumps(ds.reader)).record_key == rk
    assert MATERIAL_A not in repr(ds) and MATERIAL_A not in str(ds.stats())


def test_unpickling_refuses_a_key_file_that_changed(tmp_path) -> None:
    """A spawned worker reads the key file itself: if it now holds another key, it refuses (ConfigError)
    instead of writing records no other process accepts."""
    path = key_file(tmp_path / "k")
    blob = tmp_path / "rk.pickle"
    blob.write_bytes(pickle.dumps(load_record_key(path)))
    code = textwrap.dedent(f"""
        import pickle, sys
        from datacache.config import ConfigError
        try:
            pickle.loads(open({str(blob)!r}, "rb").read())
        except ConfigError as e:
            print("REFUSED", e)
        else:
            print("LOADED")
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    same = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert same.stdout.startswith("LOADED"), same.stderr
    key_file(tmp_path / "k", MATERIAL_B)
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert other.stdout.startswith("REFUSED") and "another key" in other.stdout and path in other.stdout
    assert MATERIAL_A not in other.stdout + other.stderr and MATERIAL_B not in other.stdout + other.stderr


# ------------------------------------------------------------------------------------ record MACs
def test_keyed_records_carry_a_blake2b_mac_over_every_field(tmp_path) -> None:
    rk = load_record_key(key_file(tmp_path / "k"))
    other = load_record_key(key_file(tmp_path / "o", MATERIAL_B))
    px = np.random.default_rng(0).integers(0, 256, (16, 21, 3), dtype=np.uint8)
    for variant in (V, VJ):
        rec = encode_record(px, 9, variant, key=K, record_key=rk)
        hdr, payload = split(rec)
        assert set(hdr) == {"v", "h", "w", "c", "dtype", "label", "enc", "n", "mac", "xxh3"}
        assert hdr["mac"] == reference_mac(MATERIAL_A, K, hdr, payload)  # a real keyed MAC, as documented
        got = decode_record(rec, K, variant, record_key=rk)
        assert got is not None and got[1] == 9 and got[0].shape == (16, 21, 3)
        # trainers read, daemons write: an unkeyed reader (a trainer) reads a keyed writer's record by its
        # xxh3 -- and still refuses one whose checksum does not hold
        plain = decode_record(rec, K, variant)
        assert plain is not None and plain[1] == 9 and np.array_equal(plain[0], got[0])
        assert decode_record(join({**hdr, "xxh3": hdr["xxh3"] ^ 1}, payload), K, variant) is None
        assert decode_record(rec, K + b"0", variant) is None
        # the previous keyed layout (the MAC alone): a keyed reader's hit, an unkeyed reader's miss
        mac_only = join({f: v for f, v in hdr.items() if f != "xxh3"}, payload)
        assert decode_record(mac_only, K, variant, record_key=rk) is not None
        assert decode_record(mac_only, K, variant) is None
        assert decode_record(rec, K, variant, record_key=other) is None    # another key: a miss
        assert decode_record(rec, K + b"0", variant, record_key=rk) is None  # under another key
        unkeyed = encode_record(px, 9, variant, key=K)
        assert decode_record(unkeyed, K, variant, record_key=rk) is None   # keyed reader, xxh3 record
        for field, value in (("label", 8), ("h", 21), ("w", 16), ("n", hdr["n"]), ("v", 3), ("c", 3),
                             ("enc", "raw" if variant.encoding == "jpeg" else "jpeg")):
            if hdr[field] == value:
                continue
            assert decode_record(join({**hdr, field: value}, payload), K, variant, record_key=rk) is None
        assert decode_record(join({**hdr, "mac": bytes(16)}, payload), K, variant, record_key=rk) is None
        flipped = bytearray(payload)
        flipped[len(flipped) // 2] ^= 4
        assert decode_record(join(hdr, bytes(flipped)), K, variant, record_key=rk) is None
        # the best a writer without the key can do: other pixels under a valid xxh3 (made by the unkeyed
        # encoder) with the genuine record's MAC copied in -- a keyed reader's miss
        other_px = encode_record(px ^ 1, 9, variant, key=K)
        assert decode_record(join({**split(other_px)[0], "mac": hdr["mac"]}, split(other_px)[1]), K, variant,
                             record_key=rk) is None


def test_quarantine_entries_carry_a_mac_with_a_key(tmp_path) -> None:
    rk = load_record_key(key_file(tmp_path / "k"))
    other = load_record_key(key_file(tmp_path / "o", MATERIAL_B))
    path, ident = "c000/1.JPEG", "1234:5678:"
    qk = quarantine_key(V.tag(), path, ident)
    keyed = quarantine_value(path, ident, "cannot decode: x (OSError)", qkey=qk, record_key=rk)
    assert parse_quarantine(keyed, path, ident, qkey=qk, record_key=rk) == "cannot decode: x (OSError)"
    # an unkeyed reader (a trainer: only writers can write entries) reads a keyed writer's entry
    assert parse_quarantine(keyed, path, ident, qkey=qk) == "cannot decode: x (OSError)"
    assert parse_quarantine(keyed, path, ident, qkey=qk, record_key=other) is None  # another key
    qk2 = quarantine_key("s32m64bilinear-raw", path, ident)
    assert parse_quarantine(keyed, path, ident, qkey=qk2, record_key=rk) is None    # moved to another key
    unkeyed = quarantine_value(path, ident, "cannot decode: forged")
    assert parse_quarantine(unkeyed, path, ident, qkey=qk, record_key=rk) is None   # forged: ignored
    assert parse_quarantine(unkeyed, path, ident, qkey=qk) == "cannot decode: forged"
    d = msgpack.unpackb(keyed)
    for change in ({"reason": "cannot decode: other"}, {"path": "c000/2.JPEG"}, {"id": "1:2:"},
                   {"mac": bytes(16)}, {"mac": "text"}, {"extra": 1}):
        assert parse_quarantine(msgpack.packb({**d, **change}), path, ident, qkey=qk, record_key=rk) is None
    for junk in (b"", b"\xc1", b"\x00" * 40, pickle.dumps(d)):
        assert parse_quarantine(junk, path, ident, qkey=qk, record_key=rk) is None


# ------------------------------------------------------------------------------------ real Redis
def _ref_pixels(root: str, rel: str, variant: Variant) -> np.ndarray:
    from datacache.decode import decode_image

    with open(os.path.join(root, rel), "rb") as f:
        return decode_image(f.read(), variant)


@needs_redis
def test_unkeyed_and_wrongly_keyed_records_in_redis_are_misses_and_repaired(tmp_path, redis_url,
                                                                           redis_server,
                                                                           imagefolder_factory) -> None:
    """The trainers' credential writes (a) a valid *unkeyed* record with the right pixels and label, (b) a
    record MAC'd with another key, (c) the 1x1x1 forgery: a keyed reader serves the real samples, rewrites
    all three with its MAC, and a second keyed process only hits."""
    import redis

    from client.dataset import CachedImageNet

    root = imagefolder_factory(classes=2, per_class=2, size=(60, 45))
    path = key_file(tmp_path / "k")
    ds = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file=path)
    other = load_record_key(key_file(tmp_path / "o", MATERIAL_B))
    r = redis.Redis(port=redis_server.port)
    lab = [int(x) for x in ds.manifest.labels]
    px = [_ref_pixels(root, p, ds.variant) for p in ds.manifest.paths]
    r.set(ds.key(0), encode_record(px[0], lab[0], ds.variant, key=ds.key(0)))
    r.set(ds.key(1), encode_record(px[1], lab[1], ds.variant, key=ds.key(1), record_key=other))
    forged = msgpack.packb({"v": 3, "h": 1, "w": 1, "c": 1, "dtype": "uint8", "label": lab[2], "enc": "raw",
                            "n": 1, "mac": bytes(16)}, use_bin_type=True)
    r.set(ds.key(2), len(forged).to_bytes(4, "little") + forged + b"\x00")
    out = ds.__getitems__([0, 1, 2, 3])
    for i, (img, label) in enumerate(out):
        assert label == lab[i] and np.array_equal(img.permute(1, 2, 0).numpy(), px[i]), i
    st = ds.stats()
    assert st["t2"]["invalid_rewritten"] == 3 and st["decoded"] == 4
    assert ds.flush(30)
    rk = load_record_key(path)
    for i in range(4):
        value = r.get(ds.key(i))
        assert decode_record(value, ds.key(i), ds.variant, record_key=rk) is not None
        assert decode_record(value, ds.key(i), ds.variant) is not None  # readable without the key
    ds2 = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file=path)
    ds2.__getitems__([0, 1, 2, 3])
    assert ds2.stats()["decoded"] == 0 and ds2.stats()["hits"] == 4


@needs_redis
def test_forged_quarantine_entries_do_not_skip_good_samples(tmp_path, redis_url, redis_server,
                                                            imagefolder_factory, monkeypatch) -> None:
    """Forged entries (unkeyed, another key) under the quarantine keys of good files: with a record key
    the samples are decoded normally -- by CachedImageNet and by ``datacache warm`` -- and a genuinely
    bad file's forged entry is replaced by a real one."""
    import redis

    from client.dataset import CachedImageNet
    from datacache.readthrough import ReadThrough
    from datacache.warm import warm_cache

    root = imagefolder_factory(classes=2, per_class=3, size=(60, 45))
    with open(os.path.join(root, "c000", "zz-bad.JPEG"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0" + b"\x13" * 500)  # complete bytes, undecodable: remembered
    path = key_file(tmp_path / "k")
    monkeypatch.setenv("DATACACHE_RECORD_KEY_FILE", path)  # the default of CachedImageNet and warm
    ds = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None)
    assert ds.reader.record_key == load_record_key(path)
    other = load_record_key(key_file(tmp_path / "o", MATERIAL_B))
    r = redis.Redis(port=redis_server.port)
    man = ds.manifest
    bad = list(man.paths).index("c000/zz-bad.JPEG")
    for i in range(len(ds)):
        qk = ds.reader.qkey(i)
        forged = (quarantine_value(man.paths[i], man.identity(i), "cannot decode: forged") if i % 2 else
                  quarantine_value(man.paths[i], man.identity(i), "cannot decode: forged", qkey=qk,
                                   record_key=other))
        r.set(qk, forged)
    rep = warm_cache(root, redis_url, workers=1, short_side=16, t1_dir=None, progress=False)
    assert rep.decoded == len(ds) - 1 and list(rep.quarantined) == ["c000/zz-bad.JPEG"]
    out = ds.__getitems__(list(range(len(ds))))
    good = [i for i in range(len(ds)) if i != bad]
    for i in good:
        assert np.array_equal(out[i][0].permute(1, 2, 0).numpy(), _ref_pixels(root, man.paths[i], ds.variant))
    st = ds.stats()  # warm filled every good sample; the bad one is substituted (one more lookup)
    assert st["decoded"] == 0 and st["hits"] == len(good) + 1 and st["substituted"] == 1
    assert st["t2"]["known_bad"] == 1 and list(ds.quarantined) == ["c000/zz-bad.JPEG"]
    assert "forged" not in ds.quarantined["c000/zz-bad.JPEG"]
    entry = r.get(ds.reader.qkey(bad))  # replaced: a real, keyed verdict
    assert ds.reader.parse_known_bad(bad, entry) is not None and b"forged" not in entry
    # a reader with no record key (a trainer; the environment's default is off here) trusts the writers'
    # real entry -- and a writer without the key would not (no valid entry: the file is decoded again)
    ds_none = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file="")
    assert ds_none.reader.record_key is None and ds_none.reader.parse_known_bad(bad, entry) is not None
    assert not ReadThrough(man, ds.variant, ds.cache_spec, writer=True).trusted_bad(bad, entry)


@needs_redis
def test_wait_warm_does_not_count_forged_quarantine_entries(tmp_path, redis_url, redis_server,
                                                            imagefolder_factory, monkeypatch) -> None:
    """wait_warm's spot check (sample_missing): with a record key, a forged quarantine entry under an
    uncached sample's key does not make that sample count as present; a real, keyed one does."""
    import redis

    from client.dataset import CachedImageNet
    from datacache.fillstatus import sample_missing

    root = imagefolder_factory(classes=2, per_class=3, size=(60, 45))
    monkeypatch.setenv("DATACACHE_RECORD_KEY_FILE", key_file(tmp_path / "k"))
    ds = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None)
    reader, man, r = ds.reader, ds.manifest, redis.Redis(port=redis_server.port)
    for i in range(len(ds)):  # nothing cached; every sample "quarantined" by an unkeyed forgery
        r.set(reader.qkey(i), quarantine_value(man.paths[i], man.identity(i), "cannot decode: forged"))

    def check() -> dict[str, int]:
        return sample_missing(reader.store, len(ds), reader.keys, lambda idx: [reader.qkey(i) for i in idx],
                              reader.parse_known_bad)

    assert check() == {"checked": len(ds), "missing": len(ds)}
    # existence alone (the old check) would have said nothing is missing
    assert sample_missing(reader.store, len(ds), reader.keys, lambda idx: [reader.qkey(i) for i in idx]
                          )["missing"] == 0
    for i in range(len(ds)):  # genuine, keyed verdicts count
        r.set(reader.qkey(i), reader.remember_bad(i, "cannot decode (OSError)")[1])
    assert check() == {"checked": len(ds), "missing": 0}


# ------------------------------------------------------------------------------------ a real daemon
@needs_redis
def test_daemon_fills_redis_with_keyed_records_for_cached_imagenet(tmp_path, redis_url, redis_server,
                                                                 imagefolder_factory) -> None:
    import redis

    from client.dataset import CachedImageNet
    from datacache.readthrough import ReadThrough

    root = imagefolder_factory(classes=2, per_class=5, size=(60, 45))
    with open(os.path.join(root, "c001", "zz-bad.JPEG"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0" + b"\x13" * 500)
    path = key_file(tmp_path / "k")
    log = tmp_path / "daemon.log"
    p = spawn_daemon(["--poll-interval", "0.3", "--cache", redis_url, "--dataset", root, "--short-side", "16",
                      "--http-port", "0", "--once"], str(log), env={"DATACACHE_DAEMON_RECORD_KEY_FILE": path})
    assert p.wait(180) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert MATERIAL_A not in text
    rk = load_record_key(path)
    ds = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None, record_key_file=path)
    r = redis.Redis(port=redis_server.port)
    keys = [k for k in r.scan_iter("dc:*")]
    assert len(keys) == len(ds) - 1
    for k in keys:  # every record the daemon's decode workers wrote carries the MAC
        value = r.get(k)
        assert decode_record(value, k, ds.variant, record_key=rk) is not None
        assert decode_record(value, k, ds.variant) is not None  # trainers need no key to read them
    bad = list(ds.manifest.paths).index("c001/zz-bad.JPEG")
    entry = r.get(ds.reader.qkey(bad))
    assert entry is not None and ds.reader.parse_known_bad(bad, entry) is not None
    assert ReadThrough(ds.manifest, ds.variant, ds.cache_spec).parse_known_bad(bad, entry) is not None
    out = ds.__getitems__(list(range(len(ds))))
    st = ds.stats()
    assert st["decoded"] == 0 and st["t2"]["known_bad"] == 1 and st["substituted"] == 1
    assert list(ds.quarantined) == ["c001/zz-bad.JPEG"] and len(out) == len(ds)
    # a process with another key decodes (misses) instead of trusting the daemon's records
    other = CachedImageNet(root, cache=redis_url, short_side=16, t1_dir=None,
                           record_key_file=key_file(tmp_path / "o", MATERIAL_B))
    other.__getitems__([0])
    assert other.stats()["decoded"] == 1 and other.stats()["hits"] == 0


def test_cli_and_trainer_take_a_record_key_file(tmp_path, small_imagefolder, monkeypatch) -> None:
    from client.dataset import CachedImageNet
    from datacache.cli import main
    from trainer.cli import build_parser
    from trainer.run import open_data
    from trainer.train_config import make_config

    path = key_file(tmp_path / "k")
    cache = f"lmdb://{tmp_path}/c"
    assert main(["warm", small_imagefolder, "--cache", cache, "--short-side", "16", "--workers", "1",
                 "--no-progress", "--t1-dir", "none", "--record-key-file", path]) == 0
    keyed = CachedImageNet(small_imagefolder, cache=cache, short_side=16, t1_dir=None, record_key_file=path)
    keyed.__getitems__(list(range(len(keyed))))
    assert keyed.stats()["decoded"] == 0  # warm's pool workers wrote MAC'd records
    seen: list = []
    real_init = CachedImageNet.__init__

    def spy(self, *a, **kw):  # type: ignore[no-untyped-def]
        real_init(self, *a, **kw)
        seen.append(self.reader.record_key)

    monkeypatch.setattr(CachedImageNet, "__init__", spy)
    assert main(["demo", "--source", small_imagefolder, "--cache", cache, "--epochs", "1", "--workers", "0",
                 "--batch-size", "8", "--image-size", "16", "--short-side", "16", "--no-progress", "--t1-dir",
                 "none", "--record-key-file", path]) == 0
    monkeypatch.undo()
    assert seen == [load_record_key(path)]
    args = build_parser().parse_args(["train", "--data", small_imagefolder, "--record-key-file", path])
    assert args.record_key_file == path
    cfg = make_config(data=small_imagefolder, cache=cache, short_side=16, record_key_file=path)
    data = open_data(cfg)
    assert data.train.reader.record_key == load_record_key(path)
    data.train.__getitems__([0, 1])
    assert data.train.stats()["decoded"] == 0
    missing = make_config(data=small_imagefolder, cache=cache, short_side=16,
                          record_key_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="record_key_file"):
        open_data(missing)


def test_daemon_config_reads_and_checks_the_key_file(tmp_path) -> None:
    from cache_daemon.daemon_config import load_config

    good = key_file(tmp_path / "k")
    cfg = load_config(None, env={"DATACACHE_DAEMON_CACHE": "redis://127.0.0.1:1",
                                 "DATACACHE_DAEMON_RECORD_KEY_FILE": good})
    assert cfg.record_key_file == good and MATERIAL_A not in repr(cfg)
    short = key_file(tmp_path / "short", "x" * 20)
    with pytest.raises(ConfigError) as ei:
        load_config(None, env={"DATACACHE_DAEMON_CACHE": "redis://127.0.0.1:1",
                               "DATACACHE_DAEMON_RECORD_KEY_FILE": short})
    assert "record_key_file" in str(ei.value) and short in str(ei.value) and "x" * 20 not in str(ei.value)


def _as_list(batch):  # type: ignore[no-untyped-def]
    return batch  # module level: picklable for spawn


def test_spawned_dataloader_workers_read_the_key_file_themselves(tmp_path, small_imagefolder) -> None:
    """A spawn worker receives the dataset pickled (the key's path and id only) and reads the key file
    itself: it serves the keyed records as hits, and what it writes carries the MAC."""
    import torch

    from client.dataset import CachedImageNet

    path = key_file(tmp_path / "k")
    cache = f"lmdb://{tmp_path}/c"
    ds = CachedImageNet(small_imagefolder, cache=cache, short_side=16, t1_dir=None, record_key_file=path)
    half = len(ds) // 2
    ds.__getitems__(list(range(half)))  # the parent fills the first half
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn",
                                         collate_fn=_as_list)
    assert sum(len(b) for b in loader) == len(ds)
    st = ds.stats()  # the worker's counters: hits for the parent's half, decodes (keyed writes) for the rest
    assert st["processes"] >= 1 and st["decoded"] == len(ds) and st["hits"] == len(ds) - half
    again = CachedImageNet(small_imagefolder, cache=cache, short_side=16, t1_dir=None, record_key_file=path)
    again.__getitems__(list(range(len(again))))
    assert again.stats()["decoded"] == 0


class _BatchDecoder:
    """Stands in for cache_daemon.decoders.DaliDecoder (not installable here): a batch backend of its own
    family with ``prepare``; module level, so it pickles into the decode pool like the real one."""

    family = "dali"

    def __init__(self) -> None:
        self.prepared = 0

    def prepare(self, datas, variant) -> None:  # type: ignore[no-untyped-def]
        self.prepared += 1

    def __call__(self, data: bytes, variant: Variant, *, name: str = "") -> np.ndarray:
        from datacache.decode import decode_image

        return decode_image(data, variant, name=name)


def test_decode_pool_workers_of_a_batch_backend_mac_what_they_encode(tmp_path, small_imagefolder) -> None:
    """The daemon's path: fill_missing with a decode pool and a batch (DALI-like) backend; every record the
    pool workers encode carries the MAC."""
    from datacache.cacheurl import parse_cache_url
    from datacache.manifest import Manifest
    from datacache.readthrough import ReadThrough
    from datacache.warm import fill_missing

    path = key_file(tmp_path / "k")
    spec = parse_cache_url(f"lmdb://{tmp_path}/c")
    variant = Variant(short_side=16, decoder_family="dali")
    reader = ReadThrough(Manifest.build(small_imagefolder), variant, spec, t1_dir=None, record_key_file=path)
    n = len(reader.manifest)
    rep = fill_missing(reader, range(n), workers=1, decoder=_BatchDecoder(), progress=False)
    assert rep.decoded == rep.written == n
    rk = load_record_key(path)
    keys = reader.keys(range(n))
    for k, v in zip(keys, reader.store.get_many(keys)):
        assert decode_record(v, k, variant, record_key=rk) is not None
        assert decode_record(v, k, variant) is not None  # beside the MAC, the xxh3 of an unkeyed reader
