"""The network testbed of launch/bench/bench_overlap.py (faults/netns.py): two capped rails per
rank, links that can be cut, and no namespace left behind when the benchmark fails or a run died."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from launch.bench import bench_overlap as bench
from faults import netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                                reason="needs root and iproute2")


def _qdisc(ns: str, dev: str) -> dict:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-j", "qdisc", "show", "dev", dev],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]


def _link(ns: str, dev: str) -> dict:
    out = subprocess.run(["ip", "-j", "-n", ns, "link", "show", "dev", dev], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)[0]


@pytest.mark.timeout(30)
def test_testbed_is_built_capped_and_removed_when_the_benchmark_fails():
    bed = netns.Network(2, bench.PREFIX, rails=("ag", "rs"), rate="100mbit")
    with pytest.raises(RuntimeError, match="benchmark failed"):
        with bed:
            assert {bed.hub, *bed.hosts} <= set(netns.namespaces())
            for ns in bed.hosts:
                for dev in ("ag", "rs"):
                    q = _qdisc(ns, dev)
                    assert q["kind"] == "tbf" and q["options"]["rate"] == 100_000_000 // 8
            bed.set_link(0, 2, up=False)
            assert "UP" not in _link(bed.hosts[0], "rs")["flags"]
            bed.set_link(0, 2, up=True)
            assert "UP" in _link(bed.hosts[0], "rs")["flags"]
            raise RuntimeError("benchmark failed")
    assert not [n for n in netns.namespaces() if n.startswith(bed.tag)]


@pytest.mark.timeout(30)
def test_leftovers_of_dead_runs_are_removed_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = f"{bench.PREFIX}{dead.pid}-r0", f"{bench.PREFIX}{os.getpid()}-r0"
    try:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        netns.remove_leftovers(bench.PREFIX)
        names = netns.namespaces()
        assert stale not in names and live in names
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
