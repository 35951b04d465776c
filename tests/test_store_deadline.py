"""Every store call commslayer makes has a deadline (issue 16, item 1; the store half of item 10).

A TCPStore client blocks for ever on a server that is stopped or cut off
without a reset.  Here the store runs in a process of its own that the test
SIGSTOPs, as a job's coordinator would be stopped (never in the test process:
a server destroyed by garbage collection inside a forked rank would wait for
its thread, which the fork did not copy); the ranks are real
processes on a real Gloo communicator.  Each call must end with
``StoreUnreachable`` naming the store's address and the call within the
deadline (plus slack), and every later call at once.  A store that closed the
connection is ``StoreUnreachable`` too, never ``PeerLost``.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Tuple

import pytest
import torch.distributed as dist

import commslayer
from commslayer.agree.store import bounded
from faults.wake import state
from tests.harness import run_ranks

DEADLINE_S = 2.0
BOUND_S = DEADLINE_S + 3.0  # generous: the call must end, and fast; not a benchmark
FAST_S = 0.5  # a call on a connection already known to be broken
ENV = {"COMMSLAYER_STORE_TIMEOUT_S": str(DEADLINE_S)}
_SERVER = ("import sys, torch.distributed as dist\n"
           "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=True)\n"
           "print(s.port, flush=True)\n"
           "sys.stdin.read()\n")  # until the test closes the pipe (or dies)


@contextmanager
def store_server() -> Iterator[Tuple[int, int]]:
    """A TCPStore server in a child process: (port, pid). Killed at the end, stopped or not."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline()), proc.pid
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: the signal is only
    queued when ``kill`` returns, and a server thread running on the other core could
    still answer a request sent right after."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while any(state(int(t)) != "T" for t in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def _client(port: int, timeout_s: float = 60) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


def _call_with_store_stopped(rank, size, _harness_store, port, server, op):
    """Build a communicator on the stoppable store, stop the store, then ``op``:
    (seconds until it raised, its message, seconds a later new_comm took to raise,
    whether a step's commit vote went through meanwhile)."""
    store = _client(port)
    comm = commslayer.new_comm("gloo", name="w", store=store, rank=rank, size=size, timeout=60)
    assert comm.should_commit()
    comm.barrier()
    if rank == 0:
        stop(server)
    comm.barrier()  # Gloo does not use the store: everyone knows it is stopped now
    committed = comm.should_commit()  # every member voted yes: tallied over Gloo, no store request
    start = time.monotonic()
    try:
        if op == "pending_members":
            comm.pending_members()
        elif op == "shrink":
            comm.shrink()
        else:
            commslayer.new_comm("gloo", name="w2", store=store, rank=rank, size=size, timeout=60)
    except commslayer.StoreUnreachable as exc:
        took, message = time.monotonic() - start, str(exc)
    else:
        raise AssertionError(f"{op} returned with the store stopped")
    if op == "pending_members" and rank != 0:  # it learnt the leader's failure; its own connection is fine
        return took, message, 0.0, committed
    start = time.monotonic()
    with pytest.raises(commslayer.StoreUnreachable, match="not used any more"):
        commslayer.new_comm("gloo", name="later", store=store, rank=rank, size=size, timeout=60)
    return took, message, time.monotonic() - start, committed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op,calls", [
    # rank 0 reads the joiners and gets no answer; it tells rank 1 over Gloo
    ("pending_members", ("store.get('commslayer/w/0//membership//wanted')",
                         "read of the joiners [communicator 'w'; op pending_members")),
    # a shrink first writes down the round this member committed on the tally alone
    ("shrink", ("store.compare_set('commslayer/w/0//membership//g0/commit/2/outcome')",) * 2),
    ("new_comm", ("commslayer/w2/",) * 2),
])
def test_a_stopped_store_ends_the_call_with_store_unreachable(op, calls):
    with store_server() as (port, pid):
        results = run_ranks(_call_with_store_stopped, 2, port, pid, op, env=ENV, timeout=45)
    for (took, message, later, committed), call in zip(results, calls):
        assert took < BOUND_S, results
        assert f"127.0.0.1:{port}" in message and "[communicator 'w" in message and call in message, message
        assert later < FAST_S, results
        assert committed, results


def test_a_store_that_drops_the_connection_is_store_unreachable_not_peer_lost():
    """torch's server drops a client that sends a key over 8192 bytes (a 20,000-character
    communicator name did it): later calls in the process are the store's failure."""
    with store_server() as (port, _):
        client = _client(port, 10)
        client.set("k" * 20000, "v")  # answered by closing the connection
        with pytest.raises(commslayer.StoreUnreachable) as raised:
            commslayer.new_comm("gloo", name="later", store=client, rank=0, size=1)
    assert f"store at 127.0.0.1:{port} closed the connection" in str(raised.value)


def test_an_oversized_key_through_the_wrapper_is_store_unreachable():
    with store_server() as (port, _):
        store = bounded(_client(port, 10), "pre/", comm="c")
        store.set("k" * 20000, "v")
        with pytest.raises(commslayer.StoreUnreachable, match=r"closed the connection .*store\.check\(\['pre//x'\]\)"):
            store.check(["x"])
        with pytest.raises(commslayer.StoreUnreachable, match=r"not used any more: it closed the connection during "
                                                              r"store\.check.*op store\.get\('pre//x'\)"):
            store.get("x")


def test_a_call_to_a_stopped_store_ends_at_the_deadline_and_later_ones_at_once():
    with store_server() as (port, pid):
        store = bounded(_client(port), deadline_s=1.0)
        store.set("a", "1")
        stop(pid)
        start = time.monotonic()
        with pytest.raises(commslayer.StoreUnreachable, match=rf"127\.0\.0\.1:{port} did not answer within 1s"):
            store.check(["a"])
        assert 1.0 <= time.monotonic() - start < 1.0 + FAST_S
        start = time.monotonic()
        with pytest.raises(commslayer.StoreUnreachable, match=r"store\.check\(\['a'\]\) got no answer"):
            store.add("n", 1)
        assert time.monotonic() - start < FAST_S
    # The connection's worker is still in the unanswered check until the server goes, and torch
    # logs the reset it then gets: let it end here, or the log reaches the terminal after the test.
    worker = f"commslayer-store-127.0.0.1:{port}"
    del store
    gc.collect()
    for thread in [t for t in threading.enumerate() if t.name == worker]:
        thread.join(10)
        assert not thread.is_alive(), f"{worker} still blocked after the server was killed"


def test_waiting_for_a_key_is_not_bounded_by_the_deadline():
    """A key another rank writes later is a wait, not an unanswered request."""
    with store_server() as (port, _):
        store, peer = bounded(_client(port, 5), deadline_s=0.3), _client(port)
        threading.Timer(1.0, lambda: peer.set("late", "here")).start()
        assert store.get("late") == b"here"
        threading.Timer(1.0, lambda: peer.set("later", "x")).start()
        store.wait(["later"])
        store.set_timeout(timedelta(seconds=0.5))
        with pytest.raises(dist.DistStoreError, match="wait timeout after 500ms"):
            store.get("never")
        assert store.check(["late"])  # a wait that timed out leaves the connection usable
