"""What the whole product costs a training step while nothing fails, part by part:
the resilience API in replica mode and in per-rank mode (peer copies every step),
each untraced, with the flight recorder and with JSON lines, next to the same
script run the plain way, side by side in one run, with ablations and a CPU
account that say where the added time goes.

    python launch/bench/bench_step_cost.py --repeats 5 --json docs/data/step-cost.json

``--smoke`` runs every configuration once for a few steps of a tiny model.

Scripts (``--scripts``), each with 4 ranks on this machine: ``train.py``
(launch/train.py at its default size, whose plain step is over 300 ms here)
and ``FSDP2 example`` (launch/examples/fsdp2_resilient.py, tens of ms a step),
so that fixed per-step costs and per-byte costs can be told apart.  Every
process runs under launch/bench/cost_probe.py, which writes down where its
CPU went.  Configurations:

* ``plain torchrun`` and ``plain torchrun (A/A)``: ``torchrun --nproc-per-node 4
  launch/plain.py SCRIPT``: the script as it was before commslayer (FSDP2 over
  the 4 ranks on plain Gloo), twice: per-rank mode's baseline and its noise;
* ``plain HSDP`` and ``plain HSDP (A/A)``: ``commslayer-run --replicas 2
  --nproc-per-replica 2 launch/plain.py SCRIPT``: plain Gloo groups, one flat
  all-reduce across the groups after backward: replica mode's baseline and its noise;
* ``plain HSDP + vote``: the same with ``launch/plain.py --vote``, a MIN all-reduce
  of one int64 over the 4 ranks after the average: ``should_commit``'s collective
  alone, without the rest of the resilience API;
* ``replica, untraced`` / ``replica, recorder`` / ``replica, JSON lines``:
  ``commslayer-run --replicas 2 --nproc-per-replica 2 SCRIPT`` with
  ``COMMSLAYER_TRACE_DIR=""`` / the launcher's default (the flight recorder,
  dumped at the end) / that and ``COMMSLAYER_TRACE_JSONL=1`` (a JSON line per
  op, written by a sink thread);
* ``per-rank, untraced`` / ``per-rank, recorder`` / ``per-rank, JSON lines``:
  ``commslayer-run --nproc-per-node 4 SCRIPT``, every rank its own restart
  unit and its state copied to a peer every step (``COMMSLAYER_REFRESH_EVERY=1``,
  the default), the same three tracing settings;
* ablations, untraced: ``replica, native off`` and ``per-rank, native off``
  (``COMMSLAYER_NATIVE=0``: every op, synchronous or async through the c10d
  adapter, takes the general Python path); ``replica, after backward``
  (``COMMSLAYER_AVERAGE_AFTER_BACKWARD=1``: no gradient hooks, one average
  after backward); ``per-rank, copies once`` (``COMMSLAYER_REFRESH_EVERY``
  past the last step: the copies are made once, before step 0).

A run's step time is, for each step from ``--warmup`` on, the slowest rank's
(the API's ``step_s``; plain.py times the same span), median over those steps.
vs baseline: a run's step time over its baseline's in the same repeat (plain
torchrun for per-rank mode, plain HSDP for replica mode), minus 1.  The CPU
account (cost_probe.py) is per rank and step, summed over the ranks: process
CPU per iteration, the main thread's, the garbage collector's time, the
snapshots' and the copies' thread; the main thread's by part (inside the job's
``step()``, and of that inside the optimizers); and per thread kind for the whole run.
Around the ranks, per run: the CPU of the job's other processes (launcher,
torchrun agents, store) and of the rest of the machine, which tell a run slowed
by its own work from one slowed by a neighbour.
Repeats rotate the order of the configurations.  Progress goes to stderr, the
Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from glob import glob
from typing import Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # launch.bench

from commslayer.run.processes import free_port  # noqa: E402
from commslayer.runs import load_results  # noqa: E402
from launch.bench.measure import (  # noqa: E402
    CpuAround, fail, launcher_env, median_range, save_runs, series, step_cells, written)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(ROOT, "launch", "bench", "cost_probe.py")
PLAIN = os.path.join(ROOT, "launch", "plain.py")
RANKS = 4
SCRIPTS = {  # name -> (path, its options, steps)
    "train.py": (os.path.join(ROOT, "launch", "train.py"), [], 30),
    "FSDP2 example": (os.path.join(ROOT, "launch", "examples", "fsdp2_resilient.py"), [], 150),
}
SMOKE_OPTIONS = {"train.py": ["--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--vocab", "64"]}
PLAIN_T, PLAIN_H = "plain torchrun", "plain HSDP"
PLAIN_ARGS = {"plain replicas": [PLAIN], "plain replicas, vote": [PLAIN, "--vote"]}  # before the script
CONFIGS: Dict[str, Tuple[str, Dict[str, Optional[str]]]] = {  # name -> (launch, environment: None = the launcher's)
    PLAIN_T: ("torchrun", {}),
    PLAIN_T + " (A/A)": ("torchrun", {}),
    PLAIN_H: ("plain replicas", {}),
    PLAIN_H + " (A/A)": ("plain replicas", {}),
    PLAIN_H + " + vote": ("plain replicas, vote", {}),
    "replica, untraced": ("replicas", {}),
    "replica, recorder": ("replicas", {"COMMSLAYER_TRACE_DIR": None}),
    "replica, JSON lines": ("replicas", {"COMMSLAYER_TRACE_DIR": None, "COMMSLAYER_TRACE_JSONL": "1"}),
    "replica, native off": ("replicas", {"COMMSLAYER_NATIVE": "0"}),
    "replica, recorder, Gloo's reduce-scatter": ("replicas", {"COMMSLAYER_TRACE_DIR": None,
                                                              "COMMSLAYER_REDUCE_SCATTER": "native"}),
    "replica, after backward": ("replicas", {"COMMSLAYER_AVERAGE_AFTER_BACKWARD": "1"}),
    "per-rank, untraced": ("per-rank", {}),
    "per-rank, recorder": ("per-rank", {"COMMSLAYER_TRACE_DIR": None}),
    "per-rank, JSON lines": ("per-rank", {"COMMSLAYER_TRACE_DIR": None, "COMMSLAYER_TRACE_JSONL": "1"}),
    "per-rank, native off": ("per-rank", {"COMMSLAYER_NATIVE": "0"}),
    "per-rank, copies once": ("per-rank", {"COMMSLAYER_REFRESH_EVERY": "1000000"}),
}


def _log(msg: str) -> None:
    print(f"[bench_step_cost] {msg}", file=sys.stderr, flush=True)


def baseline(config: str) -> str:
    return PLAIN_T if CONFIGS[config][0] in ("torchrun", "per-rank") else PLAIN_H


def account(found: List[dict], warmup: int) -> dict:
    """The CPU account of a run: per step, summed over the ranks (each rank's median over
    its iterations from ``warmup`` on; the collector's mean, since it runs in few of
    them); per run, summed over the ranks."""
    def per_step(key: str, over: Callable[[List[float]], float] = statistics.median) -> float:
        return sum(over(c[key][warmup:] or c[key]) for c in found)
    threads: Dict[str, float] = {}
    for c in found:
        for name, s in c["threads_cpu_s"].items():
            threads[name] = threads.get(name, 0.0) + s
    return {"cpu_per_step_s": per_step("step_cpu_s"), "main_cpu_per_step_s": per_step("step_main_cpu_s"),
            "step_call_cpu_per_step_s": per_step("step_call_main_cpu_s"),
            "optimizer_cpu_per_step_s": per_step("step_optimizer_cpu_s"),
            "gc_per_step_s": per_step("step_gc_s", statistics.fmean), "gc_s": sum(c["gc_s"] for c in found),
            "gc_runs": sum(c["gc_runs"] for c in found),
            "snapshot_s": sum(c["snapshot_s"] for c in found), "snapshots": sum(c["snapshots"] for c in found),
            "copies_cpu_s": sum(c["copies_cpu_s"] for c in found), "copies": sum(c["copies"] for c in found),
            "copies_bytes": sum(c["copies_bytes"] for c in found), "threads_cpu_s": threads}


class Bench:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args, self.work = args, work

    def script(self, name: str) -> Tuple[List[str], int]:
        path, options, steps = SCRIPTS[name]
        if self.args.smoke:
            options, steps = SMOKE_OPTIONS.get(name, []), 8
        return [path, *options, "--steps", str(steps)], steps

    def run(self, name: str, config: str, run: str) -> dict:
        script, steps = self.script(name)
        launch, settings = CONFIGS[config]
        run_dir, log_path = os.path.join(self.work, run), os.path.join(self.work, run + ".log")
        env = launcher_env(trace=False)
        for key, value in settings.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if launch == "torchrun":
            env["COMMSLAYER_RUN_DIR"] = run_dir
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), PROBE, PLAIN, *script]
        else:
            shape = (["--nproc-per-node", str(RANKS)] if launch == "per-rank" else
                     ["--replicas", "2", "--nproc-per-replica", str(RANKS // 2)])
            cmd = [sys.executable, "-m", "commslayer.run.launcher", *shape, "--run-dir", run_dir, PROBE,
                   *PLAIN_ARGS.get(launch, []), *script]
        with open(log_path, "w") as log, CpuAround() as around:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=900).returncode
        results, found = load_results(run_dir), written(run_dir, "cost-")
        if rc != 0 or len(results) != RANKS or any(len(r.step_s) != steps for r in results) or len(found) != RANKS:
            fail(f"{run}: exit status {rc}, {len(results)} ranks' results, {len(found)} probes", log_path)
        traced = bool(glob(os.path.join(run_dir, "traces", "*")))
        if traced != ("COMMSLAYER_TRACE_DIR" in settings):
            fail(f"{run}: traces written: {traced}", log_path)
        warmup = min(self.args.warmup, steps - 1)
        slowest = [max(r.step_s[s] for r in results) for s in range(warmup, steps)]
        figures = {"step_s": statistics.median(slowest), **account(found, warmup)}
        ranks_s = sum(c["process_cpu_s"] for c in found)
        return {**figures, "run_wall_s": around.wall_s, "ranks_cpu_s": ranks_s,
                "around_ranks_cpu_s": around.job_s - ranks_s, "outside_cpu_s": around.outside_s}


def _per_step(xs: List[dict], key: str, steps: int, scale: float = 1e3) -> str:
    return median_range([x[key] / steps for x in xs], scale, 2)


def _table(args: argparse.Namespace, figures: Dict[Tuple[str, str], List[dict]], header: List[str],
           cells: Callable[[str, List[dict]], str]) -> None:
    """One Markdown table of a row per script and configuration: ``header`` after the
    script and configuration columns; ``cells(script, its runs' figures)``, the rest of a row."""
    print("| script | configuration | " + " | ".join(header) + " |")
    print("|---|---|" + "---:|" * len(header))
    for name in args.scripts:
        for config in CONFIGS:
            print(f"| {name} | {config} | {cells(name, figures[(name, config)])} |")


def tables(args: argparse.Namespace, bench: Bench, figures: Dict[Tuple[str, str], List[dict]]) -> None:
    """The Markdown tables: step time against the baselines, then the CPU account."""
    print("| script | configuration | step time, median (ms) | min–max (ms) | vs baseline, median | min–max |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.scripts:
        for config in CONFIGS:
            row = step_cells(figures[(name, config)], figures[(name, baseline(config))], "vs_base")
            print(f"| {name} | {config} | {row} |")
    print("\nCPU account, summed over the 4 ranks, ms per step (process CPU and main thread: each rank's "
          "median over its steps; gc: its mean; snapshots and copies: the run's total over its steps), median and min–max "
          "over runs:\n")

    def account_cells(name: str, xs: List[dict]) -> str:
        steps = bench.script(name)[1]
        sent = statistics.median(x["copies_bytes"] / steps for x in xs)
        return (f"{median_range([x['cpu_per_step_s'] for x in xs], 1e3, 2)} | "
                f"{median_range([x['main_cpu_per_step_s'] for x in xs], 1e3, 2)} | "
                f"{median_range([x['gc_per_step_s'] for x in xs], 1e3, 2)} | "
                f"{_per_step(xs, 'snapshot_s', steps)} | {_per_step(xs, 'copies_cpu_s', steps)} | {sent:.0f}")
    _table(args, figures, ["process CPU", "min–max", "main thread", "min–max", "gc", "min–max", "snapshots",
                           "min–max", "copies' threads", "min–max", "copies' bytes per step"], account_cells)
    print("\nThe main thread's CPU by part, summed over the 4 ranks, ms per step (each rank's median over its "
          "steps), median and min–max over runs: inside the job's step() call (the gradient average, the vote, the "
          "optimizers), of that inside the optimizers' step, and the rest of step():\n")

    def part_cells(_name: str, xs: List[dict]) -> str:
        rest = statistics.median(x["step_call_cpu_per_step_s"] - x["optimizer_cpu_per_step_s"] for x in xs)
        return (f"{median_range([x['step_call_cpu_per_step_s'] for x in xs], 1e3, 2)} | "
                f"{median_range([x['optimizer_cpu_per_step_s'] for x in xs], 1e3, 2)} | {rest * 1e3:.2f}")
    _table(args, figures, ["step()", "min–max", "optimizers", "min–max", "step() less optimizers"], part_cells)
    print("\nCPU per thread kind over a whole run (s, summed over the ranks, median over runs; kinds over "
          "0.05 s in some configuration):\n")
    for name in args.scripts:
        kinds = sorted({k for config in CONFIGS for x in figures[(name, config)] for k, v in x["threads_cpu_s"].items()
                        if v > 0.05})
        print(f"| {name}: configuration | " + " | ".join(kinds) + " |")
        print("|---|" + "---:|" * len(kinds))
        for config in CONFIGS:
            xs = figures[(name, config)]
            print(f"| {config} | " + " | ".join(
                f"{statistics.median(x['threads_cpu_s'].get(k, 0.0) for x in xs):.2f}" for k in kinds) + " |")
        print()
    print("CPU around the ranks over a whole run (s, median and min–max over runs): the ranks' (all their "
          "threads), the rest of the job's processes (launcher, torchrun agents, store), and the machine's "
          f"other busy time, out of {os.cpu_count()} cores × the run's wall time:\n")
    _table(args, figures, ["run wall", "min–max", "ranks", "min–max", "launcher, agents, store", "min–max",
                           "outside the job", "min–max"],
           lambda _name, xs: " | ".join(median_range([x[k] for x in xs], 1, 2) for k in
                                        ("run_wall_s", "ranks_cpu_s", "around_ranks_cpu_s", "outside_cpu_s")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                   help="a subset of the configurations (each needs its baseline)")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="every configuration once, 8 steps, a tiny train.py")
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.warmup = 1, 2
    missing = {baseline(c) for c in args.configs} - set(args.configs)
    if missing:
        p.error(f"--configs needs the baselines {sorted(missing)}")
    for config in list(CONFIGS):
        if config not in args.configs:
            del CONFIGS[config]
    work = tempfile.mkdtemp(prefix="bench-step-cost-")
    bench = Bench(args, work)
    runs: Dict[Tuple[str, str], Callable[[str], dict]] = {
        (name, config): (lambda run, name=name, config=config: bench.run(name, config, run))
        for name in args.scripts for config in CONFIGS}
    figures, revision, began = series(runs, args.repeats, _log, work)
    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {RANKS} ranks on {os.cpu_count()} CPU(s); steps "
          f"{ {n: bench.script(n)[1] for n in args.scripts} }, warmup {args.warmup}; {args.repeats} repeats; "
          f"commit {revision}; {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(began))}\n")
    tables(args, bench, figures)
    if args.json:
        save_runs(args.json, revision, began, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
