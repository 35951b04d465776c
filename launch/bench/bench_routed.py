"""What routing costs an unmodified job's step: an FSDP2 and a DDP training script
under plain torchrun, run as it is and with ``COMMSLAYER_ROUTE_C10D=1`` (every
Gloo group made a commslayer group, nothing else changed), side by side in one
run.

    python launch/bench/bench_routed.py --repeats 5

Configurations, per job (``fsdp2``: ``fully_shard`` on each layer of an MLP,
its all-gathers and reduce-scatters async through the c10d adapter; ``ddp``:
``DistributedDataParallel``, its bucket all-reduces async through the adapter):

* ``plain`` and ``plain (A/A)``: plain torchrun, twice, so the spread of two
  identical configurations calibrates the others;
* ``routed``: ``COMMSLAYER_ROUTE_C10D=1``, tracing off;
* ``routed, recorder``: the same with the flight recorder on
  (``COMMSLAYER_TRACE_DIR``, its dump in a scratch directory);
* ``routed, JSON lines``: the recorder and its structlog JSON lines sink
  (``COMMSLAYER_TRACE_JSONL=1``), one line per op;
* ``routed, native off``: routed with ``COMMSLAYER_NATIVE=0``, where every
  async op takes the general Python path, as all did before the native async
  path (docs/bench/async-path.md): what the native path saves.

Each run is one ``torchrun --nproc-per-node 2`` of this file's worker; a run's
figure is the median over its steps from ``--warmup`` on of the slowest
rank's step time (forward, backward, the optimizer).  Beside it, the CPU a
step takes, summed over the ranks (each rank's median): the whole process's
and its main thread's, so that a routed step that costs more can be told
from one that waits more.  Every repeat runs each
configuration once, the order rotated from repeat to repeat; ``--configs``
picks some of them.  ``--smoke`` runs each once for a few steps of a small
model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from measure import ROOT, launcher_env, series, step_cells

CONFIGS = ("plain", "plain (A/A)", "routed", "routed, recorder", "routed, JSON lines", "routed, native off")
JOBS = ("fsdp2", "ddp")


def worker(job: str, steps: int, dim: int, layers: int, batch: int, out: str) -> None:
    """One rank of the job: train, then write its step times to ``out/rank<r>.json``."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from commslayer.c10d import group_of

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)])
    if job == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    times: List[float] = []
    cpu: List[float] = []
    main_cpu: List[float] = []
    for _ in range(steps):
        x = torch.randn(batch, dim, generator=gen)
        began, began_cpu, began_main = time.perf_counter(), time.process_time(), time.thread_time()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        main_cpu.append(time.thread_time() - began_main)
    group = "commslayer" if group_of(dist.group.WORLD) is not None else type(dist.group.WORLD).__name__
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"group": group, "step_s": times, "cpu_s": cpu, "main_cpu_s": main_cpu}, f)
    dist.destroy_process_group()


def run(job: str, config: str, args: argparse.Namespace, scratch: str, name: str) -> dict:
    """One torchrun of the job in ``config``: the slowest rank's median step time."""
    env = launcher_env(trace=False)
    if config.startswith("routed"):
        env["COMMSLAYER_ROUTE_C10D"] = "1"
    if config in ("routed, recorder", "routed, JSON lines"):
        env["COMMSLAYER_TRACE_DIR"] = os.path.join(scratch, name)
    if config == "routed, JSON lines":
        env["COMMSLAYER_TRACE_JSONL"] = "1"
    if config == "routed, native off":
        env["COMMSLAYER_NATIVE"] = "0"
    out = os.path.join(scratch, name + "-out")
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29600 + hash(name) % 300), os.path.abspath(__file__), "--worker", job, "--out", out,
           "--steps", str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
           "--batch", str(args.batch)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    ranks = []
    for rank in range(2):
        if os.path.exists(os.path.join(out, f"rank{rank}.json")):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    if done.returncode != 0 or len(ranks) != 2:
        raise SystemExit(f"{job} {config} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    routed = {r["group"] for r in ranks} == {"commslayer"}
    if routed != config.startswith("routed"):
        raise SystemExit(f"{job} {config}: the default group was {ranks[0]['group']}")
    slowest = [max(per_rank) for per_rank in zip(*(r["step_s"] for r in ranks))][args.warmup:]
    return {"step_s": statistics.median(slowest),
            **{key: sum(statistics.median(r[key][args.warmup:]) for r in ranks) for key in ("cpu_s", "main_cpu_s")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of each run's figure")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   help="the configurations to run (plain is always run: the others are figures against it)")
    p.add_argument("--json", help="also write the runs' figures here")
    p.add_argument("--smoke", action="store_true", help="every configuration once, 6 steps of a small model")
    p.add_argument("--worker", choices=JOBS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.dim, args.layers, args.batch, args.out)
        return 0
    if args.smoke:
        args.repeats, args.steps, args.warmup, args.dim, args.layers, args.batch = 1, 6, 2, 64, 2, 4
    scratch = tempfile.mkdtemp(prefix="bench-routed-")
    configs = ["plain"] + [c for c in CONFIGS if c in args.configs and c != "plain"]
    runs = {(job, config): (lambda name, job=job, config=config: run(job, config, args, scratch, name))
            for job in args.jobs for config in configs}
    figures, revision, began = series(runs, args.repeats, lambda line: print(line, file=sys.stderr, flush=True),
                                      scratch)
    print(f"command: python launch/bench/bench_routed.py {' '.join(sys.argv[1:])}")
    print(f"revision {revision}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}; "
          f"{args.repeats} repeats; model: {args.layers} layers of {args.dim}, batch {args.batch} per rank; "
          f"2 ranks; steps {args.warmup}..{args.steps - 1} of each run\n")
    print("| job | configuration | step ms (median) | min–max | vs plain (median) | min–max "
          "| CPU ms a step, 2 ranks (median) | main thread (median) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for job in args.jobs:
        base = figures[(job, "plain")]
        for config in configs:
            xs = figures[(job, config)]
            print(f"| {job} | {config} | {step_cells(xs, base, 'vs_plain')} | "
                  f"{statistics.median(x['cpu_s'] for x in xs) * 1e3:.2f} | "
                  f"{statistics.median(x['main_cpu_s'] for x in xs) * 1e3:.2f} |")
    if args.json:
        table: Dict[str, List[dict]] = {" / ".join(key): xs for key, xs in figures.items()}
        with open(args.json, "w") as f:
            json.dump({"revision": revision, "began": began, "args": vars(args), "runs": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
