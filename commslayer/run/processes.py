"""The processes of a job, started and ended as one set, and the helpers to find them.

A job's launcher (``commslayer.run.launcher``) and the fault harness
(``faults.harness``) both start processes that start others in sessions of
their own (torchrun does for its workers), and both must leave nothing
behind however they exit.  This process becomes a subreaper, so what
outlives its parent is re-parented here and found among this process's
descendants in ``/proc`` (Linux).  And what it starts dies with it: each
process starts through ``_TIED``, which asks the kernel to SIGTERM it when
its parent dies (``PR_SET_PDEATHSIG``, kept across ``exec``), so a launcher
that is SIGKILLed, and cannot end anything itself, leaves no rank running
on (a torchrun agent ends its workers on that SIGTERM).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Hashable, List

PR_SET_CHILD_SUBREAPER = 36
# Run as ``python -S -c _TIED <parent pid> <command...>`` (no site: a few ms): SIGTERM on the
# parent's death, then the command in this process. A parent that died before the request
# was made is seen as a changed parent pid.
_TIED = ("import ctypes, os, signal, sys\n"
         "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
         "if os.getppid() != int(sys.argv[1]):\n"
         "    os._exit(1)\n"
         "os.execvp(sys.argv[2], sys.argv[2:])\n")


class ProcessSet:
    """Processes started here, each in a session of its own, its output handed
    line by line to a callback; ``stop`` ends them and everything they started.
    ``procs`` holds each key's latest process: a key started again (a restarted
    rank) supersedes its process there, which ``stop`` still ends."""

    def __init__(self, grace_s: float) -> None:
        self.procs: Dict[Hashable, subprocess.Popen] = {}
        self._started: List[subprocess.Popen] = []  # superseded ones included
        self._grace_s = grace_s
        self._readers: List[threading.Thread] = []
        self._relays: Dict[Hashable, threading.Thread] = {}  # each key's latest process's output reader
        self.exited = threading.Event()  # set when a process's output ends (it exited): a supervisor wakes
        # A caller's children from before are not ours to end.
        self._before = set(descendants(os.getpid()))

    def start(self, key: Hashable, cmd: List[str], env: Dict[str, str],
              on_line: Callable[[str], None]) -> subprocess.Popen:
        """Start ``cmd`` in the caller's working directory; stdout and stderr, merged,
        go to ``on_line`` one line at a time. Started from the main thread, it is ended
        by the kernel when this process dies (the parent-death signal follows the thread
        that started the child, and only the main thread lives as long as the process)."""
        if threading.current_thread() is threading.main_thread() and sys.platform == "linux":
            cmd = [sys.executable, "-S", "-c", _TIED, str(os.getpid()), *cmd]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
        self.procs[key] = proc
        self._started.append(proc)
        t = threading.Thread(target=_relay, args=(proc, on_line, self.exited), daemon=True)
        t.start()
        self._readers.append(t)
        self._relays[key] = t
        return proc

    def rename(self, key: Hashable, new: Hashable) -> None:
        """Hold the process started under ``key`` under ``new`` from now on (a spare that
        became a rank's life), superseding ``new``'s."""
        self.procs[new] = self.procs.pop(key)
        self._relays[new] = self._relays.pop(key)

    def relayed(self, key: Hashable, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the output of the process started under ``key``,
        which has exited, has all reached its ``on_line``."""
        relay = self._relays.get(key)
        if relay is not None:
            relay.join(timeout_s)

    def stop(self) -> None:
        """End every process started here, and everything they started: SIGTERM to
        each one's process group (a torchrun agent then ends its workers) and SIGCONT
        (a stopped process handles its SIGTERM only once it runs), SIGKILL after the
        grace period to whatever is left below this process."""
        live = [p for p in self._started if p.poll() is None]
        for p in live:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self._grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while left := [pid for pid in descendants(os.getpid()) if pid not in self._before]:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self._started:
                p.poll()  # reap
            time.sleep(0.05)
        for p in self._started:
            p.wait()
        for t in self._readers:
            t.join(timeout=1)


def _relay(proc: subprocess.Popen, on_line: Callable[[str], None], exited: threading.Event) -> None:
    for line in proc.stdout:
        on_line(line)
    exited.set()


def descendants(pid: int) -> List[int]:
    """Every live (not zombie) process below ``pid``, from /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init (Linux;
    elsewhere nothing happens)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port free on every interface now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
