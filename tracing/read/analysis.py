"""What the viewer computes from a job's records: overlap, clock alignment,
the summary tables and the diagnosis.

Everything here works on record dicts as the trace format defines them
(``tracing.records``), streamed rank by rank from ``tracing.read.traceio``; a
``JobScan`` keeps only compact per-collective facts, so 16 ranks x 100,000
records fit in a few hundred MB.  docs/viewer.md gives every formula.

Imports neither torch nor commslayer.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from array import array
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from itertools import chain, compress
from operator import add, lt
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from tracing.records import COMPLETED, SCHEDULED, STARTED, STATES
from tracing.messages import ended, human_bytes, relative_site, short_error, short_reason
from tracing.read.layout import LayoutBuilder, RankLayout, lane_positions, life_ends
from tracing.read.scan_rows import COMPLETED_CODE, END, ENQ, FP, RANK, SITE, START, STATE, STATE_CODES, WIDTH, arrivals
from tracing.read.story import lineage as lineage_of, recovery_story
from tracing.read.traceio import RankSource, TraceFileError, discover, life_communicators, life_uid, rank_records, rank_rows

RS_OPS = frozenset(("reduce_scatter_single", "reduce_scatter"))
AG_OPS = frozenset(("all_gather_single", "all_gather"))
RS_BACKEND_OPS = frozenset(("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"))
AG_BACKEND_OPS = frozenset(("_allgather_base", "allgather", "allgather_into_tensor_coalesced"))
P2P_OPS = frozenset(("send", "recv", "batch_p2p"))  # not matched across ranks as collectives
UNEVEN_OPS = frozenset(("all_to_all_single", "all_to_all_v_single", "all_gather_v"))  # bytes differ per rank

SPAN_LIMIT = 1 << 62  # ns; a wait time beyond it (either sign) is corrupt and left out


def covered(*spans: "array[int]") -> int:
    """The length (ns) of the union of the half-open intervals held in ``spans``:
    flat arrays of (start, end) pairs (an end before its start counts as empty).

    With the starts and the ends each sorted on their own, the union has a gap
    exactly after the i-th end when it comes before the (i+1)-th start (at a
    point there, i+1 intervals have started and as many ended): the length is
    the whole extent less those gaps, found without a loop in Python."""
    starts = sorted(chain.from_iterable(s[0::2] for s in spans))
    if not starts:
        return 0
    ends = sorted(chain.from_iterable(map(max, s[0::2], s[1::2]) for s in spans))
    gaps = list(map(lt, ends[:-1], starts[1:]))
    return ends[-1] - starts[0] - (sum(compress(starts[1:], gaps)) - sum(compress(ends, gaps)))


@dataclass
class OverlapStats:
    """How one rank's reduce-scatter time overlapped its all-gather time (seconds).

    ``rs_s``/``ag_s``: union of the [start, end] intervals of the rank's
    reduce-scatters / all-gathers that have an end (all communicators).
    ``hidden_rs_s``: the part of ``rs_s`` during which an all-gather was also
    in flight; ``hidden_fraction = hidden_rs_s / rs_s`` (0 without RS).
    ``comm_s``: union of the intervals of all its ops (p2p included).
    ``exposed_comm_s``: the part of ``comm_s`` during which the issuing thread
    was blocked on it: [enqueue, end] of a synchronous op, and [``wait_ns``,
    ``wait_end_ns``] of an async one (the caller's ``Work.wait``; traces
    without these fields count async ops as never waited on), cut to the
    time some op was in flight (a wait that returns late, its thread
    descheduled on a loaded machine, is not communication).
    ``step``: the resilient job's step, for ``overlap_by_step`` (else None).
    """

    rank: int
    rs_count: int
    ag_count: int
    rs_s: float
    ag_s: float
    hidden_rs_s: float
    hidden_fraction: float
    comm_s: float
    exposed_comm_s: float
    step: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        """Plain values, for ``--json``."""
        return asdict(self)


def overlap_by_rank(records: Iterable[Dict[str, Any]]) -> Dict[int, OverlapStats]:
    """Per rank, reduce-scatter/all-gather overlap and exposed communication.

    ``records``: record dicts carrying ``rank``, ``op``, ``backend_op``,
    ``start_ns``, ``end_ns`` (and ``enqueue_ns``/``async_op``/``wait_ns``/
    ``wait_end_ns`` for the exposed time; without them an op counts as
    asynchronous and never waited on).  Times may be raw or aligned: only
    differences within one rank are used.  Ops without an end (still in
    flight) are left out.
    """
    return {key[0]: stats for key, stats in _overlap(records, False).items()}


def overlap_by_step(records: Iterable[Dict[str, Any]]) -> Dict[Tuple[int, int], OverlapStats]:
    """``overlap_by_rank`` per (rank, step), for the records that carry a ``step``
    (those of a resilient job, ``commslayer.resilience``)."""
    return _overlap(records, True)


def op_kind(op: str, backend_op: Optional[str]) -> int:
    """1: a reduce-scatter, 2: an all-gather (by our op name or the backend method), 0: other."""
    return 1 if op in RS_OPS or backend_op in RS_BACKEND_OPS else 2 if op in AG_OPS or backend_op in AG_BACKEND_OPS \
        else 0


class Busy:
    """The intervals of one rank (or one rank's step) that ``OverlapStats`` measures,
    added op by op (the record's times, all on one clock), each kind as a flat
    array of (start, end) pairs."""

    __slots__ = ("rs", "ag", "all", "blocked", "rs_count", "ag_count")

    def __init__(self) -> None:
        self.rs, self.ag, self.all, self.blocked = array("q"), array("q"), array("q"), array("q")
        self.rs_count = self.ag_count = 0

    def add(self, kind: int, start: int, end: int, enqueue: int, async_op: Optional[bool], wait: Any,
            wait_end: Any) -> None:
        """One op that has an end: ``kind`` from ``op_kind``; ``wait``/``wait_end``: its
        ``wait_ns``/``wait_end_ns`` (used when they are integers, for an async op)."""
        span = (start, end)
        self.all.extend(span)
        if async_op is False:
            self.blocked.extend((enqueue, end))
        elif type(wait) is int and type(wait_end) is int and -SPAN_LIMIT < wait < wait_end < SPAN_LIMIT:
            self.blocked.extend((wait, wait_end))
        if kind == 1:
            self.rs.extend(span)
            self.rs_count += 1
        elif kind == 2:
            self.ag.extend(span)
            self.ag_count += 1

    def stats(self, rank: int, step: Optional[int]) -> OverlapStats:
        """The overlap of what was added: the length of an intersection is that of
        each part less that of their union."""
        rs_ns, ag_ns, all_ns = covered(self.rs), covered(self.ag), covered(self.all)
        hidden_ns = rs_ns + ag_ns - covered(self.rs, self.ag)
        blocked_ns = covered(self.blocked)
        exposed_ns = blocked_ns + all_ns - covered(self.blocked, self.all)
        return OverlapStats(rank=rank, rs_count=self.rs_count, ag_count=self.ag_count, rs_s=rs_ns / 1e9,
                            ag_s=ag_ns / 1e9, hidden_rs_s=hidden_ns / 1e9,
                            hidden_fraction=hidden_ns / rs_ns if rs_ns else 0.0, comm_s=all_ns / 1e9,
                            exposed_comm_s=exposed_ns / 1e9, step=step)


def _overlap(records: Iterable[Dict[str, Any]], by_step: bool) -> Dict[Tuple[int, int], OverlapStats]:
    per: Dict[Tuple[int, int], Busy] = {}
    for r in records:
        start, end = r.get("start_ns"), r.get("end_ns")
        if end is None:
            continue
        if start is None:
            start = r.get("enqueue_ns", end)
        step = r.get("step") if by_step else -1
        if type(step) is not int:
            continue
        key = (r["rank"], step)
        busy = per.get(key)
        if busy is None:
            busy = per[key] = Busy()
        busy.add(op_kind(r["op"], r.get("backend_op")), start, end, r.get("enqueue_ns", start), r.get("async_op"),
                 r.get("wait_ns"), r.get("wait_end_ns"))
    return {key: per[key].stats(key[0], key[1] if by_step else None) for key in sorted(per)}


# ---------------------------------------------------------------- one pass over a job

# Ops whose end on any rank needs every rank's start: they bound clock offsets.
SYMMETRIC_OPS = frozenset(("all_reduce", "all_reduce_coalesced", "all_gather_single", "all_gather",
                           "reduce_scatter_single", "reduce_scatter", "all_to_all_single", "barrier"))


def bus_factor(op: str, n: int) -> Optional[float]:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' factors); None: no bandwidth (barrier)."""
    if op == "barrier" or n < 1:
        return None
    if op in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv", "batch_p2p"):
        return 1.0
    return (n - 1) / n  # all_gather*, reduce_scatter*, all_to_all_single, gather, scatter


# S of nccl-tests, the bytes of the whole array an op moves: out_bytes for these, else in_bytes.
_OUT_SIZED = AG_OPS | {"scatter", "recv"}


# What must agree across ranks at one sequence number (bytes: in_bytes; out_bytes for
# scatter; none for UNEVEN_OPS, whose sizes differ per rank legitimately).
FINGERPRINT_FIELDS = ("op", "dtype", "reduce_op", "bytes", "root")


def percentile(sorted_values: List[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[k]


@dataclass
class ClockOffset:
    """A rank's clock against the reference rank, after the wall-clock anchor.

    ``offset_ns`` is subtracted from the rank's times; the true offset lies
    in [``low_ns``, ``high_ns``] (None: no collective shared with the
    reference, the anchor alone is used).  ``consistent`` is False when the
    bounds cross (clock drift, or a trace that breaks the model).
    """

    rank: int
    reference: int
    offset_ns: int
    low_ns: Optional[int]
    high_ns: Optional[int]
    collectives: int
    consistent: bool = True

    @property
    def uncertainty_ns(self) -> Optional[int]:
        """The largest error the estimate can have, from its bounds."""
        if self.low_ns is None or self.high_ns is None:
            return None
        return max(abs(self.offset_ns - self.low_ns), abs(self.high_ns - self.offset_ns))


PARALLEL_BYTES = 32 << 20  # below this, forking readers costs more than it saves


class JobScan:
    """One streaming pass over every rank's records, keeping what the
    summary, the diagnosis, the clock alignment and the exports need."""

    def __init__(self, paths: Sequence[str], *, skip_bad: bool = False, jobs: int = 1,
                 detail: Optional[int] = None) -> None:
        """Read every rank's files under ``paths``.  With ``jobs`` > 1 and more
        than ``PARALLEL_BYTES`` of input, ranks are read in that many contiguous
        rank ranges: the first here, each other one by a forked process, whose
        results are merged here.
        With ``detail`` (the view's), each rank's timeline is laid out and its
        overlap measured in the same pass (``layouts``, ``overlap``,
        ``step_overlap``), keeping the records of about ``detail`` ops of the
        job for their details (``tracing.read.layout``)."""
        self.skip_bad = skip_bad
        self.paths = list(paths)
        self.problems: List[str] = []
        self.sources: Dict[int, RankSource] = discover(paths, skip_bad=skip_bad, problems=self.problems)
        self.detail_budget = None if detail is None else max(1, detail // len(self.sources))
        self._empty_state()
        ranks = sorted(self.sources)
        size = sum(os.path.getsize(p) for src in self.sources.values() for p in src.files)
        jobs = min(jobs, len(ranks))
        if jobs > 1 and size > PARALLEL_BYTES:
            chunks = [ranks[i * len(ranks) // jobs:(i + 1) * len(ranks) // jobs] for i in range(jobs)]
            with ProcessPoolExecutor(jobs - 1, mp_context=multiprocessing.get_context("fork")) as pool:
                parts = [pool.submit(_scan_chunk, [self.sources[r] for r in c], skip_bad, self.detail_budget)
                         for c in chunks[1:]]
                for rank in chunks[0]:  # this process reads the first chunk: its results need no copying
                    self._scan_rank(self.sources[rank])
                for part in parts:
                    self._merge(part.result())
        else:
            for rank in ranks:
                self._scan_rank(self.sources[rank])
        for rank in ranks:
            if not self.sources[rank].files:
                del self.sources[rank]  # every file of it was unusable (skip_bad): it counts as missing
            else:
                self._note_communicators(self.sources[rank])
        if not self.sources:
            raise TraceFileError(", ".join(paths), None, f"no usable trace file: every one was skipped "
                                                         f"({len(self.problems)} problems, the first: "
                                                         f"{self.problems[0] if self.problems else '-'})")
        self.offsets: Dict[int, ClockOffset] = self._align()
        self._note_lives()

    def _empty_state(self) -> None:
        self.communicators: Dict[str, Dict[str, Any]] = {}
        # (comm_id, generation, seq) -> flat array of WIDTH values per rank, ranks in ascending order
        self.collectives: Dict[Tuple[str, int, int], "array[int]"] = {}
        self.coll_ops: Dict[Tuple[str, int, int], str] = {}
        self.fingerprints: Dict[Tuple[Any, ...], int] = {}
        self.call_sites: Dict[str, int] = {}
        # (comm_id, op, bucket) -> [count, sum of S, sum of durations ns, durations in ms]
        self.groups: Dict[Tuple[str, str, int], List[Any]] = {}
        self.last_entered: Dict[Tuple[int, str], Dict[str, Any]] = {}   # (rank, comm_id) -> record
        self.last_completed: Dict[Tuple[int, str], Dict[str, Any]] = {}
        self.last_record: Dict[int, Dict[str, Any]] = {}                 # rank -> record with the largest op_id
        self.unfinished: Dict[int, List[Dict[str, Any]]] = {}            # rank -> records not completed
        self.rank_span: Dict[int, Tuple[int, int]] = {}                  # earliest enqueue, latest end (anchor axis)
        self.layouts: Dict[int, RankLayout] = {}                        # with ``detail``: rank -> its timeline
        self.overlap: Dict[int, OverlapStats] = {}                       # with ``detail``: overlap_by_rank's
        self.step_overlap: Dict[Tuple[int, int], OverlapStats] = {}      # with ``detail``: overlap_by_step's

    def _merge(self, part: "JobScan") -> None:
        """Add a worker's ranks (higher than any read so far) to this scan."""
        self.problems += part.problems
        self.sources.update(part.sources)
        fmap = [self.fingerprints.setdefault(fp, len(self.fingerprints))
                for fp, _ in sorted(part.fingerprints.items(), key=lambda kv: kv[1])]
        smap = [self.call_sites.setdefault(site, len(self.call_sites))
                for site, _ in sorted(part.call_sites.items(), key=lambda kv: kv[1])]
        same_ids = fmap == list(range(len(fmap))) and smap == list(range(len(smap)))
        for key, a in part.collectives.items():
            if not same_ids:
                for i in range(0, len(a), WIDTH):
                    a[i + FP], a[i + SITE] = fmap[a[i + FP]], smap[a[i + SITE]]
            mine = self.collectives.get(key)
            if mine is None:
                self.collectives[key] = a
                self.coll_ops[key] = part.coll_ops[key]
            else:
                mine.extend(a)
        for group_key, g in part.groups.items():
            known = self.groups.get(group_key)
            if known is None:
                self.groups[group_key] = g
            else:
                known[0] += g[0]
                known[1] += g[1]
                known[2] += g[2]
                known[3].extend(g[3])
        for name in ("last_entered", "last_completed", "last_record", "unfinished", "rank_span", "layouts", "overlap",
                     "step_overlap"):
            getattr(self, name).update(getattr(part, name))

    # ------------------------------------------------------------------ reading
    def _scan_rank(self, src: RankSource) -> None:
        # The hot loop of the viewer (once per record): locals, no helper calls.
        rank = src.rank
        fps, sites = self.fingerprints, self.call_sites
        colls, coll_ops, groups = self.collectives, self.coll_ops, self.groups
        entered: Dict[str, Tuple[int, Dict[str, Any]]] = {}    # comm -> (order, record): this rank's last op
        completed: Dict[str, Tuple[int, Dict[str, Any]]] = {}
        no_op = (-1, None)
        out_sized = _OUT_SIZED
        unfinished: List[Dict[str, Any]] = []
        last: Optional[Dict[str, Any]] = None
        last_id = -1
        off: Optional[int] = None
        lo, hi = None, -1  # this rank's earliest enqueue and latest end
        layout = None if self.detail_budget is None else LayoutBuilder(self.detail_budget, src.life)
        floor = None if layout is None else layout.tail_floor(src)
        every = Busy()  # the rank's busy intervals, and per step (a resilient job's records have one)
        steps: Dict[int, Busy] = {}
        for values, r in rank_rows(src, skip_bad=self.skip_bad, problems=self.problems):
            (op_id, name, comm, gen, seq, op, backend_op, reduce_op, dtype, _, _, in_bytes, out_bytes, root, _,
             async_op, _, state, _, enq, start, end, _, _, site, _) = values  # records.RECORD_FIELDS, checked
            if off is None:
                off = src.wall_minus_mono_ns or 0
                lo = enq + off
                if layout is not None and floor is not None:
                    layout.floor = floor + off
            enq += off
            drawn_from = start  # the timeline draws an op from its start, else (also at 0) its enqueue
            start = enq if start is None else start + off
            if end is None:
                end = -1
            else:
                end += off
                if end > hi:
                    hi = end
            if enq < lo:
                lo = enq
            if op_id > last_id:
                last, last_id = r, op_id
            done = state == COMPLETED
            if layout is not None:
                layout.add(comm, name, start if drawn_from else enq, end, done, r)
                if end >= 0:
                    kind, wait, wait_end = op_kind(op, backend_op), r.get("wait_ns"), r.get("wait_end_ns")
                    wait, wait_end = (wait + off if type(wait) is int else wait), \
                        (wait_end + off if type(wait_end) is int else wait_end)
                    every.add(kind, start, end, enq, async_op, wait, wait_end)
                    step = r.get("step")
                    if type(step) is int:
                        b = steps.get(step)
                        if b is None:
                            b = steps[step] = Busy()
                        b.add(kind, start, end, enq, async_op, wait, wait_end)
            if done:
                nbytes = (out_bytes if op in out_sized else in_bytes) or 0
                key = (comm, op, nbytes.bit_length())
                g = groups.get(key)
                if g is None:
                    g = groups[key] = [0, 0, 0, array("d")]
                g[0] += 1
                g[1] += nbytes
                g[2] += end - start
                g[3].append((end - start) / 1e6)
            elif len(unfinished) < 1000:
                unfinished.append(r)
            if op in P2P_OPS:
                continue
            gen = gen or 0
            order = (gen << 40) + seq
            ckey = (comm, gen, seq)
            fp = (op, dtype, reduce_op,
                  None if op in UNEVEN_OPS else out_bytes if op == "scatter" else in_bytes, root)
            fid = fps.get(fp)
            if fid is None:
                fid = fps[fp] = len(fps)
            site = site or "?"
            sid = sites.get(site)
            if sid is None:
                sid = sites[site] = len(sites)
            a = colls.get(ckey)
            if a is None:
                a = colls[ckey] = array("q")
                coll_ops[ckey] = op
            a.extend((rank, enq, start, end, fid, STATE_CODES.get(state, 0), sid))
            if order > entered.get(comm, no_op)[0]:
                entered[comm] = (order, r)
            if done and order > completed.get(comm, no_op)[0]:
                completed[comm] = (order, r)
        for comm, (_, r) in entered.items():
            self.last_entered[(rank, comm)] = r
        for comm, (_, r) in completed.items():
            self.last_completed[(rank, comm)] = r
        if lo is not None:
            self.rank_span[rank] = (lo, max(lo, hi))
        if layout is not None:
            self.layouts[rank] = layout.finish(src, src.wall_minus_mono_ns or 0)
            if every.all:
                self.overlap[rank] = every.stats(rank, None)
            for step, b in sorted(steps.items()):
                self.step_overlap[(rank, step)] = b.stats(rank, step)
        if last is not None:
            self.last_record[rank] = last
        self.unfinished[rank] = sorted(unfinished, key=lambda x: x["op_id"])

    def _note_communicators(self, src: RankSource) -> None:
        """What rank ``src.rank``'s files say about its communicators, merged over ranks."""
        rank = src.rank
        for uid, info in life_communicators(src):
            known = self.communicators.setdefault(uid, {"name": info.get("name"), "backend": info.get("backend"),
                                                        "size": info.get("size"), "global_ranks": None,
                                                        "states": {}, "comm_ranks": {}})
            if info.get("global_ranks") and not known["global_ranks"]:
                known["global_ranks"] = list(info["global_ranks"])
            if info.get("size") and not known["size"]:
                known["size"] = info["size"]
            known["states"][rank] = info.get("state")
            known["comm_ranks"][rank] = info.get("rank")

    def _note_lives(self) -> None:
        """Recovery events and the spans of restarted ranks' lives, on the common axis."""
        self.events: List[Dict[str, Any]] = []                       # with rank, life and t_ns (aligned)
        self.lives: Dict[int, List[Tuple[int, int, int]]] = {}       # rank -> (life, first, last) of each life
        for rank, src in self.sources.items():
            off = self.offsets[rank].offset_ns
            for life in [src, *src.lives]:
                for ev in life.events:
                    if "wall_ns" in ev:
                        uid = ev.get("comm_id")
                        if life.life and uid and not ev.get("generation"):
                            uid = life_uid(uid, life.life)
                        self.events.append(dict(ev, rank=rank, life=life.life, comm_id=uid, t_ns=ev["wall_ns"] - off))
                if src.lives and life.span is not None:
                    base = (src.wall_minus_mono_ns or 0) - off
                    self.lives.setdefault(rank, []).append((life.life, life.span[0] + base, life.span[1] + base))
        self.events.sort(key=lambda e: e["t_ns"])

    def site(self, site: Optional[str], rank: Optional[int] = None) -> Optional[str]:
        """A call site as the viewer shows it: relative to the working directory of
        rank ``rank``'s process (any rank's when None or unknown)."""
        src = self.sources.get(rank) if rank is not None else None
        cwd = src.last_life.cwd if src is not None else None
        if cwd is None:
            cwd = next((s.cwd for s in self.sources.values() if s.cwd), None)
        return relative_site(site, cwd)

    def life_end(self, rank: int, before_ns: int) -> Optional[int]:
        """The end (aligned ns) of rank ``rank``'s last op up to ``before_ns`` when that op
        ended a life of the rank (it was restarted after); else None."""
        spans = [s for s in self.lives.get(rank, ()) if s[2] <= before_ns]
        later = [s for s in self.lives.get(rank, ()) if s[1] > before_ns]
        return spans[-1][2] if spans and later else None

    def life_of(self, rank: int, t_ns: int) -> int:
        """The restart number of the life rank ``rank`` was in at ``t_ns`` (aligned)."""
        src = self.sources.get(rank)
        return max((life for life, lo, _ in self.lives.get(rank, ()) if lo <= t_ns), default=src.life if src else 0)

    # ---------------------------------------------------------------- clocks
    def _align(self) -> Dict[int, ClockOffset]:
        """Per-rank offsets from causality: a symmetric collective cannot end on
        rank A before rank B handed it to the backend.  So for every such op
        both ranks completed, x = e_r - e_ref (the rank's clock error against
        the reference) obeys start_r - end_ref <= x <= end_r - start_ref.  The
        estimate is the smallest correction of the wall-clock anchor that meets
        every bound (0 when the anchor already does), chained through other
        ranks for ranks that share no collective with the reference."""
        bounds: Dict[Tuple[int, int], List[int]] = {}
        for key, a in self.collectives.items():
            if len(a) < 2 * WIDTH or self.coll_ops[key] not in SYMMETRIC_OPS:
                continue
            ref, ref_start, ref_end, ref_state = a[RANK], a[START], a[END], a[STATE]
            if ref_state != COMPLETED_CODE:
                continue
            for i in range(WIDTH, len(a), WIDTH):
                if a[i + STATE] != COMPLETED_CODE:
                    continue
                lo, hi = a[i + START] - ref_end, a[i + END] - ref_start
                b = bounds.get((ref, a[i + RANK]))
                if b is None:
                    bounds[(ref, a[i + RANK])] = [lo, hi, 1]
                else:
                    if lo > b[0]:
                        b[0] = lo
                    if hi < b[1]:
                        b[1] = hi
                    b[2] += 1
        edges: Dict[int, List[Tuple[int, int, int, int]]] = {}
        for (u, v), (lo, hi, n) in bounds.items():
            edges.setdefault(u, []).append((v, lo, hi, n))
            edges.setdefault(v, []).append((u, -hi, -lo, n))
        out: Dict[int, ClockOffset] = {}
        if not self.sources:
            return out
        root = min(self.sources)
        out[root] = ClockOffset(root, root, 0, 0, 0, 0)
        todo = [root]
        while todo:
            u = todo.pop()
            base = out[u]
            for v, lo, hi, n in edges.get(u, ()):
                if v in out:
                    continue
                consistent = lo <= hi
                step = min(max(0, lo), hi) if consistent else (lo + hi) // 2
                assert base.low_ns is not None and base.high_ns is not None  # set for every aligned rank
                out[v] = ClockOffset(v, root, base.offset_ns + step, base.low_ns + lo, base.high_ns + hi, n,
                                     consistent and base.consistent)
                todo.append(v)
        for rank in self.sources:
            if rank not in out:  # shares no collective with the reference's component: anchor only
                out[rank] = ClockOffset(rank, root, 0, None, None, 0)
        return out

    def members(self, uid: str) -> List[int]:
        """Global ranks of communicator ``uid``.  A communicator built on an
        explicit store does not know them; when every rank that recorded it
        holds the same rank in it as in the job, it is taken to span ranks
        0..size-1 (else only the ranks that recorded it are known)."""
        info = self.communicators.get(uid, {})
        if info.get("global_ranks"):
            return sorted(info["global_ranks"])
        seen = info.get("comm_ranks") or {}
        if seen and info.get("size") and all(g == c for g, c in seen.items()):
            return list(range(info["size"]))
        return sorted(set(seen) | {r for (r, c) in self.last_entered if c == uid})

    def span(self) -> Tuple[int, int]:
        """First and last instant of the job's records on the common time axis (wall ns)."""
        if not self.rank_span:
            return (0, 0)
        off = self.offsets
        return (min(lo - off[r].offset_ns for r, (lo, _) in self.rank_span.items()),
                max(hi - off[r].offset_ns for r, (_, hi) in self.rank_span.items()))

    def comm_size(self, uid: str) -> int:
        """Members of communicator ``uid``: from the dumps, else the ranks that recorded it."""
        return self.communicators.get(uid, {}).get("size") or \
            len({r for (r, c) in self.last_entered if c == uid}) or 1

def _scan_chunk(sources: List[RankSource], skip_bad: bool, detail_budget: Optional[int]) -> JobScan:
    """A worker's part of a parallel scan: these ranks only, not yet aligned."""
    part = JobScan.__new__(JobScan)
    part.skip_bad, part.problems, part.detail_budget = skip_bad, [], detail_budget
    part.sources = {src.rank: src for src in sources}
    part._empty_state()
    for src in sources:
        part._scan_rank(src)
    return part


# ---------------------------------------------------------------- timelines

@dataclass
class Slice:
    """One op of one rank on the common time axis, in a lane of its communicator
    (ops of one communicator that overlap in time go to different lanes)."""

    start_ns: int
    end_ns: int
    comm: str
    lane: int
    record: Dict[str, Any]
    in_flight: bool  # no end recorded: drawn up to the end of the trace


def rank_timeline(scan: JobScan, rank: int) -> List[Slice]:
    """Rank ``rank``'s ops (read again from its files) with lanes assigned first-fit.
    An op without an end is drawn to the end of the trace, or of its life when the
    rank was restarted after it (its process is gone)."""
    src = scan.sources[rank]
    off = (src.wall_minus_mono_ns or 0) - scan.offsets[rank].offset_ns
    t_end = scan.span()[1]
    ends = life_ends(src, off, t_end)
    by_comm: Dict[str, List[Tuple[int, int, Dict[str, Any], bool]]] = {}
    for r in rank_records(src, skip_bad=True):
        start = (r.get("start_ns") or r["enqueue_ns"]) + off
        end = r.get("end_ns")
        if end is None:
            end = max(start, ends.get(r.get("life", src.life), t_end))
        else:
            end += off
        by_comm.setdefault(r["comm_id"], []).append((start, end, r, r.get("end_ns") is None))
    out: List[Slice] = []
    for comm in sorted(by_comm):
        ops = sorted(by_comm[comm], key=lambda x: (x[0], x[1]))
        lane_of = [0] * len(ops)
        for lane, mine in enumerate(lane_positions([op[0] for op in ops], [op[1] for op in ops])):
            for j in mine:
                lane_of[j] = lane
        out.extend(Slice(start, end, comm, lane, r, open_) for (start, end, r, open_), lane in zip(ops, lane_of))
    return out


def flow_order(scan: JobScan, key: Tuple[str, int, int]) -> List[int]:
    """The ranks of one collective ordered by the middle of their op on the common
    axis: the order in which a flow arrow links them (empty for an unknown key)."""
    a = scan.collectives.get(key, ())
    mids = []
    for i in range(0, len(a), WIDTH):
        rank, start, end = a[i + RANK], a[i + START], a[i + END]
        mids.append(((start + (start if end < 0 else end)) // 2 - scan.offsets[rank].offset_ns, rank))
    return [rank for _, rank in sorted(mids)]


# ---------------------------------------------------------------- summary

def _bucket_label(bits: int) -> str:
    if bits == 0:
        return "0 B"
    lo, hi = 1 << (bits - 1), 1 << bits
    return f"{human_bytes(lo)}-{human_bytes(hi)}"


def summary(scan: JobScan) -> Dict[str, Any]:
    """Latency and bandwidth per communicator x op x size bucket, straggler
    time per rank and the straggler if one stands out, clock offsets, the
    recovery story (``tracing.read.story``): plain values (times in ms, bandwidth
    in GB/s)."""
    groups = []
    for (comm, op, bits), (count, total_s, total_ns, durs) in sorted(scan.groups.items()):
        info = scan.communicators.get(comm, {})
        n = scan.comm_size(comm)
        ds = sorted(durs)
        algbw = total_s / total_ns if total_ns else None  # bytes per ns = GB/s
        factor = bus_factor(op, n)
        groups.append({
            "comm": comm, "comm_name": info.get("name"), "op": op, "ranks": n,
            "bucket": _bucket_label(bits), "bucket_min_bytes": (1 << (bits - 1)) if bits else 0,
            "bucket_max_bytes": 1 << bits, "count": count, "mean_bytes": total_s / count,
            "total_ms": total_ns / 1e6, "mean_ms": total_ns / 1e6 / count,
            "p50_ms": percentile(ds, 50), "p99_ms": percentile(ds, 99),
            "algbw_gbps": None if factor is None else algbw,
            "busbw_gbps": None if factor is None or algbw is None else algbw * factor,
        })
    rows = stragglers(scan)
    return {
        "ranks": sorted(scan.sources), "problems": list(scan.problems), "recovery": recovery_story(scan),
        "groups": groups, "stragglers": rows, "straggler": straggler(rows),
        "clock": [{"rank": c.rank, "reference": c.reference, "offset_us": c.offset_ns / 1e3,
                   "low_us": None if c.low_ns is None else c.low_ns / 1e3,
                   "high_us": None if c.high_ns is None else c.high_ns / 1e3,
                   "uncertainty_us": None if c.uncertainty_ns is None else c.uncertainty_ns / 1e3,
                   "collectives": c.collectives, "consistent": c.consistent}
                  for c in sorted(scan.offsets.values(), key=lambda c: c.rank)],
    }


def straggler(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The rank that holds the others up, if one stands out: it arrived last at least
    1.5 times as often as chance would have it (1/n of its n-member collectives),
    and more so than any other rank."""
    ranked = sorted((r for r in rows if r["expected_last"]), key=lambda r: r["last_arrivals"] / r["expected_last"],
                    reverse=True)
    if not ranked:
        return None
    top = ranked[0]
    ratio = top["last_arrivals"] / top["expected_last"]
    if ratio < 1.5 or (len(ranked) > 1 and ranked[1]["last_arrivals"] / ranked[1]["expected_last"] == ratio):
        return None
    return {"rank": top["rank"], "last_arrivals": top["last_arrivals"], "collectives": top["collectives"],
            "times_chance": ratio, "others_waited_s": sum(r["wait_s"] for r in rows if r["rank"] != top["rank"])}


def straggler_line(top: Optional[Dict[str, Any]]) -> str:
    """``summary``'s verdict on stragglers, in words."""
    if top is None:
        return "none stands out"
    return (f"rank {top['rank']}: last to arrive in {top['last_arrivals']} of its {top['collectives']} collectives "
            f"({top['times_chance']:.2f}x chance); the other ranks waited {top['others_waited_s']:.3f}s for it in all")


def stragglers(scan: JobScan) -> List[Dict[str, Any]]:
    """Per rank, over the collectives every member recorded: the time it waited
    for the last member to arrive (max aligned enqueue - its own), summed."""
    off = {r: c.offset_ns for r, c in scan.offsets.items()}
    sizes: Dict[str, int] = {}
    last = dict.fromkeys(scan.sources, 0)
    # members -> [collectives, sum of the last arrivals, each member's sum of arrivals]
    by_members: Dict[Tuple[int, ...], List[Any]] = {}
    for (comm, _, _), a in scan.collectives.items():
        n = len(a) // WIDTH
        size = sizes.get(comm)
        if size is None:
            size = sizes[comm] = scan.comm_size(comm)
        if n < 2 or n != size:
            continue
        members, entered = arrivals(a, off)
        latest = max(entered)
        last[max(compress(members, map(latest.__eq__, entered)))] += 1
        sums = by_members.get(members)
        if sums is None:
            sums = by_members[members] = [0, 0, [0] * n]
        sums[0] += 1
        sums[1] += latest
        sums[2] = list(map(add, sums[2], entered))
    wait = dict.fromkeys(scan.sources, 0)
    counted = dict.fromkeys(scan.sources, 0)
    chance = dict.fromkeys(scan.sources, 0.0)  # last arrivals expected if arrival order were random
    for members, (count, latest_sum, entered_sums) in by_members.items():
        for rank, entered_sum in zip(members, entered_sums):
            wait[rank] += latest_sum - entered_sum
            counted[rank] += count
            chance[rank] += count / len(members)
    return [{"rank": r, "collectives": counted[r], "wait_s": wait[r] / 1e9, "last_arrivals": last[r],
             "expected_last": chance[r]} for r in sorted(scan.sources)]


# ---------------------------------------------------------------- diagnosis

def _op_name(r: Dict[str, Any]) -> str:
    return f"{r['op']} #{r['seq']}"


def _where(r: Dict[str, Any], scan: Optional["JobScan"] = None, rank: Optional[int] = None) -> str:
    site = r.get("call_site") if scan is None else scan.site(r.get("call_site"), rank)
    gen = f" generation {r['generation']}" if r.get("generation") else ""
    return f"{_op_name(r)} of '{r['comm']}'{gen} ({r['state']}) at {site or '?'}"


def _ranks(rs: Iterable[int]) -> str:
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


@dataclass
class Finding:
    """One thing wrong (``error``) or worth knowing (``warning``, ``info``)."""

    severity: str
    text: str
    ranks: List[int]


def diagnose(scan: JobScan) -> Dict[str, Any]:
    """Who is stuck where and why: plain values, ``ok`` False when something is wrong."""
    findings: List[Finding] = []
    culprits: Dict[int, str] = {}
    present = set(scan.sources)
    expected = set(present)
    for uid in scan.communicators:
        expected.update(scan.members(uid))
    missing = sorted(expected - present)
    story = recovery_story(scan)
    gone = {r for loss in story["losses"] if loss["recovered"] for r in loss["lost"]}
    for r in missing:
        if r in gone:
            findings.append(Finding("info", f"rank {r} left no trace file: it was lost and the job went on "
                                            "without it", [r]))
            continue
        findings.append(Finding("error", f"rank {r} left no trace file (no dump, no JSON lines): it was killed "
                                         "(SIGKILL) or is still hung (SIGSTOP), or its files were not copied", [r]))
    for r, src in sorted(scan.sources.items()):
        if src.last_life.dump_path is None and src.last_life.jsonl_path is not None:
            findings.append(Finding("warning", f"rank {r} left JSON lines but no dump: it never exited, failed "
                                               "or got SIGTERM/SIGUSR1 (killed, or stopped)", [r]))
    lost: Dict[int, List[int]] = {}
    for r, src in sorted(scan.sources.items()):
        if src.lost_records:
            lost.setdefault(src.lost_records, []).append(r)
    for n, rs in sorted(lost.items()):
        findings.append(Finding("info", f"{_ranks(rs)}: {n} records each are in no file "
                                        "(ring overwritten, queue overflow or failed writes)", rs))
    mismatches = _mismatches(scan, findings, culprits)
    _call_site_splits(scan, findings, story)
    comms = []
    for uid in sorted({k[0] for k in scan.collectives} | set(scan.communicators)):
        comms.append(_diagnose_comm(scan, uid, missing, mismatches, findings, culprits, uid in story["superseded"],
                                    _lost_ranks(story)))
    ranks = []
    for r in sorted(expected):
        source = scan.sources.get(r)
        if source is None:
            seen = [row["from"] for c in comms for row in c["rows"] if row["rank"] == r and row["from"]]
            seen.sort(key=lambda text: "they were in" not in text)  # where the peers found it first
            ranks.append({"rank": r, "files": [], "stands": "no trace file" + (f"; {seen[0]}" if seen else ""),
                          "call_site": None, "reason": None})
            continue
        stuck = scan.unfinished.get(r) or []
        last = scan.last_record.get(r)
        stuck = [x for x in stuck if x["comm_id"] not in story["superseded"]] or \
            ([] if story["recovered"] else stuck)
        if stuck:
            stands, site = f"in {_where(stuck[0], scan, r)}", stuck[0].get("call_site")
        elif last is not None:
            stands, site = f"last seen after {_where(last, scan, r)}", last.get("call_site")
        else:
            stands, site = "no records", None
        life = source.last_life
        stack = life.main_stack
        main = None if stack is None else {"reason": short_error(stack["reason"]), "at": scan.site(stack["at"], r),
                                           "at_full": stack["at"], "frames": stack["frames"]}
        ranks.append({"rank": r, "files": source.files, "host": life.host, "pid": life.pid,
                      "reason": short_reason(life.reason), "reason_full": life.reason,
                      "lives": life.life + 1, "dump": life.dump_path is not None, "stands": stands,
                      "call_site": scan.site(site, r), "call_site_full": site, "main_thread": main})
    errors = [f for f in findings if f.severity == "error"]
    if culprits:
        head = "Likely culprit: " + "; ".join(f"rank {r} ({why})" for r, why in sorted(culprits.items()))
    elif errors:
        head = f"Something went wrong ({len(errors)} problems below), no single rank to blame."
    elif story["losses"]:
        head = "; ".join(story["lines"])
    else:
        head = f"No problem found in {len(present)} ranks' traces."
    if story["losses"] and (culprits or errors):
        findings.insert(0, Finding("info", "; ".join(story["lines"]), []))
    return {"ok": not errors, "headline": head, "culprits": sorted(culprits), "missing_ranks": missing,
            "findings": [asdict(f) for f in findings], "communicators": comms, "ranks": ranks,
            "recovery": story, "problems": list(scan.problems)}


def _describe(fp: Tuple[Any, ...]) -> str:
    """``all_reduce(float32, 32 B, SUM)``: an op's fingerprint in words."""
    op, dtype, reduce_op, size, root = fp
    parts = [str(dtype), "? B" if size is None else f"{size} B"]
    if reduce_op is not None:
        parts.append(reduce_op)
    if root is not None:
        parts.append(f"root {root}")
    return f"{op}({', '.join(parts)})"


def _joining(story: Dict[str, Any]) -> Dict[Tuple[str, int], Dict[int, Optional[int]]]:
    """(lineage, generation) -> {rank that joined it: the aligned time it was healed (None:
    no heal recorded)}: the generations a restarted rank (or replica group) was admitted to."""
    out: Dict[Tuple[str, int], Dict[int, Optional[int]]] = {}
    for adm in story["admissions"]:
        healed = {h["rank"]: h["t_ns"] for h in adm["heals"]}
        out[(adm["lineage"], adm["generation"])] = {r: healed.get(r) for r in adm["joined"]}
    return out


def _joiners_apart(scan: JobScan, key: Tuple[str, int, int], groups: Dict[int, List[int]],
                   joining: Dict[Tuple[str, int], Dict[int, Optional[int]]]) -> bool:
    """True when collective ``key``'s call sites split only between the ranks that joined its
    generation, issuing it before they were healed (a replacement's start-up: receiving its
    state, the vote on it), and the ranks that were already there (inside their recovery):
    the same op from other lines, legitimately."""
    joined = joining.get((lineage_of(key[0]), key[1]))
    if not joined:
        return False
    a = scan.collectives[key]
    for rank, enq in zip(a[RANK::WIDTH], a[ENQ::WIDTH]):
        healed = joined.get(rank)
        if healed is not None and enq - scan.offsets[rank].offset_ns > healed:
            return False  # a joiner's op after its heal: it is in the training loop, like the others
    kinds = [{r in joined for r in rs} for rs in groups.values()]
    # one line for the joiners, another for the others: any other split is a real one
    return all(len(k) == 1 for k in kinds) and sorted(k.pop() for k in kinds) == [False, True]


def _call_site_splits(scan: JobScan, findings: List[Finding], story: Dict[str, Any]) -> None:
    """Same collective, different lines of code: the ranks took different paths
    (a rank that skipped or added a collective is one call ahead from there on).
    Not a sign of that: a rank that joined a generation issuing its first ops from its
    start-up while the others issue them from their recovery (``_joiners_apart``)."""
    names = {sid: site for site, sid in scan.call_sites.items()}
    reported: Dict[str, int] = {}
    joining = _joining(story)
    for key in sorted(scan.collectives, key=lambda k: (k[0], k[1], k[2])):
        a = scan.collectives[key]
        sids = a[SITE::WIDTH]
        if len(set(sids)) < 2 or reported.get(key[0], 0) >= 3:
            continue
        groups: Dict[int, List[int]] = {}
        for rank, sid in zip(a[RANK::WIDTH], sids):
            groups.setdefault(sid, []).append(rank)
        if _joiners_apart(scan, key, groups, joining):
            continue
        reported[key[0]] = reported.get(key[0], 0) + 1
        where = "; ".join(f"{_ranks(rs)} at {scan.site(names[sid])}"
                          for sid, rs in sorted(groups.items(), key=lambda kv: min(kv[1])))
        name = scan.communicators.get(key[0], {}).get("name") or key[0]
        fewest: List[int] = min(groups.values(), key=len)
        findings.append(Finding("warning", f"'{name}' #{key[2]} ({scan.coll_ops[key]}) was called from different "
                                           f"lines: {where}", sorted(fewest)))


def _mismatches(scan: JobScan, findings: List[Finding], culprits: Dict[int, str]) -> Dict[Tuple[str, int, int], List[int]]:
    """Collectives whose ranks disagree on op, dtype, reduce op, size or root."""
    by_id = {fid: fp for fp, fid in scan.fingerprints.items()}
    out: Dict[Tuple[str, int, int], List[int]] = {}
    for key, a in scan.collectives.items():
        fids = a[FP::WIDTH]
        if len(set(fids)) < 2:
            continue
        ranks = a[RANK::WIDTH]
        groups: Dict[int, List[int]] = {}
        for rank, fid in zip(ranks, fids):
            groups.setdefault(fid, []).append(rank)
        major = max(groups, key=lambda f: (len(groups[f]), -min(groups[f])))
        ref = by_id[major]
        name = scan.communicators.get(key[0], {}).get("name") or key[0]
        parts, odd = [], []
        for fid, rs in sorted(groups.items(), key=lambda kv: min(kv[1])):
            if fid != major:
                fp = by_id[fid]
                differs = ", ".join(f for i, f in enumerate(FINGERPRINT_FIELDS) if fp[i] != ref[i])
                parts.append(f"{_ranks(rs)} called {_describe(fp)} [differs: {differs}]")
                odd += rs
        findings.append(Finding("error", f"mismatch in '{name}' ({key[0]}) at #{key[2]}: "
                                         f"{_ranks(groups[major])} called {_describe(ref)}; " + "; ".join(parts), odd))
        for r in odd:
            culprits.setdefault(r, f"mismatched {ref[0]} #{key[2]} of '{name}'")
        out[key] = odd
    return out


def _own_source(scan: JobScan, rank: int, rec: Dict[str, Any],
                lost: Dict[Tuple[str, int], Set[int]]) -> Optional[str]:
    """Where a lost life's last op ``rec`` came from, when the life that recorded it was lost
    (None otherwise: the figure is simply the rank's own): its JSON lines, its dump at its
    end (SIGTERM), or a dump it wrote before it was lost (on an earlier error or SIGUSR1),
    which may be older than its end."""
    if rank not in lost.get((lineage_of(rec["comm_id"]), rec.get("generation") or 0), ()):
        return None
    src = scan.sources[rank]
    life = next((s for s in [src, *src.lives] if s.life == (rec.get("life") or 0)), src)
    if life.jsonl_path:
        return "its own JSON lines (up to their last flush before it was lost)"
    if ended(life.reason):
        return f"its own dump at its end ({short_reason(life.reason)})"
    return f"its own last dump ({short_reason(life.reason) or 'no reason'}), written before it was lost: " \
        "it may have gone on after it"


def _peers_view(scan: JobScan, uid: str, rank: int, trouble: Optional[Dict[str, Any]],
                lost: Dict[Tuple[str, int], Set[int]]) -> Optional[str]:
    """What the other members' records say of a member that left no record of ``uid`` (a
    SIGKILLed life without JSON lines): the last collective they all completed (a symmetric
    one needs every member, so it entered that one too) and the op they were in
    (``trouble``: where they found it lost), with its sequence number and call site."""
    best: Optional[Tuple[int, int]] = None
    for (comm, gen, seq), a in scan.collectives.items():
        if comm == uid and scan.coll_ops[(comm, gen, seq)] in SYMMETRIC_OPS and rank not in a[RANK::WIDTH] \
                and all(st == COMPLETED_CODE for st in a[STATE::WIDTH]) and (best is None or (gen, seq) > best):
            best = (gen, seq)
    if best is None and trouble is None:
        return None
    parts = []
    if best is not None:
        op = scan.coll_ops[(uid, best[0], best[1])]
        parts.append(f"it entered {op} #{best[1]} (they completed it, which needs every member)")
    if trouble is not None:
        when = " when they lost it" if rank in lost.get((lineage_of(uid), trouble.get("generation") or 0), ()) else ""
        parts.append(f"they were in {_where(trouble, scan)}{when}")
    return "from its peers' records: " + "; ".join(parts)


def _lost_ranks(story: Dict[str, Any]) -> Dict[Tuple[str, int], Set[int]]:
    """(lineage, generation) -> the ranks lost in it (the story's losses)."""
    out: Dict[Tuple[str, int], Set[int]] = {}
    for loss in story["losses"]:
        out.setdefault((loss["lineage"], loss["generation"]), set()).update(loss["lost"])
    return out


def _diagnose_comm(scan: JobScan, uid: str, missing: List[int], mismatches: Dict[Tuple[str, int, int], List[int]],
                   findings: List[Finding], culprits: Dict[int, str], superseded: bool = False,
                   lost: Optional[Dict[Tuple[str, int], Set[int]]] = None) -> Dict[str, Any]:
    """One communicator's rows; what went wrong in it into ``findings`` and ``culprits``
    (as history, ``info``, when the job recovered from it: ``superseded``).  ``lost``:
    ``_lost_ranks`` of the story, to say where a lost member's last op came from."""
    lost = lost or {}
    if superseded:
        culprits = {}
    info = scan.communicators.get(uid, {})
    name = info.get("name") or uid
    members = scan.members(uid)
    present = [r for r in members if r in scan.sources]
    # The first op some member did not complete: where the communicator went wrong.
    trouble: Optional[Dict[str, Any]] = None
    for r in present:
        for rec in scan.unfinished.get(r, ()):
            if rec["comm_id"] == uid and rec["op"] not in P2P_OPS:
                order = (rec.get("generation") or 0, rec["seq"])
                if trouble is None or order < ((trouble.get("generation") or 0), trouble["seq"]):
                    trouble = rec
                break
    rows = []
    for r in members:
        le, lc = scan.last_entered.get((r, uid)), scan.last_completed.get((r, uid))
        rows.append({"rank": r, "present": r in scan.sources,
                     "last_entered": None if le is None else f"{_op_name(le)} ({le['state']})",
                     "last_completed": None if lc is None else _op_name(lc),
                     "call_site": None if le is None else scan.site(le.get("call_site"), r),
                     "from": _own_source(scan, r, le, lost) if le is not None else
                     _peers_view(scan, uid, r, trouble, lost)})
    if trouble is not None:
        gen, seq = trouble.get("generation") or 0, trouble["seq"]
        key = (uid, gen, seq)
        a = scan.collectives.get(key, array("q"))
        entered = {a[i + RANK]: STATES[a[i + STATE]] for i in range(0, len(a), WIDTH)}
        never = [r for r in present if r not in entered and _before(scan.last_entered.get((r, uid)), gen, seq)]
        by_state: Dict[str, List[int]] = {}
        for r, st in entered.items():
            by_state.setdefault(st, []).append(r)
        states = "; ".join(f"{_ranks(rs)} {st}" for st, rs in sorted(by_state.items()))
        text = f"'{name}' ({uid}) went wrong at {trouble['op']} #{seq}: {states}"
        err = trouble.get("error")
        if err is not None:
            text += f" ({short_error(err)})"
        absent = [r for r in members if r in missing]
        if never:
            for r in never:
                le = scan.last_entered.get((r, uid))
                seen = "no op of this communicator recorded" if le is None else f"last entered {_where(le, scan, r)}"
                src = scan.sources.get(r)
                stack = src.last_life.main_stack if src is not None else None
                if stack is not None and stack["at"]:
                    seen += f"; its main thread was at {scan.site(stack['at'], r)} when it dumped"
                culprits.setdefault(r, f"never entered {trouble['op']} #{seq} of '{name}'; {seen}")
            text += f"; {_ranks(never)} never entered it"
        elif absent and key not in mismatches:
            for r in absent:
                culprits.setdefault(r, f"left no trace while its peers failed in {trouble['op']} #{seq} of '{name}'")
            text += f"; {_ranks(absent)} left no trace"
        in_flight_everywhere = not never and not absent and set(by_state) <= {STARTED, SCHEDULED}
        if superseded:
            findings.append(Finding("info", f"recovered from: {text}", never or absent))
        else:
            findings.append(Finding("warning" if in_flight_everywhere else "error", text, never or absent))
    else:
        fronts = {r: scan.last_entered[(r, uid)]["seq"] for r in present if (r, uid) in scan.last_entered}
        if fronts and len(set(fronts.values())) > 1:
            top = max(fronts.values())
            behind = [r for r, s in fronts.items() if s < top]
            why = "its life ended (restarted after)" if superseded else "dumps taken at different times?"
            findings.append(Finding("info" if superseded else "warning",
                                    f"'{name}' ({uid}): {_ranks(behind)} stopped before #{top}, "
                                    f"which the others completed ({why})", behind))
    return {"uid": uid, "name": name, "members": members, "rows": rows}


def _before(rec: Optional[Dict[str, Any]], gen: int, seq: int) -> bool:
    """True when ``rec`` (a rank's last entered op) comes before (gen, seq)."""
    return rec is None or ((rec.get("generation") or 0), rec["seq"]) < (gen, seq)
