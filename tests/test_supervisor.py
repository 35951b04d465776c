"""``commslayer-run`` in per-rank mode (no ``--replicas``): every rank its own restart unit.

The ranks are tests/jobs/rank_unit_job.py: no collectives, only their environment,
the job's store and files, so each test checks the launcher's side of the store
contract (commslayer/run/supervisor.py) with real processes in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Dict

import pytest
import torch.distributed as dist

from commslayer import runs
from commslayer.run.launch import summarize
from commslayer.run.processes import free_port
from commslayer.runs import Recovery
from tests.test_launcher import LAUNCHER, launch, tagged

JOB = str(Path(__file__).resolve().parent / "jobs" / "rank_unit_job.py")


def envs(out: Path) -> Dict[str, dict]:
    """Every life's environment, by file name (``rank<r>-life<n>``)."""
    return {p.stem: json.loads(p.read_text()) for p in out.glob("rank*-life*.json")}


def run(tmp_path: Path, scenario: str, *args: str, timeout: float = 90):
    out = tmp_path / "out"
    out.mkdir()
    began = time.monotonic()
    proc, tag = launch(["--nproc-per-node", "3", *args, JOB, scenario, str(out)], cwd=tmp_path, timeout=timeout)
    return proc, tag, out, time.monotonic() - began


@pytest.mark.timeout(120)
def test_three_ranks_get_their_environment(tmp_path):
    proc, tag, out, _ = run(tmp_path, "exit", "--run-dir", "rundir")
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 0, log
    got = envs(out)
    assert sorted(got) == ["rank0-life0", "rank1-life0", "rank2-life0"], log
    store = got["rank0-life0"]["COMMSLAYER_JOB_STORE"]
    host, _, port = store.rpartition(":")
    run_dir = str(tmp_path / "rundir")
    for r in range(3):
        assert got[f"rank{r}-life0"] == {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0",
            "MASTER_ADDR": host, "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0",
            "COMMSLAYER_JOB_STORE": store, "COMMSLAYER_RESTART_UNIT": "rank", "COMMSLAYER_NODE": "0",
            "COMMSLAYER_JOB_RANK": str(r), "OMP_NUM_THREADS": "1", "COMMSLAYER_RUN_DIR": run_dir,
            "COMMSLAYER_TRACE_DIR": "",  # set empty by the test: the launcher leaves it alone
            "COMMSLAYER_FAULTS_LOG": os.path.join(run_dir, "faults.jsonl"),
            "COMMSLAYER_REPLICA": None, "COMMSLAYER_REPLICAS": None}, log
    assert "for 3 rank(s), 3 on each of 1 host(s)" in proc.stdout, log
    assert "summary: no result files in" in proc.stdout, log
    assert not tagged(tag)


@pytest.mark.timeout(120)
def test_a_failed_rank_is_restarted_alone(tmp_path):
    proc, tag, out, _ = run(tmp_path, "fail-once")
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 0, log
    got = envs(out)
    assert sorted(got) == ["rank0-life0", "rank1-life0", "rank1-life1", "rank2-life0"], log
    assert got["rank1-life1"]["TORCHELASTIC_RESTART_COUNT"] == "1" and got["rank1-life1"]["RANK"] == "1"
    assert "supervisor: rank 1: life 0 exited with status 1; starting life 1 (restart 1 of 3)" in proc.stdout, log
    assert proc.stderr == ""
    assert not tagged(tag)


@pytest.mark.timeout(120)
def test_a_rank_found_lost_is_replaced_while_its_old_life_still_exists(tmp_path):
    """Rank 1's life 0 stops itself; rank 0 writes ``rank/1/lost/0``: life 1 starts while
    life 0 is still there (stopped), and life 0 is ended with the rest at the end."""
    proc, tag, out, wall = run(tmp_path, "stop", "--grace", "30")
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 0, log
    seen = json.loads((out / "life0-seen-by-life1").read_text())
    assert seen["state"] == "T" and seen["pid"] != seen["me"], seen  # both alive at once, life 0 stopped
    assert sorted(envs(out)) == ["rank0-life0", "rank1-life0", "rank1-life1", "rank2-life0"], log
    assert "rank 1: life 0 was found lost by the other ranks; starting life 1" in proc.stdout, log
    assert not tagged(tag)  # life 0 (stopped) included
    assert wall < 25, wall  # the stopped life is ended by SIGTERM + SIGCONT, not by SIGKILL after the 30 s grace


@pytest.mark.timeout(120)
def test_a_rank_without_restarts_left_is_gone(tmp_path):
    proc, tag, out, _ = run(tmp_path, "always-fail", "--max-restarts", "1")
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 1, log
    assert sorted(envs(out)) == ["rank0-life0", "rank1-life0", "rank1-life1", "rank2-life0"], log
    assert (out / "gone").read_text() == "life 1 exited with status 1", log  # rank 0 read rank/1/gone
    lines = proc.stderr.splitlines()
    assert lines == ["commslayer-run: rank(s) [1] gave up (no restart left after --max-restarts 1 per rank); "
                     "their output is above"], log
    assert "supervisor: rank 1 is gone: life 1 exited with status 1, and no restart is left" in proc.stdout, log
    assert not tagged(tag)


@pytest.mark.timeout(120)
def test_job_failed_ends_the_job_after_the_grace(tmp_path):
    """Rank 0 writes ``job/failed``: rank 2 exits on its own within the grace, rank 1
    (asleep for 30 s) is ended after it; one line with the reason, exit 1."""
    proc, tag, out, wall = run(tmp_path, "job-failed", "--grace", "6")
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 1, log
    assert proc.stderr.splitlines() == ["commslayer-run: the job failed: rank 0 found that the job cannot go on"], log
    assert (out / "rank2-dumped").exists(), log
    assert "rank_unit_job: rank 1 was not ended" not in proc.stdout, log
    assert wall < 28, wall  # rank 1 would sleep 30 s
    assert not tagged(tag)


@pytest.mark.parametrize("args,says", [
    (["--replicas", "2", "--nproc-per-node", "2"], "--nproc-per-node is for per-rank mode (without --replicas)"),
    (["--replicas", "2", "--node-rank", "0"], "--node-rank is for per-rank mode"),
    (["--replica-ids", "0"], "--replica-ids is for replica mode: give --replicas too"),
    (["--nproc-per-replica", "2"], "--nproc-per-replica is for replica mode"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0: a host needs at least 1 rank"),
    (["--nnodes", "2", "--node-rank", "2", "--coordinator", "127.0.0.1:29600"], "--node-rank 2: a host's place is"),
    (["--nnodes", "2", "--node-rank", "1"], "--node-rank 1 joins the job's coordinator: give --coordinator"),
    (["--nnodes", "2", "--coordinator", "127.0.0.1:29600"], "the coordinator runs node rank 0's ranks"),
])
def test_mixing_the_modes_is_one_line_and_exit_2(tmp_path, args, says):
    proc, tag = launch([*args, JOB, "exit", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("commslayer-run: error: ") and says in lines[0], proc.stderr
    assert proc.stdout == ""
    assert not tagged(tag)


def test_the_summary_of_a_per_rank_run(tmp_path, capsys):
    """One copy of each shard: no cross-replica comparison; a fault names its rank and
    its stall comes from the recovery that lost that rank."""
    for r in range(3):
        runs.save(runs.RankResult(member=r, replica=0, rank=r, restart=int(r == 1), pid=100 + r, started=1.0,
                                  steps=4, start_step=2 if r == 1 else 0, elapsed_s=0.2,
                                  step_s=[0.1] * (2 if r == 1 else 4), losses={s: 1.0 for s in range(4)},
                                  optimizer_steps=[4], live=[0], fingerprints=[7 + r]), str(tmp_path))
    (tmp_path / runs.FAULT_LOG).write_text(json.dumps({"event": "injected", "member": 1, "t": 10.0,
                                                       "what": "SIGKILL of rank 1"}) + "\n")
    store = dist.HashStore()
    runs.record(store, Recovery(2, [1], 1, 10.1, 10.2, 10.5))
    assert summarize(str(tmp_path), store, 3, None, 0.05, per_rank=True)
    out = capsys.readouterr().out
    assert "summary: fault: SIGKILL of rank 1 (rank 1); survivor stall (fault to next committed step) 0.500s" in out
    assert "identical across replicas" not in out
    assert runs.load_summary(str(tmp_path)).killed[0]["rank"] == 1


@contextmanager
def two_hosts(tmp_path: Path, scenario: str, per_node: int, other_env: Dict[str, str]):
    """Two launchers on this machine, as two hosts: the coordinator (node 0) and one with
    ``--coordinator`` and ``--node-rank 1``; yields them (each one's stdout and stderr
    piped, text), the ranks' output directory, the store's port and the launch's tag.
    Whatever still runs at the end is ended."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_TEST_TAG=tag)
    common = [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", str(per_node)]
    pipes = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    coordinator = subprocess.Popen([*common, "--port", str(port), JOB, scenario, str(out)], env=env, **pipes)
    other = subprocess.Popen([*common, "--coordinator", f"127.0.0.1:{port}", "--node-rank", "1", JOB, scenario,
                              str(out)], env=dict(env, **other_env), **pipes)
    try:
        yield coordinator, other, out, port, f"COMMSLAYER_TEST_TAG={tag}".encode()
    finally:
        coordinator.send_signal(signal.SIGCONT)
        for p in (other, coordinator):
            if p.poll() is None:
                p.terminate()
            p.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_two_hosts_one_coordinator(tmp_path):
    """The coordinator runs node 0's ranks, the other launcher node 1's; ranks and node
    numbers span the job."""
    with two_hosts(tmp_path, "exit", 2, {}) as (coordinator, other, out, port, tag):
        logs = [p.communicate(timeout=90) for p in (other, coordinator)]
    assert (other.returncode, coordinator.returncode) == (0, 0), logs
    got = envs(out)
    assert sorted(got) == [f"rank{r}-life0" for r in range(4)], logs
    assert [(got[f"rank{r}-life0"]["LOCAL_RANK"], got[f"rank{r}-life0"]["COMMSLAYER_NODE"],
             got[f"rank{r}-life0"]["GROUP_RANK"], got[f"rank{r}-life0"]["WORLD_SIZE"]) for r in range(4)] == \
        [("0", "0", "0", "4"), ("1", "0", "0", "4"), ("0", "1", "1", "4"), ("1", "1", "1", "4")]
    assert {e["COMMSLAYER_JOB_STORE"] for e in got.values()} == {f"127.0.0.1:{port}"}
    assert not tagged(tag)


@pytest.mark.timeout(120)
def test_a_host_whose_coordinator_stops_answering_ends_its_ranks(tmp_path):
    """The coordinator's launcher is SIGSTOPped: the other host's launcher finds its store
    unreachable (after twice ``COMMSLAYER_STORE_TIMEOUT_S``), says so in one line, exits 1
    and ends its rank."""
    with two_hosts(tmp_path, "sleep", 1, {"COMMSLAYER_STORE_TIMEOUT_S": "1"}) as (coordinator, other, out, port, tag):
        deadline = time.monotonic() + 60
        while not (out / "rank1-life0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / "rank1-life0.json").exists()
        coordinator.send_signal(signal.SIGSTOP)
        began = time.monotonic()
        _, err = other.communicate(timeout=60)
        stalled = time.monotonic() - began
    assert other.returncode == 1, err
    [line] = err.splitlines()
    assert line.startswith(f"commslayer-run: the coordinator (the job's store at 127.0.0.1:{port}) is unreachable "
                           f"(the store at 127.0.0.1:{port} did not answer within 2s") and \
        line.endswith("; ended the processes started here"), err
    assert stalled < 20, stalled  # 2 s deadline, then SIGTERM to a sleeping rank
    assert not tagged(tag)
