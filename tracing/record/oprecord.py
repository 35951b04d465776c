"""One op's trace record as the hot path fills it: ``Record``; and ``NativeCursor``,
which reads the native direct path's records as their ops end.

The flight recorder (``tracing.record.recorder``) makes one per op and keeps it in
its ring; the sinks (``tracing.record.sinks``, ``tracing.record.jsonl``,
``tracing.record.otel``) take it as the op ends.  Both import it from here, so
neither imports the other's module to know what a record is.  The native path's
ops write their records into the recorder's ``NativeRing`` instead; a reader that
comes back now and then (a sink's thread, the status figures) reads the ones that
ended since its last look with a ``NativeCursor``.
"""

from __future__ import annotations

import functools
import os
from types import CodeType
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from commslayer import config
from commslayer.errors import CommAborted
from commslayer.comm.op_path import DIRECT_OPS
from commslayer.reduce_op import ReduceOp
from commslayer.comm.wire import BACKEND_OPS
from commslayer.comm.work import WorkStatus

from tracing.records import ABORTED, COMPLETED, FAILED, OPTIONAL_FIELDS, RECORD_FIELDS, STARTED, STATES, TIMED_OUT

if TYPE_CHECKING:
    from commslayer.comm.work import Work

_FINAL = {WorkStatus.COMPLETED: COMPLETED, WorkStatus.TIMEDOUT: TIMED_OUT, WorkStatus.ERROR: FAILED}
_DERIVED = ("backend_op", "in_bytes", "out_bytes")  # Record.to_dict computes them
thread_names: Dict[int, str] = {}  # thread ident -> name, filled the first time a thread issues an op


class Record:
    """One op, as the hot path fills it; ``to_dict()`` gives the dump's form.

    The hot path stores what it can get cheaply (torch.Size objects, the
    dtype, the reduce op object, the thread's ident, the caller's file and
    line); turning those into the format's plain values waits for ``to_dict``,
    which runs at dump time or on a sink's thread.
    """

    # backend_op, in_bytes and out_bytes follow from the others: to_dict fills them.
    __slots__ = tuple(f for f in RECORD_FIELDS if f not in _DERIVED) + OPTIONAL_FIELDS + ("sinks",)
    # The slots, as the hot path fills them (records.RECORD_FIELDS says what each means).
    op_id: int
    comm: str
    comm_id: str
    generation: int
    seq: int
    op: str
    reduce_op: Any  # the ReduceOp object until to_dict
    dtype: Optional[torch.dtype]
    in_sizes: List[torch.Size]
    out_sizes: List[torch.Size]
    root: Optional[int]
    peer: Optional[int]
    async_op: bool
    timeout_s: float
    state: str
    error: Optional[str]
    enqueue_ns: int
    start_ns: Optional[int]
    end_ns: Optional[int]
    duration_ms: Optional[float]
    thread: int  # the thread's ident until to_dict
    call_site: Optional[Tuple[CodeType, int]]  # the caller's code and instruction offset until to_dict
    stack: Optional[List[str]]
    wait_ns: Optional[int]
    wait_end_ns: Optional[int]
    step: Optional[int]
    sinks: List[Any]

    def started(self, start_ns: int) -> None:
        """The op was handed to the backend."""
        self.start_ns = start_ns
        self.state = STARTED

    def ended(self, work: "Work") -> None:
        """The op settled; an op already marked aborted stays so."""
        if self.end_ns is not None:
            return
        if self.peer is None and work.peer is not None:  # a recv from any source learnt its sender
            self.peer, self.seq = work.peer, work.seq
        self.end_ns = end = work.end_ns
        assert end is not None  # a settled op has its end
        self.duration_ms = (end - (self.start_ns or self.enqueue_ns)) / 1e6
        err = work.exception()
        if err is None:
            self.state = COMPLETED
        else:
            self.error = str(err)
            # Closed while it ran: the same state whether this wait or the recorder's abort hook came first.
            closed = isinstance(err, CommAborted) and self.start_ns is not None
            self.state = ABORTED if closed else _FINAL.get(work.status, FAILED)
        for sink in self.sinks:
            sink.enqueue(self)

    def waited(self, start_ns: int, end_ns: int) -> None:
        """The caller blocked in ``Work.wait`` (the first wait's start, the last one's end)."""
        if self.wait_ns is None:
            self.wait_ns = start_ns
        self.wait_end_ns = end_ns

    @classmethod
    def from_native(cls, fields: Tuple[Any, ...], sinks: List[Any]) -> "Record":
        """The record a ``NativeRing`` holds (its tuple: ``fields`` in direct_path.cpp)."""
        r = cls()
        (r.op_id, (r.comm, r.comm_id, r.generation), r.seq, kind, r.dtype, in_shape, out_shape, r.timeout_s, state,
         r.start_ns, r.end_ns, r.thread, code, lasti, r.step, r.error, r.async_op, r.wait_ns, r.wait_end_ns) = fields
        r.op = DIRECT_OPS[kind]
        # the direct path's only reductions: should_commit's tally takes the least
        r.reduce_op = None if r.op == "all_gather_single" else ReduceOp.MIN if r.op == "should_commit" else ReduceOp.SUM
        r.in_sizes, r.out_sizes = [torch.Size(in_shape)], [torch.Size(out_shape)]
        r.root = r.peer = r.stack = None
        r.state = STATES[state]
        r.enqueue_ns = r.start_ns
        r.duration_ms = None if r.end_ns is None else (r.end_ns - r.start_ns) / 1e6
        r.call_site = None if code is None else (code, lasti)
        r.sinks = sinks
        return r

    def to_dict(self) -> Dict[str, Any]:
        d = {f: getattr(self, f, None) for f in RECORD_FIELDS}
        for f in OPTIONAL_FIELDS:
            v = getattr(self, f)
            if v is not None:
                d[f] = v
        dtype = self.dtype
        itemsize = 0 if dtype is None else dtype.itemsize
        d["dtype"] = None if dtype is None else str(dtype).replace("torch.", "")
        d["in_sizes"] = [list(s) for s in self.in_sizes]
        d["out_sizes"] = [list(s) for s in self.out_sizes]
        d["in_bytes"] = sum(s.numel() for s in self.in_sizes) * itemsize
        d["out_bytes"] = sum(s.numel() for s in self.out_sizes) * itemsize
        d["backend_op"] = BACKEND_OPS[self.op]
        d["reduce_op"] = None if self.reduce_op is None else repr(self.reduce_op).replace("ReduceOp.", "")
        d["thread"] = thread_names.get(self.thread, str(self.thread))
        d["call_site"] = "?" if self.call_site is None else _site(self.call_site[0].co_filename, *self.call_site)
        return d


NativeFields = Tuple[Any, ...]  # a NativeRing's record: ``fields`` in direct_path.cpp


class NativeCursor:
    """Where a reader of a ``NativeRing`` is: each ``read`` returns the records
    that ended since the last one, each once, and those still in flight, which
    the next read looks at again.  Not thread-safe: one reader at a time."""

    def __init__(self, position: int = 0) -> None:
        self.position = position  # the first record not read yet, or the oldest read in flight
        self.missed = 0  # records the ring overwrote before a read reached them
        self._done: Set[int] = set()  # positions at or after ``position`` returned as ended, or taken

    def read(self, ring: Any) -> Tuple[List[NativeFields], List[NativeFields]]:
        """The records of ``ring`` that ended since the last read, and those in flight,
        oldest first; a record taken over by the Python ring is in neither."""
        first, fields = ring.records_from(self.position)
        if first > self.position:
            self.missed += first - self.position - sum(1 for p in self._done if p < first)
        position = first + len(fields)
        ended: List[NativeFields] = []
        flying: List[NativeFields] = []
        done: List[int] = []
        for at, f in enumerate(fields, first):
            if f is not None and f[10] is None:  # no end yet
                flying.append(f)
                position = min(position, at)
                continue
            done.append(at)
            if f is not None and at not in self._done:
                ended.append(f)
        self.position = position
        self._done = {at for at in done if at >= position}
        return ended, flying


@functools.lru_cache(maxsize=4096)
def _site(filename: str, code: CodeType, lasti: int) -> str:
    """"file:line" of the instruction at byte offset ``lasti`` of ``code`` (what ``f_lineno`` says).
    ``filename`` is ``code``'s, in the key: code objects compare equal without it, so the same
    function at the same line of two files would take the first one's site."""
    line = next((ln for start, end, ln in code.co_lines() if start <= lasti < end and ln is not None),
                code.co_firstlineno)
    return f"{filename}:{line}"


def global_rank() -> int:
    """The rank this process's dumps and sinks are named by: ``COMMSLAYER_JOB_RANK``
    (a job of several torchruns names its ranks itself), else the default group's."""
    job_rank = config.job_rank()
    if job_rank is not None:
        return job_rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
