"""The public resilience API (``commslayer.resilience``) on users' scripts, launched
the way a user launches them: real torchruns, real SIGKILLs, real sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MISUSE = ROOT / "tests" / "jobs" / "misuse_job.py"


def launch(script: Path, *script_args: str, replicas: int = 2, per_replica: int = 1, restarts: int = 0,
           run_dir: str = "", env: dict = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The launcher on ``script``; its whole output (the ranks' included)."""
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"), "--replicas", str(replicas), "--nproc-per-replica",
           str(per_replica), "--max-restarts", str(restarts), "--script", str(script)]
    if run_dir:
        cmd += ["--run-dir", run_dir]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", **(env or {}))
    return subprocess.run([*cmd, "--", *script_args], env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mistake, expected", [
    ("extra-state", ["StateMismatch", "replica 0 vs replica 1", "extra.value: missing vs float32[2]"]),
    ("shape", ["StateMismatch", "replica 0 vs replica 1", "counter.value: float32[3] vs float32[4]"]),
    ("no-grads", ["InvalidArgument", "step() at step 0 found no gradients"]),
    ("no-step", ["InvalidArgument", "step 0 ended without job.step()"]),
])
def test_a_mistake_is_a_clear_error_on_every_rank(mistake, expected):
    run = launch(MISUSE, mistake)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    leaving = [line for line in out.splitlines() if "leaving (" in line]
    assert len(leaving) == 2, out  # both replicas' ranks say why, in one line each
    for line in leaving:
        for text in expected:
            assert text in line, line
