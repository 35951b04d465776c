"""What ``commslayer-run`` does once its arguments are checked (``commslayer.run.launcher``,
which also explains the two modes): the job's store (its own TCPStore, an etcd
cluster, or a running job's), this host's processes (one torchrun per replica
group, or every rank itself through ``commslayer.run.supervisor``), their supervision
until they end or a bug or a lost store stops the job, and the run's summary.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Deque, Dict, Optional

import torch.distributed as dist

from commslayer import config, runs

from commslayer.train import failures
from commslayer.errors import first_line
from commslayer.agree.etcdstore import Claim, EtcdStore
from commslayer.run import shim, status
from commslayer.run.processes import ProcessSet, become_subreaper, free_port
from commslayer.run.spares import Desk, Spares
from commslayer.runs import FINISHED, PROG, joined_key
from commslayer.agree.store import bounded, connect
from commslayer.endpoints import parse_url
from commslayer.run.supervisor import Failed, RankJob, Stopped, all_ended, check_reachable, echo, stop_on_bugs, supervise_ranks

STORE_TIMEOUT = timedelta(seconds=60)
CLAIM_TTL_S = 10.0  # a job on etcd whose launcher is gone can be started again this long after
LAUNCHER, STARTED = "launcher", "launcher/started"  # the keys on etcd that the launcher starting a job holds


def run(a: argparse.Namespace) -> int:
    """Run the job that ``a`` (``commslayer.run.launcher.parse``) describes; the exit status."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    become_subreaper()
    procs = ProcessSet(a.grace)
    store = None
    served = None if a.status_socket is None else status.StatusServer(a.status_socket, _layout(a))

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control starts a background launcher with
    # SIGINT ignored, and `kill -INT` must still end the job (as torchrun does).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if a.run_dir and not a.coordinator:  # the run's summary, comparison and traces must be this run's
            try:
                aside = runs.set_aside(a.run_dir)
            except OSError as exc:
                print(f"{PROG}: error: --run-dir {a.run_dir!r} holds an earlier run's files, which cannot be moved "
                      f"aside: {exc.strerror or exc}: {exc.filename}", file=sys.stderr, flush=True)
                return 2
            if aside is not None:
                # `--run-dir D --compare-to D` means the run D held: it is in `aside` now, this run in D
                same = a.compare_to is not None and os.path.realpath(a.compare_to) == os.path.realpath(a.run_dir)
                a.compare_to = aside if same else a.compare_to
                print(f"{PROG}: {a.run_dir} held an earlier run's files; they are in {aside} now"
                      + ("; --compare-to compares this run with them there" if same else ""), flush=True)
        store = _job_store(a)
        if served is not None:
            served.start(a.address)
            print(f"coordinator: status at {served.address} (also /metrics, /healthz)", flush=True)
        if a.per_rank:
            a.scratch = tempfile.mkdtemp(prefix="commslayer-run-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                         else None)
            gone = supervise_ranks(_rank_job(a), store, procs)
        else:
            codes = _supervise(a, store, procs)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; ending every process it started", file=sys.stderr, flush=True)
        return 130
    except Failed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, Stopped) and a.run_dir and not a.coordinator:  # what the run did up to there
            procs.stop()
            summarize(a.run_dir, store, _shards(a), None, a.loss_tolerance, per_rank=a.per_rank, stopped=str(exc),
                      nodes=_nodes(a))
        return 1
    except dist.DistNetworkError as exc:  # the job's store went away between two checks
        print(f"{PROG}: the job's store failed ({first_line(exc)}); ended the processes started here",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the ending short
            signal.signal(sig, signal.SIG_IGN)
        procs.stop()
        if served is not None:
            served.close()
        if getattr(a, "scratch", None):  # the ranks' files in host memory (a reshard's whole state)
            shutil.rmtree(a.scratch, ignore_errors=True)
        if getattr(a, "claim", None) is not None:
            a.claim.release()
    if a.per_rank:
        if gone:
            print(f"{PROG}: rank(s) {gone} gave up (no restart left after --max-restarts {a.max_restarts} per "
                  "rank); their output is above", file=sys.stderr, flush=True)
        ok = not gone
    else:
        gave_up = sorted(r for r, c in codes.items() if c != 0)
        if gave_up:
            print(f"{PROG}: replica group(s) {gave_up} gave up (torchrun exit {[codes[r] for r in gave_up]} after up "
                  f"to {a.max_restarts} restart(s)); their output is above", file=sys.stderr, flush=True)
        ok = not gave_up
    if ok and not a.coordinator:
        _note_if_unfinished(store, a.run_dir)
    if a.run_dir and not a.coordinator:  # the coordinator has seen every replica group (or rank) end
        summarized = summarize(a.run_dir, store, _shards(a), a.compare_to, a.loss_tolerance, per_rank=a.per_rank,
                               nodes=_nodes(a))
        if not summarized and ok:
            print(f"{PROG}: the run's summary found a problem (the 'summary:' lines above, {a.run_dir}/"
                  f"{runs.SUMMARY})", file=sys.stderr, flush=True)
        ok = ok and summarized
    return 0 if ok else 1

def _note_if_unfinished(store, run_dir: Optional[str]) -> None:
    """Say so when every process ended well but no rank reached ``job.finish()``: a script
    that exits before its loop (or does not use commslayer.resilience) would otherwise
    end the job with status 0 and not a word about what it did not do.  (A script that
    writes its results itself, ``commslayer.runs.save``, is not said to have written none.)"""
    if not store.check([FINISHED]):
        written = run_dir is not None and bool(runs.result_paths(run_dir))
        print("coordinator: no rank called job.finish(): the script left before the end of its loop over "
              "job.steps(), or does not use commslayer.resilience (docs/training.md); no state was compared across "
              "replicas" + ("" if written else " and no result written"), flush=True)


def _shards(a: argparse.Namespace) -> int:
    """Ranks per replica group (in per-rank mode, the job's ranks: one replica of each)."""
    return a.world_size if a.per_rank else a.nproc_per_replica


def _layout(a: argparse.Namespace) -> status.Layout:
    """The job as the status server shows it (commslayer.run.status)."""
    name = parse_url(a.store)[1] if a.store else os.path.basename(a.run_dir) if a.run_dir else \
        os.path.basename(a.script or PROG)
    group = a.nproc_per_node if a.per_rank else a.nproc_per_replica
    return status.Layout(name=name, per_rank=a.per_rank, world=a.world_size if a.per_rank else a.replicas * group,
                         group=group, nodes=_nodes(a), max_restarts=a.max_restarts, run_dir=a.run_dir)


def _nodes(a: argparse.Namespace) -> int:
    """How many places may hold a launcher's count of warm spares (``runs.spare_tally_key``):
    per-rank mode's hosts; in replica mode, filed under a host's first replica group, the groups."""
    return a.nnodes if a.per_rank else a.replicas


def _job_store(a: argparse.Namespace):
    """The job's store: a client of ``--coordinator`` (a running job's), the etcd cluster of
    ``--store`` (this launcher starts the job there), or this process's own TCPStore (it is
    the coordinator)."""
    a.claim = None
    if a.coordinator:
        store = _joined_store(a.coordinator)
        # A stopped coordinator answers nothing: give up on it after twice the ranks' store deadline, so
        # that a rank, which talks to the store at least once a deadline (world rank 0 reads the joiners
        # every 0.25 s), raises StoreUnreachable itself, naming the call, before this launcher ends it.
        return bounded(store, deadline_s=2 * config.store_timeout_s())
    if a.store:
        # etcd gone (no quorum): the ranks, whose calls give up after the store deadline, raise
        # StoreUnreachable themselves before this launcher, whose calls wait longer, ends them.
        store = EtcdStore.at(a.store, STORE_TIMEOUT, request_timeout_s=1.5 * config.store_timeout_s())
        a.claim = _start_on_etcd(store)
        a.address = a.store
        held = "the job's store on etcd at " + a.store
    else:
        host, port = a.host or "127.0.0.1", a.port or 0
        try:
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT,
                                  use_libuv=True)
        except (RuntimeError, OSError) as exc:
            raise Failed(f"cannot start the coordinator's store at {host}:{port}: {first_line(exc)}") from None
        a.address = f"{host if host != '0.0.0.0' else '127.0.0.1'}:{store.port}"
        held = f"job store at {host}:{store.port}"
    if a.per_rank:
        print(f"coordinator: {held} for {a.world_size} rank(s), {a.nproc_per_node} on each of {a.nnodes} host(s), "
              "each rank its own restart unit", flush=True)
        if a.nnodes > 1 and not a.store and a.address.startswith(("127.", "localhost")):
            print(f"coordinator: the job's store listens on {a.address} (loopback): a launcher on another host "
                  "cannot reach it, and this host's ranks wait for theirs; give --host with an address they reach",
                  flush=True)
    else:
        print(f"coordinator: {held} for {a.replicas} replica group(s) of {a.nproc_per_replica}", flush=True)
    return bounded(store, deadline_s=2 * config.store_timeout_s()) if a.store else store


def _joined_store(address: str) -> dist.Store:
    """A client of a running job's store; on etcd, once the launcher that started the job
    holds it (``STARTED``, which goes with that launcher)."""
    try:
        store = connect(address, STORE_TIMEOUT)
        if isinstance(store, EtcdStore):
            store.wait([STARTED], STORE_TIMEOUT)
    except dist.DistStoreError:
        raise Failed(f"no job is running at {address}: none was started there (commslayer-run --store "
                     f"{address}) within {STORE_TIMEOUT.total_seconds():g}s") from None
    except (RuntimeError, OSError) as exc:
        raise Failed(f"cannot reach the job's store at {address}: {first_line(exc)}") from None
    return store


def _start_on_etcd(store: EtcdStore) -> Claim:
    """Hold the job (its ``LAUNCHER`` key, under a lease this process renews), then delete
    what an earlier job of the same name left, then say that the job started
    (``STARTED``, under the same lease, for launchers that join it). A job held by a
    launcher that is gone is free once its lease expires (``CLAIM_TTL_S``)."""
    me = f"{socket.gethostname()} pid {os.getpid()}"
    deadline = time.monotonic() + CLAIM_TTL_S + 1
    try:
        while (claim := store.claim(LAUNCHER, me, CLAIM_TTL_S)) is None:
            if time.monotonic() > deadline:
                holder = store.get(LAUNCHER).decode(errors="replace") if store.check([LAUNCHER]) else "?"
                raise Failed(f"the job at {store.address} is running: its launcher ({holder}) holds it; name another "
                             "job, or stop that one")
            time.sleep(0.5)
        store.delete_all(keep=LAUNCHER)
        claim.put(STARTED, me)
    except dist.DistNetworkError as exc:
        raise Failed(f"cannot start the job on etcd: {first_line(exc)}") from None
    return claim


def _worker_env(a: argparse.Namespace) -> Dict[str, str]:
    """What every process started here gets, in either mode."""
    env = dict(os.environ, COMMSLAYER_JOB_STORE=a.coordinator or a.address,
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if a.run_dir:
        env["COMMSLAYER_RUN_DIR"] = a.run_dir
        if "COMMSLAYER_TRACE_DIR" not in os.environ:  # set empty, it keeps tracing off
            env["COMMSLAYER_TRACE_DIR"] = os.path.join(a.run_dir, runs.TRACES)
        env.setdefault("COMMSLAYER_FAULTS_LOG", os.path.join(a.run_dir, runs.FAULT_LOG))
    return env


def _rank_job(a: argparse.Namespace) -> RankJob:
    return RankJob(command=[a.script, *a.script_args], env=dict(_worker_env(a), COMMSLAYER_SCRATCH_DIR=a.scratch),
                   store_address=a.coordinator or a.address,
                   world_size=a.world_size, node=a.node_rank, per_node=a.nproc_per_node,
                   max_restarts=a.max_restarts, grace_s=a.grace, coordinator=a.coordinator,
                   crash_loop=a.crash_loop, crash_window_s=a.crash_window_s, spares=a.spares)


def _supervise(a: argparse.Namespace, store, procs: ProcessSet) -> Dict[int, int]:
    """Start this host's replica groups (and warm spares, with ``--spares``) and wait until
    they (or, on the coordinator alone, every group of the job) ended; each one's torchrun
    exit status."""
    outputs = {r: _group_output(store, r) for r in a.ids}
    worker = [a.script, *a.script_args]
    spares, desk = None, None
    if a.spares:  # the host's spares are filed under its first replica group (its "node")
        spares = Spares(a.spares, min(a.ids), store, procs, worker,
                        dict(_worker_env(a), COMMSLAYER_REPLICAS=str(a.replicas), COMMSLAYER_NODE=str(min(a.ids))),
                        echo, speaker="coordinator")
        desk = Desk(spares, store, outputs)
        worker = ["--no-python", sys.executable, "-S", shim.__file__, *worker]
    try:
        for r in a.ids:
            env = dict(_worker_env(a), COMMSLAYER_REPLICA=str(r), COMMSLAYER_REPLICAS=str(a.replicas))
            if desk is not None:
                env["COMMSLAYER_SPARE_DESK"] = desk.path
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(a.nproc_per_replica), "--max-restarts", str(a.max_restarts),
                   "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "--role", f"replica{r}", *worker]
            procs.start(r, cmd, env, on_line=outputs[r])
        return _watch_groups(a, store, procs, spares)
    finally:
        if desk is not None:
            desk.close()


def _watch_groups(a: argparse.Namespace, store, procs: ProcessSet, spares: Optional[Spares]) -> Dict[int, int]:
    codes: Dict[int, int] = {}
    watched = time.monotonic()
    while len(codes) < len(a.ids) or (not a.ids and not all_ended(store, "replica", a.replicas)):
        if a.coordinator or a.store:
            check_reachable(store, a.coordinator or a.store)  # also stops on a bug
        else:
            stop_on_bugs(store)
        if spares is not None:
            spares.fill()
        if not a.coordinator and time.monotonic() - watched > 0.5:
            watched = time.monotonic()
            _stop_on_crash_loop(a, store)
            _stop_when_no_replica_is_left(a, store)
        for r in a.ids:
            proc = procs.procs[r]
            if r not in codes and proc.poll() is not None:
                codes[r] = proc.returncode
                store.set(f"replica/{r}/{'done' if proc.returncode == 0 else 'gone'}", str(proc.returncode))
                print(f"coordinator: replica group {r} {'finished' if proc.returncode == 0 else 'gave up'} "
                      f"(torchrun exit {proc.returncode})", flush=True)
        time.sleep(0.1)
    return codes


TORCHRUN_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")  # torchrun's line


def _group_output(store, replica: int) -> Callable[[str], None]:
    """What a replica group's torchrun output goes to: this launcher's output; the check
    for Gloo's words before it aborts a rank on a collective mismatch; and, when torchrun
    says a worker exited non-zero while no rank of the group ever reached
    ``resilience.init()`` (``replica/<r>/joined``), the check of the output before it for
    an error of the script's own (``failures.record_start_failure``)."""
    tail: Deque[str] = deque(maxlen=failures.START_TAIL)

    def on_line(line: str) -> None:
        echo(f"[replica {replica}] {line}")
        if failures.gloo_abort(line):
            failures.record_gloo_abort(store, line, unit=f"replica group {replica}", key=f"replica{replica}",
                                       life=len(failures.restarts(store, replica)), pid=0)
        exited = TORCHRUN_FAILED.search(line)
        if exited and int(exited.group(1)) > 0 and not store.check([joined_key(replica)]):
            rank = int(exited.group(2))
            failures.record_start_failure(store, list(tail), unit=f"replica group {replica} rank {rank}",
                                          key=failures.unit_key(replica, rank), life=0, pid=int(exited.group(3)))
        tail.append(line)
    return on_line


def _stop_on_crash_loop(a: argparse.Namespace, store) -> None:
    """Replica mode's crash-loop rule: ``Stopped`` once a replica group's torchrun restarted
    it ``--crash-loop`` K times within the window (each new life's rank 0 records when it
    began; ``commslayer.resilience``)."""
    if not a.crash_loop:
        return
    now = time.time()
    for r in range(a.replicas):
        began = failures.restarts(store, r)
        recent = [t for t in began if now - t <= a.crash_window_s]
        if len(recent) >= a.crash_loop:
            raise Stopped(f"replica group {r} failed {len(recent)} times within {a.crash_window_s:g}s (torchrun "
                          f"restarted it {len(began)} time(s) in all): a crash loop (--crash-loop {a.crash_loop}/"
                          f"{a.crash_window_s:g}), not a fault to recover from: the job stops; its output is above")


def _stop_when_no_replica_is_left(a: argparse.Namespace, store) -> None:
    """``Stopped`` once every replica group was lost and none is left to heal the restarted
    ones from (``failures.no_replica_left``); nothing once the job has finished."""
    if store.check([FINISHED]):
        return
    gone = [r for r in range(a.replicas) if store.check([f"replica/{r}/gone"])]
    why = failures.no_replica_left(store, a.replicas, _shards(a), gone)
    if why is not None:
        raise Stopped(why)


# ------------------------------------------------------------------ the summary
def summarize(run_dir: str, store, shards: int, compare_to: Optional[str], tolerance: float,
              per_rank: bool = False, stopped: Optional[str] = None, nodes: int = 0) -> bool:
    """Print what the run did and whether its invariants hold (also into
    ``summary.json``); False if one does not, if a rank ended by a deterministic
    failure (``stopped``: why the launcher stopped the job), or if there is nothing
    to compare with ``compare_to``.  ``shards``: ranks per replica group (in
    per-rank mode, ``per_rank``, the job's ranks: one replica of each); ``nodes``: the
    hosts whose warm spares are counted."""
    spares = runs.job_spares(store, nodes)
    if spares is not None:
        print(f"summary: warm spares: {spares['used']} used, {spares['left']} left", flush=True)
    bugs = failures.bugs(store)
    if bugs and stopped is None:
        stopped = failures.stop_message(bugs)
    if stopped:
        print(f"summary: the job was stopped: {stopped}", flush=True)
    results = runs.load_results(run_dir)
    if not results:  # a script that writes none (commslayer.runs.save): nothing to check
        print(f"summary: no result files in {run_dir}", flush=True)
        if compare_to:
            print(f"summary: no loss curve to compare with {compare_to}", flush=True)
        if stopped:
            runs.save_summary(runs.Summary(ok=False, killed=[], losses={}, recoveries=runs.job_recoveries(store),
                                           admissions=runs.job_admissions(store), stopped=stopped,
                                           spares=spares), run_dir)
        return not compare_to and not stopped
    ok = not stopped
    steps = results[0].steps
    whole = all(r.end_step == steps for r in results)
    print(f"summary: {len(results)} rank(s) finished, every one at step {steps}: {whole}", flush=True)
    ok &= whole
    for shard in sorted({r.rank for r in results if r.fingerprints is not None}):
        prints = {r.replica: r.fingerprints for r in results if r.rank == shard}
        if len(prints) == 1 and len(next(iter(prints.values()))) == 1:
            continue  # one copy of the shard (per-rank mode, or one replica group): nothing to compare
        same = len({tuple(v) for v in prints.values()}) == 1 and len(set(next(iter(prints.values())))) == 1
        ok &= same
        print(f"summary: shard {shard}: parameters and optimizer state bitwise identical across replicas "
              f"{sorted(prints)}: {same}", flush=True)
    killed = runs.injections(run_dir, shards)
    recoveries, admissions = runs.job_recoveries(store), runs.job_admissions(store)
    for i, k in enumerate(killed):
        until = killed[i + 1]["t"] if i + 1 < len(killed) else float("inf")
        unit = k["rank"] if per_rank else k["replica"]  # what a recovery lost: ranks in per-rank mode
        rec = next((x for x in recoveries if unit in x.lost_replicas and k["t"] <= x.detected_at < until), None)
        k["stall_s"] = rec.committed_at - k["t"] if rec and rec.committed_at is not None else None
        stall = "n/a (no recovery recorded)" if k["stall_s"] is None else f"{k['stall_s']:.3f}s"
        print(f"summary: fault: {k['what']} ({'rank' if per_rank else 'replica group'} {unit}); "
              f"survivor stall (fault to next committed step) {stall}", flush=True)
    for adm in admissions:
        print(f"summary: replica(s) {adm.replicas} rejoined at step {adm.step} (generation "
              f"{adm.generation}); join and state transfer {adm.heal_s:.3f}s", flush=True)
    losses = runs.longest(results).losses
    if compare_to:
        ref = runs.longest(runs.load_results(compare_to)).losses
        # the first fault: injected by the harness, or recovered from (a real death injects nothing)
        faulted = [k["step"] for k in killed if k.get("step") is not None] + [x.step for x in recoveries]
        ok &= compare_losses(losses, ref, min(faulted, default=steps), tolerance, compare_to)
    runs.save_summary(runs.Summary(ok=bool(ok), killed=killed, losses=losses, recoveries=recoveries,
                                   admissions=admissions, stopped=stopped, spares=spares), run_dir)
    return bool(ok)


def compare_losses(losses: Dict[int, float], ref: Dict[int, float], first_fault: int, tolerance: float,
                   ref_dir: str, window: int = 5) -> bool:
    """Steps before the first fault must have the reference's loss exactly (same seeds,
    same data); after it, the mean loss of every ``window`` consecutive steps must stay
    within ``tolerance`` (relative) of the reference's: while a replica group is
    missing a step averages fewer batches, so single steps differ more."""
    steps = sorted(ref)
    if sorted(losses) != steps:
        print(f"summary: loss vs {ref_dir}: the runs have different steps ({len(losses)} vs {len(steps)})",
              flush=True)
        return False
    same = all(losses[s] == ref[s] for s in steps if s < first_fault)
    worst, at = 0.0, None
    for i in range(len(steps) - window + 1):
        span = steps[i:i + window]
        mine, theirs = sum(losses[s] for s in span) / window, sum(ref[s] for s in span) / window
        if abs(mine - theirs) / theirs > worst:
            worst, at = abs(mine - theirs) / theirs, span[0]
    last = steps[-1]
    within = same and worst <= tolerance
    print(f"summary: loss vs the fault-free run {ref_dir}: steps before the fault identical: {same}; largest "
          f"difference of a {window}-step mean {worst:.2%} (steps {at}..{None if at is None else at + window - 1}; "
          f"tolerance {tolerance:.0%}); final loss {losses[last]:.6g} vs {ref[last]:.6g} "
          f"({losses[last] / ref[last] - 1:+.2%}): {'within' if within else 'OUTSIDE'} tolerance", flush=True)
    return within
