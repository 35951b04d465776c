"""The shrink agreement's rules, as code that does no I/O of its own: who
proposes, what the proposer waits for and decides, what the others wait on.

Why no I/O: the same rules run against a job's store (``commslayer.agree.membership``
carries out each request on it) and against the simulated store of
``commslayer.detect.watchsim``, which runs them for 10,000 members in one process; so
the simulator's figures (decision time, store requests per decision) are the
figures of this code, not of a model of it.

An agreement is a generator.  It yields requests (the classes below), is sent
each one's answer, and returns the decided member list, or raises the
``CommError`` that ends it.  ``membership.Membership`` documents the protocol
and its store keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Set, Tuple, Union

from commslayer.errors import CommAborted, CommError

PROPOSER_POLL_S = 0.005  # the proposer reads the joined list this often


@dataclass(frozen=True)
class Append:
    """Append ``value`` to ``key``; answer None."""
    key: str
    value: str


@dataclass(frozen=True)
class Read:
    """The value of ``key``, or None while nobody wrote it."""
    key: str


@dataclass(frozen=True)
class Get:
    """The value of ``key``, which exists (one request where ``Read`` may take two)."""
    key: str


@dataclass(frozen=True)
class CompareSet:
    """Write ``desired`` to ``key`` if it holds ``expected`` (absent counts as ``""``); answer the value it holds after."""
    key: str
    expected: str
    desired: str


@dataclass(frozen=True)
class Add:
    """Add ``amount`` to the counter ``key``; answer the new count."""
    key: str
    amount: int


@dataclass(frozen=True)
class Write:
    """Set ``key`` to ``value``; answer None."""
    key: str
    value: str


@dataclass(frozen=True)
class WaitFor:
    """Whether ``key`` was written within ``timeout_s``; False too as soon as
    ``look_again()`` is true (the waiter's view of who is lost changed)."""
    key: str
    timeout_s: float
    look_again: Callable[[], bool]


@dataclass(frozen=True)
class Pause:
    """Do nothing for ``seconds``; answer None."""
    seconds: float


Request = Union[Append, Read, Get, CompareSet, Add, Write, WaitFor, Pause]
Steps = Generator[Request, Any, List[int]]


def joined_and_suspected(raw: Optional[bytes]) -> Tuple[Set[int], Set[int]]:
    """(the members that joined, the members they suspect) from an agreement's
    ``joined`` list: one ``member:suspect.suspect,`` entry per post."""
    joined: Set[int] = set()
    suspected: Set[int] = set()
    for entry in (raw or b"").decode().split(","):
        member, _, suspects = entry.partition(":")
        if member.strip():
            joined.add(int(member))
            suspected.update(int(x) for x in suspects.split(".") if x.strip())
    return joined, suspected


def check_in(comm: str, decision: List[int], generation: int, me: int) -> List[int]:
    """``decision``, unless it leaves ``me`` out: then ``CommAborted`` (fenced out)."""
    if me not in decision:
        raise CommAborted(f"fenced out of generation {generation}: the survivors decided on members {decision}",
                          comm=comm, op="membership")
    return decision


def decide(generation: int, proposal: Sequence[int], previous: Sequence[int]) -> Steps:
    """Write ``proposal`` as the decision of ``generation`` unless one exists; the decision
    that holds.  Exactly one caller records it (admissions, the current generation)."""
    decision: List[int] = json.loads((yield CompareSet(f"g{generation}/decision", "", json.dumps(list(proposal)))))
    if (yield Add(f"g{generation}/recorded", 1)) == 1:
        joined = [m for m in decision if m not in previous]
        if joined:
            yield Append("admitted", "".join(f"{m}," for m in joined))
        yield Write("current", str(generation))
    return decision


class _Survivor:
    """One survivor's part in one agreement: what it has posted, and since when it runs."""

    def __init__(self, comm: str, generation: int, members: Sequence[int], me: int,
                 suspects: Callable[[], Set[int]], clock: Callable[[], float], join_window_s: float,
                 timeout_s: float, min_size: int) -> None:
        self.comm, self.generation, self.members, self.me = comm, generation, list(members), me
        self.suspects, self.clock = suspects, clock
        self.join_window_s, self.timeout_s, self.min_size = join_window_s, timeout_s, min_size
        self.start = clock()
        self.posted: Set[int] = set()

    def expire(self, waited: float) -> None:
        if waited >= self.timeout_s:
            raise CommError(f"no agreement on generation {self.generation} within {self.timeout_s:g}s",
                            comm=self.comm, op="shrink", timeout_s=self.timeout_s, elapsed_s=waited)

    def post(self, first: bool = False) -> Generator[Request, Any, None]:
        """Join (``first``), or post what this member newly suspects: one append."""
        new = self.suspects() - self.posted
        if new or first:
            yield Append(f"g{self.generation}/joined", f"{self.me}:{'.'.join(map(str, sorted(new)))},")
            self.posted |= new

    def run(self) -> Steps:
        g = self.generation
        yield from self.post(first=True)
        while True:
            yield from self.post()
            waited = self.clock() - self.start
            self.expire(waited)
            # The proposer; or this rank, once the proposer had twice its join window (it may
            # be alive to its peers but cut off from the store: it cannot hold the others up).
            if min(m for m in self.members if m not in self.posted) == self.me or waited >= 2 * self.join_window_s:
                return (yield from self.propose())
            timeout = min(self.timeout_s, 2 * self.join_window_s) - waited
            if (yield WaitFor(f"g{g}/decided", timeout, lambda: bool(self.suspects() - self.posted))):
                left_out = {int(m) for m in (yield Get(f"g{g}/decided")).decode().split(",") if m}
                return check_in(self.comm, [m for m in self.members if m not in left_out], g, self.me)

    def publish(self, decision: List[int]) -> Steps:
        """Tell the survivors waiting for ``decision`` which members it leaves out: a few
        bytes each reads, where the member list is O(N) (N readers of O(N) bytes would
        move O(N^2) through the store).  Any proposer that finds the decision writes the
        same, so one lost after deciding holds nobody up."""
        yield Write(f"g{self.generation}/decided", ",".join(str(m) for m in self.members if m not in decision))
        return check_in(self.comm, decision, self.generation, self.me)

    def propose(self) -> Steps:
        """Wait for every unsuspected member to join (or the join window), then decide
        on those that joined and that nobody suspects."""
        g = self.generation
        while True:
            yield from self.post()
            decision = yield Read(f"g{g}/decision")  # another proposer (one that suspected us) won
            if decision is not None:
                return (yield from self.publish(json.loads(decision)))
            joined, suspected = joined_and_suspected((yield Read(f"g{g}/joined")))
            expected = [m for m in self.members if m not in suspected]
            waited = self.clock() - self.start
            if set(expected) <= joined or waited >= self.join_window_s:
                proposal = [m for m in expected if m in joined]
                if len(proposal) < self.min_size:
                    raise CommError(f"only {len(proposal)} member(s) {proposal} survived; min_size is {self.min_size}",
                                    comm=self.comm, op="shrink", elapsed_s=waited)
                return (yield from self.publish((yield from decide(g, proposal, self.members))))
            self.expire(waited)
            yield Pause(PROPOSER_POLL_S)


def after_loss(comm: str, generation: int, members: Sequence[int], me: int, suspects: Callable[[], Set[int]],
               clock: Callable[[], float], *, join_window_s: float, timeout_s: float, min_size: int = 1) -> Steps:
    """One survivor's agreement on the members of ``generation`` after a loss in the
    previous one: ``suspects()`` is what its monitor names as lost (asked again while
    it waits), ``clock()`` its monotonic time in seconds."""
    return _Survivor(comm, generation, members, me, suspects, clock, join_window_s, timeout_s, min_size).run()
