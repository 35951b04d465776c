"""Run, on one commit and one after another, the benchmarks behind docs/benchmarks.md's
headline table.

Each page under docs/bench/ gives a key figure that the headline table repeats. Measured
on different days and commits, those figures cannot be set side by side; this script
measures them again in one session: it runs each page's benchmark with the options its
key figure needs (fewer repeats or sizes than a page's full run where the full run takes
longer than the figure needs: each run below says what it keeps), never two at once,
and writes into ``--out``:

- ``<run>.md``: what the benchmark printed (its tables), ``<run>.log`` its stderr;
- ``<run>.json``: its raw figures, where the benchmark takes ``--json``;
- ``manifest.json``: the revision measured, and for each run its command, when it
  began, its wall seconds and exit status.

A run that fails or outlives its timeout is recorded and the next one goes on. Reading
a key figure off a table stays a person's job: the headline row says which cell it is.

    OMP_NUM_THREADS=1 python launch/bench/headline.py --out docs/data/headline
    python launch/bench/headline.py --list      # the runs and their commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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

    def command(self, out: Path) -> List[str]:
        head = [sys.executable]
        if self.torchrun:
            head += ["-m", "torch.distributed.run", "--nproc-per-node", str(self.torchrun), "--master-port",
                     str(29960 + self.torchrun)]
        argv = head + [f"launch/bench/{self.script}", *self.options]
        if "--tracing" in self.options:
            argv += ["--trace-dir", str(out / f"traces-{self.name}")]
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
    Run("status-steps", ["status.md"], "bench_status_steps.py", ["--repeats", "3", "--traced"], takes_json=False),
    Run("etcd", ["etcd.md"], "bench_etcd.py", ["--repeats", "3"], timeout_s=1200),
    Run("training", ["training.md"], "bench_training.py", ["--repeats", "3"], timeout_s=1200),
    Run("resilience", ["resilience.md"], "bench_resilience.py", ["--repeats", "3", "--phases", "backward"],
        timeout_s=1800),
    Run("spares-replica", ["resilience.md"], "bench_resilience.py",
        ["--scripts", "FSDP2 example", "--phases", "backward", "--repeats", "3", "--spares", "2"], timeout_s=1200),
    Run("peer", ["peer.md"], "bench_peer.py", ["--repeats", "3"], timeout_s=1800),
    Run("nccl", ["nccl.md"], "bench_nccl.py", ["--repeats", "3"], takes_json=False, timeout_s=600),
]


def run_one(run: Run, out: Path) -> dict:
    """Run ``run`` with its output in ``out``; what the manifest records of it."""
    argv = run.command(out)
    began = time.time()
    shown = ["python" if a == sys.executable else a for a in argv]
    with open(out / f"{run.name}.md", "w") as stdout, open(out / f"{run.name}.log", "w") as stderr:
        try:
            rc = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1", **run.env},
                                stdout=stdout, stderr=stderr, timeout=run.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"name": run.name, "pages": list(run.pages), "command": shown, "env": run.env,
            "began": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
            "wall_s": round(time.time() - began, 1), "rc": rc if rc is not None else f"timeout {run.timeout_s} s"}


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
            print(f"{run.name}\t{','.join(run.pages)}\t{' '.join(run.command(out))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"revision": measured_revision(), "cpus": os.cpu_count(), "runs": []}
    for run in chosen:
        print(f"{time.strftime('%H:%M:%S')} {run.name} ...", file=sys.stderr, flush=True)
        manifest["runs"].append(run_one(run, out))
        with open(out / "manifest.json", "w") as f:  # after each run: a cut series keeps what it measured
            json.dump(manifest, f, indent=1)
        print(f"{time.strftime('%H:%M:%S')} {run.name}: rc {manifest['runs'][-1]['rc']}", file=sys.stderr, flush=True)
    return 0 if all(r["rc"] == 0 for r in manifest["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
