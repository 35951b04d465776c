"""The resilient HSDP job end to end: commslayer-run starts a coordinator and one torchrun per
replica group (2 x 2 ranks), launch/train.py trains, a rank is SIGKILLed at a chosen point of
a step, its torchrun restarts the group, which heals and rejoins.

Every check reads what the ranks wrote (their result files), not the launcher's verdict:
state bitwise identical across replicas (parameters and AdamW state), every optimizer
applied exactly the asked-for number of steps, the loss curve equal to the fault-free run's
before the fault and close to it after, and against plain c10d Gloo the same losses bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from commslayer.run.launch import compare_losses
from commslayer.run.processes import descendants
from commslayer.runs import load_results, load_summary, longest
from faults.harness import Layout, state_checks
from faults.netns import Network

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", "2", "--nproc-per-replica", "2"]
TRAIN = str(ROOT / "launch" / "train.py")

STEPS = 14
FAULT_STEP = 5
TINY = ["--steps", str(STEPS), "--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--vocab", "64",
        "--heal-timeout", "60"]


def launch(run_dir: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    cmd = [*LAUNCHER, "--run-dir", str(run_dir), TRAIN, *TINY, *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def losses_of(run_dir: Path) -> Dict[int, float]:
    return longest(load_results(str(run_dir))).losses


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("clean")
    proc = launch(run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def check_invariants(run_dir: Path, proc: subprocess.CompletedProcess, steps: int = STEPS) -> List[dict]:
    """The fault harness's checks: every rank of both groups at the end (the healed ones
    included), no step applied twice or skipped (AdamW counted every applied step),
    state bitwise identical across the replicas."""
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    done = load_results(str(run_dir))
    failed = [c for c in state_checks(done, steps, Layout(2, 2)) if not c.ok]
    assert not failed, (failed, log)
    assert all(r.live == [0, 1] for r in done), log
    return done


def test_plain_gloo_and_commslayer_give_the_same_losses(clean, tmp_path):
    proc = launch(tmp_path, "--plain")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plain = min(load_results(str(tmp_path)), key=lambda r: r.member)
    assert plain.losses == losses_of(clean)


@pytest.mark.parametrize("phase,replica,rank", [
    ("backward", 0, 0),     # inside backward: the mate fails in its group's FSDP2 collective and leaves too
    ("optimizer", 1, 1),    # after the step was committed, before this rank applied it
    # also the fault harness's cascade (its first fault, in forward) and bench_training's smoke (entering the average)
    pytest.param("forward", 1, 0, marks=pytest.mark.slow),  # inside the forward pass of the last block
    # entering the gradient average over the replicas (replica 0 holds world rank 0)
    pytest.param("allreduce", 0, 1, marks=pytest.mark.slow),
])
def test_a_killed_replica_group_is_survived_healed_and_loses_nothing(clean, tmp_path, phase, replica, rank):
    proc = launch(tmp_path, "--kill", f"{replica}:{FAULT_STEP}:{phase}:{rank}")
    done = check_invariants(tmp_path, proc)
    summary = load_summary(str(tmp_path))
    assert [(k["replica"], k["step"], k["phase"]) for k in summary.killed] == [(replica, FAULT_STEP, phase)]
    # The survivors recovered once, from the step the fault hit (the next one when the kill
    # came after the commit), and the group came back.
    whole = longest(done)
    assert whole.replica != replica
    [rec] = whole.recoveries
    assert rec.step == (FAULT_STEP + 1 if phase == "optimizer" else FAULT_STEP)
    assert rec.lost_replicas == [replica]
    assert rec.committed_at - summary.killed[0]["t"] < 3.0  # generous: speed is the benchmark's
    assert [a.replicas for a in whole.admissions] == [[replica]]
    restarted = [r for r in done if r.replica == replica]
    assert all(r.restart == 1 and r.start_step > FAULT_STEP for r in restarted)
    # Same seeds: identical losses before the fault, close after it.
    assert compare_losses(losses_of(tmp_path), losses_of(clean), FAULT_STEP, 0.05, str(clean))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2")
def test_replica_groups_on_separate_hosts(tmp_path):
    """Three network-namespace hosts: the coordinator on one, a replica group on each of the
    others, every launcher pointed at the coordinator's address; replica group 1 is killed."""
    with Network(3, "cstr") as net:
        coordinator = f"{net.address(1, 0)}:29650"
        env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", GLOO_SOCKET_IFNAME="eth0")
        env.pop("COMMSLAYER_LIVENESS_HOST", None)
        base = [*LAUNCHER, "--run-dir", str(tmp_path)]
        procs = [subprocess.Popen(net.run(0, [*base, "--replica-ids", "none", "--host", net.address(1, 0),
                                              "--port", "29650"]), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
        for replica in (0, 1):
            procs.append(subprocess.Popen(
                net.run(replica + 1, [*base, "--replica-ids", str(replica), "--coordinator", coordinator, TRAIN,
                                      *TINY, "--kill", f"1:{FAULT_STEP}:allreduce"]),
                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            outs = [p.communicate(timeout=150)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        log = "\n".join(o[-3000:] for o in outs)
        assert [p.returncode for p in procs] == [0, 0, 0], log
    done = check_invariants(tmp_path, subprocess.CompletedProcess([], 0, log, ""))
    whole = longest(done)
    assert [r.lost_replicas for r in whole.recoveries] == [[1]]
    assert "summary: shard 0: parameters and optimizer state bitwise identical across replicas [0, 1]: True" in outs[0]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_twenty_faults(tmp_path):
    """20 kills, alternating replica groups, ranks and phases, each as soon as the job is
    whole again: every one survived and healed, nothing lost."""
    phases = ["forward", "backward", "allreduce", "optimizer"]
    kills = [f"{i % 2}:{3 + 3 * i}:{phases[i % 4]}:{(i // 2) % 2}" for i in range(20)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    steps = 6000  # enough for 20 restarts (several seconds each) at a few hundredths of a second per step
    args = [a if a != str(STEPS) else str(steps) for a in TINY]
    cmd = [*LAUNCHER, "--max-restarts", "12", "--crash-loop", "off", "--run-dir", str(tmp_path), TRAIN, *args]
    for k in kills:
        cmd += ["--kill", k]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1100)
    (tmp_path / "launcher.log").write_text(proc.stdout + proc.stderr)  # the whole story, for a failure
    done = check_invariants(tmp_path, proc, steps)
    summary = load_summary(str(tmp_path))
    assert len(summary.killed) == 20, summary.killed
    # Every replica group was killed ten times, and came back each time: the ranks that
    # finished are the tenth restart of their group.
    assert sorted(r.restart for r in done) == [10, 10, 10, 10], [(r.member, r.restart) for r in done]
    # The job's store has a recovery for every kill, and an admission after each.
    assert len(summary.recoveries) == 20 and len(summary.admissions) == 20
    assert all(k["stall_s"] is not None for k in summary.killed), summary.killed


# SIGTERM (and SIGHUP) take the launcher's SIGINT handler: the same path as Ctrl-C
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_the_launcher_ends_every_process_it_started(tmp_path, sig):
    """Ctrl-C (or SIGTERM) to the launcher mid-run: no torchrun agent or worker is left.
    SIGUSR1 before it only prints the launcher's stacks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    cmd = [*LAUNCHER, "--run-dir", str(tmp_path), TRAIN, *TINY[:-2], "--steps", "100000"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: List[int] = []
    left: List[int] = []
    try:
        for line in proc.stdout:  # wait until the job is training
            if "step    2" in line:
                break
        started = descendants(proc.pid)
        assert started, "no processes started"
        proc.send_signal(signal.SIGUSR1)  # the launcher prints its stacks and goes on
        for line in proc.stdout:
            if line.rstrip().endswith(" in _supervise"):
                break
        assert proc.poll() is None
        proc.send_signal(sig)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # the launcher prints its stacks
            time.sleep(1)
            where = _where(proc.pid)
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"the launcher had not ended 30 s after {sig.name}:\n{where}\n"
                        f"its output ended with:\n{out[-6000:]}")
        assert proc.returncode == 130, out[-2000:]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and set(started) & set(descendants(1)):
            time.sleep(0.1)
        alive = set(descendants(1))  # every live process but init
        left = [p for p in started if p in alive]
        assert not left, left
    finally:
        # Nothing outlives a failed run; what ended is not signalled (its pid may be another's now).
        if proc.returncode != 130:
            left = started
        for pid in {*descendants(proc.pid), *left}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


def _where(pid: int) -> str:
    """What a process and those below it are doing: state and kernel wait channel
    of each, and of each of the first one's threads."""
    def line(path: str, name: str) -> str:
        try:
            with open(f"{path}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{path}/wchan") as f:
                return f"{name}: {state} {f.read() or '-'}"
        except OSError:
            return f"{name}: gone"
    lines = [line(f"/proc/{pid}/task/{t}", f"launcher thread {t}") for t in sorted(os.listdir(f"/proc/{pid}/task"))]
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            cmd = "?"
        lines.append(line(f"/proc/{child}", f"{child} {cmd}"))
    return "\n".join(lines)


def test_fsdp_overlap_in_the_resilient_job(clean, tmp_path):
    """fsdp_overlap's reduce-scatter communicator lives inside a replica group (split from the
    group's c10d communicator, whose ranks are the job's): the job survives a kill with it,
    and its gradients are those of plain FSDP2, so the losses before the fault are the
    fault-free run's bit for bit."""
    proc = launch(tmp_path, "--overlap", "--kill", f"1:{FAULT_STEP}:allreduce")
    check_invariants(tmp_path, proc)
    assert compare_losses(losses_of(tmp_path), losses_of(clean), FAULT_STEP, 0.05, str(clean))
