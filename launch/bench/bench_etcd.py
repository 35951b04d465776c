"""What keeping a resilient job's store on etcd costs it, and what losing the etcd leader
costs it: launch/examples/ddp_resilient.py as 2 replica groups of 2 ranks, its store
either the launcher's own TCPStore (the default) or a three-member etcd cluster on this
host (``faults/etcd.py``: etcd's default timing, 100 ms heartbeats and a 1 s election
timeout, its data on local disk), side by side in one run.

    python launch/bench/bench_etcd.py --repeats 5 --json docs/data/etcd.json

Configurations (untraced):

* ``TCPStore`` and ``TCPStore (A/A)``: ``commslayer-run`` with its own store,
  twice: the A/A calibrates what two identical configurations differ by here;
* ``etcd``: ``commslayer-run --store etcd://.../JOB`` on the cluster;
* ``TCPStore, SIGKILL in allreduce`` and ``etcd, SIGKILL in allreduce``:
  replica group 1's rank 0 SIGKILLed at the fault step: the survivors' stall
  (the kill to the commit of the step it hit) and the heal, from the
  launcher's summary (as launch/bench/bench_resilience.py);
* ``etcd, leader SIGKILL`` and ``etcd, leader SIGSTOP``: the cluster's leader
  killed (or stopped, and resumed ``STOP_S`` later) as soon as the job prints
  a step at or past the fault step; its cost is the job's longest step from
  that step on, less its median step (world rank 0's step times).

Step time: for each step from ``--warmup`` on, the slowest rank's, median over
those steps; vs TCPStore: a run's step time / TCPStore's in the same repeat − 1.
Repeats rotate the order of the configurations, and each run's job has a key
prefix of its own; a member lost in a run is started (or resumed) again, and
the cluster has a leader, before the next.  ``--smoke`` runs each kind of
run once for a few steps, but not the A/A (the same path as TCPStore), the
leader's SIGSTOP (the same job as its SIGKILL; a stopped leader is
tests/test_etcd_store.py's) nor a rank's SIGKILL (bench_resilience's path, in
its smoke; recovery through etcd is in the fault harness's etcd-leader-kill).  Progress goes to stderr, the
Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # faults/, commslayer/

from launch.bench.bench_resilience import REPLICAS, RANKS, Bench  # noqa: E402
from launch.bench.measure import cells, fail, launcher_env, save_runs, series, step_cells  # noqa: E402
from commslayer.runs import load_results  # noqa: E402
from faults.etcd import EtcdCluster, available  # noqa: E402

SCRIPT = "DDP example"
STOP_S = 5.0  # a stopped leader resumes this long after it was stopped
FAULT_STEP, SMOKE_FAULT_STEP = 100, 0  # the leader's loss: when the job prints a step at or past this
FREE = ["TCPStore", "TCPStore (A/A)", "etcd"]
KILLS = ["TCPStore, SIGKILL in allreduce", "etcd, SIGKILL in allreduce"]
LEADER = {"etcd, leader SIGKILL": "kill", "etcd, leader SIGSTOP": "stop"}


def _log(msg: str) -> None:
    print(f"[bench_etcd] {msg}", file=sys.stderr, flush=True)


class EtcdBench(Bench):
    def __init__(self, args: argparse.Namespace, work: str, cluster: EtcdCluster) -> None:
        super().__init__(args, work)
        self.cluster = cluster

    def on(self, config: str, run: str) -> None:
        """The next launch keeps its store where ``config`` says (a job of its own on etcd)."""
        self.launcher_options = ["--store", self.cluster.url(run)] if config.startswith("etcd") else []

    def leader_loss(self, how: str, run: str) -> dict:
        """The job with the etcd leader SIGKILLed or SIGSTOPped when it prints the fault step."""
        self.on("etcd", run)
        script, steps, _ = self._script(SCRIPT)
        run_dir, log_path = os.path.join(self.work, run), os.path.join(self.work, run + ".log")
        at = SMOKE_FAULT_STEP if self.args.smoke else FAULT_STEP
        lost: Dict[str, float] = {}
        with open(log_path, "w") as log:
            job = subprocess.Popen(self.command(script, run_dir), env=launcher_env(trace=False),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   text=True)
            assert job.stdout is not None
            for line in job.stdout:
                log.write(line)
                step = _printed_step(line)
                if step is not None and step >= at and not lost:
                    leader = self.cluster.leader()
                    (self.cluster.kill if how == "kill" else self.cluster.stop)(leader)
                    lost.update(member=leader, step=step, t=time.time())
                    if how == "stop":
                        threading.Timer(STOP_S, self.cluster.resume, args=(leader,)).start()
            rc = job.wait(600)
        if how == "stop":
            time.sleep(max(0.0, lost.get("t", 0) + STOP_S + 0.5 - time.time()))
        elif lost:
            self.cluster.start(int(lost["member"]))
        self.cluster.wait_healthy()
        results = load_results(run_dir)
        if rc != 0 or not lost or len(results) != REPLICAS * RANKS:
            fail(f"{run}: exit status {rc}, leader lost at {lost or 'never'}, {len(results)} ranks' results",
                  log_path)
        [r0] = [r for r in results if r.member == 0]
        longest_s, median_s = r0.slowest_step(int(lost["step"]))
        return {"stall_s": longest_s - median_s, "longest_step_s": longest_s, "median_step_s": median_s,
                "fault_step": lost["step"]}


def _printed_step(line: str) -> Optional[int]:
    """The step of the example's ``step N loss ...`` line, if ``line`` is one."""
    words = line.split()
    for i, w in enumerate(words[:-2]):
        if w == "step" and words[i + 1].isdigit() and words[i + 2] == "loss":
            return int(words[i + 1])
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works: the fault-free runs "
                   "but the A/A and the leader's SIGKILL, once, a few steps")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(repeats=1, warmup=1)
        args = p.parse_args()
    if not available():
        raise SystemExit("bench_etcd: etcd is not installed (Debian's etcd-server; tests/run.sh installs it)")
    work = tempfile.mkdtemp(prefix="bench-etcd-")
    cluster = EtcdCluster(os.path.join(work, "etcd"))
    bench = EtcdBench(args, work, cluster)

    def free(config: str) -> Callable[[str], dict]:
        def run(name: str) -> dict:
            bench.on(config, name)
            return bench.fault_free(SCRIPT, "ours", name)
        return run

    def killed(config: str) -> Callable[[str], dict]:
        def run(name: str) -> dict:
            bench.on(config, name)
            return bench.fault(SCRIPT, "allreduce", name)
        return run

    free_configs = [c for c in FREE if not (args.smoke and "A/A" in c)]
    kill_configs = [] if args.smoke else KILLS
    runs: Dict[str, Callable[[str], dict]] = {c: free(c) for c in free_configs}
    runs.update({c: killed(c) for c in kill_configs})
    leader = {c: how for c, how in LEADER.items() if not (args.smoke and how == "stop")}
    runs.update({c: (lambda name, how=how: bench.leader_loss(how, name)) for c, how in leader.items()})
    try:
        figures, revision, began = series(runs, args.repeats, _log, work)
    finally:
        cluster.close()

    steps = bench._script(SCRIPT)[1]
    print(f"command: `{shlex.join(['python'] + sys.argv)}`; the DDP example, {REPLICAS} replica groups x {RANKS} "
          f"ranks, {steps} steps, on {os.cpu_count()} CPU(s), untraced, with a 3-member etcd cluster on the same "
          f"host; {args.repeats} repeats; commit {revision}; {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    print("Fault-free: the slowest rank's step time, median over steps of a run; median and min–max over runs. "
          "vs TCPStore: a run's step time / TCPStore's in the same repeat − 1.\n")
    print("| store | step time, median (ms) | min–max (ms) | vs TCPStore, median | min–max |")
    print("|---|---:|---:|---:|---:|")
    for config in free_configs:
        print(f"| {config} | {step_cells(figures[config], figures['TCPStore'], 'vs_tcpstore')} |")
    if kill_configs:
        print("\nReplica group 1's rank 0 SIGKILLed in the all-reduce (seconds; median and min–max over runs):\n")
        print("| store | kill → the step committed (stall) | min–max | heal (join + state transfer) | min–max |")
        print("|---|---:|---:|---:|---:|")
        for config in kill_configs:
            print(f"| {config.split(',')[0]} | {cells(figures[config], 'stall_s', 'heal_s')} |")
    print("\nThe etcd leader lost mid-run: the job's longest step from then on, less its median step (seconds):\n")
    print("| fault | stall | min–max | longest step | min–max |")
    print("|---|---:|---:|---:|---:|")
    for config in leader:
        print(f"| {config.split(', ')[1]} | {cells(figures[config], 'stall_s', 'longest_step_s')} |")
    if args.json:
        save_runs(args.json, revision, began, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
