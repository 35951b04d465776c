"""The tests' helpers: ranks on real processes (``faults.ranks``), a free port, and calls
on real threads (``on_threads``)."""

import threading
import time
from typing import Any, Callable, List

from commslayer.processes import free_port
from faults.ranks import RankDied, run_ranks

__all__ = ["RankDied", "free_port", "on_threads", "run_ranks"]


def on_threads(*calls: Callable[[], Any], stagger_s: float = 0.0) -> List[Any]:
    """Run each call on a thread of its own and return each one's result or exception.
    With no ``stagger_s`` the threads are released at the same instant (a barrier);
    otherwise they start ``stagger_s`` apart."""
    start = threading.Barrier(len(calls)) if not stagger_s else None
    results: List[Any] = [None] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        if start is not None:
            start.wait()
        try:
            results[i] = call()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a call did not return within 10 s"
    return results
