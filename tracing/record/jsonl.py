"""Structured JSON lines per rank, written off the hot path.

A Gloo op costs ~50 µs-1 ms here, and rendering one structlog event with
orjson costs ~6-15 µs: rendering in the completion hook would add up to a
third to a small op, on the thread that runs the training loop or the
backend's callback.  So a sink callable only appends the finished ``Record``
to a bounded deque (over the bound it drops and counts, it never blocks or
grows without limit), and a daemon thread drains the deque every ~100 ms, or
sooner when it fills up, renders each record as one ``"collective"`` event
and appends the whole batch to ``<trace_dir>/rank<R>.jsonl`` in one write.

structlog is configured locally (``structlog.wrap_logger`` around a
``BytesLogger`` that writes into an in-memory batch buffer), never through
``structlog.configure``: the training job may use structlog itself, and a
library must not change how its logs look.

Besides the ops, the file gets lifecycle events: ``trace_started`` (with the
clock anchor that turns the records' monotonic times into wall time),
``communicator_created`` / ``communicator_split`` (a split's uid contains
``/``), ``communicator_aborted``, ``collective_timeout``, ``peer_lost`` and
``communicator_error``, ``recovery`` (the recorder's recovery events: a peer
lost, a new generation, fencing, a replica group recovered from, admitted,
healed) and ``sink_dropped`` when the queue overflowed.

A failing write (full disk, vanished directory) never raises into the job:
the torn tail is cut off, the loss is counted and the first failure is
logged once, as ``tracing.dumps.DumpWriter`` does for dumps.  The remaining
lines are written at exit; ``flush()`` writes them now.

The machinery shared with the OpenTelemetry sink is in ``tracing.record.sinks``
(``QueuedSink``) and ``tracing.dumps`` (``AppendWriter``).
"""

from __future__ import annotations

import io
import logging
import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Dict, List, MutableMapping, Optional

import orjson
import structlog

from tracing.dumps import FILE_MODE, AppendWriter
from tracing.records import COMPLETED, SCHEMA_VERSION
from tracing.record.oprecord import Record
from tracing.record.sinks import Item, QueuedSink

if TYPE_CHECKING:
    from tracing.record.recorder import FlightRecorder

log = logging.getLogger("commslayer.tracing")



def _iso(wall_ns: int) -> str:
    return datetime.fromtimestamp(wall_ns / 1e9, timezone.utc).isoformat(timespec="microseconds")


def _stamp(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: ``ts`` is when the event happened, not when it was rendered."""
    wall = event_dict.pop("_wall_ns", None)
    event_dict["ts"] = _iso(time.time_ns() if wall is None else wall)
    return event_dict


class JsonlSink(QueuedSink):
    """structlog JSON lines, one file per rank: ``<trace_dir>/rank<R>.jsonl``."""

    thread_name = "commslayer-trace-jsonl"
    lifecycle = True

    def __init__(self, rec: FlightRecorder, *, path: Optional[str] = None, capacity: Optional[int] = None) -> None:
        super().__init__(rec, capacity=capacity)
        if path is None:
            if rec.writer is None:
                raise ValueError("JsonlSink needs a trace directory (COMMSLAYER_TRACE_DIR)")
            path = os.path.join(rec.writer.directory, f"rank{self.rank}.jsonl")
        self.writer = AppendWriter(path, rec.writer.mode if rec.writer is not None else FILE_MODE)
        self._buffer = io.BytesIO()
        self._log = structlog.wrap_logger(
            structlog.BytesLogger(self._buffer),
            processors=[structlog.processors.add_log_level, _stamp,
                        structlog.processors.JSONRenderer(serializer=orjson.dumps)],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            context_class=dict,
            cache_logger_on_first_use=False,
        ).bind(job=rec.job, rank=self.rank, host=rec.host, pid=os.getpid())

    @classmethod
    def attach(cls, rec: FlightRecorder, *, path: Optional[str] = None) -> "JsonlSink":
        """Write every op and lifecycle event of ``rec``'s process as JSON lines (idempotent)."""
        sink = cls.attached(rec)
        if sink is not None:
            return sink
        sink = cls(rec, path=path)
        sink._event("trace_started", {"schema": SCHEMA_VERSION, "clock": dict(rec.clock), "cwd": rec.cwd})
        sink._start()
        return sink

    @property
    def path(self) -> str:
        """The file this sink appends to."""
        return self.writer.path

    def stats(self) -> Dict[str, int]:
        """Queue length and every kind of loss, for tests and health checks."""
        return {"queued": len(self._queue), "dropped": self.dropped, "failed_writes": self.writer.failed_writes,
                "lost_records": self.writer.dropped_records, "process_errors": self.process_errors}

    def process(self, items: List[Item]) -> None:
        """Render the batch into the buffer, then append it in one write."""
        clock = self.rec.clock
        offset = clock["wall_ns"] - clock["mono_ns"]
        lg = self._log
        buf = self._buffer
        buf.seek(0)
        buf.truncate()
        records = 0
        for item in items:
            if isinstance(item, Record):
                records += 1
                end = item.end_ns if item.end_ns is not None else item.enqueue_ns
                emit = lg.info if item.state == COMPLETED else lg.warning
                emit("collective", _wall_ns=end + offset, **item.to_dict())
            else:
                fields = dict(item)
                event = fields.pop("event")
                emit = lg.error if event in ("collective_timeout", "peer_lost", "communicator_error",
                                             "sink_dropped") else lg.info
                emit(event, **fields)
        self.writer.write(buf.getvalue(), records=records)

    def _shutdown(self) -> None:
        self.writer.close()
