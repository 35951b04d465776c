"""The status server's HTTP scrape at 1,000 ranks, from a synthetic job store.

A real TCPStore (the coordinator's kind) holds ``--ranks`` ranks' ``rank/<r>/life``
keys and status records as a traced rank writes them under a served job (the
flight recorder's per-op figures, one resizable communicator of every rank,
the step's collective arrivals), rewritten once a second with a fresh wall
clock by a process of its own, as live ranks write them; ``--stuck`` of them
carry an op record (``status/<unit>/op``) and a status record that is not
rewritten, as a rank stuck inside a collective leaves them.  Then the server is
started as ``commslayer-run --status-port`` starts it (``StatusServer`` on a
socket bound first, its thread reading the store once a second in this same
process), and one client GETs ``/metrics`` and ``/`` over loopback ``--gets``
times each, ``--pause`` seconds apart, while that thread keeps reading: each
GET's time from the request to the last byte of the answer, median, p90 and
max; and how long the server's reads of the store took meanwhile.

    python launch/bench/bench_status_scrape.py --ranks 1000 --gets 200

``--smoke``: 50 ranks, 2 stuck, 10 GETs of each path.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as dist  # noqa: E402

from commslayer.run import status  # noqa: E402
from commslayer.train.job import STATUS_SERVED, op_key  # noqa: E402

BUCKETS = [0, 200, 400, 300, 100, 50, 10, 5, 1, 0, 0, 0, 0, 0]
COMMS = ("c10d:0:cpu", "shards", "replicas", "replicate0")


def record(rank: int, ranks: int, now: float) -> Dict[str, Any]:
    """Rank ``rank``'s status record as a traced rank of a served per-rank job writes it."""
    ops = [[comm, op, 1066, 1066 * 4096, 0.9, BUCKETS, {}] for comm in COMMS for op in ("all_reduce",
                                                                                       "all_gather_single")]
    arrivals = [["uid-%d" % (rank // 8), 3, 9000 + i, now + 0.0001 * ((rank * 7 + i) % 13)] for i in range(16)]
    return {"unit": f"rank {rank}", "life": 0, "pid": 1000 + rank, "step": 512, "steps": 513, "step_s": 0.031,
            "generation": 1, "t": now, "comms": [["shards", 1, list(range(ranks))]], "healed": None, "ops": ops,
            "missed": 0, "arrivals": {"step": 512, "ops": arrivals},
            "op": {"op": "all_reduce", "comm": "shards", "seq": 9015, "name": "all_reduce #9015 of 'shards'",
                   "state": "completed", "in_flight": False, "since": now - 0.004, "t": now - 0.2, "pid": 1000 + rank}}


def feed(store: dist.Store, ranks: int, stuck: int) -> int:
    """Write every rank's keys; the first ``stuck`` ranks stuck in an all_reduce for 30 s. The
    bytes of one record."""
    now = time.time()
    for r in range(ranks):
        rec = record(r, ranks, now)
        if r < stuck:
            rec["t"] = now - 30
            rec["op"].update(since=now - 30.004, t=now - 30.2)
            store.set(op_key(f"rank{r}"), json.dumps({
                "op": "all_reduce", "comm": "shards", "seq": 9016, "name": "all_reduce #9016 of 'shards'",
                "state": "in flight", "in_flight": True, "since": now - 30, "t": now - 29, "pid": 1000 + r}))
        store.set(f"rank/{r}/life", "0")
        store.set(f"status/rank{r}", json.dumps(rec))
    store.set(STATUS_SERVED, "1")
    return len(json.dumps(record(0, ranks, now)))


def refresh(port: int, ranks: int, stuck: int) -> None:
    """Rewrite the live ranks' status records once a second, each with the time it is written
    (``--refresh-port``: a process of its own, as the ranks are)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
    while True:
        began = time.monotonic()
        for r in range(stuck, ranks):
            store.set(f"status/rank{r}", json.dumps(record(r, ranks, time.time())))
        time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))


def scrape(url: str, gets: int, pause: float) -> List[float]:
    """``gets`` GETs of ``url``: each one's seconds, request to the answer's last byte; and the body size."""
    times: List[float] = []
    size = 0
    for _ in range(gets):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as answer:
            size = len(answer.read())
        times.append(time.perf_counter() - t0)
        time.sleep(pause)
    times.append(size)
    return times


class Timed:
    """``fn`` with each call's seconds kept (the server's thread calls it)."""

    def __init__(self, fn: Any) -> None:
        self.seconds: List[float] = []
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - t0)


def ms(values: List[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--stuck", type=int, default=8, help="ranks stuck inside a collective (an op record each)")
    p.add_argument("--gets", type=int, default=200, help="GETs of each path")
    p.add_argument("--pause", type=float, default=0.05, help="seconds between two GETs")
    p.add_argument("--smoke", action="store_true", help="50 ranks, 2 stuck, 10 GETs of each path")
    p.add_argument("--refresh-port", type=int, help=argparse.SUPPRESS)  # the refreshing process
    a = p.parse_args()
    if a.smoke:
        a.ranks, a.stuck, a.gets = 50, 2, 10
    if a.refresh_port:
        refresh(a.refresh_port, a.ranks, a.stuck)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30),
                          use_libuv=True)
    nbytes = feed(store, a.ranks, a.stuck)
    refresher = subprocess.Popen([sys.executable, __file__, "--refresh-port", str(store.port), "--ranks",
                                  str(a.ranks), "--stuck", str(a.stuck)])
    reads, renders = Timed(status.read_view), Timed(status.Watcher._render)
    status.read_view = reads  # type: ignore[assignment]  # the watcher's calls, timed
    status.Watcher._render = lambda self: renders(self)  # type: ignore[method-assign]
    layout = status.Layout(name="synthetic", per_rank=True, world=a.ranks, group=8, nodes=0, max_restarts=3,
                           run_dir=None)
    server = status.StatusServer(socket.create_server(("127.0.0.1", 0)), layout)
    server.start(f"127.0.0.1:{store.port}")
    while server._watcher.view is None:
        time.sleep(0.05)
    print(f"{a.ranks} ranks, {a.stuck} stuck; a status record {nbytes} bytes; {a.gets} GETs of each path, "
          f"{a.pause} s apart, while the server's thread reads the store once a second", flush=True)
    print("| path | median (ms) | p90 (ms) | max (ms) | body (bytes) |\n|---|---:|---:|---:|---:|")
    for path in ("metrics", ""):
        times = scrape(server.address + path, a.gets, a.pause)
        size = int(times.pop())
        print(f"| `/{path}` | {statistics.median(times) * 1e3:.2f} | {ms(times, 0.9)} | {max(times) * 1e3:.2f} "
              f"| {size:,} |", flush=True)
    print(f"the server's reads of the store meanwhile: {len(reads.seconds)}, median "
          f"{statistics.median(reads.seconds) * 1e3:.0f} ms, max {max(reads.seconds) * 1e3:.0f} ms; its renderings "
          f"of the page and the metrics after each read: median {statistics.median(renders.seconds) * 1e3:.0f} ms, "
          f"max {max(renders.seconds) * 1e3:.0f} ms")
    view = server._watcher.view
    assert view is not None and sum(r.op is not None and r.op["in_flight"] for r in view.ranks) == a.stuck
    refresher.kill()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
