"""The public resilience API (``commslayer.resilience``) on users' scripts, launched
the way a user launches them: real torchruns, real SIGKILLs, real sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from commslayer.runs import RankResult, load_results, longest
from faults.harness import Layout, state_checks
from tests.harness import job_story

ROOT = Path(__file__).resolve().parent.parent
MISUSE = ROOT / "tests" / "jobs" / "misuse_job.py"
AT, OUTSIDE = " at step 0 with ", " outside the training loop with "  # where the launcher says a mistake was made


def launch(script: Path, *script_args: str, replicas: int = 2, per_replica: int = 1, restarts: int = 0,
           run_dir: str = "", env: dict = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``commslayer-run`` on ``script``, from a directory outside the repository; its whole
    output (the ranks' included)."""
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", str(replicas), "--nproc-per-replica",
           str(per_replica), "--max-restarts", str(restarts)]
    if run_dir:
        cmd += ["--run-dir", run_dir]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", **(env or {}))
    return subprocess.run([*cmd, str(script), *script_args], env=full_env, cwd="/", capture_output=True,
                          text=True, timeout=timeout)


EXAMPLES = {"fsdp2": ROOT / "launch" / "examples" / "fsdp2_resilient.py",
            "ddp": ROOT / "launch" / "examples" / "ddp_resilient.py"}
# the steps are short (DDP ~15 ms, FSDP2 ~35 ms here): a killed group restarts and heals well before the end
STEPS, FAULT_STEP = {"fsdp2": 800, "ddp": 1500}, 20
CLEAN_STEPS = 60  # the fault-free references: their losses before the fault step, and 40 steps averaged late


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Dict[str, List[RankResult]]:
    out = {}
    for name, script in EXAMPLES.items():
        run_dir = tmp_path_factory.mktemp(f"clean-{name}")
        run = launch(script, "--steps", str(CLEAN_STEPS), per_replica=2, restarts=2, run_dir=str(run_dir))
        assert run.returncode == 0, job_story(run.stdout + run.stderr)
        assert "no rank called job.finish()" not in run.stdout
        out[name] = load_results(str(run_dir))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example, phase, member", [
    ("fsdp2", "forward", 2),     # replica 1's rank 0, entering its forward pass
    # replica 1's rank 1, after the commit, before applying it; in the default suite through
    # train.py (tests/test_training.py), as is the next
    pytest.param("fsdp2", "optimizer", 3, marks=pytest.mark.slow),
    # replica 0's rank 0 (world rank 0), inside backward; in the default suite through
    # bench_resilience.py --smoke (tests/test_benchmarks.py), whose launcher summary checks the
    # replicas bitwise and the rejoin
    pytest.param("ddp", "backward", 0, marks=pytest.mark.slow),
    pytest.param("ddp", "allreduce", 1, marks=pytest.mark.slow),  # replica 0's rank 1, entering the average
])
def test_a_users_script_survives_a_killed_replica_group(clean, tmp_path, example, phase, member):
    fault = [{"action": "sigkill", "rank": member, "step": FAULT_STEP, "phase": phase, "life": None}]
    steps = STEPS[example]
    run = launch(EXAMPLES[example], "--steps", str(steps), per_replica=2, restarts=2, run_dir=str(tmp_path),
                 env={"COMMSLAYER_FAULTS": json.dumps(fault)}, timeout=200)
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    done = load_results(str(tmp_path))
    failed = [c for c in state_checks(done, steps, Layout(2, 2)) if not c.ok]
    assert not failed, (failed, log)  # every rank at the end, each step applied once, replicas bitwise equal
    whole = longest(done)
    assert whole.replica != member // 2
    [rec] = whole.recoveries
    assert rec.lost_replicas == [member // 2]
    assert rec.step == (FAULT_STEP + 1 if phase == "optimizer" else FAULT_STEP)
    restarted = [r for r in done if r.replica == member // 2]
    assert all(r.restart == 1 and FAULT_STEP < r.start_step < steps for r in restarted), \
        [(r.member, r.restart, r.start_step) for r in restarted]  # healed mid-run, not at the end
    reference = longest(clean[example]).losses
    assert all(whole.losses[s] == reference[s] for s in range(FAULT_STEP)), "losses before the fault differ"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_average_begun_during_backward_equals_the_one_after_it(clean, tmp_path, example):
    """FSDP2's all-reduce hook and the DDP comm hook begin the cross-replica average
    during backward (the clean runs); averaged after backward instead, every loss is
    bitwise the same."""
    steps = 40
    run = launch(EXAMPLES[example], "--steps", str(steps), per_replica=2, run_dir=str(tmp_path),
                 env={"COMMSLAYER_AVERAGE_AFTER_BACKWARD": "1"})
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    after = load_results(str(tmp_path))
    assert all(r.overlapped == ["model"] for r in clean[example])
    assert all(r.overlapped == [] for r in after)
    reference = longest(clean[example]).losses
    assert [longest(after).losses[s] for s in range(steps)] == [reference[s] for s in range(steps)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mistake, expected, where", [
    ("extra-state", ["StateMismatch", "replica 0 vs replica 1", "extra.value: missing vs float32[2]"], AT),
    ("shape", ["StateMismatch", "replica 0 vs replica 1", "counter.value: float32[3] vs float32[4]"], AT),
    ("no-grads", ["InvalidArgument", "step() at step 0 found no gradients"], AT),
    ("no-step", ["InvalidArgument", "step 0 ended without job.step()"], AT),
    ("no-optimizer", ["InvalidArgument", "no optimizer is registered, so step() would train nothing"], AT),
    ("other-model", ["InvalidArgument", "trainable parameter(s) of the registered modules are held by no registered "
                                        "optimizer (model.weight, model.bias)"], AT),
    ("scheduler", ["InvalidArgument", "optimizer 'optimizer' is driven by a learning-rate scheduler that is not "
                                      "registered"], AT),
    # each of the next three trained wrong without a word: an optimizer applied twice a step, gradients
    # averaged twice
    ("same-optimizer", ["InvalidArgument", "register: 'opt2' is 'optimizer' again: register each object once"],
     OUTSIDE),
    ("submodule", ["InvalidArgument", "register: module 'wrapped' shares parameters with a registered module"],
     OUTSIDE),
    ("two-optimizers", ["InvalidArgument", "register: optimizer 'opt2' updates parameters that a registered "
                                           "optimizer updates too"], OUTSIDE),
    # hung: replica 1 waited in finish() for replica 0, still stepping
    ("uneven-steps", ["InvalidArgument", "the ranks loop over different numbers of steps (job rank(s) [1]: "
                                         "steps(4); job rank(s) [0]: steps(5))"], AT),
    # trained two different models to the end, exit 0, with one 'DIFFERENT' line in finish()
    ("seed", ["StateMismatch", "replica 0 vs replica 1: model (parameter values): ", "torch.manual_seed"], AT),
    # trained steps 0..4 twice and reported 5 steps
    ("epochs", ["InvalidArgument", "steps() called again (steps(5), then steps(5))"], OUTSIDE),
    ("loss-item", ["InvalidArgument", "step(loss): loss is a float, not a one-element tensor"], AT),
    # trained on each replica's own gradients, then again on the average, exit 0
    ("opt-step", ["InvalidArgument", "optimizer 'optimizer' stepped outside job.step(): remove optimizer.step()"],
     AT),
    # trained nothing, exit 0
    ("no-steps", ["InvalidArgument", "steps(0): the job's number of steps must be an int >= 1"], OUTSIDE),
    # trained two different models from step 2 on, exit 0, with one 'DIFFERENT' line in finish()
    ("diverge", ["StateMismatch", "the replicas ended with different state (shard 0: replicas [0, 1], "
                                  "fingerprints ["], OUTSIDE),
])
def test_a_mistake_is_a_clear_error_on_every_rank(mistake, expected, where):
    """A mistake is a bug, not a fault: every rank that makes it says why in one line, and
    the launcher stops the job at once (--max-restarts 2: nothing is restarted)."""
    run = launch(MISUSE, mistake, restarts=2)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    leaving = [line for line in out.splitlines() if "leaving (" in line]
    assert leaving, out  # each rank says why, in one line (a rank the launcher ended first may not)
    for line in leaving:
        for text in expected:
            assert text in line, line
    stop = [line for line in run.stderr.splitlines() if line.startswith("commslayer-run:")]
    assert len(stop) == 1 and "a deterministic failure" in stop[0] and where in stop[0], out
    assert expected[0] in stop[0] and "replica group" in stop[0], stop
    assert "healed from a live replica" not in out and "restarted (restart" not in out, out


@pytest.mark.timeout(90)
def test_replica_groups_that_read_the_same_data_are_told():
    """Data drawn from the rank in the group (``RANK``, ``job.rank``) is the same in every replica
    group: the job trained as one replica, without a word. It still trains; world rank 0 says
    why its replicas add nothing, once, and a job whose replicas read their own data hears nothing."""
    warning = "every replica group computed bitwise the same loss on each shard"
    same = launch(MISUSE, "same-data")
    assert same.returncode == 0 and same.stdout.count(warning) == 1, job_story(same.stdout + same.stderr)
    assert "derive each rank's data from job.member" in same.stdout
    own = launch(MISUSE, "none")
    assert own.returncode == 0 and warning not in own.stdout, job_story(own.stdout + own.stderr)


@pytest.mark.timeout(60)
def test_a_script_started_with_python_alone_is_told_how_to_start():
    """``python my_train.py``, no launcher: a KeyError: 'RANK' from inside commslayer; now one
    line that says how to start it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "COMMSLAYER_RESTART_UNIT")}
    run = subprocess.run([sys.executable, str(MISUSE), "none"], env=env, cwd="/", capture_output=True, text=True,
                         timeout=50)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == (
        f"commslayer.errors.InvalidArgument: RANK and WORLD_SIZE not set: start the script with commslayer-run "
        f"(commslayer-run --nproc-per-node 2 {MISUSE}) or torchrun, not with python alone [op init]"), run.stderr


@pytest.mark.timeout(120)
def test_the_same_script_runs_under_plain_torchrun(tmp_path):
    """No launcher: one replica group, the same script unchanged, its result written."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_RUN_DIR=str(tmp_path))
    for name in ("COMMSLAYER_JOB_STORE", "COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(EXAMPLES["ddp"]), "--steps", "20"], env=env, cwd="/", capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    done = load_results(str(tmp_path))
    assert sorted(r.member for r in done) == [0, 1]
    assert all(r.live == [0] and sorted(r.losses) == list(range(20)) and set(r.optimizer_steps) == {20}
               for r in done)
