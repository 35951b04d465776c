"""The ``Communicator``: a group of ranks with deadline-bound ops, and its life.

This module holds the class, its state and membership (its ``lifecycle``,
commslayer.comm.lifecycle: the state machine, lost and departed peers, fencing,
shrink, reconfigure, votes, the liveness callbacks) and its hooks; its ops
live with their family: ``commslayer.comm.collectives``, ``commslayer.comm.p2p``,
both built on ``commslayer.comm.op_path`` (how one op is issued, and the direct
path).  After any failure the backend group is unusable (Gloo cannot cancel
an op), so the lifecycle remembers the first error and every later op raises
at once.  ``new_comm`` and ``join`` (commslayer.comm.create) build the first
communicator of a group; ``split``, ``shrink`` and ``reconfigure`` build the
others.

Names follow torchcomms, so code moves between the two.  The public surface,
one line each:

identity: ``get_rank``, ``get_size``, ``get_name``, ``get_backend``,
``get_device``, ``get_timeout``, ``set_timeout``, ``is_aborted``, ``state``,
``generation``, ``members``, ``lost_ranks``

collectives (``Collectives``): ``all_reduce``, ``all_reduce_coalesced``,
``all_gather_single``, ``all_gather``, ``all_gather_v``,
``reduce_scatter_single``, ``reduce_scatter``, ``reduce_scatter_v``,
``all_to_all_single``, ``all_to_all_v_single``, ``broadcast``, ``reduce``,
``gather``, ``gather_single``, ``scatter``, ``barrier``

point to point (``PointToPoint``): ``send``, ``recv``, ``recv_any_source``,
``batch_op_create`` (a ``BatchSendRecv``: ``send``, ``recv``, ``issue``)

hooks: ``register_pre_hook``, ``register_post_hook``,
``register_check_hook``, ``register_completion_hook``,
``register_abort_hook``, ``register_error_hook``

management: ``split``, ``abort``, ``finalize``, ``as_process_group``,
``record_natively`` (the flight recorder's), ``decline_native_async`` (the
fault injector's)

recovery: ``shrink``, ``reconfigure``, ``pending_members``, ``should_commit``
"""

from __future__ import annotations

import array
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from commslayer import config

from commslayer.comm import backends, native
from commslayer.comm.check import CrossRankCheck
from commslayer.comm.collectives import Collectives
from commslayer.errors import CommError, StoreUnreachable
from commslayer.hooks import HookHandle, Hooks, OpIO, OpRecorder, created
from commslayer.comm.isolation import IsolatedBackend
from commslayer.comm.lifecycle import Lifecycle, Lineage, State
from commslayer.comm.nan_check import NanCheckHook
from commslayer.comm.op_path import DIRECT_OPS, TALLY, settle_native_async
from commslayer.comm.p2p import PointToPoint
from commslayer.comm.process_group import register_communicator
from commslayer.reduce_op import ReduceOp
from commslayer.comm.validation import Checker, Timeout, timeout_seconds
from commslayer.comm.wire import BACKEND_OPS, Options
from commslayer.comm.work import Waiter, Work
from commslayer.detect.addresses import on_one_host


class Communicator(Collectives, PointToPoint):
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
        self._tally_buffer: Optional[Tuple["array.array[int]", torch.Tensor]] = None  # should_commit's (_tally)
        self._set_timeout_s(timeout_s)
        self._hints = hints
        self.uid = uid  # the same on every member, unique in the job
        # member i's rank in the job, where known: the default group's rank, unless the job is
        # several torchruns (COMMSLAYER_JOB_RANK, commslayer.comm.process_group.job_rank_shift)
        self.global_ranks = global_ranks
        # state, membership, recovery (commslayer.comm.lifecycle)
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
            why = "a peer is unreachable (its process is gone, or the network refuses it): " \
                if backends.unreachable(exc) else ""
            raise backends.classify(exc)(f"could not build the {spec.name} group: {why}{exc}", comm=name,
                                         op="new_comm", timeout_s=timeout_s) from exc
        isolate = life.lineage is not None and life.lineage.isolate
        self._ops = IsolatedBackend(self._backend) if isolate else self._backend  # what op closures call
        me = weakref.ref(self)  # the check must not keep its communicator alive
        self._check = CrossRankCheck(store, name, rank, size, lambda op, seq: None if (c := me()) is None else c.lifecycle.interruption(op, seq)) \
            if check else None
        self._counted = 0  # OpPath._seq
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
        self._untimed_opts = {}
        self._options = Options()
        self._barrier_opts = spec.barrier_options(self._options.timedelta(timeout_s), device)
        self.settle_lock = threading.Lock()  # shared by this communicator's Work objects
        self.completion_hooks = Hooks("completion", on_change=observed)
        self._waiter_thread: Optional[Waiter] = None
        self._ring_thread: Optional[Waiter] = None  # runs ring reduce-scatters in turn
        # the input size from which a reduce-scatter takes the ring (None: never; commslayer.comm.ring)
        algorithm = hints.get("reduce_scatter") or config.reduce_scatter_algorithm()
        self._ring_from = None if spec.name != "gloo" or algorithm == "native" else 0 if algorithm == "ring" else \
            config.ring_min_bytes(size, on_one_host(self.members, global_ranks))
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
            *self._native_waits(), settle_native_async))
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
        communicator, like any failed op (``commslayer.comm.nan_check`` is one)."""
        return self._checks.add(fn)

    def register_error_hook(self, fn: Callable[[CommError], None]) -> HookHandle:
        """``fn(error)`` runs once, on the first failure that breaks the communicator."""
        return self.lifecycle.error_hooks.add(fn)

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
        survivors agree through the store (commslayer.agree.membership) and keep
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
        no store request, while nobody is waiting (commslayer.agree.membership). Its
        count also rides on each ``should_commit`` tally from then on, so a call right
        after a committed vote that counted none costs nothing. Raises
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
        store settles a round only once something failed (commslayer.agree.membership).
        """
        chk = self._checker("should_commit")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)
        self._check_resizable(chk)
        return self.lifecycle.vote(ok, timeout_s, self._tally)

    def _tally(self, values: List[int], timeout_s: float) -> List[int]:
        """``should_commit``'s tally of the vote's ``values``: each the smallest of the
        members'.  Once a step in replica mode, so on a CPU communicator's deadline and
        while no hook observes it, it takes the direct path, in a buffer it keeps
        (docs/bench/step-cost.md); a failed tally drops the buffer, as its transfer may
        still write into it."""
        if not (self._unobserved and timeout_s == self._timeout_s and self._device.type == "cpu"):
            return self._agree(self._checker("should_commit"), values, timeout_s, smallest=True)
        held = self._tally_buffer
        if held is None:
            numbers = array.array("q", values)
            held = self._tally_buffer = (numbers, torch.frombuffer(numbers, dtype=torch.int64))
        numbers, t = held
        numbers[0], = values
        try:
            self._direct_run(TALLY, t, t, ReduceOp.MIN)
        except BaseException:
            self._tally_buffer = None
            raise
        return numbers.tolist()

    def _agree(self, chk: Checker, values: List[int], timeout_s: float, *, smallest: bool) -> List[int]:
        """``values`` (as many on every member) as every member gets them, over the backend:
        each the smallest of the members' (an all-reduce), else rank 0's (a broadcast).
        Recorded and hooked as op ``chk.op``, like any collective.  The tensor is new each
        time: a failed op's transfer may still write into it."""
        t = torch.frombuffer(array.array("q", values), dtype=torch.int64)
        if self._device.type != "cpu":
            t = t.to(self._device)
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

    def as_process_group(self) -> dist.ProcessGroup:
        """This communicator as a named c10d ``ProcessGroup`` (for ``DeviceMesh.from_group``)."""
        if self._process_group is None:
            self._process_group = register_communicator(self)
        return self._process_group
