"""Reading a file a user handed over: its type checked before anything blocks on it.

Opening a FIFO for reading waits for a writer, forever; a device or a socket is no better. So
every file reward-lens reads from a record, a TRL output folder, a site, a report directory, a
config or a basis goes through here: it is opened with ``O_NONBLOCK`` (which returns at once,
FIFO or not), its type is read from the open descriptor with ``fstat`` (no window between the
check and the read), and only a regular file is read. Where a library opens the path itself
(pyarrow), ``require_regular`` checks it first.

``follow_links=False`` (inside a site reward-lens wrote) refuses a symbolic link as the last
component with ``O_NOFOLLOW``, so the site never reads, and never copies into itself, a file
that lives somewhere else.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


class UnreadableFile(ValueError):
    """A file that cannot be read as one: not a regular file (a FIFO, a link where none is
    followed, a directory), too large, or not UTF-8 (bad input: exit 2). ``str`` names the path
    and the problem; ``path`` and ``problem`` let a caller re-raise it with a field."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"{path}: {problem}")


def kind_of(mode: int) -> str:
    """A file type in words ("a FIFO (named pipe)", ...), for a mode that is not a regular file's."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def _refuse(path: str | Path, mode: int) -> UnreadableFile:
    return UnreadableFile(path, f"is {kind_of(mode)}, not a regular file: reward-lens reads only regular files "
                                 "(and never waits on a pipe)")


def require_regular(path: str | Path, *, follow_links: bool = True) -> os.stat_result:
    """``stat`` of ``path`` (``lstat`` unless ``follow_links``), or UnreadableFile when it is
    not a regular file. FileNotFoundError when it does not exist."""
    st = os.stat(path) if follow_links else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode)
    return st


def is_regular(path: str | Path, *, follow_links: bool = True) -> bool:
    """True for a regular file (never blocks, never raises for a missing path)."""
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def read_bytes(path: str | Path, *, follow_links: bool = True, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``; UnreadableFile for anything else (a FIFO is
    never waited on), and, with ``limit``, for a file larger than ``limit`` bytes."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and exc.errno == errno.ELOOP:
            raise UnreadableFile(path, "is a symbolic link: reward-lens does not follow links inside a folder it "
                                        "wrote (nothing was read through it)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st.st_mode)
        if limit is not None and st.st_size > limit:
            raise UnreadableFile(path, f"is {st.st_size:,} bytes, more than the {limit:,} this file can hold")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as fh:
            fd = -1
            return fh.read()
    finally:
        if fd >= 0:
            os.close(fd)


def read_text(path: str | Path, *, follow_links: bool = True, limit: int | None = None) -> str:
    """``read_bytes`` decoded as UTF-8; a file that is not UTF-8 is named with the byte offset
    (an UnreadableFile, never the codec's bare message)."""
    data = read_bytes(path, follow_links=follow_links, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(path, f"is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r} "
                                    f"{exc.reason})") from None
