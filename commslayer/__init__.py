"""commslayer: a torchcomms-style communication layer over c10d's Gloo and NCCL.

Every op has a deadline, failures are classified into ``CommError``
subclasses, every op is observable through hooks, and the whole thing plugs
into ``torch.distributed`` as the ``"commslayer"`` backend.

Layout: ``communicator`` (API, validation, deadlines, the op path),
``lifecycle`` (state machine, membership, recovery of each generation),
``startup`` (what torch's entry points wait for), ``backends`` (how Gloo
and NCCL groups are built, classified, torn down), ``work``/``watchdog``
(deadline enforcement), ``check`` (cross-rank check mode), ``c10d`` (the
``torch.distributed`` adapter), ``errors``, ``reduce_op``, ``hooks``,
``config`` (the ``COMMSLAYER_*`` table), ``store``, ``batch`` (batched
point-to-point), ``nan_check`` (the NaN check, off by default); for resilient jobs
``replicas`` (the replicate dimension), ``launcher`` (``commslayer-run``),
``runs`` (what a run leaves, for its writer and readers) and ``processes``.
"""

from .communicator import Communicator
from .create import join, new_comm
from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommAborted,
    CommError,
    ConfigError,
    InvalidArgument,
    NanDetected,
    PeerLost,
    StoreUnreachable,
)
from .hooks import HookHandle, live_communicators, register_communicator_hook
from .nan_check import NanCheckHook
from .reduce_op import ReduceOp
from .work import Work, WorkStatus
from . import config as _config
from .c10d import install_routing as _install_routing
from .c10d import register_backend as _register_backend

_register_backend()
if _config.route_c10d():  # also when torch's entry-point autoload is off
    _install_routing()

__all__ = [
    "new_comm", "join", "Communicator", "register_communicator_hook", "live_communicators", "Work", "WorkStatus", "ReduceOp", "HookHandle",
    "CommError", "CollectiveTimeout", "PeerLost", "CommAborted", "InvalidArgument", "CollectiveMismatch",
    "StoreUnreachable", "ConfigError", "NanDetected", "NanCheckHook",
]

# `import commslayer` may be what first imports torch, and torch then loads the
# entry points (ours, tracing's, faults') while this package is half built: they
# wait for this (commslayer.startup).
from .startup import mark_ready as _mark_ready

_mark_ready()
