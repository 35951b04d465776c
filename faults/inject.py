"""Faults fired from inside a job's own processes, and the log the harness reads.

Timing a fault from outside (a signal sent when a log line appears) misses
by the length of a step; a fault fired from inside the rank lands exactly
where it was asked for.  So the harness describes its faults as JSON in
``COMMSLAYER_FAULTS`` and every process of the job reads them when torch is
imported (the ``torch.backends`` entry point, ``faults.autoload``).  A
process keeps the faults aimed at its own job rank and fires each one:

* at the ``nth`` call of a collective (``op``) on a communicator whose name
  contains ``comm``: the communicator's method is wrapped on that instance,
  so the fault lands before the op is issued or, with ``during``, while it
  is in flight (needs no change to the job);
* at a step and phase of the job's loop, where the job calls ``point(step,
  phase)`` (launch/train.py does).

Every process also appends to ``COMMSLAYER_FAULTS_LOG`` (JSON lines): each
fault when it fires, and the first failure each of its communicators sees.
The harness and the launcher's summary read injection and detection times
from there (``commslayer.runs.read_log``); a restarted process reads it to
skip the faults an earlier life fired.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set

from commslayer.errors import ConfigError
from commslayer.runs import read_log
from tracing.dumps import open_append

if TYPE_CHECKING:
    from commslayer.hooks import HookHandle

ACTIONS = ("sigkill", "exit", "raise", "sigstop", "hang", "delay", "mismatch")
TOGETHER_WAIT = 10.0  # seconds a fault waits for the others of its ``together``; then it fires alone
PHASES = ("forward", "backward", "allreduce", "optimizer", "refresh")
MISMATCHES = ("shape", "dtype", "op")


class InjectedFault(Exception):
    """The exception a ``raise`` fault throws in the job's code."""


@dataclass
class Fault:
    """One fault aimed at one process of the job.

    ``rank`` is the job rank (``COMMSLAYER_JOB_RANK``, else ``RANK``).  ``life``
    is the target's torchrun restart count; None: whichever life reaches the
    trigger first, once per job (needs the log).  The trigger is ``step`` and
    ``phase`` (the job's ``point``) or the ``nth`` call of ``op`` on a
    communicator whose name contains ``comm`` (``op`` ``*``: every collective).  ``seconds``: how long a
    ``sigstop`` lasts, or the delay a ``delay`` fault adds before every matching
    op from the nth on (at a step: one pause there, a rank that stalls once).
    ``mismatch``: what a ``mismatch`` fault changes in the op's arguments (shape,
    dtype or the reduce op).  Faults that share a non-empty ``together`` fire at
    once: each, when due, waits until every one of them is due (``TOGETHER_WAIT``
    at most), so that two ranks die in the same op even when one of them reaches
    it later than the other would notice the first one's death."""

    action: str
    rank: int
    life: Optional[int] = 0
    step: Optional[int] = None
    phase: Optional[str] = None
    op: Optional[str] = None
    comm: str = ""
    nth: int = 1
    during: bool = False
    seconds: float = 0.0
    mismatch: Optional[str] = None
    together: str = ""
    index: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        from commslayer.comm.wire import BACKEND_OPS

        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r}: expected one of {ACTIONS}")
        # A field of the wrong type or sign would not fail: the fault would never match its rank, step or
        # call (``"1" != 1``), or fail deep inside the job when it is compared; so every field is checked here.
        _whole(self, "rank", self.rank, 0)
        for name, value in (("life", self.life), ("step", self.step)):
            if value is not None:
                _whole(self, name, value, 0)
        _whole(self, "nth", self.nth, 1)
        if self.op is not None and self.op != "*" and self.op not in BACKEND_OPS:
            raise ValueError(f"fault {self.action} on rank {self.rank}: op={self.op!r}: expected '*' or one of "
                             f"{', '.join(sorted(BACKEND_OPS))}")
        if not isinstance(self.comm, str):
            raise ValueError(f"fault {self.action} on rank {self.rank}: comm={self.comm!r}: a part of a "
                             "communicator's name (a string)")
        if not isinstance(self.during, bool) or (self.during and self.op is None):
            raise ValueError(f"fault {self.action} on rank {self.rank}: during={self.during!r}: true or false, "
                             "and true only for a fault at an op")
        if self.phase is not None and self.step is None:
            raise ValueError(f"fault {self.action} on rank {self.rank}: phase={self.phase!r} without a step")
        if self.mismatch is not None and self.action != "mismatch":
            raise ValueError(f"fault {self.action} on rank {self.rank}: mismatch={self.mismatch!r} is for a "
                             "mismatch fault only")
        # ``seconds`` reaches a timer process and time.sleep: a finite, non-negative number only.
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or not 0 <= self.seconds < math.inf:
            raise ValueError(f"fault {self.action} on rank {self.rank}: seconds={self.seconds!r} "
                             "must be a finite number >= 0")
        if (self.step is None) == (self.op is None):
            raise ValueError(f"fault {self.action} on rank {self.rank}: give a step (and phase) or an op, not both")
        if self.step is not None and self.phase not in PHASES:
            raise ValueError(f"fault phase {self.phase!r}: expected one of {PHASES}")
        if self.action == "mismatch" and (self.op is None or self.mismatch not in MISMATCHES
                                          or (self.mismatch == "op" and self.op != "all_reduce")):
            raise ValueError(f"a mismatch fault needs an op and mismatch one of {MISMATCHES} (op: all_reduce only)")
        if self.op == "*" and self.action != "delay":
            raise ValueError("op '*' (every collective) is for delay faults only")
        if not isinstance(self.together, str):
            raise ValueError(f"fault together={self.together!r}: a tag (a string) shared by faults that fire at once")

    def describe(self) -> str:
        what = {"sigkill": "SIGKILL", "exit": "exit(1)", "raise": "Python exception", "hang": "hang",
                "sigstop": f"SIGSTOP for {self.seconds:g}s", "delay": f"{self.seconds * 1e3:g} ms delay",
                "mismatch": f"{self.mismatch} mismatch"}[self.action]
        if self.step is not None:
            where = f"at step {self.step} ({self.phase})"
        else:
            where = f"{'during' if self.during else 'before'} {self.op} #{self.nth}" + \
                    (f" of '{self.comm}'" if self.comm else "")
            if self.action == "delay":
                where = f"before every {self.op}" + (f" of '{self.comm}'" if self.comm else "") + \
                        (f" from #{self.nth}" if self.nth > 1 else "")
        return f"{what} of rank {self.rank} {where}"


def _whole(f: Fault, name: str, value: Any, least: int) -> None:
    """Raise ``ValueError`` naming the field unless ``value`` is an int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"fault {f.action} on rank {f.rank!r}: {name}={value!r} must be a whole number >= {least}")


def encode(faults: List[Fault]) -> str:
    """The ``COMMSLAYER_FAULTS`` value for ``faults``."""
    return json.dumps([{k: v for k, v in asdict(f).items() if k != "index"} for f in faults])


def decode(text: str) -> List[Fault]:
    """The faults of a ``COMMSLAYER_FAULTS`` value; ``ConfigError`` naming the variable
    when it is not a JSON list of fault objects or a fault is not allowed."""
    try:
        specs = json.loads(text)
        if not isinstance(specs, list) or not all(isinstance(d, dict) for d in specs):
            raise ValueError("expected a JSON list of fault objects")
        return [Fault(**d) for d in specs]
    except (ValueError, TypeError) as exc:  # json's errors are ValueErrors; unknown fields are TypeErrors
        shown = text if len(text) <= 200 else text[:200] + "..."
        raise ConfigError(f"COMMSLAYER_FAULTS={shown!r} is not allowed: {exc} (the fault harness sets it; "
                          "unset it for a run without injected faults)") from None


def job_rank() -> Optional[int]:
    """This process's job rank (``commslayer.config.job_rank``), else torchrun's ``RANK``;
    None in a process that is no rank (a launcher, a torchrun agent): no fault is aimed at it."""
    from commslayer import config

    rank = config.job_rank()
    if rank is None and os.environ.get("RANK"):
        rank = int(os.environ["RANK"])
    return rank


def life() -> int:
    from commslayer import config

    return config.restart_count()


class Log:
    """The job's fault log: whole JSON lines appended by every process (O_APPEND)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def write(self, event: str, member: Optional[int] = None, **fields: Any) -> None:
        """Append one event; ``member``: the rank it is about (default: this process's job rank)."""
        if not self.path:
            return
        line = json.dumps({"event": event, "member": job_rank() if member is None else member, "life": life(),
                           "pid": os.getpid(), "t": time.time(), **fields}) + "\n"
        try:
            fd = open_append(self.path)  # never through a link planted as the log's name
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk or a refused path must not change what the job does
            print(f"commslayer faults: cannot write {self.path}: {exc}", file=sys.stderr, flush=True)

    def read(self) -> List[Dict[str, Any]]:
        return read_log(self.path) if self.path else []


class Injector:
    """This process's faults and the hooks that fire them."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.faults: List[Fault] = []
        self._count = 0  # faults of the job seen so far: a fault's index is its place among them
        self._fired = {e["fault"] for e in log.read() if e["event"] == "injected"}
        self._calls: Dict[int, int] = {}  # fault index -> matching calls so far
        self._lock = threading.Lock()
        self.rank = job_rank()
        self._unplaced: List[Fault] = []  # the job's faults, while this process's rank is unknown
        self._together: Dict[str, List[int]] = {}  # a ``together`` tag -> the indices of the job's faults with it
        self._at_steps = False  # whether step faults fire at the job's phases (``fire_at_steps``)
        self._step_faults = False  # whether the job has a fault at a step (not at an op)
        self._phase_hook: Optional[HookHandle] = None
        self._delaying: Set[int] = set()  # indices of the delay faults at an op that fired (they stay armed)
        self._exit_hook: Optional[HookHandle] = None

    def add(self, faults: List[Fault]) -> None:
        """Take the job's ``faults`` (every process gets the same list, in the same
        order) and keep those aimed at this process that no earlier life fired.
        A process with no rank in its environment (a script run without a launcher,
        but also the launcher itself or a torchrun agent) keeps them until it builds
        a communicator: its rank there is its rank (``attach``)."""
        for f in faults:
            f.index, self._count = self._count, self._count + 1
            if f.together:
                self._together.setdefault(f.together, []).append(f.index)
        if self.rank is None:
            self._unplaced += faults
        else:
            self._arm(faults)
        if any(f.step is not None for f in faults):
            self._step_faults = True
            self._hook_phases()

    def fire_at_steps(self) -> None:
        """Fire step faults at the phases of any job on ``commslayer.resilience``.  The
        phase hook is registered only once the job has a step fault: a run with none (a
        launcher's run directory sets the fault log alone) pays nothing per step."""
        self._at_steps = True
        self._hook_phases()

    def _hook_phases(self) -> None:
        from commslayer.hooks import register_phase_hook

        if self._at_steps and self._step_faults and self._phase_hook is None:
            self._phase_hook = register_phase_hook(
                lambda job, step, phase: self.point(step, phase, lambda: fault_window(job, step)))

    def _arm(self, faults: List[Fault]) -> None:
        now = life()
        for f in faults:
            if f.rank == self.rank and f.life in (None, now) and f.index not in self._fired:
                self.faults.append(f)
                _announce("armed", f, self.rank)
        if self.faults and self._exit_hook is None:
            from commslayer.comm.exits import register_before_exit

            self._exit_hook = register_before_exit(lambda status, why: self._never_fired(status))

    def _never_fired(self, status: int) -> None:
        """When the process ends well, one line on stderr for each fault armed here that did
        not fire: its step, call or communicator never came (a step past the job's last one,
        an nth call the job does not make), which would otherwise pass unseen."""
        if status != 0:
            return
        for f in self.faults:
            if f.index not in self._delaying:
                print(f"[rank {self.rank}] fault from COMMSLAYER_FAULTS never fired: {f.describe()}: the process "
                      "ended before that step or call", file=sys.stderr, flush=True)

    # ---------------------------------------------------------- step points
    def point(self, step: int, phase: str, claim: Optional[Callable[[], bool]] = None) -> None:
        """Fire the first fault due at ``step`` (or earlier) in ``phase``; ``claim()``
        says whether one may fire now (the job's own rule, e.g. one per generation).  A
        delay loses no process, so it fires without a claim and leaves the generation's to
        a fault that does."""
        due = [f for f in self.faults if f.phase == phase and f.step is not None and f.step <= step]
        if not due or (claim is not None and due[0].action != "delay" and not claim()):
            return
        self._fire(due[0], step=step, phase=phase)

    # ------------------------------------------------------- collective hooks
    def attach(self, comm: Any) -> None:
        """Wrap the methods of ``comm`` that a fault of this process targets; log its first failure."""
        from commslayer.comm.op_path import DIRECT_OPS, TALLY
        from commslayer.comm.wire import BACKEND_OPS

        if self.rank is None:
            self.rank = comm.get_rank()
            self._arm(self._unplaced)
            self._unplaced = []
        name = comm.get_name()
        table = comm.global_ranks or comm.members  # job ranks where known; the hook must not hold comm itself
        comm.register_error_hook(lambda err: self.log.write(
            "failure", self.rank, comm=name, error=type(err).__name__, ranks=list(err.ranks),
            members=_members(table, err.ranks), what=err.what))
        wrapped = set()
        for f in self.faults:
            if f.op is not None and f.comm in name:
                for op in [o for o in BACKEND_OPS if o not in ("send", "recv", "batch_p2p")] if f.op == "*" else [f.op]:
                    setattr(comm, op, self._wrap(f, getattr(comm, op), name))
                    wrapped.add(op)
        if wrapped & set(DIRECT_OPS[:TALLY]):
            # c10d's async ops reach the native path without these methods (commslayer.comm.op_path's
            # GroupBackend): declining them there sends them through the methods, wrapped
            comm.decline_native_async()

    def _wrap(self, f: Fault, call: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                n = self._calls[f.index] = self._calls.get(f.index, 0) + 1
            if f.action == "delay":
                if n >= f.nth:
                    if n == f.nth:
                        self.log.write("injected", self.rank, fault=f.index, action=f.action, what=f.describe(),
                                       comm=name)
                        _announce("fired", f, self.rank)
                        self._delaying.add(f.index)
                    time.sleep(f.seconds)
                return call(*args, **kwargs)
            if n != f.nth or f not in self.faults:
                return call(*args, **kwargs)
            if f.action == "mismatch" and f.mismatch is not None:  # Fault checked that it names one
                self._fire(f, comm=name, act=False)
                return call(*_mismatched(f.mismatch, args), **kwargs)
            if f.during:
                work = call(*args, **{**kwargs, "async_op": True})
                self._fire(f, comm=name)
                return work
            self._fire(f, comm=name)
            return call(*args, **kwargs)

        return wrapper

    # ---------------------------------------------------------------- firing
    def _fire(self, f: Fault, act: bool = True, **where: Any) -> None:
        self.faults.remove(f)
        if f.together:
            self._wait_for_the_others(f)
        self.log.write("injected", self.rank, fault=f.index, action=f.action, what=f.describe(), seconds=f.seconds,
                       **where)
        _announce("fired", f, self.rank)
        if not act:
            return
        if f.action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "exit":
            sys.exit(1)
        elif f.action == "raise":
            raise InjectedFault(f"injected fault: {f.describe()}")
        elif f.action == "sigstop":
            # A stopped process cannot wake itself: a child sends SIGCONT (faults.wake), from a
            # session of its own so that torchrun ending this worker's process group does not end it first.
            subprocess.Popen([sys.executable, "-m", "faults.wake", repr(time.monotonic() + f.seconds),
                              str(os.getpid())], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.action == "delay":
            time.sleep(f.seconds)
        elif f.action == "hang":
            while True:  # alive (heartbeats go on), but never issues the next op
                time.sleep(3600)

    def _wait_for_the_others(self, f: Fault) -> None:
        """Log ``f`` as due and wait until every fault of its ``together`` is (the log is the
        only channel the job's processes share); past ``TOGETHER_WAIT``, say so and go on."""
        if not self.log.path:
            return
        self.log.write("due", self.rank, fault=f.index)
        wanted = set(self._together[f.together])
        deadline = time.monotonic() + TOGETHER_WAIT
        while time.monotonic() < deadline:
            if wanted <= {e["fault"] for e in self.log.read() if e["event"] == "due"}:
                return
            time.sleep(0.002)
        print(f"[rank {self.rank}] fault {f.describe()}: the others of together={f.together!r} were not due "
              f"within {TOGETHER_WAIT:g} s; it fires alone", file=sys.stderr, flush=True)


def _announce(what: str, f: Fault, rank: Optional[int]) -> None:
    """One line on stderr when a fault is armed and when it fires, naming the variable it
    came from: a value left in an environment must never act unseen in a production job."""
    print(f"[rank {rank}] fault {what} from COMMSLAYER_FAULTS: {f.describe()} (unset it for a run without "
          "injected faults)", file=sys.stderr, flush=True)


def _members(table: List[int], ranks: Any) -> List[int]:
    """``ranks`` of a communicator as ``table`` (its job ranks, or member ids) names them."""
    try:
        return [int(table[r]) for r in ranks]
    except (IndexError, TypeError):
        return list(ranks)


def _mismatched(kind: str, args: tuple) -> tuple:
    """An op's positional arguments (its tensor first), changed the way a buggy rank
    would: the tensor one element short or in float64, or (all_reduce) MAX for the
    reduce op."""
    import torch

    from commslayer import ReduceOp

    tensor, rest = args[0], args[1:]
    if kind == "shape":
        return (tensor.flatten()[:-1], *rest)
    if kind == "dtype":
        return (tensor.to(torch.float64), *rest)
    return (tensor, ReduceOp.MAX, *rest[1:])


_injector: Optional[Injector] = None


def injector() -> Injector:
    """This process's injector, built from ``COMMSLAYER_FAULTS`` the first time."""
    global _injector
    if _injector is None:
        from commslayer import config

        _injector = Injector(Log(config.faults_log()))
        _injector.add(decode(config.faults() or "[]"))
    return _injector


_installed = False


def install() -> None:
    """Attach the injector to every communicator this process builds from now on, and
    fire step faults at the phases of any job on ``commslayer.resilience`` (idempotent)."""
    from commslayer.hooks import live_communicators, register_communicator_hook

    global _installed
    if _installed:
        return
    _installed = True
    inj = injector()
    register_communicator_hook(inj.attach)
    for comm in live_communicators():
        inj.attach(comm)
    inj.fire_at_steps()


def fault_window(job: Any, step: int) -> bool:
    """Whether a step fault may fire at ``step`` of a resilient job (``commslayer.train.job.Job``):
    every replica group live, each committed a step since it last came back (with one
    group healing and another one killed, no copy of the state would be left), and no
    other fault fired in this generation (faults of two groups in one step would leave
    no copy either)."""
    healed = job.healed_at if job.healed_at is not None else -1
    if len(job.live_replicas) < job.replicas or step <= max([healed] + [a.step for a in job.admissions]):
        return False
    return job.store.add(f"faults/generation/{job.generation}", 1) == 1


def point(step: int, phase: str, claim: Optional[Callable[[], bool]] = None) -> None:
    """The job's step points (``Injector.point`` of this process)."""
    injector().point(step, phase, claim)
