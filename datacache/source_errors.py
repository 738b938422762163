"""Errors raised while reading source files, and which of them are worth retrying.

:class:`SourceError` names the file and says what to do; :class:`SizeMismatchError` is a
read whose length differs from the manifest's size (the file changed or the read was cut
short). Both pickle, so they cross the DataLoader's process boundary intact.
"""

from __future__ import annotations

from typing import Any

from datacache.redact import redact, redact_text

try:
    import aiohttp

    _AIOHTTP_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError,)
except ImportError:  # pragma: no cover
    aiohttp = None  # type: ignore[assignment]
    _AIOHTTP_ERRORS = ()



class ConfinementError(PermissionError):
    """A confined :class:`~datacache.source.Source` refused a file: its real path (after symlinks) or its
    URL lies outside the allowed prefixes. Permanent (never retried); the message names no bytes and no
    path outside the prefixes."""


class RedirectRefused(ConfinementError):
    """A confined HTTP(S) source answered with a redirect (3xx): redirects are not followed, and the
    body of the 3xx is never taken for the file."""


class NotARegularFile(OSError):
    """A confined local read found a FIFO, socket or device where a file was listed (permanent: such a
    "file" is never opened for reading, so a FIFO cannot hang the reader)."""


_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, NotARegularFile)


class SizeMismatchError(OSError):
    """The bytes read differ in length from the manifest's size (transient: retried, never cached)."""

    def __init__(self, got: int, expected: int) -> None:
        super().__init__(f"read {got} bytes but the listing says {expected}: the file changed since the "
                         "dataset was listed, or the read was cut short (re-list with revalidate='full' "
                         "to pick up the new version)")
        self.got = got
        self.expected = expected

    def __reduce__(self) -> tuple[Any, ...]:
        return (SizeMismatchError, (self.got, self.expected))


class SourceError(Exception):
    """A file could not be read; ``.path`` names it, ``.cause`` is the underlying error."""

    def __init__(self, path: str, cause: BaseException | str) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"cannot read {redact(path)}: {_advice(cause)}")  # a source URL's password hidden

    def __reduce__(self) -> tuple[Any, ...]:
        return (SourceError, (self.path, self.cause if _picklable(self.cause) else repr(self.cause)))


def _picklable(e: Any) -> bool:
    return isinstance(e, (str, SizeMismatchError, OSError, TimeoutError, ValueError))


def _advice(cause: BaseException | str) -> str:
    if isinstance(cause, str):
        return cause
    if isinstance(cause, FileNotFoundError):
        return ("file does not exist (deleted, moved, or a dangling symlink); restore it or rebuild the "
                "manifest")
    if isinstance(cause, IsADirectoryError):
        return "it is a directory, not a file; rename or remove it"
    if isinstance(cause, NotADirectoryError):
        return "a component of the path is not a directory; check the dataset layout"
    if isinstance(cause, (ConfinementError, NotARegularFile)):
        return str(cause)  # fixed texts (datacache.source): no bytes, no path outside the allowed prefixes
    if isinstance(cause, PermissionError):
        return "permission denied; fix the file permissions or the storage credentials"
    if isinstance(cause, SizeMismatchError):
        return str(cause)
    return (f"{type(cause).__name__}: {redact_text(str(cause))[:300]}; check the storage/network health "
            "(retried with backoff)")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` can help: ``OSError``/``TimeoutError`` other than not-found,
    is-a-directory, not-a-directory and permission errors; aiohttp client errors other than 4xx
    (429 is retried)."""
    if isinstance(exc, _PERMANENT):
        return False
    if _AIOHTTP_ERRORS and isinstance(exc, _AIOHTTP_ERRORS):
        status = getattr(exc, "status", None)
        return not (isinstance(status, int) and 400 <= status < 500 and status != 429)
    return isinstance(exc, (OSError, TimeoutError))

