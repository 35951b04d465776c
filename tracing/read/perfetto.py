"""Export a job's traces as Chrome trace-event JSON (Perfetto UI, chrome://tracing).

Layout: one process per rank (``pid`` = rank, named ``rank R (host)`` and
sorted by rank), one thread per communicator lane (``tid`` unique in the
file, named after the communicator; ops of one communicator that overlap in
time, async ones, go to separate lanes so that slices on a thread never
overlap), one complete event (``ph: X``) per op with its record as ``args``,
and one flow per collective (``s`` on the rank whose op is earliest, ``t``
on the middle ones, ``f`` with ``bp: e`` on the last) linking the same
collective across ranks; the recovery story (``tracing.read.story``) as global
instant events (a loss, the decision, the first op of the new generation,
admissions, fencing) and each rank's recovery events as instants on its
process.  Times are on the job's common axis
(``analysis.JobScan`` aligns the clocks), in microseconds from the first op.

The file is written as it is produced, one rank at a time.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Tuple

from tracing.read.analysis import P2P_OPS, JobScan, flow_order, rank_timeline
from tracing.read.story import recovery_story
from tracing.read.traceio import shapes_ok

_ARGS = ("seq", "comm_id", "generation", "state", "dtype", "reduce_op", "in_sizes", "out_sizes", "in_bytes",
         "out_bytes", "root", "peer", "async_op", "timeout_s", "thread", "call_site", "error", "op_id")


def export_perfetto(scan: JobScan, path: str) -> Dict[str, int]:
    """Write ``path``; returns counts of what was written (ranks, slices, flows)."""
    t0 = scan.span()[0]
    flow_ids: Dict[Tuple[str, int, int], int] = {}
    counts = {"ranks": 0, "slices": 0, "flows": 0, "markers": 0}
    odd_shapes = 0
    tids: Dict[Tuple[int, str, int], int] = {}
    comm_order = {uid: i for i, uid in enumerate(sorted({k[0] for k in scan.collectives} | set(scan.communicators)))}
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ')
        json.dump({"producer": "commslayer-trace", "ranks": sorted(scan.sources),
                   "clock_offsets_ns": {str(r): c.offset_ns for r, c in scan.offsets.items()}}, f)
        f.write(', "traceEvents": [\n')
        first = True

        def emit(ev: Dict[str, Any]) -> None:
            nonlocal first
            if not first:
                f.write(",\n")
            first = False
            json.dump(ev, f, separators=(",", ":"))

        for rank in sorted(scan.sources):
            src = scan.sources[rank]
            counts["ranks"] += 1
            host = f" ({src.host})" if src.host else ""
            emit({"ph": "M", "pid": rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {rank}{host}"}})
            emit({"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index", "args": {"sort_index": rank}})
            for sl in rank_timeline(scan, rank):
                lane_key = (rank, sl.comm, sl.lane)
                tid = tids.get(lane_key)
                if tid is None:
                    tid = tids[lane_key] = len(tids) + 1
                    name = sl.record.get("comm") or sl.comm
                    label = f"{name} [{sl.comm}]" + (f" lane {sl.lane + 1}" if sl.lane else "")
                    emit({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": label}})
                    emit({"ph": "M", "pid": rank, "tid": tid, "name": "thread_sort_index",
                          "args": {"sort_index": comm_order.get(sl.comm, 0) * 1000 + sl.lane}})
                r = sl.record
                args = {k: r.get(k) for k in _ARGS}
                for k in ("in_sizes", "out_sizes"):
                    if args[k] is not None and not shapes_ok(args[k]):
                        args[k] = None
                        odd_shapes += 1
                if sl.in_flight:
                    args["note"] = "no end recorded: still in flight when the trace was written"
                emit({"ph": "X", "pid": rank, "tid": tid, "name": r["op"], "cat": r.get("comm") or sl.comm,
                      "ts": (sl.start_ns - t0) / 1e3, "dur": (sl.end_ns - sl.start_ns) / 1e3, "args": args})
                counts["slices"] += 1
                if r["op"] in P2P_OPS:
                    continue
                key = (r["comm_id"], r.get("generation") or 0, r["seq"])
                order = flow_order(scan, key)
                if len(order) < 2:
                    continue
                pos = order.index(rank)
                fid = flow_ids.setdefault(key, len(flow_ids) + 1)
                mid = (sl.start_ns + (sl.start_ns if sl.in_flight else sl.end_ns)) // 2
                ev = {"ph": "s" if pos == 0 else "f" if pos == len(order) - 1 else "t", "id": fid,
                      "name": f"{r['op']} #{r['seq']}", "cat": "collective", "pid": rank, "tid": tid,
                      "ts": (mid - t0) / 1e3}
                if ev["ph"] == "f":
                    ev["bp"] = "e"
                emit(ev)
                counts["flows"] += pos == 0
        for m in recovery_story(scan)["markers"]:
            emit({"ph": "i", "s": "g", "pid": 0, "tid": 0, "name": m["label"], "cat": f"recovery.{m['kind']}",
                  "ts": (int(m["t_ns"]) - t0) / 1e3})
            counts["markers"] += 1
        for event in scan.events:
            if event["rank"] in scan.sources:
                emit({"ph": "i", "s": "p", "pid": event["rank"], "tid": 0, "name": event["kind"], "cat": "recovery",
                      "ts": (event["t_ns"] - t0) / 1e3,
                      "args": {k: v for k, v in event.items() if k not in ("t_ns", "wall_ns", "mono_ns")}})
        f.write("\n]}\n")
    if odd_shapes:
        scan.problems.append(f"{odd_shapes} ops' in_sizes/out_sizes were not lists of shapes: exported as null")
    return counts
