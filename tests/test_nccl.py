"""The NCCL path: a world-size-1 smoke test. Skipped without CUDA (this
project's CI has no GPU)."""

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
    try:
        comm.batch_op_create()  # not on NCCL yet: it needs an NCCL group
    except commslayer.InvalidArgument as err:
        bad += " | " + str(err)
    comm.finalize()
    return t.cpu().tolist(), out.cpu().tolist(), rs.cpu().tolist(), bad


@pytest.mark.timeout(120)
def test_nccl_world_size_one():
    t, out, rs, bad = run_ranks(_smoke, 1, timeout=100)[0]
    assert t == out == rs == [float(i) for i in range(8)]
    assert bad and "cuda" in bad and "Gloo only, not nccl" in bad
