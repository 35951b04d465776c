"""Bad input: InvalidArgument on the calling rank at once (nothing sent, the
communicator stays usable); CollectiveMismatch across ranks in check mode, and
without it once a collective that only some ranks called timed out; hooks,
abort and finalize."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_ranks


def _invalid(rank, size, store):
    import commslayer
    from commslayer import ReduceOp

    comm = commslayer.new_comm("gloo", name="bad", store=store, rank=rank, size=size, timeout=10)
    f = torch.ones(8)
    cases = {
        "not a tensor": lambda: comm.all_reduce([1.0]),
        "non-contiguous": lambda: comm.all_reduce(torch.ones(4, 4).t()),
        "wrong device": lambda: comm.all_reduce(torch.ones(2, device="meta")),
        "bitwise on float": lambda: comm.all_reduce(f, ReduceOp.BAND),
        "avg on bool": lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool), ReduceOp.AVG),
        "premul on int": lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.PREMUL_SUM(2)),
        "c10d premul": lambda: comm.all_reduce(f, torch.distributed._make_nccl_premul_sum(2.0)),
        "all_gather_single size": lambda: comm.all_gather_single(torch.empty(15), f),
        "all_gather_single dtype": lambda: comm.all_gather_single(torch.empty(16, dtype=torch.int64), f),
        "reduce_scatter_single size": lambda: comm.reduce_scatter_single(torch.empty(3), f),
        "a2a splits sum": lambda: comm.all_to_all_single(torch.empty(8), f, [4, 4], [4, 3]),
        "a2a splits length": lambda: comm.all_to_all_single(torch.empty(8), f, [8], [8]),
        "a2a uneven without splits": lambda: comm.all_to_all_single(torch.empty(8), torch.ones(7)),
        "all_gather list length": lambda: comm.all_gather([torch.empty(8)], f),
        "reduce_scatter list shape": lambda: comm.reduce_scatter(torch.empty(8), [f, torch.ones(4)]),
        "broadcast root": lambda: comm.broadcast(f, size),
        "reduce root": lambda: comm.reduce(f, -1),
        "gather list": lambda: comm.gather([f], f, 0),  # root: too short; others: must be empty
        "scatter list": lambda: comm.scatter(f, [f, f, f], 0),
        "send to self": lambda: comm.send(f, rank),
        "recv from nowhere": lambda: comm.recv(f, 7),
        "zero timeout": lambda: comm.all_reduce(f, timeout=0),
        "negative timeout": lambda: comm.barrier(timeout=-1.0),
        "infinite timeout": lambda: comm.all_reduce(f, timeout=float("inf")),
        "nan timeout": lambda: comm.all_reduce(f, timeout=float("nan")),
        "split bad rank": lambda: comm.split([0, 5], "x"),
        "split duplicates": lambda: comm.split([0, 0], "y"),
        "split empty name": lambda: comm.split([0, 1], ""),
    }
    report = {}
    for what, call in cases.items():
        start = time.monotonic()
        try:
            call()
            report[what] = "no error"
        except commslayer.InvalidArgument as err:
            assert time.monotonic() - start < 0.5
            report[what] = str(err)
    t = torch.ones(4)
    comm.all_reduce(t)  # still usable: nothing was sent
    report["after"] = t[0].item()
    return report


@pytest.mark.timeout(60)
def test_invalid_arguments_raise_at_once_and_leave_the_comm_usable():
    for rank, report in enumerate(run_ranks(_invalid, 2, timeout=40)):
        assert report.pop("after") == 2.0
        for what, msg in report.items():
            assert msg != "no error", what
            assert "communicator 'bad'" in msg and f"ranks {rank}" in msg and "op " in msg, (what, msg)
        assert "ReduceOp.PREMUL_SUM: its factor cannot be read" in report["c10d premul"]  # not an object's repr


def _mismatch(rank, size, store, kind):
    import commslayer

    comm = commslayer.new_comm("gloo", name="mm", store=store, rank=rank, size=size, timeout=5, check=True)
    comm.all_reduce(torch.ones(4))  # a matching op passes the check
    t = torch.ones(4)
    odd = rank == size - 1
    try:
        if kind == "shape":
            comm.all_reduce(torch.ones(5) if odd else t)
        elif kind == "dtype":
            comm.all_reduce(t.to(torch.int64) if odd else t)
        elif kind == "op":
            comm.all_reduce(t, commslayer.ReduceOp.MAX if odd else commslayer.ReduceOp.SUM)
        elif kind == "collective":
            comm.broadcast(t, 0) if odd else comm.all_reduce(t)
        elif kind == "a2a splits":
            comm.all_to_all_single(torch.empty(3), torch.ones(3), [1, 1, 1],
                                   [1, 2, 0] if odd else [1, 1, 1])
        else:
            if rank == 0:
                comm.send(torch.ones(4), 1)
            elif rank == 1:
                comm.recv(torch.ones(4, dtype=torch.float64), 0)
            else:
                return "not involved"
    except commslayer.CollectiveMismatch as err:
        return str(err), err.ranks
    return "no error"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,expect", [
    ("shape", "shape"), ("dtype", "dtype"), ("op", "reduce_op"), ("collective", "op:"),
    ("a2a splits", "rows to rank"), ("p2p dtype", "dtype"),
])
def test_mismatch_is_named_on_every_rank(kind, expect):
    size = 3
    for rank, result in enumerate(run_ranks(_mismatch, size, kind, timeout=60)):
        if result == "not involved":
            continue
        assert result != "no error", rank
        msg, ranks = result
        assert expect in msg, msg
        assert (size - 1 in ranks) or kind == "p2p dtype", (msg, ranks)


def _some_ranks_only(rank, size, store, kind, async_op):
    """Rank 0 alone calls a barrier where the others all-reduce (``kind`` "mismatch"), or
    every rank calls the barrier and rank 2 comes only after the timeout ("late")."""
    import commslayer

    comm = commslayer.new_comm("gloo", name="some", store=store, rank=rank, size=size, timeout=3)
    comm.all_reduce(torch.ones(4))
    began = time.monotonic()
    try:
        if rank == 0 or kind == "late":
            if rank == 2:
                time.sleep(5)
            comm.barrier()
        else:
            work = comm.all_reduce(torch.ones(4), async_op=async_op)
            if work is not None:
                work.wait()
    except commslayer.CommError as err:
        return type(err).__name__, str(err), err.ranks, time.monotonic() - began
    return "no error"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("async_op", [False, True])
def test_a_collective_called_on_some_ranks_only_is_a_mismatch_not_a_timeout(async_op):
    """No check mode: rank 0 alone calls ``barrier()`` (#2) while ranks 1 and 2 all-reduce;
    each side waits its timeout (3 s). Then every rank raises ``CollectiveMismatch`` naming
    the others' op, so the launcher takes it for a bug, not a lost peer. The control, every
    rank in the barrier and rank 2 late, stays a ``CollectiveTimeout``."""
    results = run_ranks(_some_ranks_only, 3, "mismatch", async_op, timeout=60)
    kind, msg, ranks, took = results[0]
    assert kind == "CollectiveMismatch" and ranks == (1, 2), msg
    assert "timed out in barrier #2 while rank 1 in all_reduce #2, rank 2 in all_reduce #2 timed out" in msg, msg
    assert took < 3 + 2.5, took  # the timeout, then at most the look for the others' ops
    for kind, msg, ranks, _ in results[1:]:
        assert kind == "CollectiveMismatch" and ranks == (0,), msg
        assert "timed out in all_reduce #2 while rank 0 in barrier #2 timed out" in msg, msg
    late = run_ranks(_some_ranks_only, 3, "late", async_op, timeout=60)
    assert [r[0] for r in late[:2]] == ["CollectiveTimeout"] * 2, late


def _hooks_and_lifecycle(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("gloo", name="hk", store=store, rank=rank, size=size, timeout=10)
    seen = []
    pre = comm.register_pre_hook(lambda name, op_id, args: seen.append(("pre", name, op_id)))
    post = comm.register_post_hook(lambda op_id, work: seen.append(("post", work.op, op_id)))
    comm.register_pre_hook(lambda *a: 1 / 0)  # a broken observer must not break the op
    aborts = []
    comm.register_abort_hook(lambda: aborts.append(1))
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.broadcast(t, 0)
    pre.remove()
    post.remove()
    pre.remove()  # idempotent
    comm.barrier()
    sub = comm.split([1, 0], "pair")
    x = torch.tensor([float(rank)])
    sub.all_reduce(x)
    again = None
    try:
        comm.split([0, 1], "pair")
    except commslayer.InvalidArgument as err:
        again = str(err)
    comm.abort()
    comm.abort()
    comm.finalize()
    try:
        comm.all_reduce(t)
        after = "no error"
    except commslayer.CommAborted as err:
        after = str(err)
    sub.finalize()
    sub.finalize()
    return seen, t[0].item(), sub.get_rank(), sub.get_size(), x.item(), again, len(aborts), after


@pytest.mark.timeout(60)
def test_hooks_split_abort_finalize():
    for rank, (seen, value, sub_rank, sub_size, x, again, aborts, after) in enumerate(
            run_ranks(_hooks_and_lifecycle, 2, timeout=40)):
        assert [s[:2] for s in seen] == [("pre", "all_reduce"), ("post", "all_reduce"),
                                         ("pre", "broadcast"), ("post", "broadcast")]
        ids = [s[2] for s in seen]
        assert ids[0] == ids[1] < ids[2] == ids[3]  # op ids increase
        assert value == 2.0
        assert (sub_rank, sub_size, x) == (1 - rank, 2, 1.0)  # list order is the new rank order
        assert again and "already" in again
        assert aborts == 1
        assert "aborted" in after


def _check_timeout_breaks(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("gloo", name="ct", store=store, rank=rank, size=size, timeout=1, check=True)
    if rank == 1:
        time.sleep(2.5)
        return None
    try:
        comm.all_reduce(torch.ones(2))
    except commslayer.CollectiveTimeout as err:
        first = err.ranks
    try:
        comm.all_reduce(torch.ones(2))
    except commslayer.CollectiveTimeout as err:
        return first, str(err)


@pytest.mark.timeout(60)
def test_check_mode_names_the_absent_rank_and_breaks_the_comm():
    first, later = run_ranks(_check_timeout_breaks, 2, timeout=30)[0]
    assert first == (1,) and "broken by an earlier failure" in later


def _rendezvous_fails(rank, size, store):
    import commslayer

    if rank == 1:
        return None
    try:
        commslayer.new_comm("gloo", name="alone", store=store, rank=0, size=2, timeout=1)
    except commslayer.CommError as err:
        return type(err).__name__, str(err)


def _forked_child_uses_the_communicator(rank, size, store):
    import os

    import commslayer

    comm = commslayer.new_comm("gloo", name="forked", store=store, rank=rank, size=size, timeout=30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker's situation: a copy of the parent, without its threads
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(2))
            said = "no error"
        except commslayer.CommError as err:
            said = f"{type(err).__name__} {time.monotonic() - start:.3f} {err}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    said = os.read(read, 4096).decode()
    t = torch.full((2,), float(rank + 1))
    comm.all_reduce(t)  # the parent's communicator is untouched
    return said, os.getpid(), t.tolist()


@pytest.mark.timeout(60)
def test_a_forked_child_is_told_at_once_that_its_parents_communicator_is_not_its_own():
    for said, parent, total in run_ranks(_forked_child_uses_the_communicator, 2, timeout=40):
        kind, seconds, message = said.split(" ", 2)
        assert kind == "CommAborted" and float(seconds) < 1.0, said  # not the deadline's 30 s
        assert f"belongs to process {parent}" in message and "forked child" in message, message
        assert total == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_a_group_whose_peer_never_comes_is_a_comm_error():
    kind, msg = run_ranks(_rendezvous_fails, 2, timeout=30)[0]
    assert "communicator 'alone'" in msg and "new_comm" in msg, (kind, msg)


@pytest.mark.timeout(90)
def test_a_peer_that_refuses_the_connection_at_build_is_peer_lost():
    """Rank 1 publishes its address for the new group's rendezvous and is SIGKILLed: rank 0's
    connection is refused (Gloo retries it until "Connect timeout"). That is a peer that cannot
    be reached, ``PeerLost``, not a ``CollectiveTimeout`` of an op that was slow (issue 41)."""
    import socket
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    import commslayer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    peer = ("from datetime import timedelta; import torch.distributed as dist; "
            "from torch._C._distributed_c10d import ProcessGroupGloo; "
            f"s = dist.TCPStore('127.0.0.1', {port}, 2, False, timeout=timedelta(seconds=60)); "
            "ProcessGroupGloo(dist.PrefixStore('commslayer/refusing/0/', s), 1, 2, timedelta(seconds=60))")
    proc = subprocess.Popen([sys.executable, "-c", peer])
    try:
        deadline = time.monotonic() + 60
        while not store.check(["commslayer/refusing/0//0/1"]):  # rank 1's address, for rank 0
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1 never published its address"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(commslayer.PeerLost, match="could not build the gloo group: a peer is unreachable") as info:
        commslayer.new_comm("gloo", name="refusing", store=store, rank=0, size=2, timeout=1)
    assert "communicator 'refusing'" in str(info.value) and "op new_comm" in str(info.value), info.value


# What torch 2.11's ProcessGroupNCCL raised, verbatim, when two ranks of one group were
# given the same GPU (seen on an H200 machine; this project's CI has no GPU).
_NCCL_DUPLICATE_GPU = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with NCCL_DEBUG=WARN "
    "for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 0 and rank 1 both on CUDA device 60")


def test_nccl_misuse_is_invalid_argument_with_its_cause():
    """NCCL's cause sits on a line after "Last error:": the error keeps it, and a
    misuse (which a retry repeats) is an ``InvalidArgument``, not a fault."""
    from commslayer.comm.backends import classify
    from commslayer.errors import InvalidArgument, backend_words

    exc = RuntimeError(_NCCL_DUPLICATE_GPU)
    assert classify(exc) is InvalidArgument
    words = backend_words(exc)
    assert words.endswith(": Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"), words
    assert "\n" not in words
    assert backend_words(RuntimeError("Connection closed by peer [127.0.0.1]:1234")) == \
        "Connection closed by peer [127.0.0.1]:1234"
