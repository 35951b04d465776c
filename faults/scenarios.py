"""The scenarios: what each one injects, into which rank, and what the job must do.

A scenario is data.  Its faults fired from inside the job (``faults.inject``)
are built from the job's layout; a fault that must come from outside the
ranks (the coordinator killed, a link cut, a bandwidth cap, a full disk, an
etcd member killed or stopped) is
named by ``external`` and carried out by ``faults.harness``.  ``expect``
says what the job promises: ``survive`` (the survivors go on, the lost
replica group is restarted and heals, nothing is lost) or ``stop`` (the job
ends, every rank with an error that names the cause and a trace dump).

Most scenarios run a job of replica groups (``commslayer-run --replicas``).
The ``per_rank`` ones run a job without them (per-rank mode: every rank its
own restart unit, its state also held by its buddy, ``commslayer.train.peerjob``):
their layout is one group of all the ranks, with ``per_rank`` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from commslayer.train.redundancy import holders

from .inject import Fault

ETCD_THEN = 10  # the etcd scenarios' rank fault: this many steps after the etcd fault
ETCD_STOP_S = 5.0  # how long etcd-leader-stop keeps the leader stopped
FAULT_STEP = 10  # step faults fire here (or at the first step after it at which the job can survive them)


@dataclass(frozen=True)
class Layout:
    """The job's shape (``replicas`` replica groups of ``per_replica`` ranks each), the
    rank the faults aim at and the step they fire at.  The default target is the last
    rank: not the first of its group, so that check mode (which compares every rank
    with the group's rank 0) names it.  ``per_rank``: a job without replica groups
    (one group of every rank, ``replicas`` 1), in which every rank is restarted alone."""

    replicas: int
    per_replica: int
    target: int = -1
    step: int = FAULT_STEP
    per_rank: bool = False

    def __post_init__(self) -> None:
        if self.target == -1:
            object.__setattr__(self, "target", self.ranks - 1)
        if not 0 <= self.target < self.ranks:
            raise ValueError(f"rank {self.target}: the job has ranks 0..{self.ranks - 1}")

    @property
    def ranks(self) -> int:
        return self.replicas * self.per_replica

    def unit(self, member: int) -> int:
        """The restart unit of rank ``member``: its replica group, or the rank itself in per-rank mode."""
        return member if self.per_rank else member // self.per_replica

    @property
    def holder(self) -> int:
        """The rank that holds the target's state in per-rank mode (one host, one copy)."""
        return holders([0] * self.ranks, 1)[self.target][0]


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    summary: str
    promise: str
    faults: Callable[[Layout], List[Fault]] = lambda layout: []
    external: Optional[str] = None           # coordinator-kill | -stop | link-cut | bandwidth-cap | disk-full
    #                                          | etcd-leader-kill | etcd-leader-stop | etcd-quorum-loss
    expect: str = "survive"                  # survive | stop (the job cannot go on) | bug (the job stops on it)
    fast: bool = True                        # in the default test suite
    needs_root: bool = False
    per_replica: Optional[int] = None        # the layout it needs (default: the harness's)
    env: Dict[str, str] = field(default_factory=dict)
    max_restarts: int = 3
    culprit: bool = False                    # the viewer's diagnose must name the target rank
    straggler: bool = False                  # the viewer's summary must show the target as the straggler
    stopped: bool = False                    # the target is stopped and resumed: it must be fenced
    per_rank: bool = False                   # a job without replica groups (see the module doc)
    rank: Optional[int] = None               # the default target (default: the last rank)
    spares: int = 0                          # per-rank jobs: commslayer-run --spares (a warm spare takes the rank)


def _at_step(action: str, phase: str, **kw) -> Callable[[Layout], List[Fault]]:
    return lambda layout: [Fault(action, layout.target, step=layout.step, phase=phase, **kw)]


def _later(action: str, phase: str) -> Callable[[Layout], List[Fault]]:
    """A rank fault ``ETCD_THEN`` steps after the step of the scenario's external fault."""
    return lambda layout: [Fault(action, layout.target, step=layout.step + ETCD_THEN, phase=phase)]


def _at_op(action: str, op: str, comm: str, nth: Callable[[Layout], int], **kw) -> Callable[[Layout], List[Fault]]:
    return lambda layout: [Fault(action, layout.target, op=op, comm=comm, nth=nth(layout), **kw)]


def _all_gathers(layout: Layout) -> int:
    """About ``layout.step``'s first FSDP2 all-gather in launch/train.py's default model: 10 a step."""
    return 10 * layout.step


def _shard_op(per_step: int, at: int) -> Callable[[Layout], int]:
    """The ``at``-th call (from 1) at ``layout.step`` of a collective that launch/train.py's default
    model makes ``per_step`` times a step on the shard communicator of a per-rank job (counted in
    its traces: 9 all-gathers, 5 reduce-scatters)."""
    return lambda layout: per_step * layout.step + at


def _buddy_pair(layout: Layout) -> List[Fault]:
    """The target and the holder of its state killed in the same all-gather."""
    return [Fault("sigkill", rank, op="all_gather_single", comm="shards", nth=_shard_op(9, 5)(layout), during=True,
                  together="pair") for rank in (layout.target, layout.holder)]


def _mismatch(kind: str) -> Scenario:
    return Scenario(
        f"mismatch-{kind}", "bad-input",
        f"rank issues the job's per-step loss all_reduce with a different {kind} at step {FAULT_STEP}",
        "with COMMSLAYER_CHECK=1 every member of the communicator raises CollectiveMismatch naming the rank "
        "before anything is sent; a mismatch is a bug, not a fault: the job stops within seconds with the "
        "rank and the step named, every rank dumps its trace, nothing is restarted; the viewer names the rank",
        _at_op("mismatch", "all_reduce", "c10d", lambda layout: layout.step + 1, mismatch=kind),
        # shape in the default suite; every kind is also checked at the op level (tests/test_errors.py)
        env={"COMMSLAYER_CHECK": "1"}, expect="bug", culprit=True, fast=kind == "shape")


SCENARIOS: List[Scenario] = [
    Scenario("kill-step", "process-death", f"SIGKILL of a rank at step {FAULT_STEP}, in forward",
             "the survivors see the loss in milliseconds, drop the rank's replica group and redo the step; "
             "torchrun restarts the group, which heals from a survivor and rejoins at a step boundary",
             # the default suite fires this fault first in cascade, and names the culprit of a SIGKILL in kill-collective
             _at_step("sigkill", "forward"), culprit=True, fast=False),
    Scenario("kill-collective", "process-death",
             "SIGKILL of a rank while its 100th FSDP all-gather is in flight (fired from the op's own hook)",
             "as kill-step: the op in flight fails with PeerLost on the rank's group mates, the survivors redo "
             "the step",
             _at_op("sigkill", "all_gather_single", "c10d", _all_gathers, during=True), culprit=True),
    Scenario("exit", "process-death", f"a rank calls sys.exit(1) at step {FAULT_STEP}, before the optimizer step",
             "a clean exit is a loss like any other: seen at once (the connection closes), survived, healed",
             _at_step("exit", "optimizer"), fast=False),  # a rank that exits 0 is a loss in tests/test_lifecycle.py
    Scenario("exception", "bug", f"a Python exception in a rank's backward at step {FAULT_STEP}",
             "an exception of the script's own code is a bug, not a fault: a restart would only repeat it, so "
             "the job stops within seconds, the launcher names the rank, the step and the exception, every "
             "rank dumps its trace and nothing is restarted",
             _at_step("raise", "backward"), expect="bug", culprit=True, fast=False),
    Scenario("rank-exception", "bug", f"per-rank job: a Python exception in a rank's backward at step {FAULT_STEP}",
             "the same in a job without replica groups: the launcher neither replaces the rank nor reshards the "
             "job around it", _at_step("raise", "backward"), expect="bug", culprit=True, fast=False, per_rank=True),
    Scenario("sigstop", "hang", f"SIGSTOP of a rank for 5 s at step {FAULT_STEP} (then SIGCONT)",
             "the stopped rank is declared lost after the peer timeout (3 s), the survivors go on without it; "
             "when it resumes it is fenced (its group was dropped; it never commits another step) and its "
             "group is restarted and heals",
             _at_step("sigstop", "forward", seconds=5.0), stopped=True),
    Scenario("hang", "hang", "a rank never issues its 100th FSDP all-gather (alive, heartbeating, stuck)",
             "liveness cannot see it (it is alive): its group mate's op fails at the op deadline "
             "(COMMSLAYER_TIMEOUT_S=5 here) with CollectiveTimeout, the group leaves and is restarted; the "
             "survivors redo the step",
             _at_op("hang", "all_gather_single", "c10d", _all_gathers), env={"COMMSLAYER_TIMEOUT_S": "5"}),
    Scenario("straggler", "straggler", "a rank sleeps 20 ms before every collective of every communicator",
             "20 ms is far below the peer timeout: nobody is declared dead, no step is redone; the viewer's "
             "summary names the rank as the straggler",
             _at_op("delay", "*", "", lambda layout: 1, seconds=0.020), straggler=True),
    Scenario("link-cut", "network", "a rank's network link cut for 8 s (ip link set down), then restored",
             "the survivors declare the rank lost after the peer timeout and go on; the cut rank cannot reach "
             "anyone; once the link is back it finds itself fenced, leaves, is restarted and heals",
             external="link-cut", needs_root=True, per_replica=1, fast=False),
    Scenario("bandwidth-cap", "network", "a rank's link capped to 200 Mbit/s (tc tbf) from step 10",
             "the job slows to the capped link's pace; nobody is declared dead, no step is redone",
             external="bandwidth-cap", needs_root=True, per_replica=1, fast=False),
    Scenario("coordinator-kill", "coordinator", f"the coordinator process (the job's store) SIGKILLed at step "
             f"{FAULT_STEP}",
             "the coordinator is the job's single point of failure: every rank stops within the peer timeout "
             "with an error naming the job's store, and dumps its trace; the launcher ends the job (exit 1)",
             external="coordinator-kill", expect="stop"),
    Scenario("coordinator-stop", "coordinator", f"the coordinator process (the job's store) SIGSTOPped at step "
             f"{FAULT_STEP}, and never resumed",
             "a store that stops answering is found by its deadline (COMMSLAYER_STORE_TIMEOUT_S, 10 s); training "
             "goes on meanwhile (a fault-free step asks nothing of the store) until a call that needs it (world rank "
             "0's background read of the joiners, the end of the job) raises StoreUnreachable naming the store and "
             "the call that got no answer; a rank waiting on such a rank in a collective gets PeerLost when it "
             "leaves, one that had finished exits; every rank dumps its trace; the "
             "launcher finds the coordinator unreachable too (after twice the deadline) and ends the job (exit 1); "
             "nothing is left behind",
             # the default suite stops a store in tests/test_store_deadline.py, and kills the coordinator here
             external="coordinator-stop", expect="stop", fast=False),
    Scenario("etcd-leader-kill", "etcd", f"the job's store on a 3-member etcd cluster (--store etcd://); its "
             f"leader SIGKILLed at step {FAULT_STEP}; a rank SIGKILLed {ETCD_THEN} steps later",
             "the store's calls go to another member, served once the two left elect a leader (about 1 s): "
             "training goes on, nobody is declared dead for it; the rank's loss later is survived and healed "
             "as in kill-step, on the two members left", _later("sigkill", "forward"),
             external="etcd-leader-kill"),
    Scenario("etcd-leader-stop", "etcd", f"the job's store on a 3-member etcd cluster; its leader SIGSTOPped "
             f"for {ETCD_STOP_S:g} s at step {FAULT_STEP}; a rank SIGKILLed {ETCD_THEN} steps later",
             "as etcd-leader-kill: a call that gets no answer from the stopped member goes to another one after "
             "1 s; the resumed member catches up and follows", _later("sigkill", "forward"),
             external="etcd-leader-stop", fast=False),  # the default suite stops a leader in tests/test_etcd_store.py
    Scenario("etcd-quorum-loss", "etcd", f"the job's store on a 3-member etcd cluster; 2 of its 3 members "
             f"SIGKILLed at step {FAULT_STEP}",
             "no quorum, no store: training goes on (a fault-free step asks nothing of the store) until a call "
             "that needs it goes unserved until the store deadline (COMMSLAYER_STORE_TIMEOUT_S, 10 s) and raises "
             "StoreUnreachable naming etcd (a rank waiting in a collective on one that left gets PeerLost, one "
             "that had finished exits); every rank dumps its trace; the launcher ends the job (exit 1) naming "
             "etcd; no hang", external="etcd-quorum-loss", expect="stop",
             fast=False),  # the default suite loses a quorum in tests/test_etcd_store.py
    Scenario("trace-disk-full", "storage", "the trace directory on a full filesystem (a 2 MiB tmpfs, filled); "
             f"SIGKILL of a rank at step {FAULT_STEP}",
             "tracing never fails the job: each rank logs once that it cannot write, training survives and "
             "heals as in kill-step, and no half-written trace file is left",
             _at_step("sigkill", "forward"), external="disk-full", needs_root=True),
    _mismatch("shape"),
    _mismatch("dtype"),
    _mismatch("op"),
    Scenario("cascade", "cascade", f"SIGKILL of a rank at step {FAULT_STEP}; its restarted incarnation SIGKILLed "
             "again during its heal (the state broadcast)",
             "the second fault aborts the admission; the survivors go on, the group restarts again, heals and "
             "rejoins; nothing is lost",
             lambda layout: [Fault("sigkill", layout.target, step=layout.step, phase="forward"),
                             Fault("sigkill", layout.target, life=1, op="broadcast", comm="replicate", nth=2,
                                   during=True)]),
]

PEER_PROMISE = ("the survivors hold, the launcher starts a replacement for the rank, which gets the rank's state "
                "from its holder; the interrupted step is redone and every rank ends with the state of a "
                "fault-free run, bit for bit")
SCENARIOS += [
    Scenario("rank-kill-fsdp", "peer-redundancy", f"per-rank job: SIGKILL of a rank at step {FAULT_STEP}, in "
             "forward", PEER_PROMISE, _at_step("sigkill", "forward"), per_rank=True, culprit=True, fast=False),
    Scenario("rank-kill-refresh", "peer-redundancy", f"per-rank job: SIGKILL of a rank during the refresh of the "
             f"state copies at step {FAULT_STEP} (between the sizes and the bytes)",
             PEER_PROMISE + "; the cut refresh is not used: every rank goes back to the last boundary whose copies "
             "are complete", _at_step("sigkill", "refresh"), per_rank=True, culprit=True, fast=False),
    Scenario("rank-kill-reduce-scatter", "peer-redundancy", "per-rank job: SIGKILL of a rank while the 3rd "
             f"reduce-scatter of step {FAULT_STEP}'s backward is in flight",
             PEER_PROMISE + "; FSDP2's hooks never see the error (the group is held): the step runs on and is "
             "voted down", _at_op("sigkill", "reduce_scatter_single", "shards", _shard_op(5, 3), during=True),
             per_rank=True, culprit=True, fast=False),
    Scenario("rank-stop", "peer-redundancy", f"per-rank job: SIGSTOP of a rank for 8 s at step {FAULT_STEP} "
             "(then SIGCONT)",
             "the survivors declare it lost after the peer timeout (3 s) and mark it lost in the job's store; the "
             "launcher starts a replacement while the stopped process still exists, which heals from the holder; "
             "on SIGCONT the old process finds itself fenced (CommAborted) and never commits a step; the state "
             "ends as a fault-free run's", _at_step("sigstop", "forward", seconds=8.0), per_rank=True,
             stopped=True, fast=False),
    Scenario("rank-kill-spare", "peer-redundancy", f"per-rank job with a warm spare (--spares 1): SIGKILL of a "
             f"rank at step {FAULT_STEP}, in forward",
             "the launcher hands the rank's next life to the spare, already waiting in resilience.init() with its "
             "imports done, instead of starting a process; it gets the rank's state from its holder, the "
             "interrupted step is redone and every rank ends with the state of a fault-free run, bit for bit",
             _at_step("sigkill", "forward"), per_rank=True, culprit=True, fast=False, spares=1),
    Scenario("rank-stop-spare", "peer-redundancy", f"per-rank job with a warm spare (--spares 1): SIGSTOP of a "
             f"rank for 8 s at step {FAULT_STEP} (then SIGCONT)",
             "after the peer timeout (3 s) the survivors mark it lost; the spare takes its next life while the "
             "stopped process still exists; on SIGCONT the old process finds itself fenced and never commits a "
             "step; the state ends as a fault-free run's", _at_step("sigstop", "forward", seconds=8.0),
             per_rank=True, stopped=True, fast=False, spares=1),
    Scenario("buddy-pair-kill", "peer-redundancy", "per-rank job: a rank and the holder of its state (default "
             f"ranks 1 and 2) SIGKILLed in the same all-gather of step {FAULT_STEP}",
             "the rank's state has no copy left: the job stops. Every survivor raises StateLost naming the rank and "
             "the last committed step, writes job/failed and dumps its trace; nobody hangs; the launcher prints "
             "'the job failed' and exits 1", _buddy_pair, per_rank=True, rank=1, expect="stop",
             culprit=True),
]

BY_NAME: Dict[str, Scenario] = {s.name: s for s in SCENARIOS}
FAMILIES: List[str] = list(dict.fromkeys(s.family for s in SCENARIOS))
