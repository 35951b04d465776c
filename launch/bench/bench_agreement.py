"""What one membership decision costs the store: requests per member and the
time to agree, at several sizes, on a real TCPStore.

Each member is a thread with its own TCPStore connection, wrapped as
commslayer wraps a job's store (``commslayer.agree.store.bounded``), counting the
requests that reach the server.  One member is lost; the survivors notice it
at moments spread over ``--spread`` seconds (liveness spreads a loss in that
time at scale) and call ``Membership.agree_after_loss``.  Reported, over
``--repeats`` decisions per size and for each way of waiting for the decision
(``--waits``: blocking on the server, as a job does, or polling): store
requests per survivor (median, max), requests in all, and the time from the
first survivor's call to the last one's return (median, min-max).

    python launch/bench/bench_agreement.py --sizes 4 16 64 --repeats 5

``--calibrate`` instead measures the server's time per request, which
``launch/bench/simulate_agreement.py`` models: 1, 2 and 4 client processes each
making ``get`` requests of an 8-byte and a 64 KiB value as fast as they can;
with 4 the server is saturated, and requests in all over the slowest client's
time is its cost per request (an upper bound: here the clients share the
server's 2 cores).

``--smoke`` runs 4 and 8 members once, each way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from commslayer.agree.membership import Membership  # noqa: E402
from commslayer.agree.store import bounded  # noqa: E402


class CountingStore(dist.Store):
    """A store that counts the requests it passes on (clones share the count)."""

    def __init__(self, inner: dist.Store, counter: List[int]) -> None:
        super().__init__()
        self._inner, self.counter = inner, counter
        self.set_timeout(inner.timeout)

    def _count(self) -> None:
        self.counter[0] += 1

    def set(self, key, value):
        self._count()
        return self._inner.set(key, value)

    def get(self, key):
        self._count()
        return self._inner.get(key)

    def check(self, keys):
        self._count()
        return self._inner.check(keys)

    def add(self, key, value):
        self._count()
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._count()
        return self._inner.compare_set(key, expected, desired)

    def append(self, key, value):
        self._count()
        return self._inner.append(key, value)

    def multi_get(self, keys):
        self._count()
        return self._inner.multi_get(keys)

    def wait(self, keys, timeout=None):
        self._count()
        return self._inner.wait(keys, timeout) if timeout is not None else self._inner.wait(keys)

    def delete_key(self, key):
        self._count()
        return self._inner.delete_key(key)

    def clone(self):
        return CountingStore(self._inner.clone(), self.counter)


def decision(port: int, size: int, generation: int, spread_s: float, rng: random.Random,
             blocking: bool) -> Dict[str, Any]:
    lost = size - 1
    members = list(range(size))
    counters = [[0] for _ in range(size - 1)]
    stores = [bounded(CountingStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                                  timeout=timedelta(seconds=60)), counters[m]))
              for m in range(size - 1)]
    memberships = [Membership(store, "bench", blocking_waits=blocking) for store in stores]
    for m in memberships:  # in a job the connection opened long before any loss
        waits = m.waits
        assert waits is None or waits.opened(10.0), "a connection for waits did not open"
    results: List[Any] = [None] * (size - 1)
    starts = sorted(rng.uniform(0, spread_s) for _ in range(size - 1))
    order = list(range(size - 1))
    rng.shuffle(order)
    t0 = time.monotonic()
    ends = [0.0] * (size - 1)

    def member(m: int, delay: float) -> None:
        time.sleep(delay)
        results[m] = memberships[m].agree_after_loss(
            generation, members, m, lambda: {lost}, join_window_s=3.0, timeout_s=60.0)
        ends[m] = time.monotonic()

    threads = [threading.Thread(target=member, args=(m, starts[i])) for i, m in enumerate(order)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == members[:-1] for r in results), results
    requests = [c[0] for c in counters]
    return {"requests": requests, "agree_s": max(ends) - t0 - starts[0]}


def _hammer(port: int, key: str, n: int, took: Any) -> None:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    start = time.perf_counter()
    for _ in range(n):
        client.get(key)
    took.put(time.perf_counter() - start)


def calibrate() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    values = {"8 B": "x" * 8, "64 KiB": "x" * 65536}
    for name, value in values.items():
        server.set(name, value)
    ctx = mp.get_context("fork")
    print("| value | clients | requests/s in all | µs per request in all | one client's round trip µs |")
    print("|---|---:|---:|---:|---:|")
    for name in values:
        for clients in (1, 2, 4):
            n = 4000 if name == "8 B" else 1000
            took = ctx.Queue()
            procs = [ctx.Process(target=_hammer, args=(server.port, name, n, took)) for _ in range(clients)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            times = [took.get() for _ in procs]
            print(f"| {name} | {clients} | {clients * n / max(times):.0f} | {max(times) / (clients * n) * 1e6:.1f} "
                  f"| {min(times) / n * 1e6:.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--spread", type=float, default=0.05, help="seconds over which survivors notice the loss")
    p.add_argument("--waits", nargs="+", choices=["blocking", "polling"], default=["blocking", "polling"])
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.calibrate:
        calibrate()
        return
    if args.smoke:
        args.sizes, args.repeats = [4, 8], 1
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    rng = random.Random(1)
    print("| members | waits | requests per survivor: median (max) | requests per decision "
          "| agree s: median (min–max) |")
    print("|---:|---|---|---:|---|")
    generation = 0
    for size in args.sizes:
        for waits in args.waits:
            per, total, times = [], [], []
            for _ in range(args.repeats):
                generation += 1
                d = decision(server.port, size, generation, args.spread, rng, waits == "blocking")
                per += d["requests"]
                total.append(sum(d["requests"]))
                times.append(d["agree_s"])
            print(f"| {size} | {waits} | {statistics.median(per):g} ({max(per)}) | {statistics.median(total):g} "
                  f"| {statistics.median(times):.3f} ({min(times):.3f}–{max(times):.3f}) |", flush=True)


if __name__ == "__main__":
    main()
