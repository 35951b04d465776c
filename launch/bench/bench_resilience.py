"""What the resilience API costs a user's own script, and what a lost replica group costs it:
launch/examples/fsdp2_resilient.py, launch/examples/ddp_resilient.py and launch/train.py,
each on commslayer next to the same script run the plain way, side by side in one run.

    python launch/bench/bench_resilience.py --repeats 3 --json docs/data/resilience.json

``--smoke`` runs every configuration but the A/A once for a few steps, on the
DDP example with a fault in backward (unless ``--scripts``/``--phases`` say
otherwise), to check that the benchmark still works.

Every script runs as 2 replica groups of 2 ranks (4 ranks) unless said
otherwise, untraced (``COMMSLAYER_TRACE_DIR=""``: tracing's cost is
launch/bench/bench_training.py's), in these configurations:

* ``ours``: ``commslayer-run`` running the script on ``commslayer.resilience``:
  the cross-replica gradient average begun during backward (FSDP2's all-reduce
  hook, the DDP comm hook: ``commslayer/train/gradients.py``), committed by the vote;
* ``ours, after backward``: the same with ``COMMSLAYER_AVERAGE_AFTER_BACKWARD=1``:
  the whole average after backward, in buckets of 4 MB (at these model sizes
  that is one flat all-reduce per step, the way the API did it before);
* ``plain HSDP`` and ``plain HSDP (A/A)``: ``commslayer-run`` running the script
  through ``launch/plain.py`` (plain Gloo groups, no deadlines, no recovery,
  one flat all-reduce across the groups after backward), twice: the A/A
  calibrates what two identical configurations differ by here;
* ``plain torchrun, 4 ranks``: ``torchrun --nproc-per-node 4
  launch/plain.py SCRIPT``: the script as it was before commslayer, FSDP2 or
  DDP over all 4 ranks on plain Gloo;
* ``ours, SIGKILL in PHASE`` (``--phases``): ``ours`` with rank 0 of replica
  group 1 SIGKILLed at step ``--fault-step`` in PHASE (the fault harness,
  ``COMMSLAYER_FAULTS``), which the group's torchrun restarts;
* with ``--spares S``: ``ours, S warm spares`` (fault-free, the spares waiting:
  what they cost the ranks' steps) and ``ours, SIGKILL in PHASE, S warm
  spares`` (the restarted group's ranks are spares while spares are left:
  commslayer.run.spares).

Figures: a run's step time is, for each step from ``--warmup`` on, the
slowest rank's (the API's ``step_s``: from the step's start in ``steps()`` to
the end of ``step()``), median over those steps.  Overhead: the ratio to
plain HSDP's in the same repeat, minus 1.  A fault's survivor stall is from
the kill to the commit of the step it hit (world rank 0's recovery record);
the heal is the admission's join and state transfer on the survivors; the
group back is from the kill to that admission (the restarted group voting
again); all from the launcher's summary.  Repeats rotate the order of the
configurations.  Progress goes to stderr, the Markdown tables to stdout.
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
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # launch.bench

from commslayer.run.processes import free_port  # noqa: E402
from commslayer.runs import load_results, load_summary  # noqa: E402
from launch.bench.measure import cells, fail, launcher_env, median_range, save_runs, series, step_cells  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLICAS, RANKS = 2, 2
VICTIM = RANKS  # member 2: replica group 1's rank 0
PLAIN = os.path.join(ROOT, "launch", "plain.py")
SCRIPTS = {  # name -> (path, its options, steps, fault step)
    "FSDP2 example": (os.path.join(ROOT, "launch", "examples", "fsdp2_resilient.py"), [], 300, 60),
    "DDP example": (os.path.join(ROOT, "launch", "examples", "ddp_resilient.py"), [], 300, 60),
    "train.py": (os.path.join(ROOT, "launch", "train.py"), [], 40, 12),
}
SMOKE_STEPS = {"FSDP2 example": (12, 4), "DDP example": (12, 4), "train.py": (8, 3)}
SMOKE_OPTIONS = {"train.py": ["--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--vocab", "64"]}


def _log(msg: str) -> None:
    print(f"[bench_resilience] {msg}", file=sys.stderr, flush=True)


def _run(cmd: List[str], env: Dict[str, str], log_path: str) -> int:
    with open(log_path, "w") as log:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=900).returncode


class Bench:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args, self.work = args, work
        self.launcher_options: List[str] = []  # given to commslayer-run before --run-dir

    def _script(self, name: str) -> Tuple[List[str], int, int]:
        path, options, steps, fault = SCRIPTS[name]
        if self.args.smoke:
            (steps, fault), options = SMOKE_STEPS[name], SMOKE_OPTIONS.get(name, [])
        return [path, *options, "--steps", str(steps)], steps, fault

    def command(self, script: List[str], run_dir: str) -> List[str]:
        """``commslayer-run`` on ``script`` (path and arguments) into ``run_dir``."""
        return [sys.executable, "-m", "commslayer.run.launcher", "--replicas", str(REPLICAS), "--nproc-per-replica",
                str(RANKS), "--max-restarts", "1", *self.launcher_options, "--run-dir", run_dir, *script]

    def _launch(self, script: List[str], run_dir: str, env: Dict[str, str], log_path: str, spares: int = 0) -> int:
        command = self.command(script, run_dir)
        if spares:
            command[command.index("--run-dir"):command.index("--run-dir")] = ["--spares", str(spares)]
        return _run(command, env, log_path)

    def fault_free(self, name: str, config: str, run: str) -> dict:
        script, steps, _ = self._script(name)
        run_dir, log_path = os.path.join(self.work, run), os.path.join(self.work, run + ".log")
        env = launcher_env(trace=False)
        ranks = REPLICAS * RANKS
        if config == "plain torchrun, 4 ranks":
            env["COMMSLAYER_RUN_DIR"] = run_dir
            rc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                       "--master-addr", "127.0.0.1", "--master-port", str(free_port()), PLAIN, *script],
                      env, log_path)
        else:
            if config == "ours, after backward":
                env["COMMSLAYER_AVERAGE_AFTER_BACKWARD"] = "1"
            rc = self._launch([PLAIN, *script] if config.startswith("plain") else script, run_dir, env, log_path,
                              spares=self.args.spares if config.endswith("warm spares") else 0)
        results = load_results(run_dir)
        if rc != 0 or len(results) != ranks or any(len(r.step_s) != steps for r in results):
            fail(f"{run}: exit status {rc}, {len(results)} ranks' results", log_path)
        want = {"ours": ["model"], "ours, after backward": []}.get(config, ["model"] if config.startswith("ours")
                                                                   else [])
        if any(r.overlapped != want for r in results):
            fail(f"{run}: modules averaged during backward {[r.overlapped for r in results]}, expected {want}",
                  log_path)
        warmup = min(self.args.warmup, steps - 1)
        slowest = [max(r.step_s[s] for r in results) for s in range(warmup, steps)]
        return {"step_s": statistics.median(slowest), "slowest_rank_step_s": slowest}

    def fault(self, name: str, phase: str, run: str, spares: int = 0) -> dict:
        script, steps, fault_step = self._script(name)
        run_dir, log_path = os.path.join(self.work, run), os.path.join(self.work, run + ".log")
        env = launcher_env(trace=False)
        env["COMMSLAYER_FAULTS"] = json.dumps([{"action": "sigkill", "rank": VICTIM, "step": fault_step,
                                                "phase": phase, "life": None}])
        rc = self._launch(script, run_dir, env, log_path, spares=spares)
        summary = load_summary(run_dir)
        if rc != 0 or summary is None or not summary.ok:
            fail(f"{run}: exit status {rc}, summary {'ok' if summary and summary.ok else 'failed or missing'}",
                  log_path)
        [killed] = summary.killed
        rec = next(x for x in summary.recoveries if VICTIM // RANKS in x.lost_replicas and x.committed_at)
        heals = [a.heal_s for a in summary.admissions]
        if not heals:
            fail(f"{run}: the killed group never rejoined", log_path)
        adopted = sum(line.count("takes life") for line in open(log_path))
        if spares and adopted != min(spares, RANKS):
            fail(f"{run}: {adopted} spare(s) took a rank, expected {min(spares, RANKS)}", log_path)
        return {"stall_s": rec.committed_at - killed["t"],
                "detected_to_committed_s": rec.committed_at - rec.detected_at,
                "fault_step": killed["step"], "recovered_step": rec.step, "heal_s": heals[0],
                "healed_at_step": summary.admissions[0].step, "back_s": summary.admissions[0].at - killed["t"],
                "spares_taken": adopted}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    p.add_argument("--phases", nargs="+", default=["backward", "allreduce"],
                   choices=["forward", "backward", "allreduce", "optimizer"], help="where the victim dies")
    p.add_argument("--spares", type=int, default=0, help="also run each fault (and a fault-free run) with this "
                   "many warm spares (commslayer-run --spares)")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works: every configuration "
                   "but the A/A once, a few steps, the DDP example, a fault in backward; explicit options still apply")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(repeats=1, warmup=1, scripts=["DDP example"], phases=["backward"])
        args = p.parse_args()

    work = tempfile.mkdtemp(prefix="bench-resilience-")
    bench = Bench(args, work)
    configs = ["ours", "ours, after backward", "plain HSDP", "plain HSDP (A/A)", "plain torchrun, 4 ranks"]
    if args.smoke:  # the A/A takes the same path as plain HSDP
        configs.remove("plain HSDP (A/A)")
    warm = f", {args.spares} warm spares" if args.spares else ""
    if warm:
        configs.append("ours" + warm)
    faults = [f"ours, SIGKILL in {phase}{w}" for phase in args.phases for w in ([""] + [warm] * bool(warm))]
    runs: Dict[Tuple[str, str], Callable[[str], dict]] = {}
    for name in args.scripts:
        for config in configs:
            runs[(name, config)] = lambda run, name=name, config=config: bench.fault_free(name, config, run)
        for config in faults:
            phase = config.split()[3].rstrip(",")
            runs[(name, config)] = lambda run, name=name, phase=phase, n=args.spares * config.endswith("spares"): \
                bench.fault(name, phase, run, spares=n)
    figures, revision, began = series(runs, args.repeats, _log, work)

    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {REPLICAS} replica groups x {RANKS} ranks on "
          f"{os.cpu_count()} CPU(s), untraced; steps and fault step per script "
          f"{ {n: (SMOKE_STEPS[n] if args.smoke else SCRIPTS[n][2:]) for n in args.scripts} }; {args.repeats} "
          f"repeats; commit {revision}; {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    print(f"Fault-free: the slowest rank's step time, median over steps {args.warmup}.. of a run; median and "
          "min–max over runs. vs plain HSDP: a run's step time / plain HSDP's in the same repeat − 1.\n")
    print("| script | configuration | step time, median (ms) | min–max (ms) | vs plain HSDP, median | min–max |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.scripts:
        for config in configs:
            row = step_cells(figures[(name, config)], figures[(name, "plain HSDP")], "vs_plain")
            print(f"| {name} | {config} | {row} |")
    print("\nOverlapped against after backward (ours / ours, after backward in the same repeat − 1):\n")
    print("| script | median | min–max |")
    print("|---|---:|---:|")
    for name in args.scripts:
        ratios = [a["step_s"] / b["step_s"] - 1 for a, b in zip(figures[(name, "ours")],
                                                                  figures[(name, "ours, after backward")])]
        print(f"| {name} | {median_range(ratios, 100, 2, ' %')} |")
    print("\nA replica group's rank 0 SIGKILLed (seconds; median and min–max over runs):\n")
    print("| script | fault | kill → the step committed by the survivors (stall) | min–max "
          "| loss detected → committed | min–max | heal (join + state transfer) | min–max "
          "| kill → the group back in | min–max |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.scripts:
        for config in faults:
            xs = figures[(name, config)]
            cols = cells(xs, 'stall_s', 'detected_to_committed_s', 'heal_s', 'back_s')
            print(f"| {name} | {config.removeprefix('ours, ')} | {cols} |")
    if args.json:
        save_runs(args.json, revision, began, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
