"""The machinery every trace sink shares: a hot-path enqueue and a draining thread.

Rendering a record (structlog: ~6-15 µs; an OpenTelemetry span: 20-70 µs)
must not happen on the thread that runs the training loop or the backend's
callback.  A sink therefore only appends the finished record to a bounded
deque (past the bound it drops and counts, it never blocks or grows without
limit); its own daemon thread drains the deque and does the slow part.
Lifecycle events of the communicators (created, split, aborted, errors) are
queued the same way.

The native direct path's ops call no sink at all: their records are in the
recorder's ``NativeRing``, and the sink's thread reads the ones that ended
since its last drain (``tracing.record.oprecord.NativeCursor``), so that a
sink leaves those ops on the native path (docs/bench/step-cost.md).  A
record the ring overwrote before a drain reached it counts as dropped; a
drain that read more than a quarter of the ring comes back ten times sooner.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple, Type, TypeVar, Union

import commslayer
from commslayer import config

from tracing.record.oprecord import NativeCursor, Record, global_rank

if TYPE_CHECKING:
    from tracing.record.recorder import FlightRecorder

log = logging.getLogger("commslayer.tracing")

Item = Union[Record, Dict[str, Any]]  # an op record, or a lifecycle event


def split_parent(uid: str) -> Optional[str]:
    """The uid of the communicator ``uid`` was split from, or None for a root one."""
    return uid.rsplit("/", 1)[0] if "/" in uid else None


_ERROR_EVENTS = {"CollectiveTimeout": "collective_timeout", "PeerLost": "peer_lost"}


_Sink = TypeVar("_Sink", bound="QueuedSink")


def _when(item: Item) -> int:
    """When a batch's item happened (monotonic ns): an op's end, an event's time."""
    if isinstance(item, Record):
        return item.enqueue_ns if item.end_ns is None else item.end_ns
    return int(item.get("mono_ns", 0))


class QueuedSink:
    """The shared machinery of a trace sink: a hot-path enqueue and a draining thread.

    ``enqueue`` (what goes into ``FlightRecorder.sinks``) appends to a
    bounded deque; a daemon thread calls ``process`` with everything queued,
    every ``interval_s`` or as soon as a quarter of the bound is reached.
    ``flush()`` does the same from the caller's thread and waits for it.
    Each batch also holds the native path's records that ended since the last
    one (``reads_native_ring``), and is in the order things happened.
    Subclasses implement ``process`` and may set ``lifecycle`` to also queue
    communicator events (created, split, aborted, errors).
    """

    thread_name = "commslayer-trace-sink"
    lifecycle = False
    reads_native_ring = True  # the recorder keeps native ops native (FlightRecorder._sinks_changed)

    def __init__(self, rec: FlightRecorder, *, capacity: Optional[int] = None, interval_s: float = 0.1) -> None:
        self.rec = rec
        self.rank = global_rank()
        self.capacity = capacity or config.trace_sink_queue()
        self.interval_s = interval_s
        self.dropped = 0  # records refused by a full queue
        self.process_errors = 0  # batches whose processing raised
        self._queue: Deque[Item] = deque()
        self._wake_at = max(1, self.capacity // 4)
        self._woken = False
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one drain at a time
        self._reported_drops = 0
        self._closed = False
        self._handles: List[Any] = []
        ring = rec._native
        self._cursor = None if ring is None else NativeCursor(ring.count)  # ops that end from now on
        self._wait_s = interval_s
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)

    # ------------------------------------------------------------ attaching
    def _start(self) -> None:
        """Hook into the recorder (and, for lifecycle events, every communicator), start the thread."""
        if self.lifecycle:
            for comm in commslayer.live_communicators():
                self._watch(comm)
            self._handles.append(commslayer.register_communicator_hook(self._watch))
        self.rec.add_sink(self)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def attached(cls: Type[_Sink], rec: FlightRecorder) -> Optional[_Sink]:
        """The sink of this class already attached to ``rec``, if any."""
        return next((s for s in rec.sinks if type(s) is cls), None)

    def _watch(self, comm: "commslayer.Communicator") -> None:
        """Queue the communicator's lifecycle events: created or split, errors, abort."""
        ref = weakref.ref(comm)  # the hooks below must not keep the communicator alive
        parent = split_parent(comm.uid)
        info: Dict[str, Any] = {"comm": comm.get_name(), "comm_id": comm.uid, "parent_id": parent, "backend": comm.get_backend(),
                "comm_rank": comm.get_rank(), "size": comm.get_size(), "global_ranks": comm.global_ranks,
                "generation": comm.generation}
        self._event("communicator_split" if parent else "communicator_created", info)

        def generation() -> int:
            c = ref()
            return info["generation"] if c is None else c.generation

        def on_error(err: "commslayer.CommError") -> None:
            self._event(_ERROR_EVENTS.get(type(err).__name__, "communicator_error"), info,
                        error_type=type(err).__name__, error=str(err), op=err.op, seq=err.seq,
                        timeout_s=err.timeout_s, elapsed_s=err.elapsed_s, ranks=list(err.ranks),
                        generation=generation())

        self._handles += [
            comm.register_error_hook(on_error),
            comm.register_abort_hook(lambda: self._event("communicator_aborted", info, generation=generation())),
        ]

    def _event(self, event: str, info: Dict[str, Any], **fields: Any) -> None:
        """Queue a lifecycle event (rare: never dropped)."""
        self._queue.append({"event": event, **info, **fields, "mono_ns": time.monotonic_ns(),
                            "_wall_ns": time.time_ns()})

    def recovery_event(self, ev: Dict[str, Any]) -> None:
        """Queue a recovery event of the recorder (``records.EVENT_KINDS``) as a ``recovery`` line."""
        self._queue.append({"event": "recovery", **ev, "_wall_ns": time.time_ns()})

    # ------------------------------------------------------------- hot path
    def enqueue(self, record: Record) -> None:
        """The sink callable: queue a finished record; drop and count it when full."""
        q = self._queue
        if len(q) < self.capacity:
            q.append(record)
            if len(q) >= self._wake_at and not self._woken:
                self._woken = True
                self._wake.set()
        else:
            self.dropped += 1

    # ------------------------------------------------------------- draining
    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._wait_s)
            self._wake.clear()
            self._woken = False
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            q = self._queue
            items: List[Item] = [q.popleft() for _ in range(len(q))]
            if self._cursor is not None:
                items += self._native_records()
                items.sort(key=_when)
            dropped = self.dropped
            if dropped != self._reported_drops:
                items.append({"event": "sink_dropped", "dropped": dropped - self._reported_drops,
                              "dropped_total": dropped, "mono_ns": time.monotonic_ns(), "_wall_ns": time.time_ns()})
                self._reported_drops = dropped
            if not items:
                return
            try:
                self.process(items)
            except Exception:  # a sink must never take the job down
                self.process_errors += 1
                if self.process_errors == 1:
                    log.exception("commslayer tracing: %s failed (later failures are counted, not logged)",
                                  type(self).__name__)

    def _native_records(self) -> List[Record]:
        """The native path's records that ended since the last drain (lock held)."""
        cursor, ring = self._cursor, self.rec._native
        assert cursor is not None
        backlog, missed = ring.count - cursor.position, cursor.missed
        ended, _ = cursor.read(ring)
        self.dropped += cursor.missed - missed
        self._wait_s = self.interval_s / 10 if backlog > self.rec.capacity // 4 else self.interval_s
        return [Record.from_native(fields, []) for fields in ended]

    def process(self, items: List[Item]) -> None:
        """Handle a batch of records and lifecycle events (on the sink's thread)."""
        raise NotImplementedError

    def comm_info(self, uid: str) -> Tuple[Optional[int], Optional[str]]:
        """This process's rank in communicator ``uid`` and its backend; (None, None) if
        the recorder never saw it."""
        info = self.rec.communicator_info(uid)
        return (None, None) if info is None else (info["rank"], info["backend"])

    def flush(self) -> None:
        """Process everything queued so far, now, and wait until it is written."""
        self._drain()

    def close(self) -> None:
        """Flush, stop the thread and unhook (idempotent; also runs at exit)."""
        if self._closed:
            return
        self._closed = True
        self.rec.remove_sink(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._wake.set()
        try:
            self.flush()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Release files and providers after the last flush."""
