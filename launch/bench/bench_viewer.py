"""How fast and how lean the trace viewer is on a large job: 16 ranks x
100,000 records each, generated, then ``commslayer-trace summary`` and
``diagnose`` timed as subprocesses: wall time, the max RSS of the largest
process (``wait4``: the command or one of the readers it forks), and the
peak resident memory of the whole process tree (readers run at the same
time), sampled from /proc every 20 ms (a sum of RSS: pages a forked reader
still shares with its parent count twice, so it is an upper bound).

Two layouts of the same records, as a job leaves them:

- ``jsonl``: ``rank<R>.jsonl`` with every record (structlog JSON lines,
  ``COMMSLAYER_TRACE_JSONL=1``) plus ``rank<R>.json``, a dump of the last 4096
  (the default ring);
- ``dump``: ``rank<R>.json`` alone holding all 100,000 records
  (``COMMSLAYER_TRACE_BUFFER=100000``).

The generated job: per step an async all-gather on ``dp`` and a
reduce-scatter on ``dp_rs`` that overlap, then a small all_reduce; every
rank's clock anchor is off by up to +-2 ms and its arrivals jitter, so the
alignment and the straggler table have work to do.  Commands run one after
another, alternating, ``--repeats`` times; the report gives the median and
the min-max per command and layout.

    python launch/bench/bench_viewer.py --ranks 16 --records 100000 --repeats 3 --view

``--smoke`` (2 ranks x 300 records, both layouts, every command once,
``view`` included) checks in seconds that it still runs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RING = 4096


def _records(rank: int, n: int, rng: random.Random) -> List[Dict[str, Any]]:
    """``n`` records of one rank, three per step.  The job's timeline is the same
    on every rank (a shared seed): each op's arrivals jitter by rank, and it ends
    on all ranks within 20 us, after the last arrival."""
    out: List[Dict[str, Any]] = []
    job = random.Random(7)
    t = 1_000_000_000
    seqs = {"dp.0": 0, "dp_rs.0": 0}
    for i in range(n):
        kind = i % 3
        if kind == 0:
            comm, op, backend, size, dur, asyn = "dp.0", "all_gather_single", "_allgather_base", 1 << 20, 2_000_000, True
        elif kind == 1:
            comm, op, backend, size, dur, asyn = "dp_rs.0", "reduce_scatter_single", "_reduce_scatter_base", \
                1 << 20, 2_500_000, True
        else:
            comm, op, backend, size, dur, asyn = "dp.0", "all_reduce", "allreduce", 64, 150_000, False
        seqs[comm] += 1
        common_end = t + 200_000 + dur + job.randrange(0, 300_000)
        enq = t + rng.randrange(0, 200_000)
        start = enq + 10_000
        end = common_end + rng.randrange(0, 20_000)
        out.append({
            "op_id": i + 1, "comm": comm.split(".")[0], "comm_id": comm, "generation": 0, "seq": seqs[comm],
            "op": op, "backend_op": backend, "reduce_op": None if kind == 0 else "SUM", "dtype": "float32",
            "in_sizes": [[size // 4 // (16 if kind == 0 else 1)]], "out_sizes": [[size // 4]],
            "in_bytes": size // (16 if kind == 0 else 1), "out_bytes": size, "root": None, "peer": None,
            "async_op": asyn, "timeout_s": 300.0, "state": "completed", "error": None, "enqueue_ns": enq,
            "start_ns": start, "end_ns": end, "duration_ms": (end - start) / 1e6, "thread": "MainThread",
            "call_site": f"/job/train.py:{100 + kind}", "stack": None,
        })
        t = common_end + 50_000 if kind == 2 else t + 1_000_000
    return out


def generate(directory: str, ranks: int, n: int, layout: str) -> int:
    """Write the job's files; their total size in bytes."""
    os.makedirs(directory, exist_ok=True)
    comms = {uid: {"name": uid.split(".")[0], "backend": "gloo", "rank": None, "size": ranks,
                   "global_ranks": list(range(ranks)), "generation": 0, "state": "ok"} for uid in ("dp.0", "dp_rs.0")}
    for rank in range(ranks):
        rng = random.Random(rank)
        records = _records(rank, n, rng)
        clock = {"wall_ns": 1_796_000_000_000_000_000 + rng.randrange(-2_000_000, 2_000_000), "mono_ns": 0}
        info = {uid: dict(c, rank=rank) for uid, c in comms.items()}
        kept = records if layout == "dump" else records[-RING:]
        doc = {"kind": "commslayer-trace", "schema": 1, "job": "bench", "rank": rank, "host": "bench", "pid": rank,
               "clock": clock, "reason": "exit", "dropped_records": len(records) - len(kept),
               "communicators": info, "records": kept}
        with open(os.path.join(directory, f"rank{rank}.json"), "wb") as f:
            f.write(orjson.dumps(doc))
        if layout == "jsonl":
            head = {"job": "bench", "rank": rank, "host": "bench", "pid": rank}
            with open(os.path.join(directory, f"rank{rank}.jsonl"), "wb") as f:
                f.write(orjson.dumps({"event": "trace_started", "schema": 1, "clock": clock, **head,
                                      "level": "info", "ts": "2026-11-29T00:00:00+00:00"}) + b"\n")
                for uid, c in info.items():
                    f.write(orjson.dumps({"event": "communicator_created", "comm": c["name"], "comm_id": uid,
                                          "backend": "gloo", "comm_rank": rank, "size": ranks,
                                          "global_ranks": c["global_ranks"], "generation": 0, **head,
                                          "level": "info", "ts": "2026-11-29T00:00:00+00:00"}) + b"\n")
                for r in records:
                    f.write(orjson.dumps({"event": "collective", **r, **head, "level": "info",
                                          "ts": "2026-11-29T00:00:00.000000+00:00"}) + b"\n")
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def _tree_rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants now (KiB), from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def measure(command: str, directory: str) -> Tuple[float, float, float, int]:
    """(wall s, max RSS MiB of the largest process, peak MiB of the process tree
    sampled every 20 ms, exit status) of one ``commslayer-trace`` run."""
    if command == "view":
        cmd = [sys.executable, "-m", "tracing.read.cli", "view", directory, "-o", os.path.join(directory, "view.html")]
    else:
        cmd = [sys.executable, "-m", "tracing.read.cli", command, "--json", directory]
    peak = 0
    start = time.perf_counter()
    with open(os.devnull, "wb") as devnull:
        p = subprocess.Popen(cmd, stdout=devnull, cwd=ROOT)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, _tree_rss_kib(p.pid))
            time.sleep(0.02)
    wall = time.perf_counter() - start
    return wall, usage.ru_maxrss / 1024, peak / 1024, os.waitstatus_to_exitcode(status)


def _spread(values: List[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="jsonl,dump")
    ap.add_argument("--keep", metavar="DIR", help="generate into DIR and leave it there")
    ap.add_argument("--view", action="store_true", help="also time `view` once per layout (HTML size reported)")
    ap.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: 2 ranks x "
                    "300 records, 1 repeat, --view; explicit options still apply")
    args = ap.parse_args()
    if args.smoke:
        ap.set_defaults(ranks=2, records=300, repeats=1, view=True)
        args = ap.parse_args()
    base = args.keep or tempfile.mkdtemp(prefix="bench-viewer-")
    results: Dict[Tuple[str, str], List[Tuple[float, float, float, int]]] = {}
    sizes: Dict[str, int] = {}
    try:
        for layout in args.layouts.split(","):
            d = os.path.join(base, layout)
            t = time.perf_counter()
            sizes[layout] = generate(d, args.ranks, args.records, layout)
            print(f"generated {layout}: {sizes[layout] / 2**20:.0f} MiB in {time.perf_counter() - t:.1f} s",
                  flush=True)
        for i in range(args.repeats):
            for layout in args.layouts.split(","):
                for command in ("summary", "diagnose"):
                    res = measure(command, os.path.join(base, layout))
                    results.setdefault((layout, command), []).append(res)
                    print(f"repeat {i + 1} {layout} {command}: {res[0]:.2f} s, max RSS {res[1]:.0f} MiB, "
                          f"tree {res[2]:.0f} MiB, exit {res[3]}", flush=True)
        if args.view:
            for layout in args.layouts.split(","):
                res = measure("view", os.path.join(base, layout))
                results[(layout, "view")] = [res]
                html_mib = os.path.getsize(os.path.join(base, layout, "view.html")) / 2**20
                print(f"{layout} view: {res[0]:.2f} s, max RSS {res[1]:.0f} MiB, tree {res[2]:.0f} MiB, "
                      f"exit {res[3]}, HTML {html_mib:.1f} MiB", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"{args.ranks} ranks x {args.records} records, {args.repeats} repeats (view: once); median (min-max)")
    print("| layout | files | command | wall s | max RSS MiB (largest process) | peak MiB (process tree) | exit |")
    print("|---|---|---|---|---|---|---|")
    for (layout, command), rs in results.items():
        cols = [_spread([r[0] for r in rs], ".2f"), _spread([r[1] for r in rs], ".0f"),
                _spread([r[2] for r in rs], ".0f")]
        print(f"| {layout} | {sizes[layout] / 2**20:.0f} MiB | {command} | {' | '.join(cols)} "
              f"| {sorted({r[3] for r in rs})} |")


if __name__ == "__main__":
    main()
