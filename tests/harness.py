"""The tests' helpers: ranks on real processes (``faults.ranks``), a free port, calls
on real threads (``on_threads``), and a failed job's output cut to its story (``job_story``)."""

import re
import threading
import time
from typing import Any, Callable, List

from commslayer.run.processes import free_port
from faults.ranks import RankDied, run_ranks

__all__ = ["RankDied", "free_port", "job_story", "on_threads", "run_ranks"]


def group_kind(pg: Any) -> str:
    """``"commslayer"`` for a group of commslayer's, else the group's type name."""
    from commslayer.c10d import group_of

    return "commslayer" if group_of(pg) is not None else type(pg).__name__


def on_threads(*calls: Callable[[], Any], stagger_s: float = 0.0, timeout_s: float = 10.0) -> List[Any]:
    """Run each call on a thread of its own and return each one's result or exception,
    all within ``timeout_s``. With no ``stagger_s`` the threads are released at the
    same instant (a barrier); otherwise they start ``stagger_s`` apart."""
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
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a call did not return within {timeout_s:g} s"
    return results


_STORY = re.compile(r"lost|leaving|recovered|restarted|admitted|healed|gave up|timed out|Error|error:|done:"
                    r"|terminate called|what\(\):")  # the last two: a C++ abort (Gloo's)
_BOILERPLATE = re.compile(r"elastic|error_file|traceback :|File \"|^\s*\S*\s*raise |ChildFailedError")


def job_story(log: str, lines: int = 80, tail: int = 1500) -> str:
    """What a failed job printed, short enough to survive a CI log's cuts: its lines
    that tell what happened (losses, exits, recoveries, restarts, admissions,
    errors; not torchrun's boilerplate), then its last ``tail`` characters."""
    told = [line for line in log.splitlines() if _STORY.search(line) and not _BOILERPLATE.search(line)]
    return "\n".join(["--- the story ---", *told[:lines], "--- the end of the output ---", log[-tail:]])
