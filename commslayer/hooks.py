"""How tracing and user code observe a communicator: hook lists and the recorder slot.

A hook that raises is logged once and skipped: observing a collective must
never break it (check hooks are the exception: they exist to refuse an op,
e.g. ``commslayer.comm.nan_check``).  Calling an empty list costs one truth test
on the hot path.

Hooks are general and cost a Python call each plus an argument dict per op.
The flight recorder sees every op of every communicator, so it gets a
narrower path of its own: ``Communicator.recorder`` (an ``OpRecorder``) is
asked for one record per op, and the op path and ``Work`` fill it in.

The communicator hooks and ``live_communicators`` are the process-wide
registry of communicators (tracing and the fault harness attach through it).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Set, Tuple

if TYPE_CHECKING:
    import torch

    from commslayer.comm.communicator import Communicator
    from commslayer.reduce_op import ReduceOp
    from commslayer.comm.work import Work

log = logging.getLogger("commslayer")


class HookHandle:
    """Returned by every ``register_*_hook``; ``remove()`` unregisters (idempotent)."""

    __slots__ = ("_hooks", "_fn")

    def __init__(self, hooks: "Hooks", fn: Callable[..., Any]) -> None:
        self._hooks = hooks
        self._fn = fn

    def remove(self) -> None:
        self._hooks._remove(self._fn)


class Hooks:
    """An ordered list of callables of one kind (``pre``, ``post``, ``abort``, ``error``,
    ``check``: the one kind whose exceptions propagate, ``raising``)."""

    def __init__(self, kind: str, *, raising: bool = False, on_change: Optional[Callable[[], None]] = None) -> None:
        self.kind = kind
        self.raising = raising  # what a hook raises propagates (checks that refuse an op)
        self.fns: Tuple[Callable[..., Any], ...] = ()  # replaced, never mutated: safe to iterate
        self._lock = threading.Lock()
        self._warned: Set[int] = set()
        self._on_change = on_change  # called after every add and remove

    def add(self, fn: Callable[..., Any]) -> HookHandle:
        if not callable(fn):
            raise TypeError(f"{self.kind} hook must be callable, got {fn!r}")
        with self._lock:
            self.fns = self.fns + (fn,)
        if self._on_change is not None:
            self._on_change()
        return HookHandle(self, fn)

    def _remove(self, fn: Callable[..., Any]) -> None:
        with self._lock:
            fns = list(self.fns)
            if fn in fns:
                fns.remove(fn)
            self.fns = tuple(fns)
        if self._on_change is not None:
            self._on_change()

    def __call__(self, *args: Any) -> None:
        if self.raising:
            for fn in self.fns:
                fn(*args)
            return
        for fn in self.fns:
            try:
                fn(*args)
            except Exception:  # a broken observer must not break the collective
                if id(fn) not in self._warned:
                    self._warned.add(id(fn))
                    log.exception("commslayer: %s hook %r raised (its later errors are not logged)", self.kind, fn)


class OpIO(NamedTuple):
    """What one op reads and writes, as the recorder and the pre hooks see it."""

    inputs: Tuple["torch.Tensor", ...]
    outputs: Tuple["torch.Tensor", ...]
    reduce_op: Optional["ReduceOp"]  # None for ops that do not reduce
    root: Optional[int]  # None for ops without a root


class OpRecord(Protocol):
    """One op's entry in a recorder, as the op path fills it."""

    def started(self, start_ns: int) -> None:
        """The op was handed to the backend at ``start_ns`` (monotonic)."""

    def ended(self, work: "Work") -> None:
        """The op settled: ``work`` has its status, error and ``end_ns``."""

    def waited(self, start_ns: int, end_ns: int) -> None:
        """The caller of an async op blocked in ``Work.wait`` from ``start_ns`` to ``end_ns``."""


class OpRecorder(Protocol):
    """What ``Communicator.recorder`` must be (tracing's ``FlightRecorder`` is one)."""

    def scheduled(self, comm: "Communicator", op: str, op_id: int, seq: int, io: OpIO,
                  peer: Optional[int], async_op: bool, timeout_s: float) -> OpRecord:
        """A new op entered ``comm``; ``io`` is what it reads and writes."""

    def take_native(self, op_id: int) -> Optional[OpRecord]:
        """The record the native path wrote for op ``op_id``, which failed: from now on
        the op's ``Work`` settles it (None: there is none, or the ring dropped it)."""


phase_hooks = Hooks("phase")  # fn(job, step, phase); the job calls them itself: what they raise propagates
step_hooks = Hooks("step")  # fn(job, step); an observer: what it raises is logged and skipped


def register_phase_hook(fn: Callable[..., Any]) -> HookHandle:
    """Run ``fn(job, step, phase)`` at each phase of every step of a resilient job
    (``commslayer.resilience``): ``forward``, ``backward``, ``allreduce``, ``optimizer``.
    Here rather than in ``resilience`` so that the fault harness can register while
    torch is still importing."""
    return phase_hooks.add(fn)


def register_step_hook(fn: Callable[..., Any]) -> HookHandle:
    """Run ``fn(job, step)`` once as each step of a resilient job begins (before the
    loop's body runs): for an observer that needs only the step, such as the flight
    recorder, one call a step where a phase hook costs four and a hook on the
    backward pass."""
    return step_hooks.add(fn)


recovery_hooks = Hooks("recovery")  # fn(kind, fields); a broken observer is logged and skipped


def register_recovery_hook(fn: Callable[[str, Dict[str, Any]], None]) -> HookHandle:
    """Run ``fn(kind, fields)`` at each milestone of a resilient job's recovery
    (``commslayer.train.replicas``): ``recovered`` (the survivors went on without a
    lost replica group), ``admitted`` (a restarted group was let back in) and
    ``healed`` (a restarted rank received a live replica's state). ``fields``
    are plain values (steps, member ids, bytes, seconds); tracing records them
    as events."""
    return recovery_hooks.add(fn)


status_sources = Hooks("status source")  # fn(step) -> dict; the job calls them itself and merges what they return


def register_status_source(fn: Callable[[int], Dict[str, Any]]) -> HookHandle:
    """Add what ``fn(step)`` returns (a JSON-able dict) to each status record a resilient
    job writes (``commslayer.train.job``: at a committed step, about once a second), which
    ``commslayer-run --status-port`` serves. Here so that tracing, a layer above the job,
    can add the flight recorder's figures without the job importing it."""
    return status_sources.add(fn)


status_reporters = Hooks("status reporter")  # fn(store, key); the job calls them once a life, when first served


def register_status_reporter(fn: Callable[[Any, str], None]) -> HookHandle:
    """Run ``fn(store, key)`` once in each life of a resilient job, when it first sees a
    status server serve it (``commslayer.train.job``): ``store`` is the job's store (a
    ``commslayer.agree.store.BoundedStore``), ``key`` the key of this rank's current op.
    ``fn`` returns at once; what it starts writes ``key`` from a thread that already runs
    (the flight recorder's reporter, tracing.record.figures, writes from the watchdog's),
    so that a rank stuck inside an op, whose training thread writes nothing, still says
    which op."""
    return status_reporters.add(fn)


_created = Hooks("communicator created")
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def register_communicator_hook(fn: Callable[["Communicator"], None]) -> HookHandle:
    """``fn(comm)`` runs for every communicator built from now on in this process
    (``new_comm``, ``split``, c10d groups); see ``live_communicators`` for those
    that exist already."""
    return _created.add(fn)


def live_communicators() -> List["Communicator"]:
    """The communicators of this process that have not been garbage-collected."""
    return list(_live)


def created(comm: "Communicator") -> None:
    """A communicator was built: remember it and run the communicator hooks."""
    _live.add(comm)
    _created(comm)
