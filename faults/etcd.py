"""An etcd cluster of real processes on loopback ports, for the tests, the benchmarks and
the fault harness: started in a directory of its own, its members killed, stopped and
resumed one at a time, its leader found by asking each member.

Members are ``etcd`` (Debian's etcd-server, 3.4) with their default timing (100 ms
heartbeats, a 1 s election timeout), so a lost leader costs what it would cost a
real job.  ``close`` kills every member (also at exit).
"""

from __future__ import annotations

import atexit
import http.client
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Optional, Tuple

from commslayer.agree.etcdstore import SCHEME
from commslayer.run.processes import free_port

READY_S = 30.0  # how long a cluster may take to elect its first leader


def available() -> bool:
    """Whether ``etcd`` is installed."""
    return shutil.which("etcd") is not None


class EtcdCluster:
    """``size`` etcd members on loopback; ``url(job)`` is the address a job is given."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.workdir = Path(workdir)
        self.size = size
        self.clients = [free_port() for _ in range(size)]
        peers = [free_port() for _ in range(size)]
        names = [f"m{i}" for i in range(size)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers))
        self._commands = [
            ["etcd", "--name", names[i], "--data-dir", str(self.workdir / names[i]),
             "--listen-client-urls", f"http://127.0.0.1:{self.clients[i]}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.clients[i]}",
             "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
             "--initial-cluster", initial, "--initial-cluster-state", "new", "--logger", "zap",
             "--log-outputs", str(self.workdir / f"{names[i]}.log")]
            for i in range(size)]
        self.procs: List[Optional[subprocess.Popen]] = [None] * size
        self.workdir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)
        for i in range(size):
            self.start(i)
        self.wait_healthy()

    @property
    def endpoints(self) -> List[Tuple[str, int]]:
        return [("127.0.0.1", p) for p in self.clients]

    def url(self, job: str) -> str:
        """``etcd://127.0.0.1:p1,...,127.0.0.1:pN/job``."""
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints) + f"/{job}"

    # ------------------------------------------------------------- members
    def start(self, i: int) -> None:
        """Start member ``i`` (again: it keeps its data directory and rejoins)."""
        self.procs[i] = subprocess.Popen(self._commands[i], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def stop(self, i: int) -> None:
        """SIGSTOP member ``i``: its sockets stay open and answer nothing."""
        self._signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: int) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"etcd member {i} is not running")
        proc.send_signal(sig)

    def close(self) -> None:
        for i in range(self.size):
            self.kill(i)  # SIGKILL ends a stopped member too

    # ------------------------------------------------------------- status
    def status(self, i: int, timeout_s: float = 1.0) -> Optional[dict]:
        """Member ``i``'s ``/v3/maintenance/status``, or None if it does not answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.clients[i], timeout=timeout_s)
        try:
            conn.request("POST", "/v3/maintenance/status", "{}")
            response = conn.getresponse()
            return json.loads(response.read()) if response.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None
        finally:
            conn.close()

    def leader(self, timeout_s: float = READY_S) -> int:
        """The index of the member that leads, once one does (and a running member says so)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(self.size):
                if self.procs[i] is None:
                    continue
                st = self.status(i)
                if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return i
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd member leads within {timeout_s:g}s (logs in {self.workdir})")
            time.sleep(0.05)

    def wait_healthy(self, timeout_s: float = READY_S) -> None:
        """Until every running member answers and one of them leads."""
        deadline = time.monotonic() + timeout_s
        while not all(self.status(i) for i in range(self.size) if self.procs[i] is not None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"an etcd member does not answer within {timeout_s:g}s (logs in {self.workdir})")
            time.sleep(0.05)
        self.leader(max(0.0, deadline - time.monotonic()))
