"""The launcher of a resilient job: one torchrun per replica group, and a coordinator outside them.

torchrun's agent ends every worker of its group when one dies, so a job that
must outlive a rank runs one torchrun per replica group, each with
``--max-restarts`` (it restarts its own group), and a coordinator that none of
them can take down: it holds the job's store, where the membership of the
replicate dimension is decided (commslayer.membership) and where each
group's launcher records that it finished (``replica/<r>/done``) or gave up
(``replica/<r>/gone``).

One host, everything (the coordinator and every replica group)::

    python launch/run.py --replicas 2 --nproc-per-replica 2 --run-dir runs/x -- --steps 40 --kill 1:10:allreduce

Several hosts: the coordinator on one, each host's replica groups on it (all of them
with the same ``--run-dir`` on a shared filesystem, or none; ``GLOO_SOCKET_IFNAME``
names the interface the ranks use)::

    python launch/run.py --replicas 2 --replica-ids none --host 10.0.0.1 --port 29600 --run-dir /shared/x
    GLOO_SOCKET_IFNAME=eth0 python launch/run.py --replicas 2 --replica-ids 1 --coordinator 10.0.0.1:29600 \
        --run-dir /shared/x -- --steps 40

The workers get ``COMMSLAYER_JOB_STORE``, ``COMMSLAYER_REPLICA``,
``COMMSLAYER_REPLICAS`` and, with ``--run-dir``, ``--run-dir`` itself and
``COMMSLAYER_TRACE_DIR=<run-dir>/traces`` unless it is set already (set it
empty to run without tracing).  Every process started here
runs in its own process group and is ended (SIGTERM, then SIGKILL after
``--grace``) when the launcher exits, Ctrl-C included.  Exit status: 0 when
every replica group started here finished, 1 otherwise.  With ``--run-dir``,
the coordinator prints at the end the run's summary (commslayer's recoveries, the survivor
stall per fault, whether the replicas' state matches) and ``--compare-to``
compares its loss curve with another run's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
FAULT_LOG = "faults.jsonl"  # in --run-dir: injected faults and each communicator's first failure (faults.inject)
GRACE_S = 5.0  # default --grace


class Launcher:
    """The torchruns of this host, ended together whatever way the launcher exits."""

    def __init__(self, grace_s: float) -> None:
        self.procs: Dict[int, subprocess.Popen] = {}
        self._grace_s = grace_s
        self._printing: List[threading.Thread] = []

    def start(self, replica: int, cmd: List[str], env: Dict[str, str]) -> None:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
        self.procs[replica] = proc
        t = threading.Thread(target=self._relay, args=(replica, proc), daemon=True)
        t.start()
        self._printing.append(t)

    @staticmethod
    def _relay(replica: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            sys.stdout.write(f"[replica {replica}] {line}")
            sys.stdout.flush()

    def stop(self) -> None:
        """End every process started here, and everything they started: SIGTERM to the
        torchrun agents (each ends its workers), SIGKILL after the grace period to
        whatever is left. torchrun puts its workers in sessions of their own, and a
        worker whose agent died first is re-parented to this process (a subreaper),
        so what is left is found among this process's descendants."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while left := descendants(os.getpid()):
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self.procs.values():
                p.poll()  # reap
            time.sleep(0.05)
        for p in self.procs.values():
            p.wait()
        for t in self._printing:
            t.join(timeout=1)


def descendants(pid: int) -> List[int]:
    """Every live (not zombie) process below ``pid``, from /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if state != "Z":
                children.setdefault(int(ppid), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _address_towards(address: str) -> str:
    """This host's address on the route to ``address`` (HOST:PORT)."""
    host, port = address.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))  # a UDP connect sends nothing: it only picks the route
        return s.getsockname()[0]


def _replica_ids(spec: str, replicas: int) -> List[int]:
    if spec == "all":
        return list(range(replicas))
    if spec == "none":
        return []
    ids = [int(x) for x in spec.split(",")]
    if any(not 0 <= r < replicas for r in ids):
        raise SystemExit(f"--replica-ids {spec}: replica ids are 0..{replicas - 1}")
    return ids


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="replica groups in the job")
    p.add_argument("--nproc-per-replica", type=int, default=2, help="ranks per replica group")
    p.add_argument("--replica-ids", default="all", help="the replica groups to run here: all, none, or 0,2,...")
    p.add_argument("--coordinator", help="HOST:PORT of a running coordinator (default: be the coordinator)")
    p.add_argument("--host", default="127.0.0.1", help="the address the coordinator listens on")
    p.add_argument("--port", type=int, default=0, help="the coordinator's port (default: a free one)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of each replica group (torchrun's)")
    p.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL on exit")
    p.add_argument("--run-dir", help="results and traces go here")
    p.add_argument("--compare-to", help="a fault-free run's --run-dir: compare the loss curves")
    p.add_argument("--loss-tolerance", type=float, default=0.05,
                   help="largest relative difference of a 5-step mean loss against --compare-to")
    p.add_argument("--script", default=str(ROOT / "launch" / "train.py"))
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the script's arguments")
    a = p.parse_args(argv)
    script_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    ids = _replica_ids(a.replica_ids, a.replicas)

    import torch.distributed as dist  # after parsing: --help stays fast

    from commslayer import config
    from commslayer.errors import StoreUnreachable
    from commslayer.store import bounded

    if a.coordinator:
        host, port = a.coordinator.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
        # A stopped coordinator answers nothing: give up on it after twice the ranks' store deadline, so that
        # a rank that talks to the store at least once a deadline (every step does) raises StoreUnreachable
        # itself, naming the call, before this launcher ends it.
        store = bounded(store, deadline_s=2 * config.store_timeout_s())
        address = a.coordinator
    else:
        store = dist.TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60), use_libuv=True)
        address = f"{a.host if a.host != '0.0.0.0' else '127.0.0.1'}:{store.port}"
        print(f"coordinator: job store at {a.host}:{store.port} for {a.replicas} replica group(s) of "
              f"{a.nproc_per_replica}", flush=True)

    # Peers dial this host's liveness listener at the address it reaches the coordinator from.
    advertise = os.environ.get("COMMSLAYER_LIVENESS_HOST") or _address_towards(address)
    become_subreaper()
    launcher = Launcher(a.grace)
    if a.run_dir:
        os.makedirs(a.run_dir, exist_ok=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    codes: Dict[int, int] = {}
    try:
        for r in ids:
            env = dict(os.environ, COMMSLAYER_JOB_STORE=address, COMMSLAYER_REPLICA=str(r),
                       COMMSLAYER_LIVENESS_HOST=advertise,
                       COMMSLAYER_REPLICAS=str(a.replicas), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            args = list(script_args)
            if a.run_dir:
                if "COMMSLAYER_TRACE_DIR" not in os.environ:  # set empty, it keeps tracing off
                    env["COMMSLAYER_TRACE_DIR"] = os.path.join(a.run_dir, "traces")
                env.setdefault("COMMSLAYER_FAULTS_LOG", os.path.join(a.run_dir, FAULT_LOG))
                args += ["--run-dir", a.run_dir]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(a.nproc_per_replica), "--max-restarts", str(a.max_restarts),
                   "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "--role", f"replica{r}", a.script, *args]
            launcher.start(r, cmd, env)
        watched = time.monotonic()
        while len(codes) < len(ids) or (not ids and not _all_ended(store, a.replicas)):
            if a.coordinator and time.monotonic() - watched > 0.5:
                watched = time.monotonic()
                store.check(["job/finished"])  # is the coordinator still there?
            for r, proc in launcher.procs.items():
                if r not in codes and proc.poll() is not None:
                    codes[r] = proc.returncode
                    store.set(f"replica/{r}/{'done' if proc.returncode == 0 else 'gone'}", str(proc.returncode))
                    print(f"coordinator: replica group {r} {'finished' if proc.returncode == 0 else 'gave up'} "
                          f"(torchrun exit {proc.returncode})", flush=True)
            time.sleep(0.1)
    except StoreUnreachable as exc:  # without the job's store no step can commit, and no group can rejoin
        print(f"launcher: the coordinator (the job's store at {address}) is unreachable ({exc.what}); ending the "
              "replica groups started here", flush=True)
        return 1
    except KeyboardInterrupt:
        print("launcher: interrupted; ending every process it started", flush=True)
        return 130
    finally:
        launcher.stop()
    ok = all(c == 0 for c in codes.values())
    if a.run_dir and not a.coordinator:  # the coordinator has seen every replica group end
        ok = summarize(a.run_dir, store, a.nproc_per_replica, a.compare_to, a.loss_tolerance) and ok
    return 0 if ok else 1


def _all_ended(store, replicas: int) -> bool:
    return all(store.check([f"replica/{r}/done"]) or store.check([f"replica/{r}/gone"]) for r in range(replicas))


def load_results(run_dir: str) -> List[dict]:
    """The result files of a run: one per process that reached the end (a rank killed
    on the way writes none; its restarted incarnation does)."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "result-m*-r*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def longest(results: List[dict]) -> dict:
    """The result of the rank that saw the most of the run (the earliest start)."""
    return min(results, key=lambda r: (r["start_step"], r["member"]))


def injections(run_dir: str, shards: int) -> List[dict]:
    """The faults injected in a run (from its fault log), each with its replica group."""
    from faults.inject import read_log

    return [dict(e, replica=e["member"] // shards) for e in read_log(os.path.join(run_dir, FAULT_LOG))
            if e["event"] == "injected"]


def summarize(run_dir: str, store, shards: int, compare_to: Optional[str], tolerance: float) -> bool:
    """Print what the run did and whether its invariants hold; False if one does not."""
    results = load_results(run_dir)
    if not results:
        print(f"summary: no results in {run_dir}", flush=True)
        return False
    ok = True
    steps = results[0]["steps"]
    lengths = {r["member"]: r["start_step"] + len(r["step_s"]) for r in results}
    print(f"summary: {len(results)} rank(s) finished, every one at step {steps}: "
          f"{all(n == steps for n in lengths.values())}", flush=True)
    ok &= all(n == steps for n in lengths.values())
    for shard in sorted({r["rank"] for r in results if r["fingerprints"] is not None}):
        prints = {r["replica"]: r["fingerprints"] for r in results if r["rank"] == shard}
        same = len({tuple(v) for v in prints.values()}) == 1 and len(set(next(iter(prints.values())))) == 1
        ok &= same
        print(f"summary: shard {shard}: parameters and optimizer state bitwise identical across replicas "
              f"{sorted(prints)}: {same}", flush=True)
    killed = injections(run_dir, shards)
    leader = longest(results)
    recoveries, admissions = _records(store, "job/recoveries"), _records(store, "job/admissions")
    for i, k in enumerate(killed):
        until = killed[i + 1]["t"] if i + 1 < len(killed) else float("inf")
        rec = next((x for x in recoveries if k["replica"] in x["lost_replicas"] and k["t"] <= x["detected_at"] < until),
                   None)
        k["stall_s"] = rec["committed_at"] - k["t"] if rec else None
        stall = f"{k['stall_s']:.3f}s" if rec else "n/a (no recovery recorded)"
        print(f"summary: fault: {k['what']} (replica group {k['replica']}); "
              f"survivor stall (fault to next committed step) {stall}", flush=True)
    for adm in admissions:
        print(f"summary: replica(s) {adm['replicas']} rejoined at step {adm['step']} (generation "
              f"{adm['generation']}); join and state transfer {adm['heal_s']:.3f}s", flush=True)
    losses = {int(s): v for s, v in leader["losses"].items()}
    if compare_to:
        ref_run = longest(load_results(compare_to))
        ok &= compare_losses(losses, {int(s): v for s, v in ref_run["losses"].items()},
                             min((k.get("step", steps) for k in killed), default=steps), tolerance, compare_to)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"ok": bool(ok), "killed": killed, "losses": losses, "recoveries": recoveries,
                   "admissions": admissions}, f, indent=1)
    return bool(ok)


def compare_losses(losses: Dict[int, float], ref: Dict[int, float], first_fault: int, tolerance: float,
                   ref_dir: str, window: int = 5) -> bool:
    """Steps before the first fault must have the reference's loss exactly (same seeds,
    same data); after it, the mean loss of every ``window`` consecutive steps must stay
    within ``tolerance`` (relative) of the reference's: while a replica group is
    missing a step averages fewer batches, so single steps differ more."""
    steps = sorted(ref)
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
          f"tolerance {tolerance:.0%}); final loss {losses[last]:.4f} vs {ref[last]:.4f} "
          f"({losses[last] / ref[last] - 1:+.2%}): {'within' if within else 'OUTSIDE'} tolerance", flush=True)
    return within


def _records(store, key: str) -> List[dict]:
    """The JSON lines the ranks appended to ``key`` of the job's store, in order."""
    if not store.check([key]):
        return []
    return [json.loads(line) for line in store.get(key).decode().splitlines() if line]


if __name__ == "__main__":
    sys.exit(main())
