"""Resilience for the user's own training loop: a replica group (or a rank) is lost, the others go on.

A job launched by ``commslayer-run --replicas R --nproc-per-replica P
train.py`` is R replica groups of P ranks, one torchrun each.  Inside a
group the user shards the model as usual (FSDP2 ``fully_shard`` on
``job.mesh``, or DDP on ``job.process_group``); across groups the model is
replicated, and the job keeps the replicas in step::

    job = resilience.init()                        # instead of init_process_group + init_device_mesh
    fully_shard(model, mesh=job.mesh)
    opt = torch.optim.AdamW(model.parameters())
    job.register(model=model, optimizer=opt, scheduler=sched)   # all that must heal
    for step in job.steps(1000):                   # starts where a restarted group heals to
        loss = model(batch(step)).mean()
        loss.backward()
        job.step(loss)                             # instead of opt.step(); opt.zero_grad()
    job.finish()                                   # end of job: replicas compared, results written

This module is the entry point: ``init`` builds the job, a ``Job``
(commslayer.train.job: replica groups) or, without ``--replicas``, a ``PeerJob``
(commslayer.train.peerjob: every rank its own restart unit, its state held by
its peers; a warm spare waits here until it is given a lost rank,
commslayer.train.spare), and installs the hook that makes an uncaught error leave the
job in one line (``_leave``).  Without ``commslayer-run`` (plain
``torchrun``) the job is one replica group: the same script runs
unchanged, without cross-group recovery.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from commslayer import config

from commslayer.train import failures, spare
from commslayer.errors import CommError, InvalidArgument, first_line
from commslayer.comm.exits import exit_now
from commslayer.hooks import register_phase_hook, register_step_hook  # noqa: F401  (public here: where a user looks)
from commslayer.train.job import BUCKET_BYTES, Job, StateMismatch  # noqa: F401  (StateMismatch: public here)
from commslayer.train.peerjob import PeerJob
from commslayer.train.replicas import ReplicaBroken


_FUTURE_WRAPPING = re.compile(r"(RuntimeError: )?Got the following error when running the callback: ")


def _leave(job: "Job", exc_type: type, exc: BaseException, tb: Any, previous: Callable[..., None]) -> None:
    """An uncaught error in a resilient job: say why in one line (a broken replica group
    is expected: its torchrun restarts it), record it in the job's store
    (``commslayer.train.failures``: a deterministic failure stops the job instead of being
    restarted), dump, hang up and leave with status 1."""
    loss_seen = failures.saw_loss()
    if isinstance(exc, ReplicaBroken):
        why = f"replica group broken: {first_line(exc)}"
    elif isinstance(exc, CommError):
        why = f"{type(exc).__name__}: {first_line(exc)}"
    else:
        previous(exc_type, exc, tb)
        # a CommError inside DDP's comm hook arrives wrapped by each future it passed through
        why = _FUTURE_WRAPPING.sub("", f"{type(exc).__name__}: {first_line(exc)}")
    unit, key = job.failure_unit()
    verdict = ""
    try:
        found = failures.record(job.store, exc, tb, unit=unit, key=key, life=job.restart,
                                step=job.step_index if job.step_index >= 0 else None, saw_loss=loss_seen,
                                error=why)
        verdict = f"; {found.deterministic}: the job stops" if found.deterministic else ""
    except (CommError, RuntimeError, OSError):  # the store is gone: the launcher sees the exit alone
        pass
    where = "" if config.restart_unit() == "rank" else f"replica {config.replica_id() or 0} "
    print(f"[{where}rank {os.environ.get('RANK')}] leaving ({why}){verdict}", file=sys.stderr, flush=True)
    exit_now(1, why)


def _check_launched() -> None:
    """``InvalidArgument`` naming how to start the script when no launcher started it
    (``python script.py``: no ``RANK``, ``WORLD_SIZE``), instead of a ``KeyError``."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise InvalidArgument(f"{' and '.join(missing)} not set: start the script with commslayer-run (commslayer-run "
                              f"--nproc-per-node 2 {sys.argv[0]}) or torchrun, not with python alone", op="init")


def init(*, timeout: timedelta = timedelta(seconds=60), bucket_mb: float = BUCKET_BYTES / 2 ** 20,
         overlap: Optional[bool] = None, run_dir: Optional[str] = None, heal_timeout_s: float = 120.0,
         redundancy: Optional[int] = None, refresh_every: Optional[int] = None) -> Job:
    """Start this rank's part of a resilient job, from the environment ``commslayer-run``
    (or plain ``torchrun``) sets: the replica group's process group on the
    ``"commslayer"`` backend, ``job.mesh`` (1-D over the group, for ``fully_shard``), and
    the job's resilient replicate communicator. ``bucket_mb``: the size of a bucket of
    gradients averaged after backward. ``overlap``: begin the cross-replica average of
    FSDP2 and DDP modules during backward (``commslayer.train.gradients``); ``False``
    averages everything after backward (default: ``True`` unless
    ``COMMSLAYER_AVERAGE_AFTER_BACKWARD`` is set). ``run_dir`` (default ``COMMSLAYER_RUN_DIR``):
    where ``finish`` writes this rank's result. Under ``commslayer-run`` without
    ``--replicas`` (``COMMSLAYER_RESTART_UNIT=rank``) the job is a ``PeerJob``
    (commslayer.train.peerjob): ``redundancy`` ranks keep a copy of each rank's state
    (default ``COMMSLAYER_REDUNDANCY``, 1), refreshed every ``refresh_every`` steps
    (default ``COMMSLAYER_REFRESH_EVERY``, 1), and survivors wait up to
    ``heal_timeout_s`` for a lost rank's replacement."""
    if bucket_mb <= 0:
        raise InvalidArgument(f"bucket_mb={bucket_mb!r} must be positive", op="init")
    if overlap is None:
        overlap = not config.average_after_backward()
    if redundancy is None:
        redundancy = config.redundancy()
    if refresh_every is None:
        refresh_every = config.refresh_every()
    if not isinstance(redundancy, int) or redundancy < 1:
        raise InvalidArgument(f"redundancy={redundancy!r} must be an int >= 1", op="init")
    if not isinstance(refresh_every, int) or refresh_every < 1:
        raise InvalidArgument(f"refresh_every={refresh_every!r} must be an int >= 1", op="init")
    common: Dict[str, Any] = dict(timeout=timeout, bucket_bytes=int(bucket_mb * 2 ** 20), overlap=overlap,
                                  run_dir=run_dir, heal_timeout_s=heal_timeout_s)
    waiting = config.spare()
    if waiting is not None:  # a warm spare: this returns once it is a lost rank's next life
        spare.wait_for_rank(waiting)
    per_rank = config.restart_unit() == "rank"
    _check_launched()
    job = PeerJob(redundancy=redundancy, refresh_every=refresh_every, replace_timeout_s=heal_timeout_s,
                  **common) if per_rank else Job(**common)
    previous = sys.excepthook  # after init_process_group: its hook captures stderr while it calls the one before
    sys.excepthook = lambda t, e, tb: _leave(job, t, e, tb, previous)
    return job
