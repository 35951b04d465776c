"""The trace format: the contract between the recorder and the viewer.

A dump is one JSON document per rank (``rank<R>.json`` in the trace
directory), written whole and atomically.  It imports neither torch nor
commslayer, so the viewer can read it on a laptop.  docs/trace-format.md
describes every field; bump ``SCHEMA_VERSION`` on any incompatible change.

Times are ``time.monotonic_ns()`` of the writing process; the dump's
``clock`` anchors them to the wall clock (``wall_ns - mono_ns`` converts), so
analysis can put ranks on one time axis and then refine the offsets.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

SCHEMA_VERSION = 1
DUMP_KIND = "commslayer-trace"

# The life of one op.
SCHEDULED = "scheduled"  # the call entered commslayer (enqueue_ns)
STARTED = "started"      # handed to the backend (start_ns)
COMPLETED = "completed"
TIMED_OUT = "timed_out"
FAILED = "failed"
ABORTED = "aborted"      # still in flight when its communicator was aborted
STATES = (SCHEDULED, STARTED, COMPLETED, TIMED_OUT, FAILED, ABORTED)
FINAL_STATES = (COMPLETED, TIMED_OUT, FAILED, ABORTED)

# Fields of one record, in the order a dump writes them.
RECORD_FIELDS = (
    "op_id",        # process-wide, increasing
    "comm",         # communicator name
    "comm_id",      # communicator uid: the same on every member, unique in the job
    "generation",   # membership generation of the communicator
    "seq",          # per-communicator sequence number (collectives); per-pair message number (p2p)
    "op",           # our op name: all_reduce, all_gather_single, ...
    "backend_op",   # the c10d backend method that ran underneath
    "reduce_op",    # "SUM", "AVG", "PREMUL_SUM(0.5)", ... or None
    "dtype",        # of the first tensor, e.g. "float32"
    "in_sizes",     # shapes of the input tensors
    "out_sizes",    # shapes of the output tensors
    "in_bytes",
    "out_bytes",
    "root",         # for rooted ops, else None
    "peer",         # for send/recv, else None
    "async_op",
    "timeout_s",
    "state",        # one of STATES
    "error",        # the error text for timed_out/failed/aborted, else None
    "enqueue_ns",   # monotonic
    "start_ns",     # monotonic, None until started
    "end_ns",       # monotonic, None until final
    "duration_ms",  # end - start, None until final
    "thread",       # name of the calling thread
    "call_site",    # "file:line" of the first frame outside commslayer, tracing and torch
    "stack",        # full Python stack (list of "file:line in func") when enabled, else None
)


# Recovery events: a dump's ``events`` list (and ``recovery`` lines of the JSON lines).
# Every event has ``kind``, ``mono_ns`` and ``step`` (the resilient job's step, or None);
# those of a communicator also ``comm``, ``comm_id`` and ``generation``.
EVENT_KINDS = (
    "peer_lost",   # this rank found peers lost: lost (job ranks), op, seq, error (the cause, full text)
    "generation",  # a new generation was built: members (after), before (None: this rank was not in it)
    "fenced",      # the others went on without this rank: why
    "recovered",   # commslayer.train.replicas: step, lost_replicas, generation, members, detected_s, resumed_s
    "admitted",    # commslayer.train.replicas: step, replicas, generation, members, seconds (reconfigure + transfer)
    "healed",      # commslayer.train.replicas: step, generation, source (job rank), source_replica, bytes, seconds,
                   # and spare, pid for a warm spare that adopted the rank (commslayer.train.spare)
)
EVENT_CAPACITY = 4096  # events a recorder keeps (the oldest go first)


# Fields a record has only when they apply (absent or null otherwise; not part of
# RECORD_FIELDS, so traces without them read the same).
OPTIONAL_FIELDS = (
    "wait_ns",      # monotonic: the caller of an async op first called Work.wait
    "wait_end_ns",  # monotonic: its last Work.wait returned
    "step",         # the resilient job's step (commslayer.resilience) the op was issued in
)


def new_dump(*, job: str, rank: int, host: str, pid: int, wall_ns: int, mono_ns: int, reason: str,
             dropped: int, communicators: Dict[str, Dict[str, Any]], records: List[Dict[str, Any]],
             events: Optional[List[Dict[str, Any]]] = None, cwd: Optional[str] = None,
             main_stack: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A whole dump document."""
    return {
        "kind": DUMP_KIND,
        "schema": SCHEMA_VERSION,
        "job": job,
        "rank": rank,
        "host": host,
        "pid": pid,
        "clock": {"wall_ns": wall_ns, "mono_ns": mono_ns},
        "reason": reason,
        "dropped_records": dropped,
        "communicators": communicators,
        "records": records,
        "events": events or [],
        "cwd": cwd,
        "main_stack": main_stack,
    }


def load_dump(path: str) -> Dict[str, Any]:
    """Read one dump, checking that it is ours and of a schema we understand."""
    with open(path, "rb") as f:
        doc: Dict[str, Any] = json.load(f)
    if doc.get("kind") != DUMP_KIND:
        raise ValueError(f"{path} is not a commslayer trace dump")
    if doc.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path} has trace schema {doc.get('schema')}; this reader knows {SCHEMA_VERSION}")
    return doc
