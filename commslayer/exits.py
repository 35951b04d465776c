"""Ending a process: one list of before-exit hooks, run once, whichever way the process ends.

A training process that is done (or must leave because its replica group
broke) ends with ``exit_now``, that is ``os._exit``: torch 2.13's Gloo can
abort during interpreter teardown, and an abort after a finished job would
read as a failure to torchrun, which would restart the group.  ``atexit``
handlers then do not run, so whatever must happen before the process ends
registers here (``register_before_exit``): tracing registers its dump
(commslayer does not import tracing).  ``before_exit`` runs the list once per
process: from ``exit_now``, from tracing's SIGTERM handling, from the test
harness's forked ranks, and at interpreter exit once a hook is registered.
The liveness connections close first, so that peers do not wait on this
process while the hooks run: with a goodbye after a clean run (the peers see
it *left*), without one otherwise (the peers see it *lost*, at once).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Callable, NoReturn

from .hooks import HookHandle, Hooks

_before_exit = Hooks("before-exit")  # each called as fn(status, why)
_lock = threading.Lock()
_ran = False
_at_interpreter_exit = False


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
    before-exit hooks; once per process: True for the call that ran them."""
    global _ran
    with _lock:
        if _ran:
            return False
        _ran = True
    from .liveness import close_all

    close_all(goodbye=status == 0)
    _before_exit(status, why)
    return True


def exit_now(status: int, why: str = "") -> NoReturn:
    """``before_exit(status, why)``, flush the standard streams and end the process with ``status``."""
    before_exit(status, why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
