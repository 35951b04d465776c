"""Every ``COMMSLAYER_*`` environment variable, read in one place.

docs/configuration.md documents this table; keep the two in step.
"""

from __future__ import annotations

import os
from datetime import timedelta


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise ValueError(f"{name}={raw!r} must be a positive, finite number")
    return value


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def default_timeout() -> timedelta:
    """``COMMSLAYER_TIMEOUT_S``: deadline of an op that names none (default 300 s)."""
    return timedelta(seconds=_float("COMMSLAYER_TIMEOUT_S", 300.0))


def timeout_is_set() -> bool:
    """Whether ``COMMSLAYER_TIMEOUT_S`` is given (it then overrides c10d's group timeout)."""
    return bool(os.environ.get("COMMSLAYER_TIMEOUT_S"))


def check_mode() -> bool:
    """``COMMSLAYER_CHECK=1``: compare every op's fingerprint across ranks first."""
    return _flag("COMMSLAYER_CHECK")


def route_c10d() -> bool:
    """``COMMSLAYER_ROUTE_C10D=1``: run ``init_process_group("gloo"|"nccl")`` and
    every later group through commslayer, without code changes."""
    return _flag("COMMSLAYER_ROUTE_C10D")
