"""Ending a process: one list of before-exit hooks, run once, whichever way the process ends.

A training process that is done (or must leave because its replica group
broke) ends with ``exit_now``, that is ``os._exit``: torch 2.13's Gloo can
abort during interpreter teardown, and an abort after a finished job would
read as a failure to torchrun, which would restart the group.  ``atexit``
handlers then do not run, so whatever must happen before the process ends
registers here (``register_before_exit``): tracing registers its dump
(commslayer does not import tracing).  ``before_exit`` runs the list once per
process: from ``exit_now``, from tracing's SIGTERM handling, from the test
harness's forked ranks, and at interpreter exit once a hook is registered; a
call from another thread meanwhile waits for it, so that a SIGTERM that lands
while the process ends does not end it before its dump is written.
The liveness connections close first, so that peers do not wait on this
process while the hooks run: with a goodbye after a clean run (the peers see
it *left*), without one otherwise (the peers see it *lost*, at once).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn, Optional

from commslayer.hooks import HookHandle, Hooks

_before_exit = Hooks("before-exit")  # each called as fn(status, why)
_lock = threading.Lock()
_ran = False
_runner: Optional[int] = None  # the thread that runs the hooks
_finished = threading.Event()  # set once they ran
_at_interpreter_exit = False
OTHERS_WAIT_S = 10.0  # a second caller on another thread waits this long for the hooks (a dump) to finish


def register_before_exit(fn: Callable[[int, str], None]) -> HookHandle:
    """Run ``fn(status, why)`` once before the process ends (in registration order): before
    ``exit_now`` ends it, or at interpreter exit with status 0."""
    global _at_interpreter_exit
    with _lock:
        if not _at_interpreter_exit:  # registered now, so it runs before what registered at exit earlier
            atexit.register(before_exit, 0, "")
            _at_interpreter_exit = True
    return _before_exit.add(fn)


def before_exit(status: int, why: str = "") -> bool:
    """Close every liveness connection (goodbye only when ``status`` is 0) and run the
    before-exit hooks; once per process: True for the call that ran them.  A later
    call from another thread waits until they finished (a SIGTERM that lands while
    the main thread ends the process must not end it before its dump is written)."""
    global _ran, _runner
    with _lock:
        first = not _ran
        if first:
            _ran, _runner = True, threading.get_ident()
    if not first:
        if _runner != threading.get_ident():
            _finished.wait(OTHERS_WAIT_S)
        return False
    from commslayer.detect.liveness import close_all

    try:
        close_all(goodbye=status == 0)
        _before_exit(status, why)
    finally:
        _finished.set()
    return True


def exiting_here() -> bool:
    """Whether this thread is running the before-exit hooks now: a signal handler that
    interrupts them must let them finish rather than end the process."""
    return _runner == threading.get_ident() and not _finished.is_set()


def before_exit_ran() -> bool:
    """Whether the before-exit hooks ran to their end."""
    return _finished.is_set()


def exit_now(status: int, why: str = "") -> NoReturn:
    """``before_exit(status, why)``, flush the standard streams and end the process with ``status``."""
    before_exit(status, why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
