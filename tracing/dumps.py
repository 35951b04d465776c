"""Writing trace files safely: atomically, and never at the training loop's expense.

Every file is written to a temporary name in the same directory and renamed
over the target, so a reader sees the old file or the new one, never half of
one.  A failure (unwritable directory, full disk) is logged once and counted;
it never raises into the caller.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("commslayer.tracing")


class DumpWriter:
    """Atomic file writes into one directory, with a count of what was lost."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.failed_writes = 0
        self.dropped_records = 0
        self._warned = False
        self._lock = threading.Lock()

    def write(self, name: str, data: bytes, records: int = 0) -> bool:
        """Write ``data`` to ``directory/name``; False (and counted) if it could not be."""
        path = os.path.join(self.directory, name)
        folder, base = os.path.split(path)
        tmp = os.path.join(folder, f".{base}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return True
        except OSError as exc:
            with self._lock:
                self.failed_writes += 1
                self.dropped_records += records
                first = not self._warned
                self._warned = True
            if first:
                log.warning("commslayer tracing: cannot write %s (%s); further failures are counted, not logged",
                            path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
