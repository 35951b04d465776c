"""A bug is not a fault (commslayer/train/failures.py): a user's FSDP2 script (tests/jobs/user_fsdp2.py)
under ``commslayer-run`` in both modes, with the mistakes users make.

An exception of the script's own code, or a skipped ``job.step()``, stops the whole job
within seconds with the rank, the step, the exception and the script's line named; nothing
is restarted, every rank dumps its trace.  A SIGKILL of the same rank at the same step is
still a fault, recovered.  The docs' recipe is a pair of files whose difference the test
counts.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest
import torch.distributed as dist

from commslayer.errors import PeerLost
from commslayer.runs import load_summary
from commslayer.train import failures
from tests.harness import job_story

ROOT = Path(__file__).resolve().parent.parent
USER = ROOT / "tests" / "jobs" / "user_fsdp2.py"
PLAIN, RESILIENT = (ROOT / "launch" / "examples" / f"fsdp2_{kind}.py" for kind in ("plain", "resilient"))
MODES = {"per-rank": ["--nproc-per-node", "3"], "replica": ["--replicas", "2", "--nproc-per-replica", "2"]}
STOP_S = 10.0  # from the failing rank's 'leaving' line to the launcher's exit


def run(tmp_path: Path, mode_args: List[str], *script_args: str, launcher: Tuple[str, ...] = (),
        env: dict = None, timeout: float = 150, script: Path = USER) -> Tuple[int, str, float]:
    """The launcher on the user's script, from outside the repository: its exit status, its
    whole output, and the seconds from the first rank's 'leaving' line to its exit (0: none)."""
    cmd = [sys.executable, "-m", "commslayer.run.launcher", *mode_args, "--max-restarts", "3", "--grace", "3",
           "--run-dir", str(tmp_path / "run"), *launcher, str(script), *script_args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(cmd, env=full_env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, left = [], None
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if left is None and "leaving (" in line:
            left = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            break
    code = proc.wait(timeout=30)
    took = time.monotonic() - left if left is not None else 0.0
    return code, "".join(lines), took


def stop_line(out: str) -> str:
    [line] = [x for x in out.splitlines() if x.startswith("commslayer-run:")]
    return line


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, member, unit", [("per-rank", 1, "rank 1"), ("replica", 3, "replica group 1 rank 1")])
def test_a_bug_stops_the_job_with_the_rank_named(tmp_path, mode, member, unit):
    """The script raises at step 6 on one rank, as it would again in every life: the job
    stops at once, exit 1, one line naming the rank, the step, the error and the line of
    the script; every rank's trace dumped; no restart, no reshard; the summary says so."""
    code, out, took = run(tmp_path, MODES[mode], "--bug", f"6:{member}")
    assert code == 1, job_story(out)
    line = stop_line(out)
    assert f"{unit} (life 0, pid " in line and "failed at step 6 with ValueError: bad batch at step 6" in line, line
    assert "user_fsdp2.py:" in line and ", in check_batch: raise ValueError(" in line, line
    assert "a deterministic failure (an exception of the script's own code)" in line, line
    assert took < STOP_S, (took, job_story(out))
    # SignalException: torchrun's traceback of the launcher's SIGTERM, one line now (commslayer.run.processes)
    for noise in ("starting life", "resharding", "healed from a live replica", "gave up", "SignalException"):
        assert noise not in out, (noise, job_story(out))
    traces = tmp_path / "run" / "traces"
    ranks = 3 if mode == "per-rank" else 4
    assert sorted(p.name for p in traces.glob("rank*.json")) == [f"rank{r}.json" for r in range(ranks)], out[-3000:]
    summary = load_summary(str(tmp_path / "run"))
    assert summary is not None and not summary.ok and unit in (summary.stopped or "")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["per-rank", "replica"])
def test_a_sigkill_at_the_same_step_is_still_recovered(tmp_path, mode):
    """The same rank at the same step, SIGKILLed (its first life only): a fault, recovered,
    and --compare-to against a fault-free run takes the fault from the run's own records
    (nothing was injected by a harness)."""
    clean = tmp_path / "clean"
    clean.mkdir()
    code, out, _ = run(clean, MODES[mode], "--steps", "16")
    assert code == 0, job_story(out)
    member = 1 if mode == "per-rank" else 3
    code, out, _ = run(tmp_path, MODES[mode], "--steps", "16", "--kill", f"6:{member}",
                       launcher=("--compare-to", str(clean / "run"), "--loss-tolerance", "1"))
    assert code == 0, job_story(out)
    assert "a deterministic failure" not in out
    compared = [x for x in out.splitlines() if x.startswith("summary: loss vs the fault-free run")]
    assert len(compared) == 1 and "steps before the fault identical: True" in compared[0], compared
    assert re.search(r"final loss \d\.\d{5}", compared[0]), compared  # significant digits, not 0.0000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, says", [
    (["--skip", "6:1"], "rank 1 (life 0, pid"),
    # hung: rank 1 waited in finish() for the others, still stepping
    (["--fewer-steps", "1"], "the ranks loop over different numbers of steps (job rank(s) [1]: steps(19); job "
                             "rank(s) [0, 2]: steps(20))"),
    # CommAborted, taken for a fault: every rank restarted and waited for survivors that did not exist
    (["--destroy-first"], "dist.destroy_process_group() before job.finish()"),
    # the same stop as --skip's; the two checks themselves run in the default suite on every rank
    # of a replica-mode job (tests/test_resilience.py, test_a_mistake_is_a_clear_error_on_every_rank)
    pytest.param(["--no-optimizer"], "no optimizer is registered", marks=pytest.mark.slow),
    pytest.param(["--unregistered-scheduler"], "driven by a learning-rate scheduler that is not registered",
                 marks=pytest.mark.slow),
])
def test_a_mistake_in_per_rank_mode_stops_the_job(tmp_path, args, says):
    code, out, _ = run(tmp_path, MODES["per-rank"], *args)
    assert code == 1, job_story(out)
    line = stop_line(out)
    assert says in line and "InvalidArgument" in line and "a deterministic failure" in line, line
    assert "starting life" not in out and "resharding" not in out, job_story(out)


@pytest.mark.timeout(150)
def test_a_barrier_on_rank_0_alone_stops_a_per_rank_job_as_a_mismatch(tmp_path):
    """Rank 0 alone calls ``dist.barrier()`` after step 6 (to save a checkpoint, say) while
    the others go on to step 7's all-gather. Before: each side timed out, the job took it
    for a loss of nobody, redid the step and exited 0 with the barrier skipped. Now the
    timed-out ranks compare their ops, and the job stops: a mismatch, nothing restarted.
    The op deadline is ``COMMSLAYER_TIMEOUT_S``, which replaces ``init()``'s 60 s as it does a
    c10d group's timeout (per-rank mode ignored it before)."""
    began = time.monotonic()
    code, out, took = run(tmp_path, MODES["per-rank"], "--steps", "12", "--rank0-barrier", "6",
                          env={"COMMSLAYER_TIMEOUT_S": "6"})
    assert time.monotonic() - began < 50, job_story(out)  # init()'s 60 s deadline would have passed
    assert code == 1, job_story(out)
    line = stop_line(out)
    # either side may be named first: rank 0 "timed out in barrier #N while rank 1 in all_gather... #N",
    # or a rank of the others "timed out in all_gather... #N while rank 0 in barrier #N"
    assert re.search(r" failed at step 7 with CollectiveMismatch: timed out in \w+ #\d+ while .*barrier #", line) \
        or "failed at step 7 with CollectiveMismatch: timed out in barrier #" in line, line
    assert "a deterministic failure" in line, line
    assert took < STOP_S, (took, job_story(out))
    for noise in ("starting life", "resharding", "recovered:"):
        assert noise not in out, (noise, job_story(out))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, unit", [("per-rank", "rank "), ("replica", "replica group ")])
def test_a_collective_of_uneven_sizes_that_gloo_aborts_on_is_a_bug(tmp_path, mode, unit):
    """After step 6 every rank all-reduces a metric, member 1's twice as long: Gloo aborts a
    process (SIGABRT, "Is there a distributed collective mismatch in your code?"). Before: a
    death by a signal, a fault, restarted into the same abort until the crash-loop rule
    stopped it. Now the launcher reads Gloo's words in the rank's output: a bug, stopped at once."""
    code, out, _ = run(tmp_path, MODES[mode], "--steps", "12", "--uneven-allreduce", "6:1")
    assert code == 1, job_story(out)
    line = stop_line(out)
    assert line.startswith(f"commslayer-run: {unit}") and " in a collective with CollectiveMismatch: Gloo aborted " \
        "the process: op.preamble.length <= op.nbytes." in line, line
    assert "a deterministic failure (CollectiveMismatch: ranks called one collective with different sizes)" in line
    for noise in ("starting life", "resharding", "healed from a live replica", "crash loop"):
        assert noise not in out, (noise, job_story(out))


@pytest.mark.timeout(120)
def test_ddp_in_per_rank_mode_is_refused_at_register(tmp_path):
    """The DDP example under per-rank mode trained while nothing failed, but a lost rank's
    replacement ran DDP's constructor collectives alone: the survivors timed out, the
    replacements crash-looped. Now ``register`` refuses it at the first life, naming the
    remedy."""
    proc = subprocess.run([sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", "2", "--max-restarts",
                           "2", str(PLAIN.parent / "ddp_resilient.py"), "--steps", "5"],
                          env=dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR=""), cwd="/",
                          capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, job_story(out)
    line = stop_line(out)
    assert "InvalidArgument: register: 'model' is a DistributedDataParallel module" in line, line
    assert "commslayer-run --replicas R --nproc-per-replica N" in line and "a deterministic failure" in line, line
    assert "starting life" not in out, job_story(out)


@pytest.mark.timeout(150)
def test_a_barrier_on_every_groups_rank_0_alone_stops_the_job_as_a_bug(tmp_path):
    """Replica mode, the same barrier on every group's rank 0 (a checkpoint's, say) while
    rank 1 goes on into the next step's all-gather. Both time out in the same communicator:
    rank 0 finds rank 1 in another collective at that point, a CollectiveMismatch, and the job
    stops at once, nothing restarted. Where one side's timeout comes too late for the other to
    see it (a loaded machine), the groups restart and, with no replica left to heal them from,
    the coordinator stops the job, naming each group's failure and the script's line; before
    either rule they waited 60 s to be admitted, in every life (--max-restarts 3: over 4 minutes)."""
    code, out, _ = run(tmp_path, MODES["replica"], "--steps", "12", "--rank0-barrier", "6", "--timeout", "6",
                       timeout=120)
    assert code == 1, job_story(out)
    line = stop_line(out)
    if "CollectiveMismatch" in line.split(":", 2)[1]:
        # whichever side the launcher heard from first: rank 0 in the barrier, or rank 1 in the all-gather
        assert line.startswith("commslayer-run: replica group ") and " (life 0, pid " in line, line
        said = line.split(" with CollectiveMismatch: timed out in ", 1)[1].split(" timed out: ", 1)[0]
        assert re.fullmatch(r"barrier #\d+ while rank 1 in all_gather_single #\d+|"
                            r"all_gather_single #\d+ while rank 0 in barrier #\d+", said), line
        assert "a deterministic failure" in line, line
        assert "starting life" not in out, job_story(out)
    else:
        assert line.startswith("commslayer-run: every replica group was lost, so no live replica holds"), line
        for group in (0, 1):
            assert f"replica group {group} rank 0 (life 0, pid " in line, line
        assert line.count("in main: dist.barrier()") == 2 and "more likely a bug in the script" in line, line
    assert "was not admitted within" not in out and "healed from a live replica" not in out, job_story(out)


@pytest.mark.timeout(150)
def test_every_replica_group_lost_at_once_stops_the_job_instead_of_waiting(tmp_path):
    """Replica mode, every group's rank 0 SIGKILLed at the same step (a fault: the restarted
    lives would run on): no replica is left to heal the restarted groups from, so the
    coordinator stops the job as soon as they restart, naming what each group's survivor saw
    (or, when its torchrun ended it 0 to 0.1 s after the kill, before it saw the loss: that
    it recorded nothing); a peer's death is no sign of a bug, and the stop does not say it is."""
    code, out, _ = run(tmp_path, MODES["replica"], "--steps", "12", "--kill", "6:0", "--kill", "6:2", timeout=120)
    assert code == 1, job_story(out)
    line = stop_line(out)
    assert line.startswith("commslayer-run: every replica group was lost, so no live replica holds"), line
    named = [group for group in (0, 1) if f"replica group {group} rank 1 (life 0, pid " in line]
    for group in [g for g in (0, 1) if g not in named]:
        assert f"replica group {group}: no rank recorded an exception (each was killed, or ended by its torchrun" \
               in line, line
    assert line.count("failed at step 6 with PeerLost") == len(named) and "more likely a bug" not in line, line
    assert "was not admitted within" not in out and "healed from a live replica" not in out, job_story(out)


def test_a_lost_group_whose_ranks_recorded_nothing_is_named_in_the_stop():
    """The stop above when one group's survivor recorded its PeerLost and the other's was
    ended by its torchrun first: both groups are named, the silent one as such, no bug hinted."""
    store = dist.HashStore()
    for group in (0, 1):
        failures.record_restart(store, group)
    try:
        raise PeerLost("peer lost: rank(s) 0", comm="c10d:0:cpu", op="all_gather_single", ranks=[0])
    except PeerLost as exc:
        failures.record(store, exc, exc.__traceback__, unit="replica group 1 rank 1", key=failures.unit_key(1, 1),
                        life=0, step=6, saw_loss=True, error=f"PeerLost: {exc}")
    why = failures.no_replica_left(store, replicas=2, shards=2, gone=[])
    assert why is not None and "replica group 1 rank 1 (life 0, pid " in why and "failed at step 6 with PeerLost" in why
    assert "replica group 0: no rank recorded an exception (each was killed, or ended by its torchrun" in why, why
    assert "more likely a bug" not in why, why


@pytest.mark.timeout(120)
def test_the_smallest_job_stops_with_a_clear_error_instead_of_resharding(tmp_path):
    """Two ranks with redundancy 1, one lost and no restart left: one survivor cannot hold a
    copy of anyone's state, so the job ends with ReplacementMissing saying so, no traceback."""
    code, out, _ = run(tmp_path, ["--nproc-per-node", "2"], "--kill", "6:1", launcher=("--max-restarts", "0"))
    assert code == 1, job_story(out)
    leaving = [x for x in out.splitlines() if "leaving (ReplacementMissing" in x]
    assert len(leaving) == 1 and "too few to go on resharded with redundancy 1" in leaving[0], job_story(out)
    assert "Traceback" not in out and "resharding" not in out, job_story(out)


@pytest.mark.timeout(120)
def test_a_resharding_job_ended_midway_leaves_nothing_in_host_memory(tmp_path):
    """SIGTERM to the launcher as soon as the survivors reshard: its scratch directory in
    /dev/shm (where the whole state is left for the restarted script) is gone."""
    shm = Path("/dev/shm")
    before = set(shm.glob("commslayer-*"))
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", "3", "--max-restarts", "0", "--grace",
           "3", str(USER), "--steps", "400", "--kill", "6:2"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR=""), cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "resharding: rank(s) [2] lost" in line:
            proc.send_signal(signal.SIGTERM)
            break
    proc.communicate(timeout=60)
    assert any("resharding: rank(s) [2] lost" in x for x in seen), "".join(seen)[-3000:]
    assert set(shm.glob("commslayer-*")) - before == set()


@pytest.mark.timeout(60)
def test_a_crash_loop_stops_the_job_with_the_rank_named(tmp_path):
    """Rank 1 exits 1 in every life (each looks like a lost process): its third failure
    within the window stops the job although restarts are left."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job = ROOT / "tests" / "jobs" / "rank_unit_job.py"
    proc = subprocess.run([sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", "3", "--max-restarts",
                           "9", "--crash-loop", "3/60", "--grace", "2", str(job), "always-fail", str(out_dir)],
                          env=dict(os.environ, COMMSLAYER_TRACE_DIR=""), cwd="/", capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.splitlines() == [
        "commslayer-run: rank 1 failed 3 times within 60s (life 0 exited with status 1; life 1 exited with status 1; "
        "life 2 exited with status 1): a crash loop (--crash-loop 3/60), not a fault to recover from: the job "
        "stops"], proc.stderr
    assert sorted(p.stem for p in out_dir.glob("rank1-life*.json")) == ["rank1-life0", "rank1-life1", "rank1-life2"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, case", [("per-rank", "a mistyped argument"), ("per-rank", "an import that fails"),
                                        ("replica", "an import that fails")])
def test_a_script_that_cannot_start_stops_the_job_in_its_first_life(tmp_path, mode, case):
    """Every rank's script fails before ``resilience.init()``: argparse refuses a mistyped
    option (exit 2), or an import fails (exit 1 with a traceback). Before: per-rank mode
    restarted each rank into the same failure until the crash-loop rule stopped the job (3
    lives of a rank, no word of the cause in the launcher's line); replica mode's torchruns
    restarted their groups until they gave up. Now the launcher reads the error in the
    rank's (or the group's torchrun's) output: a bug, stopped in the first life, named."""
    if case == "an import that fails":
        script = tmp_path / "train.py"
        script.write_text("import torch\nimport a_module_that_is_not_installed\n")
        code, out, _ = run(tmp_path, MODES[mode], script=script)
        says = "failed before resilience.init() with ModuleNotFoundError: No module named " \
            "'a_module_that_is_not_installed'"
    else:
        code, out, _ = run(tmp_path, MODES[mode], "--stesp", "12")
        says = "failed before resilience.init() with an argument the script refused (user_fsdp2.py: error: " \
            "unrecognized arguments: --stesp 12)"
    assert code == 1, job_story(out)
    line = stop_line(out)
    unit = r"rank \d" if mode == "per-rank" else r"replica group \d rank \d"
    assert re.match(rf"commslayer-run: {unit} \(life 0, pid \d+\) ", line) and says in line, line
    assert "a deterministic failure (the script failed before resilience.init(): it cannot start)" in line, line
    for noise in ("starting life", "crash loop", "gave up", "restarted (restart"):
        assert noise not in out, (noise, job_story(out))


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_the_loop_with_status_0_stops_the_job(tmp_path):
    """Rank 1 calls ``sys.exit(0)`` after step 5 (a "done" check that fired on one rank). Before:
    its exit made it a rank that was done; the others waited 120 s for a replacement that
    never came, resharded down to two ranks, then found rank 2 lost and failed with
    ReplacementMissing (128 s, an innocent rank named). Now: a bug, the job stops at once."""
    began = time.monotonic()
    code, out, _ = run(tmp_path, MODES["per-rank"], "--steps", "12", "--leave", "5:1")
    assert code == 1, job_story(out)
    assert time.monotonic() - began < 60, job_story(out)  # the 120 s wait for a replacement is not there
    line = stop_line(out)
    assert line.startswith("commslayer-run: rank 1 (life 0, pid ") and "before job.finish() with an exit with " \
        "status 0: a deterministic failure (a rank left the job before it finished" in line, (line, job_story(out))
    for noise in ("starting life", "resharding", "ReplacementMissing"):
        assert noise not in out, (noise, job_story(out))


@pytest.mark.timeout(150)
def test_a_spare_that_adopted_a_rank_is_held_to_the_same_rule(tmp_path):
    """Rank 1 is SIGKILLed at step 3 (a fault: a warm spare becomes its life 1); after step 6
    every rank all-reduces a metric, rank 2's twice as long, and Gloo aborts rank 1 (whose ring
    neighbour it receives from is rank 2), now the
    spare. Before: the spare's output was only echoed, so its abort was a death by a signal,
    restarted into the same abort. Now the launcher reads an adopted spare's output as its
    rank's: the job stops on life 1, a collective mismatch."""
    code, out, _ = run(tmp_path, MODES["per-rank"], "--steps", "12", "--kill", "3:1", "--uneven-allreduce", "6:2",
                       launcher=("--spares", "1"))
    assert code == 1, job_story(out)
    assert "spare 0 (pid " in out and "takes life 1" in out, job_story(out)
    line = stop_line(out)
    assert line.startswith("commslayer-run: rank 1 (life 1, pid ") and "CollectiveMismatch: Gloo aborted" in line, line
    assert "starting life 2" not in out and "crash loop" not in out, job_story(out)


@pytest.mark.timeout(150)
def test_a_run_directory_used_again_holds_only_the_new_runs_files(tmp_path):
    """The same command twice, the first run with a rank SIGKILLed (its life 1 writes a result
    of its own). Before: the second run's summary read the first's result files beside its
    own ("3 rank(s) finished" for a job of 2; the files of a run of other steps or state made
    its checks fail). Now the launcher moves an earlier run's files into ``earlier/1`` before
    it starts."""
    code, out, _ = run(tmp_path, ["--nproc-per-node", "2"], "--steps", "10", "--kill", "4:1")
    assert code == 0, job_story(out)
    first = sorted(p.name for p in (tmp_path / "run").glob("result-*.json"))
    assert "result-m1-r1.json" in first, first
    code, out, _ = run(tmp_path, ["--nproc-per-node", "2"], "--steps", "10")
    assert code == 0, job_story(out)
    assert f"{tmp_path / 'run'} held an earlier run's files; they are in {tmp_path / 'run' / 'earlier' / '1'}" in out
    assert sorted(p.name for p in (tmp_path / "run").glob("result-*.json")) == ["result-m0-r0.json",
                                                                               "result-m1-r0.json"]
    assert sorted(p.name for p in (tmp_path / "run" / "earlier" / "1").glob("result-*.json")) == first
    assert (tmp_path / "run" / "earlier" / "1" / "summary.json").exists()
    summary = load_summary(str(tmp_path / "run"))
    assert summary is not None and summary.ok and summary.recoveries == [], summary


def _code(path: Path) -> List[str]:
    """A script's lines after its module docstring, blank lines left out."""
    text = path.read_text()
    doc = ast.parse(text).body[0]
    return [line for line in text.splitlines()[doc.end_lineno:] if line.strip()]


def test_the_recipe_changes_the_lines_the_docs_say():
    """The resilient example differs from its plain twin in exactly the lines marked
    ``# commslayer``, and docs/training.md states that count."""
    diff = [x for x in difflib.unified_diff(_code(PLAIN), _code(RESILIENT), lineterm="", n=0)
            if x[:1] in "+-" and not x.startswith(("+++", "---"))]
    removed = sum(x.startswith("-") for x in diff)
    added = [x for x in diff if x.startswith("+")]
    assert all("# commslayer" in x for x in added), added
    assert len(added) == sum("# commslayer" in x for x in _code(RESILIENT))
    said = re.search(r"(\d+) lines removed and (\d+) added", (ROOT / "docs" / "training.md").read_text())
    assert said is not None and (int(said.group(1)), int(said.group(2))) == (removed, len(added)), \
        (said and said.group(0), removed, len(added))


@pytest.mark.timeout(90)
def test_an_unconverted_script_runs_in_per_rank_mode_instead_of_hanging(tmp_path):
    """The plain script, not converted yet, under ``commslayer-run --nproc-per-node 2``: rank 0
    tried to serve MASTER_PORT, the job's store, and failed (EADDRINUSE) at every restart while
    rank 1 waited for it in init_process_group for 30 minutes. Now it runs as under torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    proc = subprocess.run([sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", "2",
                           "--max-restarts", "1", str(PLAIN), "--steps", "11"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=75)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, job_story(out)
    assert [x.split(" loss ")[0] for x in proc.stdout.splitlines() if " loss " in x] == \
        ["[rank 0] step 0", "[rank 0] step 10"], job_story(out)
    assert "EADDRINUSE" not in out and "starting life" not in out, job_story(out)
    assert "coordinator: no rank called job.finish()" in proc.stdout, job_story(out)  # no resilience: said


@pytest.mark.timeout(150)
def test_the_resilient_script_and_its_plain_twin_print_the_same_losses_under_torchrun(tmp_path):
    """Under plain torchrun (no commslayer-run) the converted script is one replica group and
    trains exactly as the script it was made from."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    for name in ("COMMSLAYER_JOB_STORE", "COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS", "COMMSLAYER_RUN_DIR"):
        env.pop(name, None)
    printed = {}
    for script in (PLAIN, RESILIENT):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                               "--steps", "31"], env=env, cwd=str(tmp_path), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, job_story(proc.stdout + proc.stderr)
        printed[script.stem] = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
        assert "state of replicas" not in proc.stdout  # one replica: nothing to compare, nothing said
    assert len(printed["fsdp2_plain"]) == 4 and printed["fsdp2_plain"] == printed["fsdp2_resilient"], printed


def test_a_backends_own_error_that_a_peer_went_away_is_a_fault():
    """Gloo's raw error from a plain group, or wrapped by the futures of a DDP comm hook,
    says a peer went away: a fault, even before this process's monitor saw the loss; a
    script's own RuntimeError stays a bug."""
    from commslayer.errors import PeerLost
    from commslayer.train.failures import classify

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:49552. This is typically caused by a remote worker crashing.")
    wrapped = RuntimeError(f"Got the following error when running the callback: RuntimeError: {gloo}")
    chained = RuntimeError("the hook's future failed")
    chained.__cause__ = gloo
    for exc in (gloo, wrapped, chained, PeerLost("peer lost: rank(s) 1", ranks=[1])):
        assert classify(exc, saw_loss=False) == "", exc
    for exc in (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x4)"), ValueError("bad batch")):
        assert classify(exc, saw_loss=False) == "an exception of the script's own code", exc


def test_the_line_named_is_the_scripts_not_commslayers():
    """An error raised inside commslayer names the script's line that called it."""
    import torch

    from commslayer.train import packing
    from commslayer.train.failures import user_frame

    try:
        packing.unpack(torch.zeros(3, dtype=torch.uint8))  # the line named
    except packing.BadState as exc:
        where = user_frame(exc.__traceback__)
    assert where.startswith(f"{os.path.relpath(__file__)}:") and "packing.unpack(torch.zeros(3" in where, where


def test_what_a_life_that_died_before_init_shows_in_its_output():
    """``failures.start_failure`` on real interpreters' output: a failed import, a syntax
    error (no "Traceback" line), argparse's refusal, a chained error, and what stays a
    fault: ``sys.exit`` with a message, a store that cannot be reached, a peer gone."""
    from commslayer.train.failures import start_failure

    def output(code: str, *args: str) -> List[str]:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0, done
        return (done.stdout + done.stderr).splitlines(keepends=True)

    assert start_failure(output("import a_module_that_is_not_installed")) == \
        "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"
    assert start_failure(output("def f(:\n  pass")) == "SyntaxError: invalid syntax"
    assert start_failure(output("import argparse; argparse.ArgumentParser(prog='t.py').parse_args()", "--x")) == \
        "an argument the script refused (t.py: error: unrecognized arguments: --x)"
    assert start_failure(output("try:\n  {}['k']\nexcept KeyError:\n  raise ValueError('no k\\nat all')")) == \
        "ValueError: no k"
    # After init_process_group, torch's excepthook puts "[rank0]: " before each line of a traceback.
    assert start_failure(output("import torch.distributed as d; d.init_process_group('gloo', store=d.HashStore(), "
                                "rank=0, world_size=1); import a_module_that_is_not_installed")) == \
        "ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"
    assert start_failure(output("import sys; print('  indented'); sys.exit('no data: giving up')")) is None
    assert start_failure(output("import torch.distributed as d; raise d.DistNetworkError('connect refused')")) is None
    assert start_failure(output("import socket; socket.create_connection(('127.0.0.1', 1))")) is None
    assert start_failure(output("raise RuntimeError('[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:5')")) \
        is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, ranks", [("replica", 4), ("per-rank", 3)])
def test_max_grad_norm_clips_the_average_as_the_plain_script_clips_its_gradients(tmp_path, mode, ranks):
    """The plain FSDP2 script with clip_grad_norm_ before opt.step() against its resilient
    twin on as many ranks (replica mode: 2 groups of 2). There, clip_grad_norm_ left before
    job.step() clips each group's own gradients, not their average (step 30's loss 35.0969
    against the plain 35.168, seen once by hand); job.step(loss, max_grad_norm=...) clips the
    average: the same losses, in both modes."""
    plain, resilient = tmp_path / "plain.py", tmp_path / "resilient.py"
    plain.write_text(PLAIN.read_text().replace(
        "        loss.backward()\n",
        "        loss.backward()\n        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)\n"))
    resilient.write_text(RESILIENT.read_text().replace("job.step(loss)", "job.step(loss, max_grad_norm=0.05)"))
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    for name in ("COMMSLAYER_JOB_STORE", "COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS", "COMMSLAYER_RUN_DIR"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(plain),
                           "--steps", "31"], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, job_story(proc.stdout + proc.stderr)
    expected = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    code, out, _ = run(tmp_path, MODES[mode], "--steps", "31", script=resilient)
    assert code == 0, job_story(out)
    got = [x.split("] ", 1)[1] for x in out.splitlines() if "] step " in x and " loss " in x]
    assert len(expected) == 4 and got == expected, (got, expected)


_ONE_PASS = {"fsdp2": "        x, y = data.next()\n        loss = nn.functional.mse_loss(model(x), y)\n"
                      "        loss.backward()\n",
             "ddp": "        images, labels = data.next()\n"
                    "        loss = nn.functional.cross_entropy(model(images), labels)\n"
                    "        loss.backward()\n"}


def _accumulating(script: Path, kind: str, into: Path) -> Path:
    """``script`` with each step's gradients accumulated over 2 backward passes (no no_sync),
    and, where it is resilient, averages begun during backward from the smallest bucket."""
    text = script.read_text()
    one = _ONE_PASS[kind]
    assert one in text, script
    two = "        for _ in range(2):\n" + "".join("    " + line + "\n" for line in one.splitlines())
    into.write_text(text.replace(one, two).replace("resilience.init()", "resilience.init(bucket_mb=0.001)"))
    return into


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_gradients_accumulated_over_two_backward_passes_are_averaged_whole(tmp_path, kind):
    """Two backward passes a step, as 2 replica groups of 2, against the same on 4 ranks of one
    group (the plain FSDP2 script; the DDP script under torchrun, one replica group). The
    cross-replica averages begun during the first pass held that pass alone and were written
    over the sums at step (the DDP example's step 10 loss 0.1100 against 0.1004, the FSDP2
    example's 51.0766 against 47.8679, seen by hand): now the same losses."""
    resilient = ROOT / "launch" / "examples" / f"{kind}_resilient.py"
    reference = _accumulating(PLAIN if kind == "fsdp2" else resilient, kind, tmp_path / "reference.py")
    script = _accumulating(resilient, kind, tmp_path / "resilient.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="")
    for name in ("COMMSLAYER_JOB_STORE", "COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS", "COMMSLAYER_RUN_DIR"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(reference),
                           "--steps", "21"], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, job_story(proc.stdout + proc.stderr)
    expected = [x.split(" replicas ")[0] for x in proc.stdout.splitlines() if x.startswith("step ")]
    code, out, _ = run(tmp_path, MODES["replica"], "--steps", "21", script=script)
    assert code == 0, job_story(out)
    got = [x.split("] ", 1)[1].split(" replicas ")[0] for x in out.splitlines() if "] step " in x and " loss " in x]
    assert len(expected) == 3 and got == expected, (got, expected)


_NEVER_FIRES = {
    "5:1:forward": "--kill '5:1:forward': replica group 5, but the job has 2 (replica groups 0 to 1)",
    "0:99:forward": "--kill '0:99:forward': step 99, but the job has 20 (steps 0 to 19)",
    "1:x:forward": "--kill '1:x:forward': expected REPLICA:STEP:PHASE[:RANK], whole numbers",
}


@pytest.mark.timeout(150)
def test_a_kill_that_would_never_fire_stops_the_demo_job(tmp_path):
    """launch/train.py's --kill (what KILL= gives ./launch/demo.sh) naming a group, rank or step
    the job does not have ran the whole job without the fault, exit 0, without a word (a step
    that was not a number: a traceback on every rank): now it stops in the first life. Each
    spec's words are checked through --check-kill, which demo.sh runs before its first run."""
    code, out, _ = run(tmp_path, MODES["replica"], "--steps", "20", "--kill=5:1:forward",
                       script=ROOT / "launch" / "train.py")
    assert code == 1 and _NEVER_FIRES["5:1:forward"] in out and "the job stops" in out, job_story(out)
    for kill, says in _NEVER_FIRES.items():
        done = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--check-kill", "2x2", "--steps",
                               "20", f"--kill={kill}"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and says in done.stderr, done
    done = subprocess.run(["bash", str(ROOT / "launch" / "demo.sh")], cwd=str(ROOT), capture_output=True, text=True,
                          env=dict(os.environ, KILL="5:1:forward", RUN_DIR=str(tmp_path / "demo")), timeout=90)
    assert done.returncode == 2 and _NEVER_FIRES["5:1:forward"] in done.stderr, done
    assert "1/3" not in done.stdout and not (tmp_path / "demo").exists(), done  # before the reference run


@pytest.mark.timeout(120)
def test_a_per_rank_job_of_one_rank_stops_at_once(tmp_path):
    """commslayer-run --nproc-per-node 1 on a resilient script: its rank's state has no peer to
    keep it. Life 0 failed in init() after joining, unrecorded; the launcher restarted the rank,
    whose next life waited for survivors that never came (killed after 40 s). Now every life
    fails before joining: the launcher stops the job in its first."""
    code, out, _ = run(tmp_path, ["--nproc-per-node", "1"], "--steps", "3", script=RESILIENT, timeout=60)
    assert code == 1 and "each rank's state can have at most 0 holder(s) in a job of 1 rank(s)" in out, job_story(out)
    assert "a deterministic failure" in out and "life 1" not in out, job_story(out)
