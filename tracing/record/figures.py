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

Nothing here runs per op: the op path fills the rings as before, and this
reads them once per status record: of the native path's ring, only the
records begun since the last read (and those then still in flight). What
that costs the training thread: docs/bench/status.md.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Set, Tuple

from commslayer.comm.op_path import DIRECT_OPS
from commslayer.runs import OP_LATENCY_BUCKETS
from commslayer.hooks import HookHandle, register_status_source

from tracing.records import COMPLETED, FINAL_STATES, STATES

if TYPE_CHECKING:
    from tracing.record.recorder import FlightRecorder

MAX_ARRIVALS = 64  # the step's last collectives whose arrivals a record carries

# One finished op as read from either ring:
# (op_id, comm name, comm uid, generation, seq, op, bytes, latency s, state, enqueue ns, step)
Op = Tuple[int, str, str, int, int, str, int, float, str, int, Any]


class StatusFigures:
    """What one recorder adds to the status records (see the module doc)."""

    def __init__(self, rec: "FlightRecorder") -> None:
        self._rec = rec
        self._totals: Dict[Tuple[str, str], List[Any]] = {}  # (comm, op) -> [ops, bytes, sum s, buckets, errors]
        self._counted: Set[int] = set()  # op ids counted that are still in a ring
        self._total = 0  # ops counted in all
        self._native_from = 0  # the native ring's first record not read yet, or still in flight when read
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
                "arrivals": {"step": step, "ops": arrivals[-MAX_ARRIVALS:]}}

    def _read(self) -> Tuple[List[Op], Set[int], int, int]:
        """The finished ops in both rings not counted yet, the ids of every finished op in
        them, the ops in flight, and how many ops were recorded in all."""
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
            first, fields = rec._native.records_from(self._native_from)
            self._native_from = first + len(fields)
            for position, f in enumerate(fields, first):
                if f is None:  # taken over by the Python ring
                    continue
                (op_id, (comm, uid, gen), seq, kind, dtype, in_shape, out_shape, _, state, start, end) = f[:11]
                if end is None:
                    in_flight += 1
                    self._native_from = min(self._native_from, position)  # read it again next time
                    continue
                if op_id in counted:
                    finished.add(op_id)
                    continue
                finished.add(op_id)
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


def attach(rec: "FlightRecorder") -> HookHandle:
    """Add ``rec``'s figures to the job's status records from now on."""
    return register_status_source(StatusFigures(rec))
