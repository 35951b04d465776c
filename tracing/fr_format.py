"""Our dumps in the format of PyTorch's Flight Recorder, for torch's own analyzer.

Why: people already know ``torchfrtrace`` (``python -m
torch.distributed.flight_recorder.fr_trace <dir>``), which merges every rank's
Flight Recorder buffer and names the rank that never joined a collective and
the collective whose type, sizes or dtypes differ between ranks.  Torch's own
Gloo dumps cannot feed it in 2.13 (every entry stays ``scheduled``, send/recv
are missing, and ``pg_config`` does not name the groups the entries use, so
the analyzer dies with ``KeyError``).  Our records know all of that, so the
recorder writes, next to each ``rank<R>.json``, ``fr/commslayer_fr_rank_<R>``:
a pickle of the dict this module builds, version "2.10", the layout torch
2.13's Flight Recorder writes.  ``torchfrtrace <trace_dir>/fr`` then runs on
our traces.

This module is pure Python (no torch, no commslayer): it only turns one dump
document (``tracing.records``) into another dict.

Groups.  Every communicator becomes one process group.  Its name (the
``pg_config`` key and the first half of each entry's ``process_group``) is the
communicator's ``uid``, which is the same on every member and unique in the
job; its description is the communicator's name.  ``ranks`` is the list of
global ranks (``global_ranks``, written as the string ``"[0, 1]"`` as torch
does).  When a communicator does not know its global ranks (``new_comm`` with
an explicit store, rank and size), ``range(size)`` stands in: right for a
communicator that spans the job in rank order, wrong for a subgroup built
that way (the analyzer would then expect the wrong ranks).  The analyzer
matches the dump's file rank against these lists, so dump files must be
named by global rank (the recorder does).

Send and recv go to a group of their own per direction,
``"<uid>/p2p:<src>-><dst>"`` (global ranks; members: the two ranks; described
``"<name> p2p"``): the analyzer expects every member of an op's group to take
part in it, which a send in a group of three never satisfies, so it would
report the third rank as missing.  There, both ``collective_seq_id`` and
``p2p_seq_id`` are our ``seq``, the message's number in its direction, the
same on sender and receiver, so the analyzer pairs each send with its recv.

Records of another membership generation than the one the dump lists for
their communicator are left out: the dump knows only that generation's
members, and the analyzer needs the right members for every entry;
``commslayer.skipped_records`` counts them.

Entries.  One per record, oldest first:

==============================  ===============================================
FR key                          from our record
==============================  ===============================================
record_id                       ``op_id - 1`` (both count every op of the
                                process, so the analyzer's alignment of ranks
                                by record_id works as on torch's dumps)
pg_id                           the group's position in ``pg_config``
process_group                   ``(uid, name)``; send/recv: their p2p group
collective_seq_id               ``seq``
p2p_seq_id                      0; send/recv: ``seq``
op_id                           ``seq``
profiling_name                  ``"<backend>:<name>"``, see ``FR_OP_NAMES``;
                                send/recv: ``"gloo:send 0->1"``/``"gloo:recv 1<-0"``
                                with the ranks' positions in the sorted pair
time_created_ns                 ``enqueue_ns`` on the wall clock
time_discovered_started_ns      ``start_ns`` (wall clock), None before the start
time_discovered_completed_ns    ``end_ns`` (wall clock) of completed ops, else None
duration_ms                     of completed ops only (FR writes it only then)
input_sizes/output_sizes        ``in_sizes``/``out_sizes``; all_gather's output
                                list and reduce_scatter's input list become one
                                ``[size, *shape]`` tensor, as torch records them;
                                send and recv list their tensor on both sides
input_dtypes/output_dtypes      ``dtype`` in c10's spelling ("Float", "Long", ...)
                                once per tensor
state                           see below
retired                         True once the op ended (any final state)
timeout_ms                      ``timeout_s * 1000``
is_p2p                          send/recv
frames                          ``stack`` (innermost first, as FR), else the
                                ``call_site`` as one frame named "?"
thread_name / thread_id         ``thread`` / "" (we keep no thread id)
==============================  ===============================================

States.  FR knows only ``scheduled``, ``started`` and ``completed`` (an op is
"completed" when its end was seen, "started" when its start was).  Ours map:

- scheduled -> ``scheduled``; started -> ``started``; completed -> ``completed``
- timed_out, failed, aborted -> ``started`` (``scheduled`` if it never
  reached the backend), ``retired`` True: the op never completed, which is
  what FR shows for a hung or failed collective, so ranks that all gave up on
  the same op still match and a rank that completed it stands out.  Our own
  state and error text stay in each entry's extra ``commslayer`` dict.

``pg_status`` gives each group's last enqueued, started and completed
collective ``seq`` (-1 for none), from the records.  The analyzer ignores the
extra keys (``commslayer`` at the top and in each entry).

Op names.  The analyzer matches collectives by the part after ``backend:``
and checks sizes by name.  We use the names torch's NCCL Flight Recorder
gives the same c10d backend call, where the analyzer's checks fit ours: all_gather_single
is ``_all_gather_base`` and reduce_scatter_single ``_reduce_scatter_base``
(sizes compared as they are), all_to_all_single is ``all_to_all`` (the analyzer
then compares total input and output element counts across ranks instead of
per-rank sizes, which uneven splits would fail).

Limits.  The analyzer wants every member's file (``--allow-incomplete-ranks``
otherwise), and its ``-j`` listing needs the ``tabulate`` package.  An op
that check mode rejects (``CollectiveMismatch``) raises before it is
recorded, so the analyzer never sees that mismatch.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from tracing.records import COMPLETED, FINAL_STATES, SCHEDULED, STARTED

FR_VERSION = "2.10"

# Our op -> the name torch's Flight Recorder gives the same c10d call on NCCL
# (torch's Gloo says all_gather for _allgather_base; the analyzer takes both).
FR_OP_NAMES: Dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "allreduce_coalesced",
    "all_gather_single": "_all_gather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "all_to_all",
    "all_to_all_v_single": "all_to_all",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "gather_single": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "should_commit": "all_reduce",
    "pending_members": "broadcast",
}
P2P_OPS = ("send", "recv")

# torch dtype name (``str(dtype)`` without "torch.") -> c10::toString(ScalarType).
FR_DTYPES: Dict[str, str] = {
    "float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
    "int8": "Char", "uint8": "Byte", "int16": "Short", "int32": "Int", "int64": "Long",
    "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "bool": "Bool",
    "complex32": "ComplexHalf", "complex64": "ComplexFloat", "complex128": "ComplexDouble",
    "float8_e4m3fn": "Float8_e4m3fn", "float8_e5m2": "Float8_e5m2",
    "float8_e4m3fnuz": "Float8_e4m3fnuz", "float8_e5m2fnuz": "Float8_e5m2fnuz",
    "float8_e8m0fnu": "Float8_e8m0fnu",
}

# Profiling-name prefixes the analyzer accepts; our CPU backend is Gloo.
_FR_BACKENDS = ("gloo", "nccl")
_FRAME = re.compile(r"^(.*):(\d+) in (.*)$")
_SITE = re.compile(r"^(.*):(\d+)$")


def fr_dtype(dtype: Optional[str]) -> Optional[str]:
    """Our dtype name ("float32") in Flight Recorder's spelling ("Float")."""
    if dtype is None:
        return None
    return FR_DTYPES.get(dtype, dtype)


def _ranks(info: Dict[str, Any]) -> List[int]:
    ranks = info.get("global_ranks")
    return list(ranks) if ranks else list(range(int(info.get("size") or 0)))


def _frames(rec: Dict[str, Any]) -> List[Dict[str, Any]]:
    frames = []
    for line in reversed(rec.get("stack") or []):
        m = _FRAME.match(line)
        if m:
            frames.append({"name": m.group(3), "filename": m.group(1), "line": int(m.group(2))})
    if not frames:
        m = _SITE.match(rec.get("call_site") or "")
        if m:
            frames.append({"name": "?", "filename": m.group(1), "line": int(m.group(2))})
    return frames


def _flatten(sizes: List[List[int]]) -> List[List[int]]:
    """A list of same-shaped tensors as the one ``[n, *shape]`` buffer torch records."""
    if sizes and all(s == sizes[0] for s in sizes):
        return [[len(sizes), *sizes[0]]]
    return [list(s) for s in sizes]


def _sizes(rec: Dict[str, Any]) -> Tuple[List[List[int]], List[List[int]]]:
    ins = [list(s) for s in rec.get("in_sizes") or []]
    outs = [list(s) for s in rec.get("out_sizes") or []]
    op = rec.get("op")
    if op in P2P_OPS:  # FR lists a send's or recv's one tensor as input and output
        both = ins or outs
        return both, [list(s) for s in both]
    if op == "all_gather":
        outs = _flatten(outs)
    elif op == "reduce_scatter":
        ins = _flatten(ins)
    return ins, outs


def _state(rec: Dict[str, Any]) -> str:
    state = rec.get("state")
    if state in (SCHEDULED, STARTED, COMPLETED):
        return str(state)
    return STARTED if rec.get("start_ns") is not None else SCHEDULED


class _Groups:
    """The dump's process groups: ``pg_config``, ids, and each group's global ranks."""

    def __init__(self) -> None:
        self.config: Dict[str, Dict[str, str]] = {}
        self.ids: Dict[str, int] = {}
        self.ranks: Dict[str, List[int]] = {}

    def add(self, name: str, desc: str, ranks: List[int]) -> str:
        if name not in self.config:
            self.ids[name] = len(self.ids)
            self.ranks[name] = ranks
            self.config[name] = {"name": name, "desc": desc, "ranks": "[" + ", ".join(map(str, ranks)) + "]"}
        return name

    def p2p(self, uid: str, info: Dict[str, Any], op: str, peer: int) -> Tuple[str, str]:
        """The group of one send/recv direction, and the op's name in it."""
        ranks = self.ranks[uid]
        me = int(info.get("rank", 0))
        src, dst = (me, peer) if op == "send" else (peer, me)
        if max(src, dst) < len(ranks):
            src, dst = ranks[src], ranks[dst]
        group = self.add(f"{uid}/p2p:{src}->{dst}", f"{self.config[uid]['desc']} p2p", sorted((src, dst)))
        s, d = int(src > dst), int(dst > src)  # positions in the sorted pair
        return group, (f"send {s}->{d}" if op == "send" else f"recv {d}<-{s}")


def to_flight_recorder(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The Flight Recorder dict (version "2.10") for one of our dump documents.

    Never raises on a well-formed dump; records it cannot place (an unknown
    communicator, an older generation) are skipped and counted.
    """
    comms: Dict[str, Dict[str, Any]] = doc.get("communicators") or {}
    clock = doc.get("clock") or {}
    offset = int(clock.get("wall_ns", 0)) - int(clock.get("mono_ns", 0))

    def wall(ns: Optional[int]) -> Optional[int]:
        return None if ns is None else int(ns) + offset

    groups = _Groups()
    for uid, info in comms.items():
        groups.add(uid, str(info.get("name", uid)), _ranks(info))
    status = {uid: {"last_enqueued_collective": -1, "last_started_collective": -1,
                    "last_completed_collective": -1} for uid in comms}
    entries: List[Dict[str, Any]] = []
    skipped = 0
    for rec in doc.get("records") or []:
        uid, op, peer = rec.get("comm_id"), rec.get("op"), rec.get("peer")
        comm_info = comms.get(uid)
        is_p2p = op in P2P_OPS
        if (comm_info is None or op not in FR_OP_NAMES or rec.get("generation", 0) != comm_info.get("generation", 0)
                or (is_p2p and not isinstance(peer, int))):
            skipped += 1
            continue
        seq = int(rec.get("seq") or 0)
        group, name = groups.p2p(uid, comm_info, op, peer) if is_p2p else (uid, FR_OP_NAMES[op])
        backend = comm_info.get("backend") if comm_info.get("backend") in _FR_BACKENDS else "gloo"
        state = _state(rec)
        ins, outs = _sizes(rec)
        dtype = fr_dtype(rec.get("dtype"))
        entry: Dict[str, Any] = {
            "frames": _frames(rec),
            "record_id": int(rec.get("op_id") or 1) - 1,
            "pg_id": groups.ids[group],
            "process_group": (group, groups.config[group]["desc"]),
            "thread_name": rec.get("thread") or "",
            "thread_id": "",
            "collective_seq_id": seq,
            "p2p_seq_id": seq if is_p2p else 0,
            "op_id": seq,
            "profiling_name": f"{backend}:{name}",
            "time_created_ns": wall(rec.get("enqueue_ns")),
            "input_sizes": ins,
            "input_dtypes": [dtype] * len(ins) if dtype else [],
            "output_sizes": outs,
            "output_dtypes": [dtype] * len(outs) if dtype else [],
            "state": state,
            "time_discovered_started_ns": wall(rec.get("start_ns")) if state != SCHEDULED else None,
            "time_discovered_completed_ns": wall(rec.get("end_ns")) if state == COMPLETED else None,
            "retired": rec.get("state") in FINAL_STATES,
            "timeout_ms": int(round(float(rec.get("timeout_s") or 0) * 1000)),
            "is_p2p": is_p2p,
            "commslayer": {"op": op, "state": rec.get("state"), "error": rec.get("error"), "seq": seq,
                           "reduce_op": rec.get("reduce_op"), "root": rec.get("root"), "peer": peer},
        }
        if state == COMPLETED and rec.get("duration_ms") is not None:
            entry["duration_ms"] = float(rec["duration_ms"])
        entries.append(entry)
        if not is_p2p:
            st = status[uid]
            st["last_enqueued_collective"] = max(st["last_enqueued_collective"], seq)
            if state != SCHEDULED:
                st["last_started_collective"] = max(st["last_started_collective"], seq)
            if state == COMPLETED:
                st["last_completed_collective"] = max(st["last_completed_collective"], seq)

    return {
        "version": FR_VERSION,
        "comm_lib_version": "",
        "pg_config": groups.config,
        "pg_status": {str(groups.ids[uid]): st for uid, st in status.items()},
        "entries": entries,
        "commslayer": {"job": doc.get("job"), "rank": doc.get("rank"), "host": doc.get("host"),
                       "pid": doc.get("pid"), "reason": doc.get("reason"),
                       "dropped_records": doc.get("dropped_records", 0), "skipped_records": skipped},
    }
