"""The watchdog: one daemon thread per process that settles async ops.

A caller that waits enforces its op's deadline itself.  An async op that
nobody waits on is the watchdog's: it wakes at the earliest deadline it holds
(or every ``SWEEP_S`` to drop finished ops), turns an overdue op into
``CollectiveTimeout`` and so marks its communicator broken, whether or not
anyone is looking.  It also settles async ops of a communicator that broke
(a lost peer) at its next sweep.

It sweeps the async ops of the native path too (``AsyncOpWork`` in
commslayer/comm/direct_path.cpp, which c10d's async ops through the adapter
take): each communicator's ``DirectPath.sweep`` settles those that failed,
are overdue, or whose communicator broke, every ``SWEEP_S``.

And it runs what must happen now and then in every process whatever its
threads are doing (``every``): the flight recorder's status reporter, which
writes the op a rank is stuck in (tracing.record.figures).  Those calls must
not block: the deadlines above wait for them.

It keeps dead backends too (``bury``): a Gloo op cannot be cancelled, and
the last reference to a Gloo group joins the group's worker threads, so
dropping a broken group whose op still waits for a stopped peer would block
whichever thread dropped it for up to the op's whole timeout.  A buried
backend is released once all its leftover works have ended.

Its thread holds ``Work`` objects, and through them the backend's works and
the ops' tensors.  Freeing a tensor that Python knows takes the GIL, and a
daemon thread that asks for the GIL while the interpreter is finalizing is
ended inside C++, which aborts the process ("terminate called without an
active exception").  So at exit, before finalization, ``stop()`` ends the
thread and frees what it holds on the main thread.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from commslayer.comm.work import Work

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator

SWEEP_S = 0.25

log = logging.getLogger("commslayer")


class _Every:
    """A call the watchdog makes about every ``period_s`` (``Watchdog.every``)."""

    def __init__(self, period_s: float, fn: Callable[[], None]) -> None:
        self.period_s, self.fn, self.due = period_s, fn, 0.0
        self.failed = False  # it raised once (logged once)


class Watchdog:
    def __init__(self) -> None:
        self._works: List[Work] = []
        self._graves: List[Tuple[Any, Any]] = []  # (backend, its work still running)
        self._swept: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # whose native async ops it sweeps
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._every: List[_Every] = []

    def every(self, period_s: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` on the watchdog's thread about every ``period_s`` (at least
        ``SWEEP_S``) from now on; a function that stops it. ``fn`` must not block (the
        deadlines of async ops wait for it); what it raises is logged once and skipped."""
        call = _Every(max(period_s, SWEEP_S), fn)
        with self._cond:
            self._every.append(call)
            self._ensure_thread()

        def stop() -> None:
            with self._cond:
                if call in self._every:
                    self._every.remove(call)
        return stop

    def stop(self) -> None:
        """End the thread and drop the works it holds (at exit; idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._cond:
            self._works = []
            for backend, work in self._graves:
                if not work.is_completed():  # freeing it would wait for the op: leave it to the OS
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))
            self._graves = []

    def track(self, work: Work) -> None:
        with self._cond:
            self._works.append(work)
            self._ensure_thread()
            if work.deadline_ns < time.monotonic_ns() + SWEEP_S * 1e9:
                self._cond.notify()

    def sweep_native(self, comm: "Communicator") -> None:
        """Sweep the native path's async ops of ``comm`` from now on (while it lives)."""
        with self._cond:
            self._swept.add(comm)
            self._ensure_thread()

    def bury(self, backend: Any, work: Any) -> None:
        """Hold ``backend`` until ``work`` (its op that outlived its ``Work``) has ended."""
        with self._cond:
            self._graves.append((backend, work))
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            atexit.register(self.stop)
            self._thread = threading.Thread(target=self._run, name="commslayer-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            with self._cond:
                if self._works:
                    first = min(w.deadline_ns for w in self._works)
                    delay = min(SWEEP_S, max(0.0, (first - time.monotonic_ns()) / 1e9))
                else:
                    delay = SWEEP_S
                self._cond.wait(delay)
                works = self._works
            now = time.monotonic_ns()
            settled = [w for w in works if w.poll(now)]
            for comm in list(self._swept):
                path = comm._native
                if path is not None:
                    path.sweep(now, not comm.lifecycle.clean)
            with self._cond:
                if settled:
                    done = set(map(id, settled))
                    self._works = [w for w in self._works if id(w) not in done]
                kept, ended = [], []
                for grave in self._graves:
                    (ended if grave[1].is_completed() else kept).append(grave)
                self._graves = kept
            ended.clear()  # the backends whose op ended are freed here, outside the lock
            self._run_every(time.monotonic())

    def _run_every(self, now: float) -> None:
        for call in list(self._every):
            if now < call.due:
                continue
            call.due = now + call.period_s
            try:
                call.fn()
            except Exception:  # an observer must not stop the watchdog
                if not call.failed:
                    log.exception("commslayer: %r, called by the watchdog, raised (not logged again)", call.fn)
                call.failed = True


WATCHDOG = Watchdog()
