"""The c10d adapter: commslayer as a ``torch.distributed`` backend.

``init_process_group(backend="commslayer")`` (or ``"cpu:commslayer,cuda:commslayer"``)
and ``new_group`` build, through ``create``, a group (commslayer.comm.process_group's
``process_group``) over one communicator per device type that this module
builds (``group_communicator``): CPU → Gloo, CUDA → NCCL, with deadlines,
classified errors and hooks.  ``adopting`` makes the default group over a
communicator that exists already (a resilient job's).  ``group_of`` finds
commslayer's side of a group (``CommslayerGroup``: its communicators, its hold).

The backend name and ``COMMSLAYER_ROUTE_C10D=1`` (routing an unmodified job)
are made known to c10d by ``commslayer.registration``, which builds groups
through ``create``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
import torch.distributed as dist

from commslayer import config

from commslayer.comm import backends
from commslayer.comm.communicator import Communicator
from commslayer.errors import InvalidArgument
from commslayer.comm.lifecycle import watched_lineage
from commslayer.comm.process_group import CommslayerGroup, group_of, job_rank_shift, process_group
from commslayer.agree.store import bounded

__all__ = ["CommslayerGroup", "adopting", "create", "group_communicator", "group_of", "job_rank_shift"]


def group_communicator(kind: str, store: dist.Store, rank: int, timeout_s: float, group_name: str,
                       default_ranks: List[int]) -> Communicator:
    """The communicator that carries a c10d group's ops for backend ``kind`` (``"gloo"``,
    ``"nccl"``), named ``c10d:<group_name>:<device type>``, over the group's ``store``;
    ``default_ranks``: its members' ranks in the default group (it records them as the
    job's, ``job_rank_shift``). Its members watch each other; its membership is fixed."""
    spec, device = backends.resolve(kind, None)
    shift = job_rank_shift(default_ranks[rank])
    name = f"c10d:{group_name}:{spec.device_type}"
    uid = name + (f"+{shift}" if shift else "")
    comm_store = bounded(store, f"commslayer/{spec.device_type}/", comm=name)
    return Communicator(
        spec, device, name=name, store=comm_store, rank=rank, size=len(default_ranks),
        timeout_s=timeout_s, hints={}, check=config.check_mode(),
        uid=uid, global_ranks=[r + shift for r in default_ranks], lineage=watched_lineage(comm_store, uid, name),
    )


_adopted: List[Communicator] = []  # the communicator the next default group is made over (``adopting``)


@contextlib.contextmanager
def adopting(comm: Communicator) -> Iterator[None]:
    """Inside: ``init_process_group("commslayer", ...)`` makes the default group over
    ``comm`` (already built, e.g. by ``commslayer.join``) instead of building one."""
    _adopted.append(comm)
    try:
        yield
    finally:
        _adopted.remove(comm)


def create(dist_opts, backend_options) -> dist.ProcessGroup:
    """The ``"commslayer"`` backend's creator (``commslayer.registration``): a group over
    ``dist_opts``, or over the communicator being adopted (``adopting``)."""
    if _adopted:
        comm = _adopted[-1]
        if (dist_opts.group_rank, dist_opts.group_size) != (comm.get_rank(), comm.get_size()):
            raise InvalidArgument(f"init_process_group(rank={dist_opts.group_rank}, world_size="
                                  f"{dist_opts.group_size}) over {comm.get_name()!r}, rank {comm.get_rank()} of "
                                  f"{comm.get_size()}", comm=comm.get_name(), op="init_process_group")
        return process_group([comm])
    config.validate()  # start-up of a c10d job: a bad COMMSLAYER_* variable fails init_process_group
    timeout_s = config.group_timeout(dist_opts.timeout).total_seconds()
    kinds = ["gloo"] + (["nccl"] if torch.cuda.is_available() and dist.is_nccl_available() else [])
    default_ranks = list(dist_opts.global_ranks_in_group) or list(range(dist_opts.group_size))
    return process_group([group_communicator(kind, dist_opts.store, dist_opts.group_rank, timeout_s,
                                                      str(dist_opts.group_id), default_ranks) for kind in kinds])
