"""Per-rank supervision: each rank of a job is its own restart unit, started, watched and replaced here.

``commslayer-run`` without ``--replicas`` starts every rank of its host
directly (``python script.py args``, no torchrun) and replaces one that is
lost by a new process for the same rank, while the others live on: they hold
at a step boundary and hand the newcomer its shard (``commslayer.resilience``).
torchrun cannot do this: its agent ends every worker of its group when one
dies, and restarts them all.

What a rank and this module tell each other goes through the job's store
(the coordinator's TCPStore, or etcd); these keys are the whole contract:

- ``rank/<r>/life`` = ``n``: written here before life ``n`` of rank ``r``
  starts (its ``TORCHELASTIC_RESTART_COUNT``).
- ``rank/<r>/lost/<n>``: written by a surviving rank that found life ``n``
  of rank ``r`` lost (stopped, say: alive but shrunk out).  Life ``n + 1``
  starts without ending life ``n``: that one is superseded (should it run
  again it must find itself fenced, which is the ranks' business), its exit
  status is ignored and it is ended when the launcher exits.
- A life that exits non-zero or by a signal is replaced too; one that exits
  0 makes the rank ``rank/<r>/done``.  A life that exits 0 after it reached
  ``resilience.init()`` (``rank/<r>/member`` = its life, written by the rank)
  while ``job/finished`` is not written left the job early: a bug
  (``failures.record_early_exit``); one that exits non-zero before it
  reached ``init()`` with a Python traceback or argparse's error at the end of
  its output cannot start: a bug too (``failures.record_start_failure``).
- A rank that needs a replacement with none left (``--max-restarts`` per
  rank) is ``rank/<r>/gone``; the others are left running: they read it and
  decide.
- ``job/failed`` = a one-line reason, written by a rank that found the job
  cannot go on: no replacement starts any more, the ranks get the grace
  period to exit on their own (they dump their traces), then ``Failed``.
- ``job/bugs`` (``commslayer.train.failures``): a rank ended by a deterministic
  failure (an exception of the script, a mistake, or a failure that recurs
  at the same step): the job stops at once, every rank is ended (they dump
  their traces on SIGTERM), nothing is restarted, ``Failed`` names it.
- The same rank failing ``crash_loop`` times within ``crash_window_s``
  stops the job too (a crash loop), even when each failure looks like a
  fault.
- ``spare/<node>/<id>/ready``, ``.../rank`` and ``spare/<node>/tally``
  (``--spares``, commslayer.run.spares): a warm spare of host ``node`` is
  ready; the lost rank's next life it is to become (written here instead
  of starting a process); the spares used and left.
- ``job/resharded`` = ``{"epoch": e, "ranks": [...]}`` (JSON), written by a
  rank when the survivors of a loss with no replacement went on without it:
  they start their script again as a smaller job, the ranks listed (by
  their rank here) in their new order.  A rank not listed is retired (its
  ``gone`` is no failure), and no rank is replaced any more: a replacement
  would start with the job's first layout.

Keys are read with ``store.check``, which does not block, every
``POLL_S``, and at once when a process started here exits (its output
closes: ``ProcessSet.exited``).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from commslayer.train import failures
from commslayer.runs import FINISHED, RESHARDED
from commslayer.errors import StoreUnreachable
from commslayer.endpoints import is_etcd
from commslayer.run.processes import ProcessSet
from commslayer.run.spares import Spares

POLL_S = 0.1
RELAY_S = 1.0  # the longest an exited rank's last output lines are waited for before it is replaced
BUGS_SETTLE_S = 0.3  # after the first deterministic failure, the time for others' to be recorded beside it
FAILED = "job/failed"


class Failed(Exception):
    """The job could not go on; the message is the launcher's one line."""


class Stopped(Failed):
    """The launcher stopped the job: a rank's deterministic failure, or a crash loop."""


@dataclass
class RankJob:
    """What per-rank supervision needs to know of the job and of this host."""

    command: List[str]  # the script and its arguments, run by this interpreter
    env: Dict[str, str]  # every rank's environment, before the per-rank variables
    store_address: str  # the job's store: host:port, or etcd://...
    world_size: int
    node: int  # this host's node rank: it runs ranks node * per_node .. node * per_node + per_node - 1
    per_node: int
    max_restarts: int  # per rank
    grace_s: float
    coordinator: Optional[str]  # the coordinator this host joined; None: this host is it
    crash_loop: int = 3  # failures of one rank within crash_window_s that stop the job (0: never)
    crash_window_s: float = 600.0
    spares: int = 0  # warm spares kept on this host (commslayer.run.spares)

    @property
    def ranks(self) -> List[int]:
        return list(range(self.node * self.per_node, (self.node + 1) * self.per_node))


def rank_env(job: RankJob, rank: int, life: int) -> Dict[str, str]:
    """The environment of life ``life`` of ``rank``: what torchrun would set, and commslayer's."""
    env = dict(job.env, RANK=str(rank), LOCAL_RANK=str(rank - job.node * job.per_node),
               WORLD_SIZE=str(job.world_size), LOCAL_WORLD_SIZE=str(job.per_node), GROUP_RANK=str(job.node),
               TORCHELASTIC_RESTART_COUNT=str(life),
               COMMSLAYER_JOB_STORE=job.store_address, COMMSLAYER_RESTART_UNIT="rank",
               COMMSLAYER_NODE=str(job.node), COMMSLAYER_JOB_RANK=str(rank))
    for name in ("COMMSLAYER_REPLICA", "COMMSLAYER_REPLICAS"):  # replica mode's
        env.pop(name, None)
    if not is_etcd(job.store_address):  # the coordinator's TCPStore, where torchrun's would be
        env["MASTER_ADDR"], _, env["MASTER_PORT"] = job.store_address.rpartition(":")
        # as torchrun tells its workers: that store is served already, so an env:// rendezvous (a plain
        # init_process_group) connects to it on rank 0 too instead of trying to serve it again
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def supervise_ranks(job: RankJob, store: Any, procs: ProcessSet) -> List[int]:
    """Run this host's ranks until each is done or gone (on the coordinator: every
    rank of the job); the job's ranks that are gone.  Raises ``Failed`` on
    ``job/failed`` (after the grace period) or when the coordinator is lost (a
    ``--coordinator`` store is bounded: every poll checks that it answers)."""
    try:
        return _supervise_ranks(job, store, procs)
    except StoreUnreachable as exc:
        raise Failed(_unreachable(job.store_address, exc)) from None


def _supervise_ranks(job: RankJob, store: Any, procs: ProcessSet) -> List[int]:
    lives: Dict[int, int] = {}
    restarts: Dict[int, int] = {r: 0 for r in job.ranks}
    failed_at: Dict[int, List[Tuple[float, str]]] = {r: [] for r in job.ranks}  # (monotonic, why) of each failure
    ended: Set[int] = set()  # done or gone

    spares = Spares(job.spares, job.node, store, procs, job.command, rank_env(job, job.ranks[0], 0), echo) \
        if job.spares else None

    current: Dict[int, _Life] = {}

    def start(rank: int, life: int, why: str = "") -> None:
        lives[rank] = life
        store.set(f"rank/{rank}/life", str(life))
        env = rank_env(job, rank, life)
        current[rank] = _Life(store, rank, life, procs)
        if spares is not None and life > 0 and spares.take(rank, f"rank {rank}", env, why, current[rank]):
            return
        if life > 0:
            print(f"supervisor: rank {rank}: {why}; starting life {life} (restart {restarts[rank]} of "
                  f"{job.max_restarts})", flush=True)
        procs.start(rank, [sys.executable, *job.command], env, on_line=current[rank])

    def replace(rank: int, why: str) -> None:
        stop_on_bugs(store)  # written before that life exited: never restart a bug
        now = time.monotonic()
        failed_at[rank] = [(t, w) for t, w in failed_at[rank] if now - t <= job.crash_window_s] + [(now, why)]
        if job.crash_loop and len(failed_at[rank]) >= job.crash_loop:
            raise Stopped(f"rank {rank} failed {len(failed_at[rank])} times within {job.crash_window_s:g}s ("
                         + "; ".join(w for _, w in failed_at[rank]) + "): a crash loop (--crash-loop "
                         f"{job.crash_loop}/{job.crash_window_s:g}), not a fault to recover from: the job stops")
        if restarts[rank] >= job.max_restarts:
            ended.add(rank)
            store.set(f"rank/{rank}/gone", why)
            print(f"supervisor: rank {rank} is gone: {why}, and no restart is left (--max-restarts "
                  f"{job.max_restarts})", flush=True)
            return
        restarts[rank] += 1
        start(rank, lives[rank] + 1, why)

    for rank in job.ranks:
        start(rank, 0)
    retired: Set[int] = set()
    while True:
        procs.exited.clear()
        if spares is not None:
            spares.fill()
        stop_on_bugs(store)
        if store.check([FAILED]):
            _fail(job, store, procs)
        if not retired and store.check([RESHARDED]):
            kept = set(json.loads(store.get(RESHARDED))["ranks"])
            retired = set(range(job.world_size)) - kept
            ended |= retired & set(job.ranks)
            restarts.update({r: job.max_restarts for r in job.ranks})
            print(f"supervisor: the job goes on as ranks {sorted(kept)}; rank(s) {sorted(retired)} retired, no "
                  "rank is replaced any more", flush=True)
        for rank in job.ranks:
            if rank in ended:
                continue
            code, life = procs.procs[rank].poll(), lives[rank]
            if code is not None:
                procs.relayed(rank, RELAY_S)  # its last words may make it a bug
                current[rank].ended(code)
            if code == 0:
                ended.add(rank)
                store.set(f"rank/{rank}/done", "0")
            elif code is not None:
                replace(rank, f"life {life} {_exit(code)}")
            elif store.check([f"rank/{rank}/lost/{life}"]):
                replace(rank, f"life {life} was found lost by the other ranks")
        if len(ended) == len(job.ranks) and (job.coordinator or all_ended(store, "rank", job.world_size)):
            return [r for r in range(job.world_size) if r not in retired and store.check([f"rank/{r}/gone"])]
        procs.exited.wait(POLL_S)  # a process that exits wakes the loop at once


class _Life:
    """One life of a rank (a process started for it, or the spare that adopted it), as the
    bug rules see it.  Its output lines, called with each: this launcher's output; the
    check for Gloo's words before it aborts a process on a collective mismatch; the last
    lines, which tell what a life that exited before ``resilience.init()`` died of.  Its
    end (``ended``): the bugs an exit status shows."""

    def __init__(self, store: Any, rank: int, life: int, procs: ProcessSet) -> None:
        self._store, self._rank, self._life, self._procs = store, rank, life, procs
        self._unit, self._key = f"rank {rank}", f"rank{rank}"  # as failures records it
        self._tail: Deque[str] = deque(maxlen=failures.START_TAIL)

    def __call__(self, line: str) -> None:
        echo(f"[rank {self._rank}] {line}")
        self._tail.append(line)
        if failures.gloo_abort(line):
            failures.record_gloo_abort(self._store, line, unit=self._unit, key=self._key, life=self._life,
                                       pid=self._pid())

    def ended(self, code: int) -> None:
        """This life exited with ``code``.  Status 0 after it reached ``resilience.init()``
        while no rank finished the job: it left early (``failures.record_early_exit``).
        Non-zero before ``init()``, with no failure of its own recorded and its output ending
        in an error of the script's: it cannot start (``failures.record_start_failure``)."""
        member = f"rank/{self._rank}/member"  # written by the life in init()
        joined = self._store.check([member]) and int(self._store.get(member)) >= self._life
        if code == 0 and joined and not self._store.check([FINISHED]):
            failures.record_early_exit(self._store, unit=self._unit, key=self._key, life=self._life,
                                       pid=self._pid())
        elif code > 0 and not joined and not self._store.check([f"failure/{self._key}/{self._life}"]):
            failures.record_start_failure(self._store, list(self._tail), unit=self._unit, key=self._key,
                                          life=self._life, pid=self._pid())

    def _pid(self) -> int:
        return self._procs.procs[self._rank].pid


def _fail(job: RankJob, store: Any, procs: ProcessSet) -> None:
    reason = (store.get(FAILED).decode(errors="replace").strip().splitlines() or ["(no reason given)"])[0]
    print(f"supervisor: {FAILED}: {reason}; the ranks have {job.grace_s:g}s to exit", flush=True)
    deadline = time.monotonic() + job.grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.procs.values()):
        time.sleep(POLL_S)
    raise Failed(f"the job failed: {reason}")


def stop_on_bugs(store: Any) -> None:
    """Raise ``Failed`` naming the first deterministic failure once a rank recorded one
    (``commslayer.train.failures``); ranks failing the same way at the same moment (a bug
    that fires everywhere) are named with it."""
    if not store.check([failures.BUGS]):
        return
    time.sleep(BUGS_SETTLE_S)
    raise Stopped(failures.stop_message(failures.bugs(store)))


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def echo(line: str) -> None:
    """One line of a process's output, as it came."""
    sys.stdout.write(line)
    sys.stdout.flush()


def check_reachable(store: Any, address: str) -> None:
    """Raise ``Failed`` if the job's store no longer answers (this host's processes are then
    ended: without the job's store no step can commit, and a replacement could not rejoin),
    or once a rank recorded a deterministic failure (``stop_on_bugs``)."""
    try:
        stop_on_bugs(store)
    except StoreUnreachable as exc:
        raise Failed(_unreachable(address, exc)) from None


def _unreachable(address: str, exc: StoreUnreachable) -> str:
    """The launcher's line for a job's store that stopped answering."""
    holder = "etcd" if is_etcd(address) else "the coordinator"
    return f"{holder} (the job's store at {address}) is unreachable ({exc.what}); ended the processes started here"


def all_ended(store: Any, unit: str, count: int) -> bool:
    """Every ``unit`` (``replica`` or ``rank``) ``0..count-1`` of the job is done or gone."""
    return all(store.check([f"{unit}/{i}/done"]) or store.check([f"{unit}/{i}/gone"]) for i in range(count))
