"""The flight recorder's figures in each status record of a resilient job.

``attach(rec)`` registers ``StatusFigures`` as a status source
(``commslayer.hooks.register_status_source``): when the job writes its status
record (at a committed step, about once a second, while ``commslayer-run
--status-port`` serves the job), it reads the ops that ended since its last
call from the recorder's rings (the Python one and the native path's) and
adds to the record:

- ``ops``: per communicator name and op, cumulative over this life: ops,
  bytes (the larger of input and output, as the OpenTelemetry sink counts
  them), the sum of their latencies, their count in each bucket of
  ``commslayer.runs.OP_LATENCY_BUCKETS``, and the ops that did not complete
  by final state (``timed_out``, ``failed``, ``aborted``); ``missed``: ops
  that left the ring before a call saw them (more ops between two records
  than the ring holds);
- ``arrivals``: the step's collectives (the last ``MAX_ARRIVALS``), each as
  (communicator uid, generation, seq, wall-clock seconds it entered
  commslayer): ``commslayer-run --status-port`` matches them across ranks to
  find the rank that arrived last and how long the others waited for it.

- ``op``: the rank's last op (``CurrentOp``: the one that ended last) as
  ``OpReporter`` last looked at it, at most ``REPORT_S`` before the record.

A rank stuck inside an op writes no status record (its training thread is
in the op), so ``OpReporter`` also looks from the watchdog's thread
(``commslayer.comm.watchdog.Watchdog.every``), every ``REPORT_S``, once a
status server serves the job (``commslayer.hooks.register_status_reporter``),
and writes the op into the job's store (``commslayer.train.job.op_key``)
when one has been in flight for ``STUCK_S`` or more, and once more when that
op ended: one store write per stuck op, none while ops end in time, handed
to the store's own worker (``BoundedStore.set_soon``) so that the watchdog
never waits on the store.

Nothing here runs per op: the op path fills the rings as before, and this
reads them once per status record and once per look: of each ring, only the
records begun since the last read (and those then still in flight). What
that costs the training thread: docs/bench/status.md.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from commslayer.comm.op_path import DIRECT_OPS
from commslayer.runs import OP_LATENCY_BUCKETS
from commslayer.comm.watchdog import WATCHDOG
from commslayer.hooks import register_status_reporter, register_status_source

from tracing.messages import IN_FLIGHT, op_name
from tracing.record.oprecord import NativeCursor
from tracing.records import COMPLETED, FINAL_STATES, STATES

if TYPE_CHECKING:
    from tracing.record.recorder import FlightRecorder

MAX_ARRIVALS = 64  # the step's last collectives whose arrivals a record carries
REPORT_S = 1.0  # OpReporter looks at the rings this often (on the watchdog's thread)
STUCK_S = 1.0  # and writes the op it finds in flight for this long or longer

# One finished op as read from either ring:
# (op_id, comm name, comm uid, generation, seq, op, bytes, latency s, state, enqueue ns, step)
Op = Tuple[int, str, str, int, int, str, int, float, str, int, Any]


class StatusFigures:
    """What one recorder adds to the status records (see the module doc)."""

    def __init__(self, rec: "FlightRecorder", reporter: Optional["OpReporter"] = None) -> None:
        self._rec = rec
        self._reporter = reporter
        self._totals: Dict[Tuple[str, str], List[Any]] = {}  # (comm, op) -> [ops, bytes, sum s, buckets, errors]
        self._counted: Set[int] = set()  # op ids counted that are still in the Python ring
        self._total = 0  # ops counted in all
        self._native = NativeCursor()
        self._wall_minus_mono = rec.clock["wall_ns"] - rec.clock["mono_ns"]

    def __call__(self, step: int) -> Dict[str, Any]:
        new, self._counted, in_flight, recorded = self._read()
        arrivals: List[List[Any]] = []
        for op in new:
            self._add(op)
            if op[10] == step and op[5] not in ("send", "recv"):
                arrivals.append([op[2], op[3], op[4], (op[9] + self._wall_minus_mono) / 1e9])
        arrivals.sort(key=lambda a: a[3])
        return {"ops": [[comm, op, n, nbytes, seconds, list(buckets), dict(errors)]
                        for (comm, op), (n, nbytes, seconds, buckets, errors) in sorted(self._totals.items())],
                "missed": max(0, recorded - self._total - in_flight),
                "arrivals": {"step": step, "ops": arrivals[-MAX_ARRIVALS:]},
                "op": None if self._reporter is None else self._reporter.ended}

    def _read(self) -> Tuple[List[Op], Set[int], int, int]:
        """The finished ops in both rings not counted yet, the ids of every finished op in
        the Python one, the ops in flight, and how many ops were recorded in all."""
        rec, counted = self._rec, self._counted
        new: List[Op] = []
        finished: Set[int] = set()
        in_flight = 0
        for r in list(rec._ring):
            if r is None:
                continue
            if r.op_id in counted:
                finished.add(r.op_id)
                continue
            end = r.end_ns
            if end is None or r.state not in FINAL_STATES:
                in_flight += 1
                continue
            finished.add(r.op_id)
            new.append((r.op_id, r.comm, r.comm_id, r.generation, r.seq, r.op, _bytes(r.dtype, r.in_sizes, r.out_sizes),
                        (end - (r.start_ns or r.enqueue_ns)) / 1e9, r.state, r.enqueue_ns, r.step))
        recorded = rec._count
        if rec._native is not None:
            recorded += rec._native.count - rec._native.taken
            ended, flying = self._native.read(rec._native)
            in_flight += len(flying)
            for f in ended:
                (op_id, (comm, uid, gen), seq, kind, dtype, in_shape, out_shape, _, state, start, end) = f[:11]
                new.append((op_id, comm, uid, gen, seq, DIRECT_OPS[kind], _bytes(dtype, [in_shape], [out_shape]),
                            (end - start) / 1e9, STATES[state], start, f[14]))
        return new, finished, in_flight, recorded

    def _add(self, op: Op) -> None:
        t = self._totals.get((op[1], op[5]))
        if t is None:
            t = self._totals[(op[1], op[5])] = [0, 0, 0.0, [0] * (len(OP_LATENCY_BUCKETS) + 1), {}]
        self._total += 1
        t[0] += 1
        t[1] += op[6]
        t[2] += op[7]
        t[3][bisect.bisect_left(OP_LATENCY_BUCKETS, op[7])] += 1
        if op[8] != COMPLETED:
            t[4][op[8]] = t[4].get(op[8], 0) + 1


def _bytes(dtype: Any, in_sizes: Iterable[Any], out_sizes: Iterable[Any]) -> int:
    """The larger of an op's input and output bytes."""
    if dtype is None:
        return 0
    return max(sum(math.prod(s) for s in in_sizes), sum(math.prod(s) for s in out_sizes)) * dtype.itemsize


class CurrentOp:
    """This process's current op in ``rec``'s rings: the oldest in flight (by the time it
    began), else the one that ended last; each call reads only the records begun since
    the last one, and those still in flight then. Not thread-safe: one caller at a time."""

    def __init__(self, rec: "FlightRecorder") -> None:
        self._rec = rec
        self._from = 0  # the Python ring's first position not read yet, or in flight when read
        self._cursor = NativeCursor()  # the native ring's
        self._ended: Optional[Tuple[int, str, str, int, str]] = None  # (end ns, comm, op, seq, state)
        self._wall_minus_mono = rec.clock["wall_ns"] - rec.clock["mono_ns"]

    def __call__(self) -> Optional[Dict[str, Any]]:
        """The op as the status server takes it: op, comm, seq, name (as ``commslayer-trace
        watch`` names it, ``tracing.messages.op_name``), state (``IN_FLIGHT`` or its final
        state), in_flight, since (wall-clock seconds: when it began if in flight, else when
        it ended), t (wall-clock seconds now) and pid; None before any op."""
        flying = self._python() + self._native()
        return self._as_dict(min(flying)) if flying else self.ended()

    def ended(self) -> Optional[Dict[str, Any]]:
        """The op that ended last as of the last call, likewise; None before any ended."""
        return None if self._ended is None else self._as_dict(self._ended)

    def _as_dict(self, found: Tuple[int, str, str, int, str]) -> Dict[str, Any]:
        ns, comm, op, seq, state = found
        return {"op": op, "comm": comm, "seq": seq, "name": op_name(op, seq, comm), "state": state,
                "in_flight": state == IN_FLIGHT, "since": (ns + self._wall_minus_mono) / 1e9, "t": time.time(),
                "pid": os.getpid()}

    def _end(self, end: int, comm: str, op: str, seq: int, state: str) -> None:
        if self._ended is None or end >= self._ended[0]:
            self._ended = (end, comm, op, seq, state)

    def _python(self) -> List[Tuple[int, str, str, int, str]]:
        """The Python ring's records in flight (start ns, comm, op, seq, IN_FLIGHT), read from
        where the last call stopped."""
        rec = self._rec
        flying: List[Tuple[int, str, str, int, str]] = []
        count = rec._count
        first = max(self._from, count - rec.capacity)
        self._from = count
        for position in range(first, count):
            r = rec._ring[position % rec.capacity]
            if r is None:
                continue
            if r.end_ns is None or r.state not in FINAL_STATES:
                flying.append((r.start_ns or r.enqueue_ns, r.comm, r.op, r.seq, IN_FLIGHT))
                self._from = min(self._from, position)
            else:
                self._end(r.end_ns, r.comm, r.op, r.seq, r.state)
        return flying

    def _native(self) -> List[Tuple[int, str, str, int, str]]:
        """The native ring's, likewise."""
        ring = self._rec._native
        if ring is None:
            return []
        ended, flying = self._cursor.read(ring)
        for (_, (comm, _, _), seq, kind, _, _, _, _, state, _, end) in (f[:11] for f in ended):
            self._end(end, comm, DIRECT_OPS[kind], seq, STATES[state])
        return [(f[9], f[1][0], DIRECT_OPS[f[3]], f[2], IN_FLIGHT) for f in flying]


class OpReporter:
    """The rank's current op, looked at from the watchdog's thread every ``REPORT_S`` once a
    status server serves the job: written into the job's store while an op is stuck (see
    the module doc); the op that ended last is kept for the status records (``ended``: a
    record is written at a step boundary, where an op seen in flight a look ago has most
    likely ended since, or ended unseen: the native path marks an async op nobody waits
    for as ended at the watchdog's next sweep)."""

    def __init__(self, rec: "FlightRecorder") -> None:
        self._current = CurrentOp(rec)
        self._lock = threading.Lock()
        self.latest: Optional[Dict[str, Any]] = None  # the last look's op
        self.ended: Optional[Dict[str, Any]] = None  # and the op that had ended last then
        self._written: Optional[Tuple[Any, ...]] = None  # (comm, seq, state) of the op last written
        self._store: Any = None
        self._key = ""
        self._stop: Optional[Callable[[], None]] = None

    def start(self, store: Any, key: str) -> None:
        """Look now and every ``REPORT_S`` from now on, writing a stuck op into ``key`` of
        ``store`` (a ``BoundedStore``); a ``register_status_reporter`` hook."""
        self.stop()
        self._store, self._key = store, key
        self.look()
        self._stop = WATCHDOG.every(REPORT_S, self.look)

    def remove(self) -> None:
        """Stop looking (idempotent; the recorder's ``close``)."""
        self.stop()

    def stop(self) -> None:
        """Stop looking (idempotent)."""
        if self._stop is not None:
            self._stop()
            self._stop = None

    def look(self) -> None:
        """Read the rings; write the op if it has been in flight ``STUCK_S`` or more, or if the op
        written last was in flight and this one is not it, or ended."""
        with self._lock:
            op = self.latest = self._current()
            self.ended = self._current.ended()
        if op is None or self._store is None:
            return
        ident = (op["comm"], op["seq"], op["state"])
        stuck = op["in_flight"] and op["t"] - op["since"] >= STUCK_S
        if ident != self._written and (stuck or self._written is not None and self._written[2] == IN_FLIGHT):
            if self._store.set_soon(self._key, json.dumps(op)):
                self._written = ident


def attach(rec: "FlightRecorder") -> List[Any]:
    """Add ``rec``'s figures to the job's status records from now on, and start its
    ``OpReporter`` once the job is served: what the recorder's ``close`` removes."""
    reporter = OpReporter(rec)
    return [register_status_source(StatusFigures(rec, reporter)), register_status_reporter(reporter.start),
            reporter]
