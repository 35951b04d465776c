"""``commslayer-run``: a resilient job's launcher, in one of two modes, with a coordinator outside the job.

Replica mode (``--replicas R``): one torchrun per replica group.  torchrun's
agent ends every worker of its group when one dies, so a job that must
outlive a rank runs one torchrun per replica group, each with
``--max-restarts`` (it restarts its own group), and a coordinator that none of
them can take down: it holds the job's store, where the membership of the
replicate dimension is decided (commslayer.membership) and where each
group's launcher records that it finished (``replica/<r>/done``) or gave up
(``replica/<r>/gone``).

Per-rank mode (no ``--replicas``): every rank is its own restart unit,
started without torchrun and replaced alone when it is lost, while the
others hold (commslayer.supervisor, which also lists the store keys the
launcher and the ranks share).  It is for scripts on commslayer.resilience:
``MASTER_ADDR``/``MASTER_PORT`` name the job's store, which is already a
TCPStore server, so a plain ``init_process_group("env://")`` would try to
serve it again on rank 0.  ``--nproc-per-node P`` ranks on each of
``--nnodes M`` hosts (defaults 2 and 1); the coordinator runs node 0's
ranks, every other host its ``--node-rank``'s; ``--max-restarts`` counts per
rank.

Like torchrun, the script is the first argument that is not an option, and
every argument after it is the script's::

    commslayer-run --replicas 2 --nproc-per-replica 2 --run-dir runs/x train.py --steps 40
    commslayer-run --nproc-per-node 4 --run-dir runs/y fsdp2.py --steps 40

Several hosts: in replica mode the coordinator on one, each host's replica
groups on it; in per-rank mode the coordinator with node 0's ranks and one
launcher per other host (all of them with the same ``--run-dir`` on a shared
filesystem, or none; ``GLOO_SOCKET_IFNAME`` names the interface the ranks
use)::

    commslayer-run --replicas 2 --replica-ids none --host 10.0.0.1 --port 29600 --run-dir /shared/x
    GLOO_SOCKET_IFNAME=eth0 commslayer-run --replicas 2 --replica-ids 1 --coordinator 10.0.0.1:29600 \\
        --run-dir /shared/x train.py --steps 40

    commslayer-run --nnodes 2 --nproc-per-node 4 --host 10.0.0.1 --port 29600 fsdp2.py
    commslayer-run --nnodes 2 --nproc-per-node 4 --node-rank 1 --coordinator 10.0.0.1:29600 fsdp2.py

The job's store on etcd (``--store etcd://h1:2379,h2:2379,h3:2379/JOB``): no
process of the job holds its state, so losing the coordinator's host, or any
one etcd member, is survivable.  The launcher that starts the job holds the
key ``JOB/launcher`` under a lease it renews (a second launcher of the same
job is refused; one that died frees it within 10 s), deletes what an earlier
job of that name left, and writes ``JOB/launcher/started`` under the same
lease; launchers on other hosts join with ``--coordinator`` and the same
address, once that key exists::

    commslayer-run --replicas 2 --replica-ids none --store etcd://10.0.0.5:2379,10.0.0.6:2379/run7 --run-dir /shared/x
    commslayer-run --replicas 2 --replica-ids 0 --coordinator etcd://10.0.0.5:2379,10.0.0.6:2379/run7 \
        --run-dir /shared/x train.py --steps 40

The workers run in the caller's working directory and get
``COMMSLAYER_JOB_STORE`` (the coordinator's host:port, or the etcd address) and, with
``--run-dir``, ``COMMSLAYER_RUN_DIR``,
``COMMSLAYER_FAULTS_LOG=<run-dir>/faults.jsonl`` and
``COMMSLAYER_TRACE_DIR=<run-dir>/traces`` unless they are set already (set
the trace directory empty to run without tracing); in replica mode
``COMMSLAYER_REPLICA`` and ``COMMSLAYER_REPLICAS`` too; in per-rank mode
what torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``: the rank's life) and
``COMMSLAYER_RESTART_UNIT=rank``, ``COMMSLAYER_NODE`` (the node rank) and
``COMMSLAYER_JOB_RANK``.  Every process started here runs in its own
session and is ended (SIGTERM, then SIGKILL after ``--grace``), with
everything it started, when the launcher exits, Ctrl-C and SIGTERM
included.  With ``--run-dir``, the coordinator prints at the end the run's
summary (commslayer's recoveries, the survivor stall per fault, whether the
replicas' state matches; also in ``<run-dir>/summary.json``) and
``--compare-to`` compares its loss curve with another run's.

Exit status: 0 when every replica group (or rank) started here finished
(and, with ``--run-dir``, the summary found nothing wrong); 1 when one gave
up, a rank wrote ``job/failed``, the job's store was lost (the coordinator, or etcd's quorum) or the summary
found a problem; 2 for bad arguments (options of the other mode included);
130 when interrupted.  Anything but 0 comes with one line on stderr.
SIGUSR1 prints the launcher's own threads' stacks to stderr (a launcher
that seems stuck shows where).
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, NoReturn, Optional, Tuple

import torch.distributed as dist

from . import config, failures, runs
from .addresses import host_port
from .errors import first_line
from .etcdstore import Claim, EtcdStore, is_etcd, parse_url
from .processes import ProcessSet, become_subreaper, free_port
from .store import bounded, connect
from .supervisor import Failed, RankJob, Stopped, all_ended, check_reachable, echo, stop_on_bugs, supervise_ranks

PROG = "commslayer-run"
GRACE_S = 5.0  # default --grace: SIGTERM to SIGKILL when the launcher ends its processes
STORE_TIMEOUT = timedelta(seconds=60)
CLAIM_TTL_S = 10.0  # a job on etcd whose launcher is gone can be started again this long after
LAUNCHER, STARTED = "launcher", "launcher/started"  # the keys on etcd that the launcher starting a job holds


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, exit 2 (argparse's own adds the whole usage)."""
        self.exit(2, f"{PROG}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, usage=f"{PROG} [options] script.py [script args]", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--replicas", type=int,
                   help="replica groups in the job: replica mode (without it: per-rank mode)")
    p.add_argument("--nproc-per-replica", type=int, help="replica mode: ranks per replica group (default 2)")
    p.add_argument("--replica-ids",
                   help="replica mode: the replica groups to run here: all (default), none (only the coordinator) "
                        "or 0,2,...")
    p.add_argument("--nproc-per-node", type=int, help="per-rank mode: ranks on this host (default 2)")
    p.add_argument("--nnodes", type=int, help="per-rank mode: hosts in the job (default 1)")
    p.add_argument("--node-rank", type=int,
                   help="per-rank mode: this host's place (default 0, the coordinator's): it runs ranks "
                        "node-rank * nproc-per-node and up")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="join a running job: its coordinator's HOST:PORT, or the etcd:// address its --store names "
                        "(default: be the coordinator)")
    p.add_argument("--store", metavar="etcd://HOST:PORT,.../JOB",
                   help="keep the job's store on an etcd cluster, under the key prefix JOB/, instead of in this "
                        "launcher (default): the job then outlives this host")
    p.add_argument("--host", help="the address the coordinator listens on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the coordinator's port (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of each replica group (torchrun's) or, in per-rank mode, of each rank (default 3)")
    p.add_argument("--crash-loop", metavar="K/SECONDS", default="3/600",
                   help="stop the job when one rank (in replica mode: one replica group) fails K times within "
                        "SECONDS, even if each failure looks like a fault (default 3/600; off: never)")
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help=f"seconds between SIGTERM and SIGKILL on exit (default {GRACE_S:g})")
    p.add_argument("--run-dir", help="results, the fault log and traces go here")
    p.add_argument("--compare-to", metavar="RUN_DIR", help="a fault-free run's --run-dir: compare the loss curves")
    p.add_argument("--loss-tolerance", type=float, default=0.05,
                   help="largest relative difference of a 5-step mean loss against --compare-to (default 0.05)")
    p.add_argument("script", nargs="?", help="the training script, run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments, checked: anything that cannot make a job is a one-line error (exit 2)."""
    p = parser()
    a = p.parse_args(argv)
    if a.script_args[:1] == ["--"]:  # `script.py -- args`
        a.script_args = a.script_args[1:]
    if a.max_restarts < 0:
        p.error(f"--max-restarts {a.max_restarts}: must be 0 or more")
    a.crash_loop, a.crash_window_s = _crash_loop(p, a.crash_loop)
    if not 0 <= a.grace < math.inf:
        p.error(f"--grace {a.grace}: must be a finite number of seconds >= 0")
    if not 0 <= a.loss_tolerance < math.inf:
        p.error(f"--loss-tolerance {a.loss_tolerance}: must be a finite number >= 0")
    if a.coordinator is not None:
        if a.host is not None or a.port is not None or a.store is not None:
            p.error("--coordinator joins a running job; --host, --port and --store start one: give one or the other")
        if is_etcd(a.coordinator):
            _etcd_address(p, "--coordinator", a.coordinator)
        else:
            _address(p, a.coordinator)
    elif a.store is not None:
        if a.host is not None or a.port is not None:
            p.error("--store keeps the job's store on etcd; --host and --port start this launcher's own: give one "
                    "or the other")
        _etcd_address(p, "--store", a.store)
    elif a.port is not None and not 0 <= a.port <= 65535:
        p.error(f"--port {a.port}: a TCP port is 0..65535")
    a.per_rank = a.replicas is None
    if a.per_rank:
        _per_rank_mode(p, a)
    else:
        _replica_mode(p, a)
    if a.script is None:
        if a.per_rank or a.ids:
            p.error(f"name the script to run: {PROG} [options] script.py [script args]")
    elif not os.path.isfile(a.script):
        why = "is a directory" if os.path.isdir(a.script) else "no such file"
        p.error(f"script {a.script!r}: {why}")
    elif not os.access(a.script, os.R_OK):
        p.error(f"script {a.script!r}: not readable")
    else:
        a.script = os.path.abspath(a.script)
    if a.compare_to is not None:
        if a.run_dir is None:
            p.error("--compare-to compares this run's --run-dir with another's: give --run-dir too")
        if not runs.result_paths(a.compare_to):
            p.error(f"--compare-to {a.compare_to!r}: no result files there (result-m*-r*.json)")
    if a.run_dir is not None:
        a.run_dir = os.path.abspath(a.run_dir)
        try:
            os.makedirs(a.run_dir, exist_ok=True)
        except OSError as exc:
            p.error(f"--run-dir {a.run_dir!r}: {exc.strerror or exc}")
    return a


def _replica_mode(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("nproc_per_node", "nnodes", "node_rank"):
        if getattr(a, name) is not None:
            p.error(f"--{name.replace('_', '-')} is for per-rank mode (without --replicas); replica mode takes "
                    "--nproc-per-replica and --replica-ids")
    a.nproc_per_replica = 2 if a.nproc_per_replica is None else a.nproc_per_replica
    if a.replicas < 1:
        p.error(f"--replicas {a.replicas}: a job needs at least 1 replica group")
    if a.nproc_per_replica < 1:
        p.error(f"--nproc-per-replica {a.nproc_per_replica}: a replica group needs at least 1 rank")
    a.ids = _replica_ids(p, a.replica_ids or "all", a.replicas)


def _per_rank_mode(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("nproc_per_replica", "replica_ids"):
        if getattr(a, name) is not None:
            p.error(f"--{name.replace('_', '-')} is for replica mode: give --replicas too (without it every rank "
                    "is its own restart unit: --nproc-per-node, --nnodes, --node-rank)")
    a.nproc_per_node = 2 if a.nproc_per_node is None else a.nproc_per_node
    a.nnodes = 1 if a.nnodes is None else a.nnodes
    a.node_rank = 0 if a.node_rank is None else a.node_rank
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node {a.nproc_per_node}: a host needs at least 1 rank")
    if a.nnodes < 1:
        p.error(f"--nnodes {a.nnodes}: a job needs at least 1 host")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank}: a host's place is in 0..{a.nnodes - 1} (--nnodes {a.nnodes})")
    if a.node_rank > 0 and a.coordinator is None:
        p.error(f"--node-rank {a.node_rank} joins the job's coordinator: give --coordinator HOST:PORT (the "
                "coordinator runs node rank 0)")
    if a.node_rank == 0 and a.coordinator is not None:
        p.error("--coordinator with node rank 0: the coordinator runs node rank 0's ranks; give this host's "
                "--node-rank (1 and up)")
    a.world_size = a.nnodes * a.nproc_per_node


def _crash_loop(p: argparse.ArgumentParser, spec: str) -> Tuple[int, float]:
    """``--crash-loop K/SECONDS`` (or ``off``): (K, the window); K 0 is off."""
    if spec.strip().lower() == "off":
        return 0, 0.0
    try:
        k, window = spec.split("/")
        count, seconds = int(k), float(window)
    except ValueError:
        p.error(f"--crash-loop {spec!r}: expected K/SECONDS (failures of one rank within that window), or off")
    if count < 1 or not 0 < seconds < math.inf:
        p.error(f"--crash-loop {spec}: K must be 1 or more and SECONDS a positive number (or: off)")
    return count, seconds


def _replica_ids(p: argparse.ArgumentParser, spec: str, replicas: int) -> List[int]:
    if spec == "all":
        return list(range(replicas))
    if spec == "none":
        return []
    try:
        ids = [int(x) for x in spec.split(",")]
    except ValueError:
        p.error(f"--replica-ids {spec!r}: expected all, none, or replica ids such as 0,2")
    if any(not 0 <= r < replicas for r in ids) or len(set(ids)) != len(ids):
        p.error(f"--replica-ids {spec}: distinct replica ids in 0..{replicas - 1} (--replicas {replicas})")
    return ids


def _etcd_address(p: argparse.ArgumentParser, option: str, url: str) -> None:
    try:
        _, prefix = parse_url(url)
    except ValueError as exc:
        p.error(f"{option} {exc}")
    if not prefix:
        why = ", and a job starting there deletes what an earlier one left" if option == "--store" else ""
        p.error(f"{option} {url!r}: name the job after the endpoints (etcd://HOST:PORT,.../JOB): its keys live "
                f"under JOB/{why}")


def _address(p: argparse.ArgumentParser, text: str) -> None:
    try:
        host_port(text)
    except ValueError as exc:
        p.error(f"--coordinator {exc}")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``commslayer-run`` console script."""
    a = parse(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    become_subreaper()
    procs = ProcessSet(a.grace)
    store = None

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control starts a background launcher with
    # SIGINT ignored, and `kill -INT` must still end the job (as torchrun does).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        store = _job_store(a)
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
            summarize(a.run_dir, store, _shards(a), None, a.loss_tolerance, per_rank=a.per_rank, stopped=str(exc))
        return 1
    except dist.DistNetworkError as exc:  # the job's store went away between two checks
        print(f"{PROG}: the job's store failed ({first_line(exc)}); ended the processes started here",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the ending short
            signal.signal(sig, signal.SIG_IGN)
        procs.stop()
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
    if a.run_dir and not a.coordinator:  # the coordinator has seen every replica group (or rank) end
        summarized = summarize(a.run_dir, store, _shards(a), a.compare_to, a.loss_tolerance, per_rank=a.per_rank)
        if not summarized and ok:
            print(f"{PROG}: the run's summary found a problem (the 'summary:' lines above, {a.run_dir}/"
                  f"{runs.SUMMARY})", file=sys.stderr, flush=True)
        ok = ok and summarized
    return 0 if ok else 1


def _shards(a: argparse.Namespace) -> int:
    """Ranks per replica group (in per-rank mode, the job's ranks: one replica of each)."""
    return a.world_size if a.per_rank else a.nproc_per_replica


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
            env["COMMSLAYER_TRACE_DIR"] = os.path.join(a.run_dir, "traces")
        env.setdefault("COMMSLAYER_FAULTS_LOG", os.path.join(a.run_dir, runs.FAULT_LOG))
    return env


def _rank_job(a: argparse.Namespace) -> RankJob:
    return RankJob(command=[a.script, *a.script_args], env=dict(_worker_env(a), COMMSLAYER_SCRATCH_DIR=a.scratch), store_address=a.coordinator or a.address,
                   world_size=a.world_size, node=a.node_rank, per_node=a.nproc_per_node,
                   max_restarts=a.max_restarts, grace_s=a.grace, coordinator=a.coordinator,
                   crash_loop=a.crash_loop, crash_window_s=a.crash_window_s)


def _supervise(a: argparse.Namespace, store, procs: ProcessSet) -> Dict[int, int]:
    """Start this host's replica groups and wait until they (or, on the coordinator
    alone, every group of the job) ended; each one's torchrun exit status."""
    for r in a.ids:
        env = dict(_worker_env(a), COMMSLAYER_REPLICA=str(r), COMMSLAYER_REPLICAS=str(a.replicas))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(a.nproc_per_replica), "--max-restarts", str(a.max_restarts),
               "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "--role", f"replica{r}", a.script, *a.script_args]
        procs.start(r, cmd, env, on_line=lambda line, r=r: echo(f"[replica {r}] {line}"))
    codes: Dict[int, int] = {}
    watched = time.monotonic()
    while len(codes) < len(a.ids) or (not a.ids and not all_ended(store, "replica", a.replicas)):
        if a.coordinator or a.store:
            check_reachable(store, a.coordinator or a.store)  # also stops on a bug
        else:
            stop_on_bugs(store)
        if not a.coordinator and time.monotonic() - watched > 0.5:
            watched = time.monotonic()
            _stop_on_crash_loop(a, store)
        for r, proc in procs.procs.items():
            if r not in codes and proc.poll() is not None:
                codes[r] = proc.returncode
                store.set(f"replica/{r}/{'done' if proc.returncode == 0 else 'gone'}", str(proc.returncode))
                print(f"coordinator: replica group {r} {'finished' if proc.returncode == 0 else 'gave up'} "
                      f"(torchrun exit {proc.returncode})", flush=True)
        time.sleep(0.1)
    return codes


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


# ------------------------------------------------------------------ the summary
def summarize(run_dir: str, store, shards: int, compare_to: Optional[str], tolerance: float,
              per_rank: bool = False, stopped: Optional[str] = None) -> bool:
    """Print what the run did and whether its invariants hold (also into
    ``summary.json``); False if one does not, if a rank ended by a deterministic
    failure (``stopped``: why the launcher stopped the job), or if there is nothing
    to compare with ``compare_to``.  ``shards``: ranks per replica group (in
    per-rank mode, ``per_rank``, the job's ranks: one replica of each)."""
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
                                           admissions=runs.job_admissions(store), stopped=stopped), run_dir)
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
                                   admissions=admissions, stopped=stopped), run_dir)
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


if __name__ == "__main__":
    sys.exit(main())
