"""Membership: who belongs to generation g+1 of a communicator, decided once, through the store.

The rule: **the store decides, first proposal wins.**  Every generation has
one decision key; a member writes it with an atomic compare-and-set, so
exactly one member list exists per generation, and every caller, whatever it
proposed, adopts that one.  A rank that is not in the decision is fenced out
of the generation (``CommAborted`` naming it) and can never take part in its
collectives: the new group is built under a prefix that carries the
generation, and only the decided ranks are in it.

Shrinking after a loss: each survivor posts that it is alive ("joined") and
what it suspects, in one append (and appends again if it suspects more).
One survivor proposes: the lowest-ranked member this survivor does not
suspect, so every survivor names the same one once their monitors agree, and
the next one takes over when the proposer is lost in turn.  The proposer
waits until every member nobody suspects has joined, or ``join_window_s`` has
passed, and writes the members that joined and that nobody suspects.  The
others wait for ``g<g>/decided``, which the proposer writes next, naming
the members the decision leaves out (a few bytes, where the member list is
O(N): N survivors reading it would move O(N^2) bytes through the store): one
request that the server answers when the key is written
(``store.WaitConnection``), or, where the store cannot do that, polls of it
(at the usual rate for 0.1 s, then ever less often); then one read of it.
A survivor costs the store three requests per decision, whatever the size
(the proposer reads the joined list, O(N) bytes; the others never do).  These rules are ``commslayer.agree.agreement``'s, written
without I/O so that the simulator runs them too; this module carries them
out on the store.  So
a rank that is alive but slow to notice the loss still gets in, and a rank
that cannot reach the store (the other side of a partition) cannot be in
any later generation: with the store outside the ranks, the side that holds
the store is the job and a minority cut off from it gets errors, never a
group of its own.  ``min_size`` refuses a decision with fewer members (the
caller gets the error, nothing is built).

Growing: a restarted or new rank announces itself (``announce``) and waits
for a decision that includes it; members see it in ``joiners`` and include it
in their next ``reconfigure``.  ``Communicator.pending_members`` asks the
leader's (rank 0's) view and shares it over the backend: the leader reads the
announcements on a thread of its own every ``JOINERS_POLL_S`` while it is
being asked, so that a step costs one small collective and no store request
(a joiner it sees is read again, fresh, before anyone acts on it); from then
on its count also rides on each vote's tally (below), and a boundary right
after a committed vote that counted none needs no collective at all.

Keys live under ``membership/`` of the communicator's root store prefix:
``g<g>/joined`` (an appended list of ``member:suspect.suspect,``),
``g<g>/decision`` (the member list), ``g<g>/decided`` (the members it left
out), ``current`` (the newest decided generation), ``wanted`` (one entry per
announcement of a joiner) and ``admitted`` (one entry per admission), so a
rank killed again after joining must announce again.

Committing a step: the last op of a step can succeed on some members and
fail on others (a ring all-reduce ends on a rank once it has every piece it
needs, while a peer that died later leaves another rank waiting), so "my op
succeeded" does not mean "the step happened everywhere".  Round ``n`` of a
generation settles it, with one outcome key ``g<g>/commit/<n>/outcome``
written by compare-and-set, so the first outcome written is everyone's:

- On a communicator with a liveness monitor, the members first tally their
  votes over the backend (``Communicator.should_commit``: an all-reduce of
  the votes, the smallest wins).  A member whose tally ends with a yes knows
  that every member voted yes: it commits with no store request, and keeps
  the round as unconfirmed.  A tally that ends with a no: its member writes
  ``abort``.  A member whose tally failed (a member was lost during it)
  cannot know whether another's ended: it appends itself to
  ``g<g>/commit/<n>/unsure`` and waits (``unsure``) for the outcome, or until
  every member is unsure or gone, when nobody can have committed: ``abort``.
  A member that committed on the tally writes ``commit`` (``settle``) as
  soon as anything fails, and before it leaves or the membership changes; if
  it finds ``abort`` there, the others went on without it, and it is fenced.
  So a fault-free step costs no store request; the store is asked only once
  something went wrong.
- Without a monitor a lost member cannot be told from a slow one, so the
  votes are counted in the store (``vote``): each member that succeeded adds
  one to ``g<g>/commit/<n>/yes``; the member that brings it to the
  generation's size writes ``commit``, a member that failed or saw a loss
  writes ``abort``.

Either way a member that dies after voting yes cannot undo a commit, and one
fenced out later cannot turn an abort into a commit.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from commslayer.agree import agreement
from commslayer.errors import CollectiveTimeout, CommError
from commslayer.agree.store import POLL_S, BoundedStore, WaitConnection, bounded, wait_for_keys

AWAIT_FAST_S = 0.1  # a survivor polling for the proposer's decision polls at the usual rate this long,
AWAIT_POLL_MAX_S = 0.05  # and then ever less often, up to this pause
JOINERS_POLL_S = 0.25  # the leader's background read of the announcements, while pending_members is called,
JOINERS_IDLE_S = 5.0  # stops this long after the last call
UNSURE_LOOK_S = 0.05  # a member unsure of a commit round looks at who else is unsure this often


def _poll(ref: "weakref.ReferenceType[Membership]") -> None:
    """The leader's background read of the joiners, until nobody asks or the membership
    is gone (the thread must not keep it, and its store, alive)."""
    while True:
        membership = ref()
        if membership is None or not membership._poll_once():
            return
        del membership
        time.sleep(JOINERS_POLL_S)


class _LookAgain(Exception):
    """A survivor's wait for the decision ends early: its view of who is lost changed."""


class Membership:
    """The membership keys of one root communicator (every generation of it)."""

    def __init__(self, store: dist.Store, name: str, blocking_waits: bool = True) -> None:
        self._name = name
        self._store: dist.Store
        self._waits: Optional[WaitConnection] = None
        if isinstance(store, BoundedStore):
            self._store = bounded(store, "membership/", store._comm, store.deadline_s)
            if blocking_waits:  # a survivor's wait for a decision blocks on the server where the store allows it
                self._waits = WaitConnection(store, "membership/")
        else:
            self._store = dist.PrefixStore("membership/", store)
        # the leader's background read of the joiners (``joiners``)
        self._poll_lock = threading.Lock()
        self._poller: Optional[threading.Thread] = None
        self._poll_seen: Optional[Tuple[Dict[int, int], Dict[int, int]]] = None
        self._poll_failure: Optional[Exception] = None
        self._asked = 0.0

    @property
    def waits(self) -> Optional[WaitConnection]:
        """The connection a survivor's wait for a decision blocks on (None: it polls)."""
        return self._waits

    def _entries(self, key: str) -> List[int]:
        """The member ids appended to ``key`` (``1,2,``), in order."""
        raw = self._read(key)
        return [] if raw is None else [int(x) for x in raw.decode().split(",") if x.strip()]

    def _read(self, key: str) -> Optional[bytes]:
        if isinstance(self._store, BoundedStore):
            return self._store.get_if_set(key)
        return self._store.get(key) if self._store.check([key]) else None

    def _get_written(self, key: str) -> bytes:
        """The value of ``key``, known to exist (one request)."""
        return self._store.get_written(key) if isinstance(self._store, BoundedStore) else self._store.get(key)

    def decided(self, generation: int) -> Optional[List[int]]:
        raw = self._read(f"g{generation}/decision")
        return None if raw is None else json.loads(raw)

    def current(self) -> int:
        raw = self._read("current")
        return 0 if raw is None else int(raw)

    def _carry_out(self, steps: agreement.Steps) -> List[int]:
        """Run an agreement (``commslayer.agree.agreement``) on this store: each request it
        yields made here, its answer sent back."""
        answer: Any = None
        store = self._store
        try:
            while True:
                request = steps.send(answer)
                if isinstance(request, agreement.Read):
                    answer = self._read(request.key)
                elif isinstance(request, agreement.Get):
                    answer = self._get_written(request.key)
                elif isinstance(request, agreement.WaitFor):
                    answer = self._await(request.key, request.timeout_s, request.look_again)
                elif isinstance(request, agreement.Append):
                    answer = store.append(request.key, request.value)
                elif isinstance(request, agreement.CompareSet):
                    answer = store.compare_set(request.key, request.expected, request.desired)
                elif isinstance(request, agreement.Add):
                    answer = store.add(request.key, request.amount)
                elif isinstance(request, agreement.Write):
                    answer = store.set(request.key, request.value)
                else:
                    answer = time.sleep(request.seconds)
        except StopIteration as done:
            return done.value

    def agree_after_loss(self, generation: int, members: Sequence[int], me: int,
                         suspects: Callable[[], Set[int]], *, join_window_s: float, timeout_s: float,
                         min_size: int = 1) -> List[int]:
        """The members of ``generation`` after a loss in the previous one (see the module
        doc); ``suspects()`` is what this rank's monitor names as lost, asked again while
        waiting, since another member can be lost during the agreement itself."""
        return self._carry_out(agreement.after_loss(self._name, generation, members, me, suspects, time.monotonic,
                                                    join_window_s=join_window_s, timeout_s=timeout_s,
                                                    min_size=min_size))

    def _await(self, key: str, timeout_s: float, look_again: Callable[[], bool]) -> bool:
        """Whether the decision key ``key`` exists, waited for until ``timeout_s`` passes or
        ``look_again()`` (the survivor's view changed).  Where a wait cannot block, its
        polls go at the usual rate for ``AWAIT_FAST_S`` (a decision usually comes
        within it, and a late look would stall the job), then ever less often, up to
        every ``AWAIT_POLL_MAX_S``."""
        try:
            return self._wait(key, lambda: _LookAgain() if look_again() else None, timeout_s,
                              slow_after_s=AWAIT_FAST_S, slow_pause_s=AWAIT_POLL_MAX_S)
        except _LookAgain:
            return False

    def _wait(self, key: str, interrupted: Callable[[], Optional[Exception]], timeout_s: float,
              **polling: float) -> bool:
        """Whether ``key`` exists within ``timeout_s``, raising what ``interrupted()``
        returns once it returns something: one request that blocks on the server
        where the store allows it (``store.WaitConnection``), else polls
        (``store.wait_for_keys``, with ``polling``'s pauses)."""
        if self._waits is not None:
            stopped: List[Exception] = []

            def look_again() -> bool:
                err = interrupted()
                if err is not None:
                    stopped.append(err)
                return err is not None

            written = self._waits.wait(key, timeout_s, look_again)
            if stopped:
                raise stopped[0]
            if written is not None:
                return written
        return wait_for_keys(self._store, [key], interrupted, timeout_s, **polling)

    def agree_on(self, generation: int, members: Sequence[int], me: int, previous: Sequence[int]) -> List[int]:
        """The members of ``generation`` when the callers name them (``reconfigure``):
        the first caller's list wins; ``previous`` are the members before it."""
        return agreement.check_in(self._name, self._carry_out(agreement.decide(generation, members, previous)),
                                  generation, me)

    # ------------------------------------------------------------- growing
    def announce(self, me: int) -> int:
        """A joining rank says it wants in; returns the newest generation decided
        before that, so the joiner waits for the ones after it."""
        before = self.current()  # read first: the members may decide as soon as they see us
        self._store.append("wanted", f"{me},")
        return before

    def joiners(self, members: Sequence[int], *, fresh: bool = True) -> List[int]:
        """Joiners whose latest announcement has not been admitted yet and who are not
        among ``members``, in announcement order: read from the store now (``fresh``),
        or as the background read last saw them (at most ``JOINERS_POLL_S`` old; the
        first call reads now).  The background read runs while someone asks (it stops
        ``JOINERS_IDLE_S`` after the last call); a store failure it met is raised here."""
        announced, admitted = self._announcements() if fresh else self._polled()
        return [m for m in announced if announced[m] > admitted.get(m, 0) and m not in members]

    def _announcements(self) -> Tuple[Dict[int, int], Dict[int, int]]:
        return self._counts("wanted"), self._counts("admitted")

    def _polled(self) -> Tuple[Dict[int, int], Dict[int, int]]:
        with self._poll_lock:
            self._asked = time.monotonic()
            failure, self._poll_failure = self._poll_failure, None
            seen = self._poll_seen
            if self._poller is None or not self._poller.is_alive():  # (a forked child has no thread)
                self._poller = threading.Thread(target=_poll, args=(weakref.ref(self),),
                                                name=f"commslayer-joiners-{self._name}", daemon=True)
                self._poller.start()
        if failure is not None:
            raise failure
        return self._announcements() if seen is None else seen

    def _poll_once(self) -> bool:
        """One background read of the announcements; whether to go on."""
        with self._poll_lock:
            if time.monotonic() - self._asked > JOINERS_IDLE_S:
                self._poller, self._poll_seen = None, None
                return False
        try:
            seen = self._announcements()
        except Exception as err:  # StoreUnreachable, say: the next call raises it
            with self._poll_lock:
                self._poll_failure = err
            return False
        with self._poll_lock:
            self._poll_seen = seen
        return True

    @property
    def store_address(self) -> str:
        """Where the store is, for a message."""
        return self._store.address if isinstance(self._store, BoundedStore) else "the job's store"

    def vote(self, generation: int, call: int, size: int, ok: bool,
             interrupted: Callable[[], Optional[CommError]], timeout_s: float) -> bool:
        """Whether every one of the ``size`` members of ``generation`` voted yes in commit
        round ``call``, counted in the store (see the module doc); the same answer on
        every member."""
        key = f"g{generation}/commit/{call}"
        if not ok:
            return self.settle(generation, call, "abort")
        if self._store.add(f"{key}/yes", 1) == size:
            return self.settle(generation, call, "commit")
        try:
            self._wait_for(f"{key}/outcome", interrupted, timeout_s, "should_commit")
        except CollectiveTimeout:
            if self.settle(generation, call, "abort"):  # the last vote came in as we gave up
                return True
            raise
        except CommError:  # a member was lost before everyone voted: too late to commit
            return self.settle(generation, call, "abort")
        return self._get_written(f"{key}/outcome") == b"commit"

    def settle(self, generation: int, call: int, outcome: str) -> bool:
        """Write ``outcome`` ("commit" or "abort") as commit round ``call``'s unless one is
        written already; whether the round's outcome is commit."""
        return self._store.compare_set(f"g{generation}/commit/{call}/outcome", "", outcome) == b"commit"

    def unsure(self, generation: int, call: int, me: int, members: Sequence[int], gone: Callable[[], Set[int]],
               still_open: Callable[[], None], timeout_s: float) -> bool:
        """Commit round ``call`` for a member whose tally failed (see the module doc): it
        says so, then waits until the round is settled, or until every member is unsure
        or ``gone()`` (lost, or left after settling what it knew), when nobody can have
        committed: abort.  ``still_open()`` raises once this member's communicator is
        closed; ``CollectiveTimeout`` after ``timeout_s``."""
        key = f"g{generation}/commit/{call}"
        self._store.append(f"{key}/unsure", f"{me},")
        deadline = time.monotonic() + timeout_s
        while True:
            away = gone()  # before the outcome: who left had settled what it knew before leaving
            outcome = self._read(f"{key}/outcome")
            if outcome is not None:
                return outcome == b"commit"
            silent = set(members) - away - set(self._entries(f"{key}/unsure"))
            if not silent:
                return self.settle(generation, call, "abort")
            left = deadline - time.monotonic()
            if left <= 0:
                if self.settle(generation, call, "abort"):
                    return True
                raise CollectiveTimeout(f"commit round {call} of generation {generation} was not settled within "
                                        f"{timeout_s:g}s, and members {sorted(silent)} neither said they were "
                                        "unsure nor were lost", comm=self._name, op="should_commit",
                                        timeout_s=timeout_s, elapsed_s=timeout_s)
            still_open()
            self._wait(f"{key}/outcome", lambda: None, min(UNSURE_LOOK_S, left))

    def _wait_for(self, key: str, interrupted: Callable[[], Optional[CommError]], timeout_s: float,
                  op: str) -> None:
        """Wait until ``key`` exists; raise what ``interrupted()`` returns once the
        communicator breaks (a member lost), or ``CollectiveTimeout``."""
        if not self._wait(key, interrupted, timeout_s):
            raise CollectiveTimeout(f"{key!r} was not written within {timeout_s:g}s", comm=self._name,
                                    op=op, timeout_s=timeout_s, elapsed_s=timeout_s)

    def _counts(self, key: str) -> Dict[int, int]:
        """How often each member id appears in an appended list, in first-seen order."""
        counts: Dict[int, int] = {}
        for m in self._entries(key):
            counts[m] = counts.get(m, 0) + 1
        return counts

    def wait_for_admission(self, me: int, after: int, timeout_s: float) -> tuple:
        """A joiner's wait: (generation, members) of the first decision after generation
        ``after`` that names ``me``."""
        start = time.monotonic()
        generation = after + 1
        while True:
            decision = self.decided(generation)
            if decision is not None:
                if me in decision:
                    return generation, decision
                generation += 1
                continue
            if time.monotonic() - start >= timeout_s:
                raise CommError(f"member {me} was not admitted within {timeout_s:g}s "
                                f"(no generation after {generation - 1} names it)",
                                comm=self._name, op="join", timeout_s=timeout_s)
            time.sleep(POLL_S * 4)
