"""A replica group's worker under ``commslayer-run --replicas R --spares S``: what torchrun
starts in place of the user's script, so that a restarted group's ranks can be warm spares.

torchrun restarts every rank of a replica group when one of them fails, and it
starts each as a process of its own; the launcher's warm spares
(commslayer.run.spares) are processes it started earlier, waiting in
``resilience.init()`` with their imports done.  So torchrun runs this file
(``python -S``, by path: the standard library only, in tens of milliseconds)
with the script and its arguments:

* in the group's first life (``TORCHELASTIC_RESTART_COUNT`` 0), or when the
  launcher's desk cannot be reached, it becomes the script (``exec``, the same
  pid, as torchrun would have started it);
* in a later life it sends the launcher's desk (a Unix socket in a directory
  only this user can enter, ``COMMSLAYER_SPARE_DESK``) its pid and environment,
  torchrun's variables for this rank.  The desk answers ``cold`` (no spare
  ready, or the job has a bug to stop on: then it becomes the script) or the
  spare that took the rank: that process gets this environment, this process
  stays as torchrun's handle on it.  SIGTERM, SIGINT and SIGHUP (torchrun
  stopping the group) are passed on to the spare; the spare's exit status,
  which the desk sends when it exits, is this process's (a signal as the same
  signal).  The spare follows this process: killed (torchrun's SIGKILL after its
  grace), it takes the spare with it (commslayer.train.spare).
"""

import json
import os
import signal
import socket
import sys
from typing import List, NoReturn, Optional

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ASK_TIMEOUT_S = 10.0  # for the desk's answer: a spare taken or not (its exit status has no deadline)


def main(argv: List[str]) -> None:
    script, args = argv[0], argv[1:]
    desk = os.environ.get("COMMSLAYER_SPARE_DESK", "")
    if not desk or (os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0") == "0":
        become(script, args)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(ASK_TIMEOUT_S)
        conn.connect(desk)
        conn.sendall(json.dumps({"pid": os.getpid(), "env": dict(os.environ)}).encode() + b"\n")
        answers = conn.makefile("rb")
        spare = _answer(answers.readline(), "pid")
    except OSError as exc:
        print(f"commslayer-run: the warm spares' desk at {desk} did not answer ({exc}); this rank starts cold",
              file=sys.stderr, flush=True)
        become(script, args)
    if spare is None or spare <= 0:  # no spare for this rank
        become(script, args)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: _forward(spare, signum))
    conn.settimeout(None)  # the spare runs as long as the rank does
    try:
        code = _answer(answers.readline(), "exit")
    except OSError:
        code = None
    if code is None:  # the desk gone with its launcher: a failed life
        code = 1
    if code < 0 and -code in signal.valid_signals():
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 1)


def _answer(line: bytes, name: str) -> Optional[int]:
    """The integer ``name`` of the desk's answer ``line`` (a JSON object), None if it has none."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    found = value.get(name) if isinstance(value, dict) else None
    return found if type(found) is int else None


def become(script: str, args: List[str]) -> NoReturn:
    """Run the script in this process, as torchrun would have (``-u``: unbuffered)."""
    os.execv(sys.executable, [sys.executable, "-u", script, *args])


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
