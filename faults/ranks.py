"""Run a function on N real processes that talk over real sockets, and survive their deaths.

The parent picks a port, forks the ranks (fork, not spawn: importing torch
again costs seconds per process on this machine), then hosts the TCPStore
itself, so the store outlives any rank as it does under our launcher.  Each
rank runs ``fn(rank, size, store, *args)`` and sends back its return value or
its exception.  Ranks that do not finish within ``timeout`` are SIGKILLed and
the run fails; no process outlives the call.  Unlike torchrun, a rank's death
leaves the others running; with ``respawn`` the parent starts a killed rank
again (``HARNESS_INCARNATION`` tells the new process which life it is in).
The test suite and the recovery benchmark (``launch/bench/bench_recovery.py``) run
their ranks here.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from commslayer.run.processes import free_port


class RankFailed(AssertionError):
    pass


class RankDied:
    """The result of a rank that died (``allow_errors``): its exit code (-9: SIGKILL)."""

    def __init__(self, exitcode: Optional[int]) -> None:
        self.exitcode = exitcode

    def __repr__(self) -> str:
        return f"RankDied({self.exitcode})"


def _child(fn, rank, size, port, args, conn, env) -> None:
    # What the parent left to the garbage collector stays uncollected here: a TCPStore server in it
    # (a test's, in a cycle) joins its server thread when freed, and a forked child has no such thread.
    gc.freeze()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for the stacks of a rank that hangs
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "LOCAL_RANK": str(rank)})
    try:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=30))
        outcome = ("ok", fn(rank, size, store, *args))
    except BaseException as exc:  # report everything, including SystemExit
        outcome = ("error", (exc, traceback.format_exc()))
    # What atexit would do (goodbye, before-exit hooks: a trace dump), before the parent, once told the
    # outcome, may SIGKILL this process: killed in the middle of a dump, it left a half-written file.
    if "commslayer.detect.liveness" in sys.modules:
        from commslayer.comm.exits import before_exit

        try:
            before_exit(0, "")
        except Exception:
            traceback.print_exc()
    try:
        conn.send(outcome)
    except Exception:  # it does not pickle
        conn.send(("error", (RuntimeError(repr(outcome[1])[:2000]), traceback.format_exc())))
    conn.close()
    os._exit(0)  # skip atexit: a broken Gloo group must not hang teardown


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 60.0,
              env: Optional[Dict[str, str]] = None, allow_errors: bool = False, respawn: int = 0,
              start: str = "fork") -> List[Any]:
    """Return each rank's result; raise ``RankFailed`` if a rank raised or died
    (unless ``allow_errors``: then its exception, or ``RankDied``, is the
    result) or did not finish.  Up to ``respawn`` times in all, a rank killed
    by SIGKILL is started again and its last life's result is the one kept.
    ``start="spawn"`` starts each rank as a fresh interpreter: ranks that use CUDA
    need it once the parent asked for the devices (torch then refuses CUDA in a fork)."""
    ctx: Any = mp.get_context(start)  # typeshed's BaseContext has no Process
    port = free_port()
    pipes: List[Any] = []
    procs: List[Any] = []
    lives = [0] * size
    old_procs: List[Any] = []

    def start_rank(rank: int) -> None:
        parent, child = ctx.Pipe(duplex=False)
        child_env = {**(env or {}), "HARNESS_INCARNATION": str(lives[rank])}
        p = ctx.Process(target=_child, args=(fn, rank, size, port, args, child, child_env), daemon=True)
        p.start()
        child.close()
        if rank < len(procs):
            old_procs.append(procs[rank])
            pipes[rank], procs[rank] = parent, p
        else:
            pipes.append(parent)
            procs.append(p)

    for rank in range(size):
        start_rank(rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    results: List[Any] = [None] * size
    missing = set(range(size))
    deadline = time.monotonic() + timeout
    try:
        while missing and time.monotonic() < deadline:
            for rank in sorted(missing):
                if pipes[rank].poll(0.05):
                    try:
                        results[rank] = pipes[rank].recv()
                    except EOFError:  # died without reporting
                        procs[rank].join(5)
                        results[rank] = ("died", procs[rank].exitcode)
                    missing.discard(rank)
                elif not procs[rank].is_alive() and not pipes[rank].poll(0):
                    results[rank] = ("died", procs[rank].exitcode)
                    missing.discard(rank)
                if results[rank] is not None and results[rank][0] == "died" and results[rank][1] == -signal.SIGKILL \
                        and respawn > 0:
                    respawn -= 1
                    lives[rank] += 1
                    results[rank] = None
                    missing.add(rank)
                    start_rank(rank)
    finally:
        if missing:  # every thread's stack of the ranks that hang, on stderr, before they are killed
            for rank in sorted(missing):
                if procs[rank].is_alive():
                    os.kill(procs[rank].pid, signal.SIGUSR1)
                    time.sleep(0.5)  # one rank's stacks at a time
        for p in procs + old_procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
        del store
    if missing:
        raise RankFailed(f"ranks {sorted(missing)} did not finish within {timeout}s")
    out, failed = [], []
    for rank, (kind, value) in enumerate(results):
        if kind == "ok":
            out.append(value)
        elif kind == "died" and not allow_errors:
            failed.append(f"rank {rank} died with exit code {value}")
        elif kind == "died":
            out.append(RankDied(value))
        elif allow_errors:
            out.append(value[0])
        else:
            failed.append(f"rank {rank} raised:\n{value[1]}")
    if failed:  # every rank's failure: the first one in rank order is often only the echo of another's
        raise RankFailed("\n".join(failed))
    return out
