"""Point-to-point ops of a ``Communicator``: ``PointToPoint``.

A message is numbered in its (sender, receiver) pair, so that check mode and
the flight recorder can match a send with its receive; a recv from any
source learns its sender and number only as it completes; a batch
(``commslayer.comm.batch``) numbers all its messages before it issues them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, cast

import torch

from commslayer.comm.batch import BackendWorks, BatchSendRecv, Message
from commslayer.comm.check import fingerprint
from commslayer.hooks import OpIO
from commslayer.comm.isolation import StagedWork
from commslayer.comm.op_path import OpPath
from commslayer.comm.validation import Timeout, timeout_seconds
from commslayer.comm.wire import wire
from commslayer.comm.work import Work

if TYPE_CHECKING:
    from commslayer.comm.communicator import Communicator


class PointToPoint(OpPath):
    """Sends, receives and batches of them (see ``Communicator`` for the list)."""

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send ``tensor`` to rank ``dst`` (matched in order with its ``recv``)."""
        return self._p2p("send", tensor, dst, async_op, timeout)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Receive into ``tensor`` from rank ``src``."""
        return self._p2p("recv", tensor, src, async_op, timeout)

    def recv_any_source(self, tensor: torch.Tensor, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Receive into ``tensor`` from whichever rank's message comes first (c10d's
        ``recv_anysource``); once it completed, ``work.peer`` is the sender's rank."""
        return self._recv_any(tensor, async_op, timeout)

    def _recv_any(self, tensor: torch.Tensor, async_op: bool, timeout: Timeout, tag: int = 0) -> Work:
        """A recv that waits on every other member: the liveness monitor interrupts it
        when any of them is lost (a helper thread waits on the backend: Gloo fails a
        receive at its first timed-out wait). Numbered in its pair once the sender is known."""
        chk = self._checker("recv")
        chk.tensor(tensor, "tensor")
        if self._check is not None:
            raise chk.fail("check mode compares each message before it is sent: a recv from any source "
                           "must name its source rank")
        timeout = timeout_seconds(timeout, self._timeout_s, chk)
        self.lifecycle.ensure_usable("recv", 0)
        return self._run(chk, OpIO((), (tensor,), None, None),
                         lambda: self._ops.recv_anysource([wire(tensor)], tag), opts=None, fp=None,
                         timeout=timeout, async_op=async_op, seq=0, any_source=True)

    def _numbered(self, src: int) -> int:
        """The number of the message from ``src`` that a recv from any source received."""
        pair = (src, self._rank)
        n = self._p2p_seq[pair] = self._p2p_seq.get(pair, 0) + 1
        return n

    def _p2p(self, op: str, tensor: torch.Tensor, peer: int, async_op: bool, timeout: Timeout, tag: int = 0) -> Work:
        chk = self._checker(op)
        chk.tensor(tensor, "tensor")
        peer = chk.rank_arg(peer, "dst" if op == "send" else "src", me=self._rank)
        timeout = timeout_seconds(timeout, self._timeout_s, chk)  # before the message is numbered
        pair = (self._rank, peer) if op == "send" else (peer, self._rank)
        n = self._p2p_seq.get(pair, 0) + 1
        self._p2p_seq[pair] = n
        self.lifecycle.ensure_usable(op, n, peer)
        call = self._ops.send if op == "send" else self._ops.recv
        io = OpIO((tensor,), (), None, None) if op == "send" else OpIO((), (tensor,), None, None)
        return self._run(chk, io, lambda: call([wire(tensor)], peer, tag), opts=None, fp=self._fp(op, tensor),
                         timeout=timeout, async_op=async_op, peer=peer, seq=n)

    def batch_op_create(self) -> BatchSendRecv:
        """An empty batch of sends and receives: queue them with its ``send``/``recv``,
        then ``issue()`` them as one op (commslayer.comm.batch)."""
        return BatchSendRecv(cast("Communicator", self))

    def _batch_p2p(self, ops: List[Message], async_op: bool, timeout: Timeout) -> Work:
        """Issue a batch's messages (checked as they were queued), numbered in their pairs."""
        chk = self._checker("batch_p2p")
        timeout_s = timeout_seconds(timeout, self._timeout_s, chk)  # before the messages are numbered
        numbered = []
        for kind, tensor, peer in ops:
            pair = (self._rank, peer) if kind == "send" else (peer, self._rank)
            n = self._p2p_seq[pair] = self._p2p_seq.get(pair, 0) + 1
            numbered.append((pair, n, kind, tensor, peer))
        for pair, n, _, _, peer in numbered:
            self.lifecycle.ensure_usable("batch_p2p", n, peer)
        check = self._check

        def issue() -> Any:
            if check is not None:  # in one order on every rank, so that no two ranks wait on each other
                for (src, dst), n, kind, tensor, _ in sorted(numbered, key=lambda m: (m[0], m[1])):
                    check.p2p(fingerprint("batch_p2p", tensor), src, dst, n, timeout_s)
            works, pairs = [], []
            grouped = self._backend.supports_coalescing  # NCCL: one group call, one backend work
            if grouped:
                self._backend._start_coalescing(self._device)
            try:
                for _, _, kind, tensor, peer in numbered:
                    work = (self._ops.send if kind == "send" else self._ops.recv)([wire(tensor)], peer, 0)
                    if work.__class__ is StagedWork:
                        pairs += work.pairs
                        work = work.work
                    works.append(work)
            finally:
                both = self._backend._end_coalescing(self._device) if grouped else BackendWorks(works)
            return StagedWork(both, pairs) if self._ops is not self._backend else both

        self._batches += 1
        io = OpIO(tuple(t for k, t, _ in ops if k == "send"), tuple(t for k, t, _ in ops if k == "recv"), None, None)
        return self._run(chk, io, issue, opts=None, fp=None, timeout=timeout_s, async_op=async_op, seq=self._batches)
