"""FSDP2's gradient reduce-scatter on its own commslayer communicator.

This module owns the switch (``enable``/``disable``), the cache of
reduce-scatter communicators (one per parent communicator, shard-rank set and
network interface, so toggling never builds a second group), and every
contact with FSDP2's private state. Those contacts are checked before they are
used: a torch whose internals moved gets ``FsdpInternalsChanged`` naming what
is missing, instead of a job that silently runs without the extension.

How it hooks in (torch 2.13): a parameter group reads its reduce-scatter
group from its mesh info, where ``FSDPModule.set_separate_reduce_scatter_group``
puts a plain ``new_group`` through ``FSDPParamGroup._set_separate_reduce_scatter_group``.
We call that same method with our communicator's process group. On a torch
without it we install a custom reduce-scatter (``set_custom_reduce_scatter``'s
mechanism) that runs on our group whatever group FSDP2 passes.

Why CPU needs more: FSDP2 waits for each backward all-gather before it
issues the reduce-scatter, so on Gloo nothing overlaps. We turn on FSDP2's
asynchronous unshard (its private ``unshard_async_op``), so the prefetched
all-gather of the next block runs while this block's reduce-scatter does.
The reduce-scatter itself stays synchronous from FSDP2's point of view (it
reads the output right after the call), so its output is complete before
FSDP2 reads it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.distributed_c10d as dc
from torch.distributed.fsdp import FSDPModule

from commslayer import Communicator, InvalidArgument
from commslayer import config
from commslayer.c10d import group_communicator, group_of, job_rank_shift


class FsdpInternalsChanged(RuntimeError):
    """FSDP2's private state is not where this version of fsdp_overlap expects it."""


@dataclass
class _Saved:
    """What a parameter group had before ``enable``, restored by ``disable``."""

    rs_group: Optional[dist.ProcessGroup]  # native path: mesh_info.reduce_scatter_process_group
    rs_comm: Any  # fallback path: the group's reduce-scatter comm object
    unshard_async_op: bool


@dataclass
class _Built:
    """A communicator this module built, with the default process group it was built under:
    after ``destroy_process_group`` and a new ``init_process_group`` it is not used again."""

    world: Optional[dist.ProcessGroup]
    parent: Optional[Communicator]  # what a reduce-scatter communicator was split from
    comm: Communicator


_saved: "weakref.WeakKeyDictionary[Any, _Saved]" = weakref.WeakKeyDictionary()
_cache: Dict[Tuple[str, Tuple[int, ...], Optional[str]], _Built] = {}
_world: Dict[str, _Built] = {}  # device type -> the parent of a plain c10d job (_default_group_communicator)
_world_builds = 0  # parents built for plain c10d jobs so far: each one's store prefix is new


def enable(module: nn.Module, *, comm: Optional[Communicator] = None, interface: Optional[str] = None,
           recurse: bool = True) -> List[Communicator]:
    """Run the gradient reduce-scatter of ``module``'s FSDP2 parameter groups on
    a dedicated commslayer communicator; return the communicators used.

    Every rank of the shard groups calls it, with the same arguments, after
    ``fully_shard``. ``comm``: the communicator to split the reduce-scatter
    communicator from (default: the shard group's own communicator when the
    job runs on commslayer, else one built over the default group's store and
    ranks, so a plain ``"gloo"`` job needs no change). ``interface``:
    the network interface the new communicator uses (Gloo; NCCL picks its
    network process-wide, see docs/fsdp_overlap.md). ``recurse``: also the
    FSDP2 submodules of ``module``. Calling it again is harmless; the
    communicators are built once per process and reused.
    """
    if comm is not None and not isinstance(comm, Communicator):
        raise InvalidArgument(
            f"comm= takes a commslayer Communicator (commslayer.new_comm, or a commslayer group's), not "
            f"{type(comm).__name__}; leave it out to split from the shard group's own communicator")
    if interface is not None and (not isinstance(interface, str) or not interface.strip()):
        raise InvalidArgument(f"interface={interface!r}: the name of a network interface (\"eth1\"), or None for "
                              "the one the job's groups use")
    groups = _param_groups(module, recurse)
    used: List[Communicator] = []
    for group in groups:
        rs_comm = _communicator_for(group, comm, interface)
        _install(group, rs_comm)
        if rs_comm not in used:
            used.append(rs_comm)
    return used


def disable(module: nn.Module, *, recurse: bool = True) -> None:
    """Give ``module``'s parameter groups back what they had before ``enable``
    (reduce-scatter group and unshard mode). The cached communicators stay, so
    a later ``enable`` reuses them."""
    for group in _param_groups(module, recurse):
        saved = _saved.pop(group, None)
        if saved is None:
            continue
        if _has_native_hook(group):
            _set_native(group, saved.rs_group)
        else:
            group._reduce_scatter_comm = saved.rs_comm
        group.unshard_async_op = saved.unshard_async_op


# ------------------------------------------------------------- FSDP2 contacts
def _param_groups(module: nn.Module, recurse: bool) -> list:
    """The FSDP2 parameter groups of ``module`` (and its submodules) that shard."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fsdp_overlap needs an nn.Module wrapped by FSDP2's fully_shard, got {type(module).__name__}")
    modules = list(module.modules()) if recurse else [module]
    fsdp_modules = [m for m in modules if isinstance(m, FSDPModule)]
    if not fsdp_modules:
        raise TypeError(
            f"{type(module).__name__} is not an FSDP2 module and contains none: call "
            "torch.distributed.fsdp.fully_shard on it (or its blocks) before fsdp_overlap.enable"
        )
    groups = []
    for m in fsdp_modules:
        state = _require(m, "_get_fsdp_state")()
        for group in _require(state, "_fsdp_param_groups"):
            mesh_info = _require(group, "mesh_info")
            if hasattr(mesh_info, "shard_process_group"):  # replicate-only groups have no reduce-scatter
                _check_group(group)
                groups.append(group)
    return groups


def _require(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise FsdpInternalsChanged(
            f"FSDP2 in torch {torch.__version__} has no {type(obj).__name__}.{name}, which fsdp_overlap "
            "relies on; this torch is not supported by this version of fsdp_overlap"
        ) from None


def _check_group(group: Any) -> None:
    for name in ("device", "unshard_async_op"):
        _require(group, name)
    if _has_native_hook(group):
        _require(group.mesh_info, "reduce_scatter_process_group")
    else:
        _require(group, "_reduce_scatter_comm")


def _has_native_hook(group: Any) -> bool:
    return hasattr(type(group), "_set_separate_reduce_scatter_group")


def _set_native(group: Any, pg: Optional[dist.ProcessGroup]) -> None:
    """Point the group's reduce-scatter at ``pg`` (None: the shared shard group)
    through FSDP2's own method, and check that FSDP2 now uses it."""
    if pg is None:
        group._set_separate_reduce_scatter_group(False, {})
        expected = group.mesh_info.shard_process_group
    else:
        ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_process_group))
        group._set_separate_reduce_scatter_group(True, {ranks: pg})
        expected = pg
    if _require(group, "_reduce_scatter_process_group") is not expected:
        raise FsdpInternalsChanged(
            f"FSDP2 in torch {torch.__version__} ignored the reduce-scatter group set through "
            "_set_separate_reduce_scatter_group; this torch is not supported by this version of fsdp_overlap"
        )


def _install(group: Any, rs_comm: Communicator) -> None:
    if group not in _saved:
        native = _has_native_hook(group)
        _saved[group] = _Saved(
            rs_group=group.mesh_info.reduce_scatter_process_group if native else None,
            rs_comm=None if native else group._reduce_scatter_comm,
            unshard_async_op=group.unshard_async_op,
        )
    pg = rs_comm.as_process_group()
    if _has_native_hook(group):
        _set_native(group, pg)
    else:
        group._reduce_scatter_comm = _CommslayerReduceScatter(pg, _saved[group].rs_comm)
    if group.device.type == "cpu":
        group.unshard_async_op = True  # CUDA overlaps on streams; CPU needs the async all-gather


class _CommslayerReduceScatter:
    """FSDP2's reduce-scatter call on our group, for a torch without the native hook.

    FSDP2 calls it as ``comm(output_tensor=, input_tensor=, group=, op=, async_op=)``
    with its shard group; we run the op on ours instead and let the comm we
    replaced allocate the buffers.
    """

    def __init__(self, group: dist.ProcessGroup, replaced: Any) -> None:
        self.group = group
        self._replaced = replaced

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._replaced.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=self.group, async_op=async_op)


# ------------------------------------------------------------- communicators
def _default_group_communicator(device_type: str) -> Communicator:
    """For a job on plain c10d: a commslayer communicator over the default group's
    store and ranks (built once per device type; every rank calls ``enable``)."""
    global _world_builds
    built = _world.get(device_type)
    if built is not None and built.world is dist.group.WORLD:
        return built.comm
    if built is not None:  # built under an earlier default group (destroy_process_group since)
        built.comm.finalize()
    kind = "nccl" if device_type == "cuda" else "gloo"
    _world_builds += 1  # every rank builds its parents in the same order: the prefixes agree
    comm = group_communicator(
        kind, dist.PrefixStore(f"fsdp_overlap/{_world_builds}/", dc._get_default_store()), dist.get_rank(),
        config.default_timeout().total_seconds(), "fsdp_overlap", list(range(dist.get_world_size())))
    _world[device_type] = _Built(dist.group.WORLD, None, comm)
    return comm


def _communicator_for(group: Any, comm: Optional[Communicator], interface: Optional[str]) -> Communicator:
    """The cached reduce-scatter communicator for this group's shard ranks, split on first use."""
    device_type = group.device.type
    shard_pg = group.mesh_info.shard_process_group
    shift = job_rank_shift(dist.get_rank())  # communicators record the job's ranks
    shard_ranks = [r + shift for r in dist.get_process_group_ranks(shard_pg)]
    if comm is not None:
        parent = comm
    elif group_of(shard_pg) is not None:
        parent = group_of(shard_pg).communicator(device_type)
    else:
        parent = _default_group_communicator(device_type)
    if parent.get_device().type != device_type:
        raise InvalidArgument(f"comm {parent.get_name()!r} carries {parent.get_device().type} tensors; "
                              f"these parameters are on {device_type}")
    if interface is not None and parent.get_backend() != "gloo":
        raise InvalidArgument(
            f"interface= binds a Gloo communicator; {parent.get_backend()} picks its network devices "
            "process-wide (NCCL_SOCKET_IFNAME, NCCL_IB_HCA): set those in the job's environment"
        )
    members = parent.global_ranks
    if members is None or not set(shard_ranks) <= set(members):
        raise InvalidArgument(
            f"comm {parent.get_name()!r} must contain the shard ranks {shard_ranks} "
            f"(its members: {members if members is not None else 'unknown'})"
        )
    ranks = tuple(members.index(g) for g in shard_ranks)
    key = (parent.uid, ranks, interface)
    built = _cache.get(key)
    if built is not None and built.parent is parent and built.world is dist.group.WORLD:
        return built.comm
    if built is not None:  # split under an earlier default group: c10d has forgotten its process group
        built.comm.finalize()
        del _cache[key]
        if built.parent is parent:
            raise InvalidArgument(
                f"comm {parent.get_name()!r} was split for fsdp_overlap before destroy_process_group; after a "
                "new init_process_group pass a communicator built since, or leave comm= out")
    # the ranks are in the name: disjoint shard sets split from one parent need distinct store prefixes
    name = "fsdp_rs_" + "_".join(map(str, shard_ranks)) + (f"@{interface}" if interface else "")
    hints = {"interface": interface} if interface else {}
    rs_comm = parent.split(list(ranks), name, **hints)
    _cache[key] = _Built(dist.group.WORLD, parent, rs_comm)
    return rs_comm
