"""Writing trace files safely, and never at the training loop's expense.

A dump (``DumpWriter``) is written to a temporary name in the same directory
and renamed over the target, so a reader sees the old file or the new one,
never half of one; a sink's file (``AppendWriter``) grows by whole batches.  A failure (unwritable directory, full disk) is logged once and counted;
it never raises into the caller.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

log = logging.getLogger("commslayer.tracing")


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
            log.warning("commslayer tracing: cannot write %s (%s); further failures are counted, not logged",
                        path, exc)


class DumpWriter(_LossCounter):
    """Atomic file writes into one directory, with a count of what was lost."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def write(self, name: str, data: bytes, records: int = 0) -> bool:
        """Write ``data`` to ``directory/name``; False (and counted) if it could not be."""
        path = os.path.join(self.directory, name)
        folder = os.path.dirname(path)
        # The temporary name must not contain the target's: readers match dumps by prefix.
        tmp = os.path.join(folder, f".tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as exc:
            self._lost(path, exc, records)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False


class AppendWriter(_LossCounter):
    """Appends batches of bytes to one file; a failed write is counted, never raised.

    Unlike ``DumpWriter`` (whole files, atomically replaced), a sink's file
    grows.  A write that fails part-way (``ENOSPC`` after a short write) is
    cut back to the last complete batch, so the file never holds half a line
    in the middle; the records of a lost batch are counted in
    ``dropped_records``.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
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
                    directory = os.path.dirname(self.path)
                    if directory:
                        os.makedirs(directory, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
