"""Async ops: the Work keeps its tensors alive, many ops can be in flight and
waited in any order, futures complete, and tensors can be reused after wait."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.harness import run_ranks


def _async(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("gloo", name="as", store=store, rank=rank, size=size, timeout=30)
    n = 1 << 18
    out = torch.empty(n * size)
    inp = torch.full((n,), float(rank))
    work = comm.all_gather_single(out, inp, async_op=True)
    del inp  # the caller drops its input while the op runs
    gc.collect()
    work.wait()
    gathered_ok = all(torch.all(out[r * n:(r + 1) * n] == r).item() for r in range(size))

    ts = [torch.full((1000,), float(rank + i)) for i in range(8)]
    works = [comm.all_reduce(t, commslayer.ReduceOp.AVG, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    avg = [t[0].item() for t in ts]

    t = torch.ones(4)
    fut = comm.all_reduce(t, async_op=True).get_future()
    fut.wait()
    t.fill_(float(rank))  # reuse after completion
    comm.all_reduce(t)
    statuses = {w.status.value for w in works}
    return gathered_ok, avg, t[0].item(), statuses


@pytest.mark.timeout(60)
def test_async_ops_keep_tensors_and_complete_in_any_order():
    size = 3
    for gathered_ok, avg, reused, statuses in run_ranks(_async, size, timeout=40):
        assert gathered_ok
        assert avg == [sum(r + i for r in range(size)) / size for i in range(8)]
        assert reused == sum(range(size))
        assert statuses == {"completed"}


def _recv_polled(rank, size, store):
    """Rank 0 waits on async recvs while a second thread polls each one, as the
    watchdog does; an all_reduce after each message shows the group still works."""
    import threading

    import commslayer

    comm = commslayer.new_comm("gloo", name="polled", store=store, rank=rank, size=size, timeout=30)
    got = []
    for i in range(100):
        t = torch.zeros(256)
        if rank == 0:
            work = comm.recv(t, 1, async_op=True)
            stop = threading.Event()

            def poll(work=work, stop=stop):
                while not stop.is_set():
                    work.is_completed()

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                work.wait()
            finally:
                stop.set()
                poller.join()
            got.append(t[0].item())
        else:
            comm.send(torch.full((256,), float(i)), 0)
        comm.all_reduce(torch.ones(1))
    return got


@pytest.mark.timeout(120)
def test_a_recv_polled_while_waited_leaves_the_group_working():
    # A Gloo recv completes inside its wait; polling it from another thread must not wait
    # on it again, which waited for a message that never came and closed the connections.
    got, _ = run_ranks(_recv_polled, 2, timeout=100)
    assert got == [float(i) for i in range(100)]
