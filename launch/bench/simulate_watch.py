"""The watch protocol at sizes no machine here holds: detection time, load per
member and false positives, measured on the simulator (``commslayer.detect.watchsim``,
which runs ``commslayer.detect.watch`` itself, one instance per member).

For each size and each message jitter, ``--trials`` simulations with
different seeds; in each, after ``--warmup`` seconds one member is SIGKILLed
and another SIGSTOPped at the same moment, and the run goes on until the stop
is past the peer timeout by 1 s.  Reported:

- detection: seconds from the fault until a member declared it, over every
  live member of every trial (median, p99, max), and members that never did;
- load: frames each member sent per second over the whole run (heartbeats,
  and everything else: reports, refutations, forwarding), median and max;
- false positives: declarations of a member that was neither dead nor stopped;
- the cost of the simulation itself (events are the protocol's own work).

``--false-positive-hours H`` instead runs the fault-free protocol for ``H``
simulated member-hours at each jitter and counts declarations.

The full mesh (every member watches every other) is simulated at the sizes
where it fits (``--mesh-sizes``); at larger sizes its load is the formula
``(N - 1) / heartbeat_s`` frames a second, which the simulated sizes check.

    python launch/bench/simulate_watch.py --sizes 1000 10000 --jitter 0 0.05 --trials 3
    python launch/bench/simulate_watch.py --false-positive-hours 5000 --sizes 1000 --jitter 0.05 --seed 1

``--smoke`` runs 200 members for one trial in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from commslayer.detect.watchsim import Simulation, quantile  # noqa: E402


def trial(size: int, k: int, mesh_max: int, jitter_s: float, seed: int, warmup_s: float,
          peer_timeout_s: float, heartbeat_s: float) -> Dict[str, Any]:
    started = time.perf_counter()
    sim = Simulation(size, k=k, mesh_max=mesh_max, jitter_s=jitter_s, seed=seed, peer_timeout_s=peer_timeout_s,
                     heartbeat_s=heartbeat_s)
    victims = sim.rng.sample(range(size), 2)
    sim.kill(victims[0], at=warmup_s)
    sim.stop(victims[1], at=warmup_s)
    end = warmup_s + peer_timeout_s + 1.0
    sim.run(end)
    kill, stop = sim.detections()
    return {"kill": kill.delays, "kill_missing": kill.missing, "stop": stop.delays, "stop_missing": stop.missing,
            "frames": [w.sent / end for w in sim.members], "beats": [b / end for b in sim.beats],
            "false_positives": len(sim.false_positives()), "wall_s": time.perf_counter() - started,
            "full_mesh": sim.topology.full_mesh}


def summarize(size: int, jitter_s: float, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    def pooled(key: str) -> List[float]:
        return [x for r in runs for x in r[key]]

    kill, stop, frames, beats = pooled("kill"), pooled("stop"), pooled("frames"), pooled("beats")
    return {"size": size, "jitter_ms": jitter_s * 1000, "trials": len(runs), "full_mesh": runs[0]["full_mesh"],
            "kill_median_s": statistics.median(kill), "kill_p99_s": quantile(kill, 0.99), "kill_max_s": max(kill),
            "stop_median_s": statistics.median(stop), "stop_p99_s": quantile(stop, 0.99), "stop_max_s": max(stop),
            "missing": sum(r["kill_missing"] + r["stop_missing"] for r in runs),
            "frames_median": statistics.median(frames), "frames_max": max(frames),
            "beats_median": statistics.median(beats), "beats_max": max(beats),
            "false_positives": sum(r["false_positives"] for r in runs),
            "wall_s_median": statistics.median(r["wall_s"] for r in runs)}


def false_positive_run(size: int, k: int, mesh_max: int, jitter_s: float, hours: float, seed: int,
                       peer_timeout_s: float, heartbeat_s: float) -> Dict[str, Any]:
    started = time.perf_counter()
    sim = Simulation(size, k=k, mesh_max=mesh_max, jitter_s=jitter_s, seed=seed, peer_timeout_s=peer_timeout_s,
                     heartbeat_s=heartbeat_s)
    seconds = hours * 3600 / size
    step = 60.0
    t = 0.0
    while t < seconds:
        t = min(seconds, t + step)
        sim.run(t)
    return {"size": size, "jitter_ms": jitter_s * 1000, "member_hours": hours, "simulated_s": seconds,
            "declarations": sum(len(by) for by in sim.declared.values()),
            "wall_s": time.perf_counter() - started}


def _ms(row: Dict[str, Any], what: str) -> str:
    return " / ".join(f"{row[f'{what}_{q}_s'] * 1000:.1f}" for q in ("median", "p99", "max"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--mesh-sizes", type=int, nargs="*", default=[16, 64, 256],
                   help="sizes at which the full mesh is simulated too")
    p.add_argument("--jitter", type=float, nargs="+", default=[0.0, 0.05], help="message jitter, seconds")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--k", type=int, default=3, help="peers each member watches")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--heartbeat", type=float, default=0.25)
    p.add_argument("--false-positive-hours", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1, help="of the false-positive run")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.mesh_sizes, args.jitter, args.trials = [200], [16], [0.05], 1
    rows: List[Dict[str, Any]] = []
    if args.false_positive_hours:
        for size in args.sizes:
            for jitter in args.jitter:
                row = false_positive_run(size, args.k, 16, jitter, args.false_positive_hours, args.seed,
                                         args.peer_timeout, args.heartbeat)
                print(json.dumps(row), flush=True)
                rows.append(row)
    else:
        configs = [(n, 16) for n in args.sizes] + [(n, n) for n in args.mesh_sizes]
        print("| members | topology | jitter ms | kill median / p99 / max ms | stop median / p99 / max ms | missed "
              "| frames/member/s median (max) | heartbeats/member/s | false positives | sim wall s |")
        print("|---:|---|---:|---|---|---:|---|---|---:|---:|")
        for size, mesh_max in configs:
            for jitter in args.jitter:
                runs = [trial(size, args.k, mesh_max, jitter, seed, args.warmup, args.peer_timeout, args.heartbeat)
                        for seed in range(1, args.trials + 1)]
                row = summarize(size, jitter, runs)
                rows.append(row)
                topology = "full mesh" if row["full_mesh"] else f"k={args.k}"
                print(f"| {size} | {topology} | {row['jitter_ms']:g} "
                      f"| {_ms(row, 'kill')} | {_ms(row, 'stop')} "
                      f"| {row['missing']} | {row['frames_median']:.1f} ({row['frames_max']:.1f}) "
                      f"| {row['beats_median']:.1f} ({row['beats_max']:.1f}) | {row['false_positives']} "
                      f"| {row['wall_s_median']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
