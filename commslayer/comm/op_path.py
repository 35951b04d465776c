"""How one op of a ``Communicator`` is issued: ``OpPath``, the base its op families share.

An op, whatever its family (``commslayer.comm.collectives``,
``commslayer.comm.p2p``), ends in ``_run``: its deadline, its sequence number,
check mode (``check``), the hooks, the backend call with its option struct
(``wire``), then a ``Work`` (``work``) whose deadline the caller's ``wait``
or the ``watchdog`` enforces.  A synchronous all_reduce, all_gather_single or
reduce_scatter_single that no hook observes takes ``_direct_run`` instead:
the same steps without the branches only hooks, check mode, isolation and
async ops need, its issue, wait and flight-recorder record in native code
where ``commslayer.comm.native`` is built (docs/bench/direct-path.md).

The same three ops issued async through the c10d adapter (what FSDP2 and
DDP issue) reach the group's native backend (``GroupBackend``,
commslayer.comm.process_group), which issues them on the communicator's
native path while no hook observes the communicator and a flight recorder,
if any, takes native records (``_update_direct`` opens and closes it); that
path numbers them itself (``_seq``) and returns a c10d ``Work`` of its own, whose wait runs no Python unless
the op does not simply complete; then ``settle_native_async`` settles it
here, as the general path's ``Work`` would (docs/bench/async-path.md).  That
native ``Work`` also takes the two finishing steps the resilient modes need:
write isolation (the backend writes a staging copy, handed to the caller's
tensor only on success) and AVG's division, which Gloo lacks.  The
communicator's own async all-reduce and all-gather take it as well
(``_native_async``), their ``Work`` a ``NativeWork`` that reads its outcome.

The attributes declared on ``OpPath`` are set by ``Communicator.__init__``.
"""

from __future__ import annotations

import itertools
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Tuple, cast

import torch
from torch._C import _distributed_c10d as c10d

from commslayer.comm import backends
from commslayer.comm.check import CrossRankCheck, fingerprint
from commslayer.errors import CollectiveMismatch, CommError
from commslayer.hooks import Hooks, OpIO, OpRecorder
from commslayer.comm.isolation import StagedWork
from commslayer.reduce_op import ReduceOp
from commslayer.comm.ring import RingReduceScatter, ring_fits
from commslayer.comm.validation import Checker, Timeout, timeout_seconds
from commslayer.comm.watchdog import WATCHDOG
from commslayer.comm.wire import BACKEND_OPS, Options
from commslayer.comm.work import WAIT_SLICE, AnySourceWork, NativeWork, Waiter, Work

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator
    from commslayer.comm.lifecycle import Lifecycle

# Process-wide, monotonic: Python's count until a native direct path exists, then
# the native module's, which numbers c10d's async ops without Python (GroupBackend).
_op_ids = itertools.count(1)
_next_op_id: Callable[[], int] = _op_ids.__next__
# The ops the direct path takes (``_direct_run``), by their kind in direct_path.cpp:
# the first three as the API's ops and async through the c10d adapter; the last,
# ``should_commit``'s tally (a MIN all-reduce, ``Communicator._agree``), only synchronous
DIRECT_OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "should_commit")
TALLY = 3
# The communicators with a native direct path, by the key their async ops carry
_keys = itertools.count(1)
_async_comms: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()


RUNNING, SETTLED, HELD = 0, 1, 2  # what settle_native_async found (direct_path.cpp's SettleOutcome)


def settle_native_async(key: int, kind: int, op_id: int, seq: int, start_ns: int, timeout_s: float,
                        backend_work: Any, wait_left_s: float, failure: Optional[str] = None) -> int:
    """Settle an async op of the native path (``AsyncOpWork`` in direct_path.cpp)
    whose wait did not simply complete: fail it with ``failure``, the backend's
    error where its future failed (the backend's work may not say so yet); else
    wait on for ``wait_left_s`` (in slices where a liveness monitor may break the
    communicator), or, from the watchdog (``wait_left_s`` 0), fail it if it
    failed, is overdue or its communicator broke.  ``SETTLED`` once it completed
    (the native side then runs its finish step); ``RUNNING`` when it still runs
    (the watchdog looked at a communicator that is not broken after all); raises
    its ``CommError`` when it failed, unless the c10d group that issued it is held
    (``CommslayerGroup.hold``): then the hold's callback takes the error and
    the op counts as done, its outputs as they were (``HELD``)."""
    comm = _async_comms.get(key)
    if comm is None:  # gone: its group was destroyed while the op ran
        raise CommError("the communicator of this op was destroyed while it ran", op=DIRECT_OPS[kind], seq=seq)
    # its record, if the native path wrote one, is Python's from here on
    record = None if comm.recorder is None else comm.recorder.take_native(op_id)
    work = Work(comm, DIRECT_OPS[kind], seq, op_id, timeout_s, start_ns, backend_work, record=record)
    if failure is not None:
        work._backend_failed(RuntimeError(failure))
    elif wait_left_s <= 0 and not backend_work.is_completed() and time.monotonic_ns() < work.deadline_ns:
        err = work._interruption()
        if err is None:
            return RUNNING
        work._fail(err, time.monotonic_ns())
    else:
        work._settle_from_backend(wait_left_s)
    err = work.exception()
    if err is None:
        return SETTLED
    if comm._held_failures is None:
        raise err
    comm._held_failures(err)
    return HELD


class OpPath:
    """Issuing ops: ``_run``, ``_direct_run`` and what they need (see the module doc)."""

    _spec: backends.BackendSpec
    _device: torch.device
    _name: str
    _rank: int
    _size: int
    _timeout_s: float
    _backend: Any  # the c10d backend object
    _ops: Any  # what op closures call: the backend, or its write-isolating wrapper
    _options: Options
    _barrier_opts: Any
    _check: Optional[CrossRankCheck]
    _checkers: Dict[str, Checker]
    _counted: int  # the collectives issued, where there is no native path to count them (``_seq``)
    _p2p_seq: Dict[Tuple[int, int], int]  # (src, dst) -> the messages numbered in that pair
    _batches: int
    _ring_from: Optional[int]
    _pre: Hooks
    _checks: Hooks
    _post: Hooks
    completion_hooks: Hooks
    lifecycle: "Lifecycle"
    recorder: Optional[OpRecorder]
    _waited_elsewhere: FrozenSet[str]
    _waiter_thread: Optional[Waiter]
    _ring_thread: Optional[Waiter]
    _native: Any
    _native_records: bool
    _async_path: Any  # the native path of async ops (``_native_async``, c10d's GroupBackend), or None
    # where a failed native async op's error goes instead of its waiter: the hold of
    # the c10d group that issues them (CommslayerGroup.hold), or None
    _held_failures: Optional[Callable[[CommError], None]] = None
    # the option structs, without a deadline of their own, of the API's native async ops
    _untimed_opts: Dict[Tuple[int, Optional[ReduceOp]], Any]
    _swept = False  # whether the watchdog sweeps this communicator's native async ops
    # async ops must reach the communicator's methods (the fault injector wraps them): no native async path
    _async_declined = False
    _direct: bool
    _unobserved: bool  # no hook observes this communicator's ops and check mode is off
    _dense: Callable[..., bool]
    _dense_sized: Callable[..., bool]
    _direct_td: timedelta
    _direct_opts: Tuple[Any, ...]

    def _set_timeout_s(self, timeout_s: float) -> None:
        """The deadline of every op that names none, and the direct path's option
        structs that carry it (its own: ``_options``' structs take each op's deadline)."""
        self._timeout_s = timeout_s
        structs = Options()
        self._direct_td = structs.timedelta(timeout_s)
        self._direct_opts = tuple(
            structs.get(cls, op) for cls, op in ((c10d.AllreduceOptions, ReduceOp.SUM), (c10d.AllgatherOptions, None),
                                                 (c10d.ReduceScatterOptions, ReduceOp.SUM),
                                                 (c10d.AllreduceOptions, ReduceOp.MIN)))
        for opts in self._direct_opts:
            structs.deadline(opts, timeout_s)
        if self._native is not None:
            self._native.set_timeout(*self._native_waits())

    def _native_waits(self) -> Tuple[timedelta, timedelta]:
        """The native direct path's deadline, and how long its wait blocks before
        Python looks again: the deadline, or a slice where a liveness monitor may
        break the communicator meanwhile (``Work.wait_issued``'s)."""
        return self._direct_td, WAIT_SLICE if self.lifecycle.watched else self._direct_td

    @property
    def _seq(self) -> int:
        """The collectives issued so far: counted by the native path where there is one,
        since c10d's async ops are numbered there without Python (GroupBackend)."""
        native = self._native
        return self._counted if native is None else int(native.seq())

    def _next_seq(self) -> int:
        """The next collective's number (counted as issued)."""
        native = self._native
        if native is None:
            self._counted += 1
            return self._counted
        return int(native.next_seq())

    def _take_direct_path(self, path: Any) -> None:
        """Run the direct path's checks and ops in native code through ``path`` (a
        ``DirectPath``, commslayer.comm.native), or in Python (None)."""
        global _next_op_id
        self._counted = self._seq
        self._native = path
        self._native_records = False
        if path is not None:
            path.set_seq(self._counted)
            if _next_op_id == _op_ids.__next__:  # from now on the native module counts
                type(path).start_op_ids(next(_op_ids))
                _next_op_id = type(path).next_op_id
            path.set_ring_from(-1 if self._ring_from is None else self._ring_from)
        if path is None:
            direct = Checker(self._name, "direct", self._rank, self._size, self._spec.device_type,
                             self._spec.dtypes)
            self._dense, self._dense_sized = direct.fits, direct.fits_sized
        else:
            self._dense, self._dense_sized = path.fits, path.fits_sized
            key = next(_keys)
            _async_comms[key] = self  # type: ignore[assignment]  # OpPath is Communicator's base
            path.set_key(key)
        self._update_direct()

    def record_natively(self, ring: Any) -> None:
        """The flight recorder's call: the native direct path writes its ops' records
        into ``ring`` (a ``NativeRing``, commslayer/comm/direct_path.cpp); None: every op
        asks the recorder for a record (``OpRecorder.scheduled``)."""
        if self._native is not None:
            self._native.record_into(ring)
            self._native_records = ring is not None
        self._update_direct()

    def _update_direct(self) -> None:
        """Whether the direct path (``_direct_run``) is open: only while no hook
        observes this communicator's ops, check mode is off and writes are not
        isolated; and the native async path (``_native_async``, GroupBackend) while no hook
        observes and check mode is off, isolating writes itself where they are."""
        self._unobserved = unobserved = self._check is None and not (
            self._pre.fns or self._checks.fns or self._post.fns or self.completion_hooks.fns)
        self._direct = unobserved and self._ops is self._backend
        self._async_path = self._native if unobserved and not self._async_declined and (
            self.recorder is None or self._native_records) else None
        if self._native is not None:
            self._native.set_isolate(self._ops is not self._backend)
            self._native.set_open(self._async_path is not None and self.lifecycle.clean)

    def decline_native_async(self) -> None:
        """Send every async op through this communicator's methods (and c10d's through
        its group's Python ops), not the native path: for a caller that wraps the methods."""
        self._async_declined = True
        self._update_direct()

    def _takes_ring(self, op: ReduceOp, output: torch.Tensor, input_bytes: int) -> bool:
        """Whether this reduce-scatter runs as the ring (commslayer.comm.ring) rather than Gloo's own."""
        return self._ring_from is not None and input_bytes >= self._ring_from and ring_fits(op, output, self._size)

    def _native_async(self, kind: int, a: torch.Tensor, b: torch.Tensor, op: Optional[ReduceOp]) -> Optional[Work]:
        """An async all-reduce (``op``: SUM or AVG) or all-gather (``op`` None) of this
        communicator's own API on the native path, as a ``NativeWork``; None where it
        does not take it (its Python costs tens of µs less than ``_run``'s,
        docs/bench/async-path.md).  Not the reduce-scatter: Gloo's own has no future,
        which ``Work.get_future`` promises.  Not while a c10d group's hold takes
        failures: the caller of the communicator's API gets them."""
        if self._held_failures is not None:
            return None
        opts = self._untimed_opts.get((kind, op))
        if opts is None:
            opts = cast(Any, (c10d.AllreduceOptions, c10d.AllgatherOptions)[kind]())
            if op is not None:  # the native path divides an AVG itself
                opts.reduceOp = c10d.ReduceOp.AVG if op is ReduceOp.AVG else c10d.ReduceOp.SUM
            self._untimed_opts[(kind, op)] = opts
        path = self._async_path
        work = None if path is None else path.issue_async(kind, a, b, opts)  # closed (set_open) while unclean
        if work is None:
            return None
        comm: "Communicator" = self  # type: ignore[assignment]  # OpPath is its base; no cast call per op
        if not self._swept:
            self._swept = True
            WATCHDOG.sweep_native(comm)
        return NativeWork(comm, DIRECT_OPS[kind], work.seq, work.op_id, self._timeout_s, work.start_ns, work)

    def _checker(self, op: str) -> Checker:
        chk = self._checkers.get(op)
        if chk is None:
            chk = self._checkers[op] = Checker(self._name, op, self._rank, self._size, self._spec.device_type,
                                               self._spec.dtypes)
        return chk

    def _fp(self, op: str, t: torch.Tensor, reduce_op: Optional[ReduceOp] = None, *, root: Optional[int] = None,
            extra_shape: Optional[List[int]] = None) -> Optional[Dict[str, Any]]:
        """The op's cross-rank fingerprint in check mode, else None."""
        return None if self._check is None else fingerprint(op, t, reduce_op, root=root, extra_shape=extra_shape)

    def _direct_run(self, kind: int, a: torch.Tensor, b: torch.Tensor, reduce_op: Optional[ReduceOp]) -> Work:
        """``_run`` for a synchronous ``DIRECT_OPS[kind]`` on the communicator's
        deadline (``a``: the output, ``b``: the input; all_reduce's one tensor is
        both), with arguments the caller has checked, while ``_direct`` holds: the
        same steps without the branches for hooks, check mode, isolation and async
        ops, because each line after a blocking wait on a transfer runs with cold
        caches (docs/bench/direct-path.md).  Where it is built, the
        issue and the wait run in native code (``DirectPath.run``)."""
        comm: "Communicator" = self  # type: ignore[assignment]  # OpPath is its base; no cast call per op
        op = DIRECT_OPS[kind]
        seq = self._next_seq()
        op_id = _next_op_id()
        timeout_s = self._timeout_s
        recorder = self.recorder
        in_native = self._native is not None
        # The native path writes the op's record itself (record_natively), unless the
        # op is refused: a Python record says why.
        record = None if recorder is None or self._native_records and self.lifecycle.clean else recorder.scheduled(
            comm, op, op_id, seq, OpIO((b,), (a,), reduce_op, None), None, False, timeout_s)
        start = time.monotonic_ns()
        try:
            if not self.lifecycle.clean:
                self.lifecycle.ensure_usable(op, seq)
            if in_native:
                if record is not None:
                    record.started(start)
                # op_id 0: no native record (there is a Python one, or no recorder)
                failed = self._native.run(kind, a, b, op_id if record is None else 0, seq)  # None: completed
            else:
                opts = self._direct_opts[kind]
                c10d_work = self._backend.allreduce([a], opts) if kind in (0, TALLY) else \
                    (self._backend._allgather_base if kind == 1 else self._backend._reduce_scatter_base)(a, b, opts)
        except (RuntimeError, CommError) as exc:
            if record is None and recorder is not None:
                record = recorder.take_native(op_id)
            err = self._not_issued(exc, Work, op, seq, op_id, timeout_s, start, None, record)
            raise err from (None if err is exc else exc)
        if in_native:
            if failed is not None and record is None and recorder is not None:  # Python settles it from here
                record = recorder.take_native(op_id)
            work = Work(comm, op, seq, op_id, timeout_s, start, None if failed is None else failed[0], None, None,
                        record)
            if failed is None:
                work.completed_now()
            else:
                work.wait_failed(RuntimeError(failed[1]))
            return work
        if op in self._waited_elsewhere:
            c10d_work = self._waiter().wrap(c10d_work)
        work = Work(comm, op, seq, op_id, timeout_s, start, c10d_work, None, None, record)
        if record is not None:
            record.started(start)
        work.wait_issued(self._direct_td)
        return work

    def _not_issued(self, exc: Exception, work_cls: type, op: str, seq: int, op_id: int, timeout_s: float,
                    start: int, peer: Optional[int], record: Any) -> CommError:
        """The error of an op that failed before its backend work existed (refused,
        or the backend call raised), recorded as that op's outcome."""
        err = self.lifecycle.error_from(exc, op, seq, timeout_s, (time.monotonic_ns() - start) / 1e9, peer)
        failed = work_cls(cast("Communicator", self), op, seq, op_id, timeout_s, start, None, None, peer, record)
        # A mismatch found by check mode leaves the group usable: every rank raised
        # at the same op and nothing was sent. Anything else breaks it.
        failed.fail_before_issue(err, self._post, breaks=not isinstance(err, CollectiveMismatch))
        return err

    def _run(self, chk: Checker, io: OpIO, issue: Callable[[], Any], *, opts: Any, fp: Optional[Dict[str, Any]],
             timeout: Timeout, async_op: bool, finish: Optional[Callable[[], None]] = None,
             peer: Optional[int] = None, seq: Optional[int] = None, any_source: bool = False) -> Work:
        """Issue one op: deadline, sequence number, check mode, hooks, then the backend call.

        Collectives number themselves here; point-to-point ops pass the
        per-pair ``seq`` and have run their check already; a recv from any
        source (``any_source``) learns its peer and number as it completes.
        """
        comm: "Communicator" = self  # type: ignore[assignment]  # OpPath is its base; no cast call per op
        op = chk.op
        work_cls = AnySourceWork if any_source else Work
        timeout_s = self._timeout_s if timeout is None else timeout_seconds(timeout, self._timeout_s, chk)
        collective = seq is None
        if seq is None:
            seq = self._next_seq()
        op_id = _next_op_id()
        recorder = self.recorder
        record = None if recorder is None else recorder.scheduled(
            comm, op, op_id, seq, io, peer, async_op, timeout_s)
        if self._pre.fns:
            self._pre(op, op_id, {
                "seq": seq, "inputs": list(io.inputs), "outputs": list(io.outputs), "reduce_op": io.reduce_op,
                "root": io.root, "peer": peer, "async_op": async_op, "timeout_s": timeout_s,
                "backend_op": BACKEND_OPS[op],
            })
        start = time.monotonic_ns()
        try:
            if collective and not self.lifecycle.clean:
                self.lifecycle.ensure_usable(op, seq)  # refused, but recorded like any op that failed
            if self._checks.fns:
                self._checks(op, io)
            if self._check is not None and fp is not None:  # a batch checks its messages as it issues them
                if collective:
                    self._check.collective(fp, seq, timeout_s)
                else:
                    assert peer is not None  # point-to-point
                    src, dst = (self._rank, peer) if op == "send" else (peer, self._rank)
                    self._check.p2p(fp, src, dst, seq, timeout_s)
            td = self._options.deadline(opts, timeout_s)
            c10d_work = issue()
            if c10d_work.__class__ is RingReduceScatter:
                finish = c10d_work.finisher(finish)
                c10d_work = self._ringer().wrap(c10d_work, td)
            else:
                if c10d_work.__class__ is StagedWork:
                    finish = c10d_work.finisher(finish)
                if op in self._waited_elsewhere:
                    c10d_work = self._waiter().wrap(c10d_work)
                elif peer is None and not collective and self.lifecycle.watched:
                    # a recv from any source or a batch: a helper thread waits with the op's
                    # deadline (Gloo fails a point-to-point work at its first timed-out wait)
                    c10d_work = self._waiter().wrap(c10d_work, td)
        except (RuntimeError, CommError) as exc:
            err = self._not_issued(exc, work_cls, op, seq, op_id, timeout_s, start, peer, record)
            raise err from (None if err is exc else exc)
        work = work_cls(comm, op, seq, op_id, timeout_s, start, c10d_work, finish, peer, record)
        if record is not None:
            record.started(start)
        if self._post.fns:
            self._post(op_id, work)
        if async_op and (record is not None or self.completion_hooks.fns):
            work.settle_when_done()  # exact end times for observers
        if async_op:
            WATCHDOG.track(work)
        else:
            work.wait_issued(td)
        return work

    def _stop_waiter(self) -> None:
        for thread in (self._waiter_thread, self._ring_thread):
            if thread is not None:
                thread.stop()

    def _waiter(self) -> Waiter:
        if self._waiter_thread is None:
            self._waiter_thread = Waiter(f"{self._name}@g{self.lifecycle.generation}")
        return self._waiter_thread

    def _ringer(self) -> Waiter:
        if self._ring_thread is None:
            self._ring_thread = Waiter(f"ring-{self._name}@g{self.lifecycle.generation}")
        return self._ring_thread

    def _orphaned(self, c10d_work: Any) -> None:
        """An op failed while the backend still runs it: keep the backend until it ends."""
        WATCHDOG.bury(self._backend, c10d_work)
