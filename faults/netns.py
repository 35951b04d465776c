"""Hosts made of network namespaces, for benchmarks and tests that need a real network.

A ``Network`` is one namespace per host and a hub namespace with one bridge
per rail; every host has a veth link on every rail, named after the rail,
with the address ``10.77.<rail>.<host + 1>`` (rails count from 1), and
optionally a ``tc tbf`` rate cap in both directions.  Links can be cut and
restored (``set_link``), and one host's cap changed (``cap``).  Namespace names carry a prefix and this process's
id; ``close`` deletes them (also at exit), and ``remove_leftovers`` deletes
those of earlier runs whose process is gone.  Needs root and iproute2.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
from typing import Dict, List, Optional, Sequence


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers(prefix: str) -> None:
    """Delete the namespaces named ``<prefix><pid>-...`` whose process is gone."""
    for ns in namespaces():
        if not ns.startswith(prefix):
            continue
        pid = ns[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", ns, check=False)


def sent_bytes(devs: Sequence[str]) -> Dict[str, int]:
    """Bytes sent so far on each of ``devs`` in the calling process's namespace (tc's counters)."""
    out = {}
    for dev in devs:
        stats = json.loads(subprocess.run(["tc", "-s", "-j", "qdisc", "show", "dev", dev], check=True,
                                          capture_output=True, text=True).stdout)
        out[dev] = sum(q.get("bytes", 0) for q in stats)
    return out


def tcp_payload_sent() -> int:
    """Payload bytes the TCP sockets of the calling process's namespace have had
    acknowledged so far (``ss``'s ``bytes_acked``: no headers, no retransmissions)."""
    out = subprocess.run(["ss", "-tinH"], check=True, capture_output=True, text=True).stdout
    return sum(int(m) for m in re.findall(r"bytes_acked:(\d+)", out))


class Network:
    """``hosts`` host namespaces on ``rails``; removed by ``close`` (idempotent)."""

    def __init__(self, hosts: int, prefix: str, rails: Sequence[str] = ("eth0",), rate: Optional[str] = None) -> None:
        self.rails = list(rails)
        self.rate = rate
        self.tag = f"{prefix}{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.hosts = [f"{self.tag}-r{h}" for h in range(hosts)]
        self._made: List[str] = []

    @staticmethod
    def address(rail: int, host: int) -> str:
        return f"10.77.{rail}.{host + 1}"

    def run(self, host: int, cmd: Sequence[str]) -> List[str]:
        """``cmd`` run inside host ``host``."""
        return ["ip", "netns", "exec", self.hosts[host], *cmd]

    def set_link(self, host: int, rail: int, up: bool) -> None:
        """Cut (``up=False``) or restore host ``host``'s link on rail ``rail``."""
        _ip("-n", self.hosts[host], "link", "set", self.rails[rail - 1], "up" if up else "down")

    def __enter__(self) -> "Network":
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def cap(self, host: int, rate: Optional[str], rail: int = 1) -> None:
        """Cap host ``host``'s link on rail ``rail`` to ``rate`` (tc's units, e.g. ``100mbit``)
        both ways, replacing any cap; ``None`` lifts it."""
        dev, hub_end = self.rails[rail - 1], self._hub_end(host, self.rails[rail - 1])
        for ns, link in ((self.hosts[host], dev), (self.hub, hub_end)):  # what it sends; what it receives
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            subprocess.run(tc + ["del", "dev", link, "root"], capture_output=True)
            if rate:
                subprocess.run(tc + ["add", "dev", link, "root", "tbf", "rate", rate, "burst", "256kb",
                                     "latency", "50ms"], check=True, capture_output=True)

    @staticmethod
    def _hub_end(host: int, dev: str) -> str:
        return f"h{host}{dev}"[:15]

    def _build(self) -> None:
        self._netns(self.hub)
        for rail in range(1, len(self.rails) + 1):
            _ip("-n", self.hub, "link", "add", f"br{rail}", "type", "bridge")
            _ip("-n", self.hub, "link", "set", f"br{rail}", "up")
        for host, ns in enumerate(self.hosts):
            self._netns(ns)
            for rail, dev in enumerate(self.rails, start=1):
                hub_end = self._hub_end(host, dev)
                _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", dev, "netns", ns)
                _ip("-n", self.hub, "link", "set", hub_end, "master", f"br{rail}", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(rail, host)}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        if self.rate:
            for host in range(len(self.hosts)):
                for rail in range(1, len(self.rails) + 1):
                    self.cap(host, self.rate, rail)

    def close(self) -> None:
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
