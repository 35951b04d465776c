"""What commslayer adds to an NCCL op: calling-thread CPU time and wall time per
synchronous and asynchronous ``all_reduce`` on CUDA tensors, against plain c10d's
NCCL group and a second plain group (A/A), in one process per GPU.

    python launch/bench/bench_nccl.py [--ranks N] [--sizes 4096,1048576] [--repeats 3] [--tracing]

Rank r runs on GPU r (N at most the GPUs there are; one GPU gives a world of one,
where NCCL copies and the figures are the layers' own cost). Each repeat runs
every variant in turn, ``--iters`` timed ops after a warm-up; a cell is the
median over the repeats of each repeat's median, and its min–max. Without CUDA
it says so and exits 0 (this project's CI has no GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from faults.ranks import run_ranks  # noqa: E402
from launch.bench.measure import median_range, parse  # noqa: E402

VARIANTS = ("plain", "plain A'", "commslayer", "plain async", "commslayer async")


def _rank(rank: int, size: int, store, sizes: List[int], iters: int, repeats: int,
          traced: bool) -> Dict[str, List[tuple]]:
    import torch.distributed as dist

    import commslayer

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.PrefixStore("plain/", store), rank=rank, world_size=size,
                            device_id=device)
    other = dist.new_group(list(range(size)))
    comm = commslayer.new_comm("nccl", device, name="bench", store=dist.PrefixStore("ours/", store), rank=rank,
                               size=size, timeout=60)
    seen: Dict[str, List[tuple]] = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=device)
        calls: Dict[str, Callable[[], object]] = {
            "plain": lambda: dist.all_reduce(t),
            "plain A'": lambda: dist.all_reduce(t, group=other),
            "commslayer": lambda: comm.all_reduce(t),
            "plain async": lambda: dist.all_reduce(t, async_op=True).wait(),
            "commslayer async": lambda: comm.all_reduce(t, async_op=True).wait(),
        }
        for _ in range(repeats):
            for name in VARIANTS:
                seen.setdefault(f"{name}|{nbytes}", []).append(_timed(calls[name], iters))
    if traced:  # the flight recorder on, then the commslayer variants again
        from tracing.record.recorder import install

        install(None, signals=False)
        for nbytes in sizes:
            t = torch.ones(nbytes // 4, device=device)
            for _ in range(repeats):
                for name, call in (("commslayer + recorder", lambda: comm.all_reduce(t)),
                                   ("commslayer async + recorder", lambda: comm.all_reduce(t, async_op=True).wait())):
                    seen.setdefault(f"{name}|{nbytes}", []).append(_timed(call, iters))
    comm.finalize()
    dist.destroy_process_group()
    return seen


def _timed(call: Callable[[], object], iters: int) -> tuple:
    """(median CPU µs, median wall µs) of ``iters`` calls after a warm-up."""
    for _ in range(min(iters, 50)):
        call()
    torch.cuda.synchronize()
    cpu, wall = [], []
    for _ in range(iters):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        call()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        cpu.append((c1 - c0) / 1e3)
        wall.append((w1 - w0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1, help="world size, one GPU each (default 1)")
    p.add_argument("--sizes", default="4096,1048576", help="bytes per op, comma-separated (default 4096,1048576)")
    p.add_argument("--iters", type=int, default=2000, help="timed ops per variant and repeat (default 2000)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    p.add_argument("--tracing", action="store_true",
                   help="then the commslayer variants again with the flight recorder on")
    p.add_argument("--smoke", action="store_true", help="one repeat of 20 ops at 4 KiB")
    args = parse(p, {"sizes": "4096", "iters": 20, "repeats": 1})
    if not torch.cuda.is_available():
        print("bench_nccl.py: no CUDA device here; nothing measured")
        return
    if not 1 <= args.ranks <= torch.cuda.device_count():
        sys.exit(f"--ranks {args.ranks}: this machine has {torch.cuda.device_count()} GPU(s), one per rank")
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seen = run_ranks(_rank, args.ranks, sizes, args.iters, args.repeats, args.tracing, timeout=1200,
                     start="spawn")[0]
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)}, world size {args.ranks}, rank 0's figures\n")
    print("| variant | bytes | CPU µs (median) | CPU µs (min–max) | wall µs (median) | wall µs (min–max) "
          "| CPU over plain, µs |")
    print("|---|---|---|---|---|---|---|")
    traced = ("commslayer + recorder", "commslayer async + recorder") if args.tracing else ()
    for nbytes in sizes:
        base = {"plain": seen[f"plain|{nbytes}"], "plain async": seen[f"plain async|{nbytes}"]}
        for name in VARIANTS + traced:
            runs = seen[f"{name}|{nbytes}"]
            against = base["plain async" if "async" in name else "plain"]
            extra = "–" if name in base else \
                f"{statistics.median(r[0] for r in runs) - statistics.median(r[0] for r in against):+.2f}"
            print(f"| {name} | {nbytes} | {median_range([r[0] for r in runs], digits=2)} "
                  f"| {median_range([r[1] for r in runs], digits=2)} | {extra} |")
    print(f"\ncommand: python launch/bench/bench_nccl.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
