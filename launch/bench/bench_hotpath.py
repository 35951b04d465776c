"""Per-op cost of commslayer's own Python, on the calling thread.

Alone (``python launch/bench/bench_hotpath.py``) it runs on a 1-rank Gloo group,
where an op is nearly free: the cost of each layer warm, without the
network.  Under torchrun with 2 or more ranks every op is a real transfer
and each one follows a barrier, so each layer's code runs cold, as in a
training loop (``bench_overhead.py`` measures the same way, per op and size).
The figure is the calling thread's CPU time per op, the mean over ranks.

Variants, in turn in each round: plain c10d (``dist.all_reduce`` on the
default group), a commslayer communicator, a commslayer communicator
watched by a flight recorder (``tracing.record.recorder``), a communicator with
write isolation (``isolate_writes=True``: a staging copy in and out per op),
and the recorder's own per-op calls without an op (``scheduled``,
``started``, ``ended`` on a finished ``Work``).  With 2 or more ranks also
``should_commit`` (the vote a resilient job casts once a step: its tally, a
MIN all-reduce of two int64, and the vote's own Python), untraced and with
the recorder; on one rank nobody watches the members and the vote takes the
store instead.

    python launch/bench/bench_hotpath.py --ops 20000 --rounds 7
    torchrun --nproc-per-node 2 launch/bench/bench_hotpath.py --ops 500 --rounds 7

``--smoke`` (200 ops alone, 20 under torchrun; one round) checks in seconds
that it still runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import commslayer
from commslayer.hooks import OpIO
from tracing.record.recorder import FlightRecorder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=None,
                   help="ops per variant per round (default 20000 alone, 500 under torchrun)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--elements", type=int, default=1, help="float32 elements of the all_reduce (default 1)")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: every "
                   "variant, 200 ops (20 under torchrun), 1 round; explicit options still apply")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.smoke:
        p.set_defaults(ops=200 if world == 1 else 20, rounds=1)
        args = p.parse_args()
    if args.ops is None:
        args.ops = 20000 if world == 1 else 500
    if world == 1:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=0, world_size=1)
        where = {"store": store, "rank": 0, "size": 1}
    else:
        dist.init_process_group("gloo")
        where = {}
    sync = dist.new_group(backend="gloo") if world > 1 else None  # the barrier before each timed op
    plain = commslayer.new_comm("gloo", name="hot", **where)
    traced = commslayer.new_comm("gloo", name="hot-traced", **where)
    isolated = commslayer.new_comm("gloo", name="hot-isolated", isolate_writes=True, **where)
    with tempfile.TemporaryDirectory() as trace_dir:
        rec = FlightRecorder(4096, trace_dir, job="bench")
        rec.attach(traced)
        t = torch.ones(args.elements)
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
        if world > 1:
            variants.update({"should_commit": lambda: plain.should_commit(),
                             "should_commit + recorder": lambda: traced.should_commit()})
        per_op = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, call in variants.items():
                per_op[name].append(timed_block(call, args.ops, sync) * 1e6)
    rounds = torch.tensor(list(per_op.values()), dtype=torch.float64)
    if world > 1:  # the mean over ranks
        dist.all_reduce(rounds, group=sync)
        rounds /= world
    if dist.get_rank() == 0:
        print(report(dict(zip(per_op, rounds.tolist())), world))
    for comm in (plain, traced, isolated):
        comm.finalize()
    dist.destroy_process_group()
    return 0


def timed_block(call: Callable[[], object], ops: int, sync: Optional[dist.ProcessGroup]) -> float:
    """Calling-thread CPU seconds per op over ``ops`` calls, after untimed warm-up calls;
    with ``sync``, every call follows a barrier on it and only the calls are timed."""
    if sync is None:
        for _ in range(200):
            call()
        c0 = time.thread_time()
        for _ in range(ops):
            call()
        return (time.thread_time() - c0) / ops
    spent = 0.0
    for i in range(ops + 5):
        dist.barrier(group=sync)
        c0 = time.thread_time()
        call()
        if i >= 5:
            spent += time.thread_time() - c0
    return spent / ops


def report(per_op: Dict[str, List[float]], world: int) -> str:
    base = statistics.median(per_op["plain c10d"])
    where = "1-rank Gloo group" if world == 1 else f"{world} ranks, one barrier before each op, mean over ranks"
    lines = [f"command: `{'python' if world == 1 else 'torchrun'} {' '.join(sys.argv)}`; "
             f"torch {torch.__version__}; {where}\n",
             "| variant | CPU µs/op, median of rounds | min–max over rounds | minus plain c10d |",
             "|---|---:|---:|---:|"]
    for name, xs in per_op.items():
        med = statistics.median(xs)
        lines.append(f"| {name} | {med:.2f} | {min(xs):.2f}–{max(xs):.2f} | {med - base:+.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
