"""The NaN check: an op refuses to send a tensor that holds a NaN (off by default).

torchcomms' ``NanCheckHook``: ``NanCheckHook().register_with_comm(comm)``, or
``COMMSLAYER_NAN_CHECK=1`` for every communicator of the process. Before each
op is issued it looks at the op's floating-point and complex inputs (a send's
tensor, an all-reduce's tensor, ...; receives have none) and raises
``NanDetected`` on the first NaN, naming the rank, the op and the tensor.
The op is then not issued and the communicator is broken like after any
failed op: its peers wait in the op until their deadline.

A tensor costs one ``sum`` (a NaN makes the sum NaN); only a NaN sum (a NaN,
or infinities of both signs) pays for locating the element.
docs/bench/nan-check.md gives the measured cost per op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from commslayer.errors import NanDetected
from commslayer.hooks import HookHandle, OpIO

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator


def first_nan(t: torch.Tensor) -> Optional[int]:
    """The flat index of the first NaN in ``t`` (a sparse tensor: in its values), or None."""
    if t.is_sparse:
        t = t._values()
    if not (t.is_floating_point() or t.is_complex()):
        return None
    total = t.sum().item()  # one kernel: a NaN anywhere makes the sum NaN (x != x only for NaN)
    if total == total:
        return None
    found = torch.isnan(t.reshape(-1)).nonzero()
    return int(found[0, 0]) if found.numel() else None  # infinities of both signs, no NaN


class NanCheckHook:
    """Registers the NaN check on communicators (torchcomms' name and call)."""

    def register_with_comm(self, comm: "Communicator") -> HookHandle:
        """Check every later op of ``comm``; ``remove()`` the handle to stop."""
        name, rank = comm.get_name(), comm.get_rank()

        def check(op: str, io: OpIO) -> None:
            for i, t in enumerate(io.inputs):
                where = first_nan(t)
                if where is not None:
                    raise NanDetected(
                        f"NaN in input {i} of {len(io.inputs)} ({t.dtype} {list(t.shape)}, element {where}) "
                        f"on rank {rank}; the op was not issued", comm=name, op=op, ranks=(rank,))

        return comm.register_check_hook(check)
