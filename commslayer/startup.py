"""What torch's entry points need while the ``commslayer`` package is half imported:
the backend's name, work that must wait until the package is complete, and work
that must wait until the process knows which rank it is.

``import commslayer`` may be what first imports torch, and torch then runs
the ``torch.backends`` entry points (``tracing.autoload``,
``faults.autoload``) while this package is half built.  They register what
they need with ``when_ready``, which runs it at once when the package is
complete and otherwise once ``commslayer/__init__`` calls ``mark_ready`` at
its end.  A warm spare (``COMMSLAYER_SPARE``, commslayer.train.spare) imports
torch before it has a rank: what is filed by rank (the fault injector, the
trace recorder) waits with ``when_placed`` until it adopts one.  This module
imports nothing but ``os``, so it can be imported at any point.
"""

from __future__ import annotations

import os
from typing import Callable, List

BACKEND_NAME = "commslayer"  # the c10d backend (commslayer.registration registers it)

_ready = False
_queued: List[Callable[[], None]] = []
_unplaced: List[Callable[[], None]] = []


def when_ready(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once the package is complete: now if it is. Idempotent: a function
    queued already is not queued twice."""
    if _ready:
        fn()
    elif fn not in _queued:
        _queued.append(fn)


def is_ready() -> bool:
    """Whether ``commslayer/__init__`` has finished."""
    return _ready


def mark_ready() -> None:
    """The package is complete (``commslayer/__init__``'s last step): run what waited."""
    global _ready
    _ready = True
    while _queued:
        _queued.pop(0)()


def when_placed(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once this process has its rank: now, unless it is a warm spare still
    waiting for one (then when ``mark_placed`` is called). Idempotent as ``when_ready``."""
    if not is_spare():
        fn()
    elif fn not in _unplaced:
        _unplaced.append(fn)


def is_spare() -> bool:
    """Whether this process is a warm spare of ``commslayer-run`` still waiting for a rank:
    ``COMMSLAYER_SPARE`` set in one of its jobs (per-rank mode's ``COMMSLAYER_RESTART_UNIT=rank``,
    or replica mode's ``COMMSLAYER_REPLICAS``; elsewhere commslayer.config.spare refuses it)."""
    return bool(os.environ.get("COMMSLAYER_SPARE", "").strip()) and (
        os.environ.get("COMMSLAYER_RESTART_UNIT") == "rank" or bool(os.environ.get("COMMSLAYER_REPLICAS")))


def mark_placed() -> None:
    """A warm spare took a rank (its environment is that rank's now): run what waited."""
    while _unplaced:
        _unplaced.pop(0)()
