"""The plain FSDP2 script that launch/examples/fsdp2_resilient.py was made from: run with
``torchrun --nproc-per-node 2 launch/examples/fsdp2_plain.py``. Below this docstring the
two differ only in the lines the resilient one marks ``# commslayer``; tests/test_bugs.py
counts them and checks the count docs/training.md states, and that both print the same
losses under plain torchrun.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Samples:
    """An endless stream of (x, y) batches for one data-parallel rank, resumable by position."""

    def __init__(self, rank: int, batch: int, dim: int) -> None:
        self.rank, self.batch, self.dim, self.position = rank, batch, dim, 0
        self.target = torch.randn(dim, dim, generator=torch.Generator().manual_seed(1234))

    def next(self):
        g = torch.Generator().manual_seed(self.position * 1000 + self.rank)
        self.position += 1
        x = torch.randn(self.batch, self.dim, generator=g)
        return x, x @ self.target + 0.01 * torch.randn(self.batch, self.dim, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    data = Samples(dist.get_rank(), args.batch, args.dim)

    for step in range(args.steps):
        x, y = data.next()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        average = loss.detach() / dist.get_world_size()
        dist.all_reduce(average)
        sched.step()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step} loss {average.item():.6g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
