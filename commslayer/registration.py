"""Making commslayer known to ``torch.distributed``: the ``"commslayer"`` backend name,
and with ``COMMSLAYER_ROUTE_C10D=1`` the routing of an unmodified job's groups.

``install_routing`` rewrites the backend of every group c10d creates to
commslayer while ``get_backend`` keeps answering with the name the job asked
for.  This module imports nothing of commslayer's op path, only
``torch.distributed`` and ``commslayer.startup`` (which imports nothing):
torch's entry point (``commslayer.autoload``) runs it while ``import torch``
is under way, which may be from inside any commslayer module being imported
(``import commslayer`` leaves torch for later when it can,
``commslayer/__init__``).  The backend itself, ``commslayer.c10d``, is
imported when c10d builds the first group.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as dc

from commslayer.startup import BACKEND_NAME

_ROUTED = ("gloo", "nccl", "undefined")


def _create(dist_opts: Any, backend_options: Any) -> Any:
    from commslayer.c10d import create

    return create(dist_opts, backend_options)


def register_backend() -> None:
    """Make ``"commslayer"`` a c10d backend name (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _routes(backend: str) -> bool:
    """Whether a group c10d is asked to make on ``backend`` is made as commslayer's: NCCL
    only where this torch has it, so that a job asking for NCCL without it fails as
    plain c10d fails, instead of running on Gloo without a word."""
    return backend in _ROUTED and (backend != "nccl" or dist.is_nccl_available())


def _routed_backend(backend: Any) -> str:
    text = str(backend).lower()
    if ":" not in text:
        return BACKEND_NAME if _routes(text) else str(backend)
    pairs = [p.split(":", 1) for p in text.split(",")]
    return ",".join(f"{dev}:{BACKEND_NAME if _routes(b) else b}" for dev, b in pairs)


def _default_backend(config: dist.BackendConfig) -> str:
    """The name plain c10d gives a group of ``config`` (its default backend: NCCL if any device uses it)."""
    return "nccl" if "nccl" in config.get_device_backend_map().values() else "gloo"


def install_routing() -> None:
    """Route every group c10d creates from now on through commslayer (idempotent)."""
    register_backend()
    original = dc._new_process_group_helper
    if getattr(original, "_commslayer_routed", False):
        return

    @functools.wraps(original)
    def routed(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        pg, store = original(group_size, group_rank, global_ranks_in_group,
                             dist.Backend(_routed_backend(backend)), *args, **kwargs)
        if pg is not dist.GroupMember.NON_GROUP_MEMBER:
            # every name the job can read (get_backend, get_backend_config, name()) answers what it asked for
            config = dist.BackendConfig(dist.Backend(str(backend)))
            dc._world.pg_map[pg] = (backend, store)
            dc._world.pg_backend_config[pg] = str(config)
            from commslayer.comm.process_group import answer_as  # built by now: imported at the first group

            answer_as(pg, _default_backend(config))
        return pg, store

    setattr(routed, "_commslayer_routed", True)
    dc._new_process_group_helper = routed
