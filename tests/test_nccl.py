"""The NCCL path: a world-size-1 smoke test, and a batch of point-to-point as one
NCCL group on two GPUs. Skipped without CUDA (this project's CI has no GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL"),
]


def _smoke(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("nccl", torch.device("cuda", 0), name="gpu", store=store, rank=rank, size=size,
                               timeout=30)
    t = torch.arange(8., device="cuda")
    comm.all_reduce(t, commslayer.ReduceOp.AVG)
    out = torch.empty(8, device="cuda")
    comm.all_gather_single(out, t).wait()
    rs = torch.empty(8, device="cuda")
    comm.reduce_scatter_single(rs, t, async_op=True).wait()
    comm.barrier()
    bad = None
    try:
        comm.all_reduce(torch.ones(2))  # a CPU tensor on the NCCL communicator
    except commslayer.InvalidArgument as err:
        bad = str(err)
    comm.finalize()
    return t.cpu().tolist(), out.cpu().tolist(), rs.cpu().tolist(), bad


@pytest.mark.timeout(120)
def test_nccl_world_size_one():
    t, out, rs, bad = run_ranks(_smoke, 1, timeout=100)[0]
    assert t == out == rs == [float(i) for i in range(8)]
    assert bad and "cuda" in bad


def _batch(rank, size, store):
    import commslayer

    torch.cuda.set_device(rank)
    comm = commslayer.new_comm("nccl", torch.device("cuda", rank), name="batch", store=store, rank=rank, size=size,
                               timeout=30)
    peer = 1 - rank
    batch = comm.batch_op_create()
    got = torch.empty(4, device="cuda")
    batch.send(torch.full((4,), float(rank + 1), device="cuda"), peer)  # both send first: one NCCL group
    batch.recv(got, peer)
    work = batch.issue(async_op=True)
    work.wait()
    torch.cuda.synchronize()
    comm.finalize()
    return got.cpu().tolist(), work.op


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_batch_is_one_group_call():
    """Two ranks each send before they receive: as separate NCCL calls that would
    deadlock; as one group call (batch_op_create) both complete."""
    (got0, op), (got1, _) = run_ranks(_batch, 2, timeout=100)
    assert got0 == [2.0] * 4 and got1 == [1.0] * 4 and op == "batch_p2p"
