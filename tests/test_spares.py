"""Warm spares (``commslayer-run --spares``, ``commslayer.run.spares``, ``commslayer.train.spare``):
the FSDP2 example, 4 ranks and 1 spare, real SIGKILLs and SIGSTOPs; a lost rank's next life
is the spare, the final state is bitwise the fault-free run's, and a new spare is started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Tuple

import pytest

from commslayer.run.processes import free_port
from commslayer.runs import RankResult
from tests.harness import job_story
from tests.test_peer_redundancy import (EXAMPLE, FAULT_STEP, KILLS, RANKS, STEPS, assert_same_as_clean, by_rank,
                                        clean, launch)

__all__ = ["clean"]  # the fault-free run's results, a fixture shared with test_peer_redundancy

SPARES = ["--spares", "1"]


def adopted(log: str, rank: int, spare: int) -> bool:
    """Whether the launcher said spare ``spare`` took ``rank``'s next life."""
    return re.search(rf"supervisor: rank {rank}: .*; spare {spare} \(pid \d+\) takes life", log) is not None


def run_with_a_spare(tmp_path, clean, faults: List[dict]) -> Tuple[str, Dict[int, RankResult]]:
    """The job with one spare and ``faults``: it must finish with the fault-free run's state
    (bitwise); its output (stdout first) and every rank's last life's result."""
    run = launch(tmp_path, faults, options=SPARES)
    log = run.stdout + run.stderr
    assert run.returncode == 0, job_story(log)
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log[-8000:])
    return log, results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where, target", [
    ("backward", 2),
    # the same adoption from other points of the step (also the fault harness's rank-kill-spare, in forward)
    pytest.param("forward", 0, marks=pytest.mark.slow), pytest.param("optimizer", 3, marks=pytest.mark.slow),
])
def test_a_spare_adopts_a_killed_rank_and_nothing_is_lost(clean, tmp_path, where, target):
    log, results = run_with_a_spare(tmp_path, clean, [{"action": "sigkill", "rank": target, **KILLS[where]}])
    took = re.search(rf"spare 0 \(pid (\d+)\) takes life 1", log)
    assert took and adopted(log, target, 0), log[-8000:]
    assert results[target].restart == 1 and results[target].pid == int(took.group(1))  # the spare finished it
    assert f"spare 0 adopted rank {target} (life 1" in log
    assert "supervisor: spare 1 started" in log  # S restored in the background
    assert "summary: warm spares: 1 used, 1 left" in log
    assert "starting life" not in log  # no cold start


@pytest.mark.timeout(200)
def test_two_losses_in_a_row_take_the_spare_then_its_successor(clean, tmp_path):
    """The second loss comes 95 steps after the first (about 6 s here), when the spare started
    after it is warm (3.2 s after its start, seen in a run of this job)."""
    log, _ = run_with_a_spare(tmp_path, clean, [
        {"action": "sigkill", "rank": 2, **KILLS["backward"]},
        {"action": "sigkill", "rank": 1, "step": STEPS - 5, "phase": "backward"}])
    assert adopted(log, 2, 0) and adopted(log, 1, 1), log[-8000:]
    assert "summary: warm spares: 2 used, 1 left" in log


@pytest.mark.timeout(200)
def test_a_loss_while_the_new_spare_still_starts_falls_back_to_a_cold_replacement(clean, tmp_path):
    log, _ = run_with_a_spare(tmp_path, clean, [
        {"action": "sigkill", "rank": 2, **KILLS["backward"]},
        {"action": "sigkill", "rank": 1, "step": FAULT_STEP + 1, "phase": "backward"}])
    assert adopted(log, 2, 0), log[-8000:]
    assert "supervisor: rank 1: life 0 was killed by SIGKILL; starting life 1" in log, log[-8000:]


@pytest.mark.timeout(200)
def test_a_stopped_rank_is_replaced_by_the_spare_and_fenced_when_it_resumes(clean, tmp_path):
    # The final state is the fault-free one: nothing the resumed process did got in.  Rank 0
    # pauses 4 s after the recovery (a step fault 'delay'), so the stopped process resumes
    # while the job still runs however fast the rest of it goes (a run that ended 2 s after
    # the resume left it no time to find itself fenced).
    log, _ = run_with_a_spare(tmp_path, clean, [
        {"action": "sigstop", "rank": 2, "step": FAULT_STEP, "phase": "forward", "seconds": 5.0},
        {"action": "delay", "rank": 0, "step": FAULT_STEP + 10, "phase": "forward", "seconds": 4.0}])
    assert "fault fired from COMMSLAYER_FAULTS: 4000 ms delay of rank 0" in log, log[-8000:]
    assert re.search(r"supervisor: rank 2: life 0 was found lost by the other ranks; spare 0 \(pid \d+\) takes "
                     r"life 1", log), log[-8000:]
    fenced = [line for line in log.splitlines() if line.startswith("[rank 2]") and "leaving (CommAborted" in line]
    assert fenced and "fenced" in fenced[0], log[-8000:]


@pytest.mark.timeout(120)
def test_a_bug_is_never_given_to_a_spare(tmp_path):
    """An exception of the script stops the job (commslayer.train.failures): no spare adopts it."""
    run = launch(tmp_path, [{"action": "raise", "rank": 2, **KILLS["backward"]}], options=SPARES, timeout=100)
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-8000:]
    assert "takes life" not in log and "starting life" not in log, log[-8000:]
    assert "summary: the job was stopped" in run.stdout and "summary: warm spares: 0 used, 1 left" in run.stdout


@pytest.mark.timeout(200)
def test_a_spare_that_dies_while_it_waits_is_replaced_and_costs_no_rank(clean, tmp_path):
    """SIGKILL the first spare while it waits: it is started again, no rank restarts, and the
    second spare adopts the rank lost later."""
    faults = [{"action": "sigkill", "rank": 1, "step": STEPS - 20, "phase": "backward"}]
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", str(RANKS), "--max-restarts", "2",
           "--grace", "3", "--run-dir", str(tmp_path), *SPARES, str(EXAMPLE), "--steps", str(STEPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMMSLAYER_TRACE_DIR": "", "COMMSLAYER_FAULTS": json.dumps(faults)}
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    killed = threading.Event()

    def kill_spare(pid: int) -> None:
        time.sleep(1.0)  # it is importing torch or already waiting: either way a spare, not a rank
        os.kill(pid, signal.SIGKILL)
        killed.set()

    for line in proc.stdout:
        lines.append(line)
        found = re.match(r"supervisor: spare 0 started \(pid (\d+)\)", line)
        if found:
            threading.Thread(target=kill_spare, args=(int(found.group(1)),), daemon=True).start()
    code = proc.wait(timeout=30)
    log = "".join(lines)
    assert killed.is_set() and code == 0, job_story(log)
    # killed while it waited, or (on a loaded machine) while it still imported torch: no rank either way
    assert re.search(r"supervisor: spare 0 \(pid \d+\) exited with -9 (while it waited|before it reached "
                     r"resilience\.init\(\)); it held no rank", log), log
    assert adopted(log, 1, 1), log[-8000:]
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log[-8000:])
    assert [r for r, res in results.items() if res.restart] == [1]  # only the rank the fault killed restarted
    assert "summary: warm spares: 1 used, 1 left" in log


def test_spares_are_refused_in_replica_mode(tmp_path):
    run = subprocess.run([sys.executable, "-m", "commslayer.run.launcher", "--replicas", "2", "--spares", "1",
                          str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "--spares is for per-rank mode" in run.stderr


@pytest.mark.timeout(200)
def test_each_host_keeps_its_own_spares_and_gives_them_to_its_own_ranks(clean, tmp_path):
    """Two launchers as two hosts (2 ranks and 1 spare each): rank 3, on node 1, is killed;
    node 1's spare takes it; the coordinator's summary counts both hosts' spares."""
    faults = [{"action": "sigkill", "rank": 3, **KILLS["backward"]}]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMMSLAYER_TRACE_DIR": "", "COMMSLAYER_FAULTS": json.dumps(faults)}
    common = [sys.executable, "-m", "commslayer.run.launcher", "--nnodes", "2", "--nproc-per-node", "2",
              "--max-restarts", "2", "--grace", "3", *SPARES]
    script = [str(EXAMPLE), "--steps", str(STEPS)]
    pipes = dict(env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    coordinator = subprocess.Popen([*common, "--port", str(port), "--run-dir", str(tmp_path), *script], **pipes)
    other = subprocess.Popen([*common, "--coordinator", f"127.0.0.1:{port}", "--node-rank", "1", "--run-dir",
                              str(tmp_path), *script], **pipes)
    outs = [p.communicate(timeout=180)[0] for p in (other, coordinator)]
    log = "\n".join(outs)
    assert (other.returncode, coordinator.returncode) == (0, 0), job_story(log)
    assert adopted(outs[0], 3, 0) and "takes life" not in outs[1], log[-8000:]  # node 1's own spare
    assert_same_as_clean(by_rank(tmp_path), clean, log[-8000:])
    assert "summary: warm spares: 1 used, 2 left" in outs[1], outs[1][-4000:]
