"""Ending a process on purpose: hang up or say goodbye, run the before-exit hooks, leave.

A training process that is done (or must leave because its replica group
broke) ends with ``os._exit``: torch 2.13's Gloo can abort during interpreter
teardown, and an abort after a finished job would read as a failure to
torchrun, which would restart the group.  ``atexit`` handlers then do not
run, so whatever must happen before such an exit registers here: tracing
registers its dump (commslayer does not import tracing).  The liveness
connections close first, so that peers do not wait on this process while
the hooks run: with a goodbye after a clean run (the peers see it *left*),
without one after a failure (the peers see it *lost*, at once).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from .hooks import HookHandle, Hooks

_before_exit = Hooks("before-exit")  # each called as fn(status, why)


def register_before_exit(fn) -> HookHandle:
    """Run ``fn(status, why)`` before ``exit_now`` ends the process (in registration order)."""
    return _before_exit.add(fn)


def exit_now(status: int, why: str = "") -> NoReturn:
    """Close every liveness connection (goodbye only when ``status`` is 0), run the
    before-exit hooks, flush the standard streams and end the process with ``status``."""
    from .liveness import close_all

    close_all(goodbye=status == 0)
    _before_exit(status, why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
