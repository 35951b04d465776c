"""A job without replica groups survives a lost rank (``commslayer.train.peerjob``,
``commslayer.train.redundancy``): the FSDP2 example launched by ``commslayer-run``
without ``--replicas``, 4 ranks, real SIGKILLs and SIGSTOPs, every final state
compared bitwise with a fault-free run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from commslayer.train.redundancy import holders
from commslayer.runs import RankResult, load_results
from faults.etcd import EtcdCluster
from faults.etcd import available as etcd_available
from tests.harness import job_story
from tests.viewer_traces import run_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "launch" / "examples" / "fsdp2_resilient.py"
RANKS, STEPS, FAULT_STEP = 4, 120, 20


def launch(run_dir: Path, faults: List[dict], *, restarts: int = 2, env: Dict[str, str] = None,
           timeout: float = 150, options: List[str] = ()) -> subprocess.CompletedProcess:
    """``commslayer-run --nproc-per-node 4`` on the FSDP2 example, from outside the repository
    (``options``: more of the launcher's, e.g. those that put the job's store elsewhere)."""
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--nproc-per-node", str(RANKS), "--max-restarts",
           str(restarts), "--grace", "3", "--run-dir", str(run_dir), *options, str(EXAMPLE), "--steps", str(STEPS)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "COMMSLAYER_TRACE_DIR": "",
                "COMMSLAYER_FAULTS": json.dumps(faults), **(env or {})}
    return subprocess.run(cmd, env=full_env, cwd="/", capture_output=True, text=True, timeout=timeout)


def by_rank(run_dir: Path) -> Dict[int, RankResult]:
    """The result of the last life of every rank."""
    out: Dict[int, RankResult] = {}
    for r in sorted(load_results(str(run_dir)), key=lambda r: r.restart):
        out[r.rank] = r
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Dict[int, RankResult]:
    run_dir = tmp_path_factory.mktemp("clean")
    run = launch(run_dir, [])
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(run_dir)
    assert sorted(results) == list(range(RANKS))
    return results


def assert_same_as_clean(results: Dict[int, RankResult], clean: Dict[int, RankResult], log: str) -> None:
    """Every rank ended at the last step with the fault-free run's state, bitwise; every
    optimizer applied each step exactly once; every loss is the fault-free one."""
    assert sorted(results) == list(range(RANKS)), log
    for rank, r in results.items():
        assert r.end_step == STEPS, (rank, r.end_step, log)
        assert r.fingerprints == clean[rank].fingerprints, (rank, log)
        assert set(r.optimizer_steps) == {STEPS}, (rank, r.optimizer_steps)  # no step skipped or doubled
    reporter = results[0]
    assert {s: reporter.losses[s] for s in range(reporter.start_step, STEPS)} == \
           {s: clean[0].losses[s] for s in range(reporter.start_step, STEPS)}


KILLS = {
    "forward": {"step": FAULT_STEP, "phase": "forward"},
    "backward": {"step": FAULT_STEP, "phase": "backward"},
    "optimizer": {"step": FAULT_STEP, "phase": "optimizer"},  # after the commit: the survivors go back a step
    "refresh": {"step": FAULT_STEP, "phase": "refresh"},  # the copy of its state cut in the middle
    "reduce-scatter": {"op": "reduce_scatter_single", "comm": "shards", "nth": 2 * FAULT_STEP + 1,
                       "during": True},  # two reduce-scatters a step
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where, target", [
    ("backward", 2), ("refresh", 1),
    # the same recovery from other points of the step (also the fault harness's rank-kill-* scenarios); a
    # kill in forward is in the default suite through the etcd test below and bench_peer.py --smoke
    pytest.param("forward", 0, marks=pytest.mark.slow),
    pytest.param("optimizer", 3, marks=pytest.mark.slow), pytest.param("reduce-scatter", 3, marks=pytest.mark.slow),
])
def test_a_lost_rank_is_replaced_and_nothing_is_lost(clean, tmp_path, where, target):
    traces = tmp_path / "traces"  # one of the runs traced: the viewer must tell its story
    env = {"COMMSLAYER_TRACE_DIR": str(traces)} if where == "backward" else {}
    run = launch(tmp_path, [{"action": "sigkill", "rank": target, **KILLS[where]}], env=env)
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log)
    replaced = results[target]
    assert replaced.restart == 1 and FAULT_STEP - 1 <= replaced.start_step <= FAULT_STEP + 1, \
        (replaced.restart, replaced.start_step)  # healed mid-run from its holder's copy
    survivor = results[(target + 1) % RANKS]
    [rec] = survivor.recoveries
    assert rec.lost_replicas == [target] and rec.committed_at is not None
    assert "survivor stall (fault to next committed step)" in run.stdout
    if where == "backward":
        out = assert_per_rank_story(traces, target, FAULT_STEP, replaced.start_step)
        assert f"rank {target} (restarted) healed from rank {(target + 1) % RANKS}" in out, out  # its holder


def assert_per_rank_story(traces: Path, target: int, fault_step: int, continued_at: int) -> str:
    """What ``commslayer-trace diagnose`` tells of a per-rank job that replaced rank ``target``
    (lost in ``fault_step``; its replacement continued at ``continued_at``, its own record);
    the report."""
    code, out, err = run_cli("diagnose", str(traces))
    assert code == 0, out + err  # a recovered job: nothing is wrong
    assert "called from different lines" not in out, out  # the replacement's start-up ops are no split
    head = out.splitlines()[0]
    assert f"The job lost rank {target} at step {fault_step} and recovered in " in head, head
    assert f"rank {target} rejoined at step {continued_at} after a restart" in head, head  # what it printed
    assert (f"; back to step {continued_at})" in head) == (continued_at != fault_step), head
    d = json.loads(run_cli("diagnose", "--json", str(traces))[1])
    [loss] = d["recovery"]["losses"]
    assert loss["recovered_by"] == "first commit" and loss["recovery_s"] >= loss["resume_s"] >= loss["decision_s"]
    for r in d["ranks"]:  # every rank finished; the survivors had dumped on the loss before
        assert r["reason"].startswith("finished (exit 0)"), r
        assert (r["rank"] == target) != r["reason"].startswith("finished (exit 0); earlier dump on "), r
    # its first life was SIGKILLed without JSON lines: its last op comes from its peers' records
    [row] = [row for c in d["communicators"] if c["uid"] == "shards.0" for row in c["rows"] if row["rank"] == target]
    assert row["last_entered"] is None and row["from"].startswith("from its peers' records: "), row
    return out


@pytest.mark.timeout(200)
@pytest.mark.skipif(not etcd_available(), reason="etcd is not installed (Debian's etcd-server)")
def test_a_lost_rank_is_replaced_with_the_jobs_store_on_etcd(clean, tmp_path):
    """The same job, its store on a three-member etcd cluster (``--store etcd://``): the
    recovery's agreement and the replacement's admission go through etcd."""
    cluster = EtcdCluster(tmp_path / "etcd", size=3)
    try:
        run = launch(tmp_path / "run", [{"action": "sigkill", "rank": 1, **KILLS["forward"]}],
                     options=["--store", cluster.url("perrank")])
    finally:
        cluster.close()
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(tmp_path / "run")
    assert_same_as_clean(results, clean, run.stdout[-4000:] + run.stderr[-4000:])
    assert results[1].restart == 1 and [r.lost_replicas for r in results[2].recoveries] == [[1]]


@pytest.mark.timeout(200)
def test_refresh_every_k_steps_goes_back_at_most_k_steps(clean, tmp_path):
    """COMMSLAYER_REFRESH_EVERY=5: the copies are 0..4 steps old; a loss redoes those
    steps and the end is still the fault-free state."""
    run = launch(tmp_path, [{"action": "sigkill", "rank": 2, "step": FAULT_STEP + 3, "phase": "backward"}],
                 env={"COMMSLAYER_REFRESH_EVERY": "5", "COMMSLAYER_TRACE_DIR": str(tmp_path / "traces")})
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log)
    assert results[2].start_step == FAULT_STEP  # the last refresh before step 23 was at step 20
    # the viewer: lost in step 23, rejoined at step 20 (as the replacement said), back to step 20
    assert_per_rank_story(tmp_path / "traces", 2, FAULT_STEP + 3, results[2].start_step)


@pytest.mark.timeout(200)
def test_a_stopped_rank_is_replaced_and_fenced_when_it_resumes(clean, tmp_path):
    run = launch(tmp_path, [{"action": "sigstop", "rank": 2, "step": FAULT_STEP, "phase": "forward",
                             "seconds": 5.0}])
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log)  # nothing the stopped process did after SIGCONT got in
    assert results[2].restart == 1
    assert [r.restart for r in load_results(str(tmp_path)) if r.rank == 2] == [1]  # the old life never finished
    fenced = [line for line in log.splitlines() if line.startswith("[rank 2]") and "leaving (CommAborted" in line]
    assert fenced and "fenced" in fenced[0], log


@pytest.mark.timeout(120)
def test_a_rank_lost_with_its_holder_ends_the_job_with_the_state_named(tmp_path):
    """Ranks 1 and 2 killed in the same all-gather: rank 1's only copy was on rank 2.
    Every survivor says which state is gone and the last committed step, dumps its
    trace, and the launcher ends the job (no hang)."""
    traces = tmp_path / "traces"
    faults = [{"action": "sigkill", "rank": r, "op": "all_gather_single", "comm": "shards", "nth": 4 * FAULT_STEP}
              for r in (1, 2)]
    began = time.monotonic()
    run = launch(tmp_path, faults, env={"COMMSLAYER_TRACE_DIR": str(traces)})
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-4000:]
    assert time.monotonic() - began < 60
    assert "commslayer-run: the job failed: StateLost" in run.stderr, log[-4000:]
    for rank in (0, 3):
        said = [x for x in log.splitlines() if x.startswith(f"[rank {rank}]") and "leaving (StateLost" in x]
        assert len(said) == 1, (rank, job_story(log))
        [line] = said
        assert "rank(s) [1] and every holder of their state ([[2]], redundancy 1)" in line, line
        assert "The job last committed step" in line, line
        assert (traces / f"rank{rank}.json").stat().st_size > 0  # its trace was dumped on the way out


@pytest.mark.timeout(120)
def test_two_copies_survive_the_loss_of_a_rank_and_its_first_holder(clean, tmp_path):
    """COMMSLAYER_REDUNDANCY=2: rank 1's state is on ranks 2 and 3; ranks 1 and 2 lost together is survived."""
    faults = [{"action": "sigkill", "rank": r, "op": "all_gather_single", "comm": "shards", "nth": 4 * FAULT_STEP}
              for r in (1, 2)]
    run = launch(tmp_path, faults, env={"COMMSLAYER_REDUNDANCY": "2"})
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, job_story(run.stdout + run.stderr)
    results = by_rank(tmp_path)
    assert_same_as_clean(results, clean, log)
    assert results[1].restart == 1 and results[2].restart == 1


@pytest.mark.timeout(150)
def test_without_a_replacement_the_survivors_reshard_and_go_on(tmp_path):
    """--max-restarts 0: the three survivors merge the whole state (the lost rank's part
    from its holder), start the script again as a 3-rank job (FSDP2 on the smaller
    mesh) and finish; the new shards, merged back, are the whole state they left."""
    run = launch(tmp_path, [{"action": "sigkill", "rank": 3, "step": FAULT_STEP, "phase": "backward"}], restarts=0)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    [left] = [x for x in run.stdout.splitlines() if "resharding: rank(s) [3] lost" in x]
    [came] = [x for x in run.stdout.splitlines() if "resharded: 3 rank(s) at step" in x]
    assert left.split("fingerprint ")[1] == came.split("fingerprint ")[1].split(",")[0], (left, came)
    assert came.endswith("ranks per node 3"), came  # one host: the layout the watch topology reads
    assert "rank(s) [3] retired" in run.stdout
    results = by_rank(tmp_path)
    assert sorted(results) == [0, 1, 2], log[-4000:]
    assert all(r.end_step == STEPS and r.start_step == FAULT_STEP for r in results.values()), \
        [(r.rank, r.start_step, r.end_step) for r in results.values()]
    assert all(loss == loss for loss in results[0].losses.values())  # no NaN left: every step committed
    assert not list(Path("/dev/shm").glob("commslayer-reshard-*"))  # the whole state's files were removed


@pytest.mark.timeout(120)
def test_no_replacement_and_no_resharding_ends_the_job_with_the_rank_named(tmp_path):
    run = launch(tmp_path, [{"action": "sigkill", "rank": 3, "step": FAULT_STEP, "phase": "forward"}], restarts=0,
                 env={"COMMSLAYER_RESHARD": "0"})
    log = run.stdout + run.stderr
    assert run.returncode == 1, log[-4000:]
    leaving = [x for x in log.splitlines() if "leaving (ReplacementMissing" in x]
    assert len(leaving) == 3, log[-4000:]  # every survivor
    assert all("rank(s) [3] lost at step" in x and "restarts ran out" in x for x in leaving), leaving


@pytest.mark.parametrize("nodes, degree, expected", [
    ([0, 0, 0, 0], 1, [[1], [2], [3], [0]]),
    ([0, 0, 1, 1], 1, [[2], [3], [1], [0]]),       # every copy on the other host
    ([0, 0, 1, 1], 2, [[2, 1], [3, 0], [1, 3], [0, 2]]),
    ([0, 1, 0, 1], 1, [[1], [2], [3], [0]]),
])
def test_holders_put_copies_on_other_hosts(nodes, degree, expected):
    plan = holders(nodes, degree)
    assert plan == expected
    assert all(r not in hs and len(set(hs)) == degree for r, hs in enumerate(plan))


def test_a_degree_the_job_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="redundancy degree 4"):
        holders([0, 0, 0, 0], 4)
