"""The launcher's side of warm spares (``commslayer-run --spares S``, per-rank mode): start
them, keep S, hand one a lost rank.

Each host's launcher keeps ``S`` spares of its own (per node, with
``--nnodes``): processes of the user's script that wait in
``resilience.init()`` with their imports done (commslayer.train.spare, which
also says what a spare is and is not).  Where the supervisor
(commslayer.run.supervisor) would start a lost rank's next life, it first
asks ``take`` for a spare that is ready; the spare becomes that life (the
process the supervisor watches for the rank) and a new spare starts in the
background once the job has recovered: when the survivors recorded the
recovery in the job's store (``commslayer.runs.record``, at the first step
committed after it), or ``SUCCESSOR_WAIT_S`` after the rank was handed
over, whichever comes first.  A spare starting is a Python process
importing torch and the script's modules (1.3–1.4 s in the benchmark's
cold replacement): started at once, it took that CPU from the ranks
redoing the interrupted step (on the benchmark's 2 cores, 4 ranks: the
redone step 0.42 s, 0.29 s with the successor deferred).  With no spare
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
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from commslayer.run.processes import ProcessSet
from commslayer.runs import RECOVERIES, spare_tally_key
from commslayer.train.spare import ASSIGNED, assignment, key

MAX_FAILURES = 3  # spares of one host that died waiting, in a row, before the host stops starting them
SUCCESSOR_WAIT_S = 30.0  # the longest a taken spare's successor waits for the job to record its recovery


class Spares:
    """This host's warm spares: ``count`` of them kept started, watched, and handed out."""

    def __init__(self, count: int, node: int, store: Any, procs: ProcessSet, command: List[str], env: Dict[str, str],
                 echo: Callable[[str], None]) -> None:
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
        # while a taken spare's successor waits for the recovery: the recoveries recorded when it
        # was taken, and when it starts anyway (monotonic)
        self._deferred: Optional[Tuple[int, float]] = None

    def fill(self) -> None:
        """Start spares until ``count`` wait (unless they keep dying); reap those that died;
        the tally in the job's store says what changed."""
        for sid, proc in list(self._waiting.items()):
            code = proc.poll()
            if code is None:
                if sid in self._started and self._store.check([key(self._node, sid, "ready")]):
                    print(f"supervisor: spare {sid} ready, {time.monotonic() - self._started.pop(sid):.1f}s after "
                          "its start", flush=True)
                continue
            del self._waiting[sid]
            self._failures += 1
            where = "while it waited" if self._store.check([key(self._node, sid, "ready")]) else \
                "before it reached resilience.init()"
            print(f"supervisor: spare {sid} (pid {proc.pid}) exited with {code} {where}; it held no rank"
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
        if self._recoveries() > seen or time.monotonic() > deadline:
            self._deferred = None
        return self._deferred is None

    def _recoveries(self) -> int:
        """How many recoveries the job's ranks recorded so far."""
        return self._store.get(RECOVERIES).count(b"\n") if self._store.check([RECOVERIES]) else 0

    def _start(self) -> None:
        sid, self._next = self._next, self._next + 1
        self._outputs[sid] = lambda line: self._echo(f"[spare {sid}] {line}")
        env = dict(self._env, COMMSLAYER_SPARE=str(sid))
        proc = self._procs.start(("spare", sid), [sys.executable, *self._command], env,
                                 on_line=lambda line: self._outputs[sid](line))
        self._waiting[sid] = proc
        self._started[sid] = time.monotonic()
        print(f"supervisor: spare {sid} started (pid {proc.pid})", flush=True)

    def take(self, rank: int, env: Dict[str, str], why: str,
             on_line: Callable[[str], None]) -> Optional["subprocess.Popen[str]"]:
        """Hand ``rank``'s next life (its environment ``env``) to a ready spare: its process,
        which the caller watches as the rank's from now on (under the key ``rank``), its
        output lines going to ``on_line`` as a process started for that life would; None
        when no spare is ready."""
        for sid, proc in sorted(self._waiting.items()):
            if proc.poll() is None and self._store.check([key(self._node, sid, "ready")]):
                break
        else:
            return None
        del self._waiting[sid]
        self._failures = 0
        self.used += 1
        self._store.set(key(self._node, sid, "rank"), assignment(env, why))
        self._outputs[sid] = on_line
        self._procs.rename(("spare", sid), rank)
        if self._deferred is None:
            self._deferred = (self._recoveries(), time.monotonic() + SUCCESSOR_WAIT_S)
        print(f"supervisor: rank {rank}: {why}; spare {sid} (pid {proc.pid}) takes life "
              f"{env['TORCHELASTIC_RESTART_COUNT']}; its successor starts once the job has recovered", flush=True)
        self.fill()  # the tally written once
        return proc

    def tally(self) -> str:
        """What ``spare/<node>/tally`` holds (JSON): spares used and left on this host."""
        return json.dumps({"used": self.used, "left": len(self._waiting)})
