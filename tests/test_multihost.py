"""A plain multi-host job on commslayer: ``torchrun --nnodes 2`` across two
network-namespace hosts, routed with ``COMMSLAYER_ROUTE_C10D=1`` and no
per-host setting, starts (each rank's liveness listener is on its own
host's address) and names a SIGKILLed rank on the other host fast."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults.netns import Network

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "peer_loss_job.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2")


def _wait_for(paths, timeout_s: float, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, \
            "job did not start:\n" + "\n".join(p.stdout.read() if p.poll() is not None else "(running)" for p in procs)
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_plain_torchrun_nnodes_2_survivor_names_killed_rank(tmp_path):
    env = dict(os.environ, COMMSLAYER_ROUTE_C10D="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               COMMSLAYER_TRACE_DIR="")
    env.pop("COMMSLAYER_LIVENESS_HOST", None)
    with Network(2, "csmh") as net:
        procs = [subprocess.Popen(
            net.run(h, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(h),
                        "--nproc-per-node", "1", "--master-addr", net.address(1, 0), "--master-port", "29411",
                        str(JOB), str(tmp_path)]),
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for h in range(2)]
        try:
            _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 60, procs)
            killed_at = time.time()
            os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
            _wait_for([tmp_path / "error0.json"], 30, procs[:1])
            seen = json.loads((tmp_path / "error0.json").read_text())
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    assert seen is not None, "the survivor's all-reduces never failed"
    assert seen["type"] == "PeerLost", seen
    assert seen["ranks"] == [1] and ("rank 1" in seen["msg"] or "rank(s) 1" in seen["msg"]), seen
    assert seen["t"] - killed_at < 3.0, seen


def test_the_address_towards_the_store_is_this_hosts_own():
    """With nothing set, a rank advertises its own interface on the route to the store."""
    code = ("from commslayer.detect.addresses import advertised_host; import torch.distributed as dist;"
            "print(advertised_host(None))")
    env = dict(os.environ, MASTER_ADDR="10.77.1.1", MASTER_PORT="29412")
    for name in ("COMMSLAYER_LIVENESS_HOST", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    with Network(2, "csad") as net:
        got = [subprocess.run(net.run(h, [sys.executable, "-c", code]), env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=60).stdout.strip() for h in range(2)]
        named = subprocess.run(net.run(1, [sys.executable, "-c", code]), env=dict(env, GLOO_SOCKET_IFNAME="eth0"),
                               cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.strip()
    assert got == [net.address(1, 0), net.address(1, 1)]
    assert named == net.address(1, 1)
