"""Warm spares (``commslayer-run --spares``, ``commslayer.run.spares``, ``commslayer.train.spare``,
``commslayer.run.shim``): the FSDP2 example, 4 ranks and 1 spare, real SIGKILLs and SIGSTOPs; a
lost rank's next life is the spare, the final state is bitwise the fault-free run's, and a new
spare is started.  In replica mode (2 groups of 2) the restarted group's ranks are spares, and
the replicas end bitwise identical."""

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
    after it is warm (3.2 s after its start, seen in a run of this job).  Rank 0 pauses 4 s
    between them (a delay at one step), so that a machine whose steps are faster but whose
    processes start no faster still gives the new spare that time."""
    log, _ = run_with_a_spare(tmp_path, clean, [
        {"action": "sigkill", "rank": 2, **KILLS["backward"]},
        {"action": "delay", "rank": 0, "step": FAULT_STEP + 40, "phase": "forward", "seconds": 4.0},
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


def replica_job(tmp_path, faults: List[dict], spares: int, timeout: float = 150,
                steps: int = STEPS) -> Tuple[int, str]:
    """The FSDP2 example in replica mode, 2 groups of 2, with ``spares`` warm spares and
    ``faults``, for ``steps`` steps: the launcher's exit status and its output."""
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", "2", "--nproc-per-replica", "2",
           "--max-restarts", "2", "--grace", "3", "--run-dir", str(tmp_path), "--spares", str(spares), str(EXAMPLE),
           "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMMSLAYER_TRACE_DIR": "", "COMMSLAYER_FAULTS": json.dumps(faults)}
    run = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, timeout=timeout)
    return run.returncode, run.stdout + run.stderr


def rejoined_at(log: str) -> int:
    """The step at which the killed replica group was let back in (the summary's line)."""
    found = re.search(r"summary: replica\(s\) \[1\] rejoined at step (\d+)", log)
    assert found, job_story(log)
    return int(found.group(1))


@pytest.mark.timeout(200)
def test_replica_mode_a_restarted_group_s_ranks_are_spares_and_it_is_back_while_the_job_runs(tmp_path):
    """Rank 0 of replica group 1 SIGKILLed: torchrun restarts the group, both its ranks are
    the host's two spares (commslayer.run.shim asks the launcher's desk), the group heals
    from the live one and is voting again long before the end, the replicas end bitwise
    identical, and two new spares are started.  The job is long enough for that on a fast
    machine too: its last 280 steps take 6 s or more, where a warm spare's group was back
    0.3 to 1.8 s after it was given the rank (a cold restart: longer than the 100 steps
    after the fault of the 120-step job)."""
    steps = 300
    code, log = replica_job(tmp_path, [{"action": "sigkill", "rank": 2, **KILLS["backward"]}], spares=2, steps=steps)
    assert code == 0, job_story(log)
    for rank in (0, 1):
        assert re.search(rf"coordinator: replica group 1 rank {rank}: torchrun restarted the group \(life 1\); "
                         r"spare \d \(pid \d+\) takes life 1", log), job_story(log)
        assert re.search(rf"spare \d adopted replica group 1 rank {rank} \(life 1, pid \d+\)", log), job_story(log)
    assert "starting life" not in log and f"summary: 4 rank(s) finished, every one at step {steps}: True" in log
    assert log.count("parameters and optimizer state bitwise identical across replicas [0, 1]: True") == 2, log
    assert rejoined_at(log) < steps - 20, job_story(log)
    assert "coordinator: spare 2 started" in log and "coordinator: spare 3 started" in log  # S restored
    assert "summary: warm spares: 2 used, 2 left" in log, log[-3000:]


@pytest.mark.timeout(200)
def test_replica_mode_with_fewer_spares_than_ranks_the_rest_start_cold(tmp_path):
    """One spare for a group of two: one rank is the spare, the other starts cold through
    the shim (it becomes the script); still correct."""
    code, log = replica_job(tmp_path, [{"action": "sigkill", "rank": 3, **KILLS["forward"]}], spares=1)
    assert code == 0, job_story(log)
    assert len(re.findall(r"spare 0 \(pid \d+\) takes life 1", log)) == 1, job_story(log)
    assert log.count("parameters and optimizer state bitwise identical across replicas [0, 1]: True") == 2, log
    rejoined_at(log)
    assert "summary: warm spares: 1 used, 1 left" in log, log[-3000:]


@pytest.mark.timeout(120)
def test_replica_mode_a_bug_is_never_given_to_a_spare(tmp_path):
    code, log = replica_job(tmp_path, [{"action": "raise", "rank": 2, **KILLS["backward"]}], spares=2, timeout=100)
    assert code == 1 and "summary: the job was stopped" in log, job_story(log)
    assert "takes life" not in log, job_story(log)


def test_a_spare_given_a_replica_rank_ends_with_the_shim_torchrun_watches(tmp_path):
    """The spare follows its shim's pid (commslayer.train.spare._follow): torchrun's SIGKILL
    of the shim after its grace must not leave the spare running the rank."""
    shim = subprocess.Popen(["sleep", "60"])
    follower = subprocess.Popen([sys.executable, "-c", "import sys, time; from commslayer.train.spare import _follow; "
                                 f"_follow({shim.pid}); print('following', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    assert follower.stdout.readline() == "following\n"
    shim.kill()
    shim.wait()
    assert follower.wait(timeout=10) == -signal.SIGKILL


def test_the_shim_becomes_the_script_or_stands_for_the_spare_it_is_given(tmp_path):
    """commslayer/run/shim.py against a desk played by the test: answered cold, it runs the
    script with its arguments in its own pid; given a spare, it passes torchrun's SIGTERM on
    to it and ends as the spare's exit status says (here: by SIGTERM)."""
    import socket

    from commslayer.run import shim

    script = tmp_path / "job.py"
    script.write_text("import os, sys; print('script', os.getpid(), sys.argv[1:], flush=True)\n")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "desk"))
    server.listen(4)
    env = {**os.environ, "COMMSLAYER_SPARE_DESK": str(tmp_path / "desk"), "TORCHELASTIC_RESTART_COUNT": "1"}

    def start() -> "subprocess.Popen[str]":
        return subprocess.Popen([sys.executable, "-S", shim.__file__, str(script), "--steps", "3"], env=env,
                                stdout=subprocess.PIPE, text=True)

    cold = start()
    conn, _ = server.accept()
    request = json.loads(conn.makefile("rb").readline())
    assert request["pid"] == cold.pid and request["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    conn.sendall(b'{"cold": true}\n')
    assert cold.communicate(timeout=30)[0] == f"script {cold.pid} ['--steps', '3']\n" and cold.returncode == 0
    conn.close()

    spare = subprocess.Popen(["sleep", "60"])  # stands for the spare process
    handle = start()
    conn, _ = server.accept()
    conn.makefile("rb").readline()
    conn.sendall(json.dumps({"pid": spare.pid}).encode() + b"\n")
    time.sleep(0.5)  # the shim has its handlers
    handle.send_signal(signal.SIGTERM)
    assert spare.wait(timeout=10) == -signal.SIGTERM  # passed on
    conn.sendall(json.dumps({"exit": -signal.SIGTERM}).encode() + b"\n")
    assert handle.wait(timeout=10) == -signal.SIGTERM and handle.stdout.read() == ""
    conn.close()
    server.close()


def test_the_desk_answers_what_is_not_a_shim_s_request_with_cold(tmp_path):
    """Replica mode's desk (commslayer.run.spares.Desk) treats its connections as hostile:
    garbage, a request naming a group this host does not run, one that never ends, and a
    valid one with no spare ready are each answered (cold, or closed after the deadline);
    the desk still answers afterwards."""
    import socket

    import torch.distributed as dist

    from commslayer.run.processes import ProcessSet
    from commslayer.run.spares import Desk, REQUEST_TIMEOUT_S, Spares

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = ProcessSet(1.0)
    spares = Spares(0, 0, store, procs, ["-c", "pass"], dict(os.environ), lambda line: None, speaker="test")
    desk = Desk(spares, store, {1: lambda line: None})
    try:
        def ask(payload: bytes) -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(REQUEST_TIMEOUT_S + 5)
                conn.connect(desk.path)
                conn.sendall(payload)
                return conn.makefile("rb").readline()

        shim_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
        for payload in (b"not json\n", b'{"pid": 1, "env": []}\n', b'{"pid": -3, "env": {}}\n',
                        json.dumps({"pid": 99, "env": {**shim_env, "COMMSLAYER_REPLICA": "7"}}).encode() + b"\n",
                        json.dumps({"pid": 99, "env": {**shim_env, "COMMSLAYER_REPLICA": "1"}}).encode() + b"\n"):
            assert json.loads(ask(payload)) == {"cold": True}, payload
        started = time.monotonic()
        assert ask(b'{"pid": 1') == b""  # never ends: closed at the deadline
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
        assert json.loads(ask(b"\n")) == {"cold": True}
        assert os.stat(os.path.dirname(desk.path)).st_mode & 0o077 == 0  # no other user may ask
    finally:
        desk.close()
        procs.stop()
    assert not os.path.exists(desk.path)


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
