"""Directories, files and processes another local user cannot have prepared (stdlib only).

Every directory datacache creates or reuses (the local cluster's directory and its node directories,
the secrets directory, the T1 cache) must be owned by the invoking (effective) user and not writable by
group or others: a directory another user made -- or can write into -- lets that user choose our
passwords, plant symlinks that make us append to or truncate a file of theirs choosing (as root: any
file), or write pids we would signal. Files we write there are opened with ``O_NOFOLLOW`` and checked
on the open descriptor (``fstat``), so no check-then-open race is left. A pid read back from a state
file is signalled only after :func:`pid_is_ours` proved it is the very process we started.

Each ``*_problem`` function returns None when the path is fine, else ONE line naming the path, what is
wrong and the fix (``chown`` / ``chmod`` / another directory). Stdlib only: ``deploy/local-cluster.sh``
runs :mod:`datacache.devtools.redis_local` and :mod:`datacache.make_secrets` with any python3.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["ancestors_problem", "dir_problem", "ensure_private_dir", "open_private_append",
           "open_private_read", "pid_is_ours", "secret_stat_problem"]


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _me() -> int:
    return os.geteuid()


def dir_problem(path: str, *, what: str = "directory", follow_symlinks: bool = False) -> str | None:
    """Why the existing directory ``path`` must not be used (one line), or None.

    Refused: a symbolic link (unless ``follow_symlinks``: then the directory it names is checked), not a
    directory, owned by another user than the effective one, writable by group or others."""
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except OSError as e:
        return f"{what} {path}: cannot inspect it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return (f"{what} {path} is a symbolic link: refusing to follow it (remove it, or name the directory "
                "itself)")
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} exists and is not a directory: remove it or choose another directory"
    if st.st_uid != _me():
        return (f"{what} {path} is owned by {_who(st.st_uid)}, not by this user ({_who(_me())}): refusing a "
                "directory another user prepared; remove it (after checking what is in it) or choose "
                "another directory")
    if st.st_mode & 0o022:
        return (f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"`chmod go-w {path}` or choose another directory")
    return None


def ancestors_problem(path: str, *, what: str = "directory") -> str | None:
    """Why a directory above ``path`` would let another user replace ``path`` (one line), or None.

    Each existing ancestor (of the path as given and of its resolved form) must be owned by root or by
    this user, and be writable by group/others only with the sticky bit (as ``/tmp``): otherwise its
    other writers can rename ``path`` away and put their own in its place after every check. A symbolic
    link on the way must be owned by root or by this user."""
    apath = os.path.abspath(path)
    trusted = {0, _me()}
    parts = apath.strip("/").split("/")
    lexical = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
    real_parent = os.path.realpath(os.path.dirname(apath))
    rparts = real_parent.strip("/").split("/") if real_parent != "/" else []
    resolved = ["/"] + ["/" + "/".join(rparts[:i]) for i in range(1, len(rparts) + 1)]
    for p in lexical:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            break  # created later, by us (callers check again after creating)
        except OSError as e:
            return f"{what} {path}: cannot inspect {p} ({e.strerror})"
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in trusted:
            return (f"{what} {path}: {p} is a symbolic link owned by {_who(st.st_uid)}: refusing a path "
                    "another user can redirect; choose another directory")
    for p in resolved:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            break
        except OSError as e:
            return f"{what} {path}: cannot inspect {p} ({e.strerror})"
        if st.st_uid not in trusted:
            return (f"{what} {path}: the directory {p} above it is owned by {_who(st.st_uid)}, who could "
                    "replace it: choose a directory under one owned by you or root")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{what} {path}: the directory {p} above it is writable by group or others without the "
                    f"sticky bit (mode {stat.S_IMODE(st.st_mode):04o}), so they could replace it: "
                    "choose another directory")
    return None


def ensure_private_dir(path: str, *, what: str = "directory",
                       follow_symlinks: bool = False) -> tuple[bool, str | None]:
    """Create ``path`` mode 0700 (its missing parents with the default mode) or check the existing one
    (:func:`dir_problem`, ``follow_symlinks`` passed on). Returns (created, problem)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        old = os.umask(0o077)  # process-wide, restored at once: the directory is never more open
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:  # someone else made it between the lstat and the mkdir: check theirs
            created = False
        finally:
            os.umask(old)
        if created:
            return True, None
    return False, dir_problem(path, what=what, follow_symlinks=follow_symlinks)


def _file_problem(fd: int, path: str, what: str) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return f"{what} {path} is not a regular file: remove it"
    if st.st_uid != _me():
        return (f"{what} {path} is owned by {_who(st.st_uid)}, not by this user ({_who(_me())}): refusing a "
                "file another user prepared; remove it")
    return None


def _open_private(path: str, flags: int, what: str, verb: str, mode: int = 0o600) -> int:
    """``os.open`` with ``O_NOFOLLOW`` (and ``O_NONBLOCK``: a FIFO planted here must not hang the open),
    then the owner and type checked on the descriptor; OSError with one line otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"{what} {path} is a symbolic link: refusing to {verb} (remove it)") \
                from None
        raise
    why = _file_problem(fd, path, what)
    if why:
        os.close(fd)
        raise OSError(errno.EPERM, why)
    os.set_blocking(fd, True)
    return fd


def open_private_append(path: str, *, what: str = "log file") -> int:
    """A descriptor appending to ``path`` (created 0600), never through a symlink: OSError with one line
    when ``path`` is a symlink, not a regular file, or owned by another user."""
    return _open_private(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what, "write through it")


def open_private_read(path: str, *, what: str = "file") -> int:
    """A descriptor reading ``path`` (no symlink followed, regular, owned by this user); OSError with one
    line otherwise (FileNotFoundError when it is missing)."""
    return _open_private(path, os.O_RDONLY, what, "follow it")


def secret_stat_problem(st: os.stat_result, *, allow_root_group: bool = True) -> str | None:
    """Why a secret file with status ``st`` must not be used (a phrase, no path), or None.

    Accepted: a regular file owned by this user with no group or other permission bits (0600, 0400).
    With ``allow_root_group`` (and when this user is not root) also a file owned by ROOT, readable by
    one of this process's groups and by nobody else, writable by root alone: the layout of Kubernetes
    secret volumes (root:fsGroup 0440) and of files an administrator installs for a service group --
    root chose that group, and root could read the secret anyway."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    mode = stat.S_IMODE(st.st_mode)
    me = _me()
    if st.st_uid == me:
        if mode & 0o077:
            return (f"is readable or writable by group or others (mode {mode:04o}): anyone who read it "
                    "knows the secret")
        return None
    if allow_root_group and st.st_uid == 0 and me != 0:
        if mode & 0o037 or (mode & 0o040 and st.st_gid not in {os.getegid(), *os.getgroups()}):
            return (f"is owned by root and open to a group this user is not in, or to others (mode "
                    f"{mode:04o})")
        return None
    return (f"is owned by {_who(st.st_uid)}, not by this user ({_who(me)}): another user could have chosen "
            "the secret")


def _program_names(name: str) -> set[str]:
    """``name`` and the file its PATH entry resolves to (Debian's redis-server is a link to
    redis-check-rdb, which is what /proc/PID/exe then names)."""
    import shutil

    found = shutil.which(name)
    return {name, os.path.basename(os.path.realpath(found))} if found else {name}


def pid_is_ours(pid: object, *, exe_name: str, cwd: str | None = None) -> bool:
    """Whether ``pid`` (as read from a state file: anything) is a live process of this user running the
    program ``exe_name`` (basename of ``/proc/PID/exe``) with working directory ``cwd`` when given.

    A pid written into a state file by someone else, or one the kernel has since given to another
    process, fails one of these; only a process passing all of them may be signalled."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False  # 0 / -1 / negatives would signal process groups or every process
    base = f"/proc/{pid}"
    try:
        if os.stat(base).st_uid != _me():
            return False
        with open(f"{base}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return False
        exe = os.readlink(f"{base}/exe")
        exe = exe[:-len(" (deleted)")] if exe.endswith(" (deleted)") else exe  # upgraded while running
        if os.path.basename(exe) not in _program_names(exe_name):
            return False
        return cwd is None or os.readlink(f"{base}/cwd") == os.path.realpath(cwd)
    except (OSError, IndexError):
        return False
