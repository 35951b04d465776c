"""The calling thread's work per async op, counted instead of timed: instructions and
simulated cache misses (valgrind's callgrind) of ``dist.*(..., async_op=True).wait()``
on a plain Gloo group, on a commslayer group (``new_group(backend="commslayer")``,
the routed path) and on one watched by the flight recorder, in one process.

    python launch/bench/bench_op_instructions.py [--ranks 2] [--ops 500] [--sizes 4096 1048576] [--json F]

Why count: issue 37's per-op bars (5 µs untraced, 8 µs with the recorder, over
plain c10d) are in the calling thread's CPU, and on this 2-core machine that
figure moves by up to 8 µs from one series to the next for the same code
(docs/benchmarks.md), more than the bar.  Instructions and cache misses are the
same from run to run: what commslayer adds to an op is their difference from
plain Gloo's.  callgrind's cost model turns them into cycles (instructions + 10 a
first-level miss + 100 a last-level miss), and the CPU's clock into time.  What
the model leaves out: the kernel (a futex's wait and wake), branch mispredictions,
the latency of atomic instructions, and the pipeline's overlap of misses; so the
time is an estimate of the user-space work, not a measurement of the op.

The parent starts ``--ranks`` ranks on loopback: rank 0 under ``valgrind
--tool=callgrind`` (about 50 times slower), the others as they are.  Rank 0 collects only inside the timed
loops: a small C library, compiled here from valgrind's ``callgrind.h``, zeroes
the counts before each loop and dumps them after it.  Each dump's main-thread
part is one cell.  The ranks' collective deadline and peer timeout are raised
(``COMMSLAYER_TIMEOUT_S``, ``COMMSLAYER_PEER_TIMEOUT_S``) so that the slow rank is
not taken for a lost one; neither changes an op's path.

The wait's slice: a wait on a communicator with a liveness monitor blocks 50 ms
at a time, and a slice that ends before the op costs an exception and a call
into Python.  Natively no op here comes near 50 ms; under valgrind a 1 MiB
all-gather does (seen: 38,000 more instructions an op, nearly all of them that
exception), so the worker makes the slice 600 s before it builds the groups.

``--smoke`` checks that it still works: 5 all-reduces of 4 KiB a variant.
Needs valgrind, its headers and a C compiler (Debian: valgrind, gcc).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # launch.bench

from commslayer.run.processes import free_port  # noqa: E402
from launch.bench.measure import launcher_env, measured_revision, parse, run_workers  # noqa: E402

OPS = ("all_reduce", "all_gather_single")
VARIANTS = ("plain", "commslayer", "commslayer, recorder")
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
MARKER = """#include <valgrind/callgrind.h>
void counts_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void counts_off(const char *name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
"""


def cycles(counts: Dict[str, float]) -> float:
    """The cycles ``counts`` took by callgrind's cost model (KCachegrind's cycle estimate, without branches)."""
    first = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    last = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * first + 100 * last


def clock_mhz() -> Optional[float]:
    """The CPU's clock as /proc/cpuinfo states it (its first CPU's), or None."""
    try:
        found = re.search(r"^cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return None
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------- a rank
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import commslayer  # noqa: F401  (registers the "commslayer" backend)
    from commslayer.c10d import group_of
    from commslayer.comm import op_path
    from tracing.record.recorder import FlightRecorder

    op_path.WAIT_SLICE = timedelta(seconds=600)  # read as each group is built: see "The wait's slice" above

    out = Path(args.worker)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    groups = {"plain": dist.new_group(backend="gloo"), "commslayer": dist.new_group(backend="commslayer"),
              "commslayer, recorder": dist.new_group(backend="commslayer")}
    recorder = FlightRecorder(2 * args.ops, str(out / "trace"), job="bench-op-instructions")
    recorder.attach(group_of(groups["commslayer, recorder"]).communicator("cpu"))
    marker = ctypes.CDLL(str(out / "marker.so")) if rank == 0 else None
    world = dist.get_world_size()
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13's name first
    names = []
    for size in args.sizes:
        n = size // 4
        for op in args.op:
            inp = torch.ones(n)
            gathered = torch.empty(n * world)
            for variant in VARIANTS:
                group = groups[variant]

                def one() -> None:
                    if op == "all_reduce":
                        work = dist.all_reduce(inp, group=group, async_op=True)
                    else:
                        work = all_gather(gathered, inp, group=group, async_op=True)
                    work.wait()

                for _ in range(args.warmup):
                    one()
                dist.barrier()
                if marker is not None:
                    marker.counts_on()
                for _ in range(args.ops):
                    one()
                if marker is not None:
                    marker.counts_off(f"{op}|{size}|{variant}".encode())
                names.append([op, size, variant])
    dist.barrier()
    recorder.close()
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps({"cells": names}))


# ---------------------------------------------------------------- the parent
def _compile_marker(into: Path) -> None:
    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        sys.exit("bench_op_instructions.py needs valgrind and its headers (Debian: apt-get install valgrind)")
    source = into / "marker.c"
    source.write_text(MARKER)
    built = subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(into / "marker.so"), str(source)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"could not compile the callgrind marker: {built.stderr.strip()}")


def _dumps(into: Path) -> Dict[str, Dict[str, int]]:
    """Each dump's main-thread counts, by the name its loop gave it."""
    found = {}
    for path in into.glob("callgrind.out.*-01"):  # <pid>.<dump>-<thread>: thread 01 is the main thread
        text = path.read_text(errors="replace")
        named = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        events = re.search(r"^events: (.+)$", text, re.M)
        summary = re.search(r"^summary: (.+)$", text, re.M)
        if named and events and summary:
            found[named.group(1)] = dict(zip(events.group(1).split(), map(int, summary.group(1).split())))
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks of the job (rank 0 is counted)")
    p.add_argument("--ops", type=int, default=500, help="ops counted a cell")
    p.add_argument("--warmup", type=int, default=50, help="ops before each cell's count")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20], help="bytes a rank sends")
    p.add_argument("--op", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--json", help="also write the counts here")
    p.add_argument("--smoke", action="store_true", help="5 all-reduces of 4 KiB a variant")
    args = parse(p, {"ops": 5, "warmup": 5, "sizes": [4096], "op": ["all_reduce"]})
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-op-instructions-") as scratch:
        into = Path(scratch)
        _compile_marker(into)
        env = {**launcher_env(trace=False), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(args.ranks), "COMMSLAYER_TIMEOUT_S": "900", "COMMSLAYER_PEER_TIMEOUT_S": "300"}
        me = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--worker", scratch]
        valgrind = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--collect-atstart=no",
                    "--separate-threads=yes", f"--callgrind-out-file={into / 'callgrind.out.%p'}"]
        began = time.time()
        ranks = run_workers([valgrind + me] + [me] * (args.ranks - 1), env, scratch, timeout=3600)
        dumps = _dumps(into)
        revision = measured_revision()
        mhz = clock_mhz()
        table: List[Dict[str, Any]] = []
        for op, size, variant in ranks[0]["cells"]:
            counts = dumps.get(f"{op}|{size}|{variant}")
            if counts is None:
                sys.exit(f"callgrind wrote no counts for {op} {size} {variant} (files in {scratch}: "
                         f"{sorted(x.name for x in into.iterdir())})")
            table.append({"op": op, "bytes": size, "variant": variant,
                          **{e: counts.get(e, 0) / args.ops for e in EVENTS}})  # a summary leaves out trailing zeros
    print(f"command: python launch/bench/bench_op_instructions.py {' '.join(sys.argv[1:])}")
    print(f"revision {revision}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}; "
          f"{args.ranks} ranks on loopback; "
          f"{args.ops} ops a cell after {args.warmup}; rank 0's main thread, per op; "
          f"clock {mhz if mhz else 'unknown'} MHz (/proc/cpuinfo)\n")
    print("| op | bytes | variant | instructions | over plain | L1 misses (I / D read / D write) "
          "| last-level misses | est. cycles | over plain | ≈ µs over plain |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    plain: Dict[Any, Dict[str, float]] = {}
    for row in table:
        key = (row["op"], row["bytes"])
        if row["variant"] == "plain":
            plain[key] = row
        base = plain[key]
        row["cycles"] = cycles(row)
        more = row["cycles"] - cycles(base)
        us = f"{more / mhz:+.2f}" if mhz else "–"
        print(f"| {row['op']} | {row['bytes']} | {row['variant']} | {row['Ir']:,.0f} | {row['Ir'] - base['Ir']:+,.0f} "
              f"| {row['I1mr']:,.0f} / {row['D1mr']:,.0f} / {row['D1mw']:,.0f} "
              f"| {row['ILmr'] + row['DLmr'] + row['DLmw']:,.1f} | {row['cycles']:,.0f} | {more:+,.0f} | {us} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"revision": revision, "began": began, "clock_mhz": mhz,
                                               "args": {k: v for k, v in vars(args).items() if k != "worker"},
                                               "cells": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
