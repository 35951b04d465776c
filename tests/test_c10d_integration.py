"""commslayer as a torch.distributed backend, under real torchrun: FSDP2 (with a
separate reduce-scatter group) and DDP train bitwise like plain Gloo, through
``init_process_group("commslayer")`` and through the environment switch on an
unmodified script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commslayer.c10d import group_of
from tests.harness import free_port, group_kind, run_ranks

JOB = Path(__file__).parent / "jobs" / "train_fsdp2.py"


def _torchrun(tmp_path: Path, backend: str, nproc: int, **env: str) -> dict:
    out = tmp_path / f"{backend}-{len(env)}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(JOB), backend, str(out)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    full_env.pop("COMMSLAYER_ROUTE_C10D", None) if not env else None
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2])
def test_fsdp2_and_ddp_match_plain_gloo(tmp_path, nproc):
    plain = _torchrun(tmp_path, "gloo", nproc)
    ours = _torchrun(tmp_path, "commslayer", nproc)
    # routed and traced: observing the ops must not change a single bit
    routed = _torchrun(tmp_path, "gloo", nproc, COMMSLAYER_ROUTE_C10D="1",
                       COMMSLAYER_TRACE_DIR=str(tmp_path / "traces"))
    assert plain["world_type"] == "ProcessGroup"
    assert ours["world_type"] == routed["world_type"] == "commslayer"
    assert routed["backend"] == "gloo"  # the job still sees what it asked for, under every name
    assert routed["names"] == plain["names"] and plain["names"]["ddp"] == "gloo", (routed["names"], plain["names"])
    assert ours["names"]["name"] == ours["names"]["ddp"] == "gloo"  # the backend that carries it, as c10d names it
    assert routed["recording"] and not ours["recording"]
    for run in (ours, routed):
        _assert_bitwise(plain["fsdp"], run["fsdp"])
        _assert_bitwise(plain["ddp"], run["ddp"])
        assert run["sub"] == 1.0 and torch.equal(run["gathered"], plain["gathered"])
    # training moved the parameters: the comparison is not of two initial states
    assert not torch.equal(plain["fsdp"]["0.0.weight"], torch.manual_seed(0) and
                           torch.nn.Linear(32, 64).weight.detach())


def _mesh_from_comm(rank, size, store):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import commslayer

    dist.init_process_group("commslayer", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    comm = commslayer.new_comm("gloo", name="meshcomm", timeout=30)
    mesh = DeviceMesh.from_group(comm.as_process_group(), "cpu")
    seen = []
    comm.register_pre_hook(lambda name, op_id, args: seen.append(name))
    t = torch.ones(2)
    dist.all_reduce(t, group=mesh.get_group())
    dist.destroy_process_group()
    dist.destroy_process_group() if dist.is_initialized() else None
    return t[0].item(), seen, mesh.size()


@pytest.mark.timeout(60)
def test_device_mesh_from_a_communicator():
    for value, seen, mesh_size in run_ranks(_mesh_from_comm, 2, timeout=40):
        assert value == 2.0 and seen == ["all_reduce"] and mesh_size == 2


def _device_qualified(rank, size, store):
    import torch.distributed as dist

    dist.init_process_group("cpu:commslayer,cuda:commslayer", store=store, rank=rank, world_size=size)
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    pair = dist.new_group([0, 1])
    dist.broadcast(t, src=1, group=pair)
    name = group_kind(dist.group.WORLD)
    dist.destroy_process_group()
    return t[0].item(), name


@pytest.mark.timeout(60)
def test_device_qualified_backend_string():
    for value, name in run_ranks(_device_qualified, 3, timeout=40):
        assert value == 3.0 and name == "commslayer"


_ASK_NCCL = """
import torch.distributed as dist, commslayer.registration as r
r.install_routing() if {routed} else None
try:
    dist.init_process_group({backend!r}, store=dist.HashStore(), rank=0, world_size=1)
    print("made", dist.get_backend())
except RuntimeError as err:
    print("raised", err)
"""


@pytest.mark.skipif(dist.is_nccl_available(), reason="asks for NCCL where this torch has none")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl,cpu:gloo"])
def test_a_routed_job_that_asks_for_nccl_without_it_fails_as_plain_c10d_does(backend):
    said = [subprocess.run([sys.executable, "-c", _ASK_NCCL.format(routed=routed, backend=backend)],
                           capture_output=True, text=True, timeout=50).stdout for routed in (False, True)]
    assert said[0].startswith("raised Distributed package doesn't have NCCL built in"), said
    assert said[1] == said[0]


def _destroy_after_timeout(rank, size, store):
    import time

    import torch.distributed as dist

    import commslayer

    dist.init_process_group("commslayer", store=store, rank=rank, world_size=size)
    if rank == 1:
        time.sleep(3)
        return None
    try:
        dist.all_reduce(torch.ones(2))
        outcome = "completed"
    except commslayer.CollectiveTimeout as err:
        outcome = err.op
    pg = dist.group.WORLD
    start = time.monotonic()
    dist.destroy_process_group()
    pg.shutdown()  # a second teardown is a no-op
    pg.abort()
    return outcome, time.monotonic() - start


@pytest.mark.timeout(60)
def test_destroy_after_a_timeout_does_not_hang():
    outcome, took = run_ranks(_destroy_after_timeout, 2, timeout=30, env={"COMMSLAYER_TIMEOUT_S": "1"})[0]
    assert outcome == "all_reduce" and took < 1.0


def _functional_collectives(rank, size, store):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("commslayer", store=store, rank=rank, world_size=size)
    group = dist.group.WORLD
    calls = []
    group_of(group).communicator("cpu").register_pre_hook(lambda *args, **kwargs: calls.append(1))

    @torch.compile(backend="eager")
    def compiled(x):
        return funcol.all_reduce(x * 2, "sum", group) + 1

    eager = funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", group))
    seen_eager = len(calls)
    out = compiled(torch.ones(4))
    dist.destroy_process_group()
    return eager.tolist(), seen_eager, out.tolist(), len(calls) - seen_eager


@pytest.mark.timeout(120)
def test_functional_collectives_go_through_commslayer():
    """docs/api.md: functional collectives, eager and compiled, call the group's methods,
    so commslayer's hooks (and deadlines) see them; they do not bypass it (issue 41)."""
    for eager, seen_eager, out, seen_compiled in run_ranks(_functional_collectives, 2, timeout=100):
        assert eager == [2.0] * 4 and out == [5.0] * 4
        assert seen_eager == 1 and seen_compiled == 1, (seen_eager, seen_compiled)
