"""What the viewer computes from a job's records: overlap, clock alignment,
the summary tables and the diagnosis.

Everything here works on record dicts as the trace format defines them
(``tracing.records``), streamed rank by rank from ``tracing.traceio``; a
``JobScan`` keeps only compact per-collective facts, so 16 ranks x 100,000
records fit in a few hundred MB.  docs/viewer.md gives every formula.

Imports neither torch nor commslayer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

RS_OPS = frozenset(("reduce_scatter_single", "reduce_scatter"))
AG_OPS = frozenset(("all_gather_single", "all_gather"))
RS_BACKEND_OPS = frozenset(("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"))
AG_BACKEND_OPS = frozenset(("_allgather_base", "allgather", "allgather_into_tensor_coalesced"))
P2P_OPS = frozenset(("send", "recv"))

Interval = Tuple[int, int]


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """The union of half-open intervals, as sorted disjoint intervals."""
    out: List[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(disjoint: Iterable[Interval]) -> int:
    """Total length of disjoint intervals."""
    return sum(b - a for a, b in disjoint)


def intersect(xs: List[Interval], ys: List[Interval]) -> List[Interval]:
    """The intersection of two sorted disjoint interval lists."""
    out: List[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass
class OverlapStats:
    """How one rank's reduce-scatter time overlapped its all-gather time (seconds).

    ``rs_s``/``ag_s``: union of the [start, end] intervals of the rank's
    reduce-scatters / all-gathers that have an end (all communicators).
    ``hidden_rs_s``: the part of ``rs_s`` during which an all-gather was also
    in flight; ``hidden_fraction = hidden_rs_s / rs_s`` (0 without RS).
    ``comm_s``: union of the intervals of all its ops (p2p included).
    ``exposed_comm_s``: union of the intervals during which the issuing thread
    was blocked in a synchronous call ([enqueue, end] of ops with
    ``async_op`` false).  The trace does not record when an async op is
    waited on, so time blocked in ``Work.wait()`` is not in it: a lower bound.
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

    def to_dict(self) -> Dict[str, Any]:
        """Plain values, for ``--json``."""
        return asdict(self)


def is_rs(r: Dict[str, Any]) -> bool:
    """A reduce-scatter, by our op name or the backend method."""
    return r["op"] in RS_OPS or r.get("backend_op") in RS_BACKEND_OPS


def is_ag(r: Dict[str, Any]) -> bool:
    """An all-gather, by our op name or the backend method."""
    return r["op"] in AG_OPS or r.get("backend_op") in AG_BACKEND_OPS


def overlap_by_rank(records: Iterable[Dict[str, Any]]) -> Dict[int, OverlapStats]:
    """Per rank, reduce-scatter/all-gather overlap and exposed communication.

    ``records``: record dicts carrying ``rank``, ``op``, ``backend_op``,
    ``start_ns``, ``end_ns`` (and ``enqueue_ns``/``async_op`` for the exposed
    time; without them an op counts as asynchronous).  Times may be raw or
    aligned: only differences within one rank are used.  Ops without an end
    (still in flight) are left out.
    """
    per: Dict[int, Dict[str, List[Interval]]] = {}
    counts: Dict[int, List[int]] = {}
    for r in records:
        start, end = r.get("start_ns"), r.get("end_ns")
        if end is None:
            continue
        if start is None:
            start = r.get("enqueue_ns", end)
        rank = r["rank"]
        lanes = per.get(rank)
        if lanes is None:
            lanes = per[rank] = {"rs": [], "ag": [], "all": [], "blocked": []}
            counts[rank] = [0, 0]
        lanes["all"].append((start, end))
        if r.get("async_op") is False:
            lanes["blocked"].append((r.get("enqueue_ns", start), end))
        if is_rs(r):
            lanes["rs"].append((start, end))
            counts[rank][0] += 1
        elif is_ag(r):
            lanes["ag"].append((start, end))
            counts[rank][1] += 1
    out: Dict[int, OverlapStats] = {}
    for rank in sorted(per):
        lanes = per[rank]
        rs, ag = union(lanes["rs"]), union(lanes["ag"])
        rs_ns, hidden_ns = length(rs), length(intersect(rs, ag))
        out[rank] = OverlapStats(
            rank=rank, rs_count=counts[rank][0], ag_count=counts[rank][1],
            rs_s=rs_ns / 1e9, ag_s=length(ag) / 1e9, hidden_rs_s=hidden_ns / 1e9,
            hidden_fraction=hidden_ns / rs_ns if rs_ns else 0.0,
            comm_s=length(union(lanes["all"])) / 1e9,
            exposed_comm_s=length(union(lanes["blocked"])) / 1e9,
        )
    return out
