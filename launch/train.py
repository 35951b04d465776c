"""A small decoder-only transformer trained with HSDP on commslayer, surviving the loss of a replica group.

Run by torchrun, one torchrun per replica group (``launch/run.py`` starts
them and the coordinator; ``./launch/demo.sh`` does it all).  Each replica
group shards the model over its own ranks with FSDP2 (``fully_shard`` per
block, on the group's process group, through the ``"commslayer"`` backend);
the groups are replicas of each other and average their gradients over the
resilient replicate dimension (``commslayer.replicas``): every step is
committed on every live replica or redone on the survivors, a dead replica
group is restarted by its torchrun, heals from a live one and rejoins at a
step boundary.

Why not FSDP2's own HSDP mesh: a DeviceMesh's groups are fixed when it is
built, and the replicate dimension must change its members; an error inside
FSDP2's backward hooks would also leave its state half-done.  So FSDP2 owns
the shard dimension and the gradients of the sharded parameters are averaged
across replicas after backward, in one op per step.

The data is synthetic and deterministic: the batch of (step, replica, rank)
comes from a generator seeded by all three, so any step can be replayed and
a healed replica continues at the survivors' step.  Without the launcher
(plain ``torchrun train.py``) the job is one replica group.

``--kill R:STEP:PHASE[:RANK]`` SIGKILLs rank RANK (default 0) of replica
group R at STEP (or the first step after it at which every replica group is
live and healed), during ``forward``, ``backward``, ``allreduce`` (entering the gradient
average) or ``optimizer`` (after the step was committed); each fault fires
once per job.  The fault harness (``commslayer-faults``) fires its step faults
at the same points, under the same rule (``faults.inject``).  ``--plain`` runs the same job on plain Gloo groups
without any of it, the baseline of ``launch/bench_training.py``.
"""

from __future__ import annotations

import os
import time

_STARTED = time.time()  # wall clock: the fault harness tells which processes lived through a fault
# Tracing starts when torch is imported (COMMSLAYER_TRACE_DIR): this process's rank in the job
# (its member id) names its trace files and shifts its torchrun's ranks; keep a restarted group's traces apart from those of the run it replaces.
_REPLICA = int(os.environ.get("COMMSLAYER_REPLICA", "0"))
_RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
_MEMBER = _REPLICA * int(os.environ.get("WORLD_SIZE", "1")) + int(os.environ.get("RANK", "0"))
os.environ.setdefault("COMMSLAYER_JOB_RANK", str(_MEMBER))
if os.environ.get("COMMSLAYER_TRACE_DIR") and _RESTART:
    os.environ["COMMSLAYER_TRACE_DIR"] = os.path.join(os.environ["COMMSLAYER_TRACE_DIR"],
                                                      f"replica{_REPLICA}-restart{_RESTART}")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Callable, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import commslayer  # noqa: E402
import fsdp_overlap  # noqa: E402
from commslayer.errors import first_line  # noqa: E402
from commslayer.replicas import ReplicaBroken, Replicas, flatten, unflatten  # noqa: E402
from commslayer.store import bounded  # noqa: E402
from faults.inject import PHASES, Fault, injector  # noqa: E402


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


def optimizer_state(opt: torch.optim.Optimizer, params: List[nn.Parameter]) -> List[torch.Tensor]:
    """AdamW's state, created now rather than at the first step, so that a restarted
    replica has tensors to heal into: [step, exp_avg, exp_avg_sq] per parameter."""
    out = []
    for p in params:
        state = opt.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        out += [state["step"], _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard of a DTensor that this rank holds (a view: writes go through)."""
    return t.to_local() if hasattr(t, "to_local") else t


def kill_faults(specs: List[str], shards: int) -> List[Fault]:
    """``--kill R:STEP:PHASE[:RANK]`` as faults (SIGKILL, once per job, whichever life gets there)."""
    out = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (3, 4) or parts[2] not in PHASES:
            raise SystemExit(f"--kill {spec!r}: expected REPLICA:STEP:PHASE[:RANK], PHASE one of {PHASES}")
        rank = int(parts[0]) * shards + int(parts[3] if len(parts) == 4 else 0)
        out.append(Fault("sigkill", rank, life=None, step=int(parts[1]), phase=parts[2]))
    return out


def fault_window(rep: Optional[Replicas], replicas: int, step: int, healed_at: int, store: dist.Store) -> bool:
    """Whether a step fault may fire at ``step``: every replica group live, each
    committed a step since it last came back (with one group healing and the other one
    killed, no copy of the state would be left), and no other fault fired in this
    generation (faults of two groups in one step would leave no copy either)."""
    if rep is None or len(rep.live) < replicas or step <= max([healed_at] + [a.step for a in rep.admissions]):
        return False
    return store.add(f"faults/generation/{rep.generation}", 1) == 1


def job_store(timeout: timedelta) -> Tuple[dist.Store, int, int]:
    """The coordinator's store (``COMMSLAYER_JOB_STORE`` host:port) with this job's
    replica id and count; without a launcher, this torchrun's store as one replica."""
    address = os.environ.get("COMMSLAYER_JOB_STORE")
    if not address:
        return bounded(dist.distributed_c10d._get_default_store(), f"job{_RESTART}/"), 0, 1
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=True)
    return bounded(store), _REPLICA, int(os.environ["COMMSLAYER_REPLICAS"])


def replica_store(timeout: timedelta) -> dist.Store:
    """This replica group's store (torchrun's), under a per-restart prefix: a restarted
    group must not read the addresses its previous incarnation left there."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout, use_libuv=True)
    return dist.PrefixStore(f"restart{_RESTART}/", store)


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
    p.add_argument("--run-dir", help="write this rank's result (losses, recoveries, fingerprints) here")
    p.add_argument("--heal-timeout", type=float, default=120.0,
                   help="at the end, wait this long for restarted replica groups to rejoin")
    p.add_argument("--plain", action="store_true", help="plain Gloo groups, no resilience (the baseline)")
    p.add_argument("--overlap", action="store_true",
                   help="reduce-scatter on its own communicator, overlapping all-gather (fsdp_overlap)")
    p.add_argument("--rs-interface", help="with --overlap: the network interface for reduce-scatter")
    args = p.parse_args()

    timeout = timedelta(seconds=60)
    rank, shards = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo" if args.plain else "commslayer", store=replica_store(timeout),
                            rank=rank, world_size=shards, timeout=timeout)
    store, replica, replicas = job_store(timeout)
    faults = injector()
    faults.add(kill_faults(args.kill, shards))

    def point(phase: str) -> None:
        faults.point(step, phase, lambda: fault_window(rep, replicas, step, start_step if _RESTART else -1, store))

    model, opt = build(args, shards)
    params = list(model.parameters())
    state = [_local(q) for q in params] + optimizer_state(opt, params)
    opt.register_step_pre_hook(lambda *_: point("optimizer"))
    model.blocks[-1].register_forward_pre_hook(lambda *_: point("forward"))

    if args.plain:
        average, rep = plain_average(store, replica, replicas, rank, shards, timeout), None
        start_step = 0
    else:
        if _RESTART > 0 and store.check(["job/finished"]):
            print(f"[replica {replica} rank {rank}] the job finished while this group restarted", flush=True)
            finish(0)
        rep = Replicas(replica=replica, replicas=replicas, shard=rank, shards=shards, store=store,
                       rejoin=_RESTART > 0, timeout=timeout)
        start_step = rep.heal(state) if _RESTART > 0 else 0
        if _RESTART > 0 and rank == 0:
            print(f"[replica {replica}] restarted (restart {_RESTART}): healed from a live replica, "
                  f"continuing at step {start_step} in generation {rep.generation}", flush=True)
        average = rep.average

    losses: Dict[int, float] = {}
    step_s: List[float] = []
    begin = time.perf_counter()
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        if rep is not None:
            admitted = rep.admit(state, step)
            if admitted and rep.member == min(m for m in rep.world.members if m // shards not in admitted):
                report_admission(rep, step, store)  # by the first survivor
        data = batch(step, replica, rank, args.batch, args.seq, args.vocab)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        logits.register_hook(lambda g: (point("backward"), g)[1])
        loss.backward()
        grads = [_local(q.grad) for q in params]
        mean_loss = loss.detach().reshape(1) / shards
        dist.all_reduce(mean_loss)
        point("allreduce")
        averaged = average(torch.cat([flatten(grads), mean_loss]), step)
        unflatten(averaged[:-1], grads)
        opt.step()
        opt.zero_grad()
        losses[step] = averaged[-1].item()
        step_s.append(time.perf_counter() - t0)
        reports = (rank, replica) == (0, 0) if rep is None else rep.world.get_rank() == 0
        if reports:
            live = replicas if rep is None else len(rep.live)
            gen = "-" if rep is None else rep.generation
            tokens = live * shards * args.batch * args.seq / step_s[-1]
            print(f"step {step:4d}  loss {losses[step]:.4f}  tokens/s {tokens:8.0f}  replicas {live}/{replicas}"
                  f"  generation {gen}", flush=True)
            if rep is not None:
                report_recovery(rep, step, store)
    elapsed = time.perf_counter() - begin

    result = {"member": _MEMBER, "replica": replica, "rank": rank, "restart": _RESTART, "pid": os.getpid(),
              "started": _STARTED, "steps": args.steps,
              "start_step": start_step, "elapsed_s": elapsed, "step_s": step_s, "losses": losses,
              "optimizer_steps": [int(opt.state[q]["step"]) for q in params], "live": list(range(replicas)),
              "fingerprints": None, "recoveries": [], "admissions": []}
    if rep is not None:
        rep.wait_for(state, args.steps, lambda r: store.check([f"replica/{r}/gone"]), args.heal_timeout)
        result.update(generation=rep.generation, live=rep.live, fingerprints=compare_replicas(rep, state),
                      recoveries=[vars(r) for r in rep.recoveries], admissions=[vars(a) for a in rep.admissions])
        if rep.world.get_rank() == 0 and step_s:
            print(f"done: steps {start_step}..{args.steps - 1} in {elapsed:.1f}s, {len(rep.recoveries)} "
                  f"recoveries, {len(rep.admissions)} admissions, replicas {rep.live}/{replicas} live at the end, "
                  f"generation {rep.generation}", flush=True)
        store.set("job/finished", "1")  # a group restarting from now on has nothing to rejoin
    if args.run_dir:
        os.makedirs(args.run_dir, exist_ok=True)
        with open(os.path.join(args.run_dir, f"result-m{_MEMBER}-r{_RESTART}.json"), "w") as f:
            json.dump(result, f)
    finish(0)


def build(args: argparse.Namespace, shards: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded over this replica group's ``shards`` ranks, and its optimizer;
    the same initial values on every rank of every group (one seed)."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    mesh = init_device_mesh("cpu", (shards,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.overlap:
        fsdp_overlap.enable(model, interface=args.rs_interface)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def compare_replicas(rep: Replicas, state: List[torch.Tensor]) -> List[int]:
    """Every group's fingerprint of this shard's state; the shard's first rank prints them."""
    prints = rep.fingerprints(state)
    if rep.replicate.get_rank() == 0:
        same = "identical" if len(set(prints)) == 1 else "DIFFERENT"
        print(f"shard {rep.shard}: state of replicas {[m // rep.shards for m in rep.replicate.members]} "
              f"fingerprints {[f'{x:016x}' for x in prints]}: {same}", flush=True)
    return prints


def report_admission(rep: Replicas, step: int, store: dist.Store) -> None:
    """Record in the job's store and print the admission this boundary made."""
    a = rep.admissions[-1]
    store.append("job/admissions", json.dumps(vars(a)) + "\n")
    print(f"admitted replica(s) {a.replicas} at step {step}: generation {a.generation}, "
          f"join and state transfer {a.heal_s:.3f}s", flush=True)


def report_recovery(rep: Replicas, step: int, store: dist.Store) -> None:
    """World rank 0: record in the job's store (it outlives every rank) and print the
    recovery that the step just committed ended; the launcher's summary adds the time
    from the kill."""
    r = rep.recoveries[-1] if rep.recoveries else None
    if r is None or r.step != step or r.committed_at is None:
        return
    store.append("job/recoveries", json.dumps(vars(r)) + "\n")
    print(f"recovered: lost replica(s) {r.lost_replicas} at step {step}; generation {r.generation} built "
          f"{r.resumed_at - r.detected_at:.3f}s and the step committed {r.committed_at - r.detected_at:.3f}s "
          f"after the loss was seen", flush=True)


def plain_average(store: dist.Store, replica: int, replicas: int, shard: int, shards: int,
                  timeout: timedelta) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The baseline's gradient average: a plain Gloo group per shard across replicas."""
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"plain/replicate{shard}/", store), replica, replicas, timeout)

    def average(local: torch.Tensor, step: int) -> torch.Tensor:
        out = local.clone()
        pg.allreduce([out]).wait()
        return out.div_(replicas)

    return average


def finish(code: int, why: str = "") -> None:
    """Dump this rank's trace and leave without running interpreter teardown (torch
    2.13's Gloo can abort there); the dump's reason says why."""
    from commslayer.liveness import close_all
    from tracing.recorder import recorder

    # First, so that the others do not wait on this rank while it dumps: a goodbye after a clean
    # run, a plain hang-up (a loss, at once) after a failure.
    close_all(goodbye=code == 0)
    rec = recorder()
    if rec is not None:
        rec.dump("exit" if code == 0 else f"exit {code}: {why}")
        rec.flush_sinks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except (commslayer.CommError, RuntimeError) as exc:
        # This rank's replica group is broken (a mate died, or this rank was fenced): leave
        # at once, so that the others see it and torchrun restarts the whole group.
        why = f"{'replica group broken' if isinstance(exc, ReplicaBroken) else type(exc).__name__}: {first_line(exc)}"
        print(f"[replica {_REPLICA} rank {os.environ.get('RANK')}] leaving ({why})", file=sys.stderr, flush=True)
        finish(1, why)
