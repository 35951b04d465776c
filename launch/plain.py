"""The baseline of the resilience benchmarks: ``commslayer.resilience``'s calls done the plain way.

A script written on ``commslayer.resilience`` (``init``, ``register``,
``steps``, ``step``, ``finish``) runs here as the plain torchrun script it
was before: plain Gloo process groups, no deadlines, no recovery, no
tracing; ``step`` is ``opt.step(); opt.zero_grad()``, timed the same way.
Under ``commslayer-run`` (``COMMSLAYER_REPLICAS`` > 1) it is plain HSDP:
the group's gradients averaged across replica groups in one flat
all-reduce per step after backward, the way ``launch/train.py --plain``
does it.  Every rank writes the same result file as a resilient run
(``commslayer.runs``), so the benchmarks read both alike.  ``--vote`` (before the
script) adds to plain HSDP's step what ``should_commit`` adds and nothing else:
after the average, a MIN all-reduce of one int64 over all the job's ranks.

    torchrun --nproc-per-node 4 launch/plain.py launch/examples/ddp_resilient.py --steps 40
    commslayer-run --replicas 2 --nproc-per-replica 2 launch/plain.py --vote launch/examples/fsdp2_resilient.py
"""

import argparse
import os
import runpy
import sys
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from commslayer import config, runs
from commslayer.comm.exits import exit_now


class Job:
    """The plain stand-in for ``commslayer.train.job.Job``."""

    vote = False  # ``--vote``: a tally over the job's ranks at every step, as should_commit's

    def __init__(self, run_dir: Optional[str] = None) -> None:
        timeout = timedelta(seconds=60)
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.replica = int(os.environ.get("COMMSLAYER_REPLICA", "0"))
        self.replicas = int(os.environ.get("COMMSLAYER_REPLICAS", "1"))
        self.member = self.replica * self.world_size + self.rank
        self.live_replicas, self.generation = list(range(self.replicas)), 0
        self.reports = self.member == 0
        dist.init_process_group("gloo", timeout=timeout)
        self.process_group = dist.group.WORLD
        self.mesh = init_device_mesh("cpu", (self.world_size,))
        self.replicate = self.world = None
        if self.replicas > 1:
            host, port = os.environ["COMMSLAYER_JOB_STORE"].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, use_libuv=True)
            self.replicate = dist.ProcessGroupGloo(dist.PrefixStore(f"plain/replicate{self.rank}/", store),
                                                   self.replica, self.replicas, timeout)
            if self.vote:
                self.world = dist.ProcessGroupGloo(dist.PrefixStore("plain/world/", store), self.member,
                                                   self.replicas * self.world_size, timeout)
                self.tally = torch.ones(1, dtype=torch.int64)
                self.tally_opts = dist.AllreduceOptions()
                self.tally_opts.reduceOp = dist.ReduceOp.MIN
        self.run_dir = run_dir if run_dir is not None else config.run_dir()
        self.modules: List[nn.Module] = []
        self.optimizers: List[torch.optim.Optimizer] = []
        self.losses: Dict[int, float] = {}
        self.step_s: List[float] = []
        self.started = time.time()

    def register(self, **state: Any) -> None:
        self.modules += [m for m in state.values() if isinstance(m, nn.Module)]
        self.optimizers += [o for o in state.values() if isinstance(o, torch.optim.Optimizer)]

    def steps(self, total: int) -> Iterator[int]:
        self.total, self.begin = total, time.perf_counter()
        for self.step_index in range(total):
            self.t0 = time.perf_counter()
            yield self.step_index

    def step(self, loss: Optional[torch.Tensor] = None) -> None:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for m in self.modules for p in m.parameters() if p.grad is not None]
        parts = [loss.detach().reshape(1).to(grads[0].dtype) / self.world_size] if loss is not None else []
        if parts:
            dist.all_reduce(parts[0])
        if self.replicate is not None:
            flat = torch.cat([g.reshape(-1) for g in grads] + parts)
            self.replicate.allreduce([flat]).wait()
            flat.div_(self.replicas)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            parts = [flat[-1:]] if parts else []
        if self.world is not None:
            self.world.allreduce([self.tally], self.tally_opts).wait()
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad()
        if parts:
            self.losses[self.step_index] = parts[0].item()
        self.step_s.append(time.perf_counter() - self.t0)

    def finish(self) -> None:
        if self.run_dir:
            runs.save(runs.RankResult(
                member=self.member, replica=self.replica, rank=self.rank, restart=0, pid=os.getpid(),
                started=self.started, steps=self.total, start_step=0, elapsed_s=time.perf_counter() - self.begin,
                step_s=self.step_s, losses=self.losses, optimizer_steps=[], live=self.live_replicas), self.run_dir)
        exit_now(0)


def init(*, run_dir: Optional[str] = None, **_ignored: Any) -> Job:
    """``resilience.init`` done the plain way (its tuning options mean nothing here)."""
    return Job(run_dir)


def main() -> None:
    """Run the script in ``sys.argv[1]`` (after ``--vote``, if given) with this module standing in for
    ``commslayer.resilience``."""
    import commslayer

    me = sys.modules[__name__]
    sys.modules["commslayer.resilience"] = me
    commslayer.resilience = me
    parser = argparse.ArgumentParser(description="Run a commslayer.resilience script the plain way.")
    parser.add_argument("--vote", action="store_true",
                        help="after the cross-replica average, a MIN all-reduce of one int64 over all the "
                             "job's ranks (should_commit's collective alone)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args()
    if args.vote and int(os.environ.get("COMMSLAYER_REPLICAS", "1")) < 2:
        parser.error("--vote adds a tally across replica groups: run under commslayer-run --replicas 2 or more")
    Job.vote = args.vote
    sys.argv = [args.script, *args.args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
