"""Deadlines: a peer that never arrives gives CollectiveTimeout on the waiting
rank within timeout + 0.5 s, for collectives and point-to-point alike; an op
that finishes inside its deadline never times out."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_ranks

TIMEOUT_S = 1.0
SLACK_S = 0.5


def _absent_peer(rank, size, store, op, async_op):
    import commslayer

    comm = commslayer.new_comm("gloo", name="dl", store=store, rank=rank, size=size, timeout=30)
    comm.barrier()
    if rank == 1:  # the peer that never arrives
        time.sleep(TIMEOUT_S + SLACK_S + 1.5)
        return None
    errors = []
    comm.register_error_hook(errors.append)
    t = torch.ones(1 << 20)  # large enough that a send cannot complete into socket buffers
    start = time.monotonic()
    try:
        if op == "all_reduce":
            work = comm.all_reduce(t, timeout=TIMEOUT_S, async_op=async_op)
        elif op == "send":
            work = comm.send(t, 1, timeout=TIMEOUT_S, async_op=async_op)
        else:
            work = comm.recv(t, 1, timeout=TIMEOUT_S, async_op=async_op)
        if async_op:
            while not work.is_completed():  # nobody waits: the watchdog must settle it
                time.sleep(0.01)
            assert work.status == commslayer.WorkStatus.TIMEDOUT, work.status
            raise work.exception()
    except commslayer.CollectiveTimeout as err:
        elapsed = time.monotonic() - start
        try:
            comm.all_reduce(torch.ones(1))
        except commslayer.CollectiveTimeout as later:
            later_msg = str(later)
        return elapsed, str(err), err.op, err.seq, err.timeout_s, err.elapsed_s, later_msg, len(errors)
    raise AssertionError("no timeout")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["all_reduce", "send", "recv"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_absent_peer_times_out_in_time(op, async_op):
    result = run_ranks(_absent_peer, 2, op, async_op, timeout=30)[0]
    elapsed, msg, err_op, seq, timeout_s, err_elapsed, later_msg, hook_calls = result
    assert TIMEOUT_S - 0.05 <= elapsed < TIMEOUT_S + SLACK_S, elapsed
    assert err_op == op and timeout_s == TIMEOUT_S and err_elapsed >= TIMEOUT_S - 0.05
    assert "'dl'" in msg and op in msg and f"#{seq}" in msg and "timeout 1s" in msg and "elapsed" in msg
    assert "broken by an earlier failure" in later_msg  # later ops fail at once, naming the cause
    assert hook_calls == 1


def _late_but_in_time(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("gloo", name="late", store=store, rank=rank, size=size, timeout=30)
    results = []
    for delay in (0.2, 0.6, 0.8):
        comm.barrier()
        if rank == 1:
            time.sleep(delay)
        t = torch.ones(4)
        start = time.monotonic()
        comm.all_reduce(t, timeout=1.2)
        results.append((delay, time.monotonic() - start, t[0].item()))
        w = comm.all_reduce(torch.ones(4), async_op=True, timeout=1.2)
        time.sleep(0.05)
        w.wait()
        results.append((delay, None, w.status.value))
    return results


@pytest.mark.timeout(60)
def test_op_inside_deadline_does_not_time_out():
    for rank_results in run_ranks(_late_but_in_time, 2, timeout=40):
        for delay, _, value in rank_results:
            assert value in (2.0, "completed"), (delay, value)


def _short_wait(rank, size, store):
    import commslayer
    from datetime import timedelta

    comm = commslayer.new_comm("gloo", name="sw", store=store, rank=rank, size=size, timeout=30)
    if rank == 1:
        time.sleep(2.0)
        return None
    work = comm.all_reduce(torch.ones(4), async_op=True)
    start = time.monotonic()
    with pytest.raises(commslayer.CollectiveTimeout):
        work.wait(timeout=timedelta(seconds=0.3))
    return time.monotonic() - start, work.status.value


@pytest.mark.timeout(60)
def test_wait_timeout_shortens_the_deadline():
    elapsed, status = run_ranks(_short_wait, 2, timeout=30)[0]
    assert 0.25 <= elapsed < 0.8 and status == "timedout"
