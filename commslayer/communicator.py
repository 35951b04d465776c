"""The ``Communicator``: the public API, argument checks, deadlines and hooks.

It validates a call (``validation``), optionally compares it across ranks
(``check``), issues it on the c10d backend built by ``backends`` (the
tensors and option structs as ``wire`` prepares them, the op's deadline in
the struct), and hands back a ``Work`` whose
deadline the caller's ``wait`` or the ``watchdog`` enforces.  A synchronous
all_reduce, all_gather_single or reduce_scatter_single that no hook observes
takes ``_direct_run``: the same steps without the branches only hooks, check
mode, isolation and async ops need, its issue, wait and flight-recorder
record in native code where ``commslayer.native`` is built.  Whether it may
issue at all is its ``lifecycle``'s business (commslayer.lifecycle: the state
machine, lost and departed peers, fencing, shrink, reconfigure, votes, the
liveness callbacks): after any failure the backend group is unusable (Gloo
cannot cancel an op), so the lifecycle remembers the first error and every
later op raises at once.  ``new_comm`` and ``join`` (commslayer.create)
build the first communicator of a group; ``split``, ``shrink`` and
``reconfigure`` build the others.

Names follow torchcomms, so code moves between the two.
"""

from __future__ import annotations

import itertools
import threading
import weakref
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from . import backends, config, native
from .batch import BackendWorks, BatchSendRecv, Message
from .check import CrossRankCheck, fingerprint
from .errors import CollectiveMismatch, CommError, StoreUnreachable
from .hooks import HookHandle, Hooks, OpIO, OpRecorder, created
from .isolation import IsolatedBackend, StagedWork
from .lifecycle import Lifecycle, Lineage, State
from .nan_check import NanCheckHook
from .reduce_op import ReduceOp
from .ring import RingReduceScatter, ring_fits, ring_tag
from .validation import Checker, Timeout, timeout_seconds
from .watchdog import WATCHDOG
from .wire import BACKEND_OPS, Options, averaging, in_place, premultiplied, wire
from .work import WAIT_SLICE, AnySourceWork, Waiter, Work

_op_ids = itertools.count(1)  # process-wide, monotonic
# The ops the direct path takes (``_direct_run``), by their kind in direct_path.cpp
DIRECT_OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single")


class Communicator:
    """A group of ranks with deadline-bound collectives. Build one with ``new_comm``."""

    def __init__(
        self,
        spec: backends.BackendSpec,
        device: torch.device,
        *,
        name: str,
        store: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        hints: Dict[str, str],
        check: bool,
        uid: str,
        global_ranks: Optional[List[int]] = None,
        lineage: Optional[Lineage] = None,
        generation: int = 0,
        members: Optional[List[int]] = None,
        parent: Optional["Communicator"] = None,
    ) -> None:
        self._spec = spec
        self._device = device
        self._name = name
        self._store = store
        self._rank = rank
        self._size = size
        self._native: Any = None  # the direct path in native code (set below, where it is built)
        self._native_records = False  # whether it writes the flight recorder's records (record_natively)
        self._set_timeout_s(timeout_s)
        self._hints = hints
        self.uid = uid  # the same on every member, unique in the job
        # member i's rank in the job, where known: the default group's rank, unless the job is
        # several torchruns (COMMSLAYER_JOB_RANK, commslayer.c10d.job_rank_shift)
        self.global_ranks = global_ranks
        # state, membership, recovery (commslayer.lifecycle)
        life = Lifecycle(
            self, name=name, rank=rank, size=size, lineage=lineage, generation=generation,
            members=list(range(size)) if members is None else list(members),
            parent=None if parent is None else parent.lifecycle)
        self.lifecycle: Lifecycle = life
        # what the flight recorder stamps on each of its records, read once
        self.trace_ids: Tuple[str, str, int] = (name, uid, generation)
        try:
            self._backend = spec.create(store, rank, size, timedelta(seconds=timeout_s), hints)
        except StoreUnreachable:  # raised by the store inside the rendezvous: not a peer's fault
            raise
        except RuntimeError as exc:  # the rendezvous of the new group failed
            raise backends.classify(exc)(f"could not build the {spec.name} group: {exc}", comm=name,
                                         op="new_comm", timeout_s=timeout_s) from exc
        isolate = life.lineage is not None and life.lineage.isolate
        self._ops = IsolatedBackend(self._backend) if isolate else self._backend  # what op closures call
        me = weakref.ref(self)  # the check must not keep its communicator alive
        self._check = CrossRankCheck(store, name, rank, size, lambda op, seq: None if (c := me()) is None else c.lifecycle.interruption(op, seq)) \
            if check else None
        self._seq = 0
        self._p2p_seq: Dict[Tuple[int, int], int] = {}
        self._splits: Set[str] = set()
        self._batches = 0  # batch_p2p ops issued (their trace records' numbers)

        def observed() -> None:  # a hook came or went
            comm = me()
            if comm is not None:
                comm._update_direct()

        self._pre = Hooks("pre", on_change=observed)
        self._checks = Hooks("check", raising=True, on_change=observed)
        self._post = Hooks("post", on_change=observed)
        self._process_group: Optional[dist.ProcessGroup] = None
        self._checkers: Dict[str, Checker] = {}
        self._options = Options()
        self._barrier_opts = spec.barrier_options(self._options.timedelta(timeout_s), device)
        self.settle_lock = threading.Lock()  # shared by this communicator's Work objects
        self.completion_hooks = Hooks("completion", on_change=observed)
        self._waiter_thread: Optional[Waiter] = None
        self._ring_thread: Optional[Waiter] = None  # runs ring reduce-scatters in turn
        # the input size from which a reduce-scatter takes the ring (None: never; commslayer.ring)
        algorithm = hints.get("reduce_scatter") or config.reduce_scatter_algorithm()
        self._ring_from = None if spec.name != "gloo" or algorithm == "native" else \
            0 if algorithm == "ring" else config.ring_min_bytes()
        life.watch(store, timeout_s)
        # Our ops whose backend work ignores wait timeouts: a helper thread waits for them.
        self._waited_elsewhere = frozenset(
            op for op, backend_op in BACKEND_OPS.items() if backend_op in spec.untimed_waits) \
            if life.watched else frozenset()
        # Our ops whose backend work one thread waits on, once (Work.is_completed)
        self.waited_once = frozenset(op for op, backend_op in BACKEND_OPS.items() if backend_op in spec.single_waits)
        self.recorder: Optional[OpRecorder] = None  # set by tracing's flight recorder
        # Not on NCCL: the native direct path has not run on a GPU yet.
        self._take_direct_path(None if spec.name != "gloo" else native.direct_path(
            self._backend, size, spec.device_type, spec.dtypes,
            [kind for kind, op in enumerate(DIRECT_OPS) if op in self._waited_elsewhere], self.trace_ids,
            *self._native_waits()))
        self._update_direct()
        if config.nan_check():
            NanCheckHook().register_with_comm(self)
        created(self)

    # ---------------------------------------------------------------- identity
    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_name(self) -> str:
        return self._name

    def get_backend(self) -> str:
        return self._spec.name

    def get_device(self) -> torch.device:
        return self._device

    def get_timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: Timeout) -> None:
        """Make ``timeout`` (a timedelta or seconds) the deadline of every later op
        that names none; ops already issued keep theirs, splits made later inherit it."""
        chk = self._checker("set_timeout")
        if timeout is None:
            raise chk.fail("timeout must be a timedelta or a number of seconds, got None")
        self._set_timeout_s(timeout_seconds(timeout, self._timeout_s, chk))

    def is_aborted(self) -> bool:
        """Whether ``abort()`` (or a failed shrink) closed this communicator; one that a
        failure broke is not aborted (see ``state``)."""
        return self.lifecycle.state is State.ABORTED

    @property
    def state(self) -> str:
        """"ok", "broken: <first failure>", or why it was closed ("aborted", "finalized",
        "replaced by generation 2 (members [...])", "fenced out of generation 2: ...");
        ``lifecycle.state`` is the same as a ``State``."""
        return self.lifecycle.describe()

    @property
    def generation(self) -> int:
        """Bumped by recovery when the membership changes (each generation is a new communicator)."""
        return self.lifecycle.generation

    @property
    def members(self) -> List[int]:
        """Member ids, in rank order (the same across generations of one communicator)."""
        return self.lifecycle.members

    @property
    def lost_ranks(self) -> Set[int]:
        """Ranks the liveness monitor (or a failed op) named as lost."""
        return self.lifecycle.lost_ranks

    def __repr__(self) -> str:
        return f"<Communicator {self._name!r} {self._spec.name} rank {self._rank}/{self._size} {self.state}>"

    # ------------------------------------------------------------------- hooks
    def register_pre_hook(self, fn: Callable[[str, int, Dict[str, Any]], None]) -> HookHandle:
        """``fn(op_name, op_id, args)`` runs before each op is issued."""
        return self._pre.add(fn)

    def register_post_hook(self, fn: Callable[[int, Work], None]) -> HookHandle:
        """``fn(op_id, work)`` runs right after each op is issued."""
        return self._post.add(fn)

    def register_abort_hook(self, fn: Callable[[], None]) -> HookHandle:
        """``fn()`` runs once when the communicator is aborted."""
        return self.lifecycle.abort_hooks.add(fn)

    def register_completion_hook(self, fn: Callable[[Work], None]) -> HookHandle:
        """``fn(work)`` runs once per op when its outcome is known (completed, timed
        out or failed), with ``work.end_ns`` set. While one is registered, async ops
        settle from the backend's completion callback, so end times are exact."""
        return self.completion_hooks.add(fn)

    def register_check_hook(self, fn: Callable[[str, OpIO], None]) -> HookHandle:
        """``fn(op_name, io)`` runs before each op is issued, after its argument checks;
        a ``CommError`` it raises fails the op (recorded, nothing sent) and breaks the
        communicator, like any failed op (``commslayer.nan_check`` is one)."""
        return self._checks.add(fn)

    def register_error_hook(self, fn: Callable[[CommError], None]) -> HookHandle:
        """``fn(error)`` runs once, on the first failure that breaks the communicator."""
        return self.lifecycle.error_hooks.add(fn)

    # ------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``tensor`` across ranks, in place (a sparse COO one too: ``_all_reduce_sparse``)."""
        if self._direct and op is ReduceOp.SUM and async_op is False and timeout is None and self._dense(tensor):
            return self._direct_run(0, tensor, tensor, op)
        chk = self._checker("all_reduce")
        if getattr(tensor, "is_sparse", False):
            return self._all_reduce_sparse(chk, tensor, op, async_op, timeout)
        chk.tensor(tensor, "tensor")
        op = chk.reduce_op(op, tensor.dtype)
        opts = self._options.get(c10d.AllreduceOptions, op)
        return self._run(chk, OpIO((tensor,), (tensor,), op, None),
                         in_place(self._ops.allreduce, [wire(tensor)], op, opts), opts=opts,
                         finish=averaging(tensor, op, self._size), fp=self._fp(chk.op, tensor, op),
                         timeout=timeout, async_op=async_op)

    def all_reduce_coalesced(self, tensors: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                             async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce each of ``tensors`` (one dtype) across ranks, in place, as one op on the wire."""
        chk = self._checker("all_reduce_coalesced")
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise chk.fail(f"tensors must be a non-empty list of tensors, got {tensors!r}")
        for i, t in enumerate(tensors):
            chk.tensor(t, f"tensors[{i}]")
            chk.same_dtype(t, tensors[0], f"tensors[{i}] and tensors[0]")
        op = chk.reduce_op(op, tensors[0].dtype)
        finishes = [f for f in (averaging(t, op, self._size) for t in tensors) if f is not None]

        def finish() -> None:
            for f in finishes:
                f()

        opts = self._options.get(c10d.AllreduceCoalescedOptions, op)
        fp = self._fp(chk.op, tensors[0], op, extra_shape=[t.numel() for t in tensors])
        issue = in_place(self._ops.allreduce_coalesced, [wire(t) for t in tensors], op, opts)
        return self._run(chk, OpIO(tuple(tensors), tuple(tensors), op, None), issue, opts=opts,
                         finish=finish if finishes else None, fp=fp, timeout=timeout, async_op=async_op)

    def _all_reduce_sparse(self, chk: Checker, tensor: torch.Tensor, op: ReduceOp, async_op: bool,
                           timeout: Timeout) -> Work:
        """The backend's own reduction of a sparse COO tensor, in place (Gloo: sums only)."""
        chk.sparse(tensor, "tensor")
        op = chk.reduce_op(op, tensor.dtype)
        if op.name != "SUM" or self._spec.name != "gloo":
            raise chk.fail(f"a sparse tensor is reduced with ReduceOp.SUM on Gloo only, not {op} on "
                           f"{self._spec.name}")
        opts = self._options.get(c10d.AllreduceOptions, op)
        return self._run(chk, OpIO((tensor,), (tensor,), op, None), lambda: self._ops.allreduce([tensor], opts),
                         opts=opts, fp=self._fp(chk.op, tensor, op), timeout=timeout, async_op=async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, *,
                          async_op: bool = False, timeout: Timeout = None) -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times larger)."""
        if self._direct and async_op is False and timeout is None and self._dense_sized(output, input):
            return self._direct_run(1, output, input, None)
        chk = self._checker("all_gather_single")
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        chk.sized(output, input, "output input")
        opts = self._options.get(c10d.AllgatherOptions)
        return self._run(chk, OpIO((input,), (output,), None, None),
                         lambda: self._ops._allgather_base(wire(output), wire(input), opts), opts=opts,
                         fp=self._fp(chk.op, input), timeout=timeout, async_op=async_op)

    def all_gather_v(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, *,
                     async_op: bool = False, timeout: Timeout = None) -> Work:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]``, where the ranks'
        tensors may differ in size (``tensor_list[j]`` holds rank j's). One all-to-all
        on the wire (Gloo's all-gather takes equal sizes only): each rank sends a copy of
        its tensor per rank, and the result is copied out of one receive buffer."""
        chk = self._checker("all_gather_v")
        chk.tensor(tensor, "tensor")
        outs = chk.tensor_list(tensor_list, "tensor_list", tensor, uneven=True)
        send = wire(tensor).reshape(-1)
        counts = [wire(o).numel() for o in outs]
        sends = [send.numel()] * self._size
        fp = self._fp(chk.op, tensor, extra_shape=[])
        if fp is not None:  # check mode compares what each rank sends with what its peers expect
            fp["splits"] = [sends, counts]
        received = torch.empty(sum(counts), dtype=send.dtype, device=send.device)
        pieces = [wire(o).view(-1) for o in outs]

        def finish() -> None:
            for piece, part in zip(pieces, received.split(counts)):
                piece.copy_(part)

        opts = self._options.get(c10d.AllToAllOptions)
        return self._run(chk, OpIO((tensor,), tuple(outs), None, None),
                         lambda: self._ops.alltoall_base(received, send.repeat(self._size), counts, sends, opts),
                         opts=opts, finish=finish, fp=fp, timeout=timeout, async_op=async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                              async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input`` across ranks and leave this rank's slice in ``output``."""
        if self._direct and op is ReduceOp.SUM and async_op is False and timeout is None \
                and self._dense_sized(input, output) \
                and not self._takes_ring(op, output, input.nbytes):
            return self._direct_run(2, output, input, op)
        chk = self._checker("reduce_scatter_single")
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        op = chk.reduce_op(op, input.dtype)
        chk.sized(input, output, "input output")
        src = premultiplied(input, op)
        opts = self._options.get(c10d.ReduceScatterOptions, op)
        ring = self._takes_ring(op, output, input.nbytes)
        issue: Callable[[], Any] = (lambda: self._ring(list(wire(src).reshape(self._size, -1).unbind(0)), output)) \
            if ring else (lambda: self._ops._reduce_scatter_base(wire(output), wire(src), opts))
        return self._run(chk, OpIO((input,), (output,), op, None), issue, opts=opts,
                         finish=averaging(output, op, self._size), fp=self._fp(chk.op, output, op),
                         timeout=timeout, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[Sequence[int]] = None,
                          input_split_sizes: Optional[Sequence[int]] = None, *,
                          async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send slice j of ``input`` (dim 0, by ``input_split_sizes``, even when None) to rank j."""
        return self._all_to_all(self._checker("all_to_all_single"), output, input, output_split_sizes,
                                input_split_sizes, async_op, timeout)

    def all_to_all_v_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                            input_split_sizes: Sequence[int], *, async_op: bool = False,
                            timeout: Timeout = None) -> Work:
        """Send slice j of ``input`` (dim 0, by ``input_split_sizes``) to rank j, and
        receive rank j's into slice j of ``output`` (by ``output_split_sizes``)."""
        chk = self._checker("all_to_all_v_single")
        for what, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
            if splits is None:
                raise chk.fail(f"{what} is required (all_to_all_single splits evenly)")
        return self._all_to_all(chk, output, input, output_split_sizes, input_split_sizes, async_op, timeout)

    def _all_to_all(self, chk: Checker, output: torch.Tensor, input: torch.Tensor,
                    output_split_sizes: Optional[Sequence[int]], input_split_sizes: Optional[Sequence[int]],
                    async_op: bool, timeout: Timeout) -> Work:
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        if output.dim() == 0 or input.dim() == 0:
            raise chk.fail("output and input need at least one dimension")
        if output.shape[1:] != input.shape[1:]:
            raise chk.fail(f"output and input differ beyond dim 0: {list(output.shape)} vs {list(input.shape)}")
        out_splits = chk.splits(output_split_sizes, "output_split_sizes", output.shape[0])
        in_splits = chk.splits(input_split_sizes, "input_split_sizes", input.shape[0])
        if out_splits is None and in_splits is None and output.shape[0] != input.shape[0]:
            raise chk.fail(f"with even splits output and input need the same dim 0 "
                           f"({output.shape[0]} vs {input.shape[0]})")
        fp = self._fp(chk.op, input, extra_shape=list(input.shape[1:]))
        if fp is not None:  # check mode
            even_in = [input.shape[0] // self._size] * self._size
            even_out = [output.shape[0] // self._size] * self._size
            fp["splits"] = [in_splits or even_in, out_splits or even_out]
        opts = self._options.get(c10d.AllToAllOptions)
        return self._run(chk, OpIO((input,), (output,), None, None),
                         lambda: self._ops.alltoall_base(wire(output), wire(input), out_splits or [],
                                                         in_splits or [], opts), opts=opts,
                         fp=fp, timeout=timeout, async_op=async_op)

    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, *,
                   async_op: bool = False, timeout: Timeout = None) -> Work:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]``."""
        chk = self._checker("all_gather")
        chk.tensor(tensor, "tensor")
        outs = chk.tensor_list(tensor_list, "tensor_list", tensor)
        opts = self._options.get(c10d.AllgatherOptions)
        return self._run(chk, OpIO((tensor,), tuple(outs), None, None),
                         lambda: self._ops.allgather([[wire(o) for o in outs]], [wire(tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, tensor), timeout=timeout, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input_list[j]`` across ranks into rank j's ``output``."""
        chk = self._checker("reduce_scatter")
        chk.tensor(output, "output")
        ins = chk.tensor_list(input_list, "input_list", output)
        op = chk.reduce_op(op, output.dtype)
        return self._reduce_scatter(chk, output, ins, op, self._fp(chk.op, output, op), async_op, timeout, False)

    def reduce_scatter_v(self, output: torch.Tensor, input_list: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input_list[j]`` across ranks into rank j's ``output``, where the ranks'
        outputs may differ in size (``input_list[j]`` is shaped like rank j's output)."""
        chk = self._checker("reduce_scatter_v")
        chk.tensor(output, "output")
        ins = chk.tensor_list(input_list, "input_list", output, uneven=True)
        op = chk.reduce_op(op, output.dtype)
        fp = self._fp(chk.op, output, op, extra_shape=[])
        if fp is not None:  # check mode compares what each rank sends with what its peers expect
            fp["splits"] = [[t.numel() for t in ins], [output.numel()] * self._size]
        return self._reduce_scatter(chk, output, ins, op, fp, async_op, timeout, True)

    def _reduce_scatter(self, chk: Checker, output: torch.Tensor, ins: List[torch.Tensor], op: ReduceOp,
                        fp: Optional[Dict[str, Any]], async_op: bool, timeout: Timeout, uneven: bool) -> Work:
        """Both list forms: the ring where the blocks are even and it pays (``_takes_ring``)."""
        ins = [premultiplied(t, op) for t in ins]
        opts = self._options.get(c10d.ReduceScatterOptions, op)
        ring = not uneven and self._takes_ring(op, output, output.numel() * output.element_size() * self._size)
        issue: Callable[[], Any] = (lambda: self._ring([wire(t).reshape(-1) for t in ins], output)) \
            if ring else (lambda: self._ops.reduce_scatter([wire(output)], [[wire(t) for t in ins]], opts))
        return self._run(chk, OpIO(tuple(ins), (output,), op, None), issue, opts=opts,
                         finish=averaging(output, op, self._size), fp=fp, timeout=timeout, async_op=async_op)

    def _takes_ring(self, op: ReduceOp, output: torch.Tensor, input_bytes: int) -> bool:
        """Whether this reduce-scatter runs as the ring (commslayer.ring) rather than Gloo's own."""
        return self._ring_from is not None and input_bytes >= self._ring_from and ring_fits(op, output, self._size)

    def _ring(self, blocks: List[torch.Tensor], output: torch.Tensor) -> RingReduceScatter:
        """The ring reduce-scatter of ``blocks`` into ``output`` (run by ``_run`` on the ring thread);
        with write isolation it reduces into a staging copy."""
        return RingReduceScatter(self._backend, ring_tag(self._seq), self._rank, self._size, blocks,
                                 wire(output).view(-1),
                                 stage=self._ops is not self._backend)

    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Copy ``root``'s ``tensor`` into every rank's."""
        chk = self._checker("broadcast")
        chk.tensor(tensor, "tensor")
        root = chk.rank_arg(root, "root")
        opts = self._options.get(c10d.BroadcastOptions, root=root)
        return self._run(chk, OpIO((tensor,), (tensor,), None, root),
                         lambda: self._ops.broadcast([wire(tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, tensor, root=root), timeout=timeout, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``tensor`` across ranks into ``root``'s (others' are left undefined)."""
        chk = self._checker("reduce")
        chk.tensor(tensor, "tensor")
        root = chk.rank_arg(root, "root")
        op = chk.reduce_op(op, tensor.dtype)
        opts = self._options.get(c10d.ReduceOptions, op, root)
        return self._run(chk, OpIO((tensor,), (tensor,), op, root),
                         in_place(self._ops.reduce, [wire(tensor)], op, opts), opts=opts,
                         finish=averaging(tensor, op, self._size) if root == self._rank else None,
                         fp=self._fp(chk.op, tensor, op, root=root), timeout=timeout, async_op=async_op)

    def gather(self, output_tensor_list: Optional[List[torch.Tensor]], input_tensor: torch.Tensor, root: int, *,
               async_op: bool = False, timeout: Timeout = None) -> Work:
        """Collect every rank's ``input_tensor`` into ``root``'s ``output_tensor_list``."""
        chk = self._checker("gather")
        chk.tensor(input_tensor, "input_tensor")
        root = chk.rank_arg(root, "root")
        outs = chk.root_list(output_tensor_list, "output_tensor_list", root, input_tensor)
        opts = self._options.get(c10d.GatherOptions, root=root)
        wire_outs = [[wire(o) for o in outs]] if outs else []
        return self._run(chk, OpIO((input_tensor,), tuple(outs), None, root),
                         lambda: self._ops.gather(wire_outs, [wire(input_tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, input_tensor, root=root), timeout=timeout, async_op=async_op)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, root: int, *,
                      async_op: bool = False, timeout: Timeout = None) -> Work:
        """Collect every rank's ``input`` into ``root``'s ``output`` (``size`` times as many
        elements, rank j's in the j-th block); other ranks' ``output`` is not touched."""
        chk = self._checker("gather_single")
        chk.tensor(input, "input")
        root = chk.rank_arg(root, "root")
        wire_outs: List[List[torch.Tensor]] = []
        outs: Tuple[torch.Tensor, ...] = ()
        if root == self._rank:
            chk.tensor(output, "output")
            chk.same_dtype(output, input, "output and input")
            chk.sized(output, input, "output input")
            wire_outs = [list(wire(output).view(self._size, *wire(input).shape).unbind(0))]
            outs = (output,)
        opts = self._options.get(c10d.GatherOptions, root=root)
        return self._run(chk, OpIO((input,), outs, None, root),
                         lambda: self._ops.gather(wire_outs, [wire(input)], opts), opts=opts,
                         fp=self._fp(chk.op, input, root=root), timeout=timeout, async_op=async_op)

    def scatter(self, output_tensor: torch.Tensor, input_tensor_list: Optional[List[torch.Tensor]], root: int, *,
                async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send ``root``'s ``input_tensor_list[j]`` to rank j's ``output_tensor``."""
        chk = self._checker("scatter")
        chk.tensor(output_tensor, "output_tensor")
        root = chk.rank_arg(root, "root")
        ins = chk.root_list(input_tensor_list, "input_tensor_list", root, output_tensor)
        opts = self._options.get(c10d.ScatterOptions, root=root)
        wire_ins = [[wire(t) for t in ins]] if ins else []
        return self._run(chk, OpIO(tuple(ins), (output_tensor,), None, root),
                         lambda: self._ops.scatter([wire(output_tensor)], wire_ins, opts), opts=opts,
                         fp=self._fp(chk.op, output_tensor, root=root), timeout=timeout, async_op=async_op)

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Return once every rank has entered the barrier."""
        chk = self._checker("barrier")
        opts = self._barrier_opts
        return self._run(chk, OpIO((), (), None, None), lambda: self._ops.barrier(opts), opts=opts,
                         fp={"op": "barrier"}, timeout=timeout, async_op=async_op)

    # ---------------------------------------------------------- point to point
    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send ``tensor`` to rank ``dst`` (matched in order with its ``recv``)."""
        return self._p2p("send", tensor, dst, async_op, timeout)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Receive into ``tensor`` from rank ``src``."""
        return self._p2p("recv", tensor, src, async_op, timeout)

    def recv_any_source(self, tensor: torch.Tensor, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Receive into ``tensor`` from whichever rank's message comes first (c10d's
        ``recv_anysource``); once it completed, ``work.peer`` is the sender's rank."""
        return self._recv_any(tensor, async_op, timeout)

    def _recv_any(self, tensor: torch.Tensor, async_op: bool, timeout: Timeout, tag: int = 0) -> Work:
        """A recv that waits on every other member: the liveness monitor interrupts it
        when any of them is lost (a helper thread waits on the backend: Gloo fails a
        receive at its first timed-out wait). Numbered in its pair once the sender is known."""
        chk = self._checker("recv")
        chk.tensor(tensor, "tensor")
        if self._check is not None:
            raise chk.fail("check mode compares each message before it is sent: a recv from any source "
                           "must name its source rank")
        timeout = timeout_seconds(timeout, self._timeout_s, chk)
        self.lifecycle.ensure_usable("recv", 0)
        return self._run(chk, OpIO((), (tensor,), None, None),
                         lambda: self._ops.recv_anysource([wire(tensor)], tag), opts=None, fp=None,
                         timeout=timeout, async_op=async_op, seq=0, any_source=True)

    def _numbered(self, src: int) -> int:
        """The number of the message from ``src`` that a recv from any source received."""
        pair = (src, self._rank)
        n = self._p2p_seq[pair] = self._p2p_seq.get(pair, 0) + 1
        return n

    def _p2p(self, op: str, tensor: torch.Tensor, peer: int, async_op: bool, timeout: Timeout, tag: int = 0) -> Work:
        chk = self._checker(op)
        chk.tensor(tensor, "tensor")
        peer = chk.rank_arg(peer, "dst" if op == "send" else "src", me=self._rank)
        timeout = timeout_seconds(timeout, self._timeout_s, chk)  # before the message is numbered
        pair = (self._rank, peer) if op == "send" else (peer, self._rank)
        n = self._p2p_seq.get(pair, 0) + 1
        self._p2p_seq[pair] = n
        self.lifecycle.ensure_usable(op, n, peer)
        call = self._ops.send if op == "send" else self._ops.recv
        io = OpIO((tensor,), (), None, None) if op == "send" else OpIO((), (tensor,), None, None)
        return self._run(chk, io, lambda: call([wire(tensor)], peer, tag), opts=None, fp=self._fp(op, tensor),
                         timeout=timeout, async_op=async_op, peer=peer, seq=n)

    def batch_op_create(self) -> BatchSendRecv:
        """An empty batch of sends and receives: queue them with its ``send``/``recv``,
        then ``issue()`` them as one op (commslayer.batch)."""
        return BatchSendRecv(self)

    def _batch_p2p(self, ops: List[Message], async_op: bool, timeout: Timeout) -> Work:
        """Issue a batch's messages (checked as they were queued), numbered in their pairs."""
        chk = self._checker("batch_p2p")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)  # before the messages are numbered
        numbered = []
        for kind, tensor, peer in ops:
            pair = (self._rank, peer) if kind == "send" else (peer, self._rank)
            n = self._p2p_seq[pair] = self._p2p_seq.get(pair, 0) + 1
            numbered.append((pair, n, kind, tensor, peer))
        for pair, n, _, _, peer in numbered:
            self.lifecycle.ensure_usable("batch_p2p", n, peer)
        check = self._check

        def issue() -> Any:
            if check is not None:  # in one order on every rank, so that no two ranks wait on each other
                for (src, dst), n, kind, tensor, _ in sorted(numbered, key=lambda m: (m[0], m[1])):
                    check.p2p(fingerprint("batch_p2p", tensor), src, dst, n, timeout_s)
            works, pairs = [], []
            grouped = self._backend.supports_coalescing  # NCCL: one group call, one backend work
            if grouped:
                self._backend._start_coalescing(self._device)
            try:
                for _, _, kind, tensor, peer in numbered:
                    work = (self._ops.send if kind == "send" else self._ops.recv)([wire(tensor)], peer, 0)
                    if work.__class__ is StagedWork:
                        pairs += work.pairs
                        work = work.work
                    works.append(work)
            finally:
                both = self._backend._end_coalescing(self._device) if grouped else BackendWorks(works)
            return StagedWork(both, pairs) if self._ops is not self._backend else both

        self._batches += 1
        io = OpIO(tuple(t for k, t, _ in ops if k == "send"), tuple(t for k, t, _ in ops if k == "recv"), None, None)
        return self._run(chk, io, issue, opts=None, fp=None, timeout=timeout_s, async_op=async_op, seq=self._batches)

    # ------------------------------------------------------------- management
    def split(self, ranks: Sequence[int], name: str, *, timeout: Timeout = None,
              **hints: str) -> Optional["Communicator"]:
        """A communicator of ``ranks`` (their order is the new rank order).

        Only the listed ranks need to call it; any other rank gets ``None``.
        ``name`` must be new for this parent.
        """
        chk = self._checker("split")
        chk.name(name)
        try:
            hints = self._spec.check_hints(hints)
        except ValueError as exc:
            raise chk.fail(str(exc)) from None
        ranks = chk.rank_list(ranks, "ranks")
        if name in self._splits:
            raise chk.fail(f"a split named {name!r} was already made from this communicator")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)
        self.lifecycle.ensure_usable("split", self._seq)
        self._splits.add(name)
        if self._rank not in ranks:
            return None
        parent = self.global_ranks
        child = Communicator(
            self._spec, self._device, name=name, store=dist.PrefixStore(f"split/{name}/", self._store),
            rank=ranks.index(self._rank), size=len(ranks), timeout_s=timeout_s,
            hints={**self._hints, **hints}, check=self._check is not None,
            uid=f"{self.uid}/{name}", global_ranks=[parent[r] for r in ranks] if parent else None,
            generation=self.generation, members=[self.members[r] for r in ranks], parent=self,
        )
        self.lifecycle.adopt(child.lifecycle, ranks)
        return child

    def abort(self) -> None:
        """Stop using the group now: later ops raise ``CommAborted``. Idempotent, never raises."""
        if self.lifecycle.close(State.ABORTED):
            backends.BackendSpec.abort(self._backend)

    def finalize(self) -> None:
        """Release the group after normal use. Idempotent, never raises."""
        if self.lifecycle.close(State.FINALIZED):
            backends.BackendSpec.shutdown(self._backend)

    # --------------------------------------------------------------- recovery
    def shrink(self, *, timeout: Timeout = None, min_size: int = 1) -> "Communicator":
        """The survivors' communicator, as the next generation; every survivor calls it.

        The lost ranks are those this rank's monitor or a failed op named
        (``lost_ranks``) together with what the other survivors name; the
        survivors agree through the store (commslayer.membership) and keep
        their order. A rank that the others counted as lost gets
        ``CommAborted`` (fenced). This communicator is closed afterwards, and
        so are the communicators split from it: split the new one again.
        On a communicator closed already (aborted, finalized, replaced,
        fenced) it raises ``CommAborted`` at once, before the store is touched.
        """
        chk = self._checker("shrink")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)
        self._check_resizable(chk)
        return self.lifecycle.shrink(timeout_s, min_size, self._next_generation)

    def reconfigure(self, members: Sequence[int]) -> "Communicator":
        """The next generation with exactly ``members`` (member ids, in the new rank order).

        torchcomms' ``reconfigure``: every current member that stays calls it,
        and so does every joiner (``commslayer.join``); the first list to reach
        the store wins and everyone adopts it. Use it to grow back after a
        shrink: ``comm.reconfigure(comm.members + comm.pending_members())``.
        """
        chk = self._checker("reconfigure")
        self._check_resizable(chk)
        return self.lifecycle.reconfigure(chk.member_ids(members), self._next_generation)

    def pending_members(self, *, timeout: Timeout = None) -> List[int]:
        """Member ids that announced themselves (``commslayer.join``) and are not in
        yet; the same list on every member (a collective: every member calls it).

        Rank 0 reads the announcements on a thread of its own while this is being
        called and shares what it last saw over the backend: one small collective,
        no store request, while nobody is waiting (commslayer.membership). Raises
        ``StoreUnreachable`` on every member once rank 0's read got no answer.
        """
        chk = self._checker("pending_members")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)
        self._check_resizable(chk)
        return self.lifecycle.pending(timeout_s, lambda values, t: self._agree(chk, values, t, smallest=False))

    def should_commit(self, ok: bool = True, *, timeout: Timeout = None) -> bool:
        """Whether every member's part of a step succeeded: the same answer on every member.

        A collective that every member calls once per step, after the step's
        last op and before applying its result (torchft's ``should_commit``).
        ``ok=False`` (this member's part failed) or a member lost before it
        voted makes it ``False`` everywhere; then shrink and redo the step. A
        member that voted yes and died afterwards does not undo a commit. On a
        communicator already broken by a loss it returns ``False`` (after
        casting that vote). Raises ``CollectiveTimeout`` when a member neither
        votes nor is found lost within the timeout, ``StoreUnreachable`` when the
        store does not answer (``COMMSLAYER_STORE_TIMEOUT_S``); either breaks the
        communicator. The votes are tallied over the backend: a step that every
        member votes for costs one small all-reduce and no store request; the
        store settles a round only once something failed (commslayer.membership).
        """
        chk = self._checker("should_commit")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)
        self._check_resizable(chk)
        return self.lifecycle.vote(ok, timeout_s, lambda yes, t: self._agree(chk, [int(yes)], t, smallest=True)[0] == 1)

    def _agree(self, chk: Checker, values: List[int], timeout_s: float, *, smallest: bool) -> List[int]:
        """``values`` (as many on every member) as every member gets them, over the backend:
        each the smallest of the members' (an all-reduce), else rank 0's (a broadcast).
        Recorded and hooked as op ``chk.op``, like any collective."""
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        if smallest:
            opts = self._options.get(c10d.AllreduceOptions, ReduceOp.MIN)
            io, issue = OpIO((t,), (t,), ReduceOp.MIN, None), lambda: self._ops.allreduce([t], opts)
        else:
            opts = self._options.get(c10d.BroadcastOptions, root=0)
            io, issue = OpIO((t,), (t,), None, 0), lambda: self._ops.broadcast([t], opts)
        self._run(chk, io, issue, opts=opts, fp=None, timeout=timeout_s, async_op=False)
        return [int(v) for v in t.tolist()]

    def _check_resizable(self, chk: Checker) -> None:
        if self.lifecycle.resizable() is None:
            raise chk.fail("only a communicator made by new_comm or join (not a split or a c10d group) "
                           "can change its membership; rebuild splits from the new generation")

    def _next_generation(self, generation: int, members: List[int]) -> "Communicator":
        """Build generation ``generation`` of this communicator, with ``members`` (decided)."""
        lineage = self.lifecycle.lineage
        assert lineage is not None  # _check_resizable
        me = self.members[self._rank]
        return Communicator(
            self._spec, self._device, name=self._name, store=lineage.store_for(generation),
            rank=members.index(me), size=len(members), timeout_s=self._timeout_s, hints=self._hints,
            check=self._check is not None, uid=lineage.uid_for(generation),
            global_ranks=members if self.global_ranks is not None else None,
            lineage=lineage, generation=generation, members=members,
        )

    def _release(self) -> None:
        """The lifecycle retired this generation: let go of the backend."""
        if self._process_group is None:  # a c10d group still refers to it otherwise
            # Dropping the last reference closes the group's connections (the
            # watchdog holds it instead while one of its ops still runs).
            self._take_direct_path(None)  # the native one holds the backend too
            self._spec.release(self._backend)
            self._backend = self._ops = backends.Released()

    def _stop_waiter(self) -> None:
        for thread in (self._waiter_thread, self._ring_thread):
            if thread is not None:
                thread.stop()

    def _waiter(self) -> Waiter:
        if self._waiter_thread is None:
            self._waiter_thread = Waiter(f"{self._name}@g{self.generation}")
        return self._waiter_thread

    def _ringer(self) -> Waiter:
        if self._ring_thread is None:
            self._ring_thread = Waiter(f"ring-{self._name}@g{self.generation}")
        return self._ring_thread

    def _orphaned(self, c10d_work: Any) -> None:
        """An op failed while the backend still runs it: keep the backend until it ends."""
        WATCHDOG.bury(self._backend, c10d_work)

    def as_process_group(self) -> dist.ProcessGroup:
        """This communicator as a named c10d ``ProcessGroup`` (for ``DeviceMesh.from_group``)."""
        if self._process_group is None:
            from .c10d import register_communicator

            self._process_group = register_communicator(self)
        return self._process_group

    # ---------------------------------------------------------------- machinery
    def _set_timeout_s(self, timeout_s: float) -> None:
        """The deadline of every op that names none, and the direct path's option
        structs that carry it (its own: ``_options``' structs take each op's deadline)."""
        self._timeout_s = timeout_s
        structs = Options()
        self._direct_td = structs.timedelta(timeout_s)
        self._direct_opts = tuple(
            structs.get(cls, op) for cls, op in ((c10d.AllreduceOptions, ReduceOp.SUM), (c10d.AllgatherOptions, None),
                                                 (c10d.ReduceScatterOptions, ReduceOp.SUM)))
        for opts in self._direct_opts:
            structs.deadline(opts, timeout_s)
        if self._native is not None:
            self._native.set_timeout(*self._native_waits())

    def _native_waits(self) -> Tuple[timedelta, timedelta]:
        """The native direct path's deadline, and how long its wait blocks before
        Python looks again: the deadline, or a slice where a liveness monitor may
        break the communicator meanwhile (``Work.wait_issued``'s)."""
        return self._direct_td, WAIT_SLICE if self.lifecycle.watched else self._direct_td

    def _take_direct_path(self, path: Any) -> None:
        """Run the direct path's checks and ops in native code through ``path`` (a
        ``DirectPath``, commslayer.native), or in Python (None)."""
        self._native = path
        self._native_records = False
        if path is None:
            direct = Checker(self._name, "direct", self._rank, self._size, self._spec.device_type,
                             self._spec.dtypes)
            self._dense, self._dense_sized = direct.fits, direct.fits_sized
        else:
            self._dense, self._dense_sized = path.fits, path.fits_sized

    def record_natively(self, ring: Any) -> None:
        """The flight recorder's call: the native direct path writes its ops' records
        into ``ring`` (a ``NativeRing``, commslayer/direct_path.cpp); None: every op
        asks the recorder for a record (``OpRecorder.scheduled``)."""
        if self._native is not None:
            self._native.record_into(ring)
            self._native_records = ring is not None

    def _update_direct(self) -> None:
        """Whether the direct path (``_direct_run``) is open: only while no hook
        observes this communicator's ops, check mode is off and writes are not isolated."""
        self._direct = self._check is None and self._ops is self._backend and not (
            self._pre.fns or self._checks.fns or self._post.fns or self.completion_hooks.fns)

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
        caches (docs/benchmarks.md, "The direct path").  Where it is built, the
        issue and the wait run in native code (``DirectPath.run``)."""
        op = DIRECT_OPS[kind]
        self._seq = seq = self._seq + 1
        op_id = next(_op_ids)
        timeout_s = self._timeout_s
        recorder = self.recorder
        in_native = self._native is not None
        # The native path writes the op's record itself (record_natively), unless the
        # op is refused: a Python record says why.
        record = None if recorder is None or self._native_records and self.lifecycle.clean else recorder.scheduled(
            self, op, op_id, seq, OpIO((b,), (a,), reduce_op, None), None, False, timeout_s)
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
                c10d_work = self._backend.allreduce([a], opts) if kind == 0 else \
                    (self._backend._allgather_base if kind == 1 else self._backend._reduce_scatter_base)(a, b, opts)
        except (RuntimeError, CommError) as exc:
            if record is None and recorder is not None:
                record = recorder.take_native(op_id)
            err = self._not_issued(exc, Work, op, seq, op_id, timeout_s, start, None, record)
            raise err from (None if err is exc else exc)
        if in_native:
            if failed is not None and record is None and recorder is not None:  # Python settles it from here
                record = recorder.take_native(op_id)
            work = Work(self, op, seq, op_id, timeout_s, start, None if failed is None else failed[0], None, None,
                        record)
            if failed is None:
                work.completed_now()
            else:
                work.wait_failed(RuntimeError(failed[1]))
            return work
        if op in self._waited_elsewhere:
            c10d_work = self._waiter().wrap(c10d_work)
        work = Work(self, op, seq, op_id, timeout_s, start, c10d_work, None, None, record)
        if record is not None:
            record.started(start)
        work.wait_issued(self._direct_td)
        return work

    def _not_issued(self, exc: Exception, work_cls: type, op: str, seq: int, op_id: int, timeout_s: float,
                    start: int, peer: Optional[int], record: Any) -> CommError:
        """The error of an op that failed before its backend work existed (refused,
        or the backend call raised), recorded as that op's outcome."""
        err = self.lifecycle.error_from(exc, op, seq, timeout_s, (time.monotonic_ns() - start) / 1e9, peer)
        failed = work_cls(self, op, seq, op_id, timeout_s, start, None, None, peer, record)
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
        op = chk.op
        work_cls = AnySourceWork if any_source else Work
        timeout_s = self._timeout_s if timeout is None else timeout_seconds(timeout, self._timeout_s, chk)
        collective = seq is None
        if seq is None:
            self._seq = seq = self._seq + 1
        op_id = next(_op_ids)
        recorder = self.recorder
        record = None if recorder is None else recorder.scheduled(
            self, op, op_id, seq, io, peer, async_op, timeout_s)
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
        work = work_cls(self, op, seq, op_id, timeout_s, start, c10d_work, finish, peer, record)
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
