"""A bug is not a fault: how a rank's failure is told apart, recorded, and read by the launcher.

A resilient job recovers from *faults*: a process or host that was lost (a
signal, an OOM kill, a cut link, a hung peer).  Restarting after a *bug*
only repeats it: an exception of the script's own code fires again in the
replacement, which redoes the step, and a launcher that takes it for a
fault restarts, reshards down to one rank and blames ranks that did nothing.
So a rank that ends by an exception records it here, and the launcher stops
the whole job at once when the failure is *deterministic*:

- an exception of the script's own code (anything that is not a
  ``CommError``, does not carry one and is not a backend's error that a
  peer went away), unless this process had already seen a peer's loss: an
  error raised then is taken as its consequence;
- a ``CommError`` that is a mistake, not a loss (``MISTAKES``:
  ``InvalidArgument``, ``CollectiveMismatch``, ``StateMismatch``, ...);
- any failure that the previous life of the same rank had at the same step,
  of the same type, at the same line: it recurs (an OOM at one step, say).

A process that dies by a signal records nothing and stays a fault; the
launcher's crash-loop rule (``commslayer-run --crash-loop``) bounds those.
One exception: Gloo aborts a process (SIGABRT) when a peer sends more data
than the op expects, which only a collective mismatch does (ranks calling
one collective with different sizes), and says so on stderr; the launcher
reads the ranks' output, and ``record_gloo_abort`` makes that death a bug.

What is written to the job's store (the contract with ``commslayer.run.launcher``
and ``commslayer.run.supervisor``):

- ``failure/<unit>/<life>``: the ``Failure`` (JSON) of every life that ended
  by an exception;
- ``job/bugs``: JSON lines, one ``Failure`` per rank that ended by a
  deterministic failure; the launchers stop the job when it appears;
- ``replica-restarts/<r>``: in replica mode, the time each restarted life of
  replica group ``r`` began (its rank 0 writes it): the coordinator's
  crash-loop rule counts them;
- ``replica-healed/<r>``: the time each restarted life of replica group ``r``
  healed from a live replica (its rank 0 writes it).  A group with more
  restarts than heals holds no state; once that is every group, nothing is
  left to heal from, and the coordinator stops the job (``no_replica_left``)
  instead of letting the restarted groups wait to be admitted.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, List, Optional, Sequence

import commslayer
from commslayer.comm.backends import classify as backend_error
from commslayer.errors import CollectiveMismatch, CommError, ConfigError, InvalidArgument, NanDetected, PeerLost

BUGS = "job/bugs"
RESTARTS = "replica-restarts"
HEALED = "replica-healed"
MISTAKES = (InvalidArgument, CollectiveMismatch, ConfigError, NanDetected)  # and StateMismatch (resilience)


@dataclass
class Failure:
    """How one life of one rank ended by an exception."""

    unit: str  # the rank in the launcher's words: "rank 3", "replica group 1 rank 0"
    key: str  # the same, as a store key part: "rank3", "replica1.rank0"
    life: int  # TORCHELASTIC_RESTART_COUNT
    step: Optional[int]  # the step it was in; None: outside the loop
    error: str  # "ValueError: bad batch"
    where: str  # the last frame of the script's own code: "train.py:42, in loss_fn: raise ..." ("" if none)
    deterministic: str  # why it is a bug ("" for a fault)
    pid: int  # 0: not known (a replica group's rank that its torchrun started)
    time: float
    at: str = ""  # when not at a known step: where it was ("" : outside the training loop)

    def words(self) -> str:
        """One line: who, when, what, where."""
        at = f" at step {self.step}" if self.step is not None else f" {self.at or 'outside the training loop'}"
        where = f" ({self.where})" if self.where else ""
        pid = f", pid {self.pid}" if self.pid else ""
        return f"{self.unit} (life {self.life}{pid}) failed{at} with {self.error}{where}"

    def signature(self) -> tuple:
        """What must match for a failure to count as the same one again."""
        return self.step, self.error.split(":", 1)[0], self.where

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Failure":
        return cls(**json.loads(text))


def _ours() -> List[str]:
    """Directories whose frames are not the script's: the standard library, installed
    packages (torch included), and this project's packages."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(commslayer.__file__)))  # the repository, or site-packages
    mine = [os.path.join(here, p) for p in ("commslayer", "tracing", "faults", "fsdp_overlap")]
    paths = sysconfig.get_paths()
    return [os.path.realpath(p) + os.sep for p in
            [*mine, paths["stdlib"], paths["purelib"], paths["platlib"]] if p]


def user_frame(tb: Optional[TracebackType]) -> str:
    """The last frame of the traceback in the script's own code, as ``file:line, in
    function: source`` (the file relative to the working directory when inside it)."""
    skip = _ours()
    last = None
    for frame in traceback.extract_tb(tb):
        path = os.path.realpath(frame.filename)
        if not frame.filename.startswith("<") and not any(path.startswith(d) for d in skip):
            last = frame
    if last is None:
        return ""
    name = os.path.relpath(last.filename) if not os.path.relpath(last.filename).startswith("..") else last.filename
    source = f": {last.line.strip()}" if last.line else ""
    return f"{name}:{last.lineno}, in {last.name}{source}"


def _carries_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is, or wraps, a communication failure that is not a mistake (a
    DDP comm hook's error arrives wrapped in the futures it passed through), or is a
    backend's own error that a peer went away (Gloo's ``RuntimeError`` from a plain
    group, or from a path that did not classify it)."""
    seen = 0
    e: Optional[BaseException] = exc
    while e is not None and seen < 16:
        if isinstance(e, CommError) and not is_mistake(e):
            return True
        if isinstance(e, RuntimeError) and backend_error(e) is PeerLost:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    text = str(exc)
    return any(f"{cls}:" in text or f"{cls}(" in text for cls in LOSSES)


LOSSES = ("PeerLost", "CollectiveTimeout", "CommAborted", "StoreUnreachable", "ReplicaBroken")  # by name


def is_mistake(exc: BaseException) -> bool:
    """A ``CommError`` that says the script used the API wrongly, or diverged, rather
    than that a peer was lost."""
    return isinstance(exc, MISTAKES) or type(exc).__name__ in ("StateMismatch",)


def classify(exc: BaseException, saw_loss: bool) -> str:
    """Why ``exc`` ending a rank is a deterministic failure, or "" when it is a fault.
    ``saw_loss``: this process had seen a peer's loss before it (an error then is
    taken as that loss's consequence)."""
    if isinstance(exc, (KeyboardInterrupt, MemoryError)) or type(exc).__name__ == "OutOfMemoryError":
        return ""  # a signal or memory pressure: recovered, unless it recurs at the same step
    if is_mistake(exc):
        return f"{type(exc).__name__}: a mistake in how the script uses commslayer"
    if isinstance(exc, CommError) or _carries_loss(exc) or saw_loss:
        return ""
    return "an exception of the script's own code"


def record(store: Any, exc: BaseException, tb: Optional[TracebackType], *, unit: str, key: str, life: int,
           step: Optional[int], saw_loss: bool, error: str) -> Failure:
    """Classify and record how this life ends (``failure/<key>/<life>``); a deterministic
    failure, or one the previous life had at the same step and line, also goes to
    ``job/bugs``, which stops the job. Store errors are left to the caller."""
    failure = Failure(unit=unit, key=key, life=life, step=step, error=error, where=user_frame(tb),
                      deterministic=classify(exc, saw_loss), pid=os.getpid(), time=time.time())
    if not failure.deterministic and life > 0 and store.check([f"failure/{key}/{life - 1}"]):
        before = Failure.from_json(store.get(f"failure/{key}/{life - 1}").decode())
        if before.signature() == failure.signature() and failure.step is not None:
            failure.deterministic = f"life {before.life} failed the same way at the same step: it recurs"
    store.set(f"failure/{key}/{life}", failure.to_json())
    if failure.deterministic:
        store.append(BUGS, failure.to_json() + "\n")
    return failure


def _record_bug(store: Any, failure: Failure) -> Failure:
    """Write ``failure`` as its life's (``failure/<key>/<life>``) and as a bug (``job/bugs``)."""
    store.set(f"failure/{failure.key}/{failure.life}", failure.to_json())
    store.append(BUGS, failure.to_json() + "\n")
    return failure


GLOO_MISMATCH = "Is there a distributed collective mismatch in your code?"  # Gloo's last words before abort


def gloo_abort(line: str) -> bool:
    """Whether a line of a rank's output is Gloo's last words before it aborted the process on a
    collective mismatch."""
    return GLOO_MISMATCH in line


def record_gloo_abort(store: Any, line: str, *, unit: str, key: str, life: int, pid: int) -> None:
    """Record as a bug (``job/bugs``) the death of the rank whose output ``line`` (``gloo_abort``) is."""
    words = line.strip().split("] ", 1)[-1]  # after Gloo's "[enforce fail at <file>:<line>]"
    failure = Failure(unit=unit, key=key, life=life, step=None, error=f"CollectiveMismatch: Gloo aborted the "
                      f"process: {words}", where="", deterministic="CollectiveMismatch: ranks called one "
                      "collective with different sizes", pid=pid, time=time.time(), at="in a collective")
    store.append(BUGS, failure.to_json() + "\n")


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")  # what init_process_group's excepthook puts before each line
_EXCEPTION = re.compile(r"([A-Za-z_][\w.]*)(: .*)?")  # Python's last line of a traceback: "[module.]Type[: words]"
_NOT_BUGS = (*LOSSES, "DistNetworkError", "DistStoreError", "TimeoutError", "ConnectionError", "BrokenPipeError",
             "ConnectionAbortedError", "ConnectionRefusedError", "ConnectionResetError", "KeyboardInterrupt",
             "MemoryError", "OutOfMemoryError")  # a fault's, or its consequence's: a server away, memory short
START_TAIL = 40  # the lines of a life's output kept to tell what ended it before init


def start_failure(lines: Sequence[str]) -> Optional[str]:
    """The error that a process's last output ``lines`` show it died of, when it is one of
    the script's own before ``resilience.init()`` could record it: an exception's last line
    after its traceback (a failed import, a syntax error) or argparse's ``error:`` after its
    usage (a mistyped argument).  None for anything else: output without one, an error
    that a peer or the store went away (a fault's consequence)."""
    text = [_RANK_PREFIX.sub("", line.rstrip()) for line in lines if line.strip()]
    usage = next((i for i, t in enumerate(text) if t.startswith("usage:")), len(text))
    frame = next((i for i, t in enumerate(text) if t.startswith(("Traceback (most recent call last):", '  File "'))),
                 len(text))
    for i in range(len(text) - 1, 0, -1):
        line, before = text[i], text[i - 1]
        if usage < i and re.fullmatch(r"\S+: error: .+", line):
            return f"an argument the script refused ({line})"
        match = _EXCEPTION.fullmatch(line)
        if match and frame < i and before.startswith(" "):  # after a frame's source line or a caret
            name = match.group(1).rsplit(".", 1)[-1]
            if name in _NOT_BUGS or name.startswith("Dist") or \
                    (name == "RuntimeError" and backend_error(RuntimeError(line)) is PeerLost):
                return None
            return f"{name}{match.group(2) or ''}"
    return None


def record_start_failure(store: Any, lines: Sequence[str], *, unit: str, key: str, life: int,
                         pid: int) -> Optional[Failure]:
    """Record as a bug (``job/bugs``) the life whose process exited non-zero before it reached
    ``resilience.init()`` with its output ``lines`` ending in an error of the script's own
    (``start_failure``): its next life would fail the same way.  None when they do not."""
    error = start_failure(lines)
    if error is None:
        return None
    return _record_bug(store, Failure(unit=unit, key=key, life=life, step=None, error=error, where="",
                                      deterministic="the script failed before resilience.init(): it cannot start",
                                      pid=pid, time=time.time(), at="before resilience.init()"))


def record_early_exit(store: Any, *, unit: str, key: str, life: int, pid: int) -> Failure:
    """Record as a bug (``job/bugs``) the life that exited with status 0 after it joined the job
    and before any rank finished it (``sys.exit(0)`` in the loop, a ``return`` from it, the end
    of a script without ``job.finish()``): the others can only wait for it."""
    return _record_bug(store, Failure(
        unit=unit, key=key, life=life, step=None, error="an exit with status 0", where="",
        deterministic="a rank left the job before it finished (sys.exit, a return from the loop, or the script's "
        "end without job.finish()): every rank runs every step, then job.finish()",
        pid=pid, time=time.time(), at="before job.finish()"))


def record_restart(store: Any, replica: int) -> None:
    """A restarted life of replica group ``replica`` began (its rank 0 says it)."""
    store.append(f"{RESTARTS}/{replica}", f"{time.time()}\n")


def record_healed(store: Any, replica: int) -> None:
    """A restarted life of replica group ``replica`` healed from a live replica (its rank 0 says it)."""
    store.append(f"{HEALED}/{replica}", f"{time.time()}\n")


def restarts(store: Any, replica: int) -> List[float]:
    """When each restarted life of replica group ``replica`` began."""
    return _times(store, f"{RESTARTS}/{replica}")


def _times(store: Any, key: str) -> List[float]:
    return [float(x) for x in store.get(key).decode().split()] if store.check([key]) else []


def no_replica_left(store: Any, replicas: int, shards: int, gone: List[int]) -> Optional[str]:
    """Why no replica group holds the training state any more, or None while one may.

    A group holds it from the job's start until it is lost, and a restarted life of it
    again once it healed; a group whose torchrun gave up (``gone``) never again.  A
    group whose process died but whose restart has not begun yet is taken to hold it
    still, so this errs towards waiting.  The reason names each group's failures."""
    waiting = [r for r in range(replicas) if r not in gone and
               len(restarts(store, r)) > len(_times(store, f"{HEALED}/{r}"))]
    if not waiting or len(waiting) + len(set(gone)) < replicas:
        return None
    last = {r: _last_failure(store, r, shards) for r in range(replicas)}
    found = [f for f in last.values() if f is not None]
    # a survivor that torchrun ended (SIGTERM, 0.1 s after a peer's death) before it saw the loss records nothing
    told = "; ".join(f.words() if f is not None else f"replica group {r}: no rank recorded an exception (each was "
                     "killed, or ended by its torchrun before it could)" for r, f in last.items())
    same = {(f.step, f.error.split(":", 1)[0], f.where.split(",", 1)[0]) for f in found}
    # A peer lost is a death, whatever caused it: only errors of the ranks' own ops point at the script.
    hint = ("; every group failed the same way at the same step: more likely a bug in the script (a "
            "collective that only some ranks call, say) than a fault") \
        if len(found) > 1 and len(same) == 1 and not found[0].error.startswith("PeerLost") else ""
    return (f"every replica group was lost, so no live replica holds the training state to heal the restarted "
            f"groups from: the job stops instead of letting them wait to be admitted. {told}{hint}")


def unit_key(replica: int, rank: int) -> str:
    """Rank ``rank`` of replica group ``replica`` as a store key part (``Failure.key``)."""
    return f"replica{replica}.rank{rank}"


def _last_failure(store: Any, replica: int, shards: int) -> Optional[Failure]:
    """The first failure recorded by a rank of replica group ``replica``'s latest life that
    recorded any (None when each of its ranks was killed)."""
    for life in range(len(restarts(store, replica)), -1, -1):  # a group that gave up failed in its latest life
        keys = [f"failure/{unit_key(replica, k)}/{life}" for k in range(shards)]
        found = [Failure.from_json(store.get(k).decode()) for k in keys if store.check([k])]
        if found:
            return min(found, key=lambda f: f.time)
    return None


def bugs(store: Any) -> List[Failure]:
    """The deterministic failures recorded in the job's store, earliest first."""
    if not store.check([BUGS]):
        return []
    found = [Failure.from_json(line) for line in store.get(BUGS).decode().splitlines() if line.strip()]
    return sorted(found, key=lambda f: f.time)


def stop_message(found: List[Failure]) -> str:
    """The launcher's one line for a job stopped by deterministic failures."""
    first = found[0]
    others = sorted({f.unit for f in found[1:]} - {first.unit})
    also = f"; {', '.join(others)} failed too" if others else ""
    return (f"{first.words()}: a deterministic failure ({first.deterministic}), not a lost process: the job stops "
            f"and nothing is restarted{also}")


def saw_loss() -> bool:
    """Whether a communicator of this process has lost a peer, or failed otherwise than
    by a mistake, since its current generation began."""
    from commslayer.hooks import live_communicators

    for comm in live_communicators():
        life = comm.lifecycle
        if life.closed:  # an earlier generation, replaced after a recovery, or a communicator let go
            continue
        if life.lost_ranks or (life.failure is not None and not is_mistake(life.failure)):
            return True
    return False
