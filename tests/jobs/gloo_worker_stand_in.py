"""A thread that looks, in /proc, like one of c10d Gloo's worker threads: named as Gloo names
them, runnable for a while (hashing without the GIL), then asleep.  It imports neither torch
nor commslayer, so a process that uses it is what its own imports make it."""

from __future__ import annotations

import ctypes
import os
import hashlib
import threading
import time
from typing import Optional

NAME = "pt_gloo_runloop"  # commslayer.gloo_exit.WORKER_NAME (tests/test_gloo_exit.py checks they agree)


def _run(run_s: float, then_sleep_s: float, ready: threading.Event, marker: Optional[str]) -> None:
    ctypes.CDLL(None).prctl(15, NAME.encode(), 0, 0, 0)  # PR_SET_NAME
    block = b"x" * (1 << 20)
    ready.set()
    end = time.monotonic() + run_s
    while time.monotonic() < end:
        hashlib.sha256(block)  # releases the GIL: the thread stays runnable, not waiting for it
    if marker:
        os.close(os.open(marker, os.O_CREAT | os.O_WRONLY))
    time.sleep(then_sleep_s)


def start(run_s: float, then_sleep_s: float, marker: Optional[str] = None) -> threading.Thread:
    """The stand-in, started: runnable for ``run_s`` seconds, then (having created the file
    ``marker``, if given) asleep for ``then_sleep_s``."""
    ready = threading.Event()
    t = threading.Thread(target=_run, args=(run_s, then_sleep_s, ready, marker), daemon=True)
    t.start()
    if not ready.wait(5):
        raise RuntimeError("the stand-in thread did not start within 5 s")
    return t
