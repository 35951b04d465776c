"""commslayer's communicators as a c10d ``ProcessGroup``: ``CommslayerProcessGroup``.

A Python subclass of c10d's ``ProcessGroup`` that sends every collective
c10d's Python API or C++ callers (DDP's reducer) make through a
``Communicator`` per device type (CPU → Gloo, CUDA → NCCL), so they get
deadlines, classified errors and hooks; its c10d ``Work``s (``C10dWork``)
wrap commslayer ``Work``s, except those of an async all_reduce,
all_gather_single or reduce_scatter_single on CPU that the native path
issues (``Communicator._issue_async``): a c10d ``Work`` of its own, whose
wait runs no Python while the op completes (docs/bench/async-path.md).  A C++ ``Backend`` cannot be subclassed from
Python, so the group registers each communicator's own c10d backend object
too: that gives the group its name (DeviceMesh needs it) and serves callers
that go straight to the dispatcher (functional collectives), which therefore
bypass commslayer's deadlines.

It builds no communicator: ``commslayer.c10d`` builds those of the groups
c10d creates, and ``Communicator.as_process_group`` wraps one that exists
(``register_communicator``), which is why the communicator may import this
module and not the other.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as dc
from torch._C import _distributed_c10d as c10d

from commslayer import config
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


class C10dWork(dist.Work):
    """c10d's view of one or more commslayer ``Work`` objects."""

    def __init__(self, works: List[Work], result: Optional[List[torch.Tensor]],
                 held: Optional[Callable[[CommError], None]] = None) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._held = held

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

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

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
            return self._result if self._result is not None else []

        return torch.futures.collect_all([w.get_future() for w in self._works]).then(settle)


class CommslayerProcessGroup(dist.ProcessGroup):
    """A c10d ``ProcessGroup`` whose ops run on commslayer communicators."""

    def __init__(self, comms: Sequence[Communicator]) -> None:
        """A group over ``comms``: one communicator per device type, all of one rank and size."""
        super().__init__(comms[0].get_rank(), comms[0].get_size())
        self._held: Optional[Callable[[CommError], None]] = None
        self._answers = BACKEND_NAME
        self._comms: Dict[str, Communicator] = {}
        # the CPU communicator, whose async all_reduce, all_gather_single and
        # reduce_scatter_single may take the native path
        self._cpu: Optional[Communicator] = None
        for comm in comms:
            self._attach(comm)

    def _attach(self, comm: Communicator) -> None:
        device_type = comm.get_device().type
        self._comms[device_type] = comm
        kind = dist.ProcessGroup.BackendType.NCCL if device_type == "cuda" else dist.ProcessGroup.BackendType.GLOO
        self._register_backend(torch.device(device_type), kind, comm._backend)
        if len(self._comms) == 1:
            self._set_default_backend(kind)
        self._take_cpu()

    def _take_cpu(self) -> None:
        cpu = self._cpu = self._comms.get("cpu")
        if cpu is not None:
            cpu._held_failures = self._held  # a held group's native async ops report to the hold too
            WATCHDOG.sweep_native(cpu)

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

    def getBackendName(self) -> str:  # noqa: N802 (c10d's C++ name; DDP's logging reads it)
        return self._answers

    def name(self) -> str:
        return self._answers

    def answer_as(self, name: str) -> None:
        """Give ``name`` as this group's backend name (``name()``, DDP's logging data):
        a routed group answers with the backend the job asked for."""
        self._answers = name

    # collectives: c10d's Python API and C++ callers use these names
    def allreduce(self, tensors, opts=None):
        cpu = self._cpu
        if cpu is not None and len(tensors) == 1:
            work = cpu._issue_async(0, tensors[0], tensors[0], opts)
            if work is not None:
                return work
        if not hasattr(opts, "reduceOp"):  # the old allreduce(tensors, op) form
            op, opts = opts, c10d.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        return self._many(tensors, lambda: [
            self._comm(t).all_reduce(t, opts.reduceOp, async_op=True, timeout=_timeout(opts)) for t in tensors])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or c10d.AllreduceCoalescedOptions()
        return self._many(tensors, lambda: [self._comm(tensors[0]).all_reduce_coalesced(
            tensors, opts.reduceOp, async_op=True, timeout=_timeout(opts))])

    def all_gather_single(self, output, input, opts=None):
        cpu = self._cpu
        if cpu is not None:
            work = cpu._issue_async(1, output, input, opts)
            if work is not None:
                return work
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        chunks = [c for o in outputs for c in o.chunk(self.size())]  # Gloo's result: one per rank
        return self._many(chunks, lambda: [
            self._comm(i).all_gather_single(o, i, async_op=True, timeout=_timeout(opts))
            for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        return self._many([t for outs in output_lists for t in outs], lambda: [
            self._comm(i).all_gather(outs, i, async_op=True, timeout=_timeout(opts))
            for outs, i in zip(output_lists, inputs)])

    def reduce_scatter_single(self, output, input, opts=None):
        cpu = self._cpu
        if cpu is not None:
            work = cpu._issue_async(2, output, input, opts)
            if work is not None:
                return work
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._many(None, lambda: [
            self._comm(i).reduce_scatter_single(o, i, opts.reduceOp, async_op=True, timeout=_timeout(opts))
            for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ReduceScatterOptions()
        return self._many(None, lambda: [
            self._comm(o).reduce_scatter(o, ins, opts.reduceOp, async_op=True, timeout=_timeout(opts))
            for o, ins in zip(outputs, input_lists)])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._many([output], lambda: [self._comm(input).all_to_all_single(
            output, input, list(output_split_sizes) or None, list(input_split_sizes) or None,
            async_op=True, timeout=_timeout(opts))])

    alltoall_base = all_to_all_single

    def broadcast(self, tensors, opts=None):
        opts = opts or c10d.BroadcastOptions()
        return self._many(tensors, lambda: [
            self._comm(t).broadcast(t, opts.rootRank, async_op=True, timeout=_timeout(opts)) for t in tensors])

    def reduce(self, tensors, opts=None):
        opts = opts or c10d.ReduceOptions()
        return self._many(tensors, lambda: [
            self._comm(t).reduce(t, opts.rootRank, opts.reduceOp, async_op=True, timeout=_timeout(opts))
            for t in tensors])

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or c10d.GatherOptions()
        outs = output_lists[0] if output_lists else []
        return self._many(list(outs), lambda: [
            self._comm(inputs[0]).gather(outs, inputs[0], opts.rootRank, async_op=True, timeout=_timeout(opts))])

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or c10d.ScatterOptions()
        ins = input_lists[0] if input_lists else []
        return self._many(outputs, lambda: [
            self._comm(outputs[0]).scatter(outputs[0], ins, opts.rootRank, async_op=True, timeout=_timeout(opts))])

    def barrier(self, opts=None):
        return self._many([], lambda: [self.communicator("cpu").barrier(async_op=True, timeout=_timeout(opts))])

    def send(self, tensors, dst, tag=0):
        return self._many(None, lambda: [self._comm(t)._p2p("send", t, dst, True, None, tag) for t in tensors])

    def recv(self, tensors, src, tag=0):
        return self._many(None, lambda: [self._comm(t)._p2p("recv", t, src, True, None, tag) for t in tensors])

    def recv_anysource(self, tensors, tag=0):
        return self._many(None, lambda: [self._comm(t)._recv_any(t, True, None, tag) for t in tensors])

    def _many(self, result, issue: Callable[[], List[Work]]) -> C10dWork:
        """The ops ``issue()`` starts, as one c10d work whose ``result()`` is ``result``
        (None: raises, where Gloo's work has none); while held, one that fails is
        reported to the hold's callback and its outputs are left as they are."""
        try:
            works = issue()
        except CommError as exc:
            if self._held is None:
                raise
            self._held(exc)
            works = []
        return C10dWork(works, None if result is None else list(result), self._held)

    # resilience: the group object outlives its communicators
    def hold(self, on_failure: Callable[[CommError], None]) -> None:
        """From now on an op that fails (when issued or waited for) does not raise:
        ``on_failure(err)`` is called and the op counts as done, its outputs
        unspecified. For a caller that holds a broken step and redoes it
        (``commslayer.resilience``): FSDP2 and DeviceMesh run on to the step's
        end, where the step is voted down and redone."""
        self._held = on_failure
        self._take_cpu()

    def replace(self, comm: Communicator) -> None:
        """Carry on over ``comm``, a later generation of this group's communicator with
        the same rank and size (a replacement rank joined). The group object that
        FSDP2 and DeviceMesh hold stays the same; c10d's registered backend (used
        only by dispatcher callers, see the module doc) stays the first one's."""
        old = self.communicator(comm.get_device().type)
        if (comm.get_rank(), comm.get_size()) != (old.get_rank(), old.get_size()):
            raise InvalidArgument(f"replace: generation {comm.generation} has rank {comm.get_rank()} of "
                                  f"{comm.get_size()}, the group rank {old.get_rank()} of {old.get_size()}",
                                  comm=comm.get_name(), op="replace")
        self._comms[comm.get_device().type] = comm
        self._take_cpu()

    # lifecycle
    def abort(self) -> None:
        for comm in self._comms.values():
            comm.abort()

    def shutdown(self) -> None:
        for comm in self._comms.values():
            comm.finalize()


def job_rank_shift(my_rank: int) -> int:
    """What to add to a default-group rank to get the job's rank (``COMMSLAYER_JOB_RANK``):
    a job run as several torchruns numbers each one's ranks from 0, and each
    torchrun's ranks are taken to be one contiguous block of the job's.
    ``my_rank``: this process's rank in the default group."""
    job = config.job_rank()
    return 0 if job is None else job - my_rank


def register_communicator(comm: Communicator) -> CommslayerProcessGroup:
    """Wrap ``comm`` as a ``ProcessGroup`` and register it with c10d under a fresh name."""
    pg = CommslayerProcessGroup([comm])
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


