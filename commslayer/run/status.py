"""``commslayer-run --status-port``: the coordinator's status server, a running job seen over HTTP.

This module owns the server and what it shows: a view of the job (``View``)
built from the job's store by one thread of its own, about once a second,
and three renderings of the latest view (the page and the metrics made by
that thread once per read: a scrape renders nothing), served to any number
of clients without touching the store:

- ``/``: an HTML page that reloads itself every ``REFRESH_S``: the job, each
  rank's state (``STATES``), life, last committed step, that step's time and
  the age of the rank's last status record, its current or last op and that
  op's age (named as ``commslayer-trace watch`` names it: the rank's recorder
  writes the name), the slowest rank of the last
  collectives, the recoveries so far (with the bytes the healed ranks
  received), each resizable communicator's live generation and members,
  the ops per communicator and op, the warm spares, and the fault log's
  injections when the fault harness runs;
- ``/metrics``: the Prometheus text format, written by ``prometheus_client``
  from a private registry (``Metrics``, a collector over the latest view);
- ``/healthz``: 200 while the job runs and every rank is accounted for, 503
  with the reason (naming the ranks) otherwise (``View.health``).

Where the figures come from: the store keys the launcher and the ranks
already share (commslayer.run.supervisor: ``rank/<r>/life``, ``.../gone``,
``.../done``, ``replica/<g>/done`` and ``gone``, ``job/resharded``,
``job/failed``, ``job/bugs``; commslayer.runs: the recoveries, admissions and
spares), the run directory's fault log, and each rank's status record
(``commslayer.train.job.status_key``), which a rank writes at a committed
step at most once a second; with its flight recorder on, that record also
carries the recorder's op figures and the step's collective arrivals
(tracing.record.figures), which the server sums over ranks and lives and
matches across ranks (``Memory``), and the rank's current or last op. A
rank stuck inside an op writes no status record; its flight recorder's
reporter, on the watchdog's thread, writes that op into its op record
(``commslayer.train.job.op_key``), which the server reads for a rank whose
status record is older than ``OP_STALE_S`` (tracing.record.figures). No
rank opens a port, and an op's path is unchanged. The server reads the store through a client of its own (the
coordinator's TCPStore or the etcd cluster), so a client of the page never
waits on the store, and the store never waits on a client.

Hostile clients: unknown paths get 404, methods other than GET and HEAD 405; a request line or header over
http.server's bounds (64 KiB a line, 100 headers) gets 414 or 431; every
connection has a socket timeout (``CLIENT_TIMEOUT_S``), so a slow client
holds one thread for that long at most; at most ``MAX_CLIENTS`` connections
are served at once, and those beyond are closed unanswered. The server is
unauthenticated: bind it to loopback (the default) or to a network that
may read the job's state.
"""

from __future__ import annotations

import gc
import html
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from commslayer import runs
from commslayer.agree.store import bounded, connect
from commslayer.train import failures
from commslayer.train.job import STATUS_EVERY_S, STATUS_SERVED, op_key, status_key
from commslayer.run.supervisor import FAILED

POLL_S = 1.0  # the view is read from the store this often
REFRESH_S = 2  # the page reloads itself this often
CLIENT_TIMEOUT_S = 10.0  # a connection that sends or reads nothing for this long is closed
MAX_CLIENTS = 64  # connections served at once
STORE_TIMEOUT = timedelta(seconds=10)
STATES = ("starting", "running", "lost", "restarting", "replaced", "fenced", "finished")
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
KEEP_STEPS = 4  # a rank's last recorded steps whose arrivals are kept
KEPT = ("life", "missed", "healed")  # what Memory keeps of each life's latest status record, besides its ops
OP_STALE_S = 2.5 * STATUS_EVERY_S  # a status record older than this: the rank's op record is read too


@dataclass
class Layout:
    """The job as its coordinator started it."""

    name: str  # the run directory's name, the etcd job's, or the script's
    per_rank: bool  # per-rank mode (each rank its own restart unit); else replica groups
    world: int  # ranks in the job
    group: int  # ranks per replica group (per-rank mode: per host)
    nodes: int  # hosts whose launchers keep warm spares (per-rank mode), else 0
    max_restarts: int
    run_dir: Optional[str]  # the fault log is read from here

    def unit(self, rank: int) -> Tuple[str, str]:
        """The restart unit of ``rank`` in the store's words: (``rank`` or ``replica``, its number)."""
        return ("rank", str(rank)) if self.per_rank else ("replica", str(rank // self.group))

    def unit_key(self, rank: int) -> str:
        """``rank`` as its ``Job.failure_unit``'s store key names it."""
        return f"rank{rank}" if self.per_rank else failures.unit_key(rank // self.group, rank % self.group)

    def status_key(self, rank: int) -> str:
        """The store key of ``rank``'s status record."""
        return status_key(self.unit_key(rank))

    def op_key(self, rank: int) -> str:
        """The store key of the op ``rank`` is stuck in (``commslayer.train.job.op_key``)."""
        return op_key(self.unit_key(rank))

    def lost_unit(self, rank: int) -> int:
        """What a recovery lists as lost for ``rank``: its rank, or its replica group."""
        return rank if self.per_rank else rank // self.group


@dataclass
class RankView:
    """One rank as the coordinator last saw it."""

    rank: int
    state: str  # one of STATES
    life: int  # its current life (restarts so far)
    why: str = ""  # why it is lost or fenced
    gave_up: bool = False  # lost with no restart left: not accounted for (/healthz answers 503)
    record: Optional[Dict[str, Any]] = None  # its latest status record (job._write_status), less ops, arrivals, comms
    op: Optional[Dict[str, Any]] = None  # its current or last op, the newer of its record's and its op record's


@dataclass
class RecoveryView:
    """One recovery, with what the fault log, the admissions and the healed ranks add to the
    store's record."""

    recovery: runs.Recovery
    cause: str  # the injected fault's action, or "unknown"
    fault_t: Optional[float]  # when the fault was injected
    stall_s: Optional[float]  # fault (else detection) to the next committed step, as the launcher's summary
    heal_s: Optional[float]  # the admission of the lost units: join and state transfer (per-rank: the transfer)
    heal_bytes: Optional[int] = None  # the state the healed ranks received (their status records)


@dataclass
class OpTotals:
    """One communicator's op of one kind, summed over every rank and life (the flight
    recorder's figures, tracing.record.figures)."""

    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0  # the sum of their latencies
    buckets: List[int] = field(default_factory=lambda: [0] * (len(runs.OP_LATENCY_BUCKETS) + 1))  # not cumulative
    errors: Dict[str, int] = field(default_factory=dict)  # final state -> ops


@dataclass
class Slowest:
    """The rank that arrived last most often in the collectives of the latest step two or
    more ranks reported (``Memory.slowest``)."""

    rank: int
    last: int  # collectives it arrived last in
    of: int  # collectives matched
    waited_s: float  # the others' waits for it, summed over those collectives
    step: int
    last_in: Dict[int, int]  # every rank that arrived last once or more -> in how many
    waits: Dict[int, float]  # and the others' waits for it


class Memory:
    """What the server keeps across reads of the store: each (rank, life)'s latest status
    record (a counter must not fall when a rank starts a new life) and each rank's
    collective arrivals of its last few recorded steps."""

    def __init__(self) -> None:
        self.lives: Dict[Tuple[int, int], Dict[str, Any]] = {}
        self.arrivals: Dict[int, Dict[int, List[Tuple[Any, ...]]]] = {}  # rank -> step -> (uid, generation, seq, t)

    def take(self, rank: int, record: Dict[str, Any]) -> None:
        """Take what the sums need out of ``rank``'s status ``record`` and remember it, as tuples of
        plain values, which the garbage collector stops walking (whole records kept for every
        life, at 1,000 ranks, made a full collection of the server's process a pause of every
        request)."""
        ops = tuple((comm, op, n, nbytes, seconds, tuple(buckets), tuple(errors.items()))
                    for comm, op, n, nbytes, seconds, buckets, errors in record.pop("ops", ()))
        self.lives[(rank, record["life"])] = {"ops": ops, **{k: record[k] for k in KEPT if k in record}}
        arrivals = record.pop("arrivals", None)
        if arrivals:
            steps = self.arrivals.setdefault(rank, {})
            steps[arrivals["step"]] = [tuple(a) for a in arrivals["ops"]]
            for old in sorted(steps)[:-KEEP_STEPS]:
                del steps[old]

    def ops(self) -> Tuple[Dict[Tuple[str, str], OpTotals], int]:
        """Every life's op figures summed by (communicator, op), and the ops the rings lost."""
        out: Dict[Tuple[str, str], OpTotals] = {}
        missed = 0
        for record in self.lives.values():
            missed += record.get("missed", 0)
            for comm, op, n, nbytes, seconds, buckets, errors in record.get("ops", ()):
                t = out.setdefault((comm, op), OpTotals())
                t.ops, t.bytes, t.seconds = t.ops + n, t.bytes + nbytes, t.seconds + seconds
                t.buckets = [a + b for a, b in zip(t.buckets, buckets)]
                for kind, k in errors:
                    t.errors[kind] = t.errors.get(kind, 0) + k
        return out, missed

    def healed(self) -> List[Tuple[int, Dict[str, Any]]]:
        """(rank, heal) of every life that healed."""
        return [(rank, r["healed"]) for (rank, _), r in sorted(self.lives.items()) if r.get("healed")]

    def slowest(self) -> Optional[Slowest]:
        """Over the collectives of the latest step two or more ranks reported, matched by
        (communicator uid, generation, seq): the rank that arrived last most often, as
        ``commslayer-trace watch`` finds it over the trace files."""
        reported: Dict[int, int] = {}
        for steps in self.arrivals.values():
            for step in steps:
                reported[step] = reported.get(step, 0) + 1
        shared = [s for s, n in reported.items() if n > 1]
        if not shared:
            return None
        step = max(shared)
        by_op: Dict[Tuple[str, int, int], Dict[int, float]] = {}
        for rank, steps in self.arrivals.items():
            for uid, gen, seq, t in steps.get(step, ()):
                by_op.setdefault((uid, gen, seq), {})[rank] = t
        count: Dict[int, int] = {}
        waited: Dict[int, float] = {}
        matched = [a for a in by_op.values() if len(a) > 1]
        for a in matched:
            late = max(a, key=lambda rank: a[rank])
            count[late] = count.get(late, 0) + 1
            waited[late] = waited.get(late, 0.0) + sum(a[late] - t for t in a.values())
        if not matched:
            return None
        top = max(count, key=lambda r: (count[r], waited[r]))
        return Slowest(rank=top, last=count[top], of=len(matched), waited_s=waited[top], step=step, last_in=count,
                       waits=waited)


@dataclass
class View:
    """The job at one moment (``read_view``)."""

    layout: Layout
    taken: float  # wall clock
    ranks: List[RankView]
    recoveries: List[RecoveryView]
    heals: List[float]  # every admission's heal time (per-rank mode: every replacement's state transfer)
    injected: List[Dict[str, Any]]  # the fault log's injections
    errors: Dict[str, int]  # error type -> count (the fault log's first failures, deterministic failures)
    spares: Optional[Dict[str, int]]
    failed: Optional[str] = None  # job/failed, or the deterministic failure that stops the job
    store_error: Optional[str] = None  # the store did not answer the last read
    generation: Optional[int] = None
    counts: Dict[str, int] = field(default_factory=dict)  # state -> ranks
    comms: Dict[str, Tuple[int, List[int]]] = field(default_factory=dict)  # resizable: name -> generation, members
    ops: Dict[Tuple[str, str], OpTotals] = field(default_factory=dict)  # (communicator, op) -> figures
    missed: int = 0  # ops the ranks' flight recorders lost before a status record counted them
    slowest: Optional[Slowest] = None
    heal_bytes: List[int] = field(default_factory=list)  # each healed life's received state

    def health(self) -> Tuple[bool, str]:
        """(healthy, the reason): unhealthy when the job failed, its store does not answer, or
        a rank is lost with no restart left."""
        if self.failed:
            return False, f"the job failed: {self.failed}"
        if self.store_error:
            return False, f"the job's store does not answer: {self.store_error}"
        lost = [r for r in self.ranks if r.gave_up]
        if lost:
            return False, "; ".join(f"rank {r.rank} lost: {r.why}" for r in lost)
        if all(r.state == "finished" for r in self.ranks):
            return True, "ok: every rank finished"
        return True, f"ok: {self.layout.world} rank(s) accounted for"


def read_view(layout: Layout, store: Any, memory: Optional[Memory] = None) -> View:
    """The job as ``store`` (the job's, bounded), the run directory and what ``memory`` kept
    of earlier reads show it now."""
    memory = memory if memory is not None else Memory()
    injected = runs.injections(layout.run_dir, layout.world if layout.per_rank else layout.group) \
        if layout.run_dir else []
    log = runs.read_log(os.path.join(layout.run_dir, runs.FAULT_LOG)) if layout.run_dir else []
    errors: Dict[str, int] = {}
    for e in log:
        if e.get("event") == "failure":
            errors[str(e.get("error"))] = errors.get(str(e.get("error")), 0) + 1
    recoveries, admissions = runs.job_recoveries(store), runs.job_admissions(store)
    bugs = failures.bugs(store)
    for b in bugs:
        errors[b.error.split(":", 1)[0]] = errors.get(b.error.split(":", 1)[0], 0) + 1
    failed = store.get(FAILED).decode(errors="replace").strip() if store.check([FAILED]) else None
    if bugs:
        failed = failures.stop_message(bugs)
    kept = json.loads(store.get(runs.RESHARDED))["ranks"] if store.check([runs.RESHARDED]) else None
    ranks = [_rank(layout, store, r, recoveries, admissions, kept) for r in range(layout.world)]
    for r in ranks:
        if r.record is not None:
            memory.take(r.rank, r.record)
    healed = memory.healed()
    view = View(layout=layout, taken=time.time(), ranks=ranks,
                recoveries=[_recovery(layout, x, injected, admissions, healed) for x in recoveries],
                heals=[h["seconds"] for _, h in healed if h.get("seconds") is not None] if layout.per_rank
                else [a.heal_s for a in admissions], injected=injected, errors=errors,
                spares=runs.job_spares(store, layout.nodes), failed=failed, slowest=memory.slowest(),
                heal_bytes=[h["bytes"] for _, h in healed if h.get("bytes") is not None])
    view.ops, view.missed = memory.ops()
    generations = [r.record["generation"] for r in ranks if r.record and r.record.get("generation") is not None]
    view.generation = max(generations, default=None)
    for r in ranks:
        view.counts[r.state] = view.counts.get(r.state, 0) + 1
        for name, generation, members in (r.record or {}).pop("comms", ()):  # kept once, in view.comms
            if generation >= view.comms.get(name, (-1, []))[0]:
                view.comms[name] = (generation, members)
    return view


def _get(store: Any, key: str) -> Optional[str]:
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def _rank(layout: Layout, store: Any, rank: int, recoveries: List[runs.Recovery],
          admissions: List[runs.Admission], kept: Optional[List[int]]) -> RankView:
    """One rank's state: finished, fenced (resharded out, once the survivors committed a
    step without it), lost (no restart left; in replica mode also its group dropped by a
    recovery and not admitted back yet), restarting (a new life that has not committed a
    step), running or replaced (a later life), or starting."""
    unit, number = layout.unit(rank)
    raw = _get(store, layout.status_key(rank))
    record = json.loads(raw) if raw else None
    life_text = _get(store, f"rank/{rank}/life") if layout.per_rank else None
    life = int(life_text) if life_text else (record["life"] if record else 0)
    view = RankView(rank=rank, state="starting", life=life, record=record)
    gone = _get(store, f"{unit}/{number}/gone")
    if store.check([f"{unit}/{number}/done"]):
        view.state = "finished"
    elif kept is not None and rank not in kept and any(rank in x.lost_replicas for x in recoveries):
        view.state, view.why = "fenced", "the survivors went on resharded without it"  # and committed a step
    elif gone is not None:
        view.state, view.gave_up = "lost", True
        view.why = f"no restart left (--max-restarts {layout.max_restarts}): " + (
            gone if layout.per_rank else f"its torchrun exited {gone}")
    elif not layout.per_rank and _dropped(layout.lost_unit(rank), recoveries, admissions):
        view.state, view.why = "lost", "dropped by the survivors; its torchrun restarts it"
    elif record is None or record["life"] < life:
        view.state = "restarting" if life else "starting"
    else:
        view.state = "replaced" if life else "running"
    if view.state != "finished":
        view.op = _op(layout, store, rank, record)
    return view


def _op(layout: Layout, store: Any, rank: int, record: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``rank``'s current or last op (tracing.record.figures.CurrentOp): its status record's, or
    the one its op reporter wrote while the rank was stuck in it, whichever it looked at last.
    The op record is read only when the status record is missing or older than
    ``OP_STALE_S`` (a rank whose training thread writes records writes no op record), and
    taken only if the same process wrote both."""
    op = record.get("op") if record else None
    if record is not None and time.time() - record["t"] <= OP_STALE_S:
        return op
    raw = _get(store, layout.op_key(rank))
    stuck = json.loads(raw) if raw else None
    if stuck is None or record is not None and stuck.get("pid") != record.get("pid"):
        return op
    return stuck if op is None or stuck["t"] > op["t"] else op


def _dropped(unit: int, recoveries: List[runs.Recovery], admissions: List[runs.Admission]) -> bool:
    """Whether the latest recovery that lost ``unit`` came after its latest admission."""
    lost = [x.generation for x in recoveries if unit in x.lost_replicas]
    back = [a.generation for a in admissions if unit in a.replicas]
    return bool(lost) and max(lost) > max(back, default=-1)


def _recovery(layout: Layout, rec: runs.Recovery, injected: List[Dict[str, Any]],
              admissions: List[runs.Admission], healed: List[Tuple[int, Dict[str, Any]]]) -> RecoveryView:
    """``rec`` with its fault (the latest injection into a lost unit before it was detected,
    as the launcher's summary matches them), the admission that healed it and the bytes
    its lost ranks received in that generation."""
    unit_of = "rank" if layout.per_rank else "replica"
    fault = None
    for k in injected:
        if k[unit_of] in rec.lost_replicas and k["t"] <= rec.detected_at:
            fault = k
    start = fault["t"] if fault else rec.detected_at
    stall = rec.committed_at - start if rec.committed_at is not None else None
    admission = next((a for a in admissions if set(rec.lost_replicas) & set(a.replicas)
                      and a.generation > rec.generation), None)
    # per-rank mode records no admission: its recovery waited for the replacements, whose
    # generation it records, and their heal (the state transfer) is the heal
    generation = rec.generation if admission is None else admission.generation
    heals = [h for rank, h in healed
             if layout.lost_unit(rank) in rec.lost_replicas and h.get("generation") == generation]
    received = [h["bytes"] for h in heals if h.get("bytes") is not None]
    heal_s = admission.heal_s if admission is not None else \
        max((h["seconds"] for h in heals if h.get("seconds") is not None), default=None)
    return RecoveryView(recovery=rec, cause=fault["action"] if fault else "unknown",
                        fault_t=fault["t"] if fault else None, stall_s=stall, heal_s=heal_s,
                        heal_bytes=sum(received) if received else None)


# ------------------------------------------------------------------ metrics
class Metrics(Collector):
    """The latest view as Prometheus metrics (registered in a private ``CollectorRegistry``)."""

    def __init__(self, latest: "Watcher") -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        view = self._latest.view
        if view is None:
            return
        info = GaugeMetricFamily("commslayer_job_info", "The job: its name, mode and ranks",
                                 labels=["job", "mode", "world"])
        info.add_metric([view.layout.name, "per-rank" if view.layout.per_rank else "replicas",
                         str(view.layout.world)], 1)
        yield info
        states = GaugeMetricFamily("commslayer_ranks", "Ranks in each state", labels=["state"])
        for state in STATES:
            states.add_metric([state], view.counts.get(state, 0))
        yield states
        step = GaugeMetricFamily("commslayer_rank_step", "The last step each rank committed", labels=["rank"])
        steps = CounterMetricFamily("commslayer_rank_steps_committed", "Steps each rank committed in its current "
                                    "life (a new life starts again at 0)", labels=["rank"])
        step_s = GaugeMetricFamily("commslayer_rank_step_seconds", "The time of each rank's last reported step",
                                   labels=["rank"])
        life = GaugeMetricFamily("commslayer_rank_life", "Each rank's life (its restarts so far)", labels=["rank"])
        age = GaugeMetricFamily("commslayer_rank_status_age_seconds", "Seconds since each rank's last status "
                                "record (a rank that holds at a stall stops writing)", labels=["rank"])
        op_age = GaugeMetricFamily("commslayer_rank_op_age_seconds", "Each rank's current op: seconds in flight "
                                   "(state in_flight), else its last op's seconds since it ended (the flight "
                                   "recorder must be on)", labels=["rank", "comm", "op", "state"])
        for r in view.ranks:
            life.add_metric([str(r.rank)], r.life)
            if r.record is not None:
                step.add_metric([str(r.rank)], r.record["step"])
                steps.add_metric([str(r.rank)], r.record["steps"])
                step_s.add_metric([str(r.rank)], r.record["step_s"])
                age.add_metric([str(r.rank)], max(0.0, view.taken - r.record["t"]))
            if r.op is not None:
                op_age.add_metric([str(r.rank), str(r.op["comm"]), str(r.op["op"]), r.op["state"].replace(" ", "_")],
                                  max(0.0, view.taken - r.op["since"]))
        yield from (step, steps, step_s, life, age, op_age)
        committed = [r.record["step"] + 1 for r in view.ranks if r.record is not None]
        yield CounterMetricFamily("commslayer_steps_committed", "Steps the job committed (the furthest rank's)",
                                  value=max(committed, default=0))
        if view.generation is not None:
            yield GaugeMetricFamily("commslayer_generation", "The job's resilient communicator's generation",
                                    value=view.generation)
        causes = CounterMetricFamily("commslayer_recoveries", "Losses the survivors recovered from, by cause "
                                     "(the injected fault's action; unknown without one)", labels=["cause"])
        by_cause: Dict[str, int] = {}
        for x in view.recoveries:
            by_cause[x.cause] = by_cause.get(x.cause, 0) + 1
        for cause, n in sorted(by_cause.items()):
            causes.add_metric([cause], n)
        yield causes
        yield _histogram("commslayer_survivor_stall_seconds", "Fault (else detection) to the survivors' next "
                         "committed step", [x.stall_s for x in view.recoveries if x.stall_s is not None])
        yield _histogram("commslayer_heal_seconds", "A restarted unit's join and state transfer", view.heals)
        errors = CounterMetricFamily("commslayer_errors", "Errors by type: each communicator's first failure in "
                                     "the fault log, and deterministic failures", labels=["type"])
        for kind, n in sorted(view.errors.items()):
            errors.add_metric([kind], n)
        yield errors
        yield from _op_metrics(view)
        yield from _job_metrics(view)
        if view.spares is not None:
            spares = GaugeMetricFamily("commslayer_spares", "Warm spares used and left", labels=["state"])
            spares.add_metric(["used"], view.spares["used"])
            spares.add_metric(["left"], view.spares["left"])
            yield spares
        yield GaugeMetricFamily("commslayer_healthy", "1 while /healthz answers 200", value=int(view.health()[0]))


def _op_metrics(view: View) -> Iterator[Metric]:
    """Per communicator and op, summed over the ranks: the flight recorder's figures."""
    labels = ["comm", "op"]
    ops = CounterMetricFamily("commslayer_ops", "Ops that ended, per communicator and op", labels=labels)
    nbytes = CounterMetricFamily("commslayer_op_bytes", "Bytes of the ops that ended (the larger of input and "
                                 "output), per communicator and op", labels=labels)
    errors = CounterMetricFamily("commslayer_op_errors", "Ops that ended without completing, by final state",
                                 labels=[*labels, "type"])
    latency = HistogramMetricFamily("commslayer_op_latency_seconds", "Op latency (handed to the backend to "
                                    "ended), per communicator and op", labels=labels)
    bounds = [repr(b) for b in runs.OP_LATENCY_BUCKETS] + ["+Inf"]
    for (comm, op), t in sorted(view.ops.items()):
        ops.add_metric([comm, op], t.ops)
        nbytes.add_metric([comm, op], t.bytes)
        for kind, n in sorted(t.errors.items()):
            errors.add_metric([comm, op, kind], n)
        cumulative = [sum(t.buckets[:i + 1]) for i in range(len(t.buckets))]
        latency.add_metric([comm, op], list(zip(bounds, cumulative)), t.seconds)
    yield from (ops, nbytes, errors, latency)
    yield CounterMetricFamily("commslayer_op_records_missed", "Ops a rank's flight recorder dropped before a "
                              "status record counted them (more ops a second than its ring holds)",
                              value=view.missed)


def _job_metrics(view: View) -> Iterator[Metric]:
    """The resizable communicators, the slowest rank, the heal bytes."""
    generation = GaugeMetricFamily("commslayer_communicator_generation", "Each resizable communicator's live "
                                   "generation", labels=["comm"])
    members = GaugeMetricFamily("commslayer_communicator_members", "Each resizable communicator's live members",
                                labels=["comm"])
    for name, (gen, ids) in sorted(view.comms.items()):
        generation.add_metric([name], gen)
        members.add_metric([name], len(ids))
    yield from (generation, members)
    waits = GaugeMetricFamily("commslayer_straggler_wait_seconds", "In the collectives of the latest step the "
                              "ranks reported: how long the others waited for each rank that arrived last",
                              labels=["rank"])
    last = GaugeMetricFamily("commslayer_straggler_collectives", "In those collectives: how many each rank "
                             "arrived last in", labels=["rank"])
    if view.slowest is not None:
        for rank, waited in sorted(view.slowest.waits.items()):
            waits.add_metric([str(rank)], waited)
            last.add_metric([str(rank)], view.slowest.last_in[rank])
    yield from (waits, last)
    yield CounterMetricFamily("commslayer_heal_bytes", "State the restarted ranks received from live ones",
                              value=sum(view.heal_bytes))


def _histogram(name: str, doc: str, values: List[float]) -> HistogramMetricFamily:
    buckets = [(repr(b), sum(v <= b for v in values)) for b in SECONDS_BUCKETS] + [("+Inf", len(values))]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))


# --------------------------------------------------------------------- page
def _ago(seconds: Optional[float]) -> str:
    return "" if seconds is None else f"{seconds:.1f}s ago"


def _secs(seconds: Optional[float]) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f}s"


def _slowest(s: Optional[Slowest]) -> str:
    if s is None:
        return "n/a (no collective two ranks reported yet; the ranks' flight recorders must be on)"
    return f"rank {s.rank}, last to arrive in {s.last} of {s.of} at step {s.step} (the others waited " \
           f"{s.waited_s:.6f} s for it)"


def _op_cell(op: Optional[Dict[str, Any]], now: float) -> str:
    """A rank's current or last op, named as ``commslayer-trace watch`` names it (the rank's
    recorder wrote the name), with its age: ``all_reduce #412 of 'c10d:0', in flight 7.3 s``."""
    if op is None:
        return ""
    return f"{op['name']}, {op['state']} {max(0.0, now - op['since']):.1f} s" + ("" if op["in_flight"] else " ago")


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d} UTC"


def _table(head: List[str], rows: List[List[str]], classes: Optional[List[str]] = None) -> str:
    """An HTML table of ``rows`` (text, escaped here), each row of class ``classes[i]`` if given."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(f"<tr class='{html.escape(classes[i]) if classes else ''}'>"
                   + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for i, row in enumerate(rows))
    return f"<table><tr>{cells}</tr>{body}</table>"


def page(view: Optional[View]) -> str:
    """The status page of ``view`` (None: not read yet)."""
    head = (f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{REFRESH_S}'>"
            "<title>commslayer job status</title><style>body{font:14px sans-serif;margin:1.5em}"
            "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #bbb;padding:3px 8px;"
            "text-align:left}th{background:#eee}.lost td{background:#fdd}.restarting td,.fenced td{background:#ffe}"
            ".replaced td{background:#eef}.finished td{color:#666}.bad{color:#b00;font-weight:bold}</style>"
            "</head><body>")
    if view is None:
        return head + "<p>reading the job's store...</p></body></html>"
    lay = view.layout
    healthy, reason = view.health()
    shape = f"{lay.world // lay.group} replica group(s) of {lay.group}" if not lay.per_rank else \
        f"{lay.world} rank(s), {lay.group} per host, each its own restart unit"
    parts = [head, f"<h1>{html.escape(lay.name)}</h1>",
             f"<p>{'per-rank mode' if lay.per_rank else 'replica mode'}: {html.escape(shape)}; "
             f"--max-restarts {lay.max_restarts}"
             + (f"; generation {view.generation}" if view.generation is not None else "")
             + (f"; warm spares: {view.spares['used']} used, {view.spares['left']} left" if view.spares else "")
             + f"; read {_clock(view.taken)}</p>",
             f"<p class='{'' if healthy else 'bad'}'>health: {html.escape(reason)}</p>",
             f"<p>slowest of the last collectives: {html.escape(_slowest(view.slowest))}</p>"]
    rows, classes = [], []
    for r in view.ranks:
        rec = r.record
        group = [] if lay.per_rank else [str(r.rank // lay.group)]
        rows.append([str(r.rank), *group, r.state, str(r.life),
                     "" if rec is None else str(rec["step"]), "" if rec is None else f"{rec['step_s'] * 1000:.1f} ms",
                     "" if rec is None else f"step {rec['step']} committed, {_ago(view.taken - rec['t'])}",
                     _op_cell(r.op, view.taken), r.why])
        classes.append(r.state)
    parts += ["<h2>Ranks</h2>", _table(["rank", *([] if lay.per_rank else ["replica group"]), "state", "life",
                                        "step", "step time", "last report", "current or last op", "why"], rows,
                                       classes)]
    unit = "rank" if lay.per_rank else "replica group"
    parts += [f"<h2>Recoveries ({len(view.recoveries)})</h2>", _table(
        ["step", f"lost {unit}(s)", "cause", "detected", "detection", "survivor stall", "heal", "heal bytes",
         "generation"],
        [[str(x.recovery.step), ", ".join(map(str, x.recovery.lost_replicas)), x.cause, _clock(x.recovery.detected_at),
          _secs(None if x.fault_t is None else x.recovery.detected_at - x.fault_t), _secs(x.stall_s),
          _secs(x.heal_s), "n/a" if x.heal_bytes is None else str(x.heal_bytes), str(x.recovery.generation)]
         for x in view.recoveries])]
    parts += _communicator_tables(view)
    if view.injected:
        parts += ["<h2>Fault log</h2>", _table(["time", unit, "fault", "step"], [
            [_clock(k["t"]), str(k["rank"] if lay.per_rank else k["replica"]), str(k.get("what", k.get("action"))),
             str(k.get("step", ""))] for k in view.injected])]
    if view.errors:
        parts += ["<h2>Errors</h2>", _table(["type", "count"], [[k, str(n)] for k, n in sorted(view.errors.items())])]
    parts.append("<p>also: <a href='/metrics'>/metrics</a> (Prometheus), <a href='/healthz'>/healthz</a></p>"
                 "</body></html>")
    return "".join(parts)


def _communicator_tables(view: View) -> List[str]:
    """The resizable communicators' generations and members, and the ops of every
    communicator summed over the ranks (none without the flight recorders)."""
    parts = []
    if view.comms:
        parts += ["<h2>Resizable communicators</h2>", _table(["communicator", "generation", "members"], [
            [name, str(gen), ", ".join(map(str, ids))] for name, (gen, ids) in sorted(view.comms.items())])]
    if view.ops:
        rows = [[comm, op, str(t.ops), str(t.bytes), f"{t.seconds / t.ops * 1e6:.1f} µs" if t.ops else "",
                 ", ".join(f"{k} {n}" for k, n in sorted(t.errors.items()))]
                for (comm, op), t in sorted(view.ops.items())]
        parts += ["<h2>Ops (all ranks)</h2>",
                  _table(["communicator", "op", "ops", "bytes", "mean latency", "errors"], rows)]
    return parts


# ------------------------------------------------------------------- server
@dataclass
class Rendered:
    """One view and its renderings, made once by the watcher's thread: what every request
    until the next read is answered with (a scrape renders nothing)."""

    view: Optional[View]
    metrics: bytes
    page: bytes


class Watcher:
    """The thread that reads the job's view from its store every ``POLL_S`` and renders it
    (``rendered``)."""

    def __init__(self, layout: Layout) -> None:
        self.view: Optional[View] = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(Metrics(self))
        self.rendered = Rendered(None, b"", page(None).encode())
        self._layout, self._address = layout, ""
        self._memory = Memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commslayer-status-watch", daemon=True)

    def start(self, address: str) -> None:
        """Read the job's store at ``address`` from now on."""
        self._address = address
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = bounded(connect(self._address, STORE_TIMEOUT))
                    store.set(STATUS_SERVED, "1")
                self.view = read_view(self._layout, store, self._memory)
            except (RuntimeError, OSError, ValueError) as exc:  # the store went away, or a record was cut
                if self.view is not None:
                    self.view.store_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                store = None
            self._render()
            self._stop.wait(POLL_S)

    def _render(self) -> None:
        """Render the latest view for every request until the next read."""
        if self.view is not None:
            self.rendered = Rendered(self.view, generate_latest(self.registry), page(self.view).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, listening: socket.socket, watcher: Watcher) -> None:
        super().__init__(listening.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listening  # bound by the launcher before anything started
        self.watcher = watcher
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to ``MAX_CLIENTS``; past that the connection is closed."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    timeout = CLIENT_TIMEOUT_S  # the connection's socket timeout: a slow client is dropped
    server: _Server
    _head_only = False  # a HEAD request (HTTP/1.0: one request per connection, so per handler)

    def do_HEAD(self) -> None:
        """GET's status and headers without the body (``curl -I``, uptime checkers)."""
        self._head_only = True
        self.do_GET()

    def _not_allowed(self) -> None:
        """405 with the methods served (http.server's default is a 501 HTML page)."""
        self._send(405, "text/plain; charset=utf-8", b"method not allowed: GET or HEAD\n", allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        rendered = self.server.watcher.rendered
        view = rendered.view
        if path == "/":
            self._send(200, "text/html; charset=utf-8", rendered.page)
        elif path == "/metrics":
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", rendered.metrics)
        elif path == "/healthz":
            healthy, reason = view.health() if view is not None else (False, "the job's store was not read yet")
            self._send(200 if healthy else 503, "text/plain; charset=utf-8", (reason + "\n").encode())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /, /metrics or /healthz\n")

    def _send(self, code: int, kind: str, body: bytes, allow: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if not self._head_only:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the launcher's output is the job's."""


class StatusServer:
    """The status server of one job, on a socket the launcher already listens on (its port
    taken before any process of the job started); ``start`` once the job's store exists,
    ``close`` at the end."""

    def __init__(self, listening: socket.socket, layout: Layout) -> None:
        self._watcher = Watcher(layout)
        self._server = _Server(listening, self._watcher)
        self._thread = threading.Thread(target=self._server.serve_forever, name="commslayer-status-http",
                                        daemon=True)

    @property
    def address(self) -> str:
        host, port = self._server.socket.getsockname()[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def start(self, store_address: str) -> None:
        """Read the job's store at ``store_address`` (its ``host:port`` or etcd:// address) and serve.
        The objects of this process so far (torch's modules above all, about 160,000) are
        frozen out of the garbage collector's reach first: a full collection walked them in
        36 to 115 ms here, a pause of every request whenever the reads' garbage set one off."""
        gc.collect()
        gc.freeze()
        self._watcher.start(store_address)
        self._thread.start()

    def close(self) -> None:
        self._watcher.stop()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
