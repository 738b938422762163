"""Confinement primitives: which files a confined :class:`~datacache.source.Source` may read.

* :func:`confine_prefix` normalises an allowed prefix (a path by its real path; a URL by scheme,
  host[:port] and its ``..``-free path); :func:`url_under` says whether a URL lies under one.
* :func:`fd_real_path` is the real path of an OPEN descriptor (``/proc/self/fd/N`` on Linux; elsewhere
  ``realpath`` of the name, accepted only when it is the same file as the descriptor), so a symlink
  swapped in after the check cannot redirect the read.
* :func:`redirect_guard_options` adds an aiohttp redirect hook to HTTP(S) storage options: a redirect is
  followed only when its target lies under the prefixes, before anything is sent there, and a 3xx that
  is not followed is an error (fsspec would otherwise return the redirect's body as the file).

See :mod:`datacache.source` ("Confinement") for how reads use them.
"""

from __future__ import annotations

import os
import posixpath
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from datacache.source_errors import ConfinementError, RedirectRefused

OUTSIDE = ("outside the allowed sources (a symlink or mount escapes the dataset root); to read it, add "
           "the directory it really lies in to the allowed prefixes (the daemon's allowed_sources)")
_HTTP_SCHEMES = ("http", "https")
# O_NONBLOCK: opening a FIFO returns at once (then refused as not a regular file) instead of waiting for a
# writer; it changes nothing for regular files. O_CLOEXEC: a child forked meanwhile does not inherit it.
OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NOCTTY", 0))
Prefix = tuple[str, str, str]  # (scheme, or "local" for local files; host[:port]; normalised path)


async def _refuse_3xx(resp: Any) -> None:
    """aiohttp ``raise_for_status`` hook of a guarded HTTP(S) filesystem: a 3xx that was not followed (a
    redirect outside the prefixes is stopped before this; one without a ``Location``) is an error --
    fsspec's ``cat_file`` would otherwise return the redirect's body as the file."""
    if 300 <= resp.status < 400:
        raise RedirectRefused(f"the server answered HTTP {resp.status} (a redirect that is not followed); "
                              "refused")


_GUARDS: dict[tuple[Prefix, ...], Any] = {}  # one aiohttp TraceConfig per prefix set (see _redirect_guard)
_GUARDS_LOCK = threading.Lock()


def _redirect_guard(prefixes: tuple[Prefix, ...]) -> Any:
    """An aiohttp ``TraceConfig`` whose redirect hook raises :class:`RedirectRefused` before aiohttp
    contacts a ``Location`` outside ``prefixes``. One object per prefix set: fsspec keys its filesystem
    instances by their options' text, so the same object reuses one filesystem (and its session)."""
    import aiohttp
    import yarl

    with _GUARDS_LOCK:
        guard = _GUARDS.get(prefixes)
        if guard is not None:
            return guard

        async def on_redirect(_session: Any, _ctx: Any, params: Any) -> None:
            resp = params.response
            loc = resp.headers.get("Location") or resp.headers.get("URI")
            if loc is None:
                return  # aiohttp stops and returns the 3xx itself: _refuse_3xx refuses it
            try:
                target = str(params.url.join(yarl.URL(loc)))
            except ValueError:
                target = ""
            if not url_under(target, prefixes):
                # names the status only: a Location can carry a signed URL's token
                raise RedirectRefused(f"the server redirected (HTTP {resp.status}) outside the allowed "
                                      "sources; not followed (allow the final location's prefix, or use it "
                                      "directly)")

        guard = aiohttp.TraceConfig()
        guard.on_request_redirect.append(on_redirect)
        _GUARDS[prefixes] = guard
        return guard


def guarded_options(url: str, storage_options: dict | None, prefixes: tuple[Prefix, ...]) -> dict:
    opts = dict(storage_options or {})
    if url.split("://", 1)[0].lower() in _HTTP_SCHEMES and "::" not in url:
        client = dict(opts.get("client_kwargs") or {})
        client["trace_configs"] = [*client.get("trace_configs", ()), _redirect_guard(prefixes)]
        opts["client_kwargs"] = client
        opts["raise_for_status"] = _refuse_3xx  # a request option: every GET/HEAD of the filesystem
    return opts


def redirect_guard_options(url: str, storage_options: dict | None = None,
                           allow: Sequence[str] | None = None) -> dict:
    """``storage_options`` for ``url`` with HTTP(S) redirects guarded: one is followed only when its target
    lies under a prefix of ``allow`` (paths/URLs like ``allowed_sources``; None = under ``url`` itself),
    before anything is sent there; an unfollowed 3xx is an error, never the file. What the cache daemon
    lists, checks and reads its sources with. Other protocols: ``storage_options`` unchanged."""
    prefixes = tuple(confine_prefix(p) for p in ((url,) if allow is None else allow))
    return guarded_options(url, storage_options, prefixes)


def _is_local_scheme(scheme: str) -> bool:
    if scheme in ("file", "local"):
        return True
    try:
        return issubclass(fsspec.get_filesystem_class(scheme), LocalFileSystem)  # e.g. slowfile://
    except (ValueError, ImportError):
        return False


def confine_prefix(url: str) -> Prefix:
    """An allowed prefix (path or URL) normalised for :class:`Source` confinement: local paths (also
    ``file://`` and local stand-ins like ``slowfile://``, whose query is dropped) by their real path;
    URLs by lower-case scheme, host[:port] and their ``..``-free path. ValueError for junk."""
    if not isinstance(url, str) or not url or "\x00" in url or "::" in url:
        raise ValueError(f"confine prefix {url!r} must be a non-empty path or URL (no '::' chain)")
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if _is_local_scheme(scheme):
        path = (url.split("://", 1)[1] if "://" in url else url).split("?", 1)[0]
        return "local", "", os.path.realpath(os.path.abspath(os.path.expanduser(path)))
    u = urllib.parse.urlsplit(url)
    port = f":{u.port}" if u.port is not None else ""
    return scheme, (u.hostname or "").lower() + port, _norm_path(u.path)


def _norm_path(path: str) -> str:
    return posixpath.normpath("/" + path.lstrip("/")).replace("//", "/") if path else "/"


def path_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def url_under(url: str, prefixes: Sequence[Prefix]) -> bool:
    """Whether ``url`` (not local) lies under one of the normalised ``prefixes``: same scheme and
    host[:port], and a path under the prefix's both as written and percent-decoded (a server may decode
    ``%2e%2e`` after our check); a backslash in the path is refused (some servers read it as ``/``)."""
    try:
        u = urllib.parse.urlsplit(url)
        host = (u.hostname or "").lower() + (f":{u.port}" if u.port is not None else "")
    except ValueError:
        return False
    if not u.scheme or "\\" in u.path:
        return False
    paths = {_norm_path(u.path), _norm_path(urllib.parse.unquote(u.path))}
    scheme = u.scheme.lower()
    return any(ps == scheme and ph == host and all(path_under(p, pp) for p in paths)
               for ps, ph, pp in prefixes)


def fd_real_path(fd: int, path: str, *, use_proc: bool = True) -> str:
    """Real path of the file open as ``fd`` (opened by the name ``path``): ``/proc/self/fd/N``'s link on
    Linux; without ``/proc`` (or ``use_proc=False``) ``os.path.realpath(path)``, accepted only when it
    names the same file (device, inode) as ``fd`` -- a path swapped after the open is refused."""
    if use_proc:
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
            if real.startswith("/"):
                return real
        except OSError:
            pass
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        raise ConfinementError("the file changed while it was being opened; refused") from None
    fst = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
        raise ConfinementError("the file changed while it was being opened; refused")
    return real
