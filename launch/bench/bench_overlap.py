"""What fsdp_overlap buys: FSDP2 backward and step time on a two-rail network
the benchmark builds itself.

Testbed (needs root and iproute2): one network namespace per rank and a hub
namespace with two bridges. Every rank has two veth links, ``ag`` (rail 1,
10.77.1.0/24) and ``rs`` (rail 2, 10.77.2.0/24), each capped with ``tc tbf``
in both directions (``--rate``). The job's groups use rail 1
(``GLOO_SOCKET_IFNAME=ag``). All namespaces carry this process's id in their
name and are deleted when the benchmark ends, fails or is interrupted; a
later run deletes those of runs that died.

In every rank, side by side, alternating their order on every repeat, the
same linear stack (one FSDP2 unit per layer) trains under:

- ``default``: FSDP2 as it comes (all-gather and reduce-scatter share a group);
- ``default (A/A)``: the same again, to show the noise of the measurement;
- ``native``: ``set_separate_reduce_scatter_group(True)`` (a second group, rail 1);
- ``ours, 1 link``: ``fsdp_overlap.enable(model, interface="ag")``;
- ``ours, 2 links``: ``fsdp_overlap.enable(model, interface="rs")``.

Per configuration: backward and step time (the slowest rank's median over the
timed steps of a repeat; the table gives the median and range over repeats),
the share of reduce-scatter time hidden under all-gather (the viewer's
``overlap_by_rank`` on each rank's trace records of the backward passes) and
the bytes rank 0 sent on each rail (tc counters), which show where the traffic went.

    python launch/bench/bench_overlap.py --ranks 2 4 --json docs/data/overlap.json   # as root

``--configs`` runs a subset; ``--trace-dir DIR`` also leaves every rank's
trace there, for ``commslayer-trace overlap DIR``.  ``--smoke`` checks in
seconds that the benchmark still works: every configuration once, 2 ranks,
a 2-layer 256-wide stack, one timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from faults.netns import Network, sent_bytes  # noqa: E402
from launch.bench.measure import parse, prepare_testbed, report, run_workers  # noqa: E402

PREFIX = "csov"  # namespace names: csov<pid>-hub, csov<pid>-r<rank>
# command-line key -> the name in tables
CONFIGS = {"default": "default", "default-aa": "default (A/A)", "native": "native",
           "ours-1link": "ours, 1 link", "ours-2links": "ours, 2 links"}
ROOT = Path(__file__).resolve().parents[2]
SMOKE = {"ranks": [2], "repeats": 1, "steps": 1, "layers": 2, "dim": 256, "timeout": 120}


# ------------------------------------------------------------------ parent
def run_world(world: int, args: argparse.Namespace) -> List[dict]:
    """Build the testbed, run one worker per rank namespace, return each rank's results."""
    with Network(world, PREFIX, rails=("ag", "rs"), rate=args.rate) as bed, tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": bed.address(1, 0), "MASTER_PORT": "29500",
               "GLOO_SOCKET_IFNAME": "ag", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "COMMSLAYER_TIMEOUT_S": "120"}
        env.pop("COMMSLAYER_TRACE_DIR", None)
        worker_args = [sys.executable, str(Path(__file__).resolve()), "--worker", out,
                       "--repeats", str(args.repeats), "--steps", str(args.steps), "--layers", str(args.layers),
                       "--dim", str(args.dim), "--batch", str(args.batch),
                       "--reduce-dtype", args.reduce_dtype,
                       "--configs", *args.configs]
        if args.trace_dir:
            worker_args += ["--trace-dir", str(Path(args.trace_dir).resolve())]
        return run_workers([bed.run(r, worker_args) for r in range(world)], env, out, args.timeout)


def summarize(world: int, ranks: List[dict]) -> Dict[str, dict]:
    """Per config: median and range over repeats of the slowest rank's median step figures."""
    table = {}
    for cfg in ranks[0]["configs"]:
        blocks = [[r["blocks"][i] for r in ranks] for i, b in enumerate(ranks[0]["blocks"]) if b["config"] == cfg]
        row = {}
        for key in ("backward_s", "step_s"):
            per_repeat = [max(statistics.median(b[key]) for b in rank_blocks) for rank_blocks in blocks]
            row[key] = {"median": statistics.median(per_repeat), "min": min(per_repeat), "max": max(per_repeat),
                        "repeats": per_repeat}
        hidden = [b["hidden_fraction"] for rank_blocks in blocks for b in rank_blocks]
        row["hidden_fraction"] = {"median": statistics.median(hidden), "min": min(hidden), "max": max(hidden)}
        row["rank0_bytes"] = {rail: statistics.median(rank_blocks[0]["sent_bytes"][rail] for rank_blocks in blocks)
                              for rail in ("ag", "rs")}
        table[cfg] = row
    return table


def _ratio(reference: Optional[float], value: float) -> str:
    return "–" if reference is None else f"{reference / value:.2f}×"


def markdown(world: int, table: Dict[str, dict]) -> str:
    base = table["default"]["backward_s"]["median"] if "default" in table else None
    native = table["native"]["backward_s"]["median"] if "native" in table else None
    lines = [f"**{world} ranks**", "",
             "| configuration | backward ms, median [min–max] | step ms, median [min–max] | RS hidden under AG, "
             "median [min–max] | rank 0 sent per step, rail 1 / rail 2 (MB) | backward speed-up vs default / vs native |",
             "|---|---|---|---|---|---|"]
    for cfg, row in table.items():
        b, s, h = row["backward_s"], row["step_s"], row["hidden_fraction"]
        lines.append(
            f"| {cfg} | {1e3 * b['median']:.1f} [{1e3 * b['min']:.1f}–{1e3 * b['max']:.1f}] "
            f"| {1e3 * s['median']:.1f} [{1e3 * s['min']:.1f}–{1e3 * s['max']:.1f}] "
            f"| {100 * h['median']:.1f}% [{100 * h['min']:.1f}–{100 * h['max']:.1f}%] "
            f"| {row['rank0_bytes']['ag'] / 1e6:.1f} / {row['rank0_bytes']['rs'] / 1e6:.1f} "
            f"| {_ratio(base, b['median'])} / {_ratio(native, b['median'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rate", default="250mbit", help="tc tbf rate of every link, each direction")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and repeat")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="gradient reduce-scatter dtype (bfloat16: FSDP2's MixedPrecisionPolicy(reduce_dtype=...))")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="which configurations to run (default: all)")
    p.add_argument("--trace-dir", help="each rank also dumps its trace records here (for commslayer-trace)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one world size may take")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: every "
                   "configuration, 2 ranks, 2 layers of 256, 1 repeat of 1 step; explicit options still apply")
    args = parse(p, SMOKE)
    if args.worker:
        worker(args)
        return
    prepare_testbed(PREFIX, "bench_overlap.py")

    def measure(world: int) -> tuple:
        ranks = run_world(world, args)
        table = summarize(world, ranks)
        return table, ranks, markdown(world, table)

    report(args, "bench_overlap.py", measure)


# ------------------------------------------------------------------ worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import commslayer  # noqa: F401  (registers the backend)
    import fsdp_overlap
    from tracing.read.analysis import overlap_by_rank
    from tracing.record.recorder import install

    rec = install(args.trace_dir or os.path.join(args.worker, "traces"), capacity=1 << 16, signals=False)
    dist.init_process_group("commslayer")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    mp = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)} if args.reduce_dtype == "bfloat16" else {}

    def build(cfg: str) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh, **mp)
        fully_shard(model, mesh=mesh, **mp)
        if cfg == "native":
            model.set_separate_reduce_scatter_group(True)
        elif cfg.startswith("ours"):
            fsdp_overlap.enable(model, interface="rs" if "2 links" in cfg else "ag")
        return model

    configs = [CONFIGS[key] for key in args.configs]
    models = {cfg: build(cfg) for cfg in configs}
    optims = {cfg: torch.optim.SGD(m.parameters(), lr=1e-3) for cfg, m in models.items()}
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))

    def step(cfg: str) -> tuple:
        t0 = time.monotonic_ns()
        loss = models[cfg](x).pow(2).mean()
        t1 = time.monotonic_ns()
        loss.backward()
        t2 = time.monotonic_ns()
        optims[cfg].step()
        optims[cfg].zero_grad()
        return t0, t1, t2, time.monotonic_ns()

    blocks = []
    for repeat in range(args.repeats):
        order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
        for cfg in order:
            step(cfg)  # warm-up: the previous config's buffers are cold now
            dist.barrier()
            before, first = sent_bytes(("ag", "rs")), len(rec.records())
            times = [step(cfg) for _ in range(args.steps)]
            after = sent_bytes(("ag", "rs"))
            windows = [(t1, t2) for _, t1, t2, _ in times]
            backward = [{**r, "rank": rank} for r in rec.records()[first:]
                        if r["start_ns"] is not None and any(a <= r["start_ns"] < b for a, b in windows)]
            stats = overlap_by_rank(backward).get(rank)
            blocks.append({
                "config": cfg, "repeat": repeat,
                "backward_s": [(t2 - t1) / 1e9 for _, t1, t2, _ in times],
                "step_s": [(t3 - t0) / 1e9 for t0, _, _, t3 in times],
                "hidden_fraction": stats.hidden_fraction if stats else 0.0,
                "rs_s": stats.rs_s if stats else 0.0, "ag_s": stats.ag_s if stats else 0.0,
                "sent_bytes": {dev: (after[dev] - before[dev]) / args.steps for dev in after},
                "rs_comms": sorted({r["comm_id"] for r in backward if r["op"] == "reduce_scatter_single"}),
            })
            dist.barrier()
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "configs": configs,
                                                                 "blocks": blocks}))
    if args.trace_dir:
        rec.dump("end of benchmark")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 Gloo can abort at interpreter exit (docs/api.md, Known limits)


if __name__ == "__main__":
    main()
