"""The flight recorder: every op of every communicator, in a bounded ring.

``install()`` attaches to every communicator of the process, present and
future (commslayer's communicator-created hook).  Per op it is the
communicator's ``recorder`` (commslayer.hooks.OpRecorder): the op path asks
it for a ``Record``, which goes into the ring and rides on the op's ``Work``
until it settles; errors and aborts come through ordinary hooks.  The hot
path only fills that record; everything slow (JSON, files, structlog,
OpenTelemetry) happens at dump time or on a sink's own thread.

The ops of the native direct path (commslayer.comm.native) write their records
themselves, into the recorder's ``NativeRing``: a Python record costs tens
of µs of the calling thread after a transfer, a native one about what the
op's checks do.  The dump merges both rings by op id; a native op that fails
hands its record over to a Python one (``take_native``), which its ``Work``
then settles as any other.  The trace sinks read the native ring from their
own threads (``tracing.record.sinks``); with full stacks, or a sink that takes
``Record`` objects only as ops end, every op takes the Python record.

Dumps (``rank<R>.json``, plus ``fr/commslayer_fr_rank_<R>`` in the format of
PyTorch's Flight Recorder) are written atomically into the trace directory:
on the first error of any communicator and on SIGUSR1 (both from a
background thread), on SIGTERM and at exit (synchronously, the process is
ending), and whenever ``dump()`` is called.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from types import FrameType
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import orjson
import typing_extensions

import commslayer
from commslayer import config
from commslayer.comm import native
from commslayer.comm.exits import before_exit, before_exit_ran, exit_now, exiting_here, register_before_exit
from commslayer.hooks import OpIO, register_recovery_hook, register_step_hook

from tracing import fr_format
from tracing.record import figures
from tracing.messages import split_reasons
from tracing.dumps import FILE_MODE, DumpWriter
from tracing.record.oprecord import Record, global_rank, thread_names
from tracing.records import ABORTED, EVENT_CAPACITY, SCHEDULED, new_dump

log = logging.getLogger("commslayer.tracing")

# The code that is not a call site: commslayer's, tracing's and torch's folders, and the
# files of the wrappers torch puts around functions it deprecates (typing_extensions.deprecated's,
# which is warnings.deprecated's from Python 3.13): dist.all_gather_into_tensor is one.
_INTERNAL_PATHS = tuple(
    os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep
    for m in (commslayer, sys.modules[__package__], sys.modules["torch"])
) + tuple(os.path.abspath(str(m.__file__)) for m in (typing_extensions, warnings))


def clock_anchor(tries: int = 5) -> Dict[str, int]:
    """The wall clock and the monotonic clock read at one instant: every time this process
    records is monotonic, and the viewer puts ranks on one axis through this pair.  A
    preemption between two plain reads would skew the pair by as long as it lasted, so the
    wall read is bracketed by two monotonic reads, and the tightest bracket of a few tries
    is kept."""
    best = None
    for _ in range(tries):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall, (before + after) // 2)
    assert best is not None
    return {"wall_ns": best[1], "mono_ns": best[2]}


def _caller(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The first frame outside ``_INTERNAL_PATHS`` (commslayer, tracing, torch): the code that
    issued the op; for an op of commslayer's own thread (the copies' refresh) the outermost frame of ours."""
    inner = None
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_PATHS):
        inner, frame = frame, frame.f_back
    if inner is not None and frame is not None and frame.f_code.co_filename == threading.__file__:
        return inner
    return frame


_STACK_FRAMES = 32  # the innermost frames of the main thread a dump keeps
_DUMPING = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # a dump's own frames, where it
            os.path.abspath(before_exit.__code__.co_filename))  # runs on the main thread


def main_thread_stack() -> Dict[str, Any]:
    """Where the main thread is: its innermost frames, outermost first, as "file:line in
    function", and ``at``, the first of them outside commslayer, tracing and torch (as a
    record's call site).  What a rank that never came to an op was doing when it dumped
    (on SIGTERM, SIGUSR1 or an error); a dump taken on the main thread leaves its own
    frames out (the signal handler's, the exit hooks')."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None and frame.f_code.co_filename.startswith(_DUMPING):
        frame = frame.f_back
    at = _caller(frame)
    frames = traceback.extract_stack(frame, limit=_STACK_FRAMES) if frame is not None else []
    return {"at": None if at is None else f"{at.f_code.co_filename}:{at.f_lineno}",
            "frames": [f"{f.filename}:{f.lineno} in {f.name}" for f in frames]}


class FlightRecorder:
    """The per-process recorder. Build it with ``install()``."""

    def __init__(self, capacity: int, trace_dir: str, *, job: str, stack: bool = False,
                 mode: int = FILE_MODE) -> None:
        self.capacity = capacity
        self.job = job
        self.stack = stack
        self.writer = DumpWriter(trace_dir, mode) if trace_dir else None
        self.host = socket.gethostname()
        self.clock = clock_anchor()
        self.cwd = os.getcwd()  # the viewer shows call sites relative to it
        self._main_stack: Optional[Dict[str, Any]] = None  # at the last dump for a reason other than an exit
        self.sinks: List[Any] = []  # objects with enqueue(record) (called as each op ends) and flush(): add_sink
        self._ring: List[Optional[Record]] = [None] * capacity
        self._count = 0
        # the native direct path's records (None: no native path); native_ring is what
        # communicators write into, None while full stacks or a sink need Python records
        self._native = native.ring(capacity, thread_names, _INTERNAL_PATHS, threading.__file__)
        self.native_ring: Any = None
        self._comms: Dict[str, Tuple["weakref.ReferenceType[commslayer.Communicator]", Dict[str, Any]]] = {}
        self._sinks_changed()
        self._handles: List[Any] = []
        self._dump_requests: List[str] = []
        self._reasons: Dict[str, None] = {}  # every reason a dump was asked for, in order
        self._dump_event = threading.Event()
        self._dump_lock = threading.RLock()  # a SIGTERM handler may dump inside a dump
        self._dumper: Optional[threading.Thread] = None
        self.events: Deque[Dict[str, Any]] = deque(maxlen=EVENT_CAPACITY)  # recovery events (records.EVENT_KINDS)
        self._step: Optional[int] = None
        self._until_recording: List[Callable[[], Any]] = []  # when_recording's

    # ------------------------------------------------------------ attaching
    def when_recording(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once this recorder records a communicator: now, if it does.
        So a process that never has one (torchrun's agent imports torch too, and as
        "rank 0" its sinks would write into rank 0's files) starts no sink."""
        if self._comms:
            fn()
        else:
            self._until_recording.append(fn)

    def attach(self, comm: "commslayer.Communicator") -> None:
        """Record every op of ``comm`` from now on."""
        info = {"name": comm.get_name(), "backend": comm.get_backend()}
        ref = weakref.ref(comm)  # the recorder must not keep communicators alive
        self._comms[comm.uid] = (ref, info)
        self._refresh(comm, info)
        uid = comm.uid
        if comm.generation and "/" not in uid:  # a new generation of a resizable communicator
            self._generation_event(uid, info)
        comm.recorder = self
        comm.record_natively(self.native_ring)
        self._handles += [
            comm.register_error_hook(lambda err: self._failed(uid, err)),
            comm.register_abort_hook(lambda: self._aborted(uid)),
        ]
        while self._until_recording:
            self._until_recording.pop(0)()

    @staticmethod
    def _refresh(comm: "commslayer.Communicator", info: Dict[str, Any]) -> None:
        """Membership can change (recovery): read it from the live communicator."""
        info.update(rank=comm.get_rank(), size=comm.get_size(), global_ranks=comm.global_ranks,
                    generation=comm.generation, members=comm.members, state=comm.state)

    def scheduled(self, comm: "commslayer.Communicator", op: str, op_id: int, seq: int, io: OpIO,
                  peer: Optional[int], async_op: bool, timeout_s: float) -> Record:
        """The op path's call as ``op`` enters ``comm``: a new record in the ring."""
        r = Record()
        r.enqueue_ns = time.monotonic_ns()
        inputs, outputs, r.reduce_op, r.root = io
        # Most ops have one tensor each way: no comprehension then (a function call on 3.11).
        r.in_sizes = [inputs[0].shape] if len(inputs) == 1 else [t.shape for t in inputs]
        r.out_sizes = [outputs[0].shape] if len(outputs) == 1 else [t.shape for t in outputs]
        first = inputs[0] if inputs else (outputs[0] if outputs else None)
        r.dtype = None if first is None else first.dtype
        r.op_id = op_id
        r.comm, r.comm_id, r.generation = comm.trace_ids
        r.seq = seq
        r.op = op
        r.peer = peer
        r.async_op = async_op
        r.timeout_s = timeout_s
        r.state = SCHEDULED
        r.error = r.start_ns = r.end_ns = r.duration_ms = r.wait_ns = r.wait_end_ns = None
        r.step = self._step
        r.sinks = self.sinks
        ident = threading.get_ident()
        if ident not in thread_names:
            thread_names[ident] = threading.current_thread().name
        r.thread = ident
        # Frame 3 is the caller of the op's method (scheduled <- _run <- the method), where
        # the walk ends unless an op of ours issued it: each frame looked at becomes a frame
        # object, which costs microseconds after a transfer.
        caller = sys._getframe(3)
        frame = _caller(caller) if caller.f_code.co_filename.startswith(_INTERNAL_PATHS) else caller
        r.call_site = None if frame is None else (frame.f_code, frame.f_lasti)  # f_lineno decodes a line table
        r.stack = [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)] \
            if self.stack and frame is not None else None
        self._ring[self._count % self.capacity] = r
        self._count += 1
        return r

    # ---------------------------------------------------------------- events
    def event(self, kind: str, info: Optional[Dict[str, Any]] = None, **fields: Any) -> None:
        """Record a recovery event (``records.EVENT_KINDS``) of communicator ``info`` (if any),
        now; lifecycle sinks (JSON lines) get it too."""
        ev: Dict[str, Any] = {"kind": kind, "mono_ns": time.monotonic_ns(), "step": self._step}
        if info is not None:
            ev.update(comm=info["name"], comm_id=info.get("uid"), generation=info["generation"])
        ev.update(fields)
        self.events.append(ev)
        for sink in self.sinks:
            if getattr(sink, "lifecycle", False):
                sink.recovery_event(ev)

    def _generation_event(self, uid: str, info: Dict[str, Any]) -> None:
        """A communicator of generation > 0 was built: the members before (this rank's
        previous generation of the same name, if it had one) and after."""
        gen = info["generation"]
        before = next((i["members"] for _, i in self._comms.values()
                       if i["name"] == info["name"] and i["generation"] == gen - 1 and "members" in i), None)
        self.event("generation", dict(info, uid=uid),
                   members=list(info["members"]), before=None if before is None else list(before))

    def _step_begins(self, job: Any, step: int) -> None:
        """A resilient job's step hook: events carry the step they happened in."""
        self._step = step
        if self._native is not None:
            self._native.step = step

    def add_sink(self, sink: Any) -> None:
        """Give ``sink`` every record as its op ends (``sink.enqueue(record)``); a sink whose
        ``reads_native_ring`` is true reads the native path's records itself."""
        self.sinks.append(sink)
        self._sinks_changed()

    def remove_sink(self, sink: Any) -> None:
        """Stop giving ``sink`` records (it may have gone already)."""
        if sink in self.sinks:
            self.sinks.remove(sink)
        self._sinks_changed()

    def _sinks_changed(self) -> None:
        python_only = self.stack or not all(getattr(s, "reads_native_ring", False) for s in self.sinks)
        self.native_ring = None if python_only else self._native
        for ref, _ in list(self._comms.values()):
            comm = ref()
            if comm is not None and comm.recorder is self:
                comm.record_natively(self.native_ring)

    def take_native(self, op_id: int) -> Optional[Record]:
        """``OpRecorder.take_native``: the native record of op ``op_id`` moves to the Python ring."""
        fields = None if self._native is None else self._native.take(op_id)
        if fields is None:
            return None
        r = Record.from_native(fields, self.sinks)
        self._ring[self._count % self.capacity] = r
        self._count += 1
        return r

    def _failed(self, uid: str, err: Exception) -> None:
        info = self.communicator_info(uid)  # keeps its state ("broken: ...") should it be collected before the dump
        if isinstance(err, commslayer.PeerLost) and info is not None:
            to_job = info.get("global_ranks") or info.get("members") or []
            lost = sorted(to_job[r] if r < len(to_job) else r for r in err.ranks)
            self.event("peer_lost", dict(info, uid=uid), lost=lost, op=err.op, seq=err.seq, error=err.what)
        self.request_dump(f"{type(err).__name__}: {err}")

    def _aborted(self, uid: str) -> None:
        info = self.communicator_info(uid)  # its state says why it closed
        if info is None:
            return
        if info["state"].startswith("fenced"):
            self.event("fenced", dict(info, uid=uid), why=info["state"])
        now = time.monotonic_ns()
        if self._native is not None:
            self._native.abort(uid, now, "communicator aborted")
        for r in list(self._ring):
            if r is not None and r.comm_id == uid and r.end_ns is None:
                r.state, r.end_ns, r.error = ABORTED, now, "communicator aborted"
                for sink in self.sinks:
                    sink.enqueue(r)
        self.request_dump(f"communicator {info['name']!r} {info['state']}")

    # --------------------------------------------------------------- reading
    def _recorded(self) -> Tuple[int, List[Record]]:
        """How many ops were recorded, and the newest ``capacity`` of their records
        (both rings), oldest first."""
        n = self._count
        ring = list(self._ring)
        kept = [r for r in (ring[i % self.capacity] for i in range(max(0, n - self.capacity), n)) if r is not None]
        if self._native is not None:
            n += self._native.count - self._native.taken  # a record taken over is in the Python ring
            kept += [Record.from_native(fields, self.sinks) for fields in self._native.records()]
            kept.sort(key=lambda r: r.op_id)
            del kept[:-self.capacity]
        return n, kept

    def records(self) -> List[Dict[str, Any]]:
        """The newest records, oldest first."""
        return [r.to_dict() for r in self._recorded()[1]]

    def document(self, reason: str) -> Dict[str, Any]:
        """The dump document as of now."""
        count, kept = self._recorded()
        records = [r.to_dict() for r in kept]
        lost = count - len(kept)
        return new_dump(job=self.job, rank=global_rank(), host=self.host, pid=os.getpid(),
                        wall_ns=self.clock["wall_ns"], mono_ns=self.clock["mono_ns"], reason=reason,
                        dropped=lost + (self.writer.dropped_records if self.writer else 0),
                        communicators=self._communicators(), records=records, events=list(self.events),
                        cwd=self.cwd, main_stack=self._main_stack)

    def communicator_info(self, uid: str) -> Optional[Dict[str, Any]]:
        """What the recorder knows of communicator ``uid`` (name, backend, rank, size,
        global ranks, generation, state), read from the communicator while it lives."""
        entry = self._comms.get(uid)
        if entry is None:
            return None
        ref, info = entry
        comm = ref()
        if comm is not None:
            self._refresh(comm, info)
        return dict(info)

    def _communicators(self) -> Dict[str, Dict[str, Any]]:
        return {uid: info for uid in list(self._comms) if (info := self.communicator_info(uid)) is not None}

    # --------------------------------------------------------------- dumping
    def flush_sinks(self) -> None:
        """Make every sink write what it holds now (before the process ends)."""
        for sink in list(self.sinks):
            try:
                sink.flush()
            except Exception:
                log.exception("commslayer tracing: flushing %r failed", sink)

    def dump(self, reason: str = "on demand") -> Optional[str]:
        """Write this rank's dump now; the path, or None if it could not be written.
        Its ``reason`` lists every reason this process has dumped for, oldest first,
        since a later dump replaces the earlier file."""
        if self.writer is None or not self._comms:
            # A process that never had a communicator (torchrun's agent, which imports torch
            # too) has nothing to say, and as "rank 0" it would write over rank 0's dump.
            return None
        with self._dump_lock:
            # whole reasons, not their "; "-separated pieces: a reason's own context ("[communicator
            # 'a'; op ...; ranks 2]") holds "; " too, and a piece seen before would be dropped from it
            self._reasons.update(dict.fromkeys(split_reasons(reason)))
            if reason != "exit" and not reason.startswith("exit "):
                self._main_stack = {"reason": reason, **main_thread_stack()}
            doc = self.document("; ".join(self._reasons))
            rank = doc["rank"]
            n = len(doc["records"])
            ok = self.writer.write(f"rank{rank}.json", orjson.dumps(doc), records=n)
            self.writer.write(f"fr/commslayer_fr_rank_{rank}",
                              pickle.dumps(fr_format.to_flight_recorder(doc)), records=0)
        return os.path.join(self.writer.directory, f"rank{rank}.json") if ok else None

    def request_dump(self, reason: str) -> None:
        """Dump from the background thread: safe from hooks and signal handlers."""
        self._dump_requests.append(reason)
        if self._dumper is None:
            self._dumper = threading.Thread(target=self._dump_loop, name="commslayer-trace-dump", daemon=True)
            self._dumper.start()
        self._dump_event.set()

    def _dump_loop(self) -> None:
        while True:
            self._dump_event.wait()
            self._dump_event.clear()
            reasons, self._dump_requests = self._dump_requests, []
            if reasons:
                try:
                    self.dump("; ".join(dict.fromkeys(reasons)))
                except Exception:  # a dump must never take the job down
                    log.exception("commslayer tracing: dump failed")

    def close(self) -> None:
        """Stop recording (unhook from every communicator)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ref, _ in self._comms.values():
            comm = ref()
            if comm is not None and comm.recorder is self:
                comm.recorder = None
                comm.record_natively(None)


_recorder: Optional[FlightRecorder] = None
_lock = threading.Lock()


def _dump_before_exit(rec: FlightRecorder, status: int, why: str) -> None:
    """``commslayer.comm.exits.before_exit``: the process ends (the connections are closed already)."""
    if status == 0:
        reason = "exit"
    elif status == _TERM_STATUS:
        reason = why
    else:
        reason = f"exit {status}: {why}"
    rec.dump(reason)
    rec.flush_sinks()


_TERM_GRACE_S = 1.0  # after a SIGTERM dump, how long the main thread has to end the process
_TERM_STATUS = 128 + signal.SIGTERM  # how a process ends that SIGTERM ended


def install(trace_dir: Optional[str] = None, *, capacity: Optional[int] = None,
            stack: Optional[bool] = None, signals: bool = True) -> FlightRecorder:
    """Start recording every communicator of this process (idempotent).

    Defaults come from ``COMMSLAYER_TRACE_DIR``, ``COMMSLAYER_TRACE_BUFFER`` and
    ``COMMSLAYER_TRACE_STACK``; ``COMMSLAYER_TRACE_JSONL`` and
    ``COMMSLAYER_TRACE_OTEL`` add those sinks.  With ``signals``, SIGTERM and
    SIGUSR1 dump (from the main thread only; elsewhere they are left alone).
    """
    global _recorder
    with _lock:
        if _recorder is not None:
            return _recorder
        rec = FlightRecorder(capacity or config.trace_buffer(), trace_dir or config.trace_dir(),
                             job=config.job_id(), stack=config.trace_stack() if stack is None else stack,
                             mode=config.trace_mode())
        for comm in commslayer.live_communicators():
            rec.attach(comm)
        rec._handles += [commslayer.register_communicator_hook(rec.attach), register_step_hook(rec._step_begins),
                         register_recovery_hook(lambda kind, fields: rec.event(kind, **fields)), *figures.attach(rec)]
        if rec.writer is not None and config.trace_jsonl():
            from tracing.record.jsonl import JsonlSink

            rec.when_recording(lambda: JsonlSink.attach(rec))
        if config.trace_otel():
            from tracing.record.otel import OtelSink

            rec.when_recording(lambda: OtelSink.attach(rec))
        if signals and threading.current_thread() is threading.main_thread():
            _install_signal_handlers(rec)
        rec._handles.append(register_before_exit(lambda status, why: _dump_before_exit(rec, status, why)))
        _recorder = rec
        return rec


def recorder() -> Optional[FlightRecorder]:
    """The installed recorder, if any."""
    return _recorder


def _install_signal_handlers(rec: FlightRecorder) -> None:
    """SIGTERM and SIGUSR1 dump even while the main thread is blocked in a collective.

    Python runs signal handlers only when the main thread is back in the
    interpreter, and a rank waiting in a Gloo op is not.  So the handlers are
    registered (that makes the C-level handler record the signal) and the
    signal number also goes to a wakeup pipe that a watcher thread reads:
    the watcher dumps at once.  For SIGTERM with no handler of the program's
    own, the watcher runs the before-exit hooks (hang up, dump) and raises
    SIGTERM again: the main thread, once back in Python, ends the process the
    default way; if it is still stuck in C a second later, the watcher ends it
    with exit status 143 (only the main thread may restore a handler).  The
    main thread's handler never waits for the watcher: a handler runs wherever
    the main thread was interrupted, perhaps holding a lock the hooks need.  A
    program that has its own wakeup fd (asyncio) keeps it; then the handlers
    alone dump.
    """
    previous_term = signal.getsignal(signal.SIGTERM)
    term_lock = threading.Lock()
    term_dumped: List[bool] = []
    watcher: Optional[threading.Thread] = None

    def dump_once_for_term() -> None:
        # The program handles SIGTERM (it may go on): dump once.  The watcher and the main
        # thread may both get here: the second one waits for the first one's dump.  The dump
        # lock is taken first: the main thread may be inside a dump of its own (it holds
        # that lock, and re-enters it here), and a watcher holding term_lock while waiting
        # for it would deadlock with a main thread waiting for term_lock.
        with rec._dump_lock, term_lock:
            if not term_dumped:
                term_dumped.append(True)
                rec.dump("SIGTERM")
                rec.flush_sinks()

    def on_term(signum: int, frame: Optional[FrameType]) -> None:
        if callable(previous_term):
            dump_once_for_term()
            previous_term(signum, frame)
            return
        if exiting_here():
            return  # this thread is ending the process already: its dump comes next
        if watcher is None:
            before_exit(_TERM_STATUS, "SIGTERM")
        elif not before_exit_ran():
            return  # the watcher runs the hooks, then raises SIGTERM again
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None if watcher else rec.request_dump("SIGUSR1"))

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    theirs = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if theirs != -1:  # not ours to take: give it back and rely on the handlers
        signal.set_wakeup_fd(theirs)
        os.close(read_fd)
        os.close(write_fd)
        return

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum == signal.SIGTERM and callable(previous_term):
                    dump_once_for_term()
                elif signum == signal.SIGTERM:
                    # This process ends: hang up first (before_exit), so that its peers take it
                    # as lost now rather than wait on it while it writes its dump.
                    before_exit(_TERM_STATUS, "SIGTERM")
                    os.kill(os.getpid(), signal.SIGTERM)  # for the main thread, once back in Python
                    time.sleep(_TERM_GRACE_S)
                    exit_now(_TERM_STATUS, "SIGTERM")
                elif signum == signal.SIGUSR1:
                    rec.dump("SIGUSR1")

    watcher = threading.Thread(target=watch, name="commslayer-trace-signals", daemon=True)
    watcher.start()
