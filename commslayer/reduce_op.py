"""``ReduceOp``: torchcomms' reduction names, and how each maps onto c10d.

Gloo has no AVG and no PREMUL_SUM, so the communicator runs both as SUM with a
scaling step (before or after the op); this module says which step is needed.
"""

from __future__ import annotations

from typing import Dict, Union

import torch
import torch.distributed as dist


class ReduceOp:
    """A reduction. Use the class attributes, or ``ReduceOp.PREMUL_SUM(factor)``."""

    __slots__ = ("name", "factor")

    SUM: "ReduceOp"
    PRODUCT: "ReduceOp"
    MIN: "ReduceOp"
    MAX: "ReduceOp"
    AVG: "ReduceOp"
    BAND: "ReduceOp"
    BOR: "ReduceOp"
    BXOR: "ReduceOp"

    def __init__(self, name: str, factor: Union[float, torch.Tensor, None] = None) -> None:
        self.name = name
        self.factor = factor

    @staticmethod
    def PREMUL_SUM(factor: Union[float, torch.Tensor]) -> "ReduceOp":  # noqa: N802 (torchcomms name)
        """Multiply every input by ``factor``, then sum."""
        return ReduceOp("PREMUL_SUM", factor)

    @property
    def is_bitwise(self) -> bool:
        return self.name in ("BAND", "BOR", "BXOR")

    def to_c10d(self) -> dist.ReduceOp:
        """The c10d op that runs on the wire (AVG and PREMUL_SUM travel as SUM)."""
        name = "SUM" if self.name in ("AVG", "PREMUL_SUM") else self.name
        op: dist.ReduceOp = getattr(dist.ReduceOp, name)
        return op

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReduceOp) and (self.name, self.factor) == (other.name, other.factor)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}" + (f"({self.factor})" if self.name == "PREMUL_SUM" else "")


for _name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"):
    setattr(ReduceOp, _name, ReduceOp(_name))

_FROM_C10D: Dict[object, "ReduceOp"] = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


def coerce(op: object) -> ReduceOp:
    """Accept our ``ReduceOp``, a c10d ``ReduceOp`` or its ``RedOpType`` (what the
    c10d adapter passes); nothing else, since an int compares equal to a
    ``RedOpType`` (``5`` is ``BAND``) and would be taken silently.

    Raises ``ValueError`` for another type, and for what cannot be expressed (a
    c10d PREMUL_SUM, whose factor Python cannot read); the caller turns it into
    ``InvalidArgument``.
    """
    if isinstance(op, ReduceOp):
        return op
    if not isinstance(op, dist.ReduceOp):  # RedOpType members are instances of it too
        raise ValueError(f"op must be a commslayer.ReduceOp (or a torch.distributed.ReduceOp), "
                         f"got {op!r} ({type(op).__name__})")
    for c10d_op, ours in _FROM_C10D.items():
        if op == c10d_op:  # a ReduceOp instance compares equal to its RedOpType
            return ours
    name = getattr(getattr(op, "op", op), "name", repr(op))  # a ReduceOp instance's repr names no op
    raise ValueError(f"unsupported reduce op torch.distributed.ReduceOp.{name}: its factor cannot be read; scale "
                     f"the tensor and use SUM, or commslayer.ReduceOp.PREMUL_SUM(factor) on a communicator")
