"""Every ``COMMSLAYER_*`` environment variable, read in one place.

docs/configuration.md documents this table; keep the two in step.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional


def _positive(name: str, default, kind=float):
    """A positive, finite number of type ``kind`` from the environment, or ``default``."""
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise ValueError(f"{name}={raw!r} must be a positive, finite number")
    return value


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def default_timeout() -> timedelta:
    """``COMMSLAYER_TIMEOUT_S``: deadline of an op that names none (default 300 s)."""
    return timedelta(seconds=_positive("COMMSLAYER_TIMEOUT_S", 300.0))


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


def job_id() -> str:
    """``COMMSLAYER_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``, else ``"local"``."""
    return os.environ.get("COMMSLAYER_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local"


def trace_dir() -> str:
    """``COMMSLAYER_TRACE_DIR``: where trace dumps go; setting it turns tracing on
    for every communicator of the process (empty: tracing off)."""
    return os.environ.get("COMMSLAYER_TRACE_DIR", "")


def job_rank() -> Optional[int]:
    """``COMMSLAYER_JOB_RANK``: this process's rank in a job made of several torchruns
    (one per replica group, ``launch/run.py``), each of which numbers its ranks
    from 0. It names trace files, and c10d groups map their ranks into it
    (a torchrun's ranks are taken to be one contiguous block of the job's)."""
    value = os.environ.get("COMMSLAYER_JOB_RANK", "")
    return int(value) if value else None


def trace_buffer() -> int:
    """``COMMSLAYER_TRACE_BUFFER``: records kept in the flight recorder's ring (default 4096)."""
    return _positive("COMMSLAYER_TRACE_BUFFER", 4096, int)


def trace_stack() -> bool:
    """``COMMSLAYER_TRACE_STACK=1``: keep the full Python stack in every record (slow)."""
    return _flag("COMMSLAYER_TRACE_STACK")


def trace_jsonl() -> bool:
    """``COMMSLAYER_TRACE_JSONL=1``: also write structlog JSON lines, one per op."""
    return _flag("COMMSLAYER_TRACE_JSONL")


def trace_otel() -> bool:
    """``COMMSLAYER_TRACE_OTEL=1``: also emit OpenTelemetry spans and metrics."""
    return _flag("COMMSLAYER_TRACE_OTEL")


def trace_sink_queue() -> int:
    """``COMMSLAYER_TRACE_SINK_QUEUE``: records a trace sink (JSON lines, OpenTelemetry)
    holds before its background thread writes them; beyond it, records are dropped
    and counted rather than slowing the op down (default 65536)."""
    return _positive("COMMSLAYER_TRACE_SINK_QUEUE", 65536, int)


def heartbeat_s() -> float:
    """``COMMSLAYER_HEARTBEAT_S``: how often each member tells its peers it is alive
    (default 0.25 s; ``0`` turns liveness off: a lost peer is then only seen by the
    op that talks to it, or at the op's deadline)."""
    if os.environ.get("COMMSLAYER_HEARTBEAT_S", "").strip() in ("0", "0.0"):
        return 0.0
    return _positive("COMMSLAYER_HEARTBEAT_S", 0.25)


def peer_timeout_s() -> float:
    """``COMMSLAYER_PEER_TIMEOUT_S``: silence after which a peer counts as stopped
    (default 3 s). A peer whose process ends is named at once, whatever this is."""
    return _positive("COMMSLAYER_PEER_TIMEOUT_S", 3.0)


def store_timeout_s() -> float:
    """``COMMSLAYER_STORE_TIMEOUT_S``: how long one store request may go unanswered
    before the store counts as unreachable (default 10 s; commslayer.store)."""
    return _positive("COMMSLAYER_STORE_TIMEOUT_S", 10.0)


def isolate_writes() -> bool:
    """``COMMSLAYER_ISOLATE_WRITES=1``: ops write into staging buffers that are
    copied to the caller's tensors only when the op succeeds, so an op that
    raised can never write into them later (costs a copy of every output)."""
    return _flag("COMMSLAYER_ISOLATE_WRITES")


def faults() -> str:
    """``COMMSLAYER_FAULTS``: the fault harness's faults, as JSON (faults.inject)."""
    return os.environ.get("COMMSLAYER_FAULTS", "")


def faults_log() -> str:
    """``COMMSLAYER_FAULTS_LOG``: where a process logs the faults it fires and the
    first failure of each of its communicators (empty: nowhere)."""
    return os.environ.get("COMMSLAYER_FAULTS_LOG", "")
