"""The lifecycle of one communicator generation: its state machine, membership and recovery.

A ``Communicator`` issues ops; its ``Lifecycle`` knows whether it may, and
what happens around it on other threads: the liveness monitor naming lost
or departed peers, the watchdog and the caller reporting failures, a shrink
or a reconfigure replacing the generation, a decision of the others fencing
this rank out, a parent closing the communicators split from it.  It also
turns a backend's exception into the ``CommError`` an op raises
(``error_from``), because only it knows which peers were lost meanwhile.

State is a ``State`` plus a reason, changed under one lock (``_move``), along
the transitions in ``TRANSITIONS``; a move that the table does not allow
raises ``CommAborted`` naming the state it found.  The events that may race
(a failure, ``abort``, ``finalize``, a retirement) check and move in one step,
so each happens once: the error hooks run on the first failure only, whatever
thread reported it.  Hooks, the store, the monitor and the owner's backend
are called after the lock is let go, never under it.

What every generation of one communicator shares is its ``Lineage`` (the root
store, the uid, the ``Membership`` keys, liveness timing); generation g+1 is
decided through the store (commslayer.agree.membership) and built by the owner.
A generation also keeps the commit round this member committed on the
backend's tally alone, and writes it into the store once anything fails,
before the membership changes and before a goodbye (``confirm_commit``).
"""

from __future__ import annotations

import enum
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch.distributed as dist

from commslayer import config
from commslayer.detect.addresses import rank_hosts
from commslayer.comm.backends import classify
from commslayer.errors import (CollectiveMismatch, CollectiveTimeout, CommAborted, CommError, PeerLost,
                               StoreUnreachable, backend_words)
from commslayer.hooks import Hooks
from commslayer.detect.liveness import Liveness
from commslayer.agree.membership import Membership

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator


class State(enum.Enum):
    """Where a communicator generation stands (``Lifecycle.state``)."""

    ACTIVE = "active"        # ops run
    BROKEN = "broken"        # a failure broke it: ops raise that failure; shrink or close it
    SHRINKING = "shrinking"  # its shrink is agreeing on the next generation: closed to ops
    REPLACED = "replaced"    # a later generation replaced it (shrink, reconfigure, or its parent's)
    FENCED = "fenced"        # the others went on without this rank
    ABORTED = "aborted"      # abort(), or a shrink that failed
    FINALIZED = "finalized"  # finalize()


OPEN: FrozenSet[State] = frozenset({State.ACTIVE, State.BROKEN})
GOODBYE_CONFIRM_S = 2.0  # how long a goodbye waits for the last round's confirmation to reach the store
# A timed-out collective looks for what the others timed out in for a tenth of the time it waited,
# within these bounds: their ops start a little apart, so they time out a little apart.
MISMATCH_LOOK_S = 2.0
MISMATCH_MIN_S = 0.2
# A vote's tally is one int64, the least of the members' (``vote``): YES plus the count of
# joiners plus one (-1, the store did not answer, is 0), or NOT_COUNTED from a member that
# does not count them; without YES, a no.
YES = 1 << 62
NOT_COUNTED = YES - 1

# The legal moves; every other one raises CommAborted naming the state.
TRANSITIONS: Dict[State, FrozenSet[State]] = {
    State.ACTIVE: frozenset({State.BROKEN, State.SHRINKING, State.REPLACED, State.FENCED, State.ABORTED,
                             State.FINALIZED}),
    State.BROKEN: frozenset({State.SHRINKING, State.REPLACED, State.FENCED, State.ABORTED, State.FINALIZED}),
    State.SHRINKING: frozenset({State.REPLACED, State.FENCED, State.ABORTED}),
    State.REPLACED: frozenset(),
    State.FENCED: frozenset(),
    State.ABORTED: frozenset(),
    State.FINALIZED: frozenset(),
}


# Every lifecycle of this process, for a forked child to close (_close_in_forked_child).
_lifecycles: "weakref.WeakSet[Lifecycle]" = weakref.WeakSet()


def _close_in_forked_child() -> None:
    """A forked child (a DataLoader worker, say) copies the communicators but none of
    the threads that move their ops (Gloo's, the liveness monitor's): an op there
    would wait out its deadline.  So in the child each one is closed, and an op
    says why at once."""
    parent = os.getppid()
    for lifecycle in list(_lifecycles):
        lifecycle.close_in_child(parent)


os.register_at_fork(after_in_child=_close_in_forked_child)


@dataclass
class Lineage:
    """What every generation of one communicator shares (``new_comm`` makes it)."""

    root_store: dist.Store  # bounded (commslayer.agree.store); generation g > 0 lives under its prefix "g<g>/"
    base_uid: str
    membership: Membership
    heartbeat_s: float  # 0: no liveness monitor
    peer_timeout_s: float
    isolate: bool  # write isolation (commslayer.comm.isolation)
    resizable: bool = True  # False for a c10d group: watched, but its membership is fixed
    asks_joiners: bool = False  # pending_members was called: each vote's tally carries the leader's count of joiners

    def store_for(self, generation: int) -> dist.Store:
        """The store of ``generation`` (the root store's prefix ``g<g>/`` after generation 0)."""
        return self.root_store if generation == 0 else dist.PrefixStore(f"g{generation}/", self.root_store)

    def uid_for(self, generation: int) -> str:
        """The uid of ``generation``: the same on every member, unique in the job."""
        return self.base_uid if generation == 0 else f"{self.base_uid}@g{generation}"


def watched_lineage(store: dist.Store, uid: str, name: str) -> Lineage:
    """The lineage of a communicator whose membership is fixed (a c10d group): its
    members watch each other (``COMMSLAYER_HEARTBEAT_S``), nothing more."""
    return Lineage(store, uid, Membership(store, name, blocking_waits=False), *config.liveness_timing(), isolate=False,
                   resizable=False)


def in_child(ranks: Set[int], child_ranks: List[int]) -> Set[int]:
    """Which of ``ranks`` (of a parent) belong to a split over ``child_ranks``, as its ranks."""
    return {child_ranks.index(r) for r in ranks if r in child_ranks}


class Lifecycle:
    """The state machine and membership of one communicator generation (its ``lifecycle``).

    ``owner`` is the communicator (held weakly); when a closing move lets go of
    the group the lifecycle calls its ``_stop_waiter`` and ``_release``.
    """

    def __init__(self, owner: "Communicator", *, name: str, rank: int, size: int, lineage: Optional[Lineage],
                 generation: int, members: List[int], parent: Optional["Lifecycle"] = None) -> None:
        self._owner = weakref.ref(owner)
        self._name = name
        self._rank = rank
        self._size = size
        # A split shares its parent's lineage (timing, isolation) but cannot change membership.
        self.lineage: Optional[Lineage] = lineage if parent is None else parent.lineage
        self.is_split = parent is not None
        self.generation = generation  # bumped by recovery when the membership changes
        self.members = members  # member ids, in rank order
        self._lock = threading.Lock()
        self.state = State.ACTIVE
        self.reason = ""  # why it left ACTIVE (the text ``describe`` shows once closed)
        self.failure: Optional[CommError] = None  # the first failure, once BROKEN
        self.clean = True  # ACTIVE and nobody departed: the op path's one check
        self.lost_ranks: Set[int] = set()  # ranks the liveness monitor (or a failed op) named as lost
        self.departed: Dict[int, float] = {}  # rank -> when it closed the group on purpose (monotonic)
        self.error_hooks = Hooks("error")
        self.abort_hooks = Hooks("abort")
        self._children: List[Tuple["weakref.ReferenceType[Lifecycle]", List[int]]] = []
        self._liveness: Optional[Liveness] = None
        self.watched: bool = parent is not None and parent.watched  # a liveness monitor covers this group
        self._commits = 0  # should_commit rounds of this generation
        self._unconfirmed: Optional[int] = None  # a round this member committed on the tally alone
        self._joiners_at_vote: Optional[int] = None  # the leader's count of joiners in the last committed tally
        self._confirm_lock = threading.Lock()
        _lifecycles.add(self)

    # ------------------------------------------------------------------ state
    def describe(self) -> str:
        """"ok", "broken: <first failure>", or why it was closed ("aborted", "finalized",
        "replaced by generation 2 (members [...])", "fenced out of generation 2: ...")."""
        state = self.state
        if state is State.ACTIVE:
            return "ok"
        if state is State.BROKEN:
            first = self.failure
            return f"broken: {type(first).__name__}: {first.what}" if first is not None else "broken"
        return self.reason

    def close_in_child(self, parent: int) -> None:
        """This process is a forked child of ``parent``, which owns the communicator:
        close it here, without hooks (they would write the parent's trace files)."""
        self._lock, self._confirm_lock = threading.Lock(), threading.Lock()  # a parent's thread may have held them
        if self.state in OPEN:
            self.state = State.ABORTED
            self.reason = (f"closed in this forked child (pid {os.getpid()}): the communicator belongs to process "
                           f"{parent}, and its ops need threads a fork does not copy; a child process makes "
                           "communicators of its own")
            self._unclean()

    @property
    def closed(self) -> bool:
        """Whether ops are refused for good (any state but ACTIVE and BROKEN)."""
        return self.state not in OPEN

    def _move(self, to: State, reason: str, op: Optional[str] = None) -> None:
        """Move to ``to`` (the lock is held); ``CommAborted`` naming the state if the table forbids it."""
        if to not in TRANSITIONS[self.state]:
            if self.state in OPEN:
                raise CommAborted(f"communicator is {self.state.value}: it cannot become {to.value}",
                                  comm=self._name, op=op)
            raise CommAborted(f"communicator was {self.describe()}", comm=self._name, op=op)
        self.state = to
        self.reason = reason
        self._unclean()

    def _unclean(self) -> None:
        """Ops check the group from now on; and c10d's async ops, which the
        native path issues without Python, no longer take it (``DirectPath.set_open``)."""
        self.clean = False
        native = getattr(self._owner(), "_native", None)
        if native is not None:
            native.set_open(False)

    def fail(self, err: CommError) -> bool:
        """The first failure breaks an ACTIVE communicator and runs the error hooks (once,
        whichever thread reports it); any later one, or one after it closed, is ignored."""
        with self._lock:
            if self.state is not State.ACTIVE:
                return False
            self.failure = err
            self._move(State.BROKEN, "")
        if self._unconfirmed is not None:  # a member unsure of that round may wait for it: not on this thread
            self.confirm_in_background()
        self.error_hooks(err)
        return True

    def mismatched(self, err: CollectiveTimeout) -> CommError:
        """``err``, a collective of this generation that timed out, or ``CollectiveMismatch``
        once another member timed out at the same sequence number in a different op.

        A collective that only some ranks call (``dist.barrier()`` on rank 0 alone, say)
        pairs with a different op on the others, and every later op is shifted by one,
        so each side waits until its timeout.  That is a bug in the script, and a restart
        would repeat it; a plain timeout would be taken for a lost peer.  So on a timeout,
        and only then, each member writes its op into the store and reads the others'
        for a moment; nothing changes on an op that completes."""
        lineage, seq, op = self.lineage, err.seq, err.op
        if lineage is None or seq is None or op is None or self._size < 2:
            return err
        base = f"timed-out/{lineage.uid_for(self.generation)}/{self._name}/{seq}/"  # unique in the job
        others = {r: f"{base}{r}" for r in range(self._size) if r != self._rank}
        try:
            store = lineage.store_for(self.generation)
            store.set(f"{base}{self._rank}", op)
            deadline = time.monotonic() + min(MISMATCH_LOOK_S, max(MISMATCH_MIN_S, (err.elapsed_s or 0.0) / 10))
            while not store.check(list(others.values())) and time.monotonic() < deadline:
                time.sleep(0.02)
            theirs = {r: store.get(k).decode() for r, k in others.items() if store.check([k])}
        except (CommError, RuntimeError):  # a store that fails (it is bounded) leaves the timeout as it was
            return err
        differ = {r: o for r, o in theirs.items() if o != op}
        if not differ:
            return err
        told = ", ".join(f"rank {r} in {o} #{seq}" for r, o in sorted(differ.items()))
        return CollectiveMismatch(
            f"timed out in {op} #{seq} while {told} timed out: the ranks called different collectives at this "
            "point (a collective that only some ranks call shifts every later one); every rank must call the "
            "same collectives in the same order", comm=self._name, op=op, seq=seq, timeout_s=err.timeout_s,
            elapsed_s=err.elapsed_s, ranks=differ)

    def close(self, to: State) -> bool:
        """``abort`` (``to`` ABORTED) or ``finalize`` (FINALIZED): True for the call that
        closed it, False (nothing done) once it is closed already."""
        with self._lock:
            if self.state not in OPEN:
                return False
            self._move(to, to.value)
        if to is State.ABORTED:  # now: a member unsure of the last round takes this one as gone
            self._unconfirmed = None
        self.stop_watching()
        if to is State.ABORTED:
            self.abort_hooks()
        return True

    def retire(self, to: State, why: str, *, stop_watching: bool = True, op: Optional[str] = None) -> bool:
        """Close this generation as ``to`` (SHRINKING, REPLACED, FENCED, or ABORTED after a
        failed shrink), and the communicators split from it. With ``op`` an illegal move
        raises ``CommAborted`` (a caller's request); without, it is skipped (False)."""
        with self._lock:
            first = self.state in OPEN
            try:
                self._move(to, why, op)
            except CommAborted:
                if op is not None:
                    raise
                return False
        for child, _ in self.live_children():
            child.retire(to, f"split from {self._name!r} generation {self.generation}, which was {why}; "
                             f"split the new generation again")
        if first:
            if stop_watching:
                self.stop_watching()
            self.abort_hooks()
            owner = self._owner()
            if owner is not None:
                owner._release()
        return True

    def refuse_closed(self, op: str, seq: Optional[int] = None) -> None:
        """``CommAborted`` naming why, once closed (aborted, finalized, replaced by a later
        generation, fenced out). Membership changes call it before touching the store:
        the keys of the next generation may be live already, and a stale caller would
        join the live generation's rendezvous."""
        if self.state not in OPEN:
            raise CommAborted(f"communicator was {self.describe()}", comm=self._name, op=op, seq=seq)

    def ensure_usable(self, op: str, seq: int, peer: Optional[int] = None) -> None:
        """Raise unless ``op`` can run: a point-to-point op with ``peer`` needs only that
        member; a collective needs every one."""
        if self.departed:
            self.departure_matters(0.0, None if peer is None else {peer})
        self.refuse_closed(op, seq)
        first = self.failure
        if first is not None:
            raise type(first)(
                f"communicator is broken by an earlier failure ({first.op} #{first.seq}: {first.what})",
                comm=self._name, op=op, seq=seq, ranks=first.ranks,
            )

    def interruption(self, op: str, seq: Optional[int], timeout_s: Optional[float] = None,
                     elapsed_s: Optional[float] = None) -> Optional[CommError]:
        """The error a wait inside ``op`` ends with once this communicator is broken
        or closed (None while it is usable)."""
        if self.departed:  # a member that finished its part may leave while this op completes
            self.departure_matters(self.lineage.peer_timeout_s if self.lineage is not None else 0.0)
        first = self.failure
        if first is None and self.state in OPEN:
            return None
        if first is None:
            return CommAborted(f"communicator was {self.describe()}", comm=self._name, op=op, seq=seq,
                               timeout_s=timeout_s, elapsed_s=elapsed_s)
        return type(first)(f"interrupted: {first.what}", comm=self._name, op=op, seq=seq,
                           timeout_s=timeout_s, elapsed_s=elapsed_s, ranks=first.ranks)

    # ------------------------------------------------------------- membership
    def shrink(self, timeout_s: float, min_size: int,
               build: Callable[[int, List[int]], "Communicator"]) -> "Communicator":
        """Agree with the other survivors on the next generation and ``build`` it (see
        ``Communicator.shrink``)."""
        lineage = self._resizable()
        self.confirm_commit()
        # Close this generation's backend first: a survivor still blocked inside it on this
        # group (Gloo's reduce-scatter waits in the caller) is let go at once. The liveness
        # monitor keeps watching until the agreement is over, so that a member that dies
        # during it is a suspect at once rather than after the whole join window.
        self.retire(State.SHRINKING, "being shrunk after a loss", stop_watching=False, op="shrink")
        generation = self.generation + 1
        began = time.monotonic()

        def suspects() -> Set[int]:
            # Members that say goodbye during the agreement are not suspects: the others close
            # this generation on purpose once they agreed. One that left before this rank began
            # (sys.exit, finalize) will not join: a suspect at once, not after the join window.
            # (Had it left because it agreed already, the decision exists and suspects do not count.)
            with self._lock:
                return ({self.members[r] for r in self.lost_ranks if r not in self.departed}
                        | {self.members[r] for r, t in self.departed.items() if t < began})

        try:
            members = lineage.membership.agree_after_loss(
                generation, self.members, self.members[self._rank], suspects,
                join_window_s=lineage.peer_timeout_s, timeout_s=timeout_s, min_size=min_size)
            return self.next_generation(generation, members, build)
        except CommError as err:
            self.retire(State.ABORTED, f"closed by a shrink that failed ({type(err).__name__}: {err.what})")
            raise
        finally:
            self.stop_watching()

    def reconfigure(self, members: List[int], build: Callable[[int, List[int]], "Communicator"]) -> "Communicator":
        """The next generation with ``members`` (the first list to reach the store wins)."""
        lineage = self._resizable()
        self.confirm_commit()
        self.refuse_closed("reconfigure")
        generation = self.generation + 1
        decided = lineage.membership.agree_on(generation, members, self.members[self._rank], self.members)
        return self.next_generation(generation, decided, build)

    def next_generation(self, generation: int, members: List[int],
                        build: Callable[[int, List[int]], "Communicator"]) -> "Communicator":
        """``build`` the decided generation, then retire this one as REPLACED."""
        nxt = build(generation, members)
        self.retire(State.REPLACED, f"replaced by generation {generation} (members {members})")
        return nxt

    def pending(self, timeout_s: float, share: Callable[[List[int], float], List[int]]) -> List[int]:
        """Joiners not in yet, the same list on every member (``Communicator.pending_members``):
        the leader's view (``Membership.joiners``), which ``share(values, timeout_s)``
        hands to every member over the backend, first their number (-1: the leader
        could not reach the store), then, if any, the joiners. Where the last vote's
        committed tally counted none (``vote``), every member has that same count
        and returns no joiner with no collective."""
        lineage = self._resizable()
        self.refuse_closed("pending_members")
        lineage.asks_joiners = True
        counted, self._joiners_at_vote = self._joiners_at_vote, None
        if counted == 0 and self.failure is None:
            return []
        membership = lineage.membership
        seen: List[int] = []
        failure: Optional[CommError] = None
        leader = self._rank == 0
        try:
            if leader:
                try:
                    if counted is None:
                        seen = membership.joiners(self.members, fresh=False)
                    if seen or counted is not None:  # seen a moment ago, or counted: read again before anyone acts
                        seen = membership.joiners(self.members)
                except StoreUnreachable as err:
                    failure = err
            count = share([-1 if failure is not None else len(seen)], timeout_s)[0]
            if count < 0:
                if failure is not None:
                    raise failure
                raise StoreUnreachable(f"the store at {membership.store_address} did not answer the leader's "
                                       f"(member {self.members[0]}'s) read of the joiners", comm=self._name,
                                       op="pending_members")
            return share(seen if leader else [0] * count, timeout_s) if count else []
        except StoreUnreachable as err:  # no member can be let in, and no step committed, any more
            self.fail(err)
            raise

    def vote(self, ok: bool, timeout_s: float, tally: Callable[[List[int], float], List[int]]) -> bool:
        """This member's ``should_commit`` vote; the outcome every member gets (the protocol:
        commslayer.agree.membership). ``tally(values, timeout_s)``: the least of each of
        ``values`` over the members, over the backend; it raises ``CommError`` when it
        fails. The one value holds the vote (``YES`` or not) and, once
        ``pending_members`` is asked on this communicator, the leader's count of
        joiners (``NOT_COUNTED`` from the others): a committed tally that counted none
        spares the next ``pending_members`` its collective. One int64, not two: a Gloo
        all-reduce of two takes a fifth to a quarter longer at 4 ranks, docs/bench/step-cost.md."""
        lineage = self._resizable()
        self.refuse_closed("should_commit")
        self._joiners_at_vote = None
        self._commits += 1
        call = self._commits
        membership = lineage.membership
        generation = self.generation
        began = time.monotonic()
        try:
            if not self.watched:
                return membership.vote(generation, call, self._size, ok and self.failure is None,
                                       lambda: self.interruption("should_commit", call), timeout_s)
            if self.failure is not None:  # it cannot take part in the tally, so nobody's ends
                return membership.settle(generation, call, "abort")
            if not ok:
                membership.settle(generation, call, "abort")
            try:
                counted = self._count_joiners(lineage)
                mine = (YES if ok else 0) + (NOT_COUNTED if counted is None else counted + 1)
                [least] = tally([mine], timeout_s)
                everyone = least >= YES
            except CommAborted:
                raise
            except CommError:
                if not ok:
                    return False
                me = self.members[self._rank]
                left = max(timeout_s - (time.monotonic() - began), lineage.peer_timeout_s)
                return membership.unsure(generation, call, me, self.members, self._gone,
                                         lambda: self.refuse_closed("should_commit"), left)
            if not ok:
                return False
            if everyone:
                self._unconfirmed = call
                self._joiners_at_vote = None if least - YES == NOT_COUNTED else least - YES - 1  # ``mine``'s
                if self.failure is not None:  # it broke during the tally: ``fail`` may have missed this round
                    self.confirm_commit()
                    self.refuse_closed("should_commit")  # fenced: the others aborted it
                return True
            return membership.settle(generation, call, "abort")
        except (CollectiveTimeout, StoreUnreachable) as err:  # no step can commit on this communicator any more
            self.fail(err)
            raise

    def _count_joiners(self, lineage: Lineage) -> Optional[int]:
        """The count of joiners this member puts on a vote's tally: the leader's, once
        ``pending_members`` is asked, from its background read (-1: the store did not
        answer); None from the others."""
        if self._rank != 0 or not lineage.asks_joiners:
            return None
        try:
            return len(lineage.membership.joiners(self.members, fresh=False))
        except StoreUnreachable:
            return -1

    def left_members(self) -> Set[int]:
        """Members that closed the group on purpose (said goodbye), lost since or not."""
        with self._lock:
            return {self.members[r] for r in self.departed}

    def _gone(self) -> Set[int]:
        """Members lost, or that left (after settling what they knew: ``confirm_commit``)."""
        with self._lock:
            return {self.members[r] for r in self.lost_ranks | set(self.departed)}

    def confirm_commit(self) -> None:
        """Write the round this member committed on the tally alone as committed, where a
        member unsure of it looks; if the others settled it as aborted meanwhile (they
        went on without this member), this member is fenced out."""
        with self._confirm_lock:
            call = self._unconfirmed
            if call is None:
                return
            lineage = self._resizable()
            committed = lineage.membership.settle(self.generation, call, "commit")
            self._unconfirmed = None
        if not committed:
            self.retire(State.FENCED, f"fenced out: the others aborted commit round {call} of generation "
                                      f"{self.generation}, which this member had committed")

    def confirm_in_background(self) -> threading.Thread:
        """``confirm_commit`` on a thread of its own (started); a store failure it meets
        is left to whoever needs the outcome."""
        def confirm() -> None:
            try:
                self.confirm_commit()
            except CommError:
                pass

        thread = threading.Thread(target=confirm, name=f"commslayer-confirm-{self._name}", daemon=True)
        thread.start()
        return thread

    def resizable(self) -> Optional[Lineage]:
        """The lineage, if this communicator may change its membership (made by new_comm
        or join, not a split or a c10d group); the membership methods need it."""
        lineage = self.lineage
        return lineage if lineage is not None and not self.is_split and lineage.resizable else None

    def _resizable(self) -> Lineage:
        lineage = self.resizable()
        assert lineage is not None, "Communicator checks resizable() first"
        return lineage

    # ---------------------------------------------------------------- children
    def adopt(self, child: "Lifecycle", ranks: List[int]) -> None:
        """``child`` was split from this communicator over ``ranks``; it learns what was lost."""
        self._children.append((weakref.ref(child), list(ranks)))
        with self._lock:
            lost = in_child(self.lost_ranks, ranks)
        if lost:
            child.peers_lost(lost, "lost before the split")

    def live_children(self) -> List[Tuple["Lifecycle", List[int]]]:
        """The lifecycles split from this one that still exist, with the ranks
        (of this one) they were split over."""
        return [(child, ranks) for ref, ranks in self._children if (child := ref()) is not None]

    # ---------------------------------------------------------------- liveness
    def watch(self, store: dist.Store, connect_timeout_s: float) -> None:
        """Start the liveness monitor of a root communicator of more than one member."""
        lineage = self.lineage
        if self.is_split or lineage is None or lineage.heartbeat_s <= 0 or self._size <= 1:
            return
        ref = weakref.ref(self)

        def on_lost(ranks: Set[int], why: str) -> None:
            life = ref()
            if life is not None:
                life.peers_lost(ranks, why)

        def on_left(ranks: Set[int]) -> None:
            life = ref()
            if life is not None and not life.check_fenced():
                life.peers_left(ranks)

        def before_goodbye() -> None:  # a member unsure of the last round waits for what this one knows
            life = ref()
            if life is not None and life._unconfirmed is not None:
                # bounded: a process must not hang at its exit on a store that stopped answering
                life.confirm_in_background().join(GOODBYE_CONFIRM_S)

        self._liveness = Liveness(store, self._rank, self._size, heartbeat_s=lineage.heartbeat_s,
                                  peer_timeout_s=lineage.peer_timeout_s, connect_timeout_s=connect_timeout_s,
                                  on_lost=on_lost, on_left=on_left, before_goodbye=before_goodbye,
                                  label=f"{self._name}@g{self.generation}",
                                  watch_peers=config.watch_peers(), mesh_max=config.full_mesh_max(),
                                  hosts=rank_hosts(self.members))
        self.watched = True

    @property
    def monitor(self) -> Optional[Liveness]:
        """This generation's liveness monitor (None when it has none)."""
        return self._liveness

    def stop_watching(self) -> None:
        """Close the liveness monitor and the owner's waiter thread."""
        if self._liveness is not None:
            self._liveness.close()
        owner = self._owner()
        if owner is not None:
            owner._stop_waiter()

    def check_fenced(self) -> bool:
        """Peers left or vanished: if they went on without this rank, it is fenced (True)."""
        if self.lineage is None:
            return False
        try:
            decided = self.lineage.membership.decided(self.generation + 1)
        except Exception:  # the store is gone too: nothing to learn from it
            return False
        if decided is None or self.members[self._rank] in decided:
            return False
        self.retire(State.FENCED, f"fenced out of generation {self.generation + 1}: the others went on with "
                                  f"members {decided}")
        return True

    def peers_lost(self, ranks: Set[int], why: str) -> None:
        """The monitor named ``ranks`` (of this group) as lost: ops in flight and
        every later op raise ``PeerLost``; splits that contain them learn it too."""
        with self._lock:
            ranks = set(ranks) - self.lost_ranks
        if not ranks or (self._liveness is not None and self.check_fenced()):
            return
        with self._lock:
            self.lost_ranks |= ranks
        owner = self._owner()
        members = ", ".join(f"rank {r} (member {self.members[r]})" for r in sorted(ranks))
        self.fail(PeerLost(f"peer lost: {members}: {why}", comm=self._name, op="liveness",
                           seq=None if owner is None else owner._seq, ranks=ranks))
        for child, parent_ranks in self.live_children():
            child.peers_lost(in_child(ranks, parent_ranks), why)

    def peers_left(self, ranks: Set[int]) -> None:
        """Peers finalized or exited normally: nothing is wrong until an op needs them
        (``ensure_usable``, ``interruption``)."""
        now = time.monotonic()
        with self._lock:
            for r in ranks:
                self.departed.setdefault(r, now)
            if self.departed:
                self._unclean()
        for child, parent_ranks in self.live_children():
            child.peers_left(in_child(ranks, parent_ranks))

    def departure_matters(self, grace_s: float, among: Optional[Set[int]] = None) -> None:
        """Turn members (``among`` them, if given) that left at least ``grace_s`` ago into a loss."""
        if self.state is State.ACTIVE:
            now = time.monotonic()
            with self._lock:
                gone = {r for r, t in self.departed.items()
                        if now - t >= grace_s and (among is None or r in among)}
            if gone:
                self.peers_lost(gone, "it left the communicator (finalize or exit) while this rank still "
                                      "needs it")

    def error_from(self, exc: BaseException, op: str, seq: int, timeout_s: float, elapsed_s: float,
                   peer: Optional[int]) -> CommError:
        """The ``CommError`` a backend exception inside ``op`` becomes: a connection
        that dropped names the lost rank(s) once the monitor knows them."""
        if isinstance(exc, CommError):
            return exc
        cls = classify(exc)
        what = backend_words(exc)
        ranks: Tuple[int, ...] = () if peer is None else (peer,)
        if cls is PeerLost and not ranks and self.watched:
            ranks = tuple(self.await_lost_ranks())
            if ranks:
                what = f"peer lost: rank(s) {', '.join(map(str, sorted(ranks)))} (backend: {what})"
        return cls(what, comm=self._name, op=op, seq=seq, timeout_s=timeout_s, elapsed_s=elapsed_s, ranks=ranks)

    def await_lost_ranks(self) -> Set[int]:
        """The backend saw a connection drop; the monitor names the rank within
        milliseconds when its process died (give it up to one heartbeat period)."""
        heartbeat_s = self.lineage.heartbeat_s if self.lineage is not None else 0.0
        deadline = time.monotonic() + max(heartbeat_s, 0.2)
        while not self.lost_ranks and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            return set(self.lost_ranks)
