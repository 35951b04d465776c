"""A bandwidth-optimal reduce-scatter on Gloo: the ring, over point-to-point messages.

Gloo's own reduce-scatter sends every rank's whole input; the ring sends
(n-1)/n of it.  The input is cut into n blocks (block j ends on rank j).  In
step s (0 .. n-2) rank r sends block (r-s-1) mod n to rank r+1, having added
its own part of that block to what it received, and receives block
(r-s-2) mod n from rank r-1; after n-1 steps block r is complete on rank r.
Every block travels in chunks, and a chunk is reduced and passed on as soon
as it arrives, so the additions overlap the transfers.

Summation order: block b is ``((x[b+1] + x[b+2]) + ...) + x[b]`` (ranks
modulo n, x[k] is rank k's input), the same on every run.  At two ranks that
is ``x[b+1] + x[b]``, bitwise Gloo's result (addition commutes); at more it
can differ from Gloo's order in the last bits.

A ``RingReduceScatter`` is run whole by the communicator's ring thread
(``work.Waiter``): its ``wait`` is the algorithm, bounded by the op's
deadline; the caller waits on the thread like on any backend work.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from commslayer.reduce_op import ReduceOp

# Gloo matches point-to-point messages by peer and tag, in order.  Each ring op
# has a tag of its own, from its collective number, so that what a failed op
# left in flight is never taken by a later one; user send/recv keep theirs
# below RING_TAGS_FROM (0 unless a c10d job picks one).
RING_TAGS_FROM = 1 << 30
_RING_TAGS = 1 << 30
CHUNK_BYTES = 1 << 20  # a chunk is reduced while the next ones travel
_WINDOW = 8  # receives posted ahead of the chunk being reduced
# Additions run in pieces below ATen's grain size (32768 elements), so that they
# stay on this thread: an OpenMP region leaves its threads spinning, and on a
# small host they starve Gloo's network thread (measured on 2 cores: the ring
# took 6-8x as long with parallel additions).
_PIECE = 16384
RING_OPS = frozenset({"SUM", "AVG", "PREMUL_SUM"})  # elementwise sums: the ring adds


def ring_tag(seq: int) -> int:
    """The point-to-point tag of the ring op numbered ``seq`` on its communicator."""
    return RING_TAGS_FROM + seq % _RING_TAGS


def ring_fits(op: ReduceOp, output: torch.Tensor, size: int) -> bool:
    """Whether the ring can carry this reduce-scatter (else Gloo's own runs it):
    a sum of a numeric dtype (complex travels as real pairs) into a contiguous, non-empty output."""
    return size > 1 and op.name in RING_OPS and output.dtype != torch.bool and output.is_contiguous() \
        and output.numel() > 0


def in_ring_order(inputs: List[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of the sum of ``inputs`` (every rank's whole input, flat,
    in rank order), added as the ring adds it: ``((x[b+1] + x[b+2]) + ...) + x[b]``,
    ranks modulo their number (docs/api.md); what the ring leaves in that rank's output."""
    size = len(inputs)
    n = inputs[0].numel() // size
    parts = [inputs[(rank + 1 + i) % size][rank * n:(rank + 1) * n] for i in range(size)]
    acc = parts[0].clone()
    for part in parts[1:]:
        acc = acc + part
    return acc


class RingReduceScatter:
    """One ring reduce-scatter of ``blocks`` (n flat tensors: block j is rank j's
    share) into the flat ``out``, through ``backend``'s send/recv with ``tag``."""

    __slots__ = ("_backend", "_tag", "_rank", "_size", "_blocks", "_out", "_result", "_issued_ns", "_done",
                 "_error", "_chunk")

    def __init__(self, backend: Any, tag: int, rank: int, size: int, blocks: List[torch.Tensor], out: torch.Tensor,
                 stage: bool) -> None:
        self._backend = backend
        self._tag = tag
        self._rank = rank
        self._size = size
        self._blocks = blocks
        self._out = out
        # written by the ring; with isolation a staging copy, handed over only on success
        self._result = torch.empty_like(out) if stage else out
        self._issued_ns = time.monotonic_ns()
        self._done = False
        self._error: Optional[BaseException] = None
        self._chunk = max(1, CHUNK_BYTES // max(out.element_size(), 1))

    def finisher(self, then: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """The op's finish step: the staged result copied out (with isolation), then ``then``."""
        if self._result is self._out:
            return then
        out, result = self._out, self._result

        def finish() -> None:
            out.copy_(result)
            if then is not None:
                then()

        return finish

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Run the ring within ``timeout`` of its issue (the first call runs it; a later
        one answers how it ended); a backend failure or the deadline raises Gloo's
        ``RuntimeError``."""
        if not self._done:
            limit_s = float("inf") if timeout is None else timeout.total_seconds()
            try:
                self._run(self._issued_ns / 1e9 + limit_s)
            except BaseException as exc:
                self._error = exc
            self._done = True
        if self._error is not None:
            raise self._error
        return True

    def _chunks(self) -> List[Tuple[int, int]]:
        m = self._out.numel()
        return [(lo, min(lo + self._chunk, m)) for lo in range(0, m, self._chunk)]

    def _run(self, deadline: float) -> None:
        n, r, backend, tag = self._size, self._rank, self._backend, self._tag
        right, left = (r + 1) % n, (r - 1) % n
        chunks = self._chunks()
        k_count = len(chunks)
        m = self._out.numel()
        # two receive buffers, alternating by step; step s's buffer is sent on in step s+1
        bufs = torch.empty((min(n - 1, 2), m), dtype=self._out.dtype)
        units = [(s, k) for s in range(n - 1) for k in range(k_count)]
        sends: Dict[Tuple[int, int], Any] = {}  # (step, chunk) -> its send (a reused buffer waits for it)
        recvs: Dict[int, Any] = {}  # unit index -> its receive work

        def post(i: int) -> None:
            s, k = units[i]
            lo, hi = chunks[k]
            if s >= 2:  # the chunk of this buffer that step s-1 sent must be out first
                _wait(sends.pop((s - 1, k)), deadline)
            recvs[i] = backend.recv([bufs[s % 2, lo:hi]], left, tag)

        # a receive into a reused buffer waits for the send posted two steps earlier: at most 2 steps ahead
        window = min(_WINDOW, 2 * k_count)
        for i in range(min(window, len(units))):  # receives first: the peer may send at once
            post(i)
        first = self._blocks[(r - 1) % n]
        pending = [backend.send([first[lo:hi]], right, tag) for lo, hi in chunks]
        for i, (s, k) in enumerate(units):
            _wait(recvs.pop(i), deadline)
            lo, hi = chunks[k]
            got = bufs[s % 2, lo:hi]
            own = self._blocks[(r - s - 2) % n][lo:hi]
            if s < n - 2:
                _add(got, own, got)
                sends[(s + 1, k)] = backend.send([got], right, tag)
            else:
                _add(got, own, self._result[lo:hi])
            if i + window < len(units):
                post(i + window)
        for work in pending + list(sends.values()):
            _wait(work, deadline)


def _add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a + b`` (flat tensors), piece by piece on the calling thread."""
    for lo in range(0, a.numel(), _PIECE):
        hi = lo + _PIECE
        torch.add(a[lo:hi], b[lo:hi], out=out[lo:hi])


def _wait(work: Any, deadline: float) -> None:
    """Wait for one point-to-point work until the op's deadline (Gloo raises on expiry)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise RuntimeError("ring reduce-scatter timed out")
    work.wait(timedelta(seconds=min(left, 1e9)))
