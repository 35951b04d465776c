"""``python -m faults.wake DEADLINE PID``: end a ``sigstop`` fault.

A stopped process cannot wake itself, so ``faults.inject`` starts this helper
(arguments, no shell) just before the process stops itself.  The helper first
waits to see it stopped: a SIGCONT sent before the stop would be lost, and
the process would stay stopped for good.  Then it sends SIGCONT at
``DEADLINE``, a ``time.monotonic()`` value (one clock for every process of
the machine), however long this interpreter took to start.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import List, Optional

POLL_S = 0.001
GIVE_UP_S = 60.0  # past the deadline, a process that never stopped is not waited for


def state(pid: int) -> Optional[str]:
    """The state letter of ``pid`` in /proc (``T``: stopped), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def main(argv: List[str]) -> None:
    deadline, pid = float(argv[0]), int(argv[1])
    while state(pid) not in ("T", None, "Z", "X") and time.monotonic() < deadline + GIVE_UP_S:
        time.sleep(POLL_S)
    time.sleep(max(0.0, deadline - time.monotonic()))
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
