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
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Hashable, List, Optional

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
        self._stopping = threading.Event()  # set by ``stop``: what it makes torchrun print is folded
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
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
                                errors="replace")  # a byte that is not UTF-8 must not end the reader: the rank
        # would block on its full pipe, and the job hang
        self.procs[key] = proc
        self._started.append(proc)
        t = threading.Thread(target=_relay, args=(proc, SignalTracebacks(on_line, self._stopping), self.exited),
                             daemon=True)
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
        self._stopping.set()
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


def _relay(proc: subprocess.Popen, on_line: "SignalTracebacks", exited: threading.Event) -> None:
    for line in proc.stdout:
        on_line(line)
    on_line.close()
    exited.set()


_CHAINED = ("", "During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
_SIGNAL_EXCEPTION = re.compile(r"SignalException: Process \d+ got signal: (\d+)$")
_HELD_LINES = 500  # a traceback longer than this is shown as it is


class SignalTracebacks:
    """One process's output on its way to ``on_line``, with the traceback a torchrun
    agent prints when ``stop`` signals it (tens of lines of torch's own frames ending
    in ``SignalException``, chained twice: nothing about the job) folded into one line
    once ``stopping`` is set.  Every other line passes as it came, and so does every
    other traceback, whole."""

    def __init__(self, on_line: Callable[[str], None], stopping: threading.Event) -> None:
        self._on_line = on_line
        self._stopping = stopping
        self._held: List[str] = []  # a traceback begun while stopping, not yet known to be torchrun's
        self._signal: Optional[str] = None  # the signal its last exception line names, once it ends in one

    def __call__(self, line: str) -> None:
        if self._held:
            text = line.rstrip("\n")
            if self._signal is None or text in _CHAINED or text.startswith("Traceback "):
                self._hold(line, text)
                return
            self._fold()  # the traceback ended in the signal's exception: this line is the next one
        if self._stopping.is_set() and line.startswith("Traceback (most recent call last):"):
            self._held = [line]
            return
        self._on_line(line)

    def _hold(self, line: str, text: str) -> None:
        self._held.append(line)
        if text in _CHAINED[1:] or text.startswith("Traceback "):
            self._signal = None  # another traceback of the chain follows
        elif self._signal is None and text and not text.startswith(" "):  # the traceback's exception
            found = _SIGNAL_EXCEPTION.search(text)
            if found is None:
                self._flush()
                return
            self._signal = found.group(1)
        if len(self._held) > _HELD_LINES:
            self._flush()

    def close(self) -> None:
        """The output ended: pass on, or fold, what is held."""
        if self._signal is not None:
            self._fold()
        elif self._held:
            self._flush()

    def _fold(self) -> None:
        self._on_line(f"(torchrun's traceback of signal {self._signal}, sent to stop it: {len(self._held)} lines "
                      "left out)\n")
        self._held, self._signal = [], None

    def _flush(self) -> None:
        held, self._held, self._signal = self._held, [], None
        for line in held:
            self._on_line(line)


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
