"""A discrete-event simulator of the watch protocol: thousands of members in one
process, no sockets, the protocol code itself (``commslayer.detect.watch.Watch``).

Why: the protocol's claims (a loss known everywhere in ``O(log N)`` hops,
constant load per member, no healthy member declared lost under jitter) are
about sizes no test machine holds.  The simulator drives one ``Watch`` per
member exactly as ``commslayer.detect.liveness`` does over TCP (bytes in, ``tick``
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

Given a ``StoreModel``, it also runs the shrink agreement that follows a loss
(``commslayer.agree.agreement``, the code a job runs): each survivor starts it when
it declares the loss, as a job's ranks do when their collective fails, and
its requests go to one simulated store server that serves them one at a time
in arrival order, each costing a fixed time plus a time per byte moved.  A
survivor's wait for the decision blocks on the server (one request, answered
when the key is written or after ``WAIT_SLICE_S``, as ``store.WaitConnection``
does) or, with ``blocking_waits=False``, polls as ``store.wait_for_keys`` does.
Recorded: when the decision was written, when each survivor had it, and the
requests each one sent.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from commslayer.agree import agreement
from commslayer.agree.membership import AWAIT_FAST_S, AWAIT_POLL_MAX_S
from commslayer.agree.store import FIRST_POLL_S, WAIT_SLICE_S, next_pause
from commslayer.detect.watch import BEAT, Topology, Watch

_TICK, _DELIVER, _HANGUP, _KILL, _STOP, _RESUME, _HEAL, _LEAVE = range(8)
_REQUEST, _ANSWER, _WAKE, _SLICE_ENDS = range(8, 12)


@dataclass
class StoreModel:
    """The job's store as the simulator sees it: one server, requests served one at
    a time in arrival order, each taking ``service_s`` plus ``per_byte_s`` for each
    byte of value it moves, ``rtt_s`` there and back on the network."""
    service_s: float = 20e-6
    per_byte_s: float = 1e-9
    rtt_s: float = 0.0002
    blocking_waits: bool = True


@dataclass
class Agreement:
    """What the store saw of one shrink agreement."""
    decided_at: float = float("nan")  # when the decision key was written
    returned: Dict[int, float] = field(default_factory=dict)  # survivor -> when it had the decision
    failed: Dict[int, str] = field(default_factory=dict)  # survivor -> the error that ended its agreement
    requests: Dict[int, int] = field(default_factory=dict)  # member -> requests it sent
    decision: Optional[List[int]] = None
    server_busy_s: float = 0.0


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
                 hosts: Optional[Sequence[object]] = None, store: Optional[StoreModel] = None) -> None:
        self.size = size
        self.rng = random.Random(seed)
        self.topology = Topology.choose(size, k=k, mesh_max=mesh_max, seed=seed, hosts=hosts)
        self.delay_s, self.jitter_s, self.wake_jitter_s = delay_s, jitter_s, wake_jitter_s
        self.now = 0.0
        self._queue: List[Tuple[float, int, int, int, int, Any]] = []
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
        self.peer_timeout_s = peer_timeout_s
        self.store = store
        self.agreement = Agreement()
        self._kv: Dict[str, bytes] = {}
        self._server_free = 0.0
        self._blocked_on: Dict[str, List[Tuple[int, int]]] = {}  # key -> (member, token) waiting on the server
        self._steps: Dict[int, agreement.Steps] = {}  # survivor -> its agreement, while it runs
        self._token: Dict[int, int] = {}  # survivor -> its request in flight (later answers are stale)
        self._waiting: Dict[int, List[Any]] = {}  # survivor -> [WaitFor, when it began, poll pause]
        self._abandoned: Dict[int, int] = {}  # survivor -> the token of a blocking wait it gave up on
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
            elif kind >= _REQUEST:
                self._store_event(kind, a, b, data, t)
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
            if self.store is not None:
                self._lost_news(m)
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

    # ------------------------------------------------------------- the agreement
    def _lost_news(self, m: int) -> None:
        """Member ``m`` declared a loss: it starts the agreement, or, waiting on the
        server for the decision, stops waiting when its view changed (``look_again``)."""
        if m not in self._steps and m not in self.agreement.returned and m not in self.agreement.failed:
            watch = self.members[m]
            self._steps[m] = agreement.after_loss(
                "sim", 1, range(self.size), m, lambda: set(watch.lost), lambda: self._local(m, self.now),
                join_window_s=self.peer_timeout_s, timeout_s=60.0)
            self.agreement.requests.setdefault(m, 0)
            self._step(m, None)
            return
        waiting = self._waiting.get(m)
        if waiting is not None and self.store is not None and self.store.blocking_waits \
                and m not in self._abandoned and waiting[0].look_again():
            self._abandoned[m] = self._token[m]
            self._step(m, False)

    def _step(self, m: int, answer: Any) -> None:
        """Send ``answer`` to ``m``'s agreement and carry out the request it makes next."""
        self._waiting.pop(m, None)
        try:
            request = self._steps[m].send(answer)
        except StopIteration as done:
            self.agreement.returned[m] = self.now
            self.agreement.decision = done.value
            del self._steps[m]
            return
        except agreement.CommError as err:
            self.agreement.failed[m] = str(err)
            del self._steps[m]
            return
        if isinstance(request, agreement.Pause):
            self._push(self.now + request.seconds, _WAKE, m, self._next_token(m), None)
        elif isinstance(request, agreement.WaitFor):
            self._waiting[m] = [request, self.now, FIRST_POLL_S]
            self._wait_once(m)
        else:
            self._request(m, request)

    def _wait_once(self, m: int) -> None:
        request, began, _ = self._waiting[m]
        assert self.store is not None
        left = request.timeout_s - (self.now - began)
        if self.store.blocking_waits and m not in self._abandoned:
            self._request(m, ("wait", request.key, min(WAIT_SLICE_S, left)))
        else:
            self._request(m, ("check", request.key))

    def _waited(self, m: int, written: bool) -> None:
        """The answer to one slice of a wait, or to one poll of it."""
        request, began, pause = self._waiting[m]
        waited = self.now - began
        if written or request.look_again() or waited >= request.timeout_s - 0.001:
            self._step(m, written)
        elif self.store is not None and self.store.blocking_waits and m not in self._abandoned:
            self._wait_once(m)  # the slice ended: the next one
        else:
            self._waiting[m][2] = next_pause(pause, waited, AWAIT_FAST_S, AWAIT_POLL_MAX_S)
            self._push(self.now + pause, _WAKE, m, self._next_token(m), None)

    def _next_token(self, m: int) -> int:
        self._token[m] = self._token.get(m, 0) + 1
        return self._token[m]

    def _request(self, m: int, request: Any) -> None:
        assert self.store is not None
        self._push(self.now + self.store.rtt_s / 2, _REQUEST, m, self._next_token(m), request)

    def _store_event(self, kind: int, m: int, token: int, data: Any, t: float) -> None:
        if kind == _REQUEST:
            self._serve(m, token, data, t)
        elif kind == _SLICE_ENDS:
            self._slice_ends(m, token, data, t)
        elif m in self.dead:
            return
        elif m in self.stopped:
            self.stopped[m].append((kind, m, token, data))
        elif self._abandoned.get(m) == token:  # the end of a wait this member gave up on
            del self._abandoned[m]
        elif token != self._token.get(m) or m not in self._steps:
            return
        elif kind == _WAKE:
            if m in self._waiting:
                self._wait_once(m)
            else:
                self._step(m, None)
        elif m in self._waiting:
            self._waited(m, bool(data))
        else:
            self._step(m, data)

    def _serve(self, m: int, token: int, request: Any, t: float) -> None:
        """The server takes ``request`` from ``m`` at ``t``, after the ones before it."""
        store = self.store
        assert store is not None
        kv, stats = self._kv, self.agreement
        answer: Any = None
        requests, moved = 1, 0
        if isinstance(request, tuple):  # ("check", key) of a poll, or ("wait", key, slice_s)
            answer = request[1] in kv
        elif isinstance(request, agreement.Get):
            answer = kv[request.key]
            moved = len(answer)
        elif isinstance(request, agreement.Read):
            value = kv.get(request.key)
            if value is not None:  # a check, then the get
                requests, moved, answer = 2, len(value), value
        elif isinstance(request, agreement.Append):
            kv[request.key] = kv.get(request.key, b"") + request.value.encode()
            moved = len(request.value)
        elif isinstance(request, agreement.CompareSet):
            held = kv.get(request.key, b"")
            if held == request.expected.encode():
                kv[request.key] = held = request.desired.encode()
            answer, moved = held, len(held)
        elif isinstance(request, agreement.Add):
            answer = int(kv.get(request.key, b"0")) + request.amount
            kv[request.key] = str(answer).encode()
        elif isinstance(request, agreement.Write):
            kv[request.key] = request.value.encode()
            moved = len(request.value)
        stats.requests[m] = stats.requests.get(m, 0) + requests
        done = self._busy(t, requests * store.service_s + moved * store.per_byte_s)
        key = getattr(request, "key", None)
        if isinstance(request, agreement.CompareSet) and request.key.endswith("/decision") \
                and stats.decided_at != stats.decided_at:
            stats.decided_at = done  # the first decision (nan until then)
        if key is not None and key in self._blocked_on and key in kv:  # written: the blocked waits are answered
            for waiter, waiter_token in self._blocked_on.pop(key):
                self._push(self._busy(done, store.service_s) + store.rtt_s / 2, _ANSWER, waiter, waiter_token, True)
        if isinstance(request, tuple) and request[0] == "wait" and not answer:
            self._blocked_on.setdefault(request[1], []).append((m, token))
            self._push(t + request[2], _SLICE_ENDS, m, token, request[1])
        else:
            self._push(done + store.rtt_s / 2, _ANSWER, m, token, answer)

    def _slice_ends(self, m: int, token: int, key: str, t: float) -> None:
        """A blocking wait's slice ends unanswered: the client cancels it (one request)."""
        assert self.store is not None
        blocked = self._blocked_on.get(key, [])
        if (m, token) in blocked:
            blocked.remove((m, token))
            self.agreement.requests[m] += 1
            self._push(self._busy(t, self.store.service_s) + self.store.rtt_s / 2, _ANSWER, m, token, False)

    def _busy(self, t: float, cost: float) -> float:
        """The server spends ``cost`` on a request that reached it at ``t``: when it is done."""
        self._server_free = max(t, self._server_free) + cost
        self.agreement.server_busy_s += cost
        return self._server_free

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

    def _push(self, t: float, kind: int, a: int, b: int, data: Any) -> None:
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
