"""A small decoder-only transformer trained with FSDP2 on commslayer.

Run by torchrun (``./launch/demo.sh`` does it for you).  The data is
synthetic and deterministic: the batch of (step, rank) comes from a
generator seeded by both, so any step can be replayed.  Every collective FSDP2
issues goes through commslayer (``init_process_group("commslayer")``); a
pre-hook counts them, and the run ends with a summary of what was sent.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commslayer  # noqa: F401  (registers the "commslayer" backend)
import fsdp_overlap


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int, rank: int, batch_size: int, seq: int, vocab: int) -> torch.Tensor:
    """Deterministic tokens for (step, rank): a noisy counting sequence the model can learn."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch_size, seq + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--overlap", action="store_true",
                   help="reduce-scatter on its own communicator, overlapping all-gather (fsdp_overlap)")
    p.add_argument("--rs-interface", help="with --overlap: the network interface for reduce-scatter")
    args = p.parse_args()

    dist.init_process_group("commslayer")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = dist.group.WORLD.communicator("cpu")
    ops = collections.Counter()
    comm.register_pre_hook(lambda name, op_id, op_args: ops.update([name]))

    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.overlap:
        fsdp_overlap.enable(model, interface=args.rs_interface)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = time.perf_counter()
    step_s = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        data = batch(step, rank, args.batch, args.seq, args.vocab)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        comm.all_reduce(mean_loss, commslayer.ReduceOp.AVG)
        step_s.append(time.perf_counter() - t0)
        tokens_s = world * args.batch * args.seq / step_s[-1]
        if rank == 0:
            print(f"step {step:4d}  loss {mean_loss.item():.4f}  tokens/s {tokens_s:8.0f}  ranks {world}", flush=True)

    elapsed = time.perf_counter() - start
    if rank == 0:
        sent = ", ".join(f"{n} {name}" for name, n in sorted(ops.items()))
        print(f"done: {args.steps} steps in {elapsed:.1f}s on {world} ranks through commslayer "
              f"({comm.get_backend()}); rank 0 issued {sent}", flush=True)
        print("RESULT " + json.dumps({"steps": args.steps, "elapsed_s": elapsed, "step_s": step_s}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
