"""At interpreter exit, c10d Gloo's worker threads let go of their last op first.

Each Gloo group runs its ops on worker threads (``pt_gloo_runloop``).  A
worker marks an op complete, which wakes the caller waiting on it, and only
then drops its reference to the op's work and, through it, the op's tensors.
Dropping a tensor that Python knows takes the GIL, and a thread that asks for
the GIL while the interpreter finalizes is ended inside C++: the process
aborts ("terminate called without an active exception", status -6).  On a
loaded machine the worker can be descheduled in that gap while the main
thread runs to the end of the script, so a job that trained every step exits
-6 and torchrun reports it failed.  ``destroy_process_group`` does not stop
the workers.  Plain c10d does this too (docs/configuration.md, "At exit").

``wait_for_gloo_workers`` runs from ``atexit``, before finalization: it
releases the GIL until no worker thread is runnable at two checks in a row,
or until ``EXIT_WAIT_S``.  A worker waiting for its next op sleeps; one still
holding a finished op is runnable, or waits for the GIL, which each pause
gives it.  commslayer.autoload registers it at ``import torch``, so it also
covers scripts that never import commslayer.  Linux only (it reads the
threads' states in /proc); elsewhere it returns at once.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import List

EXIT_WAIT_S = 2.0
PAUSE_S = 0.001
WORKER_NAME = "pt_gloo_runloop"


def _worker_states() -> List[str]:
    """The scheduler state letter (R, S, D, ...) of each Gloo worker thread of this process."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended
        name, _, rest = stat.partition("(")[2].rpartition(")")
        if name == WORKER_NAME:
            states.append(rest.split()[0])
    return states


def wait_for_gloo_workers(timeout_s: float = EXIT_WAIT_S) -> None:
    """Release the GIL until no Gloo worker thread is runnable at two checks in a row
    (at most ``timeout_s``); return at once in a process without Gloo workers."""
    if not _worker_states():
        return
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(PAUSE_S)
        quiet = 0 if "R" in _worker_states() else quiet + 1


def install() -> None:
    """Run ``wait_for_gloo_workers`` at interpreter exit (once per process)."""
    atexit.unregister(wait_for_gloo_workers)
    atexit.register(wait_for_gloo_workers)
