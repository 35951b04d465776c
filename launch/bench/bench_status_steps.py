"""Step time of a resilient job with the status server on and scraped, against off.

The DDP and FSDP2 examples (``launch/examples``), 2 replica groups of 2 ranks,
``--steps`` steps, each configuration ``--repeats`` times in a rotated order:
the server off, off again (the A/A), and on (``commslayer-run --status-port``)
with ``/metrics`` GET once a second while the job runs.  ``--traced`` leaves the
ranks' flight recorders on (each job traces into its run directory), so a
served job's status records carry the recorder's figures and its watchdog
thread reports the current op (tracing.record.figures).  Per run: the median of
every rank's step times from step ``--skip`` on; per configuration: the median
of the runs, their range, and the difference from "off".

    python launch/bench/bench_status_steps.py --repeats 3 [--traced]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from commslayer import runs  # noqa: E402
from commslayer.run.processes import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = {"DDP": "launch/examples/ddp_resilient.py", "FSDP2": "launch/examples/fsdp2_resilient.py"}
CONFIGS = ("off", "off (A/A)", "on, scraped 1/s")


def run(script: str, on: bool, steps: int, skip: int, traced: bool) -> Tuple[float, int]:
    """One 2x2 job; with ``on``, the status server scraped every second. The median step time
    (ms) over every rank's steps from ``skip`` on, and how many scrapes answered."""
    run_dir = tempfile.mkdtemp(prefix="status-steps-")
    port = free_port()
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", "2", "--nproc-per-replica", "2",
           "--run-dir", run_dir, *(["--status-port", str(port)] if on else []), os.path.join(ROOT, script),
           "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if traced:
        env.pop("COMMSLAYER_TRACE_DIR", None)  # unset: the run directory's traces
    else:
        env["COMMSLAYER_TRACE_DIR"] = ""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scrapes = 0
    while on and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
                answer.read()
            scrapes += 1
        except OSError:  # not serving yet, or the job just ended
            pass
        time.sleep(1)
    if proc.wait() != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}): {' '.join(cmd)}")
    times = [s for r in runs.load_results(run_dir) for s in r.step_s[skip:]]
    return statistics.median(times) * 1e3, scrapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--skip", type=int, default=20, help="steps left out at the start of each rank's life")
    p.add_argument("--traced", action="store_true", help="the ranks' flight recorders on")
    p.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    a = p.parse_args()
    for name in a.examples:
        got: Dict[str, List[float]] = {c: [] for c in CONFIGS}
        for i in range(a.repeats):
            for config in CONFIGS[i % 3:] + CONFIGS[:i % 3]:
                ms, scrapes = run(EXAMPLES[name], config.startswith("on"), a.steps, a.skip, a.traced)
                got[config].append(ms)
                print(f"{name} repeat {i} {config}: median step {ms:.2f} ms ({scrapes} scrapes)", flush=True)
        base = statistics.median(got["off"])
        for config, values in got.items():
            m = statistics.median(values)
            print(f"{name}{' traced' if a.traced else ''} {config}: median of {a.repeats} {m:.2f} ms "
                  f"({min(values):.2f}-{max(values):.2f}), vs off {100 * (m / base - 1):+.2f} %", flush=True)


if __name__ == "__main__":
    main()
