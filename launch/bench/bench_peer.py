"""Peer-memory redundancy, what it saves and what it costs: a 4-rank FSDP2 job with no
replica groups that loses a rank, next to the usual alternatives, side by side in one run.

    python launch/bench/bench_peer.py --repeats 3 --json docs/data/peer.json

``--smoke`` runs every configuration once on a tiny model for a few steps, to
check that the benchmark still works.

The job is launch/train.py's decoder-only LM at its default size (dim 128,
4 layers, seq 128, batch 8 per rank), run through launch/bench/bench_peer_job.py
(train.py with probes: the process's milestones, the committed steps, the
copies' bytes), 4 ranks, untraced (``COMMSLAYER_TRACE_DIR=""``).

A rank lost (rank 2 SIGKILLed at the start of step F, ``--fault-step``):

* ``peer redundancy``: ``commslayer-run --nproc-per-node 4``, per-rank mode:
  FSDP2 over all 4 ranks, each rank's state copied to its holder at every
  step boundary; the fault harness kills rank 2 in forward of step F, the
  launcher starts a replacement, the survivors wait for it and redo the step;
* ``replica groups (2 x 2)``: ``commslayer-run --replicas 2
  --nproc-per-replica 2``: the same script as HSDP, replica group 1's rank 0
  killed the same way; the survivors go on without the group, its torchrun
  restarts it and it heals from them;
* ``torchrun + DCP``: ``torchrun --max-restarts 1`` of plain FSDP2 over
  all 4 ranks on plain Gloo, the same model, data and AdamW, a
  ``torch.distributed.checkpoint`` every ``--ckpt-every`` steps
  (launch/bench/bench_training.py's baseline job with one replica group): rank 2
  SIGKILLs itself at the start of step F, torchrun ends the others and
  restarts all 4, they load the latest checkpoint and redo the steps since.

Survivor stall: from the kill (the wall time the victim noted just before
SIGKILL) to step F committed by world rank 0 after it (for ours its probe, for
the DCP job its log); steps redone: steps before F committed again after the
kill.  The replacement's process start (the restarted rank 2: exec, the
interpreter up, ``import torch``, the other imports, the model built) is
reported apart, so the target "stall <= one process start + 1 s" can be
judged run by run.

Fault-free (``--steps`` steps, no fault):

* ``plain torchrun`` and ``plain torchrun (A/A)``: ``torchrun
  --nproc-per-node 4`` of the same script: ``resilience.init`` makes a job
  of one replica group, no copies (the commit vote, no redundancy), twice:
  the A/A calibrates what two identical configurations differ by here;
* ``peer, refresh every step`` and ``peer, refresh every K steps``
  (``--refresh-every``): per-rank mode with ``COMMSLAYER_REFRESH_EVERY``.

A run's step time is, for each step from ``--warmup`` on, the slowest rank's
(the API's ``step_s``), median over those steps; overhead is the ratio to
plain torchrun's in the same repeat, minus 1.  Copies: bytes sent per step
per rank (``job.copies.bytes_sent`` over the steps run), and host memory the
copies hold per rank (``held_bytes`` at the end and its peak, sampled
before and after each step) divided by the size of one rank's packed state.
Repeats rotate the order of the configurations.  Progress goes to stderr,
the Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # launch.bench

from commslayer.config import peer_timeout_s  # noqa: E402
from commslayer.run.processes import free_port  # noqa: E402
from commslayer.runs import load_results, load_summary  # noqa: E402
from launch.bench.bench_training import MODEL, SMOKE, _train_args, dcp_restart  # noqa: E402
from launch.bench.measure import cells, fail, launcher_env, median_range, save_runs, series, step_cells, written  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "launch", "bench", "bench_peer_job.py")
RANKS, VICTIM = 4, 2
PEER, GROUPS, DCP = "peer redundancy (per-rank mode)", "replica groups (2 x 2)", "torchrun + DCP"
SPARE, STOP, SPARE_STOP = "peer + 1 warm spare", "peer, SIGSTOP", "peer + 1 warm spare, SIGSTOP"
BASE, AA, EVERY, SOME = "plain torchrun", "plain torchrun (A/A)", "peer, refresh every step", "peer, refresh every K"
EVERY_SPARE = "peer, refresh every step + 1 warm spare"
LOST = (PEER, SPARE, STOP, SPARE_STOP, GROUPS, DCP)
CONFIGS = (PEER, SPARE, STOP, SPARE_STOP, GROUPS, DCP, BASE, AA, EVERY, EVERY_SPARE, SOME)
WITH_SPARE = (SPARE, SPARE_STOP, EVERY_SPARE)
SMOKE_CONFIGS = [PEER, SPARE, BASE, EVERY]
STOP_S = 10.0  # how long a SIGSTOPped rank stays stopped: it resumes long after its replacement took over
SPARE_STARTED = re.compile(r"supervisor: spare \d+ started \(pid (\d+)\)")


def _log(msg: str) -> None:
    print(f"[bench_peer] {msg}", file=sys.stderr, flush=True)


def probes(run_dir: str) -> List[dict]:
    """The probes launch/bench/bench_peer_job.py wrote in a run, one per process that finished."""
    return written(run_dir, "probe-")


class Bench:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args, self.work = args, work

    def _launch(self, mode: str, run: str, steps: int, env: Dict[str, str],
                options: Sequence[str] = ()) -> Tuple[str, str, int, int]:
        """One run of the job (``mode``: per-rank, replicas or torchrun; ``options``: more of the
        launcher's): its run directory, log, exit status, and the most resident memory (bytes)
        a warm spare held while it waited (0: no spare)."""
        run_dir, log_path = os.path.join(self.work, run), os.path.join(self.work, run + ".log")
        script = [JOB, *_train_args(argparse.Namespace(steps=steps, model=self.args.model))]
        if mode == "torchrun":
            env["COMMSLAYER_RUN_DIR"] = run_dir
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script]
        else:
            shape = ["--nproc-per-node", str(RANKS)] if mode == "per-rank" else ["--replicas", "2",
                                                                                 "--nproc-per-replica", "2"]
            cmd = [sys.executable, "-m", "commslayer.run.launcher", *shape, *options, "--run-dir", run_dir, *script]
        spare_rss = 0
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.25)
                spare_rss = max([spare_rss] + [_rss(pid) for pid in _spares(log_path)])
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait()
        return run_dir, log_path, rc, spare_rss

    def fault_free(self, config: str, run: str) -> dict:
        args, env = self.args, launcher_env(trace=False)
        if config in (EVERY, SOME, EVERY_SPARE):
            env["COMMSLAYER_REFRESH_EVERY"] = str(args.refresh_every if config == SOME else 1)
        run_dir, log_path, rc, spare_rss = self._launch("torchrun" if config in (BASE, AA) else "per-rank", run,
                                                        args.steps, env, _options(config))
        results = load_results(run_dir)
        if rc != 0 or len(results) != RANKS or any(len(r.step_s) != args.steps for r in results):
            fail(f"{run}: exit status {rc}, {len(results)} ranks' results", log_path)
        slowest = [max(r.step_s[s] for r in results) for s in range(args.warmup, args.steps)]
        out: dict = {"step_s": statistics.median(slowest), "slowest_rank_step_s": slowest}
        if config == EVERY_SPARE:
            if not spare_rss:
                fail(f"{run}: no waiting spare's memory was read", log_path)
            out["spare_rss_bytes"] = spare_rss
        if config in (EVERY, SOME, EVERY_SPARE):
            found = probes(run_dir)
            if len(found) != RANKS or any("state_bytes" not in p for p in found):
                fail(f"{run}: {len(found)} probes with copies", log_path)
            out["ranks"] = [{k: p[k] for k in ("rank", "state_bytes", "bytes_sent", "held_bytes", "held_peak",
                                               "holders")} for p in sorted(found, key=lambda p: p["rank"])]
            out["sent_per_step"] = [p["bytes_sent"] / args.steps for p in out["ranks"]]
            out["held_per_state"] = [p["held_bytes"] / p["state_bytes"] for p in out["ranks"]]
            out["peak_per_state"] = [p["held_peak"] / p["state_bytes"] for p in out["ranks"]]
        return out

    def lost_rank(self, config: str, run: str) -> dict:
        args = self.args
        if config == DCP:
            return dcp_restart(argparse.Namespace(model=args.model, steps=args.fault_steps, fault_step=args.fault_step,
                                                  ckpt_every=args.ckpt_every, warmup=args.warmup),
                               self.work, run, replicas=1)
        env = launcher_env(trace=False)
        stop = {"action": "sigstop", "seconds": STOP_S} if config in (STOP, SPARE_STOP) else {"action": "sigkill"}
        env["COMMSLAYER_FAULTS"] = json.dumps([{**stop, "rank": VICTIM, "step": args.fault_step,
                                                "phase": "forward", "life": None}])
        run_dir, log_path, rc, _ = self._launch("replicas" if config == GROUPS else "per-rank", run,
                                                args.fault_steps, env, _options(config))
        summary = load_summary(run_dir)
        if rc != 0 or summary is None or not summary.ok or len(summary.killed) != 1:
            fail(f"{run}: exit status {rc}, summary {summary and (summary.ok, summary.killed)}", log_path)
        killed = summary.killed[0]["t"]
        found = probes(run_dir)
        leader = next((p for p in found if p["member"] == 0 and p["restart"] == 0), None)
        fresh = next((p for p in found if p["member"] == VICTIM and p["restart"] > 0), None)
        if leader is None or fresh is None:
            fail(f"{run}: probes {[(p['member'], p['restart']) for p in found]}", log_path)
        after = [(s, t) for s, t in leader["commits"] if t > killed]
        done = next((t for s, t in after if s == args.fault_step), None)
        if done is None:
            fail(f"{run}: rank 0 never committed step {args.fault_step} after the kill", log_path)
        since = {k: fresh[k] - killed for k in ("exec_at", "script_at", "torch_at", "imports_at", "build_from",
                                                "built_at")}
        if config in WITH_SPARE:
            if "adopted_at" not in fresh:
                fail(f"{run}: rank {VICTIM}'s next life was not the warm spare", log_path)
            return {"stall_s": done - killed, "launcher_stall_s": summary.killed[0]["stall_s"],
                    "steps_redone": len([s for s, _ in after if s < args.fault_step]),
                    "to_adoption_s": fresh["adopted_at"] - killed, "adoption_to_init_s": fresh["init_at"] -
                    fresh["adopted_at"], "init_to_build_s": fresh["build_from"] - fresh["init_at"],
                    "model_build_s": fresh["built_at"] - fresh["build_from"], "built_to_commit_s": done -
                    fresh["built_at"], "peer_timeout_s": peer_timeout_s(),
                    "warmed_before_fault_s": killed - fresh["warmed_at"] if "warmed_at" in fresh else None}
        return {"stall_s": done - killed, "launcher_stall_s": summary.killed[0]["stall_s"],
                "steps_redone": len([s for s, _ in after if s < args.fault_step]),
                "replacement_since_kill_s": since,
                "replacement_first_commit_s": fresh["commits"][0][1] - killed if fresh["commits"] else None,
                "process_start_s": fresh["built_at"] - fresh["exec_at"],
                "python_up_s": fresh["script_at"] - fresh["exec_at"],
                "torch_import_s": fresh["torch_at"] - fresh["script_at"],
                "other_imports_s": fresh["imports_at"] - fresh["torch_at"],
                "model_build_s": fresh["built_at"] - fresh["build_from"], "peer_timeout_s": peer_timeout_s()}


def _options(config: str) -> List[str]:
    """The launcher's options a configuration adds."""
    return ["--spares", "1"] if config in WITH_SPARE else []


def _spares(log_path: str) -> List[int]:
    """The pids of the warm spares a run's launcher said it started."""
    with open(log_path, errors="replace") as f:
        return [int(m.group(1)) for m in SPARE_STARTED.finditer(f.read())]


def _rss(pid: int) -> int:
    """Resident memory of ``pid`` (bytes); 0 once it is gone. (A spare of a fault-free run
    waits all along; in a run with a loss it becomes a rank, and its figure is not used.)"""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _tables(args: argparse.Namespace, figures: Dict[str, List[dict]]) -> None:
    """The Markdown tables, a row per configuration run."""
    def ours(config: str) -> bool:
        return config in (PEER, STOP, GROUPS) and config in figures

    if any(c in figures for c in LOST):
        print(f"A rank lost: rank 2 SIGKILLed at the start of step {args.fault_step} (F) of {args.fault_steps} "
              "(seconds; median and min–max over runs; torchrun + DCP: its process start is from the script's "
              "start, not exec).\n")
        print("| configuration | stall: kill → step F committed again | min–max | steps redone | "
              "replacement: kill → process started | min–max | process start (→ model built) | min–max | "
              "stall − process start | min–max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in filter(ours, (PEER, STOP, GROUPS)):
        xs = figures[config]
        print(f"| {config} | {cells(xs, 'stall_s')} | {sorted({x['steps_redone'] for x in xs})} | "
              f"{median_range([x['replacement_since_kill_s']['exec_at'] for x in xs])} | "
              f"{cells(xs, 'process_start_s')} | {median_range([x['stall_s'] - x['process_start_s'] for x in xs])} |")
    dcp = figures.get(DCP, [])
    if dcp:
        print(f"| {DCP} every {args.ckpt_every} steps | "
              f"{median_range([x['fault_step_committed_s'] for x in dcp])} | "
              f"{sorted({x['steps_redone'] for x in dcp})} | {median_range([x['process_started_s'] for x in dcp])} | "
              f"{median_range([x['built_s'] - x['process_started_s'] for x in dcp])} | "
              f"{median_range([x['fault_step_committed_s'] - x['built_s'] + x['process_started_s'] for x in dcp])} |")
    if any(c in figures for c in LOST):
        print("\nThe replacement's process start, per part (seconds; median and min–max over runs; torchrun + DCP: "
              "4 processes start at once, its imports are torch's with train.py's):\n")
        print("| configuration | exec → interpreter up | min–max | import torch | min–max | other imports | "
              "min–max | model build (FSDP2) | min–max | checkpoint load | min–max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in filter(ours, (PEER, STOP, GROUPS)):
        xs = figures[config]
        parts = cells(xs, 'python_up_s', 'torch_import_s', 'other_imports_s', 'model_build_s')
        print(f"| {config} | {parts} | – | – |")
    if dcp:
        print(f"| {DCP} | – | – | {median_range([x['imported_s'] - x['process_started_s'] for x in dcp])} | "
              "– | – | "
              f"{median_range([x['built_s'] - x['imported_s'] for x in dcp])} | "
              f"{median_range([x['checkpoint_loaded_s'] - x['built_s'] for x in dcp])} |")
    spared = [c for c in (SPARE, SPARE_STOP) if c in figures]
    if spared:
        print("\nWith a warm spare (`--spares 1`): the stall per part (seconds; median and min–max over runs): "
              "fault → the launcher gives the spare the rank (for SIGSTOP: the peer timeout, the survivors' "
              "decision, the launcher reading it) → `init()` returns in the spare (it joins the next generation) "
              "→ the script reaches its model build → model built (FSDP2) → step F committed on rank 0 (state "
              "received from the holder, the interrupted step redone).\n")
        print("| configuration | stall | min–max | steps redone | fault → spare given the rank | min–max | → init() "
              "returned | min–max | → model build begins | min–max | model build | min–max | → step F committed "
              "| min–max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in spared:
        xs = figures[config]
        print(f"| {config} | {cells(xs, 'stall_s')} | {sorted({x['steps_redone'] for x in xs})} | "
              f"{cells(xs, 'to_adoption_s', 'adoption_to_init_s', 'init_to_build_s', 'model_build_s')} | "
              f"{cells(xs, 'built_to_commit_s')} |")
    stopped = [c for c in (STOP, SPARE_STOP) if c in figures]
    if stopped:
        print(f"\nSIGSTOP (rank 2 stopped for {STOP_S:g} s, fenced when it resumes): the stall beyond the peer "
              "timeout (`COMMSLAYER_PEER_TIMEOUT_S`, the time a stopped rank takes to be found lost):\n")
        print("| configuration | peer timeout (s) | stall − peer timeout (s) | min–max |")
        print("|---|---:|---:|---:|")
    for config in stopped:
        xs = figures[config]
        print(f"| {config} | {xs[0]['peer_timeout_s']:g} | "
              f"{median_range([x['stall_s'] - x['peer_timeout_s'] for x in xs])} |")
    if BASE not in figures:
        return

    print(f"\nFault-free, {args.steps} steps: the slowest rank's step time, median over steps {args.warmup}.. of a "
          "run; median and min–max over runs. vs plain torchrun: a run's step time / plain torchrun's in the same "
          "repeat − 1.\n")
    print("| configuration | step time, median (ms) | min–max (ms) | vs plain torchrun, median | min–max |")
    print("|---|---:|---:|---:|---:|")
    named = {c: f"{c} (K={args.refresh_every})" if c == SOME else c for c in (BASE, AA, EVERY, EVERY_SPARE, SOME)}
    for config in (c for c in (BASE, AA, EVERY, EVERY_SPARE, SOME) if c in figures):
        print(f"| {named[config]} | {step_cells(figures[config], figures[BASE], 'vs_plain')} |")
    if EVERY_SPARE in figures:
        print(f"\nA waiting spare's resident memory (the most sampled every 0.25 s over a run; median and min–max "
              f"over runs): {median_range([x['spare_rss_bytes'] for x in figures[EVERY_SPARE]], 2 ** -20, 1, ' MiB')}"
              .replace(" | ", " (") + ").")
    if not any(c in figures for c in (EVERY, SOME)):
        return
    print("\nThe copies, per rank (every rank of every run: median and min–max): one rank's packed state at the "
          "end, bytes sent per step (the first copy, before the first optimizer step, has no optimizer state), "
          "and what the copies hold in host memory in units of one rank's packed state:\n")
    print("| configuration | packed state (bytes) | min–max | sent per step (bytes) | min–max | "
          "held at the end / state | min–max | peak held / state | min–max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config in (c for c in (EVERY, EVERY_SPARE, SOME) if c in figures):
        xs = figures[config]

        def every(key: str) -> List[float]:
            return [v for x in xs for v in x[key]]

        print(f"| {named[config]} | {median_range([r['state_bytes'] for x in xs for r in x['ranks']], 1, 0)} | "
              f"{median_range(every('sent_per_step'), 1, 0)} | {median_range(every('held_per_state'), 1, 2)} | "
              f"{median_range(every('peak_per_state'), 1, 2)} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps of a fault-free run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--fault-step", type=int, default=15, help="the step in which rank 2 is killed")
    p.add_argument("--fault-steps", type=int, default=17, help="steps of a run with a lost rank")
    p.add_argument("--ckpt-every", type=int, default=10, help="the DCP baseline saves a checkpoint every N steps")
    p.add_argument("--refresh-every", type=int, default=10, help="K of 'peer, refresh every K'")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                   help=f"the configurations to run (default: all of {list(CONFIGS)})")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works in under a minute: a tiny model, "
                   f"a few steps, once, only {SMOKE_CONFIGS} (the others run the same code); explicit options "
                   "still apply")
    args = p.parse_args()
    args.model = MODEL
    if args.smoke:
        p.set_defaults(repeats=1, steps=4, warmup=1, fault_step=3, fault_steps=4, ckpt_every=2, refresh_every=2,
                       configs=SMOKE_CONFIGS)
        args = p.parse_args()
        args.model = SMOKE["model"]

    work = tempfile.mkdtemp(prefix="bench-peer-")
    bench = Bench(args, work)
    if any(c in args.configs for c in (AA, EVERY, EVERY_SPARE, SOME)) and BASE not in args.configs:
        p.error(f"{BASE!r} is the fault-free baseline: run it too")
    runs: Dict[str, Callable[[str], dict]] = {}
    for config in args.configs:
        runs[config] = (lambda run, config=config: bench.lost_rank(config, run)) if config in LOST else \
            (lambda run, config=config: bench.fault_free(config, run))
    figures, revision, began = series(runs, args.repeats, _log, work)

    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {RANKS} ranks on {os.cpu_count()} CPU(s), untraced; "
          f"model {args.model}; {args.repeats} repeats; commit {revision}; "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(began))}\n")
    _tables(args, figures)
    if args.json:
        save_runs(args.json, revision, began, figures, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
