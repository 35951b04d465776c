"""Run a scenario against a real job, then check what survived and write the report.

The job is the resilient launcher (``commslayer-run``: a coordinator and one
torchrun per replica group) running ``launch/train.py`` or the job given.
Faults fired from inside the ranks travel in ``COMMSLAYER_FAULTS``; the
harness carries out the external ones itself when the job reports the
fault step (SIGKILL or SIGSTOP of the coordinator, a link cut or a bandwidth
cap in network namespaces, a trace directory on a full tmpfs).  The harness is a
subreaper, so every process the job leaves behind is found and ended.

Then it reads what the ranks wrote (result files, the fault log and the
launcher's summary through ``commslayer.runs``; trace dumps) and checks the
invariants: the faults fired, the job did what the scenario promises,
survivors' state bitwise identical, no step applied twice or skipped, a dump covering the fault on
every survivor, the viewer's verdict, and no process, namespace or mount
left behind.  ``run`` returns the report; ``write_reports`` writes it as
JSON and Markdown.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from commslayer.run.launcher import GRACE_S
from commslayer.run.processes import ProcessSet, become_subreaper, descendants, free_port
from commslayer.runs import (FAULT_LOG, TRACES, RankResult, Recovery, load_results, load_summary, longest,
                             read_log, result_paths)
from tracing.read import analysis
from tracing.read.traceio import TraceFileError, read_dump

from .etcd import EtcdCluster
from .etcd import available as etcd_available
from .inject import Fault, Log, encode
from .scenarios import BY_NAME, ETCD_STOP_S, FAULT_STEP, Layout, Scenario

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = str(ROOT / "launch" / "train.py")

# fired by the harness at the fault step
EXTERNAL = ("coordinator-kill", "coordinator-stop", "link-cut", "bandwidth-cap", "etcd-leader-kill", "etcd-leader-stop",
            "etcd-quorum-loss")
NOT_A_RANK = ("coordinator", "link", "cap", "etcd")  # faults whose target is not a rank's process
UNANSWERED = ("coordinator-stop", "etcd-quorum-loss")  # store faults found by the deadline, not a closed socket
LINK_CUT_S = 8.0
CAP_RATE = "200mbit"
STEP_LINE = re.compile(r"\] step\s+(\d+)\s")


class Skipped(Exception):
    """The scenario cannot run here (it needs root, iproute2 or tc); the message says why."""


@dataclass
class Options:
    """How to run the job: ``ranks`` in replica groups of ``per_replica``, ``steps``
    training steps, ``job`` and its extra ``job_args``; ``timeout_s`` bounds one run.
    ``rank`` (default: the last), ``step``, ``op`` and ``nth`` move the scenario's
    fault: the rank it hits, the step of a step fault or an external one, the kind
    of collective (on any communicator) and the call of it that a collective fault
    (the first life's) fires at.  ``reference``: compare a per-rank job's final state
    with a fault-free run's (run once per job, steps and size: ``reference_fingerprints``)."""

    ranks: int = 4
    per_replica: int = 2
    steps: int = 30
    rank: Optional[int] = None
    step: int = FAULT_STEP
    nth: Optional[int] = None
    op: Optional[str] = None
    job: str = DEFAULT_JOB
    job_args: List[str] = field(default_factory=list)
    timeout_s: float = 300.0
    reference: bool = True

    def layout(self, scenario: Scenario) -> Layout:
        """The job's shape and the fault's target and step; ``ValueError`` naming the option
        that cannot make a run in which the scenario's fault comes."""
        for name, value, least in (("steps", self.steps, 1), ("per_replica", self.per_replica, 1),
                                   ("rank", self.rank, 0), ("step", self.step, 0)):
            if value is not None and value < least:
                raise ValueError(f"{scenario.name}: {name} {value}: must be {least} or more")
        if self.step >= self.steps:
            raise ValueError(f"{scenario.name}: the fault step {self.step} never comes: the job runs steps "
                             f"0..{self.steps - 1} (steps {self.steps})")
        if not self.timeout_s > 0:
            raise ValueError(f"{scenario.name}: timeout {self.timeout_s}: must be more than 0 seconds")
        rank = next((r for r in (self.rank, scenario.rank) if r is not None), -1)
        if scenario.per_rank:  # per_replica does not apply: no replica groups
            if self.ranks < 3:
                raise ValueError(f"{scenario.name}: a per-rank job of {self.ranks} ranks: needs 3 or more "
                                 "(a lost rank, the holder of its state and another survivor)")
            return Layout(1, self.ranks, rank, self.step, per_rank=True)
        per = scenario.per_replica or self.per_replica
        if self.ranks % per or self.ranks // per < 2:
            raise ValueError(f"{scenario.name}: {self.ranks} ranks do not make 2 or more replica groups of {per}")
        return Layout(self.ranks // per, per, rank, self.step)

    def faults(self, scenario: Scenario, layout: Layout) -> List[Fault]:
        """The scenario's faults, the first life's collective fault moved to ``op`` and ``nth``."""
        from commslayer.comm.wire import BACKEND_OPS

        if self.op is not None and self.op not in BACKEND_OPS:
            raise ValueError(f"op {self.op!r}: expected one of {', '.join(BACKEND_OPS)}")
        out = []
        for f in scenario.faults(layout):
            if f.op and f.life in (0, None) and f.action != "delay":
                f = replace(f, nth=f.nth if self.nth is None else self.nth, op=self.op or f.op,
                            comm="" if self.op else f.comm)
            if f.step is not None and f.step >= self.steps:
                raise ValueError(f"{scenario.name}: its fault at step {f.step} never comes: the job runs steps "
                                 f"0..{self.steps - 1} (steps {self.steps})")
            out.append(f)
        return out


@dataclass
class Check:
    name: str
    ok: Optional[bool]  # None: does not apply to this scenario
    detail: str = ""


# ------------------------------------------------------------------ the run
class _Job:
    """The job's launcher processes, their output (to ``job.log``, scanned for steps)."""

    def __init__(self, run_dir: str) -> None:
        self._set = ProcessSet(grace_s=0.0)
        self.procs: List[subprocess.Popen] = []
        self.step = -1
        self.stepped = threading.Condition()
        self.ended_at: Optional[float] = None
        self._log = open(os.path.join(run_dir, "job.log"), "w")

    def start(self, cmd: List[str], env: Dict[str, str], name: str) -> subprocess.Popen:
        proc = self._set.start(name, cmd, env, on_line=lambda line: self._read(line, name))
        self.procs.append(proc)
        return proc

    def _read(self, line: str, name: str) -> None:
        self._log.write(f"[{name}] {line}")
        m = STEP_LINE.search(line)
        if m:
            with self.stepped:
                self.step = max(self.step, int(m.group(1)))
                self.stepped.notify_all()

    def wait_step(self, step: int, deadline: float) -> bool:
        with self.stepped:
            return self.stepped.wait_for(lambda: self.step >= step or self.ended(), deadline - time.monotonic()) \
                and self.step >= step

    def ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def wait(self, deadline: float, procs: Optional[List[subprocess.Popen]] = None) -> bool:
        """True if every launcher (of ``procs``, if given) ended before ``deadline``
        (``ended_at``: when the last did)."""
        for p in self.procs if procs is None else procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        self.ended_at = time.time()
        return True

    def close(self) -> None:
        self._set.stop()
        self._log.close()


def _requirements(scenario: Scenario) -> None:
    if scenario.family == "etcd" and not etcd_available():
        raise Skipped(f"{scenario.name}: needs etcd (Debian's etcd-server; tests/run.sh installs it)")
    if not scenario.needs_root:
        return
    if os.geteuid() != 0:
        raise Skipped(f"{scenario.name}: needs root (network namespaces, tc, mounts); run as root to include it")
    tools = ["ip", "tc"] if scenario.family == "network" else ["mount", "umount"]
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        raise Skipped(f"{scenario.name}: needs {', '.join(missing)} (iproute2 / util-linux)")


def run(name: str, out_dir: str, options: Optional[Options] = None) -> Dict[str, Any]:
    """Run scenario ``name`` into ``out_dir/<name>`` and return its report (also
    written there as report.json and report.md).  Raises ``Skipped`` when it
    cannot run on this machine."""
    scenario = BY_NAME[name]
    options = options or Options()
    _requirements(scenario)
    layout = options.layout(scenario)
    run_dir = os.path.abspath(os.path.join(out_dir, name))
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    os.makedirs(run_dir)
    become_subreaper()
    before = set(descendants(os.getpid()))  # a caller's own children are not the job's orphans
    faults = options.faults(scenario, layout)
    log_path = os.path.join(run_dir, FAULT_LOG)
    log = Log(log_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_FAULTS=encode(faults), COMMSLAYER_FAULTS_LOG=log_path,
               **scenario.env)
    env.pop("COMMSLAYER_TRACE_DIR", None)  # the launcher's default: <run-dir>/traces
    shape = ["--nproc-per-node", str(layout.ranks)] if layout.per_rank else \
        ["--replicas", str(layout.replicas), "--nproc-per-replica", str(layout.per_replica)]
    base = [sys.executable, "-m", "commslayer.run.launcher", *shape, "--max-restarts", str(scenario.max_restarts),
            "--run-dir", run_dir, *(["--spares", str(scenario.spares)] if scenario.spares else [])]
    job_args = [options.job, "--steps", str(options.steps), "--heal-timeout", "90", *options.job_args]
    reference = reference_fingerprints(options, layout, out_dir, job_args) \
        if scenario.per_rank and scenario.expect == "survive" and options.reference else None
    began = time.time()
    deadline = time.monotonic() + options.timeout_s
    notes: List[str] = []
    leftovers: Dict[str, List[str]] = {}
    net, coordinator_proc, cluster = None, None, None  # the network hosts, the coordinator's own launcher, etcd
    with ExitStack() as stack:
        job = _Job(run_dir)
        stack.callback(job.close)
        trace_dir = os.path.join(run_dir, TRACES)
        if scenario.external == "disk-full":
            trace_dir = stack.enter_context(_FullDisk(run_dir, leftovers)).trace_dir
            env["COMMSLAYER_TRACE_DIR"] = trace_dir
        if scenario.family == "network":
            from .netns import Network, namespaces

            tag = f"csft{os.getpid()}-"  # Network's names; checked once it is closed (callbacks run last first)
            stack.callback(lambda: leftovers.__setitem__("namespaces", [n for n in namespaces() if n.startswith(tag)]))
            net = stack.enter_context(Network(layout.replicas + 1, "csft"))
            coordinator = f"{net.address(1, 0)}:29660"
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            env.pop("COMMSLAYER_LIVENESS_HOST", None)
            job.start(net.run(0, [*base, "--replica-ids", "none", "--host", net.address(1, 0), "--port", "29660"]),
                      env, "coordinator")
            for r in range(layout.replicas):
                job.start(net.run(r + 1, [*base, "--replica-ids", str(r), "--coordinator", coordinator, *job_args]),
                          env, f"host {r + 1}")
        elif scenario.family == "etcd":
            cluster = EtcdCluster(Path(run_dir) / "etcd")
            stack.callback(cluster.close)
            job.start([*base, "--store", cluster.url("job"), *job_args], env, "launcher")
        elif scenario.external in ("coordinator-kill", "coordinator-stop"):
            port = free_port()
            coordinator_proc = job.start([*base, "--replica-ids", "none", "--port", str(port)], env, "coordinator")
            job.start([*base, "--coordinator", f"127.0.0.1:{port}", *job_args], env, "groups")
        else:
            job.start([*base, *job_args], env, "launcher")
        if scenario.external in EXTERNAL:
            if job.wait_step(layout.step, deadline):
                _inject_external(scenario.external, log, job, layout, net, coordinator_proc, cluster)
            else:
                notes.append(f"the job never reached step {layout.step}: the external fault was not injected")
        if scenario.external == "coordinator-stop":  # the job ends without its stopped coordinator
            assert coordinator_proc is not None  # started above for this fault
            finished = job.wait(deadline, [p for p in job.procs if p is not coordinator_proc])
            for sig in (signal.SIGCONT, signal.SIGKILL):
                os.killpg(coordinator_proc.pid, sig)
            coordinator_proc.wait()
        else:
            finished = job.wait(deadline)
        if not finished:
            notes.append(f"the job did not end within {options.timeout_s:.0f}s: ended by the harness")
        codes = [p.poll() for p in job.procs]
        if cluster is not None:  # the job's store goes with the job
            cluster.close()
        time.sleep(0.5)  # a torchrun's last workers are being reaped
        left = [pid for pid in descendants(os.getpid()) if pid not in before]
        leftovers["processes"] = [_describe_pid(pid) for pid in left]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.time() - began
    report = evaluate(scenario, layout, options, run_dir, trace_dir, codes, job.ended_at, leftovers, began,
                      reference)
    report.update(wall_s=round(wall, 3), notes=notes + report["notes"])
    write_reports(report, run_dir)
    return report


_REFERENCES: Dict[tuple, Dict[int, List[int]]] = {}


def reference_fingerprints(options: Options, layout: Layout, out_dir: str, job_args: List[str]) -> Dict[int, List[int]]:
    """Each rank's state fingerprints at the end of a fault-free run of the per-rank job
    (``job_args``: the script and its arguments), by rank; empty if that run failed.  Run
    into ``out_dir/reference-per-rank`` once per job, arguments and size in this process."""
    key = (layout.ranks, *job_args)
    if key not in _REFERENCES:
        ref_dir = os.path.abspath(os.path.join(out_dir, "reference-per-rank"))
        shutil.rmtree(ref_dir, ignore_errors=True)
        os.makedirs(ref_dir)
        env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
        env.pop("COMMSLAYER_FAULTS", None)
        job = _Job(ref_dir)
        try:
            proc = job.start([sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", str(layout.ranks),
                              "--run-dir", ref_dir, *job_args], env, "reference")
            done = job.wait(time.monotonic() + options.timeout_s)
        finally:
            job.close()
        results = load_results(ref_dir) if done and proc.returncode == 0 else []
        _REFERENCES[key] = {r.member: r.fingerprints or [] for r in results}
    return _REFERENCES[key]


def _inject_external(kind: str, log: Log, job: _Job, layout: Layout, net: Any,
                     coordinator: Optional[subprocess.Popen], cluster: Optional[EtcdCluster]) -> None:
    """Fire a fault the ranks cannot fire themselves, and log it like theirs."""
    if kind.startswith("etcd-"):
        assert cluster is not None
        leader = cluster.leader()
        victims = [leader, (leader + 1) % cluster.size] if kind == "etcd-quorum-loss" else [leader]
        pids = [cluster.procs[i].pid for i in victims]  # type: ignore[union-attr]
        what = {"etcd-leader-kill": "SIGKILL of the etcd leader",
                "etcd-leader-stop": f"SIGSTOP of the etcd leader for {ETCD_STOP_S:g} s",
                "etcd-quorum-loss": "SIGKILL of 2 of the 3 etcd members, the leader first"}[kind]
        log.write("injected", fault="etcd", action="sigstop" if kind == "etcd-leader-stop" else "sigkill", what=what,
                  step=job.step, member=-1, target=pids[0])
        for i in victims:
            if kind == "etcd-leader-stop":
                cluster.stop(i)
                threading.Timer(ETCD_STOP_S, cluster.resume, args=(i,)).start()
            else:
                cluster.kill(i)
        return
    if kind in ("coordinator-kill", "coordinator-stop"):
        assert coordinator is not None  # run_scenario started it for these
        sig = signal.SIGKILL if kind == "coordinator-kill" else signal.SIGSTOP
        log.write("injected", fault="coordinator", action=sig.name.lower(), what=f"{sig.name} of the coordinator",
                  step=job.step, member=-1, target=coordinator.pid)
        os.killpg(coordinator.pid, sig)
    elif kind == "link-cut":
        log.write("injected", fault="link", action="link-cut", what=f"link of rank {layout.target} cut for "
                  f"{LINK_CUT_S:g}s", step=job.step, member=layout.target)
        net.set_link(layout.target + 1, 1, False)
        time.sleep(LINK_CUT_S)
        net.set_link(layout.target + 1, 1, True)
        log.write("restored", fault="link")
    else:
        log.write("injected", fault="cap", action="bandwidth-cap", step=job.step, member=layout.target,
                  what=f"link of rank {layout.target} capped to {CAP_RATE}")
        net.cap(layout.target + 1, CAP_RATE)


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid}: {cmdline[:120]}"
    except OSError:
        return str(pid)


class _FullDisk:
    """A 2 MiB tmpfs under the run directory, filled to the last byte, holding the trace directory."""

    def __init__(self, run_dir: str, leftovers: Dict[str, List[str]]) -> None:
        self.mount = os.path.join(run_dir, "tracefs")
        self.trace_dir = os.path.join(self.mount, "traces")
        self._leftovers = leftovers

    def __enter__(self) -> "_FullDisk":
        os.makedirs(self.mount)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", self.mount], check=True, capture_output=True)
        os.makedirs(self.trace_dir)
        with open(os.path.join(self.mount, "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stray = sorted(os.listdir(self.trace_dir))
        subprocess.run(["umount", "-l", self.mount], capture_output=True)
        with open("/proc/mounts") as f:
            self._leftovers["mounts"] = [line.split()[1] for line in f if line.split()[1] == self.mount]
        self._leftovers["trace_files_on_full_disk"] = self.stray


# ------------------------------------------------------------- the checks
def evaluate(scenario: Scenario, layout: Layout, options: Options, run_dir: str, trace_dir: str,
             codes: List[Optional[int]], ended_at: Optional[float], leftovers: Dict[str, List[str]],
             began: float, reference: Optional[Dict[int, List[int]]] = None) -> Dict[str, Any]:
    """The report of a finished run: what was injected, detected and recovered, and the checks
    (``reference``: a per-rank job's fingerprints in a fault-free run, ``reference_fingerprints``)."""
    events = read_log(os.path.join(run_dir, FAULT_LOG))
    injected = [e for e in events if e["event"] == "injected"]
    results = load_results(run_dir)
    summary = load_summary(run_dir)
    recoveries = summary.recoveries if summary else []
    t0 = injected[0]["t"] if injected else None
    checks: List[Check] = []
    notes: List[str] = []
    wanted = len(options.faults(scenario, layout)) + (scenario.external in EXTERNAL)
    checks.append(Check("faults injected", len(injected) == wanted,
                        f"{len(injected)} of {wanted}: " + "; ".join(e["what"] for e in injected)))
    target_pids = {e["pid"] for e in injected if e["member"] == layout.target and e["fault"] not in NOT_A_RANK}
    killed = sorted({e["member"] for e in injected if e["fault"] not in NOT_A_RANK})
    detection = _detection(events, injected, layout, {r.pid: r.started for r in results})
    outside = [e for e in injected if e["fault"] == "etcd"]  # the job's store's faults: nothing to recover from
    recovery = recovery_of(recoveries, [e for e in injected if e not in outside], results)
    if scenario.expect == "survive":
        checks += state_checks(results, options.steps, layout, reference)
        checks.append(Check("job finished", ended_at is not None and all(c == 0 for c in codes),
                            f"launcher exit {codes}"))
        checks.append(_dumps_cover(scenario, results, trace_dir, t0, target_pids, layout))
    elif scenario.expect == "bug":
        checks += _bug_checks(t0, layout, codes, ended_at, trace_dir, run_dir)
    elif layout.per_rank:
        checks += _state_lost_checks(t0, layout, killed, codes, ended_at, trace_dir, run_dir)
    else:
        checks += _stop_checks(scenario, t0, layout, codes, ended_at, trace_dir, run_dir)
    quiet = scenario.straggler or scenario.external == "bandwidth-cap"
    if quiet:
        # Once a rank has finished (its result written), the others may see it go: not a fault.
        done = min((os.path.getmtime(p) for p in result_paths(run_dir)), default=float("inf"))
        failures = [e for e in events if e["event"] == "failure" and e["t"] < done]
        late = sum(e["event"] == "failure" and e["t"] >= done for e in events)
        checks.append(Check("nobody declared dead", not failures and not recoveries,
                            f"{len(failures)} communicator failures, {len(recoveries)} recoveries"))
        if late:
            notes.append(f"{late} communicator failure(s) logged after the first rank had finished the run "
                         "(a peer that finished was seen to go; see faults.jsonl)")
    elif scenario.expect == "survive":
        if outside:
            checks.append(_store_fault_ridden_out(outside[0], injected, events, recoveries, results))
        checks.append(_recovered_from_every_fault(recovery, options.steps))
    if scenario.spares:
        used = summary.spares["used"] if summary and summary.spares else 0
        checks.append(Check("a warm spare took the rank", used == len(killed),
                            f"spares used {used}, ranks lost {len(killed)} (the launcher's summary)"))
    if scenario.stopped:
        checks.append(_fenced(events, recoveries, results, layout, target_pids, trace_dir, run_dir))
    diagnosis = _diagnose(trace_dir, layout, scenario)
    if scenario.culprit:
        checks.append(Check("viewer names the rank", layout.target in diagnosis.get("culprits", []),
                            diagnosis.get("headline", "")))
    if scenario.straggler:
        top = diagnosis.get("straggler")
        checks.append(Check("viewer's summary shows the straggler", top == layout.target,
                            f"commslayer-trace summary: straggler: {diagnosis.get('straggler_line')}"))
    if scenario.family == "bad-input":
        checks.append(_mismatch_raised(trace_dir, layout))
    if scenario.external == "bandwidth-cap":
        notes.append(_step_times(results, injected))
    if scenario.external == "disk-full":
        stray = leftovers.get("trace_files_on_full_disk", [])
        checks.append(Check("no half-written trace file", not [n for n in stray if ".tmp-" in n],
                            f"files left in the full trace directory: {stray}"))
        said = _grep(os.path.join(run_dir, "job.log"), "cannot write")
        checks.append(Check("tracing reported the full disk", said > 0, f"{said} 'cannot write' warnings in job.log"))
    for kind in ("processes", "namespaces", "mounts"):
        if kind in leftovers or kind == "processes":
            left = leftovers.get(kind, [])
            checks.append(Check(f"no orphan {kind}", not left, "; ".join(left) or "none"))
    passed = all(c.ok is not False for c in checks)
    return {
        "scenario": scenario.name, "family": scenario.family, "summary": scenario.summary,
        "promise": scenario.promise, "expect": scenario.expect, "passed": passed,
        "layout": {"replicas": layout.replicas, "per_replica": layout.per_replica, "target": layout.target,
                   "per_rank": layout.per_rank},
        "steps": options.steps, "job": options.job, "env": scenario.env, "launcher_exit": codes,
        "injected": [{"what": e["what"], "t": e["t"], "after_start_s": round(e["t"] - began, 3),
                      "step": e.get("step"), "member": e["member"], "life": e["life"]} for e in injected],
        "detection": detection, "recovery": recovery, "diagnosis": diagnosis,
        # a job that must stop (expect stop or bug): from the first fault until every process was gone
        "ended_s": None if scenario.expect == "survive" or t0 is None or ended_at is None else round(ended_at - t0, 3),
        "checks": [vars(c) for c in checks], "notes": notes, "run_dir": run_dir,
    }


def state_checks(results: List[RankResult], steps: int, layout: Layout,
                 reference: Optional[Dict[int, List[int]]] = None) -> List[Check]:
    """Nothing lost: every rank of every group reached the end with the same state, each step applied once.
    A per-rank job holds each shard once: its state is compared with ``reference``, a fault-free run's
    fingerprints by rank (None: not compared)."""
    members = sorted(r.member for r in results)
    out = [Check("every rank finished every step", members == list(range(layout.ranks)) and
                 all(r.end_step == steps for r in results),
                 f"result files of members {members}")]
    twice = [(r.member, sorted(set(r.optimizer_steps))) for r in results
             if set(r.optimizer_steps) != {steps} or sorted(r.losses) != list(range(r.start_step, steps))]
    out.append(Check("no step applied twice or skipped", bool(results) and not twice,
                     f"AdamW step counts all {steps} and one loss per step on every rank" if not twice
                     else f"wrong on (member, AdamW steps): {twice}"))
    if layout.per_rank:
        out.append(_same_as_reference(results, reference))
        return out
    diffs = []
    for shard in sorted({r.rank for r in results}):
        prints = {tuple(r.fingerprints or ()) for r in results if r.rank == shard}
        values = {x for p in prints for x in p}
        if len(prints) != 1 or len(values) != 1:
            diffs.append(shard)
    out.append(Check("state bitwise identical across replicas", bool(results) and not diffs,
                     "parameters and AdamW state, per shard (BLAKE2b)" + (f"; differ on shards {diffs}" if diffs
                                                                         else "")))
    return out


def _same_as_reference(results: List[RankResult], reference: Optional[Dict[int, List[int]]]) -> Check:
    name = "state bitwise identical to a fault-free run"
    if reference is None:
        return Check(name, None, "no fault-free reference run (--no-reference)")
    if not reference:
        return Check(name, False, "the fault-free reference run did not finish")
    differ = sorted(r.member for r in results if r.fingerprints != reference.get(r.member))
    return Check(name, bool(results) and not differ and sorted(reference) == sorted(r.member for r in results),
                 "parameters, AdamW state and registered objects per rank (BLAKE2b) vs the reference run's"
                 + (f"; differ on ranks {differ}" if differ else ""))


def _detection(events: List[dict], injected: List[dict], layout: Layout,
               started: Dict[int, float]) -> List[Dict[str, Any]]:
    """Per process that lived through each fault: the first failure it logged after
    the fault (before the next one), and how long after."""
    out = []
    for i, inj in enumerate(injected):
        until = injected[i + 1]["t"] if i + 1 < len(injected) else float("inf")
        first: Dict[int, dict] = {}
        for e in events:
            if e["event"] == "failure" and inj["t"] <= e["t"] < until and e["pid"] != inj["pid"] \
                    and started.get(e["pid"], 0) < inj["t"]:
                first.setdefault(e["pid"], e)
        for e in sorted(first.values(), key=lambda e: e["t"]):
            out.append({"fault": inj["what"], "member": e["member"], "life": e["life"],
                        "after_s": round(e["t"] - inj["t"], 4), "error": e["error"], "comm": e["comm"],
                        "mate": layout.unit(e["member"]) == layout.unit(layout.target)})
    return out


def recovery_of(recoveries: List[Recovery], injected: List[dict], results: List[RankResult]) -> Dict[str, Any]:
    """Per fault, the recovery it caused (the first one seen after it): fault to next
    committed step; the rejoins (as the longest-lived rank saw them, also those at the
    end of the run); how many recoveries in all."""
    admissions = longest(results).admissions if results else []
    per_fault = []
    for i, inj in enumerate(injected):
        until = injected[i + 1]["t"] if i + 1 < len(injected) else float("inf")
        rec = next((r for r in recoveries if inj["t"] <= r.detected_at < until and r.committed_at), None)
        committed = None if rec is None else rec.committed_at
        per_fault.append({"fault": inj["what"], "stall_s": None if committed is None else round(committed - inj["t"], 4),
                          "detected_to_committed_s": None if rec is None or committed is None else
                          round(committed - rec.detected_at, 4),
                          "redone_step": None if rec is None else rec.step})
    return {
        "stall_s": per_fault[0]["stall_s"] if per_fault else None, "per_fault": per_fault,
        "rejoined": [{"replicas": a.replicas, "step": a.step, "heal_s": round(a.heal_s, 4)}
                     for a in admissions],
        "recoveries": len(recoveries),
    }


def _recovered_from_every_fault(recovery: Dict[str, Any], steps: int) -> Check:
    """Each fault was followed by a committed step; a later fault that came after the
    survivors' last step (on a slow machine, a restarted group killed while it heals at
    the end of the run) by the group rejoining at the end."""
    stalls = [f["stall_s"] for f in recovery["per_fault"]]
    at_end = any(a["step"] == steps for a in recovery["rejoined"])
    late = len(stalls) > 1 and stalls[-1] is None and at_end
    ok = bool(stalls) and (None not in stalls or (late and None not in stalls[:-1]))
    said = ", ".join("none" if x is None else f"{x}s" for x in stalls)
    return Check("survivors recovered from every fault", ok, "fault to next committed step: " + said
                 + ("; the last fault came after the survivors' last step and the group rejoined at the end "
                    "of the run" if late else ""))


def _store_fault_ridden_out(fault: dict, injected: List[dict], events: List[dict], recoveries: List[Recovery],
                            results: List[RankResult]) -> Check:
    """The job's store lost a member (the etcd leader): until the next fault nobody may be
    declared dead and nothing recovered; what it cost is the longest step after it
    (world rank 0's), against the median step."""
    later = [e["t"] for e in injected if e["t"] > fault["t"]]
    until = min(later, default=float("inf"))
    failures = [e for e in events if e["event"] == "failure" and fault["t"] <= e["t"] < until]
    recovered = [r for r in recoveries if fault["t"] <= r.detected_at < until]
    cost = ""
    first = [r for r in results if r.member == 0 and r.start_step <= fault["step"]]
    if first:
        then = [int(e["step"]) for e in injected if e["t"] > fault["t"] and e.get("step") is not None]
        longest_s, median_s = first[0].slowest_step(fault["step"], min(then, default=None))
        cost = f"; the longest step after it {longest_s:.3f} s, the median step {median_s:.3f} s"
    return Check("the store's fault was ridden out", not failures and not recovered,
                 f"{fault['what']} at step {fault['step']}: {len(failures)} communicator failures and "
                 f"{len(recovered)} recoveries before the next fault{cost}")


def _dump_path(trace_dir: str, result: RankResult) -> str:
    sub = "" if not result.restart else f"replica{result.replica}-restart{result.restart}"
    return os.path.join(trace_dir, sub, f"rank{result.member}.json")


def _dumps_cover(scenario: Scenario, results: List[RankResult], trace_dir: str, t: Optional[float],
                 target_pids: set, layout: Layout) -> Check:
    if scenario.external == "disk-full":
        return Check("every survivor has a dump covering the fault", None, "the trace disk is full by design")
    if t is None:
        return Check("every survivor has a dump covering the fault", False, "no fault was injected")
    survivors = [r for r in results if r.started < t and r.pid not in target_pids]
    bad = []
    for r in survivors:
        try:
            doc = read_dump(_dump_path(trace_dir, r))
        except (OSError, TraceFileError) as exc:
            bad.append(f"member {r.member}: {exc}")
            continue
        shift = doc["clock"]["wall_ns"] - doc["clock"]["mono_ns"]
        starts = [x["enqueue_ns"] for x in doc["records"]]
        ends = [x.get("end_ns") or x["enqueue_ns"] for x in doc["records"]]
        first = t if scenario.straggler else (min(starts, default=t) + shift) / 1e9  # a delay lasts: records after it
        if not starts or not first <= t <= (max(ends) + shift) / 1e9:
            bad.append(f"member {r.member}: records do not span the fault")
    return Check("every survivor has a dump covering the fault", bool(survivors) and not bad,
                 f"{len(survivors)} survivors" + (": " + "; ".join(bad) if bad else ", each dump's records span it"))


def _stop_checks(scenario: Scenario, t: Optional[float], layout: Layout, codes: List[Optional[int]],
                 ended_at: Optional[float], trace_dir: str, run_dir: str) -> List[Check]:
    """A fault the job cannot survive: the whole job must end soon after it, the cause
    named, and every rank must leave a dump that says why it ended.  Soon: a killed
    coordinator closes its connections, so within the peer timeout; a stopped one
    answers nothing, so within the launcher's deadline for it (twice the store's),
    its poll of it (0.5 s) and its grace period; by then the ranks that waited on
    the store must have raised ``StoreUnreachable`` themselves (a fault-free step
    asks nothing of the store: a rank may have finished its steps meanwhile)."""
    from commslayer import config

    if t is None:
        return [Check("job ended with the cause named", False, "no fault was injected")]
    took = None if ended_at is None else ended_at - t
    # the job's settings, inherited from this environment
    stopped = scenario.external in UNANSWERED
    bound_s = 2 * config.store_timeout_s() + 0.5 + GRACE_S if stopped else config.peer_timeout_s()
    out = [Check(f"job ended (non-zero) within {bound_s:g}s", took is not None and took <= bound_s
                 and any(c not in (0, None) for c in codes),
                 f"every process gone {took:.3f}s after the fault; launcher exits {codes}" if took is not None
                 else "the job did not end")]
    said = _grep(os.path.join(run_dir, "job.log"), "is unreachable")
    reasons = {}
    for m in range(layout.ranks):
        try:
            reasons[m] = read_dump(os.path.join(trace_dir, f"rank{m}.json"))["reason"]
        except (OSError, TraceFileError):
            pass
    named = sorted(m for m, why in reasons.items() if "StoreUnreachable" in why)
    out.append(Check("the cause is named", said > 0 or bool(named),
                     f"launcher: '... the job's store ... is unreachable': {'yes' if said else 'no'}; ranks that raised "
                     f"StoreUnreachable themselves: {named}"))
    out.append(Check("every rank dumped its trace, saying why it ended", sorted(reasons) == list(range(layout.ranks)),
                     "; ".join(f"rank {m}: {why[:120]}" for m, why in sorted(reasons.items())) or "no dumps"))
    if stopped:  # each rank waited on the store, or in a collective on a rank that did and left, or had
        # finished: a fault-free step asks nothing of the store, so the job may train to its end first.  A
        # rank whose wait began late (after such a loss) is still waiting when the launcher, which named
        # the cause, ends the job: its dump says SIGTERM.
        others = [m for m in range(layout.ranks) if m not in named]
        out.append(Check("ranks waiting on the store raised StoreUnreachable, the others lost such a rank, "
                         "had finished or were ended by the launcher that named the store",
                         bool(named) and all("PeerLost" in reasons.get(m, "") or reasons.get(m) == "exit"
                                             or (reasons.get(m) == "SIGTERM" and said > 0) for m in others),
                         f"StoreUnreachable: ranks {named}; the others: "
                         + "; ".join(f"rank {m}: {reasons.get(m, 'no dump')[:80]}" for m in others) + "; first: "
                         + next((why[why.find('StoreUnreachable'):][:300] for m, why in sorted(reasons.items())
                                 if m in named), "none")))
    return out


BUG_STOP_S = 10.0  # a deterministic failure ends the whole job within this


def _bug_checks(t: Optional[float], layout: Layout, codes: List[Optional[int]], ended_at: Optional[float],
                trace_dir: str, run_dir: str) -> List[Check]:
    """A bug, not a fault (``commslayer.train.failures``): the whole job must end soon (the launcher
    sees the record at its next poll and ends every process), exit 1 with one line naming the
    failing rank and the step, with every rank of the first life dumped and nothing restarted."""
    if t is None:
        return [Check("job stopped on the bug", False, "no fault was injected")]
    took = None if ended_at is None else ended_at - t
    out = [Check(f"job stopped (exit 1) within {BUG_STOP_S:g}s", took is not None and took <= BUG_STOP_S
                 and any(c not in (0, None) for c in codes),
                 f"every process gone {took:.3f}s after the fault; launcher exits {codes}" if took is not None
                 else "the job did not end")]
    said = _lines(os.path.join(run_dir, "job.log"), "a deterministic failure")
    line = next((x[x.find("commslayer-run:"):].strip() for x in said if "commslayer-run:" in x), "")  # after [launcher]
    out.append(Check("the launcher names the rank and the step", " at step " in line and "rank" in line,
                     line[:300] or "no 'commslayer-run: ... a deterministic failure' line"))
    dumped = [m for m in range(layout.ranks) if os.path.exists(os.path.join(trace_dir, f"rank{m}.json"))]
    out.append(Check("every rank dumped its trace", dumped == list(range(layout.ranks)), f"dumps of ranks {dumped}"))
    restarted = [x.strip()[:120] for x in (_lines(os.path.join(run_dir, "job.log"), "starting life")
                                           + _lines(os.path.join(run_dir, "job.log"), "healed from a live replica"))]
    out.append(Check("nothing was restarted", not restarted, "; ".join(restarted) or "no restart, no heal"))
    return out


def _state_lost_checks(t: Optional[float], layout: Layout, killed: List[int], codes: List[Optional[int]],
                       ended_at: Optional[float], trace_dir: str, run_dir: str) -> List[Check]:
    """A per-rank job that lost a rank's every copy: it must end soon, the launcher with exit 1
    and its 'the job failed' line, and every survivor with a dump whose reason is ``StateLost``
    naming the rank and the job's last committed step (the same on all).  Soon: the loss is seen
    and the survivors shrink, each within the peer timeout; then the launcher grants the ranks
    its grace period (replacements it started meanwhile do not leave on their own)."""
    from commslayer import config

    if t is None:
        return [Check("job ended with the cause named", False, "no fault was injected")]
    took = None if ended_at is None else ended_at - t
    bound_s = 2 * config.peer_timeout_s() + GRACE_S
    out = [Check(f"job ended (exit 1) within {bound_s:g}s", took is not None and took <= bound_s and codes == [1],
                 f"every process gone {took:.3f}s after the fault; launcher exits {codes}" if took is not None
                 else "the job did not end")]
    failed = _lines(os.path.join(run_dir, "job.log"), "commslayer-run: the job failed:")
    out.append(Check("the launcher names the lost state", any("StateLost" in line for line in failed),
                     failed[0].strip()[:300] if failed else "no 'commslayer-run: the job failed' line"))
    reasons, steps = {}, set()
    for m in range(layout.ranks):
        if m in killed:
            continue
        try:
            reasons[m] = read_dump(os.path.join(trace_dir, f"rank{m}.json"))["reason"]
        except (OSError, TraceFileError) as exc:
            reasons[m] = f"no dump: {exc}"
        last = re.search(r"last committed step (-?\d+)", reasons[m])
        steps.add(int(last.group(1)) if last else None)
    named = all("StateLost" in why and f"rank(s) {[layout.target]}" in why for why in reasons.values())
    out.append(Check("every survivor dumped its trace, ending on StateLost with the lost rank and the last "
                     "committed step", bool(reasons) and named and len(steps) == 1 and None not in steps,
                     f"last committed step {sorted(steps, key=str)}; " + "; ".join(
                         f"rank {m}: {why[why.find('StateLost'):][:160]}" for m, why in sorted(reasons.items()))))
    return out


def _fenced(events: List[dict], recoveries: List[Recovery], results: List[RankResult], layout: Layout,
            target_pids: set, trace_dir: str, run_dir: str) -> Check:
    """The stopped rank's restart unit was dropped, and the rank never finished a step after it;
    in a per-rank job it must say it left fenced (its dump is replaced by its replacement's)."""
    stop = next(e for e in events if e["event"] == "injected" and e["action"] == "sigstop")
    resumed = stop["t"] + stop["seconds"]  # when its helper sent SIGCONT
    dropped = [r for r in recoveries if layout.unit(layout.target) in r.lost_replicas]
    finished = [r for r in results if r.pid in target_pids]
    detail = f"SIGCONT {resumed - min(r.detected_at for r in dropped):.3f}s after the survivors saw the loss" \
        if dropped else "no recovery dropped it"
    said = True
    if layout.per_rank:
        left = [line.strip() for line in _lines(os.path.join(run_dir, "job.log"), f"rank {layout.target}] leaving (")]
        said = any("CommAborted" in line and "fenced" in line for line in left)
        ended = f"it said: {left[0][:300]}" if left else "it never said it left"
    else:
        try:  # a dump shows it resumed (it dumps on the SIGTERM its torchrun sent); none: killed while stopped
            ended = f"its dump says it ended on: {read_dump(os.path.join(trace_dir, f'rank{layout.target}.json'))['reason']}"
        except (OSError, TraceFileError):
            ended = "it left no dump (ended while stopped)"
    return Check("the stopped rank was fenced", bool(dropped) and not finished and said,
                 f"{detail}; {'it' if layout.per_rank else 'its replica group'} was dropped at step(s) "
                 f"{[r.step for r in dropped]}; "
                 f"the stopped process {'finished (WRONG)' if finished else 'never finished a step after it'}; "
                 f"{ended}")


def _diagnose(trace_dir: str, layout: Layout, scenario: Scenario) -> Dict[str, Any]:
    """The viewer's verdict on the job's traces: its culprits, or the ranks its recovery story lost."""
    try:
        scan = analysis.JobScan([trace_dir], skip_bad=True)
        d = analysis.diagnose(scan)
    except (TraceFileError, OSError, ValueError) as exc:
        return {"headline": f"no diagnosis: {exc}", "culprits": []}
    # a job that recovered has no culprit: the viewer names the rank as lost in its recovery story
    lost = [r for loss in d["recovery"]["losses"] for r in loss["lost"]]
    out = {"headline": d["headline"], "culprits": d["culprits"] + lost, "ok": d["ok"]}
    if scenario.straggler:
        top = analysis.summary(scan)["straggler"]
        out["straggler"] = None if top is None else top["rank"]
        out["straggler_line"] = analysis.straggler_line(top)
    return out


def _mismatch_raised(trace_dir: str, layout: Layout) -> Check:
    """Every member of the target's replica group recorded a CollectiveMismatch naming it."""
    group = range(layout.target - layout.target % layout.per_replica,
                  layout.target - layout.target % layout.per_replica + layout.per_replica)
    seen = {}
    for m in group:
        try:
            doc = read_dump(os.path.join(trace_dir, f"rank{m}.json"))
        except (OSError, TraceFileError):
            continue
        errs = [r["error"].split(" [communicator")[0] for r in doc["records"]
                if r.get("error") and "disagree" in r["error"]]
        if errs:
            seen[m] = errs[0]
    named = all(f"vs rank {layout.target % layout.per_replica}" in e for e in seen.values())
    return Check("CollectiveMismatch on every member, naming the rank", sorted(seen) == list(group) and named,
                 "; ".join(f"rank {m}: {e[:160]}" for m, e in sorted(seen.items())) or "none recorded")


def _step_times(results: List[RankResult], injected: List[dict]) -> str:
    r = longest(results) if results else None
    if r is None or not injected or injected[0].get("step") is None:
        return "step times: n/a"
    cut = injected[0]["step"] - r.start_step
    before, after = sorted(r.step_s[:cut]), sorted(r.step_s[cut + 1:])
    if not before or not after:
        return "step times: n/a"
    b, a = before[len(before) // 2], after[len(after) // 2]
    return f"median step time {b * 1e3:.1f} ms before the cap, {a * 1e3:.1f} ms after ({a / b:.2f}x)"


def _grep(path: str, text: str) -> int:
    return len(_lines(path, text))


def _lines(path: str, text: str) -> List[str]:
    """The lines of the file at ``path`` that contain ``text`` (none: no file)."""
    try:
        with open(path, errors="replace") as f:
            return [line for line in f if text in line]
    except OSError:
        return []


# ---------------------------------------------------------------- reports
def write_reports(report: Union[Dict[str, Any], List[Dict[str, Any]]], directory: str, name: str = "report") -> None:
    """``report.json`` and ``report.md`` (one scenario's report, or a list of them)."""
    with open(os.path.join(directory, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(directory, f"{name}.md"), "w") as f:
        f.write(markdown(report if isinstance(report, list) else [report]))


def markdown(reports: List[Dict[str, Any]]) -> str:
    """The Markdown summary of one or more scenario reports."""
    lines = ["| scenario | result | injected | detection (first survivor, s) | recovery: fault to next "
             "committed step (s) | rejoined (step, heal s) |", "|---|---|---|---|---|---|"]
    for r in reports:
        if r.get("skipped"):
            lines.append(f"| {r['scenario']} | skipped: {r['skipped']} | | | | |")
            continue
        survivors = [d for d in r["detection"] if not d["mate"]]
        det = f"{survivors[0]['after_s']:.4f} ({survivors[0]['error']})" if survivors else "-"
        if r.get("ended_s") is not None:  # nothing to recover: the job had to stop
            rec = f"- (job ended {r['ended_s']:.3f}s after the fault)"
        else:
            rec = ", ".join("-" if f["stall_s"] is None else f"{f['stall_s']:.4f}"
                            for f in r["recovery"].get("per_fault", []))
        rejoined = ", ".join(f"{a['step']} ({a['heal_s']:.3f})" for a in r["recovery"].get("rejoined", [])) or "-"
        inj = "; ".join(f"{i['what']} (+{i['after_start_s']:.1f}s)" for i in r["injected"]) or "none"
        lines.append(f"| {r['scenario']} | {'PASS' if r['passed'] else 'FAIL'} | {inj} | {det} | "
                     f"{rec or '-'} | {rejoined} |")
    for r in reports:
        if r.get("skipped"):
            continue
        lines += ["", f"## {r['scenario']} ({r['family']}): {'PASS' if r['passed'] else 'FAIL'}", "",
                  f"- injected: {r['summary']}", f"- promise: {r['promise']}",
                  f"- layout: {_shape(r['layout'])}, target rank {r['layout']['target']}; {r['steps']} steps; "
                  f"wall {r['wall_s']:.1f}s",
                  f"- viewer: {r['diagnosis'].get('headline', '')}"]
        for d in r["detection"]:
            lines.append(f"- detected by rank {d['member']} (life {d['life']}{', its group mate' if d['mate'] else ''})"
                         f" after {d['after_s']:.4f}s: {d['error']} on '{d['comm']}'")
        lines.append("")
        lines.append("| check | outcome | detail |")
        lines.append("|---|---|---|")
        for c in r["checks"]:
            outcome = {True: "ok", False: "FAILED", None: "n/a"}[c["ok"]]
            lines.append(f"| {c['name']} | {outcome} | {c['detail'].replace('|', '/')} |")
        for n in r["notes"]:
            lines.append(f"\n{n}")
    return "\n".join(lines) + "\n"


def _shape(layout: Dict[str, Any]) -> str:
    if layout.get("per_rank"):
        return f"{layout['per_replica']} ranks, each its own restart unit (per-rank mode)"
    return f"{layout['replicas']} replica groups x {layout['per_replica']} ranks"


def repeated(reports: List[Dict[str, Any]]) -> str:
    """Markdown: per scenario over repeated runs, how many passed and the median and
    range of detection (first and last survivor outside the faulted group), survivor
    stall and heal times, and, for a job that had to stop, how long after the fault
    its last process was gone."""
    def spread(values: List[float]) -> str:
        if not values:
            return "-"
        v = sorted(values)
        mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
        return f"{mid:.3f} ({v[0]:.3f}-{v[-1]:.3f})"

    lines = ["| scenario | passed | detection, first survivor (s) | detection, last survivor (s) | "
             "fault to next committed step (s) | heal (s) | job ended after the fault (s) |",
             "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["scenario"] for r in reports):
        runs = [r for r in reports if r["scenario"] == name and not r.get("skipped")]
        if not runs:
            lines.append(f"| {name} | skipped | | | | | |")
            continue
        first, last, stall, heal = [], [], [], []
        ended = [r["ended_s"] for r in runs if r.get("ended_s") is not None]
        for r in runs:
            survivors = [d["after_s"] for d in r["detection"] if not d["mate"] and d["fault"] == r["injected"][0]["what"]]
            if survivors:
                first.append(min(survivors))
                last.append(max(survivors))
            if r["recovery"].get("stall_s") is not None:
                stall.append(r["recovery"]["stall_s"])
            heal += [a["heal_s"] for a in r["recovery"].get("rejoined", [])]
        lines.append(f"| {name} | {sum(r['passed'] for r in runs)}/{len(runs)} | {spread(first)} | {spread(last)} | "
                     f"{spread(stall)} | {spread(heal)} | {spread(ended)} |")
    return "\n".join(lines) + "\n"
