"""The watch protocol of liveness: who watches whom, when a member counts as
lost, and how a loss reaches every member, as a state machine with no sockets
and no clock of its own.

Why a state machine: ``commslayer.detect.liveness`` drives it over TCP, and the
simulator (``launch/bench/simulate_watch.py``) drives the very same code over
simulated links with thousands of members in one process, so what the
simulator measures is the protocol that runs.

**Topology.**  In a small member set every member watches every other (the
full mesh: a loss is seen first-hand by everyone).  Above
``COMMSLAYER_FULL_MESH_MAX`` members, each member watches ``k`` peers
(``COMMSLAYER_WATCH_PEERS``): the member set is laid out on ``k`` cycles
with no edge in common, and each member watches its successor on each
cycle.  So every member has ``k`` distinct watchers and at most ``2k``
connections, whatever the size.  The first cycle interleaves hosts, and the
others avoid same-host edges, so that watchers sit on other hosts where hosts
are known.  The other ``k - 1`` cycles are random (seeded by the member set's
label, the same on every member); the union of random cycles is an expander,
so a message flooded over the connections reaches every member in
``O(log N)`` hops, and losing a few members does not disconnect the rest.

**Evidence.**  A watcher reports a peer when its connection ends or when
its heartbeats stop for the peer timeout.  A member declares a peer lost when

* it saw its own connection to the peer hung up: only the peer's own kernel
  closes it cleanly, so the process is gone, and no slow watcher can make
  that up; or
* two observers reported it (silence, a connection that broke, which a cut
  link can cause, or a hang-up: another member's word for one is a claim like
  any other, and in a real loss every member connected to the peer sees its
  own hang-up at the same moment), or
* every observer of the peer still alive reported it (one, in a set of two),
  or
* one report stood for ``confirm_s`` and no observer refuted it.

A watcher that hears from a reported peer after another member's report of
it, whatever its cause (or the reported peer itself, if it hears of it),
refutes that report.  So one slow or cut-off
watcher cannot get a healthy member declared lost: its report waits for a
second, and the peer's other watchers refute it.  Nor can one member that
lies: in the full mesh nothing is forwarded, so a report, a refutation or a
departure counts only from the member it names, on that member's own
connection (anything else is dropped and counted in ``refused``), and a lie
that rank X hung up is one report, refuted at X's next heartbeat.  Above the
full mesh, a report forwarded by a member is taken in its observer's name
unchecked (nothing signs it): two lying reports in two names are enough
there, which ``docs/recovery.md`` lists as a limit.

**Bounded state.**  Whatever peers send, the tables hold at most one entry
per (peer, observer) pair of the topology: a flooded frame is known by the
highest serial seen from its observer, not by a set of every frame seen.

**Spreading.**  Reports, refutations and departures (a member's goodbye)
are flooded: each member forwards each one once to its neighbours (in the
full mesh its author sends it to everyone, and nobody forwards).  Every
member thus sees the same evidence and comes to the same conclusion, with
``O(k)`` messages per member per event.  Heartbeats go from each member to its
watchers only: ``k / heartbeat_s`` messages a second per member.
"""

from __future__ import annotations

import logging
import random
import struct
import zlib
from typing import Dict, List, Optional, Sequence, Set, Tuple

log = logging.getLogger("commslayer")

BEAT = b"."
BYE = b"B"
_REPORT = struct.Struct("!cIIIBI")  # b"R", target, observer, observer's serial, how, silence in ms
_REFUTE = struct.Struct("!cIIII")   # b"A", target, refuter, observer refuted, that report's serial
_LEFT = struct.Struct("!cI")        # b"L", the member that said goodbye
_SIZES = {b"R"[0]: _REPORT.size, b"A"[0]: _REFUTE.size, b"L"[0]: _LEFT.size}

HUNG_UP, BROKEN, SILENT = 0, 1, 2  # how an observer found a peer lost
_HOW = {HUNG_UP: "its process exited (connection closed)", BROKEN: "its connection broke"}


def how_text(how: int, silent_ms: int) -> str:
    """A report's cause as the error names it."""
    if how == SILENT:
        return f"no heartbeat for {silent_ms / 1000:.2f}s (stopped or hung)"
    return _HOW[how]


class Topology:
    """Who watches whom in a member set of ``size`` members (ranks ``0..size-1``).

    ``watches(r)``: the peers whose heartbeats ``r`` checks; ``watchers(r)``: the
    peers that check ``r``'s (``r`` sends its heartbeats to them);
    ``neighbours(r)``: every peer ``r`` holds a connection to."""

    def __init__(self, size: int, cycles: Optional[List[List[int]]] = None) -> None:
        self.size = size
        self.cycles = cycles  # None: the full mesh
        self._cache: Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]] = {}
        if cycles is not None:
            successors: List[List[int]] = [[] for _ in range(size)]
            predecessors: List[List[int]] = [[] for _ in range(size)]
            for cycle in cycles:
                for i, a in enumerate(cycle):
                    b = cycle[(i + 1) % size]
                    successors[a].append(b)
                    predecessors[b].append(a)
            for r in range(size):
                watches, watchers = tuple(dict.fromkeys(successors[r])), tuple(dict.fromkeys(predecessors[r]))
                self._cache[r] = (watches, watchers, tuple(dict.fromkeys(watches + watchers)))

    @property
    def full_mesh(self) -> bool:
        return self.cycles is None

    @property
    def digest(self) -> int:
        """A checksum of who watches whom: members that chose differently (their
        ``COMMSLAYER_WATCH_PEERS``, ``COMMSLAYER_FULL_MESH_MAX`` or host layouts
        differ) find out when they connect (``commslayer.detect.liveness``)."""
        if self.cycles is None:
            return zlib.crc32(struct.pack("!I", self.size))
        return zlib.crc32(struct.pack(f"!{self.size * len(self.cycles) + 1}I", self.size,
                                      *(m for cycle in self.cycles for m in cycle)))

    @property
    def degree(self) -> int:
        """How many peers each member watches."""
        return self.size - 1 if self.cycles is None else len(self.cycles)

    def _lists(self, r: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
        lists = self._cache.get(r)
        if lists is None:  # the full mesh, built per member on demand
            others = tuple(p for p in range(self.size) if p != r)
            lists = self._cache[r] = (others, others, others)
        return lists

    def watches(self, r: int) -> Tuple[int, ...]:
        return self._lists(r)[0]

    def watchers(self, r: int) -> Tuple[int, ...]:
        return self._lists(r)[1]

    def neighbours(self, r: int) -> Tuple[int, ...]:
        return self._lists(r)[2]

    @classmethod
    def choose(cls, size: int, *, k: int, mesh_max: int, seed: int,
               hosts: Optional[Sequence[object]] = None) -> "Topology":
        """The full mesh up to ``mesh_max`` members (or where ``k`` disjoint cycles do not
        fit: fewer than ``2k + 1`` members, or a few more and the search finds none),
        else ``k`` cycles (see the module doc)."""
        if size <= mesh_max or size < 2 * k + 1 or k < 1:
            return cls(size)
        try:
            return cls(size, _disjoint_cycles(size, k, random.Random(seed), hosts))
        except ValueError:  # only near 2k + 1 members, where the mesh costs about as much
            return cls(size)


def _disjoint_cycles(size: int, k: int, rng: random.Random,
                     hosts: Optional[Sequence[object]]) -> List[List[int]]:
    """``k`` cycles through ``0..size-1`` with no edge in common, the first one
    interleaving hosts, the others random and avoiding same-host edges where they can."""
    first = _interleaved(size, hosts)
    edges = {frozenset(p) for p in zip(first, first[1:] + first[:1])}
    cycles = [first]
    for _ in range(1, k):
        cycle = _random_cycle(size, rng, edges, hosts)
        edges |= {frozenset(p) for p in zip(cycle, cycle[1:] + cycle[:1])}
        cycles.append(cycle)
    return cycles


def _interleaved(size: int, hosts: Optional[Sequence[object]]) -> List[int]:
    """The members in an order that takes one from each host in turn."""
    if hosts is None:
        return list(range(size))
    by_host: Dict[object, List[int]] = {}
    for r in range(size):
        by_host.setdefault(hosts[r], []).append(r)
    groups = sorted(by_host.values(), key=len, reverse=True)
    return [g[i] for i in range(len(groups[0])) for g in groups if i < len(g)]


def _random_cycle(size: int, rng: random.Random, taken: Set[frozenset],
                  hosts: Optional[Sequence[object]]) -> List[int]:
    """A random cycle that uses no edge of ``taken`` and, where it can, no same-host edge:
    a local search that swaps a member at the end of a bad edge with a random other
    member whenever that leaves fewer bad edges around the two (or as many, at random)."""
    def bad(a: int, b: int, hosts: Optional[Sequence[object]]) -> bool:
        return frozenset((a, b)) in taken or (hosts is not None and hosts[a] == hosts[b])

    for strict in ((True, False) if hosts is not None else (False,)):
        use_hosts = hosts if strict else None
        cycle = list(range(size))
        rng.shuffle(cycle)

        def bad_at(e: int) -> bool:  # the edge from position e to the next
            return bad(cycle[e % size], cycle[(e + 1) % size], use_hosts)

        wrong = {e for e in range(size) if bad_at(e)}
        for _ in range(200 * size):
            if not wrong:
                return cycle
            e = rng.choice(sorted(wrong)) if len(wrong) < 64 else next(iter(wrong))
            j, other = (e + 1) % size, rng.randrange(size)
            if other == j:
                continue
            around = {e, j, (other - 1) % size, other}
            before = sum(bad_at(x) for x in around)
            cycle[j], cycle[other] = cycle[other], cycle[j]
            after = sum(bad_at(x) for x in around)
            if after > before or (after == before and rng.random() < 0.5):
                cycle[j], cycle[other] = cycle[other], cycle[j]
                continue
            for x in around:
                (wrong.add if bad_at(x) else wrong.discard)(x)
    raise ValueError(f"no cycle of {size} members avoids the {len(taken)} edges taken")


class Watch:
    """One member's side of the protocol. The driver feeds it what arrives
    (``received``, ``hung_up``) and calls ``tick`` once ``due()`` has come; after
    each call, it sends ``outbox`` (``(peer, frame)`` pairs) and acts on
    ``news_lost`` (peer -> why) and ``news_left``, then clears them (``take``)."""

    def __init__(self, me: int, topology: Topology, *, heartbeat_s: float, peer_timeout_s: float, now: float,
                 confirm_s: Optional[float] = None) -> None:
        self.me = me
        self.topology = topology
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.confirm_s = peer_timeout_s / 2 if confirm_s is None else confirm_s
        self.neighbours = topology.neighbours(me)
        self._watchers = topology.watchers(me)
        self._last_seen: Dict[int, float] = {p: now for p in topology.watches(me)}
        self._buffers: Dict[int, bytes] = {}
        self._serial = 0
        self._reported: Dict[int, int] = {}  # peers this member reported, not heard from since -> serial
        self._reports: Dict[int, Dict[int, Tuple[int, int, int, float]]] = {}  # target -> observer -> report
        self._latest: Dict[Tuple[int, int], int] = {}  # (target, observer) -> highest report serial seen
        self._refuted: Dict[Tuple[int, int], int] = {}  # (target, observer) -> highest serial refuted
        self._early: Dict[Tuple[int, int], Tuple[int, int]] = {}  # a refutation ahead of its report: serial, refuter
        self._vouch: Dict[int, Dict[int, int]] = {}  # target -> observer -> serial, to refute at its next beat
        self._refused_from: Set[int] = set()  # neighbours whose refused frames were logged already
        self.refused = 0  # frames dropped because the member that sent them may not say that
        self.lost: Dict[int, str] = {}
        self.left: Set[int] = set()
        self.outbox: List[Tuple[int, bytes]] = []
        self.news_lost: Dict[int, str] = {}
        self.news_left: Set[int] = set()
        self._next_beat = now
        self._last_tick = now
        self.sent = 0  # frames this member sent, counting each peer

    # ------------------------------------------------------------- inputs
    def received(self, peer: int, data: bytes, now: float) -> None:
        """Bytes that arrived from neighbour ``peer``."""
        if data == BEAT and peer not in self._buffers:
            self._beat(peer, now)
            return
        buf = self._buffers.pop(peer, b"") + data
        i = 0
        while i < len(buf):
            tag = buf[i]
            if tag == BEAT[0]:
                self._beat(peer, now)
                i += 1
                continue
            if tag == BYE[0]:
                self._departed(peer, None)
                i += 1
                continue
            size = _SIZES.get(tag)
            if size is None:
                log.warning("commslayer liveness: rank %d sent a frame this version does not know (%r); "
                            "dropping the rest of what it sent", peer, buf[i:i + 8])
                return
            if len(buf) - i < size:
                break
            self._frame(peer, buf[i:i + size], now)
            i += size
        if i < len(buf):
            self._buffers[peer] = buf[i:]

    def hung_up(self, peer: int, now: float, how: int = HUNG_UP) -> None:
        """The connection to neighbour ``peer`` ended."""
        self._buffers.pop(peer, None)
        mine = self._reports.get(peer, {}).get(self.me)
        if peer not in self.left and peer not in self.lost and (mine is None or mine[0] != HUNG_UP):
            self._report(peer, how, 0, now)  # a hang-up after a report of silence is news: it is stronger

    def tick(self, now: float) -> None:
        """Send the heartbeats due; report watched peers silent for the peer timeout;
        confirm reports that stood unrefuted for ``confirm_s``."""
        if now - self._last_tick > self.heartbeat_s + self.peer_timeout_s / 2:
            # This process was stopped itself (or starved): the silence is ours, not the peers'.
            for p in self._last_seen:
                self._last_seen[p] = now
        self._last_tick = now
        if now >= self._next_beat:
            for p in self._watchers:
                if p not in self.left:  # lost ones too: one stopped for a while must not take us for lost
                    self._send(p, BEAT)
            self._next_beat = now + self.heartbeat_s
        for p, seen in list(self._last_seen.items()):  # a report can end in a loss, which forgets the peer
            if now - seen > self.peer_timeout_s and p not in self._reported and p not in self.left:
                self._report(p, SILENT, int((now - seen) * 1000), now)
        for target in [t for t in self._reports if t not in self.lost]:
            self._judge(target, now)

    def due(self) -> float:
        """When ``tick`` must run next."""
        due = self._next_beat
        for p, seen in self._last_seen.items():
            if p not in self._reported:
                due = min(due, seen + self.peer_timeout_s)
        for reports in self._reports.values():
            if reports:
                due = min(due, min(r[3] for r in reports.values()) + self.confirm_s)
        return due

    def goodbye(self) -> None:
        """Tell every neighbour, lost ones too, that this member leaves on purpose (a
        stopped one reads it when it resumes, and so learns it was left behind)."""
        for p in self.neighbours:
            if p not in self.left:
                self._send(p, BYE)

    def take(self) -> Tuple[List[Tuple[int, bytes]], Dict[int, str], Set[int]]:
        """What to send, who was found lost (-> why) and who left, since the last call."""
        out, lost, left = self.outbox, self.news_lost, self.news_left
        self.outbox, self.news_lost, self.news_left = [], {}, set()
        return out, lost, left

    # ------------------------------------------------------------ the rules
    def _send(self, peer: int, frame: bytes) -> None:
        self.outbox.append((peer, frame))
        self.sent += 1

    def _flood(self, frame: bytes, source: Optional[int]) -> None:
        if source is not None and self.topology.full_mesh:
            return  # its author sent it to every member already
        for p in self.neighbours:
            if p != source and p not in self.lost and p not in self.left:
                self._send(p, frame)

    def _beat(self, peer: int, now: float) -> None:
        if peer in self._last_seen:
            self._last_seen[peer] = now
        if peer in self._reported:  # heard again after reporting it: take the report back
            self._vouch.setdefault(peer, {})[self.me] = self._reported.pop(peer)
        pending = self._vouch.pop(peer, None)
        if pending and peer not in self.lost:
            for observer, serial in sorted(pending.items()):
                self._refute(peer, observer, serial, source=None)

    def _report(self, target: int, how: int, silent_ms: int, now: float) -> None:
        self._serial += 1
        self._reported[target] = self._serial
        self._take_report(target, self.me, self._serial, how, silent_ms, now, source=None)

    def _frame(self, peer: int, frame: bytes, now: float) -> None:
        tag = frame[:1]
        size = self.topology.size
        if tag == b"R":
            _, target, observer, serial, how, silent_ms = _REPORT.unpack(frame)
            if (target < size and observer in self.topology.neighbours(target) and how in (HUNG_UP, BROKEN, SILENT)
                    and self._author_may(peer, observer, "a report", frame)):
                self._take_report(target, observer, serial, how, silent_ms, now, source=peer)
        elif tag == b"A":
            _, target, refuter, observer, serial = _REFUTE.unpack(frame)
            if (target < size and (refuter == target or refuter in self.topology.watchers(target))
                    and observer in self.topology.neighbours(target)
                    and self._author_may(peer, refuter, "a refutation", frame)):
                self._refute(target, observer, serial, source=peer, refuter=refuter)
        else:
            _, target = _LEFT.unpack(frame)
            if target < size and self._author_may(peer, None, "a departure", frame):
                self._departed(target, peer)

    def _author_may(self, peer: int, author: Optional[int], what: str, frame: bytes) -> bool:
        """Whether ``peer`` may pass on ``frame``, written by ``author`` (None: a departure,
        which its author says with a goodbye): anyone above the full mesh, where frames are
        forwarded; in the full mesh only the author itself."""
        if author == peer or not self.topology.full_mesh:
            return True
        self.refused += 1
        if peer not in self._refused_from:
            self._refused_from.add(peer)
            log.warning("commslayer liveness: rank %d sent %s in another member's name in the full mesh (%r); "
                        "dropped, and so is every such frame from it (counted, not logged)", peer, what, frame)
        return False

    def _take_report(self, target: int, observer: int, serial: int, how: int, silent_ms: int, now: float,
                     source: Optional[int]) -> None:
        if serial <= self._latest.get((target, observer), 0) or (observer == self.me and source is not None):
            return  # seen already, older than one seen, or in this member's name (which knows its own)
        self._latest[target, observer] = serial
        if target in self.left or target in self.lost or serial <= self._refuted.get((target, observer), 0):
            return
        self._flood(_REPORT.pack(b"R", target, observer, serial, how, silent_ms), source)
        if target == self.me:  # reported, and alive to read it: refute at once
            self._refute(self.me, observer, serial, source=None)
            return
        reports = self._reports.setdefault(target, {})
        since = reports[observer][3] if observer in reports else now  # its grace began with its first report
        reports[observer] = (how, silent_ms, serial, since)
        if observer != self.me and target in self._last_seen:  # vouch at its next beat
            self._vouch.setdefault(target, {})[observer] = serial
        early = self._early.pop((target, observer), None)
        if early is not None and early[0] == serial:
            self._refute(target, observer, serial, source=None, refuter=early[1])
        self._judge(target, now)

    def _refute(self, target: int, observer: int, serial: int, source: Optional[int],
                refuter: Optional[int] = None) -> None:
        refuter = self.me if refuter is None else refuter
        if serial <= self._refuted.get((target, observer), 0):
            return  # refuted already
        if serial > self._latest.get((target, observer), 0):  # ahead of its report (a faster path): it waits for
            self._early[target, observer] = (serial, refuter)  # that one report only, so a made-up serial bars nothing
            return
        self._refuted[target, observer] = serial
        self._flood(_REFUTE.pack(b"A", target, refuter, observer, serial), source)
        reports = self._reports.get(target)
        if reports and observer in reports and reports[observer][2] == serial:
            del reports[observer]

    def _judge(self, target: int, now: float) -> None:
        reports = self._reports.get(target)
        if not reports or target in self.lost:
            return
        alive = [o for o in self.topology.neighbours(target) if o not in self.lost and o not in self.left]
        mine = reports.get(self.me)
        if (len(reports) >= min(2, max(1, len(alive))) or (mine is not None and mine[0] == HUNG_UP)
                or now - min(r[3] for r in reports.values()) >= self.confirm_s):
            self._declare(target, reports, now)

    def _declare(self, target: int, reports: Dict[int, Tuple[int, int, int, float]], now: float) -> None:
        mine = reports.get(self.me)
        if mine is not None:
            why = how_text(mine[0], mine[1])
        else:
            observer = min(reports)
            how, silent_ms = reports[observer][:2]
            why = f"{how_text(how, silent_ms)}, seen by rank {observer}"
        self.lost[target] = why
        self.news_lost[target] = why
        del self._reports[target]
        self._last_seen.pop(target, None)
        self._vouch.pop(target, None)
        for other in [t for t in self._reports if t not in self.lost]:  # fewer observers left to agree
            self._judge(other, now)

    def _departed(self, target: int, source: Optional[int]) -> None:
        if target == self.me or target in self.left or target in self.lost:
            return
        self.left.add(target)
        self.news_left.add(target)
        self._last_seen.pop(target, None)
        self._reports.pop(target, None)
        if not self.topology.full_mesh:  # in the full mesh its goodbye reached every member
            self._flood(_LEFT.pack(b"L", target), source)
