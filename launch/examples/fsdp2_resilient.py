"""An FSDP2 training script made resilient with commslayer: the lines marked ``# commslayer``
are the whole change from the plain torchrun script it was (docs/training.md shows the diff).

    commslayer-run --replicas 2 --nproc-per-replica 2 launch/examples/fsdp2_resilient.py --steps 40
    torchrun --nproc-per-node 2 launch/examples/fsdp2_resilient.py      # also runs, as one replica group

A small MLP learns a fixed random linear map from noisy samples. The data
stream is the user's own object with a position (``state_dict``), and so is
the learning-rate schedule: both are registered and heal with the model.
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from commslayer import resilience  # commslayer


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

    job = resilience.init()  # commslayer: instead of init_process_group + init_device_mesh
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=job.mesh)  # commslayer
    fully_shard(model, mesh=job.mesh)  # commslayer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    data = Samples(job.member, args.batch, args.dim)  # commslayer: this rank's place in the whole job
    job.register(model=model, optimizer=opt, scheduler=sched, data=data)  # commslayer

    for step in job.steps(args.steps):  # commslayer: instead of range(args.steps)
        x, y = data.next()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        committed = job.step(loss)  # commslayer: instead of opt.step(); opt.zero_grad(); all_reduce(loss)
        sched.step()
        if committed and job.reports and step % 10 == 0:  # commslayer
            print(f"step {step} loss {job.losses[step]:.6g}", flush=True)  # commslayer
    job.finish()  # commslayer


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
