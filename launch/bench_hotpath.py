"""Warm per-op cost of commslayer's own Python, without the network: a
1-rank Gloo group, where an op is nearly free, so what is measured is the
calling thread's CPU time per op of each layer.

Variants, interleaved in rounds: plain c10d (``dist.all_reduce`` on a
1-rank Gloo group), a commslayer communicator, a commslayer communicator
watched by a flight recorder (``tracing.recorder``), and the recorder's own
per-op calls without an op (``scheduled``, ``started``, ``ended`` on a
finished ``Work``, called from as deep a stack as the op path's), and a
communicator with write isolation (``isolate_writes=True``: a staging copy
in and out per op).  This
complements ``bench_overhead.py``, whose cold per-op numbers (one op after a
barrier, between other groups' ops) are what a training loop sees.

    python launch/bench_hotpath.py --ops 20000 --rounds 7

``--smoke`` (200 ops, one round) checks in seconds that it still runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import commslayer
from commslayer.hooks import OpIO
from tracing.recorder import FlightRecorder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=20000, help="ops per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: every "
                   "variant, 200 ops, 1 round; explicit options still apply")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(ops=200, rounds=1)
        args = p.parse_args()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=0, world_size=1)
    plain = commslayer.new_comm("gloo", name="hot", store=store, rank=0, size=1)
    traced = commslayer.new_comm("gloo", name="hot-traced", store=store, rank=0, size=1)
    isolated = commslayer.new_comm("gloo", name="hot-isolated", store=store, rank=0, size=1, isolate_writes=True)
    with tempfile.TemporaryDirectory() as trace_dir:
        rec = FlightRecorder(4096, trace_dir, job="bench")
        rec.attach(traced)
        t = torch.ones(1)
        io = OpIO((t,), (t,), dist.ReduceOp.SUM, None)
        done = plain.all_reduce(t)

        def record_only() -> None:
            record = rec.scheduled(plain, "all_reduce", 0, 0, io, None, False, 30.0)
            record.started(0)
            record.ended(done)

        variants = {"plain c10d": lambda: dist.all_reduce(t), "commslayer": lambda: plain.all_reduce(t),
                    "commslayer + recorder": lambda: traced.all_reduce(t),
                    "commslayer, isolate_writes": lambda: isolated.all_reduce(t),
                    "recorder calls alone": lambda: record_only()}
        per_op = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                for _ in range(200):
                    call()
                c0 = time.thread_time()
                for _ in range(args.ops):
                    call()
                per_op[name].append((time.thread_time() - c0) / args.ops * 1e6)
    base = statistics.median(per_op["plain c10d"])
    print(f"command: `python {' '.join(sys.argv)}`; torch {torch.__version__}; 1-rank Gloo group\n")
    print("| variant | CPU µs/op, median of rounds | min–max over rounds | minus plain c10d |")
    print("|---|---:|---:|---:|")
    for name, xs in per_op.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.2f} | {min(xs):.2f}–{max(xs):.2f} | {med - base:+.2f} |")
    for comm in (plain, traced, isolated):
        comm.finalize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
