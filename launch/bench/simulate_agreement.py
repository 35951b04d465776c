"""The shrink agreement at sizes no machine here holds: decision time and store
requests per decision, measured on the simulator (``commslayer.detect.watchsim`` with
a ``StoreModel``), which runs the watch protocol and ``commslayer.agree.agreement``
themselves, one instance per member, against one simulated store server.

For each size, fault (one member SIGKILLed or SIGSTOPped after ``--warmup``
seconds) and way of waiting (a blocking wait on the server, as a job does on
a TCPStore; or polling, as it does on a store that cannot block), ``--trials``
simulations with different seeds.  Each survivor starts the agreement when it
declares the loss.  Reported: when the decision was written and when the last
survivor had it (seconds after the fault), the agreement's own share (the
last survivor's return less the last detection), store requests per survivor
(median, max) and per decision, and the server's busy time.

The server's cost per request (``--service-us``, ``--per-byte-ns``) defaults
to what ``launch/bench/bench_agreement.py --calibrate`` measured on a TCPStore here:
the time per request with 4 clients saturating it, on 2 cores shared by the
server and the clients, so an upper bound on what a store host pays.

    python launch/bench/simulate_agreement.py --sizes 64 1000 10000 --trials 3

``--smoke`` runs 200 members for one trial of each kind in seconds.
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

from commslayer.detect.watchsim import Simulation, StoreModel  # noqa: E402


def trial(size: int, fault: str, blocking: bool, seed: int, args: argparse.Namespace) -> Dict[str, Any]:
    started = time.perf_counter()
    store = StoreModel(service_s=args.service_us * 1e-6, per_byte_s=args.per_byte_ns * 1e-9,
                       rtt_s=args.rtt_us * 1e-6, blocking_waits=blocking)
    sim = Simulation(size, seed=seed, jitter_s=args.jitter, peer_timeout_s=args.peer_timeout, store=store)
    victim = sim.rng.randrange(size)
    getattr(sim, fault)(victim, at=args.warmup)
    sim.run(args.warmup + 3 * args.peer_timeout)
    a = sim.agreement
    survivors = [m for m in range(size) if m != victim]
    assert a.decision == survivors and not a.failed, (a.decision, a.failed)
    assert sorted(a.returned) == survivors, "a survivor never had the decision"
    detected = sim.declared[victim]
    per = [a.requests[m] for m in survivors]
    return {"decided_s": a.decided_at - args.warmup, "last_s": max(a.returned.values()) - args.warmup,
            "own_s": max(a.returned.values()) - max(detected[m] for m in survivors),
            "per_survivor": per, "total": sum(per), "proposer": max(per), "busy_s": a.server_busy_s,
            "wall_s": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 1000, 10000])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--jitter", type=float, default=0.05, help="message jitter, seconds")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--service-us", type=float, default=29.1, help="server time per request")
    p.add_argument("--per-byte-ns", type=float, default=0.37, help="server time per byte of value moved")
    p.add_argument("--rtt-us", type=float, default=200.0, help="network round trip of a request")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.trials = [200], 1
    print("| members | fault | waits | decision written s | last survivor has it s: median (max) "
          "| agreement's own s | requests per survivor: median (max) | requests per decision | server busy s "
          "| sim wall s |")
    print("|---:|---|---|---:|---|---:|---|---:|---:|---:|")
    rows: List[Dict[str, Any]] = []
    for size in args.sizes:
        for fault in ("kill", "stop"):
            for blocking in (True, False):
                runs = [trial(size, fault, blocking, seed, args) for seed in range(1, args.trials + 1)]
                per = [x for r in runs for x in r["per_survivor"]]
                row = {"size": size, "fault": fault, "waits": "blocking" if blocking else "polling",
                       "trials": len(runs),
                       **{k: statistics.median(r[k] for r in runs)
                          for k in ("decided_s", "last_s", "own_s", "total", "busy_s", "wall_s")},
                       "last_max_s": max(r["last_s"] for r in runs),
                       "per_survivor_median": statistics.median(per), "per_survivor_max": max(per)}
                rows.append(row)
                print(f"| {size} | {fault} | {row['waits']} | {row['decided_s']:.3f} "
                      f"| {row['last_s']:.3f} ({row['last_max_s']:.3f}) | {row['own_s']:.3f} "
                      f"| {row['per_survivor_median']:g} ({row['per_survivor_max']}) | {row['total']:g} "
                      f"| {row['busy_s']:.3f} | {row['wall_s']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
