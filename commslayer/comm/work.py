"""``Work``: the handle of one issued op, and the deadline it must meet.

A ``Work`` wraps the c10d work of the backend.  ``wait`` blocks (without the
GIL) until the backend finishes or the deadline passes; then it settles the op
exactly once: runs the op's finishing step (AVG's division, for example), or
records the error and tells the communicator it is broken.  The watchdog
settles async ops that nobody waits for, so an overdue op is reported even
when the caller has moved on.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from commslayer.comm.backends import classify
from commslayer.errors import CollectiveTimeout, CommError, first_line
from commslayer.comm.validation import Timeout, timeout_seconds

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator
    from commslayer.hooks import Hooks, OpRecord


class WorkStatus(enum.Enum):
    NOT_STARTED = "not_started"
    INPROGRESS = "inprogress"
    COMPLETED = "completed"
    TIMEDOUT = "timedout"
    ERROR = "error"


_DONE = (WorkStatus.COMPLETED, WorkStatus.TIMEDOUT, WorkStatus.ERROR)

# With a liveness monitor, waits on the backend wake this often to see whether
# the communicator broke meanwhile; ops shorter than this never wake.  Not
# send/recv: Gloo ends a point-to-point work with an error at its first timed-out wait.
_SLICE_S = 0.05
WAIT_SLICE = timedelta(seconds=_SLICE_S)


class Work:
    """One op in flight. ``wait()``, ``is_completed()``, ``status``, ``exception()``."""

    __slots__ = (
        "comm", "op", "seq", "op_id", "peer", "timeout_s", "start_ns", "deadline_ns", "end_ns",
        "_c10d", "_finish", "_status", "_error", "record",
    )

    def __init__(
        self,
        comm: "Communicator",
        op: str,
        seq: int,
        op_id: int,
        timeout_s: float,
        start_ns: int,
        c10d_work: Any,
        finish: Optional[Callable[[], None]] = None,
        peer: Optional[int] = None,
        record: Optional[OpRecord] = None,
    ) -> None:
        self.comm = comm
        self.peer = peer
        self.op = op
        self.seq = seq
        self.op_id = op_id
        self.timeout_s = timeout_s
        self.start_ns = start_ns
        self.deadline_ns = start_ns + int(timeout_s * 1e9)
        self.end_ns: Optional[int] = None
        self._c10d = c10d_work
        self._finish = finish
        self._status = WorkStatus.INPROGRESS
        self._error: Optional[CommError] = None
        self.record = record  # the flight recorder's entry for this op, if one watches

    @property
    def status(self) -> WorkStatus:
        return self._status

    def exception(self) -> Optional[CommError]:
        """The error this op ended with, or None."""
        return self._error

    def is_completed(self) -> bool:
        """True once the op has ended, successfully or not (never blocks)."""
        if self._status in _DONE:
            return True
        if self._c10d.is_completed():
            if self.op in self.comm.waited_once and self._c10d.__class__ is not WaitedElsewhere:
                # Such a work completes inside the wait of the thread that settles it; waiting
                # on it again from here (the watchdog) would close the group's connections.
                return True
            self._settle_from_backend(0.0)
            return True
        return False

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the op is done; raise its ``CommError`` if it failed.

        ``timeout`` (a timedelta or seconds) shortens the op's own deadline: an
        op still running when the wait gives up is declared timed out (it
        cannot be cancelled, so the communicator cannot be trusted after it
        either). Not positive, not finite or not a number: ``InvalidArgument``.
        """
        if timeout is not None:
            timeout_s = timeout_seconds(timeout, self.timeout_s, self.comm._checker(self.op))
        began = time.monotonic_ns()
        try:
            if self._status not in _DONE:
                remaining = (self.deadline_ns - began) / 1e9
                if timeout is not None:
                    remaining = min(remaining, timeout_s)
                self._settle_from_backend(remaining)
        finally:
            if self.record is not None:  # the caller's exposed communication time
                self.record.waited(began, time.monotonic_ns())
        if self._error is not None:
            raise self._error
        return True

    def wait_issued(self, timeout: timedelta) -> None:
        """The synchronous path: wait the op's whole timeout right after issuing it
        (in slices when a liveness monitor may interrupt it)."""
        sliced = self.comm.lifecycle.watched and self.peer is None
        try:
            self._c10d.wait(WAIT_SLICE if sliced else timeout)
        except RuntimeError as exc:
            self.wait_failed(exc)
            return
        if self._finish is None and not self.comm.completion_hooks.fns:
            self.completed_now()
            return
        self._complete()
        if self._error is not None:
            raise self._error

    def completed_now(self) -> None:
        """The synchronous op's wait returned, and nothing is left to run: it completed.
        Kept short: it runs right after a long wait, with cold caches."""
        self.end_ns = time.monotonic_ns()
        self._status = WorkStatus.COMPLETED
        if self.record is not None:
            self.record.ended(self)

    def wait_failed(self, exc: RuntimeError) -> None:
        """The synchronous op's first wait (its deadline, or a slice of it) raised
        ``exc``: settle the op, raising its error unless a later slice saw it complete."""
        if not (self.comm.lifecycle.watched and self.peer is None):
            self._backend_failed(exc)
            assert self._error is not None  # a failed backend always leaves its error
            raise self._error from None
        self._settle_from_backend((self.deadline_ns - time.monotonic_ns()) / 1e9)
        if self._error is not None:
            raise self._error

    def fail_before_issue(self, err: CommError, post_hooks: "Hooks", breaks: bool) -> None:
        """The op never reached the backend (check mode refused it, or the call raised)."""
        if post_hooks.fns:
            post_hooks(self.op_id, self)
        self._fail(err, time.monotonic_ns(), breaks=breaks)

    def get_future(self) -> "torch.futures.Future[None]":
        """A future that completes with the op, or fails with its ``CommError``."""

        def settle(fut: "torch.futures.Future[Any]") -> None:
            self._settle_from_future(fut)
            if self._error is not None:
                raise self._error

        if self._c10d is None:  # a synchronous op that completed in native code
            done: "torch.futures.Future[None]" = torch.futures.Future()
            done.set_result(None)
            return done
        future: "torch.futures.Future[None]" = self._c10d.get_future().then(settle)
        return future

    def settle_when_done(self) -> None:
        """Settle the op from the backend's completion callback, as it ends.

        A backend work with no future (Gloo's reduce-scatter) settles when it
        is waited on instead: waiting on it from a second thread corrupted
        FSDP2's gradients (measured), so nothing else does.
        """
        try:
            future = self._c10d.get_future()
        except RuntimeError:
            return
        future.add_done_callback(self._settle_from_future)

    def _settle_from_future(self, fut: "torch.futures.Future[Any]") -> None:
        # Runs on the backend's thread as the op ends: waiting here would deadlock.
        try:
            fut.value()
        except RuntimeError as exc:
            self._backend_failed(exc)
        else:
            self._complete()

    def poll(self, now_ns: int) -> bool:
        """Watchdog step: settle the op if it ended, is overdue, or its communicator
        broke meanwhile; True when settled."""
        if self.is_completed():
            return True
        if now_ns >= self.deadline_ns:
            self._expire(now_ns)
            return True
        err = self._interruption()
        if err is not None:
            self._fail(err, now_ns)
            return True
        return False

    def _settle_from_backend(self, remaining_s: float) -> None:
        if remaining_s <= 0 and not self._c10d.is_completed():
            self._expire(time.monotonic_ns())
            return
        end_ns = time.monotonic_ns() + int(remaining_s * 1e9)
        sliceable = self.comm.lifecycle.watched and self.peer is None
        while True:
            watched = sliceable and remaining_s > _SLICE_S
            try:
                # c10d truncates to whole milliseconds, and 0 would mean "forever"
                self._c10d.wait(WAIT_SLICE if watched else timedelta(milliseconds=max(remaining_s * 1e3, 1.0)))
            except RuntimeError as exc:
                if not watched:
                    self._backend_failed(exc)
                    return
                if self._c10d.is_completed():  # it ended as the slice ran out: one more wait tells how
                    sliceable = False
                else:
                    err = self._interruption()
                    if err is not None:
                        self._fail(err, time.monotonic_ns())
                        return
                remaining_s = (end_ns - time.monotonic_ns()) / 1e9
                continue
            break
        self._complete()

    def _elapsed_s(self) -> float:
        return (time.monotonic_ns() - self.start_ns) / 1e9

    def _interruption(self) -> Optional[CommError]:
        """The error this op ends with once its communicator broke or closed (None while usable)."""
        return self.comm.lifecycle.interruption(self.op, self.seq, self.timeout_s, self._elapsed_s())

    def _error_from(self, exc: BaseException) -> CommError:
        """A backend exception raised while waiting on this op, as our error."""
        return self.comm.lifecycle.error_from(exc, self.op, self.seq, self.timeout_s, self._elapsed_s(), self.peer)

    def _backend_failed(self, exc: RuntimeError) -> None:
        now_ns = time.monotonic_ns()
        if classify(exc) is CollectiveTimeout:  # a backend's timeout before the op's deadline: keep its words
            self._expire(now_ns, first_line(exc) if now_ns < self.deadline_ns else None)
        elif now_ns >= self.deadline_ns and self.peer is None:
            # Out of time whatever the backend says: a peer whose own copy of the op timed out
            # first closes the connection, and this side must still take part in ``mismatched``.
            self._expire(now_ns, first_line(exc))
        else:
            self._fail(self._error_from(exc), now_ns)

    def _complete(self) -> None:
        with self.comm.settle_lock:
            if self._status in _DONE:
                return
            try:
                if self._finish is not None:
                    self._finish()
            except Exception as exc:
                self._error = self._error_from(exc)
                self._status = WorkStatus.ERROR
            else:
                self._status = WorkStatus.COMPLETED
            self.end_ns = time.monotonic_ns()
        if self.record is not None:
            self.record.ended(self)
        if self.comm.completion_hooks.fns:
            self.comm.completion_hooks(self)

    def _expire(self, now_ns: int, backend: Optional[str] = None) -> None:
        """The op ran out of time: its deadline passed, or the backend said so (``backend``: its words)."""
        err = CollectiveTimeout(
            "collective timed out" if backend is None else f"collective timed out (backend: {backend})",
            comm=self.comm.get_name(),
            op=self.op,
            seq=self.seq,
            timeout_s=self.timeout_s,
            elapsed_s=(now_ns - self.start_ns) / 1e9,
            ranks=() if self.peer is None else (self.peer,),
        )
        self._fail(err if self.peer is not None else self.comm.lifecycle.mismatched(err), now_ns, WorkStatus.TIMEDOUT)

    def _fail(self, err: CommError, now_ns: int, status: WorkStatus = WorkStatus.ERROR, breaks: bool = True) -> None:
        with self.comm.settle_lock:
            if self._status in _DONE:
                return
            self._error = err
            self._status = status
            self.end_ns = now_ns
            if self._c10d is not None and not self._c10d.is_completed():
                self.comm._orphaned(self._c10d)
        if self.record is not None:
            self.record.ended(self)  # before the error hooks, which may dump the trace
        if breaks:
            self.comm.lifecycle.fail(err)
        if self.comm.completion_hooks.fns:
            self.comm.completion_hooks(self)

    def __repr__(self) -> str:
        return f"<Work {self.comm.get_name()}:{self.op}#{self.seq} {self._status.value}>"


class NativeWork(Work):
    """An async ``all_reduce`` or ``all_gather_single`` of the communicator's own API
    that the native path issued (``OpPath._native_async``): its backend work is an
    ``AsyncOpWork`` (direct_path.cpp), which waits without running
    Python, runs the finishing step (isolation's copy, AVG's division), keeps its
    record and settles a failure as ``Work`` would; the native watchdog sweep settles
    it when nobody waits.  Here only the outcome is read."""

    __slots__ = ()

    def is_completed(self) -> bool:
        if self._status in _DONE:
            return True
        if not self._c10d.is_completed():
            return False
        self._settle(None)
        return True

    def wait(self, timeout: Timeout = None) -> bool:
        if self._status not in _DONE:
            self._settle(None if timeout is None else timeout_seconds(timeout, self.timeout_s,
                                                                     self.comm._checker(self.op)))
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> "torch.futures.Future[None]":
        def settle(fut: "torch.futures.Future[Any]") -> None:
            self._settle(None)  # done by now: its outcome, at once
            if self._error is not None:
                raise self._error

        future: "torch.futures.Future[None]" = self._c10d.get_future().then(settle)
        return future

    def _settle(self, timeout_s: Optional[float]) -> None:
        try:
            if timeout_s is None:
                self._c10d.wait()
            else:
                self._c10d.wait(timedelta(milliseconds=max(1.0, timeout_s * 1e3)))
        except CommError as err:
            self._error = err
            self._status = WorkStatus.TIMEDOUT if isinstance(err, CollectiveTimeout) else WorkStatus.ERROR
        else:
            self._status = WorkStatus.COMPLETED
        self.end_ns = time.monotonic_ns()


class AnySourceWork(Work):
    """A recv from any source: its peer (the sender) and its number in that pair
    are known once it completed; until then ``peer`` is None."""

    __slots__ = ()

    def _complete(self) -> None:
        with self.comm.settle_lock:
            if self.peer is None and self._status not in _DONE:
                self.peer = self._c10d._source_rank()
                self.seq = self.comm._numbered(self.peer)
        super()._complete()


class WaitedElsewhere:
    """A backend work whose ``wait(timeout)`` ignores the timeout (Gloo's
    reduce-scatter), waited on by the communicator's ``Waiter`` thread instead, so
    that the caller can wait in slices and be interrupted like any other op.
    Exactly one thread waits on the real work: two waiters corrupted FSDP2's
    gradients (measured)."""

    __slots__ = ("work", "timeout", "finished", "_held", "error")

    def __init__(self, work: Any, timeout: Optional[timedelta] = None) -> None:
        self.work = work
        self.timeout = timeout  # the op's deadline, for a backend work whose wait honours it
        self.finished = False
        # Held until the work ends: a lock's timed acquire is one C call, where an
        # Event's wait runs threading.Condition's Python after the op's transfer.
        self._held = threading.Lock()
        self._held.acquire()
        self.error: Optional[BaseException] = None

    def set_finished(self) -> None:
        """The waiter thread's call once the work ended (``error`` set before, if it failed)."""
        self.finished = True
        self._held.release()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self.finished:
            if not self._held.acquire(timeout=-1 if timeout is None else timeout.total_seconds()):
                raise RuntimeError("Operation timed out!")
            self._held.release()  # for any later wait
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.finished

    def get_future(self) -> Any:
        raise RuntimeError("this work has no future")

    def _source_rank(self) -> int:
        return int(self.work._source_rank())


class Waiter:
    """One daemon thread per communicator that waits on ``WaitedElsewhere`` works in turn."""

    def __init__(self, label: str) -> None:
        self._queue: "queue.SimpleQueue[Optional[WaitedElsewhere]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"commslayer-waiter-{label}", daemon=True)
        self._thread.start()

    def wrap(self, work: Any, timeout: Optional[timedelta] = None) -> WaitedElsewhere:
        waited = WaitedElsewhere(work, timeout)
        self._queue.put(waited)
        return waited

    def _run(self) -> None:
        while True:
            waited = self._queue.get()
            if waited is None:
                return
            try:
                waited.work.wait() if waited.timeout is None else waited.work.wait(waited.timeout)
            except BaseException as exc:  # handed to the caller's wait
                waited.error = exc
            waited.set_finished()
            waited = None

    def stop(self) -> None:
        """End the thread once the works queued before have ended (idempotent)."""
        self._queue.put(None)
