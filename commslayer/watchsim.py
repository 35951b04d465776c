"""A discrete-event simulator of the watch protocol: thousands of members in one
process, no sockets, the protocol code itself (``commslayer.watch.Watch``).

Why: the protocol's claims (a loss known everywhere in ``O(log N)`` hops,
constant load per member, no healthy member declared lost under jitter) are
about sizes no test machine holds.  The simulator drives one ``Watch`` per
member exactly as ``commslayer.liveness`` does over TCP (bytes in, ``tick``
when due, frames out), over links that keep TCP's order, with

* a message delay per frame: a base latency plus uniform jitter;
* a clock per member: an offset and a rate error (``drift_ppm``), and a
  timer that fires late by up to ``wake_jitter_s`` (a thread being scheduled);
* faults: ``kill`` (the process dies; its neighbours read the hang-up after
  what it had sent), ``stop`` (SIGSTOP: nothing runs, frames queue, and all
  of it runs on resume), ``cut`` (a link delivers nothing until healed);
* ``leave``: a member says goodbye and exits.

It records when each member declared each peer lost (or saw it leave), and
counts the frames and heartbeats each member sent.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .watch import BEAT, Topology, Watch

_TICK, _DELIVER, _HANGUP, _KILL, _STOP, _RESUME, _HEAL, _LEAVE = range(8)


@dataclass
class Failure:
    """A fault the simulation injected: ``kind`` is ``kill`` or ``stop``."""
    member: int
    kind: str
    at: float
    until: float = float("inf")


@dataclass
class Detection:
    """When the members declared one failed member lost (seconds after the fault)."""
    member: int
    kind: str
    delays: List[float] = field(default_factory=list)
    missing: int = 0  # live members that never declared it

    def quantile(self, q: float) -> float:
        return quantile(self.delays, q)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank; nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Simulation:
    """``size`` members running the watch protocol over simulated links.

    ``k`` and ``mesh_max`` choose the topology as ``Topology.choose`` does;
    ``hosts`` (one label per member) makes it host-aware."""

    def __init__(self, size: int, *, k: int = 3, mesh_max: int = 16, heartbeat_s: float = 0.25,
                 peer_timeout_s: float = 3.0, delay_s: float = 0.0002, jitter_s: float = 0.0,
                 drift_ppm: float = 100.0, wake_jitter_s: float = 0.001, seed: int = 0,
                 hosts: Optional[Sequence[object]] = None) -> None:
        self.size = size
        self.rng = random.Random(seed)
        self.topology = Topology.choose(size, k=k, mesh_max=mesh_max, seed=seed, hosts=hosts)
        self.delay_s, self.jitter_s, self.wake_jitter_s = delay_s, jitter_s, wake_jitter_s
        self.now = 0.0
        self._queue: List[Tuple[float, int, int, int, int, bytes]] = []
        self._seq = 0
        self._offset = [self.rng.uniform(0, 1000) for _ in range(size)]
        self._rate = [1 + self.rng.uniform(-drift_ppm, drift_ppm) * 1e-6 for _ in range(size)]
        self._link_free: Dict[int, float] = {}  # link (a * size + b) -> when it is free
        self._tick_at = [0.0] * size
        self.dead: Set[int] = set()
        self.stopped: Dict[int, List[Tuple[int, int, int, bytes]]] = {}  # member -> what arrived meanwhile
        self._cut: Set[int] = set()
        self._held: Dict[int, List[bytes]] = {}
        self.failures: List[Failure] = []
        self.declared: Dict[int, Dict[int, float]] = {}  # target -> member -> when
        self.departed: Dict[int, Dict[int, float]] = {}  # leaver -> member -> when it learned
        self.beats = [0] * size
        self.members: List[Watch] = []
        for m in range(size):
            start = self.rng.uniform(0, heartbeat_s)  # members start out of phase
            self.members.append(Watch(m, self.topology, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                      now=self._local(m, start)))
            self._tick_at[m] = start
            self._push(start, _TICK, m, 0, b"")

    # ------------------------------------------------------------- faults
    def kill(self, member: int, at: float) -> None:
        self.failures.append(Failure(member, "kill", at))
        self._push(at, _KILL, member, 0, b"")

    def stop(self, member: int, at: float, for_s: float = float("inf")) -> None:
        self.failures.append(Failure(member, "stop", at, at + for_s))
        self._push(at, _STOP, member, 0, b"")
        if for_s != float("inf"):
            self._push(at + for_s, _RESUME, member, 0, b"")

    def leave(self, member: int, at: float) -> None:
        """``member`` says goodbye at ``at`` and exits."""
        self._push(at, _LEAVE, member, 0, b"")

    def cut(self, a: int, b: int, at: float, until: float = float("inf")) -> None:
        """Cut the link between ``a`` and ``b`` (both ways) from ``at`` until ``until``."""
        self._push(at, _HEAL, a, b, b"cut")
        if until != float("inf"):
            self._push(until, _HEAL, a, b, b"")

    # ------------------------------------------------------------- running
    def run(self, until: float) -> None:
        """Process every event up to simulated time ``until``."""
        queue, members, dead, stopped = self._queue, self.members, self.dead, self.stopped
        offset, rate, pop = self._offset, self._rate, heapq.heappop
        while queue and queue[0][0] <= until:
            t, _, kind, a, b, data = pop(queue)
            self.now = t
            if kind == _DELIVER or kind == _HANGUP:  # from a to b
                if b in dead:
                    continue
                if b in stopped:
                    stopped[b].append((kind, a, b, data))
                    continue
                watch = members[b]
                if kind == _HANGUP:
                    watch.hung_up(a, offset[b] + t * rate[b])
                else:
                    watch.received(a, data, offset[b] + t * rate[b])
                if data is not BEAT or watch.outbox or watch.news_lost or watch.news_left:
                    self._after(b, rescheduling=True)
            elif kind == _TICK:
                if a in dead or t != self._tick_at[a] or a in stopped:
                    continue  # stale (rescheduled since), or stopped: the resume ticks
                members[a].tick(offset[a] + t * rate[a])
                self._after(a, rescheduling=True, ticked=True)
            else:
                self._fault(kind, a, b, data, t)
        self.now = until

    def _fault(self, kind: int, a: int, b: int, data: bytes, t: float) -> None:
        if kind == _LEAVE:
            self.members[a].goodbye()
            self._after(a, rescheduling=False)
        if kind in (_KILL, _LEAVE):
            self.dead.add(a)
            self.stopped.pop(a, None)
            for n in self.topology.neighbours(a):  # the kernel hangs up after what was already sent
                if a * self.size + n in self._cut:
                    self._held.setdefault(a * self.size + n, []).append(b"")  # a cut link: when it heals
                    continue
                at = t + self.delay_s + self.rng.random() * self.jitter_s
                self._push(max(at, self._link_free.get(a * self.size + n, 0.0)) + 1e-9, _HANGUP, a, n, b"")
        elif kind == _STOP:
            self.stopped[a] = []
        elif kind == _RESUME:
            for event in self.stopped.pop(a, []):  # in the order it arrived, as the sockets hold it
                self._push(t, *event)
            self._tick_at[a] = t
            self._push(t, _TICK, a, 0, b"")
        elif data == b"cut":
            self._cut |= {a * self.size + b, b * self.size + a}
        else:
            self._cut -= {a * self.size + b, b * self.size + a}
            for x, y in ((a, b), (b, a)):
                for frame in self._held.pop(x * self.size + y, []):
                    if frame:
                        self._send(x, y, frame)
                    else:
                        self._push(t + self.delay_s, _HANGUP, x, y, b"")

    def _after(self, m: int, rescheduling: bool, ticked: bool = False) -> None:
        watch = self.members[m]
        if watch.outbox:
            for peer, frame in watch.outbox:
                if frame is BEAT:
                    self.beats[m] += 1
                self._send(m, peer, frame)
            watch.outbox = []
        if watch.news_lost:
            for target in watch.news_lost:
                self.declared.setdefault(target, {}).setdefault(m, self.now)
            watch.news_lost = {}
        if watch.news_left:
            for target in watch.news_left:
                self.departed.setdefault(target, {}).setdefault(m, self.now)
            watch.news_left = set()
        if rescheduling:
            due = (watch.due() - self._offset[m]) / self._rate[m] + self.rng.random() * self.wake_jitter_s
            if ticked or due < self._tick_at[m]:
                self._tick_at[m] = due = max(due, self.now)
                self._seq += 1
                heapq.heappush(self._queue, (due, self._seq, _TICK, m, 0, b""))

    def _send(self, a: int, b: int, frame: bytes) -> None:
        link = a * self.size + b
        if link in self._cut:
            self._held.setdefault(link, []).append(frame)
            return
        at = self.now + self.delay_s + self.rng.random() * self.jitter_s
        free = self._link_free.get(link, 0.0)
        if at < free:
            at = free  # one link delivers in order
        self._link_free[link] = at
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, _DELIVER, a, b, frame))

    def _push(self, t: float, kind: int, a: int, b: int, data: bytes) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (t, self._seq, kind, a, b, data))

    def _local(self, m: int, t: float) -> float:
        return self._offset[m] + t * self._rate[m]

    # ------------------------------------------------------------- results
    def detections(self) -> List[Detection]:
        """For each injected failure, how long each live member took to declare it."""
        out = []
        failed = {f.member for f in self.failures}
        for f in self.failures:
            d = Detection(f.member, f.kind)
            seen = self.declared.get(f.member, {})
            for m in range(self.size):
                if m in failed:
                    continue
                if m in seen:
                    d.delays.append(seen[m] - f.at)
                else:
                    d.missing += 1
            out.append(d)
        return out

    def false_positives(self) -> List[Tuple[int, int, float]]:
        """(declarer, target, when) for every declaration of a member that was not
        failed (dead, or stopped) at that time."""
        out = []
        for target, by in self.declared.items():
            failures = [f for f in self.failures if f.member == target]
            for m, t in by.items():
                if not any(f.at <= t <= f.until or (f.kind == "kill" and t >= f.at) for f in failures):
                    out.append((m, target, t))
        return out

    def frames_per_member_s(self, seconds: float) -> Tuple[float, float]:
        """(median, max) frames a member sent per second, over ``seconds`` simulated."""
        rates = [w.sent / seconds for w in self.members]
        return statistics.median(rates), max(rates)

    def beats_per_member_s(self, seconds: float) -> Tuple[float, float]:
        rates = [b / seconds for b in self.beats]
        return statistics.median(rates), max(rates)
