"""Small trace files written by hand, for the viewer's tests of bad input:
valid records, dumps and JSON lines as the recorder writes them (built from
``tracing.records``, no torch), and the viewer's CLI run in-process."""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

from tracing.read import cli
from tracing.records import RECORD_FIELDS, new_dump

WALL_NS, MONO_NS = 1_790_000_000_000_000_000, 5_000_000_000


def record(op_id: int, *, rank: int = 0, seq: Optional[int] = None, comm_id: str = "a.0", comm: str = "a",
           op: str = "all_reduce", **fields: Any) -> Dict[str, Any]:
    """One completed op, every field of the format set; ``fields`` override."""
    enq = MONO_NS + op_id * 1_000_000 + rank * 1_000
    r = dict.fromkeys(RECORD_FIELDS)
    r.update(op_id=op_id, comm=comm, comm_id=comm_id, generation=0, seq=op_id if seq is None else seq, op=op,
             backend_op="allreduce", reduce_op="SUM", dtype="float32", in_sizes=[[4]], out_sizes=[[4]],
             in_bytes=16, out_bytes=16, async_op=False, timeout_s=30.0, state="completed",
             enqueue_ns=enq, start_ns=enq + 10_000, end_ns=enq + 500_000, duration_ms=0.49,
             thread="MainThread", call_site="train.py:42")
    r.update(fields)
    return r


def communicators(size: int, uid: str = "a.0", name: str = "a") -> Dict[str, Dict[str, Any]]:
    """The ``communicators`` entry of a dump for one communicator over ranks 0..size-1."""
    return {uid: {"name": name, "backend": "gloo", "rank": 0, "size": size, "global_ranks": list(range(size)),
                  "generation": 0, "members": list(range(size)), "state": "ok"}}


def dump_doc(rank: int, records: List[Dict[str, Any]], size: int = 2) -> Dict[str, Any]:
    """A whole dump document of rank ``rank``."""
    comms = communicators(size)
    comms["a.0"]["rank"] = rank
    return new_dump(job="j", rank=rank, host="h", pid=100 + rank, wall_ns=WALL_NS, mono_ns=MONO_NS,
                    reason="end of run", dropped=0, communicators=comms, records=records)


def header(rank: int) -> Dict[str, Any]:
    """The first line of a JSON-lines trace."""
    return {"event": "trace_started", "schema": 1, "job": "j", "rank": rank, "host": "h", "pid": 100 + rank,
            "level": "info", "clock": {"wall_ns": WALL_NS, "mono_ns": MONO_NS}}


def jsonl_lines(rank: int, records: Iterable[Dict[str, Any]], size: int = 2) -> List[Dict[str, Any]]:
    """The events of a JSON-lines trace: header, communicator_created, one per record."""
    created = {"event": "communicator_created", "rank": rank, "comm": "a", "comm_id": "a.0", "backend": "gloo",
               "comm_rank": rank, "size": size, "global_ranks": list(range(size)), "generation": 0}
    return [header(rank), created, *({"event": "collective", "rank": rank, **r} for r in records)]


def write(path: str, content: Any) -> str:
    """A dump (a dict) or JSON lines (a list of dicts or raw bytes lines) to ``path``."""
    with open(path, "wb") as f:
        if isinstance(content, list):
            f.write(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n" for x in content))
        else:
            f.write(json.dumps(content).encode())
    return path


def job(directory: str, ranks: int = 2, ops: int = 4, *, jsonl: bool = True) -> str:
    """A clean job of ``ranks`` ranks doing ``ops`` all-reduces: dumps, and JSON lines if asked."""
    for rank in range(ranks):
        recs = [record(i, rank=rank) for i in range(1, ops + 1)]
        write(os.path.join(directory, f"rank{rank}.json"), dump_doc(rank, recs, ranks))
        if jsonl:
            write(os.path.join(directory, f"rank{rank}.jsonl"), jsonl_lines(rank, recs, ranks))
    return directory


def run_cli(*args: str) -> Tuple[int, str, str]:
    """``commslayer-trace ARGS`` in this process: (exit status, stdout, stderr).
    argparse's own exit (usage errors) comes back as its status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()
