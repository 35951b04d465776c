"""Write isolation: an op that has raised never writes into the caller's tensors.

A Gloo op cannot be cancelled: after a survivor has given up on a stopped
peer (``PeerLost``) or a deadline (``CollectiveTimeout``), the backend's
worker still waits inside the op, and if the peer comes back (SIGCONT) the op
completes and writes its result into the tensors it was given, long after
the caller moved on and maybe reused them.  With isolation the backend never
sees the caller's output tensors: every op writes into a staging copy, and
the copy goes to the caller only when the op settles successfully (the
op's ``finish`` step, which runs at most once and never after a failure).

It costs one copy of every output (plus one of every in-place input) per op,
so it is a choice: ``new_comm(..., isolate_writes=True)`` or
``COMMSLAYER_ISOLATE_WRITES=1``; docs/recovery.md gives the measured cost.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

Pairs = List[Tuple[torch.Tensor, torch.Tensor]]  # (caller's tensor, staging copy)


class StagedWork:
    """The backend's work plus the copies to make when it succeeds."""

    __slots__ = ("work", "pairs")

    def __init__(self, work: Any, pairs: Pairs) -> None:
        self.work = work
        self.pairs = pairs

    def wait(self, timeout=None):
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()

    def _source_rank(self) -> int:
        return int(self.work._source_rank())

    def finisher(self, then: Optional[Callable[[], None]]) -> Callable[[], None]:
        """The op's finish step: copy the results out, then run ``then`` (AVG's division)."""
        pairs = self.pairs

        def finish() -> None:
            for dst, src in pairs:
                dst.copy_(src)
            if then is not None:
                then()

        return finish


def _fresh(ts: Sequence[torch.Tensor], pairs: Pairs) -> List[torch.Tensor]:
    """Staging buffers for outputs the op overwrites whole."""
    out = [torch.empty_like(t) for t in ts]
    pairs.extend(zip(ts, out))
    return out


def _copied(ts: Sequence[torch.Tensor], pairs: Pairs) -> List[torch.Tensor]:
    """Staging buffers for in-place ops, which read them first."""
    out = [t.clone() for t in ts]
    pairs.extend(zip(ts, out))
    return out


class IsolatedBackend:
    """The op methods of a c10d backend, each given staging copies of its outputs."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def allreduce(self, tensors, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.allreduce(_copied(tensors, pairs), opts), pairs)

    def allreduce_coalesced(self, tensors, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.allreduce_coalesced(_copied(tensors, pairs), opts), pairs)

    def reduce(self, tensors, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.reduce(_copied(tensors, pairs), opts), pairs)

    def broadcast(self, tensors, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.broadcast(_copied(tensors, pairs), opts), pairs)

    def _allgather_base(self, output, input, opts):
        pairs: Pairs = []
        return StagedWork(self._backend._allgather_base(_fresh([output], pairs)[0], input, opts), pairs)

    def _reduce_scatter_base(self, output, input, opts):
        pairs: Pairs = []
        return StagedWork(self._backend._reduce_scatter_base(_fresh([output], pairs)[0], input, opts), pairs)

    def alltoall_base(self, output, input, out_splits, in_splits, opts):
        pairs: Pairs = []
        staged = _fresh([output], pairs)[0]
        return StagedWork(self._backend.alltoall_base(staged, input, out_splits, in_splits, opts), pairs)

    def allgather(self, output_lists, inputs, opts):
        pairs: Pairs = []
        staged = [_fresh(outs, pairs) for outs in output_lists]
        return StagedWork(self._backend.allgather(staged, inputs, opts), pairs)

    def reduce_scatter(self, outputs, input_lists, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.reduce_scatter(_fresh(outputs, pairs), input_lists, opts), pairs)

    def gather(self, output_lists, inputs, opts):
        pairs: Pairs = []
        staged = [_fresh(outs, pairs) for outs in output_lists]
        return StagedWork(self._backend.gather(staged, inputs, opts), pairs)

    def scatter(self, outputs, input_lists, opts):
        pairs: Pairs = []
        return StagedWork(self._backend.scatter(_fresh(outputs, pairs), input_lists, opts), pairs)

    def recv(self, tensors, src, tag):
        pairs: Pairs = []
        return StagedWork(self._backend.recv(_fresh(tensors, pairs), src, tag), pairs)

    def recv_anysource(self, tensors, tag):
        pairs: Pairs = []
        return StagedWork(self._backend.recv_anysource(_fresh(tensors, pairs), tag), pairs)

    def send(self, tensors, dst, tag):
        return StagedWork(self._backend.send(tensors, dst, tag), [])

    def barrier(self, opts):
        return StagedWork(self._backend.barrier(opts), [])
