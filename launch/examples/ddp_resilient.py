"""A DDP training script made resilient with commslayer: the lines marked ``# commslayer``
are the whole change from the plain torchrun script it was (docs/training.md shows the diff).

    commslayer-run --replicas 2 --nproc-per-replica 2 launch/examples/ddp_resilient.py --steps 40
    torchrun --nproc-per-node 2 launch/examples/ddp_resilient.py        # also runs, as one replica group

A small CNN classifies synthetic 8x8 "images" (which quadrant holds a bright
blob). DDP averages gradients inside a replica group; commslayer averages
them across groups. The data stream's position is the user's state and
heals with the model.
"""

import argparse
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from commslayer import resilience  # commslayer


class Blobs:
    """Batches of 1x8x8 images with a blob in one quadrant, labelled by the quadrant. The
    batch drawn depends on the stream (one per data-parallel rank) and the position,
    and only the position is state: it is the same on every replica, so a healed
    replica continues its own stream where the others are."""

    def __init__(self, stream: int, batch: int) -> None:
        self.stream, self.batch, self.position = stream, batch, 0

    def next(self):
        rng = torch.Generator().manual_seed(self.position * 1_000_003 + self.stream)
        self.position += 1
        labels = torch.randint(0, 4, (self.batch,), generator=rng)
        images = 0.1 * torch.randn(self.batch, 1, 8, 8, generator=rng)
        for i, q in enumerate(labels.tolist()):
            r, c = divmod(q, 2)
            images[i, 0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] += 1.0
        return images, labels

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Blobs(stream=job.replica * job.world_size + job.rank, batch=args.batch)
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
