"""What tracing costs a real training run: launch/train.py (4-rank FSDP2 on
commslayer) with tracing off, off again (the A/A calibration), and with every
sink on (flight recorder + structlog JSON lines + OpenTelemetry).

The three variants alternate, run after run, so drift hits them alike; each
run is a fresh ``torchrun``.  A run's figure is its median step time over
steps 1.. (step 0 carries one-time costs); the report gives, per variant, the
median and the min–max of those figures over the repeats, and the ratios of
medians against the first tracing-off variant.  A run whose ranks trained to
the end but did not all exit cleanly still counts, and is reported.

    python launch/bench_tracing_train.py --repeats 5 --steps 20
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
from typing import Dict, List

VARIANTS = {
    "off": {},
    "off (A/A)": {},
    "all sinks": {"COMMSLAYER_TRACE_JSONL": "1", "COMMSLAYER_TRACE_OTEL": "1"},
}


EXIT_FAILURES: Dict[str, int] = {v: 0 for v in VARIANTS}


def run_once(variant: str, args: argparse.Namespace, trace_root: str, i: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_TRACE")}
    env["OMP_NUM_THREADS"] = "1"
    if variant == "all sinks":
        env["COMMSLAYER_TRACE_DIR"] = os.path.join(trace_root, f"run{i}")
    env.update(VARIANTS[variant])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-port", str(29700 + i % 50), "launch/train.py", "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{variant} run failed:\n{out.stderr[-3000:]}")
    if out.returncode != 0:  # trained to the end, then a rank died at exit: counted, reported
        EXIT_FAILURES[variant] += 1
        print(f"[bench_tracing_train] {variant}: exit status {out.returncode} after training; stderr tail:\n"
              f"{out.stderr[-600:]}", file=sys.stderr, flush=True)
    steps = json.loads(line[len("RESULT "):])["step_s"]
    return statistics.median(steps[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    args = p.parse_args()
    results: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as trace_root:
        i = 0
        for r in range(args.repeats):
            order = list(VARIANTS)[r % 3:] + list(VARIANTS)[:r % 3]
            for v in order:
                results[v].append(run_once(v, args, trace_root, i))
                i += 1
                print(f"[bench_tracing_train] repeat {r} {v}: {results[v][-1] * 1e3:.2f} ms/step",
                      file=sys.stderr, flush=True)
    base = statistics.median(results["off"])
    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {args.nproc} ranks, {args.steps} steps, "
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
