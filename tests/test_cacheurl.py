"""One parser for cache URLs (issue 9, item 10) and the refusal of network filesystems for LMDB (item 9)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from datacache import fscheck
from datacache.cacheurl import parse_bytes, parse_cache_url
from datacache.config import ConfigError
from datacache.stores import open_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_normalises_and_types_options(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = parse_cache_url("lmdb://~/cache?readonly=1&max_map_size=2GiB&map_size=65536").store
    assert (spec.scheme, spec.location) == ("lmdb", f"{tmp_path}/cache")  # ~ expanded, not in the path
    assert spec.opts == {"readonly": True, "max_map_size": 2 << 30, "map_size": 65536}
    assert spec.url == f"lmdb://{tmp_path}/cache?map_size=65536&max_map_size=2147483648&readonly=1"
    monkeypatch.chdir(tmp_path)
    assert parse_cache_url("lmdb://rel").store.location == f"{tmp_path}/rel"  # absolute in the parent
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert open_store(parse_cache_url("memory://").store).url == "memory://"
    assert (parse_bytes("4GiB"), parse_bytes("1.5k"), parse_bytes("12"), parse_bytes("x")) == (4 << 30, 1500,
                                                                                              12, None)


@pytest.mark.parametrize(("url", "words"), [
    ("bogus://x", ["unknown scheme 'bogus'", "lmdb://", "memory://"]),
    ("/var/cache/x", ["no scheme", "did you mean lmdb:///var/cache/x"]),
    ("lmdb://", ["needs a directory"]),
    ("lmdb:///c?readonly=maybe", ["readonly='maybe'", "true"]),
    ("lmdb:///c?map_size=big", ["map_size='big'", "512MiB"]),
    ("lmdb:///c?mapsize=1", ["unknown option 'mapsize'", "max_map_size", "readonly"]),
    ("lmdb:///c?readonly=1&readonly=0", ["given twice"]),
    ("lmdb:///c?max_readers=0", ["max_readers=0 must be >= 1"]),
    ("memory://?fetch_bytes=-3", ["fetch_bytes"]),
    ("lmdb:///a::lmdb:///a", ["same tier twice"]),
    ("::".join(f"lmdb:///t{i}" for i in range(5)), ["chains 5 tiers", "at most 4"]),
    ("redis://127.0.0.1", ["not host:port"]),
    ("redis://127.0.0.1:6379/zero", ["database 'zero' must be a number"]),
    ("redis+cluster://h1:7000,h2", ["'h2' is not host:port"]),
    ("redis+cluster://h1:7000/0", ["no database number"]),
    ("redis://@h:1", ["user:password@"]),
    ("redis://h:1?socket_timeout=soon", ["socket_timeout='soon'", "a number"]),
    ("redis://h:1?tls=1", ["unknown option 'tls'", "ssl_ca_certs"]),
    ("lmdb:///a::bogus://b", ["unknown scheme 'bogus'"]),
    ("", ["non-empty"]),
])
def test_bad_urls_name_the_bad_part(url: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_cache_url(url)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_bad_url_fails_at_construction_not_in_a_worker(small_imagefolder: str) -> None:
    from client.dataset import CachedImageNet

    with pytest.raises(ConfigError, match=r"unknown scheme 'bogus'.*valid schemes: .*lmdb://, memory://"):
        CachedImageNet(small_imagefolder, cache="bogus://x")
    proc = subprocess.run([sys.executable, "-m", "datacache.cli", "demo", "--cache", "bogus://x"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown scheme 'bogus'" in proc.stderr and "lmdb://" in proc.stderr
    assert "DataLoader worker" not in proc.stderr and "Traceback" not in proc.stderr


def test_filesystem_type_of_real_mounts_and_mountinfo() -> None:
    assert fscheck.filesystem_type("/proc") == "proc" or fscheck.filesystem_type("/proc").startswith("0x")
    if os.path.isdir("/dev/shm"):
        assert fscheck.filesystem_type("/dev/shm/does/not/exist/yet") == "tmpfs"  # nearest existing ancestor
    text = ("22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
            "40 22 0:40 / /home rw,relatime - nfs4 srv:/export/home rw,vers=4.2\n"
            "41 40 0:41 / /home/u/sshfs rw - fuse.sshfs u@h:/ rw\n"
            "42 22 0:42 / /mnt/my\\040disk rw - xfs /dev/sdb rw\n")
    assert fscheck.parse_mountinfo(text, "/home/u/.cache/datacache/lmdb") == "nfs4"
    assert fscheck.parse_mountinfo(text, "/home/u/sshfs/x") == "fuse.sshfs"
    assert fscheck.parse_mountinfo(text, "/homework") == "ext4"  # a prefix of the string is not a mount
    assert fscheck.parse_mountinfo(text, "/mnt/my disk/c") == "xfs"
    for t in ("nfs", "nfs4", "cifs", "smb3", "fuse", "fuse.sshfs", "9p", "ceph", "lustre"):
        assert fscheck.is_network_filesystem(t), t
    for t in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs"):
        assert not fscheck.is_network_filesystem(t), t


def test_lmdb_cache_on_a_network_filesystem_is_refused(small_imagefolder: str, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS cannot be mounted here, so the kernel's answer for the cache directory is replaced;
    everything else (parser, check, CachedImageNet, warm) is the real code path."""
    from client.dataset import CachedImageNet
    from datacache.warm import warm_cache

    nfs_home = str(tmp_path / "home")
    monkeypatch.setattr(fscheck, "filesystem_type", lambda p: "nfs4" if p.startswith(nfs_home) else "ext4")
    url = f"lmdb://{nfs_home}/.cache/datacache/lmdb"
    for make in (lambda: CachedImageNet(small_imagefolder, cache=url),
                 lambda: warm_cache(small_imagefolder, url, progress=False)):
        with pytest.raises(ConfigError) as ei:
            make()
        msg = str(ei.value)
        assert f"{nfs_home}/.cache/datacache/lmdb" in msg and "nfs4" in msg
        assert "lmdb:///local/disk/path" in msg
    assert not os.path.exists(nfs_home)  # refused before anything was created
    CachedImageNet(small_imagefolder, cache=f"lmdb://{tmp_path}/local", short_side=32,
                   t1_dir=None)  # local: fine
