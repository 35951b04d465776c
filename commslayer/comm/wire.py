"""How an op's arguments reach the c10d backend.

The communicator checks a call and then hands the backend tensors and an
option struct; this module owns what happens in between: which backend
method each op runs (``BACKEND_OPS``), the tensors as the backend carries
them (complex as pairs of reals, PREMUL_SUM's scaled input), the finishing
step of an AVG reduction (Gloo has no AVG), and the option structs with the
op's deadline in them (``Options``: cached, because c10d copies a struct on
every call and a pybind setter costs more than a dict lookup).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from commslayer.reduce_op import ReduceOp

# Which method of the c10d backend each op runs (the pre hook reports it).
BACKEND_OPS = {
    "all_reduce": "allreduce", "all_reduce_coalesced": "allreduce_coalesced", "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base", "all_to_all_single": "alltoall_base",
    "all_gather": "allgather", "reduce_scatter": "reduce_scatter", "broadcast": "broadcast",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "send": "send", "recv": "recv",
    "all_gather_v": "alltoall_base", "reduce_scatter_v": "reduce_scatter", "all_to_all_v_single": "alltoall_base",
    "gather_single": "gather", "batch_p2p": "send/recv",
    "should_commit": "allreduce", "pending_members": "broadcast",  # the membership's own collectives
}


def wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend carries it (complex travels as pairs of reals)."""
    return torch.view_as_real(t) if t.dtype.is_complex else t


def premultiplied(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The input a reduction sends: a scaled copy for PREMUL_SUM, else ``t`` itself."""
    if op.name != "PREMUL_SUM":
        return t
    factor: Any = op.factor
    scaled: torch.Tensor = t * factor
    return scaled


def in_place(call: Callable[..., Any], ts: List[torch.Tensor], op: ReduceOp, opts: Any) -> Callable[[], Any]:
    """The issue step of an in-place reduction (all_reduce, its coalesced form, reduce).
    PREMUL_SUM scales the tensors first: the result overwrites them anyway. Decided
    once, not per call."""
    if op.name == "PREMUL_SUM":
        factor: Any = op.factor
        return lambda: call([t.mul_(factor) for t in ts], opts)
    return lambda: call(ts, opts)


def averaging(t: torch.Tensor, op: ReduceOp, size: int) -> Optional[Callable[[], None]]:
    """What finishes an AVG reduction into ``t`` (None for any other op): Gloo sums,
    then ``t`` is divided by the group's size."""
    if op.name != "AVG":
        return None
    if t.dtype.is_floating_point or t.is_complex():
        def divide() -> None:
            t.div_(size)
        return divide

    def truncate() -> None:  # integer AVG truncates towards zero, as NCCL's ncclAvg does
        t.copy_(torch.div(t, size, rounding_mode="trunc"))
    return truncate


class Options:
    """One communicator's backend option structs, built once per (kind, reduce op,
    root) and given each op's deadline only when it differs from the one it holds."""

    __slots__ = ("_structs", "_timeouts", "_timedeltas")

    def __init__(self) -> None:
        self._structs: Dict[Tuple[Any, ...], Any] = {}
        self._timeouts: Dict[int, float] = {}  # id of a cached struct -> the timeout it holds
        self._timedeltas: Dict[float, datetime.timedelta] = {}

    def get(self, cls: Callable[[], Any], reduce_op: Optional[ReduceOp] = None, root: Optional[int] = None) -> Any:
        """The struct of class ``cls`` for this reduce op and root."""
        key = (cls, None if reduce_op is None else reduce_op.name, root)
        opts = self._structs.get(key)
        if opts is None:
            opts = cls()
            if reduce_op is not None:
                opts.reduceOp = reduce_op.to_c10d()
            if root is not None:
                opts.rootRank = root
            self._structs[key] = opts
        return opts

    def timedelta(self, seconds: float) -> datetime.timedelta:
        """``seconds`` as a timedelta (cached: an op's deadline repeats)."""
        td = self._timedeltas.get(seconds)
        if td is None:
            td = self._timedeltas[seconds] = datetime.timedelta(seconds=seconds)
        return td

    def deadline(self, opts: Any, seconds: float) -> datetime.timedelta:
        """Put the deadline into ``opts`` (None: an op without a struct) and return it."""
        td = self._timedeltas.get(seconds) or self.timedelta(seconds)
        if opts is not None and self._timeouts.get(id(opts)) != seconds:
            opts.timeout = td
            self._timeouts[id(opts)] = seconds
        return td
