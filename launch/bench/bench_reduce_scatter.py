"""Reduce-scatter on Gloo: commslayer's ring (commslayer/comm/ring.py) against Gloo's own.

Every rank runs, side by side, rotating their order on every repeat, a float32
``reduce_scatter_single`` (SUM) of each input size on three communicators:

- ``native``: ``reduce_scatter="native"`` (Gloo's own reduce-scatter);
- ``native (A/A)``: a second one of the same, to show the noise of the measurement;
- ``ring``: ``reduce_scatter="ring"``.

With ``--async-adapter`` each op is issued as FSDP2 issues its reduce-scatters:
``dist.reduce_scatter_single(out, x, group=g, async_op=True).wait()`` on the
communicator's ``as_process_group()`` (the c10d adapter, where Gloo's own
takes the native async path and the ring the general Python path).

A sample is one op between barriers; a repeat's figure is the slowest rank's
median over ``--iters`` samples; the table gives the median and range over
repeats, the speed-up of each against ``native``, the calling thread's CPU per
op (``time.thread_time``, each rank's median, averaged over the ranks; the
median and range over repeats), and (``--link capped``) what
rank 0 sent per op: the bytes on its link (tc's counters: with TCP/IP and
Ethernet headers and the ACKs of what it received) and the TCP payload its
sockets had acknowledged (``ss``), the latter against (n-1)/n of the input.

``--link capped`` (root and iproute2) runs every rank in a network namespace of
launch/bench/bench_overlap.py's testbed (faults/netns.py), its link capped with
``tc tbf`` at ``--rate`` both ways; ``--link loopback`` runs the ranks on this
host's loopback, without a cap.

    python launch/bench/bench_reduce_scatter.py --link capped --ranks 2 4        # as root
    python launch/bench/bench_reduce_scatter.py --link loopback --ranks 2 4 --sizes 4K 64K 256K 1M 4M 16M 64M
    python launch/bench/bench_reduce_scatter.py --link loopback --async-adapter --ranks 2 4 --sizes 64K 256K 512K 1M

``--smoke`` checks in seconds that the benchmark works: loopback, 2 ranks,
64 KiB and 1 MiB, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from commslayer.run.processes import free_port  # noqa: E402
from faults.netns import Network, sent_bytes, tcp_payload_sent  # noqa: E402
from launch.bench.measure import parse, prepare_testbed, report, run_workers  # noqa: E402

PREFIX = "csrs"  # namespace names: csrs<pid>-hub, csrs<pid>-r<rank>
CONFIGS = {"native": "native", "native (A/A)": "native", "ring": "ring"}  # name -> the reduce_scatter hint
ROOT = Path(__file__).resolve().parents[2]
SMOKE = {"link": "loopback", "ranks": [2], "sizes": ["64K", "1M"], "repeats": 1, "iters": 2, "timeout": 60}
_UNITS = {"K": 1 << 10, "M": 1 << 20}


def size_bytes(text: str) -> int:
    """``64K``, ``1M``, ``4096``: a size in bytes."""
    unit = _UNITS.get(text[-1:].upper(), 1)
    return int(text[:-1] if unit > 1 else text) * unit


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


# ------------------------------------------------------------------ parent
def run_world(world: int, args: argparse.Namespace) -> List[dict]:
    """Run one worker per rank (in the testbed's namespaces, or on loopback); each rank's results."""
    with tempfile.TemporaryDirectory() as out:
        worker = [sys.executable, str(Path(__file__).resolve()), "--worker", out, "--link", args.link,
                  "--repeats", str(args.repeats), "--iters", str(args.iters), "--sizes", *args.sizes] + \
            (["--async-adapter"] if args.async_adapter else [])
        env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "COMMSLAYER_TIMEOUT_S": "300"}
        env.pop("COMMSLAYER_TRACE_DIR", None)
        if args.link == "capped":
            with Network(world, PREFIX, rails=("ag",), rate=args.rate) as bed:
                env.update(MASTER_ADDR=bed.address(1, 0), MASTER_PORT="29500", GLOO_SOCKET_IFNAME="ag")
                return run_workers([bed.run(r, worker) for r in range(world)], env, out, args.timeout)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
        return run_workers([worker] * world, env, out, args.timeout)


def summarize(ranks: List[dict]) -> Dict[str, Dict[str, dict]]:
    """Per size and config: median and range over repeats of the slowest rank's median op time."""
    table: Dict[str, Dict[str, dict]] = {}
    for size in ranks[0]["sizes"]:
        row = table.setdefault(str(size), {})
        for cfg in CONFIGS:
            blocks = [[r for r in rank["blocks"] if r["size"] == size and r["config"] == cfg] for rank in ranks]
            per_repeat = [max(statistics.median(b[i]["op_s"]) for b in blocks) for i in range(len(blocks[0]))]
            cpu = [statistics.fmean(statistics.median(b[i]["cpu_s"]) for b in blocks) for i in range(len(blocks[0]))]
            sent = [b["sent_bytes"] for b in blocks[0] if b["sent_bytes"] is not None]
            row[cfg] = {"median": statistics.median(per_repeat), "min": min(per_repeat), "max": max(per_repeat),
                        "repeats": per_repeat, "cpu_median": statistics.median(cpu), "cpu_min": min(cpu),
                        "cpu_max": max(cpu),
                        "rank0_wire": statistics.median(w for w, _ in sent) if sent else None,
                        "rank0_payload": statistics.median(p for _, p in sent) if sent else None}
    return table


def markdown(world: int, table: Dict[str, Dict[str, dict]]) -> str:
    lines = [f"**{world} ranks**", "",
             "| input | configuration | ms per op, median [min–max] | speed-up vs native "
             "| caller CPU per op, µs [min–max] | rank 0 sent per op: wire / TCP payload (MB) "
             "| payload / ((n-1)/n × input) |",
             "|---|---|---|---|---|---|---|"]
    for size, row in table.items():
        nbytes = int(size)
        base = row["native"]["median"]
        for cfg, cell in row.items():
            wire, payload = cell["rank0_wire"], cell["rank0_payload"]
            sent = "–" if wire is None else f"{wire / 1e6:.3f} / {payload / 1e6:.3f}"
            share = "–" if payload is None else f"{payload / ((world - 1) / world * nbytes):.3f}"
            lines.append(f"| {label(nbytes)} | {cfg} | {1e3 * cell['median']:.2f} [{1e3 * cell['min']:.2f}–"
                         f"{1e3 * cell['max']:.2f}] | {base / cell['median']:.2f}× | {1e6 * cell['cpu_median']:.1f} "
                         f"[{1e6 * cell['cpu_min']:.1f}–{1e6 * cell['cpu_max']:.1f}] | {sent} | {share} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", choices=["capped", "loopback"], default="capped")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=["1M", "4M", "16M", "64M"],
                   help="input sizes per rank (the whole input; K and M suffixes)")
    p.add_argument("--rate", default="250mbit", help="--link capped: tc tbf rate of every link, each direction")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=2, help="timed ops per size, configuration and repeat")
    p.add_argument("--timeout", type=float, default=1200, help="seconds one world size may take")
    p.add_argument("--async-adapter", action="store_true",
                   help="issue each op async through torch.distributed on the communicator's as_process_group()")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: loopback, "
                   "2 ranks, 64 KiB and 1 MiB, 1 repeat; explicit options still apply")
    args = parse(p, SMOKE)
    if args.worker:
        worker(args)
        return
    if args.link == "capped":
        prepare_testbed(PREFIX, "bench_reduce_scatter.py --link capped")

    def measure(world: int) -> tuple:
        ranks = run_world(world, args)
        table = summarize(ranks)
        return table, ranks, markdown(world, table)

    report(args, "bench_reduce_scatter.py", measure)


# ------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    import torch

    import commslayer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                       rank == 0, timeout=timedelta(seconds=60))
    comms = {cfg: commslayer.new_comm("gloo", name=cfg.replace(" ", "_").replace("/", ""), store=store, rank=rank,
                                      size=world, reduce_scatter=hint) for cfg, hint in CONFIGS.items()}
    sync = commslayer.new_comm("gloo", name="sync", store=store, rank=rank, size=world)
    groups = {}
    for cfg, comm in comms.items() if args.async_adapter else ():
        comm.global_ranks = list(range(world))
        groups[cfg] = comm.as_process_group()

    def reduce_scatter(cfg: str, out: torch.Tensor, x: torch.Tensor) -> None:
        if groups:
            torch.distributed.reduce_scatter_single(out, x, group=groups[cfg], async_op=True).wait()
        else:
            comms[cfg].reduce_scatter_single(out, x)
    capped = args.link == "capped"
    sizes = [size_bytes(s) // (4 * world) * 4 * world for s in args.sizes]
    blocks = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        out = torch.empty(x.numel() // world)
        configs = list(CONFIGS)
        for cfg in configs:  # warm-up: connections, allocations
            reduce_scatter(cfg, out, x)
        for repeat in range(args.repeats):
            for cfg in configs[repeat % len(configs):] + configs[:repeat % len(configs)]:
                times, cpu = [], []
                before = (sent_bytes(("ag",))["ag"], tcp_payload_sent()) if capped else None
                for _ in range(args.iters):
                    sync.barrier()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    reduce_scatter(cfg, out, x)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
                sync.barrier()  # the last ACKs are in
                after = (sent_bytes(("ag",))["ag"], tcp_payload_sent()) if capped else None
                # the barriers' few bytes count too: a few hundred per op, against MBs
                sent = None if before is None or after is None else \
                    [(a - b) / args.iters for a, b in zip(after, before)]
                blocks.append({"size": nbytes, "config": cfg, "repeat": repeat, "op_s": times, "cpu_s": cpu,
                           "sent_bytes": sent})
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "sizes": sizes, "blocks": blocks}))
    sync.barrier()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 Gloo can abort at interpreter exit (docs/api.md, Known limits)


if __name__ == "__main__":
    main()
