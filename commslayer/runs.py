"""What a resilient run leaves behind, and the one definition its writer and readers share.

A run under ``commslayer-run --run-dir D`` leaves in ``D``:

- ``result-m<member>-r<restart>.json``: one ``RankResult`` per process that
  reached the end of the job (a rank killed on the way writes none; its
  restarted life does), written by the training script with ``save``;
- ``faults.jsonl``: the fault log (``faults.inject`` appends each fault it
  fires and the first failure each communicator sees), read by ``read_log``;
- ``summary.json``: the launcher's ``Summary`` of the run;
- ``traces/``: the ranks' traces (unless ``COMMSLAYER_TRACE_DIR`` says otherwise);
- ``earlier/<n>/``: what the ``n``-th earlier run in the same folder left
  there, set aside by the launcher before this one started (``set_aside``).

The job's store (the coordinator's) holds the recoveries and admissions the
ranks recorded (``record``; read by ``job_recoveries``, ``job_admissions``):
it outlives every rank, so they survive whichever rank saw them.

The launcher's summary, the fault harness, the benchmarks and the tests all
read through this module, so a field changes in one place.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union


@dataclass
class Recovery:
    """One loss the survivors recovered from, as this rank saw it (wall-clock times)."""

    step: int
    lost_replicas: List[int]
    generation: int  # the generation the survivors went on with
    detected_at: float  # the step's average failed or was voted down
    resumed_at: float  # the new generation was built (the redo starts)
    committed_at: Optional[float] = None  # the redone step was committed


@dataclass
class Admission:
    """A replica group let back in at a step boundary."""

    step: int
    replicas: List[int]
    generation: int
    heal_s: float  # the reconfigure and the state transfer, on this rank
    at: Optional[float] = None  # when (wall clock) the group was in, on this rank


PROG = "commslayer-run"  # the launcher, as its messages name it (the harness reads them)
FAULT_LOG = "faults.jsonl"
SUMMARY = "summary.json"
RECOVERIES = "job/recoveries"  # keys of the job's store: JSON lines, one per record
ADMISSIONS = "job/admissions"
RESHARDED = "job/resharded"  # a per-rank job resharded onto fewer ranks: the epoch and the ranks kept
FINISHED = "job/finished"  # a rank ended its job.finish(): a group restarting from now on has nothing to rejoin
# Upper bounds (seconds) of the op latency histogram in the ranks' status records (tracing.record.figures
# writes them, commslayer.run.status serves them); the last bucket is +Inf.
OP_LATENCY_BUCKETS = (1e-05, 5e-05, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass
class RankResult:
    """What one process of the job did, written when it reached the end."""

    member: int  # its rank in the job: replica * ranks per replica + rank
    replica: int  # its replica group
    rank: int  # its rank in the replica group (the shard it holds)
    restart: int  # its torchrun's restart count: which life of the group it is
    pid: int
    started: float  # wall clock when the process started: which processes lived through a fault
    steps: int  # the steps the job was asked to run
    start_step: int  # its first step (after a restart: the step it healed to)
    elapsed_s: float  # from start_step to the end of the last step
    step_s: List[float]  # each step's time, from start_step on
    losses: Dict[int, float]  # step -> the loss averaged over the live replicas
    optimizer_steps: List[int]  # per parameter, the optimizer's step count at the end
    live: List[int]  # the replica groups live at the end
    fingerprints: Optional[List[int]] = None  # each live replica's hash of this shard's state; None: not compared
    recoveries: List[Recovery] = field(default_factory=list)  # the losses it recovered from
    admissions: List[Admission] = field(default_factory=list)  # the replica groups it let back in
    generation: Optional[int] = None  # the replicate dimension's generation at the end; None: not resilient
    overlapped: List[str] = field(default_factory=list)  # registered modules whose average began during backward

    @property
    def end_step(self) -> int:
        """The step after its last one."""
        return self.start_step + len(self.step_s)

    def slowest_step(self, first: int, last: Optional[int] = None) -> Tuple[float, float]:
        """(its longest step time among steps ``first`` up to ``last`` (exclusive; to the
        end without one), its median step time): what something that happened at step
        ``first`` cost it."""
        span = self.step_s[max(0, first - self.start_step):None if last is None else last - self.start_step]
        return max(span, default=0.0), statistics.median(self.step_s) if self.step_s else 0.0

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "RankResult":
        return cls(**dict(data, losses={int(s): v for s, v in data["losses"].items()},
                          recoveries=[Recovery(**r) for r in data["recoveries"]],
                          admissions=[Admission(**a) for a in data["admissions"]]))


RESULT_GLOB = "result-m*-r*.json"


def result_name(member: int, restart: int) -> str:
    return f"result-m{member}-r{restart}.json"


def save(result: RankResult, run_dir: str) -> str:
    """Write ``result`` into ``run_dir`` (created if missing) whole or not at all; return its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, result_name(result.member, result.restart))
    _write_json(path, asdict(result))
    return path


def result_paths(run_dir: str) -> List[str]:
    """The result files of a run, in name order."""
    return sorted(glob.glob(os.path.join(run_dir, RESULT_GLOB)))


def joined_key(replica: int) -> str:
    """The key of the job's store that a rank of replica group ``replica`` writes once it reached
    ``resilience.init()``: the launcher takes a failure of a group without it for the script's
    failing to start."""
    return f"replica/{replica}/joined"


TRACES = "traces"  # the run's traces, unless COMMSLAYER_TRACE_DIR names another folder
EARLIER = "earlier"  # where an earlier run's files in the same folder are set aside


def set_aside(run_dir: str) -> Optional[str]:
    """Move what an earlier run left in ``run_dir`` (its results, summary, fault log and
    traces) into ``run_dir/earlier/<n>``, the first ``n`` free, so that this run's summary,
    comparison and traces are its own; the folder, or None when there was nothing."""
    names = [os.path.basename(p) for p in result_paths(run_dir)] + [
        n for n in (SUMMARY, FAULT_LOG, TRACES) if os.path.exists(os.path.join(run_dir, n))]
    if not set(names) - {FAULT_LOG}:  # a fault log alone is the fault harness's, for the run it starts
        return None
    n = 1
    while os.path.exists(os.path.join(run_dir, EARLIER, str(n))):
        n += 1
    into = os.path.join(run_dir, EARLIER, str(n))
    os.makedirs(into)
    for name in names:
        os.replace(os.path.join(run_dir, name), os.path.join(into, name))
    return into


def load_results(run_dir: str) -> List[RankResult]:
    """The results of a run: one per process that reached the end."""
    out = []
    for path in result_paths(run_dir):
        with open(path) as f:
            out.append(RankResult.from_json(json.load(f)))
    return out


def longest(results: List[RankResult]) -> RankResult:
    """The result of the rank that saw the most of the run (the earliest start)."""
    return min(results, key=lambda r: (r.start_step, r.member))


# ------------------------------------------------------------ the job's store
def record(store: Any, item: Union[Recovery, Admission]) -> None:
    """Append a recovery or an admission to the job's store (``store``: a c10d Store)."""
    key = RECOVERIES if isinstance(item, Recovery) else ADMISSIONS
    store.append(key, json.dumps(asdict(item)) + "\n")


def job_recoveries(store: Any) -> List[Recovery]:
    """The recoveries the ranks recorded in the job's store, in order."""
    return [Recovery(**d) for d in _lines(store, RECOVERIES)]


def job_admissions(store: Any) -> List[Admission]:
    """The admissions the ranks recorded in the job's store, in order."""
    return [Admission(**d) for d in _lines(store, ADMISSIONS)]


def spare_tally_key(node: int) -> str:
    """Where host ``node``'s launcher keeps the count of its warm spares (commslayer.run.spares)."""
    return f"spare/{node}/tally"


def job_spares(store: Any, nodes: int) -> Optional[Dict[str, int]]:
    """The warm spares used and left on the job's ``nodes`` hosts (what each host's launcher
    wrote, commslayer.run.spares); None when no host kept spares."""
    tallies = [json.loads(store.get(spare_tally_key(n))) for n in range(nodes) if store.check([spare_tally_key(n)])]
    if not tallies:
        return None
    return {"used": sum(t["used"] for t in tallies), "left": sum(t["left"] for t in tallies)}


def _lines(store: Any, key: str) -> List[dict]:
    if not store.check([key]):
        return []
    return [json.loads(line) for line in store.get(key).decode().splitlines() if line]


# ---------------------------------------------------------------- the fault log
def read_log(path: str) -> List[Dict[str, Any]]:
    """The events of a fault log, in the order they were written (none: no log)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def injections(run_dir: str, shards: int) -> List[Dict[str, Any]]:
    """The faults injected in a run (its fault log's ``injected`` events), each with
    the replica group it hit and the rank in it (``shards``: ranks per replica group;
    in per-rank mode the job's ranks, so ``rank`` is the job rank)."""
    return [dict(e, replica=e["member"] // shards, rank=e["member"] % shards)
            for e in read_log(os.path.join(run_dir, FAULT_LOG)) if e["event"] == "injected"]


# ------------------------------------------------------------------ the summary
@dataclass
class Summary:
    """The launcher's account of a run (``summary.json``)."""

    ok: bool  # every invariant the launcher checks held
    killed: List[Dict[str, Any]]  # ``injections``, each with ``stall_s``: fault to the next committed step (None: none)
    losses: Dict[int, float]  # the longest-lived rank's loss per step
    recoveries: List[Recovery]  # from the job's store
    admissions: List[Admission]
    stopped: Optional[str] = None  # why the launcher stopped the job (a deterministic failure, a crash loop)
    spares: Optional[Dict[str, int]] = None  # warm spares used and left, over every host (None: no --spares)


def save_summary(summary: Summary, run_dir: str) -> None:
    _write_json(os.path.join(run_dir, SUMMARY), asdict(summary), indent=1)


def load_summary(run_dir: str) -> Optional[Summary]:
    """The run's summary; None when the launcher wrote none (or not whole)."""
    try:
        with open(os.path.join(run_dir, SUMMARY)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return Summary(ok=data["ok"], killed=data["killed"], losses={int(s): v for s, v in data["losses"].items()},
                   recoveries=[Recovery(**r) for r in data["recoveries"]],
                   admissions=[Admission(**a) for a in data["admissions"]], stopped=data.get("stopped"),
                   spares=data.get("spares"))


def _write_json(path: str, data: Any, indent: Optional[int] = None) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=indent)
    os.replace(tmp, path)
