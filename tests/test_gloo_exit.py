"""The wait for c10d Gloo's worker threads at exit (commslayer/gloo_exit.py).

A thread named as Gloo names its workers stands in for one: while it runs
(hashing without the GIL, so it stays runnable) the wait goes on; once it
sleeps or ends, the wait returns.  Real processes check that ``import torch``
registers the wait, through commslayer's entry point and through
``import commslayer`` with autoloading off.  How often a loaded machine aborts
a finished job without it: launch/bench/bench_gloo_exit.py, docs/bench/gloo-exit.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from commslayer import gloo_exit
from tests.jobs import gloo_worker_stand_in as stand_in

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads' states in /proc")


def test_the_stand_in_has_the_name_gloo_gives_its_workers():
    assert stand_in.NAME == gloo_exit.WORKER_NAME


@pytest.mark.timeout(30)
@pytest.mark.parametrize("run_s, timeout_s, then, low, high", [
    (0.5, 5.0, "asleep", 0.4, 1.4),  # the wait lasts while the worker runs and ends when it sleeps
    (3.0, 0.3, "running", 0.25, 1.5),  # the wait gives up at its deadline
])
def test_the_wait_lasts_while_a_worker_runs(run_s, timeout_s, then, low, high):
    t = stand_in.start(run_s, 1.0 if then == "asleep" else 0.0)
    t0 = time.monotonic()
    gloo_exit.wait_for_gloo_workers(timeout_s=timeout_s)
    took = time.monotonic() - t0
    states = gloo_exit._worker_states()
    assert states == ["S"] if then == "asleep" else "R" in states, states  # asleep, not ended: the wait saw it sleep
    assert low < took < high, took
    t.join()


def test_without_gloo_workers_the_wait_returns_at_once():
    assert gloo_exit._worker_states() == []
    t0 = time.monotonic()
    gloo_exit.wait_for_gloo_workers()
    assert time.monotonic() - t0 < 0.05


@pytest.mark.timeout(60)
@pytest.mark.parametrize("autoload, code, waits", [
    ("1", "import torch", True),  # commslayer's torch.backends entry point registers it
    ("0", "import torch, commslayer", True),  # autoloading off: import commslayer does
    ("0", "import torch", False),  # plain torch: nothing waits
])
def test_the_wait_is_registered_at_import(tmp_path, autoload, code, waits):
    """A process that ends while a Gloo worker still runs (for 1.8 s, within the wait's 2 s)
    lets it run to its end when commslayer registered the wait at import; plain torch ends
    it with the process."""
    marker = tmp_path / "ran-to-the-end"
    script = (f"{code}\nfrom tests.jobs.gloo_worker_stand_in import start\nstart(1.8, 5.0, {str(marker)!r})\n"
              "print('end', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload))
    assert proc.stdout is not None and proc.stdout.readline() == "end\n"
    assert proc.wait(timeout=30) == 0
    assert marker.exists() == waits
