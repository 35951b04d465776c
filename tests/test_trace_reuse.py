"""A trace directory used again: a run of 4 ranks, then a run of 2 into the same
directory under torchrun, with JSON lines.  The first run's files (ranks 2 and 3)
and its lines in the files both runs append to must not be taken for the second
run's: the reader leaves them out and says so, and torchrun's agent, which imports
torch too, writes no line of its own into rank 0's file.  The rule that tells runs
apart (when each file's process began tracing, when the file was last written) on
dumps made to measure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import orjson
import pytest

from tests.harness import free_port
from tracing.read import analysis
from tracing.read.traceio import discover
from tracing.records import new_dump

JOB = Path(__file__).parent / "jobs" / "ops_job.py"


def _torchrun(trace_dir: Path, nproc: int, cwd: Optional[Path] = None, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(JOB)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_")}, "OMP_NUM_THREADS": "1",
           "COMMSLAYER_ROUTE_C10D": "1", "COMMSLAYER_TRACE_DIR": str(trace_dir), "COMMSLAYER_TRACE_JSONL": "1",
           "COMMSLAYER_TIMEOUT_S": "5", **env}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, cwd=cwd)


@pytest.mark.timeout(200)
def test_a_reused_trace_directory_shows_the_newest_run_and_names_what_it_left_out(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    first = _torchrun(traces, 4, NOPS="5")
    assert first.returncode == 0, first.stderr[-3000:]
    # every file holds one process's lines: the agent wrote none
    for rank in range(4):
        assert (traces / f"rank{rank}.jsonl").read_text().count('"trace_started"') == 1
    second = _torchrun(traces, 2, NOPS="3", DIE_RANK="1")  # rank 1 dies without a dump: its old one stays
    assert second.returncode != 0
    assert (traces / "rank0.jsonl").read_text().count('"trace_started"') == 2

    scan = analysis.JobScan([str(traces)])
    found = analysis.diagnose(scan)
    assert sorted(scan.sources) == [0, 1], scan.problems
    left_out = [p for p in scan.problems if p.startswith("left out ")]
    assert len(left_out) == 1 and all(f"rank{r}.json" in left_out[0] for r in (1, 2, 3)), scan.problems
    assert "rank1.jsonl" not in left_out[0]  # the second run's rank 1 wrote its lines before it died
    appended = [p for p in scan.problems if "left out lines" in p]
    assert sorted(Path(p.split(":")[0]).name for p in appended) == ["rank0.jsonl", "rank1.jsonl"], scan.problems
    # what the reader says is the second run's: rank 0 waits in all_reduce #4 for rank 1, which left no dump
    assert not found["ok"]
    text = str(found)
    assert "#4" in text and "#5" not in text, text[:3000]


def _dump(directory: Path, rank: int, started_s: float, written_s: float) -> Path:
    """A dump of rank ``rank`` whose process began tracing at ``started_s`` and which was
    last written at ``written_s`` (seconds since the epoch)."""
    path = directory / f"rank{rank}.json"
    doc = new_dump(job="j", rank=rank, host="h", pid=100 + rank, wall_ns=int(started_s * 1e9), mono_ns=1,
                   reason="exit", dropped=0, communicators={}, records=[])
    path.write_bytes(orjson.dumps(doc))
    os.utime(path, ns=(int(written_s * 1e9), int(written_s * 1e9)))
    return path


def test_runs_are_told_apart_by_when_their_processes_traced(tmp_path: Path) -> None:
    t = 1_800_000_000.0
    for rank in (2, 3):  # an earlier run's ranks that the newer run does not have
        _dump(tmp_path, rank, t, t + 10)
    for rank in (0, 1):
        _dump(tmp_path, rank, t + 20, t + 30)
    problems: List[str] = []
    assert sorted(discover([str(tmp_path)], problems=problems)) == [0, 1]
    assert len(problems) == 1 and "rank2.json" in problems[0] and "rank3.json" in problems[0], problems
    # a file named on the command line is read all the same
    assert sorted(discover([str(tmp_path / "rank0.json"), str(tmp_path / "rank2.json")])) == [0, 2]
    # began within RUN_GAP_NS of the others' last write: one run (hosts' clocks differ a little)
    _dump(tmp_path, 2, t + 30.5, t + 31)
    _dump(tmp_path, 3, t + 30.5, t + 31)
    assert sorted(discover([str(tmp_path)])) == [0, 1, 2, 3]
    # a start after the file's own last write cannot be: that file does not take part
    _dump(tmp_path, 5, t + 1000, t + 41)
    assert sorted(discover([str(tmp_path)])) == [0, 1, 2, 3, 5]


@pytest.mark.timeout(60)
def test_a_relative_trace_directory_is_the_one_the_job_started_in(tmp_path: Path) -> None:
    """``COMMSLAYER_TRACE_DIR=traces`` and a script that changes directory after start-up
    (Hydra's runs do): every file lands in ``traces`` where the job started."""
    (tmp_path / "elsewhere").mkdir()
    ran = _torchrun(Path("traces"), 1, cwd=tmp_path, NOPS="3", CHDIR=str(tmp_path / "elsewhere"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["fr", "rank0.json", "rank0.jsonl"]
    assert not list((tmp_path / "elsewhere").iterdir())
