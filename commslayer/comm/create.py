"""Building a communicator: ``new_comm`` (a new group) and ``join`` (a member
that comes into a running one).

Both check what the caller passed and the ``COMMSLAYER_*`` environment, fill
in torchrun's rank, size and store where the caller named none, and make the
communicator's ``Lineage`` (commslayer.comm.lifecycle): its root in the store and
the membership that later generations are agreed through.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from commslayer import config

from commslayer.comm import backends
from commslayer.comm.communicator import Communicator
from commslayer.comm.lifecycle import Lineage
from commslayer.agree.membership import Membership
from commslayer.agree.store import bounded, env_rank_size, env_store
from commslayer.comm.validation import Checker, Timeout, shown_name, timeout_seconds

_instances: Dict[str, int] = {}  # comm name -> how many were built here (keeps prefixes unique)
_instances_lock = threading.Lock()


def new_comm(
    backend: str,
    device: Optional[torch.device] = None,
    *,
    name: str,
    timeout: Timeout = None,
    store: Optional[dist.Store] = None,
    rank: Optional[int] = None,
    size: Optional[int] = None,
    check: Optional[bool] = None,
    isolate_writes: Optional[bool] = None,
    **hints: str,
) -> Communicator:
    """Build a communicator; every member rank calls it with the same ``name``.

    ``backend`` is ``"gloo"``, ``"nccl"`` or ``"auto"`` (by ``device``).  Rank,
    size and the store default to torchrun's environment.  ``timeout`` (a
    timedelta or seconds) is the deadline of every op that names none;
    default ``COMMSLAYER_TIMEOUT_S``.  ``check`` turns on the cross-rank
    check mode (default ``COMMSLAYER_CHECK``).  ``isolate_writes`` stages
    every output so an op that raised never writes later (default
    ``COMMSLAYER_ISOLATE_WRITES``; commslayer.comm.isolation).  ``hints`` go to
    the backend (Gloo: ``interface``, ``threads``; NCCL:
    ``high_priority_stream``), checked first: an unknown hint or a value the
    backend does not allow is ``InvalidArgument``.  A bad ``COMMSLAYER_*``
    variable is ``ConfigError`` (config.validate).  Members watch each
    other (``COMMSLAYER_HEARTBEAT_S``, ``COMMSLAYER_PEER_TIMEOUT_S``) and the
    communicator can ``shrink`` and ``reconfigure``.
    """
    chk = Checker(shown_name(name), "new_comm", -1 if rank is None else rank)
    spec, device, timeout_s, store, hints, make_lineage = _lineage(chk, backend, device, name, timeout, store,
                                                                   isolate_writes, hints)
    global_ranks = None
    if store is None:
        store, env_rank, env_size = env_store(timedelta(seconds=timeout_s))
        if rank is None and size is None:
            global_ranks = list(range(env_size))
        rank = env_rank if rank is None else rank
        size = env_size if size is None else size
    elif rank is None or size is None:
        env_rank, env_size = env_rank_size()
        rank = env_rank if rank is None else rank
        size = env_size if size is None else size
    if not (isinstance(size, int) and size > 0 and isinstance(rank, int) and 0 <= rank < size):
        raise chk.fail(f"rank {rank} / size {size} is not a valid position in a group")
    lineage = make_lineage(store)
    return Communicator(
        spec, device, name=name, store=lineage.store_for(0), rank=rank, size=size, timeout_s=timeout_s,
        hints=hints,
        check=config.check_mode() if check is None else check,
        uid=lineage.uid_for(0), global_ranks=global_ranks, lineage=lineage,
    )


def join(
    backend: str,
    device: Optional[torch.device] = None,
    *,
    name: str,
    member: int,
    timeout: Timeout = None,
    store: Optional[dist.Store] = None,
    check: Optional[bool] = None,
    isolate_writes: Optional[bool] = None,
    **hints: str,
) -> Communicator:
    """Join the running communicator ``name`` as member id ``member`` (a restarted
    rank, or a new one): announce it, wait until the members ``reconfigure`` to
    a generation that includes it, and return that generation's communicator."""
    chk = Checker(shown_name(name), "join", -1)
    spec, device, timeout_s, store, hints, make_lineage = _lineage(chk, backend, device, name, timeout, store,
                                                                   isolate_writes, hints)
    if store is None:
        store = env_store(timedelta(seconds=timeout_s))[0]
    if not isinstance(member, int) or member < 0:
        raise chk.fail(f"member must be a non-negative int, got {member!r}")
    lineage = make_lineage(store)
    before = lineage.membership.announce(member)
    generation, members = lineage.membership.wait_for_admission(member, before, timeout_s)
    return Communicator(
        spec, device, name=name, store=lineage.store_for(generation),
        rank=members.index(member), size=len(members), timeout_s=timeout_s,
        hints=hints, check=config.check_mode() if check is None else check,
        uid=lineage.uid_for(generation), lineage=lineage, generation=generation, members=members,
    )


def _lineage(chk: Checker, backend: str, device: Optional[torch.device], name: str, timeout: Timeout,
             store: Optional[dist.Store], isolate_writes: Optional[bool], hints: Dict[str, Any]
             ) -> Tuple[backends.BackendSpec, torch.device, float, Optional[dist.Store], Dict[str, str],
                        Callable[[dist.Store], Lineage]]:
    """What new_comm and join both check and read: (spec, device, timeout_s, store, the
    backend hints, a function of the store that makes the communicator's ``Lineage``).
    Start-up: a bad ``COMMSLAYER_*`` variable raises ``ConfigError`` here."""
    chk.name(name, forbidden="/")
    config.validate()
    try:
        spec, device = backends.resolve(backend, device)
        hints = spec.check_hints(hints)
    except ValueError as exc:
        raise chk.fail(str(exc)) from None
    heartbeat_s, peer_timeout_s = config.liveness_timing()
    store_timeout_s = config.store_timeout_s()
    timeout_s = timeout_seconds(timeout, config.default_timeout().total_seconds(), chk)
    isolate = config.isolate_writes() if isolate_writes is None else bool(isolate_writes)

    def make(store: dist.Store) -> Lineage:
        with _instances_lock:
            instance = _instances.get(name, 0)
            _instances[name] = instance + 1
        root = bounded(store, f"commslayer/{name}/{instance}/", comm=name, deadline_s=store_timeout_s)
        return Lineage(root, f"{name}.{instance}", Membership(root, name), heartbeat_s, peer_timeout_s, isolate)

    return spec, device, timeout_s, store, hints, make
