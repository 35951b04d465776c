"""commslayer: a torchcomms-style communication layer over c10d's Gloo and NCCL.

Every op has a deadline, failures are classified into ``CommError``
subclasses, every op is observable through hooks, and the whole thing plugs
into ``torch.distributed`` as the ``"commslayer"`` backend.

Layout, by layer from the bottom (docs/architecture.md draws it): the base
modules at this root (``errors``, ``config``, ``reduce_op``, ``hooks``,
``endpoints``, ``startup``, ``runs``); ``agree`` (membership, agreement, the
store); ``detect`` (liveness and the watch protocol); ``comm`` (the
``Communicator``, its ops, ``Work`` and lifecycle); the ``torch.distributed``
adapter (``c10d``, ``registration``, ``autoload``); ``train`` (resilient
training, whose entry point is ``resilience``); ``run`` (``commslayer-run``).
A module's old path from before the subpackages still imports, with a
``DeprecationWarning``, for one release (``old_paths``).

``import commslayer`` imports torch only when it must register the backend
itself: when torch is imported already (it costs nothing then) or when torch
will not load commslayer's ``torch.backends`` entry point (autoloading off, or
the package not installed).  Otherwise the names below are imported on first
use, and ``import torch`` registers the backend through the entry point: a
process that only needs a torch-free part (``commslayer-run`` checking its
arguments) does not pay seconds for torch.
"""

from __future__ import annotations

import os as _os
import sys as _sys
from importlib import import_module as _import_module
from typing import TYPE_CHECKING, Any

from commslayer import config as _config
from commslayer.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommAborted,
    CommError,
    ConfigError,
    InvalidArgument,
    NanDetected,
    OutOfFiles,
    PeerLost,
    StoreUnreachable,
)
from commslayer.old_paths import install as _install_old_paths
from commslayer.startup import mark_ready as _mark_ready

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator
    from commslayer.comm.create import join, new_comm
    from commslayer.hooks import HookHandle, live_communicators, register_communicator_hook
    from commslayer.comm.nan_check import NanCheckHook
    from commslayer.reduce_op import ReduceOp
    from commslayer.comm.work import Work, WorkStatus

_HOMES = {"Communicator": "comm.communicator", "join": "comm.create", "new_comm": "comm.create",
          "HookHandle": "hooks", "live_communicators": "hooks", "register_communicator_hook": "hooks",
          "NanCheckHook": "comm.nan_check", "ReduceOp": "reduce_op", "Work": "comm.work", "WorkStatus": "comm.work"}

__all__ = [
    "new_comm", "join", "Communicator", "register_communicator_hook", "live_communicators", "Work", "WorkStatus", "ReduceOp", "HookHandle",
    "CommError", "CollectiveTimeout", "PeerLost", "CommAborted", "InvalidArgument", "CollectiveMismatch",
    "StoreUnreachable", "ConfigError", "NanDetected", "NanCheckHook", "OutOfFiles",
]


def __getattr__(name: str) -> Any:
    """The torch-side names, imported on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'commslayer' has no attribute {name!r}")
    value = getattr(_import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def _loaded_by_torch() -> bool:
    """Whether ``import torch`` will run commslayer's ``torch.backends`` entry point."""
    if _os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":  # torch's own test of it
        return False
    from importlib.metadata import entry_points

    return any(e.value == "commslayer.autoload:autoload" for e in entry_points(group="torch.backends"))


_install_old_paths()
_route = _config.route_c10d()  # a bad value fails `import commslayer` at once, torch or not
if "torch" in _sys.modules or not _loaded_by_torch():
    from commslayer import gloo_exit as _gloo_exit
    from commslayer.registration import install_routing as _install_routing
    from commslayer.registration import register_backend as _register_backend

    _gloo_exit.install()
    _register_backend()
    if _route:
        _install_routing()
    for _name in _HOMES:  # the API as attributes, as a plain import would leave it
        __getattr__(_name)

# `import commslayer` may be what first imports torch, and torch then loads the
# entry points (ours, tracing's, faults') while this package is half built: they
# wait for this (commslayer.startup).
_mark_ready()
