"""commslayer's communicators as a c10d ``ProcessGroup``.

A group that c10d's Python API and C++ callers (DDP's reducer, FSDP2) use
sends every collective through a ``Communicator`` per device type (CPU →
Gloo, CUDA → NCCL), so it gets deadlines, classified errors and hooks.

Where the native module is built (commslayer.comm.native), the group is c10d's
own ``ProcessGroup`` with a ``GroupBackend`` (direct_path.cpp) registered per
device type: c10d's dispatcher reaches it without Python, and it issues the
async all_reduce, all_gather_single and reduce_scatter_single that the
communicator's native path takes (FSDP2's and DDP's) without a line of Python,
a c10d ``Work`` of its own whose wait runs none while the op completes
(docs/bench/async-path.md).  Every other op it hands to the group's Python
side, ``CommslayerGroup``, whose c10d ``Work`` (``C10dWork``) wraps commslayer
``Work``s; so are ops on tensors that are not contiguous, which Gloo runs and the
communicators refuse: they run on contiguous copies (``_dense``).  A Python
subclass of ``ProcessGroup`` would cost each call a lookup of Python overrides
(measured in docs/bench/async-path.md).  Where the
module is not built, the group is such a subclass, ``CommslayerProcessGroup``,
whose methods are ``CommslayerGroup``'s; it registers each communicator's own
c10d backend, which serves callers that go straight to the dispatcher
(functional collectives), bypassing commslayer's deadlines.

``group_of`` finds commslayer's side of a group, for the helpers that the
resilient modes use (``communicator``, ``hold``, ``replace``).

It builds no communicator: ``commslayer.c10d`` builds those of the groups
c10d creates, and ``Communicator.as_process_group`` wraps one that exists
(``register_communicator``), which is why the communicator may import this
module and not the other.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as dc
from torch._C import _distributed_c10d as c10d

from commslayer import config
from commslayer.comm import native
from commslayer.comm.watchdog import WATCHDOG
from commslayer.errors import CommError, InvalidArgument
from commslayer.startup import BACKEND_NAME

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator
    from commslayer.comm.work import Work


def _timeout(opts) -> Optional[timedelta]:
    """An option struct's timeout, or None when c10d left it unset (negative)."""
    t = getattr(opts, "timeout", None)
    return t if isinstance(t, timedelta) and t.total_seconds() > 0 else None


CopyBack = List[Tuple[torch.Tensor, torch.Tensor]]  # (a caller's tensor, the contiguous copy an op wrote)


def _dense(t: torch.Tensor, back: Optional[CopyBack] = None) -> torch.Tensor:
    """``t``, or a contiguous copy of it for the op to run on where it is not contiguous:
    Gloo runs such tensors, and a routed job must see no difference, though the
    communicators refuse them.  ``back``: the op writes ``t``, so the pair is listed
    there, for the work to copy the result into ``t`` once the op succeeded.  A
    written tensor whose elements share memory (an expanded view) cannot take a copy
    back: it is passed on as it is, for the communicator to refuse."""
    if t.layout != torch.strided or t.is_contiguous():
        return t
    if back is not None and any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return t
    copy = t.contiguous()
    if back is not None:
        back.append((t, copy))
    return copy


class C10dWork(dist.Work):
    """c10d's view of one or more commslayer ``Work`` objects."""

    def __init__(self, works: List[Work], result: Optional[List[torch.Tensor]],
                 held: Optional[Callable[[CommError], None]] = None, back: CopyBack = ()) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._held = held
        self._back = back

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
            timeout = None
        try:
            for w in self._works:
                w.wait(timeout)
        except CommError as exc:
            if self._held is None:
                raise
            self._held(exc)
            return True
        self._copy_back()
        return True

    def _copy_back(self) -> None:
        """The op succeeded: its results reach the caller's tensors that ran on copies (``_dense``)."""
        back, self._back = self._back, ()
        with torch.no_grad():
            for t, copy in back:
                t.copy_(copy)

    def is_completed(self) -> bool:
        done = all(w.is_completed() for w in self._works)
        if done and self._back and self.exception() is None:
            self._copy_back()
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def result(self) -> List[torch.Tensor]:
        """The op's outputs, as Gloo's work gives them (None: Gloo's work has none and raises)."""
        if self._result is None:
            raise RuntimeError("result() not implemented.")
        return self._result

    def _source_rank(self) -> int:
        """The sender's group rank, once a recv from any source completed (``dist.recv`` reads it)."""
        peer = self._works[0].peer if self._works else None
        if peer is None:
            raise InvalidArgument("no source rank: the receive has not completed")
        return peer

    def get_future(self) -> torch.futures.Future:
        def settle(fut):
            try:
                for each in fut.value():
                    each.value()  # re-raises a member's CommError
            except CommError as exc:
                if self._held is None:
                    raise
                self._held(exc)
            else:
                self._copy_back()
            return self._result if self._result is not None else []

        return torch.futures.collect_all([w.get_future() for w in self._works]).then(settle)


class CommslayerGroup:
    """commslayer's side of a c10d group: its communicators, its hold, and the ops
    c10d hands to Python, each under c10d's name for it."""

    def __init__(self, comms: Sequence[Communicator]) -> None:
        """The side of a group over ``comms``: one communicator per device type, all of one rank and size."""
        self._held: Optional[Callable[[CommError], None]] = None
        self._comms: Dict[str, Communicator] = {}
        self._backend: Any = None  # the group's GroupBackend, where it has one
        for comm in comms:
            self._comms[comm.get_device().type] = comm
            self._held_by(comm)

    def _held_by(self, comm: Communicator) -> None:
        """``comm`` carries this group's ops: its native async ops report to the hold too,
        and the group's backend issues them on its native path."""
        comm._held_failures = self._held
        if self._backend is not None and comm.get_device().type == "cpu":
            self._backend.set_path(comm._native)
        if comm._native is not None:
            WATCHDOG.sweep_native(comm)

    def communicator(self, device_type: str = "cpu") -> Communicator:
        """The communicator that carries this group's ops on ``device_type``."""
        try:
            return self._comms[device_type]
        except KeyError:
            raise InvalidArgument(
                f"group has no communicator for {device_type} tensors (have: {sorted(self._comms)})"
            ) from None

    def _comm(self, t: torch.Tensor) -> Communicator:
        return self.communicator(t.device.type)

    # collectives: c10d's Python API and C++ callers use these names.  Each runs on
    # contiguous copies of the tensors that are not (_dense): ``out(t)`` for a tensor the
    # op writes, whose work copies the result back.
    def allreduce(self, tensors, opts=None):
        if not hasattr(opts, "reduceOp"):  # the old allreduce(tensors, op) form
            op, opts = opts, c10d.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        return self._many(tensors, lambda out: [
            self._comm(t).all_reduce(out(t), opts.reduceOp, async_op=True, timeout=_timeout(opts)) for t in tensors])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        return self._many(tensors, lambda out: [self._comm(tensors[0]).all_reduce_coalesced(
            [out(t) for t in tensors], opts.reduceOp, async_op=True, timeout=_timeout(opts))])

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        chunks = [c for o in outputs for c in o.chunk(self._comm(o).get_size())]  # Gloo's result: one per rank
        return self._many(chunks, lambda out: [
            self._comm(i).all_gather_single(out(o), _dense(i), async_op=True, timeout=_timeout(opts))
            for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        return self._many([t for outs in output_lists for t in outs], lambda out: [
            self._comm(i).all_gather([out(o) for o in outs], _dense(i), async_op=True, timeout=_timeout(opts))
            for outs, i in zip(output_lists, inputs)])

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._many(None, lambda out: [
            self._comm(i).reduce_scatter_single(out(o), _dense(i), opts.reduceOp, async_op=True,
                                                timeout=_timeout(opts))
            for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._many(None, lambda out: [
            self._comm(o).reduce_scatter(out(o), [_dense(i) for i in ins], opts.reduceOp, async_op=True,
                                         timeout=_timeout(opts))
            for o, ins in zip(outputs, input_lists)])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._many([output], lambda _: [self._comm(input).all_to_all_single(
            output, input, list(output_split_sizes) or None, list(input_split_sizes) or None,
            async_op=True, timeout=_timeout(opts))])

    alltoall_base = all_to_all_single

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        return self._many(tensors, lambda out: [
            self._comm(t).broadcast(out(t), opts.rootRank, async_op=True, timeout=_timeout(opts)) for t in tensors])

    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        return self._many(tensors, lambda out: [
            self._comm(t).reduce(out(t), opts.rootRank, opts.reduceOp, async_op=True, timeout=_timeout(opts))
            for t in tensors])

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        outs = output_lists[0] if output_lists else []
        return self._many(list(outs), lambda out: [self._comm(inputs[0]).gather(
            [out(o) for o in outs], _dense(inputs[0]), opts.rootRank, async_op=True, timeout=_timeout(opts))])

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        ins = input_lists[0] if input_lists else []
        return self._many(outputs, lambda out: [self._comm(outputs[0]).scatter(
            out(outputs[0]), [_dense(i) for i in ins], opts.rootRank, async_op=True, timeout=_timeout(opts))])

    def barrier(self, opts=None):
        return self._many([], lambda _: [self.communicator("cpu").barrier(async_op=True, timeout=_timeout(opts))])

    def send(self, tensors, dst, tag=0):
        return self._many(None, lambda _: [self._comm(t)._p2p("send", t, dst, True, None, tag) for t in tensors])

    def recv(self, tensors, src, tag=0):
        return self._many(None, lambda _: [self._comm(t)._p2p("recv", t, src, True, None, tag) for t in tensors])

    def recv_anysource(self, tensors, tag=0):
        return self._many(None, lambda _: [self._comm(t)._recv_any(t, True, None, tag) for t in tensors])

    def _many(self, result, issue: Callable[[Callable[[torch.Tensor], torch.Tensor]], List[Work]]) -> C10dWork:
        """The ops ``issue(out)`` starts, as one c10d work whose ``result()`` is ``result``
        (None: raises, where Gloo's work has none); ``out(t)`` gives the tensor an op
        writes in place of ``t`` (``_dense``), whose result the work copies into ``t`` once
        the ops succeeded.  While held, one that fails is reported to the hold's callback
        and its outputs are left as they are."""
        back: CopyBack = []
        try:
            works = issue(lambda t: _dense(t, back))
        except CommError as exc:
            if self._held is None:
                raise
            self._held(exc)
            return C10dWork([], None if result is None else list(result), self._held)
        return C10dWork(works, None if result is None else list(result), self._held, back)

    # resilience: the group object outlives its communicators
    def hold(self, on_failure: Callable[[CommError], None]) -> None:
        """From now on an op that fails (when issued or waited for) does not raise:
        ``on_failure(err)`` is called and the op counts as done, its outputs
        unspecified. For a caller that holds a broken step and redoes it
        (``commslayer.resilience``): FSDP2 and DeviceMesh run on to the step's
        end, where the step is voted down and redone."""
        self._held = on_failure
        for comm in self._comms.values():
            self._held_by(comm)

    def replace(self, comm: Communicator) -> None:
        """Carry on over ``comm``, a later generation of this group's communicator with
        the same rank and size (a replacement rank joined). The group object that
        FSDP2 and DeviceMesh hold stays the same; c10d's registered backend (used
        for the ops commslayer does not carry) stays the first one's."""
        old = self.communicator(comm.get_device().type)
        if (comm.get_rank(), comm.get_size()) != (old.get_rank(), old.get_size()):
            raise InvalidArgument(f"replace: generation {comm.generation} has rank {comm.get_rank()} of "
                                  f"{comm.get_size()}, the group rank {old.get_rank()} of {old.get_size()}",
                                  comm=comm.get_name(), op="replace")
        self._comms[comm.get_device().type] = comm
        self._held_by(comm)

    # lifecycle
    def abort(self) -> None:
        for comm in self._comms.values():
            comm.abort()

    def shutdown(self) -> None:
        for comm in self._comms.values():
            comm.finalize()


class CommslayerProcessGroup(CommslayerGroup, dist.ProcessGroup):
    """The group where the native module is not built: c10d's ``ProcessGroup`` as a
    Python subclass whose methods are ``CommslayerGroup``'s (see the module doc)."""

    def __init__(self, comms: Sequence[Communicator]) -> None:
        dist.ProcessGroup.__init__(self, comms[0].get_rank(), comms[0].get_size())
        CommslayerGroup.__init__(self, comms)
        for comm in comms:
            self._register_backend(comm.get_device(), _backend_type(comm), comm._backend)
        self._set_default_backend(_default_type(comms))


def _backend_type(comm: Communicator) -> dist.ProcessGroup.BackendType:
    return dist.ProcessGroup.BackendType.NCCL if comm.get_device().type == "cuda" else \
        dist.ProcessGroup.BackendType.GLOO


def _default_type(comms: Sequence[Communicator]) -> dist.ProcessGroup.BackendType:
    """What c10d makes a group's default backend, and so its name: NCCL if any device uses it."""
    types = [_backend_type(comm) for comm in comms]
    return dist.ProcessGroup.BackendType.NCCL if dist.ProcessGroup.BackendType.NCCL in types else types[0]


def process_group(comms: Sequence[Communicator]) -> dist.ProcessGroup:
    """A c10d group over ``comms``, one communicator per device type, all of one rank and
    size: c10d's own ``ProcessGroup`` with a ``GroupBackend`` per device type where the
    native module is built, else a ``CommslayerProcessGroup`` (see the module doc)."""
    side = CommslayerGroup(comms)
    backend = native.group_backend(comms[0].get_rank(), comms[0].get_size(), side,
                                   {comm.get_device().type: comm._backend for comm in comms})
    if backend is None:
        return CommslayerProcessGroup(comms)
    side._backend = backend
    pg = dist.ProcessGroup(comms[0].get_rank(), comms[0].get_size())
    for comm in comms:
        side._held_by(comm)
        # c10d's own backend under its own type, for what reads it by type (DDP's
        # logger casts the GLOO one to ProcessGroupGloo); the device's ops to ours
        pg._register_backend(comm.get_device(), _backend_type(comm), comm._backend)
        pg._register_backend(comm.get_device(), dist.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(_default_type(comms))
    return pg


def group_of(pg: Any) -> Optional[CommslayerGroup]:
    """commslayer's side of c10d group ``pg``; None where ``pg`` is not commslayer's."""
    if isinstance(pg, CommslayerGroup):
        return pg
    for device in getattr(pg, "_device_types", ()):
        try:
            side = getattr(pg._get_backend(device), "ops", None)
        except RuntimeError:
            continue
        if isinstance(side, CommslayerGroup):
            return side
    return None


def answer_as(pg: dist.ProcessGroup, name: str) -> None:
    """Give ``name`` (``"gloo"``, ``"nccl"``) as commslayer group ``pg``'s backend name
    (``name()``, DDP's logging data), where it has that backend: a routed group
    answers with the one the job asked for."""
    kind = dist.ProcessGroup.BackendType.NCCL if name == "nccl" else dist.ProcessGroup.BackendType.GLOO
    device = "cuda" if name == "nccl" else "cpu"
    if torch.device(device) in pg._device_types:
        pg._set_default_backend(kind)


def job_rank_shift(my_rank: int) -> int:
    """What to add to a default-group rank to get the job's rank (``COMMSLAYER_JOB_RANK``):
    a job run as several torchruns numbers each one's ranks from 0, and each
    torchrun's ranks are taken to be one contiguous block of the job's.
    ``my_rank``: this process's rank in the default group."""
    job = config.job_rank()
    return 0 if job is None else job - my_rank


def register_communicator(comm: Communicator) -> dist.ProcessGroup:
    """Wrap ``comm`` as a ``ProcessGroup`` and register it with c10d under a fresh name."""
    pg = process_group([comm])
    name = f"commslayer:{comm.uid}"
    pg._set_group_name(name)
    if comm.global_ranks is not None:  # the job's ranks: back to the default group's
        me = dist.get_rank() if dist.is_initialized() else comm.global_ranks[comm.get_rank()]
        shift = job_rank_shift(me)
        mapping = {g - shift: i for i, g in enumerate(comm.global_ranks)}
    else:  # only our own place is known
        mapping = {dist.get_rank() if dist.is_initialized() else comm.get_rank(): comm.get_rank()}
    dc._register_pg_in_world(pg, backend_name=BACKEND_NAME, store=comm._store, group_name=name,
                             backend_config=f"{comm.get_device().type}:{BACKEND_NAME}", rank_mapping=mapping)
    return pg


