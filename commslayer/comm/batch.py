"""Batched point-to-point: torchcomms' ``batch_op_create()``.

A ``BatchSendRecv`` queues sends and receives and issues them as one op: one
``Work``, one deadline, one trace record (op ``batch_p2p``). On NCCL the
messages are one group call (the backend's coalescing); Gloo has none, so
there they go to the backend as separate sends and receives issued back to
back, and the batch's work waits on all of them (``BackendWorks``). Each message takes
its number in its pair (sender, receiver), so batched and single messages
between two ranks stay matched in order.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from commslayer.comm.validation import Timeout

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator
    from commslayer.comm.work import Work

Message = Tuple[str, torch.Tensor, int]  # ("send" or "recv", tensor, peer)


class BackendWorks:
    """The backend works of a batch's messages, waited on as one."""

    __slots__ = ("works",)

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if timeout is None:
            for w in self.works:
                w.wait()
            return True
        end = time.monotonic() + timeout.total_seconds()
        for w in self.works:  # c10d rounds to whole milliseconds, and 0 would mean "forever"
            w.wait(timedelta(seconds=max(end - time.monotonic(), 0.001)))
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> "torch.futures.Future[Any]":
        """Completes when every message has; fails with the first failed one's error."""
        both = torch.futures.collect_all([w.get_future() for w in self.works])
        return both.then(lambda f: [sub.value() for sub in f.value()])

    def _source_rank(self) -> int:
        raise RuntimeError("a batch has no single source rank")


class BatchSendRecv:
    """Sends and receives to issue together; ``ops`` lists the queued ones as
    (kind, tensor, peer). Each is checked as it is queued."""

    def __init__(self, comm: "Communicator") -> None:
        self._comm = comm
        self._chk = comm._checker("batch_p2p")
        self.ops: List[Message] = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Queue a send of ``tensor`` to rank ``dst``."""
        self._add("send", tensor, dst, "dst")

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Queue a receive into ``tensor`` from rank ``src``."""
        self._add("recv", tensor, src, "src")

    def _add(self, kind: str, tensor: torch.Tensor, peer: int, what: str) -> None:
        self._chk.tensor(tensor, f"the tensor of {kind} #{len(self.ops)}")
        self.ops.append((kind, tensor, self._chk.rank_arg(peer, what, me=self._comm.get_rank())))

    def issue(self, async_op: bool = False, *, timeout: Timeout = None) -> "Work":
        """Issue the queued messages as one op; the batch is empty again afterwards."""
        ops, self.ops = self.ops, []
        if not ops:
            raise self._chk.fail("the batch is empty: queue sends and recvs before issue()")
        return self._comm._batch_p2p(ops, async_op, timeout)
