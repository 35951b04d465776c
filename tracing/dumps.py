"""Writing trace files safely, and never at the training loop's expense.

A dump (``DumpWriter``) is written to a temporary name in the same directory
and renamed over the target, so a reader sees the old file or the new one,
never half of one; a sink's file (``AppendWriter``) grows by whole batches.
A failure (unwritable directory, full disk, a refused path) is logged once
and counted; it never raises into the caller.

Trace directories are often shared, and whoever can write there can plant a
name before the job writes it.  So a job never writes through a symbolic
link: each file is opened with ``O_NOFOLLOW`` relative to its directory
(opened anew for every dump), a directory the job makes below the trace
directory (``fr``) is opened with ``O_NOFOLLOW`` too, a dump's temporary
has an unpredictable name and is created with ``O_EXCL``, and only regular
files (or character devices, such as /dev/null) are appended to: a FIFO
would block the writer, a hard link would write into its other name.  What
a job creates is private to its user: files 0600, directories 0700
(``COMMSLAYER_TRACE_MODE`` loosens that for a group).  The trace directory
itself is the user's to name: a symbolic link there is followed.
``open_append`` is the same safe open for the fault harness's log.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
from typing import Optional

log = logging.getLogger("commslayer.tracing")

FILE_MODE = 0o600  # trace files: the job's user only, unless COMMSLAYER_TRACE_MODE says otherwise


class UnsafePath(OSError):
    """A path a job refuses to write through: a symbolic link, a FIFO or socket,
    a hard-linked file.  Its message says which, and where a link points."""


def dir_mode(file_mode: int) -> int:
    """The mode of a directory that holds files of ``file_mode``: search (x) wherever read is allowed."""
    return file_mode | (file_mode & 0o444) >> 2


def _why(dir_fd: int, name: str, exc: OSError) -> OSError:
    """``exc`` from opening ``name`` (in ``dir_fd``) without following links, as an
    ``UnsafePath`` if a symbolic link or a FIFO was the cause."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return exc
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        return UnsafePath(f"{name} is a symbolic link to {target}; not followed")
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return UnsafePath(f"{name} is a FIFO or socket; not written to")
    return exc


def _make_dirs(path: str, mode: int) -> None:
    """``os.makedirs`` with ``mode`` for every directory it creates (makedirs gives
    the parents the default mode)."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        _make_dirs(parent, mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass


def _open_dir(path: str, mode: int) -> int:
    """A descriptor of the directory ``path`` (the user's: links followed), created
    with every missing parent, ``mode``, if need be."""
    path = os.path.normpath(path or ".")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        _make_dirs(path, mode)
        return os.open(path, flags)


def _open_subdir(dir_fd: int, name: str, mode: int) -> int:
    """A descriptor of the directory ``name`` in ``dir_fd``, one the job makes
    (``mode``): never a symbolic link."""
    try:
        os.mkdir(name, mode, dir_fd=dir_fd)
    except FileExistsError:
        pass
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise _why(dir_fd, name, exc) from None


def open_append(path: str, mode: int = FILE_MODE) -> int:
    """A descriptor to append to ``path`` (created ``mode`` if missing, its directory
    ``dir_mode(mode)``).  Raises ``UnsafePath`` for a symbolic link, a FIFO or
    socket, or a file with several hard links; never blocks."""
    folder, name = os.path.split(path)
    dir_fd = _open_dir(folder, dir_mode(mode))
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise _why(dir_fd, name, exc) from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_nlink > 1:
                raise UnsafePath(f"{name} has {st.st_nlink} hard links; not written through")
        elif not stat.S_ISCHR(st.st_mode):
            raise UnsafePath(f"{name} is a FIFO or socket; not written to")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _LossCounter:
    """What every trace writer shares: failed writes and lost records are
    counted, and only the first failure is logged."""

    def __init__(self) -> None:
        self.failed_writes = 0
        self.dropped_records = 0
        self._warned = False
        self._lock = threading.Lock()

    def _lost(self, path: str, exc: OSError, records: int) -> None:
        with self._lock:
            self.failed_writes += 1
            self.dropped_records += records
            first = not self._warned
            self._warned = True
        if first:
            log.log(logging.ERROR if isinstance(exc, UnsafePath) else logging.WARNING,
                    "commslayer tracing: cannot write %s (%s); further failures are counted, not logged",
                    path, exc)


class DumpWriter(_LossCounter):
    """Atomic file writes into one directory, with a count of what was lost.

    A name may hold subdirectories (``fr/...``): the job makes them, ``dir_mode(mode)``,
    and never follows one that is a symbolic link."""

    def __init__(self, directory: str, mode: int = FILE_MODE) -> None:
        super().__init__()
        self.directory = directory
        self.mode = mode

    def write(self, name: str, data: bytes, records: int = 0) -> bool:
        """Write ``data`` to ``directory/name``; False (and counted) if it could not be."""
        path = os.path.join(self.directory, name)
        *subdirs, base = name.split("/")
        try:
            dir_fd = _open_dir(self.directory, dir_mode(self.mode))
            try:
                for sub in subdirs:
                    child = _open_subdir(dir_fd, sub, dir_mode(self.mode))
                    os.close(dir_fd)
                    dir_fd = child
                self._replace(dir_fd, base, data)
            finally:
                os.close(dir_fd)
            return True
        except OSError as exc:
            self._lost(path, exc, records)
            return False

    def _replace(self, dir_fd: int, name: str, data: bytes) -> None:
        # The temporary name must not contain the target's: readers match dumps by prefix.
        tmp = f".tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.mode,
                     dir_fd=dir_fd)
        try:
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # A link planted as ``name`` is replaced, not followed.
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise


class AppendWriter(_LossCounter):
    """Appends batches of bytes to one file; a failed write is counted, never raised.

    Unlike ``DumpWriter`` (whole files, atomically replaced), a sink's file
    grows.  A write that fails part-way (``ENOSPC`` after a short write) is
    cut back to the last complete batch, so the file never holds half a line
    in the middle; the records of a lost batch are counted in
    ``dropped_records``.  The file is opened by ``open_append``.
    """

    def __init__(self, path: str, mode: int = FILE_MODE) -> None:
        super().__init__()
        self.path = path
        self.mode = mode
        self._fd: Optional[int] = None
        self._size = 0  # bytes known to be whole in the file
        self._io_lock = threading.Lock()

    def write(self, data: bytes, records: int = 0) -> bool:
        """Append ``data``; False (and counted, with ``records`` lost) if it could not be."""
        if not data:
            return True
        with self._io_lock:
            try:
                if self._fd is None:
                    self._fd = open_append(self.path, self.mode)
                    self._size = os.fstat(self._fd).st_size
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                self._size += len(data)
                return True
            except OSError as exc:
                if self._fd is not None:
                    try:
                        os.ftruncate(self._fd, self._size)  # drop a torn batch
                    except OSError:
                        pass
                failure = exc
        self._lost(self.path, failure, records)
        return False

    def close(self) -> None:
        """Close the file (a later ``write`` opens it again)."""
        with self._io_lock:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None
