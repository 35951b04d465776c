"""A DDP training script made resilient with commslayer: the lines marked ``# commslayer``
are the whole change from the plain torchrun script it was (docs/training.md shows the diff).

    commslayer-run --replicas 2 --nproc-per-replica 2 launch/examples/ddp_resilient.py --steps 40
    torchrun --nproc-per-node 2 launch/examples/ddp_resilient.py        # also runs, as one replica group

A small CNN classifies synthetic 8x8 "images" (which quadrant holds a bright
blob). DDP averages gradients inside a replica group; commslayer averages
them across groups. The RNG that draws the data is the user's state and
heals with the model.
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from commslayer import resilience  # commslayer


class Blobs:
    """Batches of 1x8x8 images with a blob in one quadrant, labelled by the quadrant."""

    def __init__(self, seed: int, batch: int) -> None:
        self.batch = batch
        self.rng = torch.Generator().manual_seed(seed)

    def next(self):
        labels = torch.randint(0, 4, (self.batch,), generator=self.rng)
        images = 0.1 * torch.randn(self.batch, 1, 8, 8, generator=self.rng)
        for i, q in enumerate(labels.tolist()):
            r, c = divmod(q, 2)
            images[i, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 1.0
        return images, labels

    def state_dict(self):
        return {"rng": self.rng.get_state()}

    def load_state_dict(self, state):
        self.rng.set_state(state["rng"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()

    job = resilience.init()  # commslayer: instead of init_process_group
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(8 * 4 * 4, 4))
    model = DistributedDataParallel(net, process_group=job.process_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = Blobs(seed=job.replica * job.world_size + job.rank, batch=args.batch)
    job.register(model=model, optimizer=opt, data=data)  # commslayer

    for step in job.steps(args.steps):  # commslayer: instead of range(args.steps)
        images, labels = data.next()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        job.step(loss)  # commslayer: instead of opt.step(); opt.zero_grad()
        if job.reports and step % 10 == 0:
            print(f"step {step} loss {job.losses[step]:.4f} replicas {job.live_replicas}", flush=True)
    job.finish()  # commslayer


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
