"""A plain torch.distributed job with no commslayer in it: FSDP2 on a 1-D
mesh (with a separate reduce-scatter group), DDP, and a few raw collectives.

Run by torchrun: ``train_fsdp2.py BACKEND OUT_PATH``.  Rank 0 saves the final
parameters of both models and the type of the world group, so a test can run
it on plain Gloo, on ``"commslayer"``, and on ``"gloo"`` with
``COMMSLAYER_ROUTE_C10D=1``, and compare the results bitwise.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from commslayer.c10d import group_of

STEPS = 5


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)])


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * step + rank))


def main() -> None:
    backend, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    fsdp = model(0)
    for block in fsdp:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp.set_separate_reduce_scatter_group(True)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = fsdp(batch(step, rank)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    fsdp_params = {k: v.full_tensor().clone() for k, v in fsdp.state_dict().items()}

    ddp = DistributedDataParallel(model(1))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    for step in range(STEPS):
        ddp(batch(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ddp_params = {k: v.clone() for k, v in ddp.module.state_dict().items()}

    sub = dist.new_group([0, 1])
    x = torch.tensor([float(rank)])
    if rank in (0, 1):
        dist.all_reduce(x, group=sub)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))

    # every name of a group the job can read, DDP's logging included
    names = {"backend": dist.get_backend(), "config": dist.get_backend_config(), "name": dist.group.WORLD.name(),
             "ddp": ddp._get_ddp_logging_data()["backend_name"], "sub": (dist.get_backend(sub), sub.name())
             if rank in (0, 1) else None}
    if rank == 0:
        torch.save({"names": names, "fsdp": fsdp_params, "ddp": ddp_params, "world_type": "commslayer" if group_of(dist.group.WORLD) else "ProcessGroup",
                    "backend": dist.get_backend(), "sub": x.item(), "gathered": torch.cat(gathered),
                    # whether commslayer's recorder watched this run (started from the environment)
                    "recording": getattr(sys.modules.get("tracing.record.recorder"), "recorder", lambda: None)() is not None},
                   out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's Gloo worker threads can still be freeing an op's tensors when the
    # interpreter finalizes, which aborts the process (plain Gloo too; docs/api.md,
    # "Known limits"). The results are saved: leave without running finalizers.
    sys.stdout.flush()
    os._exit(0)
