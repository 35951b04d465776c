"""A user's FSDP2 script on commslayer.resilience, with the mistakes users make, for
tests/test_bugs.py: run under ``commslayer-run`` in either mode.

``user_fsdp2.py [--steps N] [--bug STEP:MEMBER] [--skip STEP:MEMBER] [--kill STEP:MEMBER]
[--fewer-steps MEMBER] [--destroy-first] [--no-optimizer] [--unregistered-scheduler] [--rank0-barrier STEP]
[--uneven-allreduce STEP:MEMBER] [--leave STEP:MEMBER] [--timeout S]``

- ``--bug``: the member's loss code raises ``ValueError`` at that step, in every life
  (a bug: it recurs);
- ``--skip``: the member does not call ``job.step()`` at that step;
- ``--kill``: the member SIGKILLs itself at that step, in its first life only (a fault); given
  again, another member too;
- ``--fewer-steps``: the member loops over one step fewer than the others;
- ``--destroy-first``: the plain script's ``dist.destroy_process_group()`` left before ``job.finish()``;
- ``--no-optimizer``: ``job.register(model=model)`` alone;
- ``--unregistered-scheduler``: an LR scheduler drives the optimizer but is not registered;
- ``--rank0-barrier``: after that step, rank 0 of the process group alone calls ``dist.barrier()``
  (as a script that saves a checkpoint there would), in every life;
- ``--uneven-allreduce``: after that step every rank all-reduces a tensor of its own (a metric), the
  member's twice as long as the others' (Gloo aborts a process on it), in every life;
- ``--leave``: after that step the member leaves the loop with ``sys.exit(0)`` (a "done" check that
  fired on one rank only), in every life;
- ``--timeout``: the ops' deadline, ``resilience.init(timeout=...)`` (default 60 s).

A member is ``job.member``: the rank in per-rank mode, replica * ranks per replica + rank
in replica mode.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from commslayer import resilience


def at(spec):
    step, member = spec.split(":")
    return int(step), int(member)


def check_batch(x, step):
    if not torch.isfinite(x).all():
        raise ValueError(f"bad batch at step {step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bug", type=at)
    p.add_argument("--skip", type=at)
    p.add_argument("--kill", type=at, action="append", default=[])
    p.add_argument("--fewer-steps", type=int)
    p.add_argument("--destroy-first", action="store_true")
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--unregistered-scheduler", action="store_true")
    p.add_argument("--rank0-barrier", type=int)
    p.add_argument("--uneven-allreduce", type=at)
    p.add_argument("--leave", type=at)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()

    job = resilience.init(timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    fully_shard(model, mesh=job.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    if args.no_optimizer:
        job.register(model=model)
    elif args.unregistered_scheduler:
        job.register(model=model, optimizer=opt)
    else:
        job.register(model=model, optimizer=opt, scheduler=sched)
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in job.steps(args.steps - (args.fewer_steps == job.member)):
        g = torch.Generator().manual_seed(step * 100 + job.member)
        x = torch.randn(8, 16, generator=g)
        if args.bug == (step, job.member):
            x[0, 0] = float("nan")
        check_batch(x, step)
        if (step, job.member) in args.kill and life == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(x), x.flip(1))
        loss.backward()
        if args.skip == (step, job.member):
            continue
        job.step(loss)
        if args.rank0_barrier == step and dist.get_rank() == 0:
            dist.barrier()
        if args.uneven_allreduce is not None and args.uneven_allreduce[0] == step:
            dist.all_reduce(torch.ones(20000 if args.uneven_allreduce[1] == job.member else 10000))
        if args.leave == (step, job.member):
            sys.exit(0)
        sched.step()
        if job.reports:
            print(f"step {step} loss {job.losses[step]:.6g}", flush=True)
    if args.destroy_first:
        dist.destroy_process_group()
    job.finish()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
