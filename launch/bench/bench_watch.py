"""The watch protocol on real processes, next to the simulator at the same size.

``--ranks`` processes (``faults.ranks.run_ranks``: forked, one TCPStore in the
parent) each make a commslayer communicator and then stay idle (no ops: only
liveness runs).  After ``--warmup`` seconds one rank SIGKILLs itself and
another SIGSTOPs itself at the same moment.  Each survivor records when its
monitor declared each of them (the monitor's "lost" log record, wall clock),
and how many frames its monitor sent.  Then the simulator
(``commslayer.detect.watchsim``) runs the same size, topology and timing with
loopback-like delays, and both are printed side by side:

- detection after the kill and after the stop: median and max over survivors
  and repeats;
- frames each member sent per second (heartbeats included): median and max.

    python launch/bench/bench_watch.py --ranks 16 --repeats 3
    python launch/bench/bench_watch.py --ranks 16 --repeats 3 --full-mesh-max 16

``--full-mesh-max`` below ``--ranks`` (default 4) makes it the watch topology
(``--k`` peers); at ``--ranks`` or above, the full mesh.  ``--smoke`` runs 8
ranks once with a 1 s peer timeout.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import statistics
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from commslayer.detect.watchsim import Simulation  # noqa: E402
from faults.ranks import run_ranks  # noqa: E402

_LOST = re.compile(r"lost (.*)")


def _member(rank: int, size: int, store: Any, warmup_s: float, peer_timeout_s: float) -> Dict[str, Any]:
    import commslayer

    declared: Dict[int, float] = {}

    class Declarations(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = _LOST.search(record.getMessage())
            if found:
                for r in re.findall(r"rank (\d+):", found.group(1)):
                    declared.setdefault(int(r), record.created)

    logging.getLogger("commslayer").addHandler(Declarations(level=logging.WARNING))
    killed, stopped = size - 1, size // 2
    comm = commslayer.new_comm("gloo", name="watch", store=store, rank=rank, size=size, timeout=60)
    comm.barrier()
    if rank == 0:
        store.set("fault_at", repr(time.time() + warmup_s))
    fault_at = float(store.get("fault_at"))
    monitor = comm.lifecycle.monitor
    assert monitor is not None
    if rank in (killed, stopped):
        store.set(f"pid/{rank}", str(os.getpid()))
        time.sleep(max(0.0, fault_at - time.time()))
        store.set(f"at/{rank}", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if rank == killed else signal.SIGSTOP)
    started, frames_before = time.time(), monitor.frames_sent
    time.sleep(max(0.0, fault_at - time.time()) + peer_timeout_s + 2.0)
    rate = (monitor.frames_sent - frames_before) / (time.time() - started)
    at = {r: float(store.get(f"at/{r}")) for r in (killed, stopped)}
    if rank == 0:
        os.kill(int(store.get(f"pid/{stopped}")), signal.SIGKILL)
    out = {"kill": declared.get(killed, float("inf")) - at[killed],
           "stop": declared.get(stopped, float("inf")) - at[stopped], "frames_per_s": rate,
           "full_mesh": monitor.topology.full_mesh, "others": sorted(set(declared) - {killed, stopped})}
    comm.finalize()
    return out


def real(ranks: int, repeats: int, env: Dict[str, str], warmup_s: float, peer_timeout_s: float) -> Dict[str, Any]:
    kill: List[float] = []
    stop: List[float] = []
    frames: List[float] = []
    others: List[int] = []
    mesh = None
    for _ in range(repeats):
        results = run_ranks(_member, ranks, warmup_s, peer_timeout_s, timeout=120 + 2 * ranks, env=env,
                            allow_errors=True)
        for r in results:
            if isinstance(r, dict):
                kill.append(r["kill"])
                stop.append(r["stop"])
                frames.append(r["frames_per_s"])
                others += r["others"]
                mesh = r["full_mesh"]
    return {"kill": kill, "stop": stop, "frames": frames, "others": others, "full_mesh": mesh}


def simulated(ranks: int, repeats: int, k: int, mesh_max: int, warmup_s: float, peer_timeout_s: float,
              heartbeat_s: float) -> Dict[str, Any]:
    kill: List[float] = []
    stop: List[float] = []
    frames: List[float] = []
    for seed in range(1, repeats + 1):
        sim = Simulation(ranks, k=k, mesh_max=mesh_max, peer_timeout_s=peer_timeout_s, heartbeat_s=heartbeat_s,
                         delay_s=0.0002, jitter_s=0.0005, seed=seed)
        sim.run(warmup_s)
        sent = [w.sent for w in sim.members]
        sim.kill(ranks - 1, at=warmup_s)
        sim.stop(ranks // 2, at=warmup_s)
        end = warmup_s + peer_timeout_s + 2.0
        sim.run(end)
        d_kill, d_stop = sim.detections()
        kill += d_kill.delays
        stop += d_stop.delays
        frames += [(w.sent - s) / (end - warmup_s) for w, s in zip(sim.members, sent)
                   if w.me not in (ranks - 1, ranks // 2)]
    return {"kill": kill, "stop": stop, "frames": frames, "others": [], "full_mesh": sim.topology.full_mesh}


def _cells(values: List[float], scale: float, digits: int) -> str:
    return f"{statistics.median(values) * scale:.{digits}f} / {max(values) * scale:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--full-mesh-max", type=int, default=4)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--heartbeat", type=float, default=0.25)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.ranks, args.repeats, args.peer_timeout, args.heartbeat, args.warmup = 8, 1, 1.0, 0.1, 1.0
    env = {"COMMSLAYER_FULL_MESH_MAX": str(args.full_mesh_max), "COMMSLAYER_WATCH_PEERS": str(args.k),
           "COMMSLAYER_PEER_TIMEOUT_S": str(args.peer_timeout), "COMMSLAYER_HEARTBEAT_S": str(args.heartbeat)}
    rows = [("real processes", real(args.ranks, args.repeats, env, args.warmup, args.peer_timeout)),
            ("simulator", simulated(args.ranks, args.repeats, args.k, args.full_mesh_max, args.warmup,
                                    args.peer_timeout, args.heartbeat))]
    print("| run | members | topology | kill → declared, median / max ms | stop → declared, median / max s "
          "| frames/member/s, median / max | survivors' declarations of healthy ranks |")
    print("|---|---:|---|---|---|---|---:|")
    for name, r in rows:
        topology = "full mesh" if r["full_mesh"] else f"k={args.k}"
        print(f"| {name} | {args.ranks} | {topology} | {_cells(r['kill'], 1000, 1)} | {_cells(r['stop'], 1, 3)} "
              f"| {_cells(r['frames'], 1, 1)} | {len(r['others'])} |", flush=True)


if __name__ == "__main__":
    main()
