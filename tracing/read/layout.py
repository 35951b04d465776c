"""The timeline of one rank, laid out while the scan reads its records (the
reading pass of ``analysis.JobScan`` with ``detail`` set): each op in a lane of
its communicator, compactly, and the records of the ops the page may show in
detail (the latest ``budget`` completed ones and every one that did not
complete), so that the view never reads a trace twice.

Times are on the scan's anchor axis (the rank's first-life monotonic clock
plus its wall-clock anchor, before the alignment): the lanes and which ops
are the latest do not depend on the alignment, which is known only once
every rank is read.

Imports neither torch nor commslayer.
"""

from __future__ import annotations

from array import array
from itertools import accumulate, compress
from operator import sub
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from tracing.read.traceio import RankSource, TraceFileError, tail_ends

# The fields of a record the page shows (the rest is left here: the records travel from the readers).
DETAIL_FIELDS = ("op", "seq", "comm", "comm_id", "state", "duration_ms", "dtype", "in_bytes", "out_bytes", "reduce_op",
                 "root", "peer", "async_op", "timeout_s", "thread", "call_site", "life", "error")
OPEN = (1 << 63) - 1  # the end of an op without one until the trace's end is known (after every real time)


def lane_positions(starts: Sequence[int], ends: Sequence[int]) -> List[List[int]]:
    """The lanes of intervals given in start order, first fit (an interval goes in the
    first lane whose last interval ended by its start; a new lane when none did), as
    the positions of each lane's intervals."""
    lane_ends: List[int] = []
    lanes: List[List[int]] = []
    for j, (start, end) in enumerate(zip(starts, ends)):
        for k, last in enumerate(lane_ends):
            if last <= start:
                lane_ends[k] = end
                lanes[k].append(j)
                break
        else:
            lane_ends.append(end)
            lanes.append([j])
    return lanes


def life_ends(src: RankSource, shift: int, t_end: int) -> Dict[int, int]:
    """The end of each life of a restarted rank (empty for one never restarted):
    its last op's end, the first-life clock moved by ``shift``; ``t_end`` for the last."""
    spans = [(life.life, life.span) for life in [src, *src.lives] if src.lives and life.span is not None]
    return {life: (span[1] + shift if i + 1 < len(spans) else t_end) for i, (life, span) in enumerate(spans)}


@dataclass
class Lane:
    """The ops of one lane of a communicator, in start order: their starts, draw
    indices (by communicator, then start, over the rank), and the running sum of
    their durations (``busy[j]``: the first ``j`` ops'; an op without an end counts 0)."""

    uid: str
    number: int   # the lane in its communicator
    name: str     # the communicator's name
    start: array
    draw: array
    busy: array

    def end(self, j: int) -> int:
        """The end of the lane's ``j``-th op (its start for an op without an end)."""
        return self.start[j] + self.busy[j + 1] - self.busy[j]


@dataclass
class RankLayout:
    """One rank's ops, lane by lane; the ops the page may show in detail: ``records``."""

    lanes: List[Lane]
    count: int                                          # ops in all
    latest: List[int]                                   # the latest ``budget`` ends of ops that have one
    records: Dict[int, Dict[str, Any]] = field(repr=False)  # draw index -> DETAIL_FIELDS of a record: the latest
                                                            # completed, and:
    incomplete: Set[int] = field(default_factory=set)       # draw indices of the ops that did not complete
    open_life: Dict[int, int] = field(default_factory=dict)  # draw index -> life, of the ops without an end
    at: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # draw index -> (lane, position), of ``records``


class LayoutBuilder:
    """Collects one rank's ops as the scan reads them (``add``), then lays them out (``finish``)."""

    def __init__(self, budget: int, life: int) -> None:
        self.budget, self.life = budget, life
        self.by_comm: Dict[str, List[Tuple[int, int, int]]] = {}   # uid -> (start, end, index as added)
        self.names: Dict[str, str] = {}                            # uid -> its name (the first record's)
        self.count = 0
        self.open: Dict[int, int] = {}                             # index -> life, of the ops without an end
        self.incomplete: Dict[int, Dict[str, Any]] = {}            # index -> record, of the ops not completed
        self.latest: List[Tuple[int, int, Dict[str, Any]]] = []    # (end, index, record): the latest completed
        self.floor = -1  # a completed op that ended before this is not among them (``tail_floor``; a cut of ``latest``)

    def add(self, uid: str, name: Optional[str], start: int, end: int, completed: bool, record: Dict[str, Any]) -> None:
        """One op (``end`` < 0: none recorded)."""
        i = self.count
        self.count = i + 1
        ops = self.by_comm.get(uid)
        if ops is None:
            ops = self.by_comm[uid] = []
            self.names[uid] = name or uid
        if end < 0:
            ops.append((start, OPEN, i))
            self.open[i] = record.get("life", self.life)
            self.incomplete[i] = record
            return
        ops.append((start, end, i))
        if not completed:
            self.incomplete[i] = record
        elif end >= self.floor:
            latest = self.latest
            latest.append((end, i, record))
            if len(latest) >= 2 * self.budget:  # keep the latest ``budget`` (cheap when they come in order)
                latest.sort()
                del latest[:-self.budget]
                self.floor = latest[0][0]

    def tail_floor(self, src: RankSource) -> Optional[int]:
        """For a rank of one life with JSON lines, a lower bound of the ``budget``-th latest
        end from the file's last lines (its clock, for ``floor``), so that the records read
        long before that end are not held (reading follows the order in which ops ended)."""
        if src.lives or not src.jsonl_path:
            return None
        try:
            ends = tail_ends(src.jsonl_path, self.budget, src.jsonl_offset)
        except TraceFileError:
            return None
        return sorted(ends)[-self.budget] if len(ends) >= self.budget else None

    def finish(self, src: RankSource, shift: int) -> RankLayout:
        """The layout, once every record of rank ``src`` was added (its lives' spans known;
        ``shift``: first-life clock to the anchor axis)."""
        ends = life_ends(src, shift, OPEN)
        self.latest.sort()
        keep = dict(self.incomplete)
        keep.update((i, r) for _, i, r in self.latest[-self.budget:])
        lanes: List[Lane] = []
        at: Dict[int, Tuple[int, int]] = {}  # index as added -> (lane, position) of the kept ops
        draw: Dict[int, int] = {}            # index as added -> draw index, of the kept ops
        count, finite = 0, array("q")
        for uid in sorted(self.by_comm):
            spans = self.by_comm[uid]
            if self.open:  # an op left open by a life that ended is drawn to that life's end
                spans = [(s, max(s, ends.get(self.open[i], OPEN)) if i in self.open else e, i) for s, e, i in spans]
            spans.sort()
            ss, es, ii = zip(*spans)
            durations = list(map(sub, es, ss))
            if self.open and not self.open.keys().isdisjoint(ii):
                for j, i in enumerate(ii):
                    if i in self.open:
                        durations[j] = 0
                finite.extend(e for e, i in zip(es, ii) if i not in self.open)
            else:
                finite.extend(es)
            kept = set(compress(range(len(ii)), map(keep.__contains__, ii)))  # positions, in start order
            draw.update((ii[j], count + j) for j in kept)
            for k, mine in enumerate(lane_positions(ss, es)):
                at.update((ii[mine[p]], (len(lanes), p)) for p in compress(range(len(mine)), map(kept.__contains__, mine)))
                lanes.append(Lane(uid, k, self.names[uid], array("q", map(ss.__getitem__, mine)),
                                  array("i", map(count.__add__, mine)),
                                  array("q", accumulate(map(durations.__getitem__, mine), initial=0))))
            count += len(ss)
        shown = {draw[i]: {k: r.get(k) for k in DETAIL_FIELDS} for i, r in keep.items()}
        return RankLayout(lanes, count, sorted(finite)[-self.budget:], shown,
                          {draw[i] for i in self.incomplete}, {draw[i]: life for i, life in self.open.items()},
                          {draw[i]: at[i] for i in keep})
