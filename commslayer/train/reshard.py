"""A sharded state moved to a different number of ranks: merged whole, then cut again.

When a lost rank gets no replacement, a ``PeerJob`` goes on with the
survivors: the state of every rank (the survivors' own, the lost rank's from
its holder) is merged into the whole state, the survivors start their
script again on one rank fewer (FSDP2 built by the user's own code on the
smaller mesh), and each takes its part of the whole.  This module owns the
two transformations, on the snapshot format of ``commslayer.train.job._State``
(``{"modules": {name: [tensors]}, "optimizers": {name: {"state": [{key:
(tensor, sharded)}], "groups": [...]}}, "objects": {name: state_dict}}``):

- ``merge``: the ranks' snapshots, in rank order, into the whole state.  A
  sharded tensor (an FSDP2 parameter's local shard, or optimizer state laid
  out like it) is the concatenation of the ranks' pieces along dim 0, which
  is how FSDP2 shards (``Shard(0)``, unpadded local views); anything else is
  the same on every rank and taken from the first.  Objects stay per rank.
- ``piece``: this rank's part of a whole tensor, for a parameter of the new
  layout (the DTensor's own offsets on its mesh).

Imports nothing of commslayer; torch only.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch


def merge(snapshots: Dict[int, Dict[str, Any]], sharded: Dict[str, List[bool]]) -> Dict[str, Any]:
    """The whole state from every rank's snapshot (``snapshots[rank]``); ``sharded[module]``
    says, per tensor of the module (parameters, then buffers), whether it is a shard."""
    ranks = sorted(snapshots)
    first = snapshots[ranks[0]]
    modules = {}
    for name, tensors in first["modules"].items():
        modules[name] = [torch.cat([snapshots[r]["modules"][name][i] for r in ranks]) if flag else t
                         for i, (t, flag) in enumerate(zip(tensors, sharded[name]))]
    optimizers = {}
    for name, opt in first["optimizers"].items():
        state = []
        for j, entry in enumerate(opt["state"]):
            state.append({k: (torch.cat([snapshots[r]["optimizers"][name]["state"][j][k][0] for r in ranks]), True)
                          if flag else (v, False) for k, (v, flag) in entry.items()})
        optimizers[name] = {"state": state, "groups": opt["groups"]}
    return {"modules": modules, "optimizers": optimizers,
            "objects": {r: snapshots[r]["objects"] for r in ranks}}


def piece(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``like`` (a DTensor of the new layout, or a plain
    tensor: all of it) holds on this rank."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(like, DTensor):
        return whole
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
