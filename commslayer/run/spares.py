"""The launcher's side of warm spares (``commslayer-run --spares S``): start them, keep S,
hand one a lost rank (per-rank mode's supervisor) or a restarted replica group's rank
(replica mode's ``Desk``).

Each host's launcher keeps ``S`` spares of its own (per node, with
``--nnodes``): processes of the user's script that wait in
``resilience.init()`` with their imports done (commslayer.train.spare, which
also says what a spare is and is not).  Where the supervisor
(commslayer.run.supervisor) would start a lost rank's next life, it first
asks ``take`` for a spare that is ready; the spare becomes that life (the
process the supervisor watches for the rank) and a new spare starts in the
background once the job has recovered: when the ranks recorded a recovery
or an admission in the job's store after the rank was handed over
(``commslayer.runs.record``: per-rank mode's survivors at the first step
committed after the loss; in replica mode, where the survivors went on
before torchrun restarted the group, the restarted group let back in), or
``SUCCESSOR_WAIT_S`` after it was handed over, whichever comes first.  A
spare starting is a Python process importing torch and the script's
modules (1.3–1.4 s in the benchmark's cold replacement): started at once,
it took that CPU from the ranks redoing the interrupted step (on the
benchmark's 2 cores, 4 ranks: the redone step 0.42 s, 0.29 s with the
successor deferred).  With no spare
ready (none left, or the new one not started or still starting) the
replacement starts cold, as without spares.

A spare that dies while it waits is no rank's loss: it is started again,
and after ``MAX_FAILURES`` such deaths in a row (a script that cannot reach
``init``) the host goes on without spares, saying so.  A whole host lost
takes its spares with it; its ranks are replaced by no one and the
survivors reshard (commslayer.train.peerjob), as without spares.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from commslayer.run.processes import ProcessSet
from commslayer.runs import ADMISSIONS, RECOVERIES, spare_tally_key
from commslayer.train.failures import BUGS
from commslayer.train.spare import ASSIGNED, REPLICA_ASSIGNED, assignment, key

MAX_FAILURES = 3  # spares of one host that died waiting, in a row, before the host stops starting them
SUCCESSOR_WAIT_S = 30.0  # the longest a taken spare's successor waits for the job to record its recovery
REQUEST_TIMEOUT_S = 5.0  # for a shim's request to arrive whole (replica mode's desk)
MAX_REQUEST = 1 << 20  # bytes: a worker's environment, as JSON


class Spares:
    """This host's warm spares: ``count`` of them kept started, watched, and handed out."""

    def __init__(self, count: int, node: int, store: Any, procs: ProcessSet, command: List[str], env: Dict[str, str],
                 echo: Callable[[str], None], speaker: str = "supervisor") -> None:
        self.count = count
        self.used = 0  # spares that adopted a rank
        self._node = node
        self._store = store
        self._procs = procs
        self._command = command
        self._env = {k: v for k, v in env.items() if k not in ASSIGNED}
        self._echo = echo
        self._waiting: Dict[int, "subprocess.Popen[str]"] = {}  # spare id -> its process, not yet given a rank
        self._outputs: Dict[int, Callable[[str], None]] = {}  # where a spare's output lines go: ours, then its rank's
        self._next = 0
        self._failures = 0
        self._started: Dict[int, float] = {}  # spare id -> when it started, until it is seen ready
        self._published = ""  # the tally last written to the job's store
        # while a taken spare's successor waits for the recovery: the recoveries and admissions
        # recorded when it was taken, and when it starts anyway (monotonic)
        self._deferred: Optional[Tuple[int, float]] = None
        self._speaker = speaker  # who this host's launcher is in its lines
        self._lock = threading.Lock()  # replica mode's desk takes spares from threads of its own

    def fill(self) -> None:
        """Start spares until ``count`` wait (unless they keep dying); reap those that died;
        the tally in the job's store says what changed."""
        with self._lock:
            self._fill()

    def _fill(self) -> None:
        for sid, proc in list(self._waiting.items()):
            code = proc.poll()
            if code is None:
                if sid in self._started and self._store.check([key(self._node, sid, "ready")]):
                    print(f"{self._speaker}: spare {sid} ready, {time.monotonic() - self._started.pop(sid):.1f}s after "
                          "its start", flush=True)
                continue
            del self._waiting[sid]
            self._failures += 1
            where = "while it waited" if self._store.check([key(self._node, sid, "ready")]) else \
                "before it reached resilience.init()"
            print(f"{self._speaker}: spare {sid} (pid {proc.pid}) exited with {code} {where}; it held no rank"
                  + (f"; {MAX_FAILURES} spares died in a row: this host goes on without spares (a spare runs the "
                     "script with no rank up to resilience.init(): a script that reads RANK before it, or never "
                     "calls it, cannot have spares)" if self._failures == MAX_FAILURES else ""), flush=True)
        while len(self._waiting) < self.count and self._failures < MAX_FAILURES and self._recovered():
            self._start()
        tally = self.tally()
        if tally != self._published:
            self._store.set(spare_tally_key(self._node), tally)
            self._published = tally

    def _recovered(self) -> bool:
        """Whether no successor waits for a recovery any more (see the module doc)."""
        if self._deferred is None:
            return True
        seen, deadline = self._deferred
        if self._records() > seen or time.monotonic() > deadline:
            self._deferred = None
        return self._deferred is None

    def _records(self) -> int:
        """How many recoveries and admissions the job's ranks recorded so far."""
        return sum(self._store.get(k).count(b"\n") for k in (RECOVERIES, ADMISSIONS) if self._store.check([k]))

    def _start(self) -> None:
        sid, self._next = self._next, self._next + 1
        self._outputs[sid] = lambda line: self._echo(f"[spare {sid}] {line}")
        env = dict(self._env, COMMSLAYER_SPARE=str(sid))
        proc = self._procs.start(("spare", sid), [sys.executable, *self._command], env,
                                 on_line=lambda line: self._outputs[sid](line))
        self._waiting[sid] = proc
        self._started[sid] = time.monotonic()
        print(f"{self._speaker}: spare {sid} started (pid {proc.pid})", flush=True)

    def take(self, as_key: Hashable, who: str, env: Dict[str, str], why: str, on_line: Callable[[str], None],
             follow: Optional[int] = None) -> Optional["subprocess.Popen[str]"]:
        """Hand the next life of ``who`` (a rank, its environment ``env``) to a ready spare:
        its process, which the caller's process set holds under ``as_key`` from now on, its
        output lines going to ``on_line`` as a process started for that life would; None
        when no spare is ready.  ``follow``: the pid the spare ends with (replica mode's
        shim, which torchrun watches); the spare then takes ``env`` whole (``assignment``)."""
        with self._lock:
            return self._take(as_key, who, env, why, on_line, follow)

    def _take(self, as_key: Hashable, who: str, env: Dict[str, str], why: str, on_line: Callable[[str], None],
              follow: Optional[int]) -> Optional["subprocess.Popen[str]"]:
        for sid, proc in sorted(self._waiting.items()):
            if proc.poll() is None and self._store.check([key(self._node, sid, "ready")]):
                break
        else:
            return None
        del self._waiting[sid]
        self._failures = 0
        self.used += 1
        self._store.set(key(self._node, sid, "rank"), assignment(env, why, follow))
        self._outputs[sid] = on_line
        self._procs.rename(("spare", sid), as_key)
        if self._deferred is None:
            self._deferred = (self._records(), time.monotonic() + SUCCESSOR_WAIT_S)
        print(f"{self._speaker}: {who}: {why}; spare {sid} (pid {proc.pid}) takes life "
              f"{env['TORCHELASTIC_RESTART_COUNT']}; its successor starts once the job has recovered", flush=True)
        self._fill()  # the tally written once
        return proc

    def tally(self) -> str:
        """What ``spare/<node>/tally`` holds (JSON): spares used and left on this host."""
        return json.dumps({"used": self.used, "left": len(self._waiting)})


class Desk:
    """Replica mode's counter for spares: torchrun restarts every rank of a replica group,
    and each restarted rank's worker (commslayer.run.shim, which torchrun starts in place of
    the script) asks here, over a Unix socket in a directory only this user can enter,
    whether a spare takes its rank.  The answer is a spare's pid, its environment then
    the shim's (``Spares.take``), or ``cold``: none ready, or the job has a bug recorded
    (it stops; a spare never adopts one).  The connection stays open until the spare
    exits, and its exit status goes back to the shim, torchrun's handle on the rank."""

    def __init__(self, spares: Spares, store: Any, outputs: Dict[int, Callable[[str], None]]) -> None:
        self._spares, self._store, self._outputs = spares, store, outputs
        self._directory = tempfile.mkdtemp(prefix="commslayer-spares-")  # mode 0700
        self.path = os.path.join(self._directory, "desk")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(64)
        threading.Thread(target=self._accept, name="commslayer-spare-desk", daemon=True).start()

    def close(self) -> None:
        """Stop taking requests (a shim that asks now starts its rank cold)."""
        self._server.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="commslayer-spare-desk-rank", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(REQUEST_TIMEOUT_S)
                request = _request(conn.makefile("rb").readline(MAX_REQUEST))
                if request is None or int(request[1]["COMMSLAYER_REPLICA"]) not in self._outputs \
                        or self._store.check([BUGS]):
                    conn.sendall(b'{"cold": true}\n')
                    return
                pid, env = request
                replica, rank, life = (env[name] for name in ("COMMSLAYER_REPLICA", "RANK",
                                                               "TORCHELASTIC_RESTART_COUNT"))
                who = f"replica group {replica} rank {rank}"
                proc = self._spares.take((int(replica), int(rank)), who, env,
                                         f"torchrun restarted the group (life {life})",
                                         self._outputs[int(replica)], follow=pid)
                if proc is None:
                    conn.sendall(b'{"cold": true}\n')
                    return
                conn.sendall(json.dumps({"pid": proc.pid}).encode() + b"\n")
                conn.settimeout(None)
                conn.sendall(json.dumps({"exit": proc.wait()}).encode() + b"\n")
            except OSError:
                return  # the shim went away: the spare follows it (commslayer.train.spare)


def _request(line: bytes) -> Optional[Tuple[int, Dict[str, str]]]:
    """A shim's request (its pid and environment), or None if it is not one: the
    environment's strings must name a rank of a replica group (decimal numbers)."""
    try:
        given = json.loads(line)
        pid, env = given["pid"], given["env"]
    except (ValueError, KeyError, TypeError):
        return None
    if type(pid) is not int or pid <= 0 or not isinstance(env, dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()) \
            or not all(env.get(name, "").isdigit() for name in REPLICA_ASSIGNED):
        return None
    return pid, env
