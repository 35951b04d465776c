"""The replicate dimension of an HSDP job, kept alive while replica groups die and come back.

An HSDP job is ``replicas`` replica groups of ``shards`` ranks each: a model
is sharded across the ranks of one replica group (FSDP2, over the group's own
process group) and replicated across the groups, whose gradients are
averaged.  The unit of failure is the replica group: when one of its ranks
dies its shards are gone, but every other replica group holds the same state.
torchrun (one per replica group) restarts the whole group; the others keep
training without it, and let it back in once it has healed.

What this module owns, on top of commslayer's recovery (``shrink``,
``join``, ``reconfigure``, ``should_commit``):

- ``world``: one communicator over every rank of every live replica group
  (member id ``replica * shards + shard``).  It carries liveness, the
  membership decisions and the commit votes; the averaging runs on
  ``replicate``, its split over the ranks that hold the same shard.
- Atomic steps (``average``): the gradient average of a step (its buckets
  all-reduced together, some of them begun during backward with ``start``)
  counts only if
  every rank of every live replica group voted that its part succeeded
  (``should_commit``); otherwise the survivors shrink and redo the average
  from the same local gradients, so the optimizer step is applied once, on
  every live replica, with the average over exactly the live ones.
- Whole replica groups only: a rank whose own group lost a member leaves
  (``ReplicaBroken``: its torchrun restarts the group), and a generation that
  still holds part of a group drops it.
- Growing back (``admit``, ``heal``): at a step boundary the members admit
  every restarted replica group whose ranks have all announced themselves;
  its ranks receive the state (a ``Healable``: parameters, optimizer state,
  the user's own state, packed to bytes) and the step number from a live
  replica over ``replicate``.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from commslayer.comm.communicator import Communicator
from commslayer.comm.create import join, new_comm
from commslayer.errors import CommAborted, CommError, InvalidArgument, StoreUnreachable
from commslayer.hooks import recovery_hooks
from commslayer.reduce_op import ReduceOp
from commslayer.runs import Admission, Recovery
from commslayer.train import spare
from commslayer.comm.work import Work


class ReplicaBroken(CommError):
    """This rank's own replica group lost a member: the process must exit so that
    its launcher restarts the whole group, which then heals and rejoins."""


@dataclass
class Started:
    """A bucket's cross-replica average in flight (``Replicas.start``)."""

    out: torch.Tensor  # the average, once ``work`` is done
    work: Optional[Work]  # None: it could not be issued (a loss)
    generation: int  # the generation it was issued in


def _finished(started: Sequence[Started]) -> bool:
    """Wait for every started average; whether all succeeded."""
    try:
        for s in started:
            if s.work is None:
                return False
            s.work.wait()
    except CommAborted:
        raise
    except CommError:
        return False
    return True


class Replicas:
    """This rank's view of the live replica groups (see the module doc).

    ``store`` is the job's store, outside every replica group (the launcher's
    coordinator holds it), so losing any group, rank 0's included, is
    survivable.  ``rejoin``: this process is a restart of ``replica`` and
    joins the running job instead of starting it.
    """

    def __init__(self, *, replica: int, replicas: int, shard: int, shards: int, store: dist.Store,
                 rejoin: bool = False, timeout: timedelta = timedelta(seconds=60), name: str = "replicas") -> None:
        self.replica, self.replicas, self.shard, self.shards = replica, replicas, shard, shards
        self.member = replica * shards + shard
        self._timeout = timeout
        self.recoveries: List[Recovery] = []
        self.admissions: List[Admission] = []
        self._healed = False
        if rejoin:
            self.world = join("gloo", name=name, member=self.member, store=store, timeout=timeout,
                              isolate_writes=True)
        else:
            self.world = new_comm("gloo", name=name, store=store, rank=self.member, size=replicas * shards,
                                  timeout=timeout, isolate_writes=True)
        self.world.global_ranks = list(self.world.members)  # member ids are the job's ranks
        self.replicate = self._split()

    # ------------------------------------------------------------ who is live
    @property
    def live(self) -> List[int]:
        """The replica groups in the current generation."""
        return sorted({m // self.shards for m in self.world.members})

    @property
    def generation(self) -> int:
        return self.world.generation

    def _split(self) -> Communicator:
        mine = [r for r, m in enumerate(self.world.members) if m % self.shards == self.shard]
        return self.world.split(mine, name=f"replicate{self.shard}")

    def _complete(self, members: Sequence[int]) -> List[int]:
        """``members`` without the replica groups that are not all there."""
        counts = {}
        for m in members:
            counts[m // self.shards] = counts.get(m // self.shards, 0) + 1
        return [m for m in members if counts[m // self.shards] == self.shards]

    # ------------------------------------------------------------ atomic steps
    def start(self, bucket: torch.Tensor) -> "Started":
        """Start the average of one bucket over the live replica groups now (during
        backward), for ``average`` to finish; ``bucket`` itself is never written."""
        out = torch.empty_like(bucket)
        try:
            return Started(out, self.replicate._all_reduce_into(out, bucket, ReduceOp.AVG), self.generation)
        except CommAborted:
            raise  # fenced out: the others went on without this replica group
        except CommError:
            return Started(out, None, self.generation)  # a loss: ``average`` finds it and recovers

    def average(self, buckets: Sequence[torch.Tensor], step: int,
                started: Optional[Sequence["Started"]] = None) -> List[torch.Tensor]:
        """The average of each of ``buckets`` over the live replica groups, committed on
        every rank of every one of them (the buckets themselves are never written). The
        buckets' all-reduces are in flight together; ``started``, if given, are those of
        ``buckets`` begun earlier with ``start``. Redone on the survivors after a loss;
        raises ``ReplicaBroken`` if this rank's own group lost a member."""
        if started is not None and (len(started) != len(buckets) or
                                    any(s.generation != self.generation for s in started)):
            raise InvalidArgument("average: the started averages do not match the buckets of this generation",
                                  comm=self.replicate.get_name(), op="average")
        while True:
            if started is None:
                started = [self.start(b) for b in buckets]
            ok = _finished(started)
            detected = time.time()
            if self._agreed(ok):
                if self.recoveries and self.recoveries[-1].committed_at is None:
                    self.recoveries[-1].committed_at = time.time()
                return [s.out for s in started]
            self._recover(step, detected)
            started = None

    def _recover(self, step: int, detected: float) -> None:
        before = self.live
        self._leave_if_broken()
        world = self.world.shrink()
        complete = self._complete(world.members)
        if self.member not in complete:
            raise ReplicaBroken(f"replica group {self.replica} is incomplete in generation "
                                f"{world.generation} (members {world.members})", comm=world.get_name(),
                                op="shrink")
        if complete != world.members:  # part of a group got in: go on with whole groups only
            world = world.reconfigure(complete)
        self.world = world
        self.replicate = self._split()
        self.recoveries.append(Recovery(step, sorted(set(before) - set(self.live)), self.generation,
                                        detected, time.time()))
        recovery_hooks("recovered", {"step": step, "lost_replicas": self.recoveries[-1].lost_replicas,
                                     "generation": self.generation, "members": list(self.world.members),
                                     "seconds": self.recoveries[-1].resumed_at - detected})

    def _leave_if_broken(self) -> None:
        lost = {self.world.members[r] for r in self.world.lost_ranks}
        mates = sorted(m for m in lost if m // self.shards == self.replica)
        if mates:
            raise ReplicaBroken(f"member(s) {mates} of this rank's replica group {self.replica} were lost",
                                comm=self.world.get_name(), op="shrink", ranks=self.world.lost_ranks)

    # ------------------------------------------------------------ growing back
    def admit(self, state: "Healable", step: int) -> List[int]:
        """At a step boundary (every live rank calls it): let in the restarted replica
        groups whose ranks have all announced themselves and send them ``state`` and
        ``step``. Returns the replica groups admitted."""
        if self._healed:  # a rank that just healed took part in this boundary's admission
            self._healed = False
            return []
        try:
            pending = self.world.pending_members()
        except (CommAborted, StoreUnreachable):
            raise
        except CommError:
            # A member was lost; its mates may have got the list before (the leader died
            # after publishing it). Recovering here could leave them blocked on this rank in
            # their own group's forward pass: the step's average finds the loss on every rank.
            return []
        ready = {m // self.shards for m in self._complete(pending)}
        if not ready:
            return []
        start = time.perf_counter()
        joiners = [m for m in pending if m // self.shards in ready]
        ok = True
        try:
            self.world = self.world.reconfigure(sorted(self.world.members + joiners))
            self.replicate = self._split()
            self._transfer(state, step, survivor=True)
        except CommAborted:
            raise
        except CommError:
            ok = False
        if not self._agreed(ok):  # a member (or a joiner) was lost meanwhile: admit later
            self._recover(step, time.time())
            return []
        admitted = sorted(ready)
        self.admissions.append(Admission(step, admitted, self.generation, time.perf_counter() - start, time.time()))
        recovery_hooks("admitted", {"step": step, "replicas": admitted, "generation": self.generation,
                                    "members": list(self.world.members), "seconds": self.admissions[-1].heal_s})
        return admitted

    def heal(self, state: "Healable") -> int:
        """A restarted rank, once admitted: overwrite ``state`` with a live replica's
        and return the step to continue from."""
        start = time.perf_counter()
        step = self._transfer(state, -1, survivor=False)
        if not self._agreed(True):
            raise CommError("the state transfer failed on another rank", comm=self.world.get_name(), op="heal")
        self._healed = True
        recovery_hooks("healed", {"step": step, "generation": self.generation, "seconds": time.perf_counter() - start,
                                  **self._received, **spare.heal_fields()})
        return step

    def _agreed(self, ok: bool) -> bool:
        """Whether every rank's part of an admission succeeded, the same answer on all:
        the ranks of one group must not go different ways (one recovering, its mate
        stepping on and blocking on it in their group's collectives)."""
        try:
            return self.world.should_commit(ok)
        except (CommAborted, StoreUnreachable):  # fenced, or nothing can be agreed any more
            raise
        except CommError:
            return False

    def _transfer(self, state: "Healable", step: int, *, survivor: bool) -> int:
        """Send ``state`` (``state.pack()``) and ``step`` from the first rank of
        ``replicate`` that was live before the admission (the same on every member: they
        all say which); the others ``unpack`` it."""
        comm = self.replicate
        flags = torch.zeros(comm.get_size(), dtype=torch.int64)
        comm.all_gather_single(flags, torch.tensor([int(survivor)], dtype=torch.int64))
        root = int(torch.nonzero(flags)[0])
        payload = state.pack() if comm.get_rank() == root else None
        head = torch.tensor([step, 0 if payload is None else payload.numel()], dtype=torch.int64)
        comm.broadcast(head, root)
        data = payload if payload is not None else torch.empty(int(head[1]), dtype=torch.uint8)
        comm.broadcast(data, root)
        if not survivor:
            state.unpack(data)
            source = comm.global_ranks[root]
            self._received = {"source": source, "source_replica": source // self.shards, "bytes": data.numel()}
        return int(head[0])

    def wait_for(self, state: "Healable", step: int, gone: Callable[[int], bool],
                 timeout_s: float, poll_s: float = 0.1) -> None:
        """At the end of the run: keep admitting until every replica group is live
        again, the rest are ``gone`` (their launcher gave up), or ``timeout_s``
        passed. Each round ends in an all-reduce (any rank may ask for another),
        so all leave together, and none leaves before every rank entered the last
        op of ``world`` (one that did would count the others' goodbyes as a loss)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.admit(state, step)
            missing = [r for r in range(self.replicas) if r not in self.live and not gone(r)]
            again = torch.tensor([int(bool(missing) and time.monotonic() < deadline)])
            try:
                self.world.all_reduce(again, ReduceOp.MAX)
            except CommAborted:
                raise
            except CommError:
                self._recover(step, time.time())
                continue
            if not int(again):
                return
            time.sleep(poll_s)

    def fingerprints(self, state: "Healable") -> List[int]:
        """A 63-bit hash of ``state`` on every replica group's rank of this shard, in
        ``replicate`` rank order: equal values mean bitwise-identical state."""
        mine = torch.tensor([state.fingerprint()], dtype=torch.int64)
        out = torch.zeros(self.replicate.get_size(), dtype=torch.int64)
        self.replicate.all_gather_single(out, mine)
        return out.tolist()


class Healable(Protocol):
    """What a replica group's state must offer to be sent to a restarted group."""

    def pack(self, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's whole state as a 1-D ``uint8`` tensor (``commslayer.train.packing``),
        to be sent to a restarted rank of the same shard; in the front of ``into``, a
        buffer an earlier ``pack`` returned and nothing uses now, where it fits."""

    def unpack(self, data: torch.Tensor) -> None:
        """Overwrite this rank's state with what ``pack`` gave on a live replica."""

    def fingerprint(self) -> int:
        """A 63-bit hash of the state: equal on two replicas only if bitwise identical."""


def fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """A 63-bit hash of the bytes of ``tensors``, in order."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return int.from_bytes(h.digest(), "little") >> 1
