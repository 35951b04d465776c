"""A small decoder-only transformer trained with HSDP on commslayer, surviving the loss of a replica group.

Run by torchrun, one torchrun per replica group (``commslayer-run`` starts
them and the coordinator; ``./launch/demo.sh`` does it all).  It uses only
the public resilience API (``commslayer.resilience``), as a user's script
would: each replica group shards the model over its own ranks with FSDP2
(``fully_shard`` per block on ``job.mesh``); the groups are replicas of each
other and ``job.step`` averages their gradients: every step is committed on
every live replica, a dead replica group is restarted by its torchrun, heals
from a live one and rejoins at a step boundary.

Why not FSDP2's own HSDP mesh: a DeviceMesh's groups are fixed when it is
built, and the replicate dimension must change its members; an error inside
FSDP2's backward hooks would also leave its state half-done.  So FSDP2 owns
the shard dimension, and each FSDP module's reduce-scatter output is averaged
across replicas as backward produces it (``commslayer.train.gradients``, through
FSDP2's all-reduce hook), committed by ``job.step``.

The data is synthetic and deterministic: the batch of (step, replica, rank)
comes from a generator seeded by all three, so any step can be replayed and
a healed replica continues at the survivors' step.  Without the launcher
(plain ``torchrun train.py``) the job is one replica group.

``--kill R:STEP:PHASE[:RANK]`` SIGKILLs rank RANK (default 0) of replica
group R at STEP (or the first step after it at which every replica group is
live and healed), during ``forward``, ``backward``, ``allreduce`` (entering the gradient
average) or ``optimizer`` (after the step was committed); each fault fires
once per job; one naming a group, rank or step the job does not have stops it.  The fault harness (``commslayer-faults``) fires its step faults
at the same points (the API's phase hooks), under the same rule
(``faults.inject.fault_window``).  ``--plain`` runs the same job on plain Gloo groups
without any of it (``launch/plain.py``), the baseline of ``launch/bench/bench_training.py``.
"""

from __future__ import annotations

import argparse
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import fsdp_overlap
import plain
from commslayer import config, resilience
from commslayer.errors import InvalidArgument
from faults.inject import PHASES, Fault, injector, install


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


def batch(step: int, replica: int, rank: int, batch_size: int, seq: int, vocab: int) -> torch.Tensor:
    """Deterministic tokens for (step, replica, rank): a noisy counting sequence the model can learn."""
    g = torch.Generator().manual_seed((1_000_003 * step + 1_009 * replica + rank) % (2 ** 63))
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    noise = torch.rand(batch_size, seq + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)


def kill_faults(specs: List[str], replicas: int, shards: int, steps: int) -> List[Fault]:
    """``--kill R:STEP:PHASE[:RANK]`` as faults (SIGKILL, once per job, whichever life gets there),
    for a job of ``replicas`` groups of ``shards`` ranks that runs ``steps`` steps: one that names
    a group, rank or step the job does not have is ``InvalidArgument`` (on every rank: the job
    stops), where it would never fire."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        try:
            replica, step, rank = int(parts[0]), int(parts[1]), int(parts[3] if len(parts) == 4 else 0)
        except (ValueError, IndexError):
            replica = step = rank = -1
        if len(parts) not in (3, 4) or parts[2] not in PHASES or min(replica, step, rank) < 0:
            raise InvalidArgument(f"--kill {spec!r}: expected REPLICA:STEP:PHASE[:RANK], whole numbers and PHASE "
                                  f"one of {PHASES}", op="--kill")
        for what, value, bound in (("replica group", replica, replicas), ("rank", rank, shards),
                                   ("step", step, steps)):
            if value >= bound:
                raise InvalidArgument(f"--kill {spec!r}: {what} {value}, but the job has {bound} ({what}s 0 to "
                                      f"{bound - 1})", op="--kill")
        out.append(Fault("sigkill", replica * shards + rank, life=None, step=step, phase=parts[2]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", action="append", default=[], metavar="R:STEP:PHASE[:RANK]")
    p.add_argument("--run-dir", default=config.run_dir(),
                   help="write this rank's result (losses, recoveries, fingerprints) here (default: $COMMSLAYER_RUN_DIR)")
    p.add_argument("--heal-timeout", type=float, default=120.0,
                   help="at the end, wait this long for restarted replica groups to rejoin")
    p.add_argument("--plain", action="store_true", help="plain Gloo groups, no resilience (the baseline: plain.py)")
    p.add_argument("--bucket-mb", type=float, default=4.0,
                   help="gradients averaged after backward go in buckets of this size (resilience.init)")
    p.add_argument("--overlap", action="store_true",
                   help="reduce-scatter on its own communicator, overlapping all-gather (fsdp_overlap)")
    p.add_argument("--rs-interface", help="with --overlap: the network interface for reduce-scatter")
    p.add_argument("--check-kill", metavar="REPLICASxRANKS",
                   help="only check --kill against a job of that shape (2x2) and exit: 0 if it fires, 2 if not")
    args = p.parse_args()
    if args.check_kill:
        replicas, _, ranks = args.check_kill.partition("x")
        if not (replicas.isdigit() and ranks.isdigit()):
            p.error(f"--check-kill {args.check_kill!r}: expected REPLICASxRANKS, such as 2x2")
        try:
            kill_faults(args.kill, int(replicas), int(ranks), args.steps)
        except InvalidArgument as exc:
            p.exit(2, f"{exc.what}\n")
        return

    job = (plain.init(run_dir=args.run_dir) if args.plain else
           resilience.init(run_dir=args.run_dir, heal_timeout_s=args.heal_timeout, bucket_mb=args.bucket_mb))
    if args.kill:
        injector().add(kill_faults(args.kill, job.replicas, job.world_size, args.steps))
        install()
    model = build(args, job.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    job.register(model=model, optimizer=opt)
    for step in job.steps(args.steps):
        data = batch(step, job.replica, job.rank, args.batch, args.seq, args.vocab)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        loss.backward()
        job.step(loss)
        if job.reports:
            live = len(job.live_replicas)
            tokens = live * job.world_size * args.batch * args.seq / job.step_s[-1]
            print(f"step {step:4d}  loss {job.losses[step]:.4f}  tokens/s {tokens:8.0f}  replicas "
                  f"{live}/{job.replicas}  generation {job.generation}", flush=True)
    job.finish()


def build(args: argparse.Namespace, mesh) -> nn.Module:
    """The model, sharded over this replica group's mesh; the same initial values on
    every rank of every group (one seed)."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.overlap:
        fsdp_overlap.enable(model, interface=args.rs_interface)
    return model


if __name__ == "__main__":
    main()
