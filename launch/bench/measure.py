"""What the benchmarks share: their runs repeated and rotated, the table cells of
a median and its spread, the launchers' environment, the revision measured, and
the parent side of a benchmark whose ranks are worker processes (one per rank,
on network namespaces)."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, List, Mapping, Sequence, Tuple, TypeVar

from faults.netns import remove_leftovers

ROOT = Path(__file__).resolve().parents[2]
K = TypeVar("K", bound=Hashable)


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
    print(f"command: python launch/bench/{script} {' '.join(sys.argv[1:])}")


def launcher_env(trace: bool = True) -> Dict[str, str]:
    """The launchers' environment; ``trace=False``: ``COMMSLAYER_TRACE_DIR=""``, which the launcher leaves alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_")}
    env["OMP_NUM_THREADS"] = "1"
    if not trace:
        env["COMMSLAYER_TRACE_DIR"] = ""
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    return env


def fail(what: str, log_path: str) -> None:
    with open(log_path) as f:
        tail = f.read()[-3000:]
    raise SystemExit(f"{what} (log {log_path}):\n{tail}")


def measured_revision() -> str:
    """The commit measured, and whether the code the job runs differed from it."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(git + ["status", "--porcelain", "--", "commslayer", "launch", "tracing", "fsdp_overlap"],
                             capture_output=True, text=True).stdout.split("\n")
    changed = [line[3:] for line in changed if line.strip()]
    return f"{head or 'unknown'}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def rotated(runs: Dict[K, Callable[[str], dict]], repeats: int, log: Callable[[str], None]) -> Dict[K, List[dict]]:
    """Every configuration of ``runs`` once per repeat, the order rotated from repeat to
    repeat so that drift hits them alike; each run's figures, by configuration. A run is
    called with its name (``r<repeat>-<configuration>`` made a file name) and logged with
    its figures that are floats."""
    figures: Dict[K, List[dict]] = {key: [] for key in runs}
    for i in range(repeats):
        for key in list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]:
            t0 = time.time()
            label = " / ".join(key) if isinstance(key, tuple) else str(key)
            figures[key].append(runs[key](re.sub(r"[^A-Za-z0-9_-]+", "_", f"r{i}-{label}")))
            shown = {k: round(v, 4) for k, v in figures[key][-1].items() if isinstance(v, float)}
            log(f"repeat {i} {label} ({time.time() - t0:.0f} s): {shown}")
    return figures


def series(runs: Dict[K, Callable[[str], dict]], repeats: int, log: Callable[[str], None],
           work: str) -> Tuple[Dict[K, List[dict]], str, float]:
    """``rotated`` with what a benchmark notes around it: (the figures, the revision
    measured, the wall time it began); ``work`` (the runs' scratch) is removed after."""
    revision = measured_revision()
    began = time.time()
    figures = rotated(runs, repeats, log)
    shutil.rmtree(work)
    log(f"done in {time.time() - began:.0f} s")
    return figures, revision, began


class CpuAround:
    """Where the machine's CPU went while a command ran: ``job_s``, the CPU of the
    processes this one started and waited for, and of all theirs (a launcher, its
    agents and store, the ranks); ``outside_s``, the rest of the machine's busy time
    (other processes, the kernel's own threads); ``wall_s``.  Whatever this process
    did meanwhile counts as outside."""

    def __enter__(self) -> "CpuAround":
        self._began = (time.perf_counter(), _machine_busy_s(), _children_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, job = self._began
        self.wall_s = time.perf_counter() - wall
        self.job_s = _children_cpu_s() - job
        self.outside_s = _machine_busy_s() - busy - self.job_s


def _machine_busy_s() -> float:
    """CPU seconds every core spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def written(run_dir: str, prefix: str) -> List[dict]:
    """The JSON files ``<prefix>*.json`` a run's processes wrote into ``run_dir`` (one per
    process that finished), in name order."""
    out = []
    for path in sorted(Path(run_dir).glob(f"{prefix}*.json")):
        with open(path) as f:
            out.append(json.load(f))
    return out


def save_runs(path: str, revision: str, began: float, figures: Mapping[Any, Any], **more: Any) -> None:
    """A benchmark's raw figures (its ``--json``): the command, the CPUs, the revision
    measured and when the series began, ``more``, and every run by configuration (a
    tuple key joined with " / ")."""
    runs = {(" / ".join(k) if isinstance(k, tuple) else k): v for k, v in figures.items()}
    with open(path, "w") as f:
        json.dump({"command": ["python"] + sys.argv, "cpus": os.cpu_count(), "revision": revision,
                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)), **more, "runs": runs}, f, indent=1)


def median_range(xs: Sequence[float], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """Two table cells: the median, and min–max."""
    return (f"{statistics.median(xs) * scale:.{digits}f}{unit} | "
            f"{min(xs) * scale:.{digits}f}–{max(xs) * scale:.{digits}f}{unit}")


def cells(xs: List[dict], *keys: str) -> str:
    """A median and a min–max cell for each of ``keys`` over the runs ``xs``."""
    return " | ".join(median_range([x[k] for x in xs]) for k in keys)


def ratio_cells(xs: List[dict], base: List[dict], key: str) -> str:
    """A median and a min–max cell (%) of the step time of the runs ``xs`` against the
    baseline's runs ``base`` in the same repeats, less 1 (set as each run's ``key``; "–"
    for the baseline itself)."""
    for x, b in zip(xs, base):
        x[key] = x["step_s"] / b["step_s"] - 1
    return "– | –" if xs is base else median_range([x[key] for x in xs], 100, 2, " %")


def step_cells(xs: List[dict], base: List[dict], key: str) -> str:
    """Four cells for a fault-free configuration's runs ``xs``: its step time (ms) and
    ``ratio_cells``."""
    return f"{median_range([x['step_s'] for x in xs], 1e3, 2)} | {ratio_cells(xs, base, key)}"
