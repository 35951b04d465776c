"""Peer-memory redundancy: every rank keeps, in host memory, a copy of its wards' state.

A job sharded over every rank (FSDP2 without replica groups) holds each
shard once: a lost rank takes its parameters and optimizer state with it.
Here each rank's state (``Healable.pack()``, a flat byte tensor: its shard of the
parameters, its optimizer state, the registered objects) is also kept by
``degree`` other ranks, its holders, chosen on other hosts where the hosts
are known (``holders``).  A replacement process then receives the lost
rank's state from a surviving holder, and the job loses no step.

The copies move on a communicator of their own (a split of the shard
communicator), in a thread, so the transfer started at a step boundary
overlaps the next step's forward and backward; the step's commit waits for
it.  Two versions are kept while a refresh is in flight:

- ``confirmed``: the state of every rank at one boundary, complete on every
  holder (the commit vote of the step after it said so);
- ``pending``: the refresh under way (this rank's own state, and the copies
  received so far).

A rank keeps its own state at the confirmed boundary too, because a torch
optimizer updates in place: a loss after a step's commit (in the optimizer,
or in the next step's refresh) leaves the survivors one step ahead of the
lost rank's copy, and they go back to it.  ``restore`` picks the newest
boundary that every rank can reach (a survivor from its own snapshot, a
replacement from a holder's copy) and hands each rank its state there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from commslayer.comm.communicator import Communicator
from commslayer.errors import CommError

class StateLost(CommError):
    """A lost rank's state has no surviving copy (the rank and every holder of its
    state were lost together): the job cannot go on without a checkpoint."""


def holders(nodes: Sequence[int], degree: int) -> List[List[int]]:
    """``holders(nodes, degree)[r]``: the ranks that keep a copy of rank ``r``'s state.

    ``nodes[r]`` is rank ``r``'s host. Ranks are ordered round-robin across the
    hosts (the first rank of every host, then the second, ...) and each rank's
    copies go to the next ``degree`` ranks in that ring, so with equal hosts a
    copy never shares its original's host; with one host every copy does."""
    size = len(nodes)
    if not 1 <= degree < size:
        raise ValueError(f"redundancy degree {degree}: needs 1 <= degree < {size} (the ranks)")
    by_node: Dict[int, List[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    queues = [ranks for _, ranks in sorted(by_node.items())]
    ring: List[int] = []
    for i in range(max(len(q) for q in queues)):
        ring += [q[i] for q in queues if i < len(q)]
    at = {rank: i for i, rank in enumerate(ring)}
    return [[ring[(at[r] + j) % size] for j in range(1, degree + 1)] for r in range(size)]


@dataclass
class Version:
    """Every rank's state at the boundary before ``step``, as one rank holds it."""

    step: int
    own: torch.Tensor  # this rank's state (``commslayer.train.packing``)
    copies: Dict[int, torch.Tensor] = field(default_factory=dict)  # ward rank -> its state (complete copies only)
    received: Optional[torch.Tensor] = None  # the buffer the copies are views of


class PeerCopies:
    """This rank's part of the redundancy: what it holds and the refresh in flight.

    ``comm`` carries the copies (every rank of the job, in rank order);
    ``plan`` is ``holders(...)``; ``on_sending`` runs in the refresh thread
    once the sizes are known and before the bytes move (the fault harness
    kills a rank there: a refresh cut in the middle)."""

    def __init__(self, comm: Communicator, plan: List[List[int]],
                 on_sending: Optional[Callable[[int], None]] = None) -> None:
        self.plan = plan
        self.rank = comm.get_rank()
        self.wards = [w for w, hs in enumerate(plan) if self.rank in hs]
        self.confirmed: Optional[Version] = None
        self.pending: Optional[Version] = None
        self.bytes_sent = 0
        self._spare: Optional[Version] = None  # the last version dropped: its buffers are reused
        self._comm = comm
        self._on_sending = on_sending
        self._thread: Optional[threading.Thread] = None
        self._ok = True

    def use(self, comm: Communicator) -> None:
        """Carry the copies over ``comm`` from now on (the next generation's split)."""
        self._comm = comm

    # ------------------------------------------------------------ refreshing
    def spare(self) -> Optional[torch.Tensor]:
        """A buffer to pack the next refresh's state into (``Healable.pack(into=)``): the
        one of the last version dropped, which nothing uses any more; or None."""
        return None if self._spare is None else self._spare.own

    def refresh(self, step: int, own: torch.Tensor) -> None:
        """Start sending ``own`` (this rank's state at the boundary before ``step``) to
        its holders and receiving its wards' copies; ``wait`` finishes it."""
        self.wait()
        self.pending = Version(step, own)
        self._ok = False
        self._thread = threading.Thread(target=self._exchange, args=(self.pending,), daemon=True,
                                        name=f"commslayer-copies-{step}")
        self._thread.start()

    def _exchange(self, version: Version) -> None:
        try:
            own = version.own
            into = None if self._spare is None else self._spare.received
            got, version.received = self._route({h: own for h in self.plan[self.rank]}, on_sizes=self._on_sending,
                                                step=version.step, into=into)
            version.copies.update(got)
            self.bytes_sent += own.numel() * len(self.plan[self.rank])
            self._ok = True
        except CommError:
            self._ok = False  # the step's vote says no; ``restore`` finds out which copies are whole

    def _route(self, sends: Dict[int, torch.Tensor], *, step: int, on_sizes: Optional[Callable[[int], None]] = None,
               into: Optional[torch.Tensor] = None) -> Tuple[Dict[int, torch.Tensor], torch.Tensor]:
        """Send each of ``sends`` (rank -> bytes) to its rank; what the others sent here, by
        sender (views of one buffer: the front of ``into`` where it is large enough),
        and that buffer. Two collectives (the sizes, then an all-to-all of the bytes),
        not point-to-point ops: a wait in a collective ends as soon as the liveness
        monitor names a lost member, whatever it waits for."""
        size = self._comm.get_size()
        row = torch.zeros(size, dtype=torch.int64)
        for dst, t in sends.items():
            row[dst] = t.numel()
        sizes = torch.zeros(size * size, dtype=torch.int64)
        self._comm.all_gather_single(sizes, row)
        if on_sizes is not None:
            on_sizes(step)
        matrix = sizes.view(size, size)
        pieces = [sends[dst] for dst in sorted(sends)]
        data = pieces[0] if len(pieces) == 1 else (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8))
        splits = matrix[:, self.rank].tolist()
        total = sum(splits)
        out = into[:total] if into is not None and into.numel() >= total else torch.empty(total, dtype=torch.uint8)
        self._comm.all_to_all_single(out, data, output_split_sizes=splits, input_split_sizes=matrix[self.rank].tolist())
        got, at = {}, 0
        for src, n in enumerate(splits):
            if n:
                got[src] = out[at:at + n]
            at += n
        return got, out

    def wait(self) -> bool:
        """Wait for the refresh in flight; whether every copy of it arrived here and
        went out from here (True when none is in flight)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._ok

    def confirm(self) -> None:
        """Every rank's refresh succeeded (the commit vote said so): it becomes the
        version to go back to."""
        if self.pending is not None:
            self._spare, self.confirmed, self.pending = self.confirmed, self.pending, None

    def exchange(self, step: int, own: torch.Tensor) -> bool:
        """A whole refresh, waited for: whether it succeeded here."""
        self.refresh(step, own)
        return self.wait()

    @property
    def held_bytes(self) -> int:
        """Host memory the copies take on this rank now (own snapshots and wards' copies,
        and the buffers of the last version dropped, kept for the next refresh)."""
        return sum(v.own.numel() + (sum(c.numel() for c in v.copies.values()) if v.received is None
                                    else v.received.numel())
                   for v in (self.confirmed, self.pending, self._spare) if v is not None)

    # ------------------------------------------------------------- recovery
    def unrecoverable(self, lost: Set[int]) -> List[int]:
        """The lost ranks none of whose holders survived."""
        return sorted(r for r in lost if all(h in lost for h in self.plan[r]))

    def _have(self, size: int) -> torch.Tensor:
        """This rank's row of what it can give: the confirmed and the pending step (-1:
        none), then per rank a bitmask (1: its state at the confirmed step, 2: at the
        pending step; a copy counts only if it arrived whole)."""
        row = torch.zeros(2 + size, dtype=torch.int64)
        for column, bit, version in ((0, 1, self.confirmed), (1, 2, self.pending)):
            row[column] = -1 if version is None else version.step
            for rank in ([] if version is None else [self.rank, *version.copies]):
                row[2 + rank] |= bit
        return row

    def _agree(self, comm: Communicator, ranks: Sequence[int]) -> Tuple[int, Optional[Version], Dict[int, int]]:
        """Every member of ``comm`` (``ranks[c]``: the job rank of its member ``c``) says
        what it holds; the newest boundary at which every job rank's state is held by
        some member: its step, this rank's version of it, and per job rank the member
        that gives it (the rank itself where it is a member, else a holder)."""
        size = len(self.plan)
        rows = torch.zeros(comm.get_size() * (2 + size), dtype=torch.int64)
        comm.all_gather_single(rows, self._have(size))
        table = rows.view(comm.get_size(), 2 + size)
        at = {rank: c for c, rank in enumerate(ranks)}

        def source(rank: int, bit: int) -> Optional[int]:
            return next((at[h] for h in [rank] + self.plan[rank] if h in at and int(table[at[h], 2 + rank]) & bit),
                        None)

        for column, bit, version in ((1, 2, self.pending), (0, 1, self.confirmed)):
            steps = {int(table[c, column]) for c in range(comm.get_size()) if int(table[c, column]) >= 0}
            sources = {rank: source(rank, bit) for rank in range(size)}
            if len(steps) == 1 and None not in sources.values():
                return steps.pop(), version, {r: c for r, c in sources.items() if c is not None}
        missing = [r for r in range(size) if source(r, 1) is None]
        raise StateLost(f"no surviving copy of the state of rank(s) {missing}", comm=comm.get_name(),
                        op="restore", ranks=missing)

    def restore(self, joined: bool) -> Tuple[int, torch.Tensor, int]:
        """After a generation change (every rank calls it; ``joined``: this process is a
        replacement and holds nothing): agree on the newest boundary whose state every
        rank can get, give every replacement its state there from a holder, and refresh
        every copy at it. Returns the boundary's step, this rank's state at it and the
        rank it came from (itself, for a survivor)."""
        self.wait()
        if joined:
            self.confirmed = self.pending = None
        step, mine, sources = self._agree(self._comm, range(len(self.plan)))
        sends = {r: mine.copies[r] for r, c in sources.items() if c == self.rank and r != self.rank and mine is not None}
        got, _ = self._route(sends, step=step)
        if sources[self.rank] != self.rank:
            own = got[sources[self.rank]]
        else:
            assert mine is not None  # a survivor has its own state at the chosen step
            own = mine.own
        self.confirmed = self.pending = self._spare = None
        if not self.exchange(step, own):
            raise CommError(f"refreshing the copies at step {step} after the recovery failed",
                            comm=self._comm.get_name(), op="restore")
        return step, own, sources[self.rank]

    def gather(self, comm: Communicator, ranks: Sequence[int]) -> Tuple[int, Dict[int, torch.Tensor]]:
        """Every job rank's state at the newest boundary the members of ``comm`` (the
        survivors, ``ranks[c]`` the job rank of member ``c``) can give, on every member:
        what resharding onto the survivors starts from. Returns the boundary's step and
        the states by job rank."""
        self.wait()
        step, mine, sources = self._agree(comm, ranks)
        me = list(ranks).index(self.rank)
        given = {r: (mine.own if r == self.rank else mine.copies[r])
                 for r, c in sources.items() if c == me and mine is not None}
        lengths = torch.zeros(len(self.plan), dtype=torch.int64)
        for r, data in given.items():
            lengths[r] = data.numel()
        table = torch.zeros(comm.get_size() * len(self.plan), dtype=torch.int64)
        comm.all_gather_single(table, lengths)
        per_member = table.view(comm.get_size(), len(self.plan))
        width = int(per_member.sum(dim=1).max())
        mine_bytes = torch.cat([given[r] for r in sorted(given)]) if given else torch.empty(0, dtype=torch.uint8)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:mine_bytes.numel()] = mine_bytes
        everything = torch.empty(comm.get_size() * width, dtype=torch.uint8)
        comm.all_gather_single(everything, padded)
        out: Dict[int, torch.Tensor] = {}
        for c in range(comm.get_size()):
            at = c * width
            for r in range(len(self.plan)):
                n = int(per_member[c, r])
                if n:
                    out[r] = everything[at:at + n]
                    at += n
        return step, out
