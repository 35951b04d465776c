"""How often a finished Gloo job aborts at exit, with and without the wait for
Gloo's worker threads (commslayer/gloo_exit.py), on a loaded machine.

The job: ``torchrun --standalone --nproc-per-node 2`` of a script that
all-reduces a 4 KiB tensor 20 times and ends (the last op is the last line).
Busy loops beside it (``--busy``, default two per core) load the machine as a
CI run does.  Three arms, run alternately, ``--runs`` times each:

- ``plain torch``: ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so torch loads none of
  commslayer's entry points: plain c10d;
- ``commslayer, wait removed``: the entry points load, the script unregisters
  the wait: what commslayer would be without it;
- ``commslayer``: as installed; the script times the wait at exit.

An aborted run is one whose torchrun exits non-zero; the report says how many
of those printed "terminate called".

    python launch/bench/bench_gloo_exit.py --runs 30

``--smoke`` (one run per arm, one busy loop) checks in seconds that it still runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # launch/

from launch.bench.measure import ROOT, measured_revision, median_range  # noqa: E402

JOB = """
import atexit, os, sys, time
import torch, torch.distributed as dist
from commslayer import gloo_exit

arm = os.environ["BENCH_ARM"]
if arm != "plain torch":
    atexit.unregister(gloo_exit.wait_for_gloo_workers)
if arm == "commslayer":
    def timed():
        t0 = time.perf_counter()
        gloo_exit.wait_for_gloo_workers()
        os.write(2, f"waited_ms {(time.perf_counter() - t0) * 1e3:.3f}\\n".encode())  # one write: ranks share the pipe
    atexit.register(timed)
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(20):
    dist.all_reduce(t)
"""
ARMS = ("plain torch", "commslayer, wait removed", "commslayer")


def one_run(script: str, arm: str, timeout: float) -> Dict[str, object]:
    env = dict(os.environ, BENCH_ARM=arm, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0" if arm == "plain torch" else "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script], env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    waited = [float(x) for x in re.findall(r"waited_ms (\d+\.\d{3})\n", out)]
    return {"code": proc.returncode, "terminate": "terminate called" in out, "waited_ms": waited}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30, help="runs of each arm")
    p.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1), help="busy loops beside the job")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    p.add_argument("--smoke", action="store_true", help="one run per arm, one busy loop")
    args = p.parse_args()
    if args.smoke:
        args.runs, args.busy = 1, 1
    revision = measured_revision()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results: Dict[str, List[Dict[str, object]]] = {arm: [] for arm in ARMS}
    began = time.time()
    try:
        with tempfile.TemporaryDirectory() as work:
            script = os.path.join(work, "last_op.py")
            Path(script).write_text(JOB)
            for i in range(args.runs):
                for arm in ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]:
                    results[arm].append(one_run(script, arm, args.timeout))
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print(f"revision {revision}; {args.runs} runs per arm, {args.busy} busy loops on {os.cpu_count()} cores, "
          f"{time.time() - began:.0f} s")
    print("| arm | runs | aborted | of those, 'terminate called' | wait at exit, ms: median | min–max |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        xs = results[arm]
        failed = [x for x in xs if x["code"] != 0]
        waited = [w for x in xs for w in x["waited_ms"]]  # type: ignore[attr-defined]
        spread = median_range(waited) if waited else "– | –"
        print(f"| {arm} | {len(xs)} | {len(failed)} | {sum(1 for x in failed if x['terminate'])} | {spread} |")


if __name__ == "__main__":
    main()
