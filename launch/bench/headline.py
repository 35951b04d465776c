"""Run, on one commit and one after another, the benchmarks behind docs/benchmarks.md's
headline table.

Each page under docs/bench/ gives a key figure that the headline table repeats. Measured
on different days and commits, those figures cannot be set side by side; this script
measures them again in one session: it runs each page's benchmark with the options its
key figure needs (``RUNS``: often fewer repeats or sizes than a page's full run, and
the headline row names what the series did not run again), never two at once, and
writes into ``--out``:

- ``<run>.md``: what the benchmark printed (its tables), ``<run>.log`` its stderr;
- ``<run>.json``: its raw figures, where the benchmark takes ``--json`` (the traces of
  a traced run go to a temporary folder, removed after it);
- ``manifest.json``: for each run, the revision it measured, its command, when it
  began, its wall seconds and exit status (a later ``--only`` replaces its runs'
  entries and keeps the others').

A run that fails or outlives its timeout is recorded and the next one goes on. Reading
a key figure off a table stays a person's job: the headline row says which cell it is.

    OMP_NUM_THREADS=1 python launch/bench/headline.py --out docs/data/headline
    python launch/bench/headline.py --list      # the runs and their commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.bench.measure import ROOT, measured_revision  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One benchmark invocation: its name (the files' stem), the pages its figures feed,
    the script and its options, ranks under torchrun (0: run it with python), extra
    environment, whether it takes ``--json``, and its timeout in seconds."""

    name: str
    pages: Sequence[str]
    script: str
    options: Sequence[str] = ()
    torchrun: int = 0
    env: Dict[str, str] = field(default_factory=dict)
    takes_json: bool = True
    timeout_s: float = 900.0

    def command(self, out: Path, traces: str) -> List[str]:
        head = [sys.executable]
        if self.torchrun:
            head += ["-m", "torch.distributed.run", "--nproc-per-node", str(self.torchrun), "--master-port",
                     str(29960 + self.torchrun)]
        argv = head + [f"launch/bench/{self.script}", *self.options]
        if "--tracing" in self.options:
            argv += ["--trace-dir", traces]
        return argv + (["--json", str(out / f"{self.name}.json")] if self.takes_json else [])


_OPS = ["--ops", "all_reduce,all_gather_single,reduce_scatter_single", "--sizes", "4KiB,1MiB"]

# In the order they run: issue 37's step and per-op figures first, the longest runs last.
RUNS: List[Run] = [
    # overhead.md, direct-path.md and tracing.md's per-op rows: every variant in one run per world size
    Run("overhead-n2", ["overhead.md", "direct-path.md", "tracing.md"], "bench_overhead.py",
        [*_OPS, "--max-seconds-per-size", "6", "--tracing", "--breakdown"], torchrun=2),
    Run("overhead-n4", ["overhead.md", "direct-path.md"], "bench_overhead.py",
        [*_OPS, "--max-seconds-per-size", "6", "--tracing", "--breakdown"], torchrun=4),
    Run("async-n2", ["async-path.md"], "bench_overhead.py",
        [*_OPS, "--max-seconds-per-size", "6", "--async-op", "--tracing"], torchrun=2),
    Run("async-n4", ["async-path.md"], "bench_overhead.py",
        [*_OPS, "--max-seconds-per-size", "5", "--async-op", "--tracing"], torchrun=4),
    Run("async-isolated-n2", ["async-path.md"], "bench_overhead.py",
        [*_OPS, "--max-seconds-per-size", "6", "--async-op", "--tracing"], torchrun=2,
        env={"COMMSLAYER_ISOLATE_WRITES": "1"}),
    Run("nan-check-n2", ["nan-check.md"], "bench_overhead.py",
        ["--nan-check", "--ops", "all_reduce", "--sizes", "4KiB,1MiB", "--max-seconds-per-size", "8"], torchrun=2),
    Run("hotpath", ["tracing.md"], "bench_hotpath.py", ["--ops", "20000", "--rounds", "7"], takes_json=False),
    Run("step-cost", ["step-cost.md"], "bench_step_cost.py", ["--repeats", "3"], timeout_s=1800),
    Run("routed", ["async-path.md"], "bench_routed.py", ["--repeats", "3"], timeout_s=1200),
    Run("op-instructions", ["async-path.md"], "bench_op_instructions.py", [], timeout_s=2400),
    Run("recovery", ["recovery.md", "agreement.md"], "bench_recovery.py", ["--repeats", "7", "--cap", "20"]),
    Run("viewer", ["viewer.md"], "bench_viewer.py", ["--ranks", "16", "--records", "100000", "--repeats", "3",
                                                     "--view"], takes_json=False),
    Run("watch-sim", ["watch.md"], "simulate_watch.py",
        ["--sizes", "1000", "10000", "--jitter", "0", "0.05", "--trials", "3"]),
    Run("agreement", ["agreement.md"], "bench_agreement.py", ["--sizes", "4", "16", "64", "--repeats", "3"],
        takes_json=False),
    Run("agreement-sim", ["agreement.md"], "simulate_agreement.py", ["--sizes", "64", "1000", "10000",
                                                                      "--trials", "3"]),
    Run("reduce-scatter-capped", ["reduce-scatter.md"], "bench_reduce_scatter.py",
        ["--link", "capped", "--ranks", "2", "4", "--repeats", "3", "--iters", "1"]),
    Run("overlap", ["overlap.md"], "bench_overlap.py", ["--ranks", "2", "4", "--repeats", "3"]),
    Run("tracing-train", ["tracing.md"], "bench_tracing_train.py", ["--repeats", "5", "--steps", "20"],
        takes_json=False),
    Run("status-scrape", ["status.md"], "bench_status_scrape.py", ["--ranks", "1000", "--gets", "200"],
        takes_json=False),
    Run("status-steps", ["status.md"], "bench_status_steps.py", ["--repeats", "3", "--traced"], takes_json=False),
    Run("etcd", ["etcd.md"], "bench_etcd.py", ["--repeats", "3"], timeout_s=1200),
    Run("training", ["training.md"], "bench_training.py", ["--repeats", "3"], timeout_s=1200),
    Run("resilience", ["resilience.md"], "bench_resilience.py", ["--repeats", "3", "--phases", "backward"],
        timeout_s=1800),
    Run("spares-replica", ["resilience.md"], "bench_resilience.py",
        ["--scripts", "FSDP2 example", "--phases", "backward", "--repeats", "3", "--spares", "2"], timeout_s=1200),
    Run("peer", ["peer.md"], "bench_peer.py", ["--repeats", "3"], timeout_s=1800),
    Run("gloo-exit", ["gloo-exit.md"], "bench_gloo_exit.py", ["--runs", "10"], takes_json=False),
    Run("nccl", ["nccl.md"], "bench_nccl.py", ["--repeats", "3"], takes_json=False, timeout_s=600),
]


def run_one(run: Run, out: Path) -> dict:
    """Run ``run`` with its output in ``out``; what the manifest records of it."""
    began = time.time()
    with tempfile.TemporaryDirectory(prefix=f"headline-{run.name}-") as traces, \
            open(out / f"{run.name}.md", "w") as stdout, open(out / f"{run.name}.log", "w") as stderr:
        argv = run.command(out, traces)
        env = {"PYTHONWARNINGS": "ignore:Failed to initialize NumPy", **os.environ, "OMP_NUM_THREADS": "1", **run.env}
        proc = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's ranks with it
            proc.wait()
            rc = f"timeout {run.timeout_s} s"
    shown = ["python" if a == sys.executable else "<temporary folder>" if a == traces else a for a in argv]
    return {"name": run.name, "revision": measured_revision(), "pages": list(run.pages), "command": shown,
            "env": run.env, "began": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
            "wall_s": round(time.time() - began, 1), "rc": rc}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/data/headline",
                   help="the folder the runs write into (a relative path is taken from the repository root)")
    p.add_argument("--only", nargs="+", metavar="RUN", choices=[r.name for r in RUNS], help="run only these")
    p.add_argument("--list", action="store_true", help="print each run's name, pages and command; run nothing")
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the commands name the scripts and --out relative to the repository root
    out = Path(args.out)
    chosen = [r for r in RUNS if not args.only or r.name in args.only]
    if args.list:
        for run in chosen:
            print(f"{run.name}\t{','.join(run.pages)}\t{' '.join(run.command(out, '<temporary folder>'))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    path = out / "manifest.json"
    earlier = json.loads(path.read_text())["runs"] if path.exists() else []
    done = []
    for run in chosen:
        print(f"{time.strftime('%H:%M:%S')} {run.name} ...", file=sys.stderr, flush=True)
        done.append(run_one(run, out))
        kept = [r for r in earlier if r["name"] not in {d["name"] for d in done}]
        order = [r.name for r in RUNS]
        runs = sorted(kept + done, key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
        with open(path, "w") as f:  # after each run: a series cut short keeps what it measured
            json.dump({"cpus": os.cpu_count(), "runs": runs}, f, indent=1)
        print(f"{time.strftime('%H:%M:%S')} {run.name}: rc {done[-1]['rc']}", file=sys.stderr, flush=True)
    return 0 if all(r["rc"] == 0 for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
