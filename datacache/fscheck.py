"""Which filesystem holds a path, and refusing network filesystems for LMDB.

LMDB needs a local disk: its lock file is a shared memory map whose reader table and mutexes
are updated by every process, and its data file is memory-mapped. On NFS, SMB/CIFS, FUSE and
other network or user-space filesystems the map is not coherent between hosts and fcntl/robust
mutex semantics are not what LMDB relies on ("LMDB does not work on network filesystems", its
documentation says), so a cache there corrupts silently. The default cache lives under
``~/.cache``, which on clusters is often an NFS home directory: :func:`require_local_disk`
refuses such a location with an error naming the path and what to pass instead.

:func:`filesystem_type` asks the kernel with ``statfs(2)`` (``f_type`` magic, through ctypes:
Python's ``os.statvfs`` has no type field) for the nearest existing ancestor of the path and
names FUSE sub-types (``fuse.sshfs``) from ``/proc/self/mountinfo``; where ``statfs`` is not
available it falls back to ``mountinfo`` alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from datacache.config import ConfigError

# linux/magic.h
MAGIC_NAMES = {
    0x6969: "nfs", 0x517B: "smb", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x65735546: "fuse",
    0x01021997: "9p", 0x00C36400: "ceph", 0x5346414F: "afs", 0x6B414653: "afs", 0x73757245: "coda",
    0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs",
    0x01021994: "tmpfs", 0x794C7630: "overlay", 0x2FC12FC1: "zfs", 0xF2F52010: "f2fs", 0x858458F6: "ramfs",
}
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "smb", "smb2", "smb3", "cifs", "fuse", "fuseblk", "9p", "ceph",
                       "afs", "coda", "lustre", "gpfs", "glusterfs", "beegfs", "sshfs", "davfs", "s3fs")


def nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists (a cache directory may not exist yet)."""
    p = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _statfs_magic(path: str) -> int | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        buf = ctypes.create_string_buffer(512)  # larger than struct statfs on every ABI
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # f_type is the first field


def parse_mountinfo(text: str, path: str) -> str | None:
    """Filesystem type of the mount holding ``path`` (longest mount point prefix) from mountinfo text."""
    best, best_type = "", None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        mnt = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
        fstype = right.split()[0] if right.split() else ""
        inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, best_type = mnt, fstype
    return best_type


def filesystem_type(path: str) -> str:
    """Type name (``ext4``, ``tmpfs``, ``nfs``, ``fuse.sshfs`` ...) of the filesystem holding ``path``."""
    p = os.path.realpath(nearest_existing(path))
    magic = _statfs_magic(p)
    name = MAGIC_NAMES.get(magic) if magic is not None else None
    if name is None or name == "fuse":
        try:
            with open("/proc/self/mountinfo") as f:
                from_mounts = parse_mountinfo(f.read(), p)
        except OSError:
            from_mounts = None
        name = from_mounts or name or (f"0x{magic:x}" if magic is not None else "unknown")
    return name


def is_network_filesystem(fstype: str) -> bool:
    """True for NFS, SMB/CIFS, FUSE (any sub-type), 9p, Ceph, Lustre, GPFS and similar."""
    base = fstype.lower().split(".")[0]
    return base in NETWORK_FILESYSTEMS


def require_local_disk(path: str, scheme: str = "lmdb") -> None:
    """Raise ConfigError when ``path`` is on a network/user-space filesystem (see the module docstring)."""
    fstype = filesystem_type(path)
    if is_network_filesystem(fstype):
        raise ConfigError(
            f"{scheme} cache directory {path} is on a {fstype} filesystem; LMDB needs a local disk "
            f"(memory maps and locks do not work on network filesystems). Pass a local directory, e.g. "
            f"cache='{scheme}:///local/disk/path' (CLI: --cache {scheme}:///local/disk/path).")
