"""The fault-injection harness, run as users run it: ``commslayer-faults`` against the
resilient training job at world size 4, one real fault per scenario.

Each fast scenario must pass every check the harness makes (faults fired, survivors'
state bitwise identical, every step applied once, dumps covering the fault, the
viewer's verdict, nothing left behind); the network scenarios need root and run with
``-m slow``.  The checks themselves are tested against runs that break them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from faults.harness import Layout, state_checks
from faults.inject import Fault, decode, encode
from faults.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent


def faults_cli(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "faults.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def run_scenario(name: str, out: Path) -> dict:
    proc = faults_cli("run", name, "--out", str(out))
    if "SKIPPED" in proc.stdout:
        pytest.skip(proc.stdout.split("SKIPPED", 1)[1].strip().splitlines()[0])
    report = json.loads((out / name / "report.json").read_text())
    failed = [c for c in report["checks"] if c["ok"] is False]
    assert proc.returncode == (0 if report["passed"] else 1), proc.stdout[-2000:]
    assert report["passed"] and not failed, (failed, proc.stdout[-3000:], report["notes"])
    return report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if s.fast])
def test_fast_scenario_passes(name, tmp_path):
    report = run_scenario(name, tmp_path)
    assert (tmp_path / name / "report.md").read_text().startswith("| scenario |")
    scenario = next(s for s in SCENARIOS if s.name == name)
    if scenario.expect == "survive" and not scenario.straggler:
        # Every fault was survived, and the survivors saw each one (generous bound: speed is a benchmark's).
        assert all(f["stall_s"] is not None and f["stall_s"] < 10 for f in report["recovery"]["per_fault"])
        assert report["detection"] and all(d["after_s"] < 10 for d in report["detection"])
    if scenario.expect == "stop":
        # The ranks named the cause themselves (their fault log): the store's failure, or the loss of a
        # rank that left because of it; a stopped store (no reset) is found by the store deadline.
        errors = {d["error"] for d in report["detection"]}
        assert errors and errors <= {"PeerLost", "StoreUnreachable"}, report["detection"]
        if scenario.external == "coordinator-stop":
            assert "StoreUnreachable" in errors, report["detection"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS if not s.fast])
def test_network_scenario_passes(name, tmp_path):
    run_scenario(name, tmp_path)


def test_list_names_every_scenario():
    proc = faults_cli("list", timeout=60)
    assert proc.returncode == 0
    assert [line.split()[0] for line in proc.stdout.splitlines()] == [s.name for s in SCENARIOS]


@pytest.mark.parametrize("args,says", [
    (["no-such-fault"], "unknown scenario"),
    (["kill-step", "--rank", "9"], "the job has ranks 0..3"),
    (["kill-collective", "--op", "allreduce"], "op 'allreduce': expected one of all_reduce"),
    (["kill-step", "--ranks", "5"], "do not make 2 or more replica groups"),
])
def test_bad_arguments_are_usage_errors(args, says):
    proc = faults_cli("run", *args, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr


@pytest.mark.timeout(200)
def test_a_job_that_does_not_survive_fails_the_run(tmp_path):
    """A job that dies at start: no fault fires, nothing finishes; the run says so and exits 1."""
    job = tmp_path / "broken.py"
    job.write_text("import sys\nsys.exit(3)\n")
    proc = faults_cli("run", "exit", "--out", str(tmp_path / "out"), "--job", str(job), "--timeout", "150")
    assert proc.returncode == 1, proc.stdout[-2000:]
    report = json.loads((tmp_path / "out" / "exit" / "report.json").read_text())
    failed = {c["name"] for c in report["checks"] if c["ok"] is False}
    assert {"faults injected", "every rank finished every step", "job finished"} <= failed, failed
    assert "FAIL" in (tmp_path / "out" / "exit" / "report.md").read_text()


def test_state_checks_catch_a_skipped_step_and_diverged_state():
    good = [{"member": m, "rank": m % 2, "start_step": 0, "step_s": [0.1] * 4, "optimizer_steps": [4, 4],
             "losses": {str(s): 1.0 for s in range(4)}, "fingerprints": [7 + m % 2, 7 + m % 2]} for m in range(4)]
    layout = Layout(2, 2)
    assert all(c.ok for c in state_checks(good, 4, layout))
    skipped = [dict(r) for r in good]
    skipped[3] = dict(skipped[3], optimizer_steps=[3, 3])
    diverged = [dict(r) for r in good]
    diverged[2] = dict(diverged[2], fingerprints=[7, 9])
    assert [c.name for c in state_checks(skipped, 4, layout) if not c.ok] == ["no step applied twice or skipped"]
    assert [c.name for c in state_checks(diverged, 4, layout) if not c.ok] == \
        ["state bitwise identical across replicas"]


def test_fault_specs_round_trip_and_reject_bad_input():
    faults = [Fault("sigkill", 3, step=10, phase="forward"),
              Fault("mismatch", 1, op="all_reduce", comm="c10d", nth=5, mismatch="dtype")]
    assert decode(encode(faults)) == faults
    with pytest.raises(ValueError, match="action"):
        Fault("explode", 0, step=1, phase="forward")
    with pytest.raises(ValueError, match="not both"):
        Fault("sigkill", 0, step=1, phase="forward", op="all_reduce")
    with pytest.raises(ValueError, match="mismatch"):
        Fault("mismatch", 0, op="broadcast", mismatch="op")
    with pytest.raises(ValueError, match="delay"):
        Fault("sigkill", 0, op="*")
