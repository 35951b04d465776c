"""An ordinary torch.distributed job with no commslayer in it, for 2 ranks: every
collective and point-to-point op (sync and async), the collectives on tensors that
are not contiguous, coalescing blocks, object collectives, new_group/new_subgroups,
a 2-D DeviceMesh, FSDP2 as HSDP on it, DDP with a comm hook and its logging data,
monitored_barrier, and timeouts per group and per op.

Run by torchrun: ``c10d_compat_job.py OUT_PREFIX``.  Each rank saves what it
saw (results, and what the job can read about its groups, works and errors)
to ``OUT_PREFIX.<rank>.pt``, so that a test can run it on plain Gloo and with
``COMMSLAYER_ROUTE_C10D=1`` and compare the two runs bitwise.
"""

import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

# DDP's logging fields that time the run or name the host: they differ between any two runs
_RUN_DEPENDENT = ("time", "avg_", "host", "master_", "cuda_visible", "nccl_")


def outcome(call: Callable[[], Any]) -> Any:
    """What a call gave, or the error classes (torch's own) and how long it took to raise."""
    began = time.monotonic()
    try:
        return ("ok", call())
    except Exception as err:  # compared between the runs
        torch_classes = [c.__name__ for c in type(err).__mro__ if c.__module__.startswith(("torch", "builtins"))]
        return ("raised", torch_classes, round(time.monotonic() - began))


def work_state(work: Any) -> Dict[str, Any]:
    """What a job can read from a finished c10d work (or the future some calls return)."""
    work.wait()
    facts: Dict[str, Any] = {"kind": "Work" if isinstance(work, dist.Work) else type(work).__name__}
    for name in ("is_completed", "is_success", "exception", "result", "done", "value"):
        facts[name] = outcome(lambda: getattr(work, name)())
    facts["future"] = outcome(lambda: work.get_future().done())
    return facts


def collectives(group: Any, rank: int, world: int, async_op: bool) -> Dict[str, Any]:
    seen: Dict[str, Any] = {}

    def run(name: str, work: Any, result: Any) -> None:
        seen[name] = (work_state(work) if async_op else work is None, result)

    x = torch.arange(6.0) * (rank + 1)
    run("all_reduce", dist.all_reduce(x, group=group, async_op=async_op), x)
    y = torch.arange(4, dtype=torch.int64) + rank
    run("all_reduce max", dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group, async_op=async_op), y)
    outs = [torch.zeros(3) for _ in range(world)]
    run("all_gather", dist.all_gather(outs, torch.full((3,), rank + 0.5), group=group, async_op=async_op), outs)
    flat = torch.zeros(3 * world)
    run("all_gather_into_tensor", dist.all_gather_into_tensor(flat, torch.full((3,), rank + 1.5), group=group,
                                                               async_op=async_op), flat)
    out = torch.zeros(2)
    run("reduce_scatter", dist.reduce_scatter(out, [torch.full((2,), r + rank * 10.0) for r in range(world)],
                                              group=group, async_op=async_op), out)
    out2 = torch.zeros(2)
    run("reduce_scatter_tensor", dist.reduce_scatter_tensor(out2, torch.arange(2.0 * world) + rank, group=group,
                                                            async_op=async_op), out2)
    a2a = torch.zeros(world * 2)
    run("all_to_all_single", dist.all_to_all_single(a2a, torch.arange(world * 2.0) + 10 * rank, group=group,
                                                    async_op=async_op), a2a)
    splits_in = [1 + r for r in range(world)]
    splits_out = [1 + rank] * world
    uneven = torch.zeros(sum(splits_out))
    run("all_to_all_single uneven", dist.all_to_all_single(uneven, torch.arange(float(sum(splits_in))) + rank,
                                                           splits_out, splits_in, group=group,
                                                           async_op=async_op), uneven)
    lists = [torch.zeros(2) for _ in range(world)]
    if not async_op:  # a list all-to-all: Gloo's group may refuse it, and then both must
        seen["all_to_all"] = outcome(lambda: dist.all_to_all(
            lists, [torch.full((2,), 10.0 * rank + j) for j in range(world)], group=group)), lists
    b = torch.full((3,), float(rank))
    run("broadcast", dist.broadcast(b, src=1, group=group, async_op=async_op), b)
    r = torch.full((3,), rank + 2.0)
    run("reduce", dist.reduce(r, dst=0, group=group, async_op=async_op), r if rank == 0 else None)
    g = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    run("gather", dist.gather(torch.full((2,), rank * 3.0), g, dst=0, group=group, async_op=async_op), g)
    s = torch.zeros(2)
    run("scatter", dist.scatter(s, [torch.full((2,), 7.0 + i) for i in range(world)] if rank == 1 else None,
                                src=1, group=group, async_op=async_op), s)
    run("barrier", dist.barrier(group=group, async_op=async_op), None)
    co = [torch.ones(2) * (rank + 1), torch.arange(3.0)]
    run("all_reduce_coalesced", dist.all_reduce_coalesced(co, group=group, async_op=async_op), co)
    return seen


def strided(rank: int, rows: int = 4, cols: int = 3, scale: float = 1.0) -> torch.Tensor:
    """A rows x cols view that is not contiguous (a transposed block), with rank-dependent values."""
    return ((torch.arange(rows * cols, dtype=torch.float32) + 1) * scale * (rank + 1)).reshape(cols, rows).t()


def non_contiguous(group: Any, rank: int, world: int, async_op: bool) -> Dict[str, Any]:
    """Every collective that plain Gloo runs on tensors that are not contiguous, on such
    tensors: what each wrote into them, seen through the views and in storage order.
    (Gloo refuses them for send, recv and all_to_all_single, as commslayer does.)"""
    seen: Dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any], written: List[torch.Tensor]) -> None:
        got = outcome(call)
        state = work_state(got[1]) if async_op and got[0] == "ok" else got
        if name == "reduce" and rank != 0 and isinstance(state, dict):
            del state["result"]  # what Gloo left in a non-root's tensor depends on timing
        seen[name] = (state, [t.clone() for t in written], [t.t().contiguous() for t in written if t.dim() == 2])

    x = strided(rank)
    run("all_reduce", lambda: dist.all_reduce(x, group=group, async_op=async_op), [x])
    shared = torch.ones(1).expand(4)  # its elements share memory: commslayer refuses it (docs/api.md)
    run("all_reduce expanded", lambda: dist.all_reduce(shared, group=group, async_op=async_op), [])
    b = strided(rank)
    run("broadcast", lambda: dist.broadcast(b, src=1, group=group, async_op=async_op), [b])
    r = strided(rank)
    run("reduce", lambda: dist.reduce(r, dst=0, group=group, async_op=async_op), [r] if rank == 0 else [])
    outs = [strided(0, scale=0.0) for _ in range(world)]
    run("all_gather", lambda: dist.all_gather(outs, strided(rank), group=group, async_op=async_op), outs)
    flat = torch.zeros(3, 4 * world).t()
    run("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(flat, strided(rank), group=group,
                                                                         async_op=async_op), [flat])
    shard = strided(0, scale=0.0)
    run("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(shard, strided(rank, rows=4 * world),
                                                                       group=group, async_op=async_op), [shard])
    g = [strided(0, scale=0.0) for _ in range(world)] if rank == 0 else None
    run("gather", lambda: dist.gather(strided(rank), g, dst=0, group=group, async_op=async_op), g or [])
    s = strided(0, scale=0.0)
    run("scatter", lambda: dist.scatter(s, [strided(i, scale=7.0) for i in range(world)] if rank == 1 else None,
                                        src=1, group=group, async_op=async_op), [s])
    return seen


def point_to_point(group: Any, rank: int) -> Dict[str, Any]:
    peer = 1 - rank
    out: Dict[str, Any] = {}
    t = torch.zeros(4)
    if rank == 0:
        dist.send(torch.arange(4.0), peer, group=group)
    else:
        out["recv"] = (dist.recv(t, peer, group=group), t.clone())
    t = torch.zeros(4)
    if rank == 1:
        dist.send(torch.arange(4.0) * 2, peer, group=group, tag=5)
    else:
        out["recv any"] = (dist.recv(t, group=group, tag=5), t.clone())
    got = torch.zeros(3)
    sent = dist.isend(torch.full((3,), rank + 9.0), peer, group=group)
    received = dist.irecv(got, peer, group=group)
    out["isend"] = work_state(sent)
    out["irecv"] = (work_state(received), got)
    got2 = torch.zeros(5)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(5.0) + rank, peer, group),
                                    dist.P2POp(dist.irecv, got2, peer, group)])
    out["batch"] = ([work_state(w) for w in works], got2)
    return out


def coalesced(group: Any, rank: int) -> Dict[str, Any]:
    """``_coalescing_manager`` blocks, sync and async (the manager's work)."""
    out: Dict[str, Any] = {}
    for async_ops in (False, True):
        ts = [torch.ones(2) * (rank + 1), torch.arange(3.0) * (rank + 2)]
        with dist._coalescing_manager(group=group, async_ops=async_ops) as manager:
            for t in ts:
                dist.all_reduce(t, group=group)
        if async_ops:
            manager.wait()
        out[f"all_reduce async={async_ops}"] = ts
    return out


def objects(group: Any, rank: int, world: int) -> Dict[str, Any]:
    """Object collectives; each one's outcome (torch turns the bytes back into objects
    through numpy: without numpy every receiving call raises, after its ops ran)."""
    out: Dict[str, Any] = {}
    gathered: List[Any] = [None] * world
    out["all_gather_object"] = outcome(
        lambda: dist.all_gather_object(gathered, {"rank": rank, "x": [rank] * (rank + 1)}, group=group)), gathered
    objs: List[Any] = [f"from {rank}", rank * 2] if rank == 1 else [None, None]
    out["broadcast_object_list"] = outcome(lambda: dist.broadcast_object_list(objs, src=1, group=group)), objs
    into: Any = [None] * world if rank == 0 else None
    out["gather_object"] = outcome(lambda: dist.gather_object(("g", rank), into, dst=0, group=group)), into
    got: List[Any] = [None]
    out["scatter_object_list"] = outcome(lambda: dist.scatter_object_list(
        got, [{"to": i} for i in range(world)] if rank == 0 else None, src=0, group=group)), got
    received: List[Any] = [None, None]
    out["send_object_list"] = outcome(lambda: dist.send_object_list([{"a": 1}, "b"], dst=1, group=group)
                                      if rank == 0 else dist.recv_object_list(received, src=0, group=group)), received
    return out


def group_facts(group: Any) -> Dict[str, Any]:
    """What a job can read about a group."""
    return {"rank": dist.get_rank(group), "size": dist.get_world_size(group), "backend": dist.get_backend(group),
            "ranks": dist.get_process_group_ranks(group), "config": dist.get_backend_config(group),
            "name": group.name(), "group_name": group.group_name, "group_desc": group.group_desc,
            "bound_device": group.bound_device_id, "size()": group.size(), "rank()": group.rank()}


def groups(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    pair = dist.new_group([0, 1])
    out["new_group"] = group_facts(pair)
    out["new_group ops"] = collectives(pair, rank, world, False)["all_reduce"]
    mine, subgroups = dist.new_subgroups(group_size=1)
    out["new_subgroups"] = (group_facts(mine), len(subgroups))
    t = torch.full((2,), rank + 1.0)
    dist.all_reduce(t, group=mine)
    out["subgroup all_reduce"] = t
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    out["mesh"] = {dim: group_facts(mesh.get_group(dim)) for dim in ("dp", "tp")}
    out["mesh coords"] = (mesh.get_coordinate(), mesh.size(), mesh.ndim, mesh["dp"].size())
    for dim in ("dp", "tp"):
        t = torch.arange(3.0) + rank
        dist.all_reduce(t, group=mesh.get_group(dim))
        out[f"mesh {dim} all_reduce"] = t
    out["hsdp"] = hsdp(init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")), rank)
    return out


def hsdp(mesh: Any, rank: int) -> List[torch.Tensor]:
    """FSDP2 as HSDP (replicate x shard) for 2 steps: each rank's local parameter shards."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.to_local().detach().clone() for p in model.parameters()]


def ddp(rank: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    logging = model._get_ddp_logging_data()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "logging": {k: v for k, v in logging.items() if not any(s in k for s in _RUN_DEPENDENT)}}


def timeouts(rank: int, store: Any) -> Dict[str, Any]:
    """A group with a 1 s timeout, and a 1 s wait on an op of a group with a long one:
    rank 1 never joins the ops, then waits until rank 0 has seen both end."""
    out: Dict[str, Any] = {}
    short = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    long = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    if rank == 0:
        out["group timeout"] = outcome(lambda: dist.all_reduce(torch.ones(2), group=short))
        work = dist.irecv(torch.zeros(2), 1, group=long)
        out["op timeout"] = outcome(lambda: work.wait(timedelta(seconds=1)))
        store.set("compat/timeouts done", "1")
    else:
        store.wait(["compat/timeouts done"], timedelta(seconds=60))
    return out


def main() -> None:
    out_prefix = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    world_group = dist.group.WORLD
    result: Dict[str, Any] = {"world": group_facts(world_group)}
    result["default timeout"] = dist.distributed_c10d._get_default_timeout("gloo")
    for async_op in (False, True):
        result[f"collectives async={async_op}"] = collectives(world_group, rank, world, async_op)
        result[f"non-contiguous async={async_op}"] = non_contiguous(world_group, rank, world, async_op)
    result["p2p"] = point_to_point(world_group, rank)
    result["coalesced"] = coalesced(world_group, rank)
    result["objects"] = objects(world_group, rank, world)
    result["groups"] = groups(rank, world)
    result["ddp"] = ddp(rank)
    result["monitored_barrier"] = outcome(lambda: dist.monitored_barrier(timeout=timedelta(seconds=10)))
    store = dist.distributed_c10d._get_default_store()
    result["timeouts"] = timeouts(rank, store)
    torch.save(result, f"{out_prefix}.{rank}.pt")
    sys.stdout.flush()
    os._exit(0)  # groups whose ops timed out cannot be torn down cleanly, on either backend


if __name__ == "__main__":
    main()
