"""What tracing costs a real training run: launch/train.py (4-rank FSDP2 on
commslayer) with tracing off, off again (the A/A calibration), and with every
sink on (flight recorder + structlog JSON lines + OpenTelemetry).

The three variants alternate, run after run, so drift hits them alike; each
run is a fresh ``torchrun``.  A run's figure is its median step time over
steps 1.. (step 0 carries one-time costs); the report gives, per variant, the
median and the min–max of those figures over the repeats, and the ratios of
medians against the first tracing-off variant.  A run whose ranks trained to
the end but did not all exit cleanly still counts, and is reported.

    python launch/bench/bench_tracing_train.py --repeats 5 --steps 20

``--smoke`` checks that the benchmark still runs, in seconds: 2 ranks, a tiny
model, 3 steps, one run of each variant.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from commslayer.run.processes import free_port
from commslayer.runs import load_results

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {
    "off": {},
    "off (A/A)": {},
    "all sinks": {"COMMSLAYER_TRACE_JSONL": "1", "COMMSLAYER_TRACE_OTEL": "1"},
}
SMOKE_MODEL = ["--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--vocab", "64"]

EXIT_FAILURES: Dict[str, int] = {v: 0 for v in VARIANTS}


def run_once(variant: str, args: argparse.Namespace, work: str, i: int) -> float:
    """One torchrun of train.py; rank 0's median step time over steps 1.."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_TRACE")}
    env["OMP_NUM_THREADS"] = "1"
    if variant == "all sinks":
        env["COMMSLAYER_TRACE_DIR"] = os.path.join(work, f"traces{i}")
    env.update(VARIANTS[variant])
    run_dir = os.path.join(work, f"run{i}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(free_port()), str(ROOT / "launch" / "train.py"), "--steps", str(args.steps),
           "--run-dir", run_dir, *args.train_args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    rank0 = next((r for r in load_results(run_dir) if r.member == 0), None)
    if rank0 is None:
        raise SystemExit(f"{variant} run failed (exit status {out.returncode}):\n{out.stderr[-3000:]}")
    traces = env.get("COMMSLAYER_TRACE_DIR")
    if traces and not os.path.exists(os.path.join(traces, "rank0.jsonl")):
        raise SystemExit(f"{variant}: no trace written to {traces}")
    if out.returncode != 0:  # trained to the end, then a rank died at exit: counted, reported
        EXIT_FAILURES[variant] += 1
        print(f"[bench_tracing_train] {variant}: exit status {out.returncode} after training; stderr tail:\n"
              f"{out.stderr[-600:]}", file=sys.stderr, flush=True)
    return statistics.median(rank0.step_s[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--smoke", action="store_true", help="the smallest run of every variant, to check the "
                   "benchmark works (2 ranks, a tiny model, 3 steps, 1 repeat); explicit options still apply")
    p.set_defaults(train_args=[])  # train.py's model options: its defaults, or a tiny model for --smoke
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(repeats=1, steps=3, nproc=2, train_args=SMOKE_MODEL)
        args = p.parse_args()
    results: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as work:
        i = 0
        for r in range(args.repeats):
            order = list(VARIANTS)[r % 3:] + list(VARIANTS)[:r % 3]
            for v in order:
                results[v].append(run_once(v, args, work, i))
                i += 1
                print(f"[bench_tracing_train] repeat {r} {v}: {results[v][-1] * 1e3:.2f} ms/step",
                      file=sys.stderr, flush=True)
    base = statistics.median(results["off"])
    model = f"train.py {shlex.join(args.train_args)}" if args.train_args else "train.py's default model"
    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {args.nproc} ranks, {model}, {args.steps} steps, "
          f"{args.repeats} repeats per variant\n")
    print("| variant | median step (ms) | min–max over repeats (ms) | ratio to off | runs that failed at exit |")
    print("|---|---:|---:|---:|---:|")
    for v, xs in results.items():
        med = statistics.median(xs)
        print(f"| {v} | {med * 1e3:.2f} | {min(xs) * 1e3:.2f}–{max(xs) * 1e3:.2f} | {med / base:.3f} "
              f"| {EXIT_FAILURES[v]} of {len(xs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
