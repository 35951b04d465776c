"""The benchmarks' parent side: one worker process per rank, and their results."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from faults.netns import remove_leftovers


def run_workers(cmds: List[List[str]], env: Dict[str, str], out: str, timeout: float) -> List[dict]:
    """Run ``cmds[r]`` as rank r (``RANK`` set, output in ``out/rank<r>.log``) and return
    each rank's ``out/rank<r>.json``; ``RuntimeError`` with a log's tail when a rank
    fails or they are not all done within ``timeout`` seconds (the rest are killed)."""
    world = len(cmds)
    logs = [open(Path(out, f"rank{r}.log"), "wb") for r in range(world)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=logs[r], stderr=subprocess.STDOUT)
             for r, cmd in enumerate(cmds)]
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                tail = Path(out, f"rank{failed[0] if failed else 0}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{world} ranks: " + (f"rank(s) {failed} failed" if failed else
                                                         f"no result within {timeout} s") + f"\n{tail}")
            time.sleep(0.1)
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for p, log in zip(procs, logs):
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()


def parse(p: argparse.ArgumentParser, smoke: Dict[str, Any]) -> argparse.Namespace:
    """``p``'s arguments, with ``--worker OUT_DIR`` (hidden: how the parent starts a rank)
    and ``smoke``'s defaults under ``--smoke`` (options given explicitly still apply)."""
    p.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(**smoke)
        args = p.parse_args()
    return args


def prepare_testbed(prefix: str, script: str) -> None:
    """Before a benchmark builds network namespaces named ``prefix``: root or exit, SIGTERM
    and SIGHUP unwinding through the testbed's cleanup, leftovers of dead runs removed."""
    if os.geteuid() != 0:
        sys.exit(f"{script} builds network namespaces: run it as root")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    remove_leftovers(prefix)


def report(args: argparse.Namespace, script: str,
           measure: Callable[[int], Tuple[Dict[str, Any], List[dict], str]]) -> None:
    """For each world size in ``args.ranks``: ``measure(world)`` gives (table, every rank's
    results, the table as Markdown), printed as it comes; all of it into ``args.json``
    when given; last, the command line that ran ``script``."""
    results: Dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "worlds": {}}
    for world in args.ranks:
        table, ranks, text = measure(world)
        results["worlds"][str(world)] = {"table": table, "ranks": ranks}
        print(text + "\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"command: python launch/{script} {' '.join(sys.argv[1:])}")
