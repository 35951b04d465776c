"""torchcomms' op set on the Communicator: all_gather_v, reduce_scatter_v,
all_to_all_v_single, gather_single and batched point-to-point give what plain
c10d (ProcessGroupGloo) gives on the same inputs, at 2 and 3 real ranks with
uneven sizes; set_timeout, is_aborted, the NaN check, check mode and bad input,
each in one spawned job per world size; and a batch's deadline and lost peer."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from tests.harness import RankDied, run_ranks

DTYPES = (torch.float32, torch.int64, torch.complex64)


def _block(j: int, cols: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank j's uneven block: j + 1 rows of ``cols``, distinct values per rank and salt."""
    return (torch.arange((j + 1) * cols, dtype=torch.float32).reshape(j + 1, cols) + 100 * j + 7 * salt).to(dtype)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _results(comm: Any, rank: int, size: int, dtypes: Tuple[torch.dtype, ...] = DTYPES) -> List[str]:
    """Every new op against plain c10d on the default (plain Gloo) group; the names of those that differ."""
    import torch.distributed as dist

    from commslayer import ReduceOp

    bad = []
    for async_op in (False, True):
        def run(work: Any) -> None:
            if async_op:
                work.wait()

        for dtype in dtypes:
            tag = f"{comm.get_name()} {dtype} async={async_op}"
            mine = _block(rank, 2, dtype)
            outs = [torch.zeros_like(_block(j, 2, dtype)) for j in range(size)]
            run(comm.all_gather_v(outs, mine, async_op=async_op))
            # Gloo's all_gather takes equal sizes only: the reference broadcasts each rank's block
            ref = [mine.clone() if j == rank else torch.zeros_like(o) for j, o in enumerate(outs)]
            for j in range(size):
                dist.broadcast(ref[j], j)
            if not all(_same(o, r) for o, r in zip(outs, ref)):
                bad.append(f"all_gather_v {tag}")

            ops = [(ReduceOp.SUM, dist.ReduceOp.SUM)]
            if not dtype.is_complex:
                ops += [(ReduceOp.MAX, dist.ReduceOp.MAX), (ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT)]
            for op, plain_op in ops:
                ins = [_block(j, 3, dtype, salt=rank) for j in range(size)]
                out = torch.zeros_like(_block(rank, 3, dtype))
                run(comm.reduce_scatter_v(out, ins, op, async_op=async_op))
                ref_out = torch.zeros_like(out)
                dist.reduce_scatter(ref_out, [t.clone() for t in ins], op=plain_op)
                if not _same(out, ref_out):
                    bad.append(f"reduce_scatter_v {op} {tag}")

            send_rows = [rank * 2 + j + 1 for j in range(size)]  # rows this rank sends to rank j
            recv_rows = [j * 2 + rank + 1 for j in range(size)]
            inp = _block(sum(send_rows) - 1, 4, dtype, salt=rank)
            out = torch.zeros(sum(recv_rows), 4, dtype=dtype)
            run(comm.all_to_all_v_single(out, inp, recv_rows, send_rows, async_op=async_op))
            ref_out = torch.zeros_like(out)
            dist.all_to_all_single(ref_out, inp, recv_rows, send_rows)
            if not _same(out, ref_out):
                bad.append(f"all_to_all_v_single {tag}")

            root = size - 1
            inp = _block(1, 3, dtype, salt=rank)
            out = torch.zeros(size * 2, 3, dtype=dtype) if rank == root else torch.full((1,), 5, dtype=dtype)
            run(comm.gather_single(out, inp, root, async_op=async_op))
            parts = [torch.zeros_like(inp) for _ in range(size)] if rank == root else None
            # plain Gloo's gather refuses complex tensors: the reference gathers their real views
            dist.gather(_real(inp), None if parts is None else [_real(p) for p in parts], dst=root)
            expected = torch.cat(parts) if parts is not None else torch.full((1,), 5, dtype=dtype)
            if not _same(out, expected):
                bad.append(f"gather_single {tag}")

            bad += _batch(comm, rank, size, dtype, async_op)
    return bad


def _batch(comm: Any, rank: int, size: int, dtype: torch.dtype, async_op: bool) -> List[str]:
    """A ring of sends and receives, two messages per pair, as one batch and as plain c10d's batch_isend_irecv."""
    import torch.distributed as dist

    nxt, prev = (rank + 1) % size, (rank - 1) % size
    sends = [_block(rank, 2, dtype, salt=k) for k in range(2)]
    got = [torch.zeros_like(_block(prev, 2, dtype)) for _ in range(2)]
    batch = comm.batch_op_create()
    for k in range(2):  # receives queued first on odd ranks: the order within a batch does not matter
        if rank % 2:
            batch.recv(got[k], prev)
            batch.send(sends[k], nxt)
        else:
            batch.send(sends[k], nxt)
            batch.recv(got[k], prev)
    work = batch.issue(async_op)
    if async_op:
        work.wait()
    ref = [torch.zeros_like(g) for g in got]
    p2p = [dist.P2POp(dist.isend, s, nxt) for s in sends] + [dist.P2POp(dist.irecv, r, prev) for r in ref]
    for w in dist.batch_isend_irecv(p2p):
        w.wait()
    ok = all(_same(g, r) for g, r in zip(got, ref)) and batch.ops == []
    return [] if ok else [f"batch {dtype} async={async_op}"]


def _refusals(comm: Any, rank: int, size: int) -> Dict[str, Any]:
    """Bad input: each call's error class and message (nothing is sent)."""
    calls: Dict[str, Callable[[], Any]] = {
        "splits sum": lambda: comm.all_to_all_v_single(torch.zeros(size), torch.zeros(size), [1] * size,
                                                       [2] * size),
        "splits none": lambda: comm.all_to_all_v_single(torch.zeros(size), torch.zeros(size), None, [1] * size),
        "splits count": lambda: comm.all_to_all_v_single(torch.zeros(size), torch.zeros(size), [size],
                                                         [1] * size),
        "gather_v count": lambda: comm.all_gather_v([torch.zeros(1)], torch.zeros(1)),
        "gather_v own": lambda: comm.all_gather_v([torch.zeros(3)] * size, torch.zeros(2)),
        "gather_v dtype": lambda: comm.all_gather_v([torch.zeros(2, dtype=torch.int64)] * size, torch.zeros(2)),
        "scatter_v own": lambda: comm.reduce_scatter_v(torch.zeros(2), [torch.zeros(3)] * size),
        "gather_single size": lambda: comm.gather_single(torch.zeros(size + 1), torch.zeros(1), rank),
        "gather_single root": lambda: comm.gather_single(torch.zeros(size), torch.zeros(1), size),
        "batch empty": lambda: comm.batch_op_create().issue(),
        "batch self": lambda: comm.batch_op_create().send(torch.zeros(1), rank),
        "batch range": lambda: comm.batch_op_create().recv(torch.zeros(1), size),
        "batch tensor": lambda: comm.batch_op_create().send([1.0], (rank + 1) % size),
        "timeout negative": lambda: comm.set_timeout(-1),
        "timeout none": lambda: comm.set_timeout(None),
    }
    out = {}
    for what, call in calls.items():
        try:
            call()
            out[what] = None
        except Exception as err:  # the test checks the class
            out[what] = (type(err).__name__, getattr(err, "op", None), getattr(err, "ranks", None), str(err))
    return out


def _error(call: Callable[[], Any]) -> Any:
    try:
        call()
    except Exception as err:  # the test checks the class
        return type(err).__name__, getattr(err, "op", None), getattr(err, "ranks", None), str(err)
    return None


def _ops_job(rank: int, size: int, store: Any) -> Dict[str, Any]:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import commslayer
    from commslayer.comm.nan_check import NanCheckHook
    from tracing.record.recorder import install

    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=rank, world_size=size)
    rec = install(None, signals=False)
    comm = commslayer.new_comm("gloo", name="tc", store=store, rank=rank, size=size, timeout=30)
    out: Dict[str, Any] = {"differ": _results(comm, rank, size), "refused": _refusals(comm, rank, size)}
    # the same with write isolation, and on a split (no liveness monitor: waits without a helper thread)
    iso = commslayer.new_comm("gloo", name="tc-iso", store=store, rank=rank, size=size, timeout=30,
                              isolate_writes=True)
    out["differ"] += _results(iso, rank, size, (torch.float32,)) + \
        _results(comm.split(list(range(size)), "tc-split"), rank, size, (torch.float32,))
    # a batch between single messages: the pair's numbering carries on across it
    peer = 1 - rank if rank < 2 else None
    if peer is not None:
        t = torch.zeros(3)
        comm.send(torch.ones(3), peer) if rank == 0 else comm.recv(t, peer)
        batch = comm.batch_op_create()
        batch.send(torch.full((3,), 2.0 + rank), peer)
        batch.recv(t, peer)
        batch.issue()
        out["after batch"] = t.tolist()
        comm.recv(t, peer) if rank == 0 else comm.send(torch.ones(3), peer)
    out["records"] = [(r["op"], r["peer"], r["seq"], r["state"], r.get("backend_op")) for r in rec.records()
                      if r["comm"] == "tc" and r["op"] in ("batch_p2p", "send", "recv")][-4:]

    checked = commslayer.new_comm("gloo", name="tc-check", store=store, rank=rank, size=size, timeout=30,
                                  check=True)
    rows = [1 + (j == 0 and rank == 1) for j in range(size)]  # rank 1 expects 2 rows from rank 0, which sends 1
    out["check a2a"] = _error(lambda: checked.all_to_all_v_single(torch.zeros(sum(rows)), torch.zeros(size),
                                                                  rows, [1] * size))
    outs = [torch.zeros(1 + (j == 0 and rank == 1)) for j in range(size)]  # the same for all_gather_v
    out["check gather_v"] = _error(lambda: checked.all_gather_v(outs, torch.zeros(1)))
    got = [torch.zeros(2) for _ in range(size)]
    checked.all_gather_v(got, torch.full((2,), float(rank)))  # a mismatch leaves the group usable
    out["check after"] = [g.tolist() for g in got]
    batch = checked.batch_op_create()  # check mode compares each batched message with its other end
    if rank < 2:
        batch.send(torch.ones(2 + rank), 1 - rank)
        batch.recv(torch.zeros(2 + rank), 1 - rank)  # rank 0 expects 2 elements, rank 1 sends 3
        out["check batch"] = _error(batch.issue)

    nan = commslayer.new_comm("gloo", name="tc-nan", store=store, rank=rank, size=size, timeout=30)
    handle = NanCheckHook().register_with_comm(nan)
    t = torch.ones(4)
    nan.all_reduce(t)
    out["nan clean"] = t.tolist()
    bad = torch.ones(5)
    bad[rank + 1] = float("nan")
    out["nan"] = _error(lambda: nan.all_reduce(bad))
    out["nan after"] = _error(lambda: nan.all_reduce(torch.ones(1)))
    out["nan record"] = [(r["op"], r["state"]) for r in rec.records() if r["comm"] == "tc-nan"]
    handle.remove()
    os.environ["COMMSLAYER_NAN_CHECK"] = "1"
    env = commslayer.new_comm("gloo", name="tc-nan-env", store=store, rank=rank, size=size, timeout=30)
    del os.environ["COMMSLAYER_NAN_CHECK"]
    ints = torch.ones(2, dtype=torch.int64)
    env.all_reduce(ints)  # integers hold no NaN
    out["nan env"] = _error(lambda: env.gather_single(torch.zeros(size, 2), torch.full((2,), float("nan")), 0))

    short = commslayer.new_comm("gloo", name="tc-timeout", store=store, rank=rank, size=size, timeout=30)
    short.set_timeout(timedelta(seconds=1.5))
    out["timeout"] = short.get_timeout().total_seconds()
    out["aborted before"] = short.is_aborted()
    if rank == 0:  # nobody sends: the recv ends at the deadline set_timeout gave
        began = time.monotonic()
        err = _error(lambda: short.recv(torch.zeros(1), 1))
        out["deadline"] = (err and err[0], time.monotonic() - began)
        out["broken aborted"] = short.is_aborted()
        store.set("tc-timed-out", "1")
    else:  # stays until rank 0's recv has timed out: a peer that left would end it sooner
        store.wait(["tc-timed-out"], timedelta(seconds=30))
    short.abort()
    out["aborted"] = short.is_aborted()

    # The direct path of synchronous ops (Communicator._direct_run) closes while a hook
    # watches, opens again when it goes, and carries the deadline set_timeout gives.
    direct = commslayer.new_comm("gloo", name="tc-direct", store=store, rank=rank, size=size, timeout=30)
    seen: List[str] = []
    direct.all_reduce(torch.ones(2))
    handle = direct.register_pre_hook(lambda op, op_id, args: seen.append(op))
    direct.all_reduce(torch.ones(2))
    direct.all_gather_single(torch.zeros(2 * size), torch.ones(2))
    direct.reduce_scatter_single(torch.zeros(1), torch.ones(size))
    handle.remove()
    direct.all_reduce(torch.ones(2))
    out["hooked"] = seen
    direct.set_timeout(1.5)
    if rank == 0:  # nobody else joins: the all_reduce ends at the new deadline
        began = time.monotonic()
        err = _error(lambda: direct.all_reduce(torch.ones(2)))
        out["direct deadline"] = (err and err[0], err and err[1], time.monotonic() - began)
        store.set("tc-direct-timed-out", "1")
    else:
        store.wait(["tc-direct-timed-out"], timedelta(seconds=30))
    direct.abort()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_torchcomms_ops_match_plain_c10d(size: int) -> None:
    results = run_ranks(_ops_job, size, timeout=100)
    for rank, out in enumerate(results):
        assert out["differ"] == [], (rank, out["differ"])
        for what, err in out["refused"].items():
            assert err is not None and err[0] == "InvalidArgument" and err[2] == (rank,), (rank, what, err)
            assert f"rank {rank}" in err[3] or f"ranks {rank}" in err[3], (what, err)
        assert all(err[1] == "all_to_all_v_single" for what, err in out["refused"].items() if "splits" in what)
        assert f"sums to {2 * size}" in out["refused"]["splits sum"][3] and "required" in out["refused"]["splits none"][3]
        assert "this rank's own" in out["refused"]["gather_v own"][3]
        assert out["refused"]["batch empty"][1] == "batch_p2p" and "empty" in out["refused"]["batch empty"][3]

        kind, op, ranks, what = out["check a2a"]
        assert kind == "CollectiveMismatch" and op == "all_to_all_v_single" and ranks == (0, 1), out["check a2a"]
        assert "rank 0 sends 1 rows to rank 1, which expects 2" in what, what
        assert out["check gather_v"][0] == "CollectiveMismatch" and out["check gather_v"][2] == (0, 1)
        assert out["check after"] == [[float(j)] * 2 for j in range(size)]

        kind, op, ranks, what = out["nan"]
        assert (kind, op, ranks) == ("NanDetected", "all_reduce", (rank,)), out["nan"]
        assert f"element {rank + 1}" in what and f"on rank {rank}" in what and "input 0 of 1" in what, what
        assert out["nan clean"] == [float(size)] * 4
        assert out["nan after"][0] == "NanDetected" and "earlier failure" in out["nan after"][3]
        assert out["nan record"][-2:] == [("all_reduce", "failed"), ("all_reduce", "failed")], out["nan record"]
        assert out["nan env"][:3] == ("NanDetected", "gather_single", (rank,)), out["nan env"]

        assert out["timeout"] == 1.5 and out["aborted before"] is False and out["aborted"] is True
        assert out["hooked"] == ["all_reduce", "all_gather_single", "reduce_scatter_single"], out["hooked"]
    ours = results[0]
    kind, op, took = ours["direct deadline"]
    assert (kind, op) == ("CollectiveTimeout", "all_reduce") and 1.4 < took < 4.0, ours["direct deadline"]
    kind, took = ours["deadline"]
    assert kind == "CollectiveTimeout" and 1.4 < took < 4.0 and ours["broken aborted"] is False, ours["deadline"]
    for rank in (0, 1):
        out = results[rank]
        assert out["after batch"] == [2.0 + (1 - rank)] * 3, out["after batch"]
        # one record per batch; the messages around it keep their numbers in their direction: the
        # first (n) is followed by the batch's message in the same direction (n + 1), and the last
        # by the batch's other one; the ring carried 1 -> 0 before only at 2 ranks (n - 1 messages)
        mine = ("send", "recv") if rank == 0 else ("recv", "send")
        n = out["records"][-3][2]
        assert out["records"][-3:] == [
            (mine[0], 1 - rank, n, "completed", mine[0]),
            ("batch_p2p", None, out["records"][-2][2], "completed", "send/recv"),
            (mine[1], 1 - rank, n + 1 if size == 2 else 2, "completed", mine[1])], out["records"]
        kind, op, ranks, what = out["check batch"]
        assert (kind, op, ranks) == ("CollectiveMismatch", "batch_p2p", (0, 1)), out["check batch"]


def _batch_ends(rank: int, size: int, store: Any) -> Any:
    """A batch that nobody answers ends at its deadline; one whose peer dies, with PeerLost."""
    import os
    import signal

    import commslayer

    comms = [commslayer.new_comm("gloo", name=f"tc-batch-ends-{i}", store=store, rank=rank, size=size, timeout=30)
             for i in range(2)]
    if rank == 1:  # answers nothing; dies once rank 0's first batch has timed out
        store.wait(["tc-batch timed out"])
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    out = {}
    for comm, what, timeout in ((comms[0], "deadline", 1.0), (comms[1], "lost", 20.0)):
        batch = comm.batch_op_create()
        batch.send(torch.ones(2), 1)
        batch.recv(torch.zeros(2), 1)
        began = time.monotonic()
        out[what] = _error(lambda: batch.issue(timeout=timeout)), time.monotonic() - began
        store.set("tc-batch timed out", "1")
    return out


@pytest.mark.timeout(60)
def test_a_batch_ends_at_its_deadline_and_when_its_peer_dies() -> None:
    ours, died = run_ranks(_batch_ends, 2, timeout=45, allow_errors=True)
    assert isinstance(died, RankDied), died
    (kind, op, _, _), took = ours["deadline"]
    assert (kind, op) == ("CollectiveTimeout", "batch_p2p") and 0.9 < took < 3.0, ours["deadline"]
    (kind, op, ranks, _), took = ours["lost"]
    assert (kind, op, ranks) == ("PeerLost", "batch_p2p", (1,)) and took < 8.0, ours["lost"]
