"""launch/train.py with the probes of launch/bench/bench_peer.py: the same job, its milestones written down.

    commslayer-run --nproc-per-node 4 --run-dir D launch/bench/bench_peer_job.py --steps 20

Runs train.py's ``main`` unchanged, and writes, when the job reaches
``job.finish()``, ``probe-m<member>-r<life>-<pid>.json`` into the run
directory (``$COMMSLAYER_RUN_DIR``) with this process's:

- ``exec_at``: when the process started (the kernel's start time of the
  process, ``/proc/self/stat``: a resolution of one clock tick, 10 ms);
  ``script_at``: when this script began (the interpreter up);
  ``torch_at``: ``import torch`` done; ``imports_at``: train.py and
  commslayer imported; ``init_from``/``init_at``: ``resilience.init``
  called and returned (a warm spare waits in it for its rank: then
  ``adopted_at`` is when it was given one, and ``warmed_at`` when it had
  imported rank 0's torch modules and stepped its optimizers on meta
  tensors, if it had); ``build_from``/``built_at``:
  train.py's ``build`` (the model made and sharded with FSDP2);
- ``commits``: ``[step, wall clock]`` for each step the job committed, in
  order (a step redone after a loss appears again);
- with peer redundancy (``job.copies``, per-rank mode): ``state_bytes``,
  the size of this rank's packed state (its shard of the parameters and
  optimizer state, its registered objects), ``bytes_sent`` for the copies,
  ``held_bytes`` at the end and ``held_peak``, the most the copies held
  here when sampled just before and just after each ``job.step``.

Wall clock is ``time.time``; every process of a run is on one host.
"""

import os
import time

SCRIPT_AT = time.time()
import torch  # noqa: E402  (timed: what a replacement process pays to import it)

TORCH_AT = time.time()
import json  # noqa: E402
import sys  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch/: train.py
import train  # noqa: E402
from commslayer import config, resilience  # noqa: E402
from commslayer.train import spare  # noqa: E402

IMPORTS_AT = time.time()


def exec_at() -> float:
    """This process's start, wall clock: the kernel's start time (``/proc/self/stat``, clock ticks
    after boot) moved onto the wall clock by the offset between the two clocks now."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")


class Probe:
    """What this process writes down about its job (see the module doc)."""

    def __init__(self) -> None:
        self.record: Dict[str, Any] = {"exec_at": exec_at(), "script_at": SCRIPT_AT, "torch_at": TORCH_AT,
                                       "imports_at": IMPORTS_AT, "pid": os.getpid(), "restart": config.restart_count()}
        self.commits: List[List[float]] = []
        self.held_peak = 0
        self.job: Optional[Any] = None

    def build(self, args: Any, mesh: Any) -> torch.nn.Module:
        self.record["build_from"] = time.time()
        model = BUILD(args, mesh)
        self.record["built_at"] = time.time()
        return model

    def init(self, **kwargs: Any) -> Any:
        self.record["init_from"] = time.time()
        self.job = job = INIT(**kwargs)
        self.record.update(init_at=time.time(), restart=config.restart_count())  # a spare's life is known now
        if spare.adopted is not None:
            self.record["adopted_at"] = spare.adopted[1]
        if spare.warmed_at is not None:
            self.record["warmed_at"] = spare.warmed_at
        step, finish = job.step, job.finish

        def probed_step(loss: Optional[torch.Tensor] = None) -> None:
            index, done = job.step_index, len(job.step_s)
            self._sample()
            step(loss)
            if len(job.step_s) > done:
                self.commits.append([index, time.time()])
            self._sample()

        def probed_finish(**options: Any) -> Any:
            self._save()
            return finish(**options)

        job.step, job.finish = probed_step, probed_finish
        return job

    def _copies(self) -> Any:
        return getattr(self.job, "copies", None)  # a PeerJob's, from steps() on; None for other jobs

    def _sample(self) -> None:
        copies = self._copies()
        if copies is not None:
            self.held_peak = max(self.held_peak, copies.held_bytes)

    def _save(self) -> None:
        job = self.job
        assert job is not None
        member = job.replica * job.world_size + job.rank
        out = dict(self.record, member=member, replica=job.replica, rank=job.rank, commits=self.commits)
        copies = self._copies()
        if copies is not None:
            out.update(state_bytes=copies.confirmed.own.numel(), bytes_sent=copies.bytes_sent,
                       held_bytes=copies.held_bytes, held_peak=self.held_peak, holders=copies.plan[job.rank])
        run_dir = job.run_dir or "."
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, f"probe-m{member}-r{out['restart']}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)


BUILD, INIT = train.build, resilience.init
PROBE = Probe()
train.build = PROBE.build
resilience.init = PROBE.init

if __name__ == "__main__":
    train.main()
