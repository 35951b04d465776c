"""``commslayer-run``: a resilient job's launcher, in one of two modes, with a coordinator outside the job.

Replica mode (``--replicas R``): one torchrun per replica group.  torchrun's
agent ends every worker of its group when one dies, so a job that must
outlive a rank runs one torchrun per replica group, each with
``--max-restarts`` (it restarts its own group), and a coordinator that none of
them can take down: it holds the job's store, where the membership of the
replicate dimension is decided (commslayer.agree.membership) and where each
group's launcher records that it finished (``replica/<r>/done``) or gave up
(``replica/<r>/gone``), and each group's ranks that they reached
``resilience.init()`` (``replica/<r>/joined``: a group that fails without it
cannot start its script, a bug).

Per-rank mode (no ``--replicas``): every rank is its own restart unit,
started without torchrun and replaced alone when it is lost, while the
others hold (commslayer.run.supervisor, which also lists the store keys the
launcher and the ranks share).  It is for scripts on commslayer.resilience:
``MASTER_ADDR``/``MASTER_PORT`` name the job's store, which is already a
TCPStore server; as under torchrun, ``TORCHELASTIC_USE_AGENT_STORE=True``
makes a plain ``init_process_group("env://")`` connect to it on every rank
(an unconverted script runs, without recovery).  ``--nproc-per-node P`` ranks on each of
``--nnodes M`` hosts (defaults 2 and 1); the coordinator runs node 0's
ranks, every other host its ``--node-rank``'s; ``--max-restarts`` counts per
rank.

``--spares S`` keeps S warm spares on each host (commslayer.run.spares):
a lost rank's next life is one of them, its imports done, instead of a
process started cold.  In replica mode torchrun restarts every rank of the
group, and each restarted rank is a spare while spares are left: torchrun
starts commslayer.run.shim, which asks this launcher for one.

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
``TORCHELASTIC_USE_AGENT_STORE``, ``TORCHELASTIC_RESTART_COUNT``: the rank's life) and
``COMMSLAYER_RESTART_UNIT=rank``, ``COMMSLAYER_NODE`` (the node rank) and
``COMMSLAYER_JOB_RANK``.  Every process started here runs in its own
session and is ended (SIGTERM, then SIGKILL after ``--grace``), with
everything it started, when the launcher exits, Ctrl-C and SIGTERM
included (a torchrun agent's traceback of that SIGTERM, tens of lines of
torch's frames, is one line of the output).  With ``--run-dir``, the coordinator prints at the end the run's
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
import fcntl
import io
import math
import os
import socket
import sys
import tempfile
import threading
from typing import List, NoReturn, Optional, TextIO, Tuple

from commslayer import config, runs
from commslayer.endpoints import host_port, is_etcd, parse_url
from commslayer.errors import ConfigError
from commslayer.runs import PROG

GRACE_S = 5.0  # default --grace: SIGTERM to SIGKILL when the launcher ends its processes
MAX_WORLD = 65_536  # ranks in a job: the job's store holds keys per rank, which the coordinator scans
PROCS_PER_CPU = 4  # default --max-local-procs: this many per CPU of the host (at least MIN_LOCAL_PROCS)
MIN_LOCAL_PROCS = 8
# Variables this launcher alone sets, for some of its processes; inherited from the caller's
# environment by every rank, each made a job hang: a leftover COMMSLAYER_SPARE made every rank
# wait as a warm spare for a rank nobody gives it, COMMSLAYER_RESTART_UNIT=rank made replica
# mode's ranks start as per-rank mode's (and fail, then hang in their group's next life); and
# COMMSLAYER_JOB_RANK gave every rank of replica mode one job rank (their trace files overwrote each other).
LAUNCHERS_OWN = {"COMMSLAYER_SPARE": "a warm spare's id, for --spares' processes only",
                 "COMMSLAYER_RESTART_UNIT": "per-rank mode's, for its ranks only",
                 "COMMSLAYER_JOB_RANK": "one rank's place in the job, for that rank only"}


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
    p.add_argument("--spares", type=int, default=0,
                   help="warm spares on each host, started with the job and waiting in resilience.init(); a "
                        "lost rank's next life (in replica mode: each rank of a restarted replica group, while "
                        "spares are left) is one of them instead of a cold start (default 0)")
    p.add_argument("--max-local-procs", type=int,
                   help="refuse to start more processes than this on this host (ranks and spares; in replica "
                        f"mode torchrun agents and their workers) (default {PROCS_PER_CPU} per CPU, at least "
                        f"{MIN_LOCAL_PROCS})")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of each replica group (torchrun's) or, in per-rank mode, of each rank (default 3)")
    p.add_argument("--crash-loop", metavar="K/SECONDS", default="3/600",
                   help="stop the job when one rank (in replica mode: one replica group) fails K times within "
                        "SECONDS, even if each failure looks like a fault (default 3/600; off: never)")
    p.add_argument("--grace", type=float, default=GRACE_S,
                   help=f"seconds between SIGTERM and SIGKILL on exit (default {GRACE_S:g})")
    p.add_argument("--status-port", type=int, metavar="PORT",
                   help="serve the job's status on this port: an HTML page at /, Prometheus metrics at /metrics, "
                        "/healthz (unauthenticated; the coordinator only; 0: a free port; default: off)")
    p.add_argument("--status-host",
                   help="the address --status-port listens on (default 127.0.0.1)")
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
    for name, what in LAUNCHERS_OWN.items():
        if os.environ.get(name, "").strip():
            p.error(f"{name}={os.environ[name]!r} is in the environment: {PROG} sets it itself ({what}), and every "
                    "rank would inherit it: unset it")
    try:
        config.store_timeout_s()  # what this launcher's own calls to the job's store are bounded by
    except ConfigError as exc:
        p.error(str(exc))
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
    if a.status_port is not None:
        a.status_host = "127.0.0.1" if a.status_host is None else a.status_host
        if a.coordinator is not None:
            p.error("--status-port is served by the launcher that starts the job; this one joins it (--coordinator)")
        if not 0 <= a.status_port <= 65535:
            p.error(f"--status-port {a.status_port}: a TCP port is 0..65535")
        if a.status_port and a.status_port == a.port:
            p.error(f"--status-port {a.status_port} is also --port, where the job's store listens: give another")
        if not a.status_host.strip():  # socket's "" is every interface: an empty $VAR must not publish the server
            p.error(f"--status-host {a.status_host!r}: name an address (0.0.0.0 for every interface, unauthenticated)")
    elif a.status_host is not None:
        p.error(f"--status-host {a.status_host} without --status-port: give the port the status server listens on")
    a.per_rank = a.replicas is None
    if a.per_rank:
        _per_rank_mode(p, a)
    else:
        _replica_mode(p, a)
    _bounded(p, a)
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
            with tempfile.TemporaryFile(dir=a.run_dir):  # a read-only mount, another user's folder: not later
                pass
        except OSError as exc:
            p.error(f"--run-dir {a.run_dir!r}: cannot write there: {exc.strerror or exc}")
        if a.coordinator is None:  # one job's launcher at a time (those joining it share the folder)
            a.run_dir_lock = os.open(a.run_dir, os.O_RDONLY | os.O_DIRECTORY)  # held until this process ends
            try:
                fcntl.flock(a.run_dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                p.error(f"--run-dir {a.run_dir!r}: another {PROG} runs a job there now (the two runs' results, "
                        "traces and summaries would mix): give another --run-dir, or wait until that job ends")
    return a


def _replica_mode(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("nproc_per_node", "nnodes", "node_rank"):
        if getattr(a, name) is not None:
            p.error(f"--{name.replace('_', '-')} is for per-rank mode (without --replicas); replica mode takes "
                    "--nproc-per-replica and --replica-ids")
    _spares(p, a)
    a.nproc_per_replica = 2 if a.nproc_per_replica is None else a.nproc_per_replica
    if a.replicas < 1:
        p.error(f"--replicas {a.replicas}: a job needs at least 1 replica group")
    if a.nproc_per_replica < 1:
        p.error(f"--nproc-per-replica {a.nproc_per_replica}: a replica group needs at least 1 rank")
    a.ids = _replica_ids(p, a.replica_ids or "all", a.replicas)
    if a.spares and not a.ids:
        p.error(f"--spares {a.spares} with --replica-ids none: spares stand in for ranks of this host's replica "
                "groups, and it runs none")


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
    _spares(p, a)
    a.world_size = a.nnodes * a.nproc_per_node


def _spares(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.spares < 0:
        p.error(f"--spares {a.spares}: must be 0 or more")
    if a.spares and a.max_restarts == 0:
        p.error(f"--spares {a.spares} with --max-restarts 0: a spare becomes a lost rank's next life, and "
                "--max-restarts 0 starts none")


def _bounded(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse, before anything starts, a job larger than the job's store is meant for or
    more processes than this host can run (an extra zero in ``--nproc-per-node`` must be
    a one-line error, not a launcher that fills the host's memory)."""
    world = a.world_size if a.per_rank else a.replicas * a.nproc_per_replica
    if world > MAX_WORLD:
        p.error(f"a job of {world} ranks: at most {MAX_WORLD}")
    if a.per_rank:
        here, what = a.nproc_per_node + a.spares, f"--nproc-per-node {a.nproc_per_node}" + (
            f" and --spares {a.spares}" if a.spares else "")
    else:
        here = len(a.ids) * (a.nproc_per_replica + 1) + a.spares
        what = f"{len(a.ids)} replica group(s) of --nproc-per-replica {a.nproc_per_replica} (and a torchrun agent " \
            "each)" + (f" and --spares {a.spares}" if a.spares else "")
    cpus = os.cpu_count() or 1
    limit = a.max_local_procs if a.max_local_procs is not None else max(MIN_LOCAL_PROCS, PROCS_PER_CPU * cpus)
    if a.max_local_procs is not None and a.max_local_procs < 1:
        p.error(f"--max-local-procs {a.max_local_procs}: must be 1 or more")
    if here > limit:
        why = "--max-local-procs" if a.max_local_procs is not None else \
            f"this host's {cpus} CPU(s) allow {limit} (--max-local-procs to allow more)"
        p.error(f"{what}: {here} processes on this host, more than {limit}: {why}")


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


class Output(io.TextIOBase):
    """The launcher's standard output, where every process's output lines go: once its reader
    is gone (``commslayer-run ... | head``, a ``tee`` that died) a write raised
    ``BrokenPipeError`` in the thread relaying a process's output, which stopped reading it,
    and the process then blocked on its full pipe: the job hung.  Here the first such write
    says so in one line on stderr, and every later one goes to /dev/null: the job goes on."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self._lock = threading.Lock()
        self._closed = False

    def write(self, text: str) -> int:
        """Write ``text`` (dropped once the reader is gone)."""
        try:
            self._stream.write(text)
        except BrokenPipeError:
            self._gone()
        return len(text)

    def flush(self) -> None:
        """Flush (nothing once the reader is gone)."""
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def fileno(self) -> int:
        """The file descriptor underneath."""
        return self._stream.fileno()

    def _gone(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())  # what is buffered, and all later
        print(f"{PROG}: its standard output was closed (broken pipe): the job goes on, and the output of its "
              "processes is dropped from here on", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``commslayer-run`` console script: the arguments are checked
    before torch is imported (seconds on a loaded machine), so that ``--help`` and a
    usage error answer at once; then ``commslayer.run.launch`` runs the job."""
    a = parse(argv)
    sys.stdout = Output(sys.stdout)
    a.status_socket = None
    if a.status_port is not None:  # before any process starts (and before torch): a port in use ends it here
        family = socket.AF_INET6 if ":" in a.status_host else socket.AF_INET
        try:
            a.status_socket = socket.create_server((a.status_host, a.status_port), family=family)
        except OSError as exc:  # a name that does not resolve: a negative errno (getaddrinfo's), its text in strerror
            why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else \
                (exc.strerror or str(exc)).split(" (while attempting")[0]
            print(f"{PROG}: error: --status-port {a.status_port}: cannot listen on {a.status_host}:{a.status_port}: "
                  f"{why}", file=sys.stderr, flush=True)
            return 2
    from commslayer.run.launch import run

    return run(a)


if __name__ == "__main__":
    sys.exit(main())
