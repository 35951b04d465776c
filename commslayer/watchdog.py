"""The watchdog: one daemon thread per process that settles async ops.

A caller that waits enforces its op's deadline itself.  An async op that
nobody waits on is the watchdog's: it wakes at the earliest deadline it holds
(or every ``SWEEP_S`` to drop finished ops), turns an overdue op into
``CollectiveTimeout`` and so marks its communicator broken, whether or not
anyone is looking.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import List, Optional

from .work import Work

SWEEP_S = 0.25


class Watchdog:
    def __init__(self) -> None:
        self._works: List[Work] = []
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._to_wait: "queue.SimpleQueue[Work]" = queue.SimpleQueue()
        self._waiter: Optional[threading.Thread] = None

    def wait_in_background(self, work: Work) -> None:
        """Settle ``work`` as soon as it ends, from a thread that waits on it.

        For backend works that have no completion callback (Gloo's
        reduce-scatter), when observers need exact end times: ops are waited
        in issue order, which is the order they complete in on one group.
        """
        self._to_wait.put(work)
        if self._waiter is None:
            with self._cond:
                if self._waiter is None:
                    self._waiter = threading.Thread(target=self._wait_loop, name="commslayer-waiter", daemon=True)
                    self._waiter.start()

    def _wait_loop(self) -> None:
        while True:
            work = self._to_wait.get()
            if not work.is_completed():
                work.poll_until_deadline()

    def track(self, work: Work) -> None:
        with self._cond:
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commslayer-watchdog", daemon=True)
                self._thread.start()
            elif work.deadline_ns < time.monotonic_ns() + SWEEP_S * 1e9:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._works:
                    first = min(w.deadline_ns for w in self._works)
                    delay = min(SWEEP_S, max(0.0, (first - time.monotonic_ns()) / 1e9))
                else:
                    delay = SWEEP_S
                self._cond.wait(delay)
                works = self._works
            now = time.monotonic_ns()
            settled = [w for w in works if w.poll(now)]
            if settled:
                with self._cond:
                    done = set(map(id, settled))
                    self._works = [w for w in self._works if id(w) not in done]


WATCHDOG = Watchdog()
