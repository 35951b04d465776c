"""A step's gradients averaged across the live replica groups: in buckets, begun during backward.

``commslayer.train.job.Job.step`` hands the average to ``Replicas.average``, which
commits it on every live replica or redoes it on the survivors.  This module
decides what is averaged and when it starts, by what wraps each registered
module:

- FSDP2 (``fully_shard``): each FSDP module's reduce-scatter output, this
  rank's shard of its gradients already averaged inside the replica group, is
  handed to us by ``FSDPModule.set_all_reduce_hook``; once such outputs add up
  to ``bucket_bytes``, their cross-replica average starts, as one bucket,
  while backward goes on with the layers below (the rest at ``step``).  FSDP
  views the sharded gradients into those outputs, so the average is written
  back into them in place.
- DDP: a comm hook runs DDP's own in-group average (torch's default
  ``allreduce_hook``).  The cross-replica average does not follow DDP's
  buckets: DDP rebuilds them after a process's first iteration, so a
  restarted replica's buckets differ from the survivors' for one step, and
  averaging bucket with bucket would mix different parameters.  It follows
  chunks of the parameters in a fixed order (reversed, the order backward
  produces them, up to ``bucket_bytes`` each) instead: a chunk starts once
  every parameter in it has its in-group average (checked at each DDP
  bucket, and at ``step`` for the rest), chunk after chunk in the same order
  on every rank.
- Anything else (and any gradient the above did not cover, e.g. one cast to
  another dtype after the reduce-scatter): after backward, packed into flat
  buckets of at most ``bucket_bytes``, all in flight together.
- A step whose gradients accumulate over several backward passes (without
  DDP's ``no_sync`` or FSDP2's ``set_requires_gradient_sync(False)``): what
  began during the first pass holds that pass alone, so it is waited for and
  not written, and every gradient is averaged after the last pass, as above.

Which path a gradient takes follows from the model's structure, so it is the
same on every rank, and the collectives on the replicate communicator are
issued in the same order everywhere.  Without a second replica group there is
nothing to begin early and no hook is installed.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from commslayer.train.replicas import Replicas, Started


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, as a view)."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class _Early:
    """A buffer whose cross-replica average began during backward."""

    buffer: torch.Tensor  # the in-group average (its values stay local: the redo after a loss reads them)
    started: Started
    write: Callable[[torch.Tensor], None]  # puts the cross-replica average where the gradients are
    params: Tuple[torch.Tensor, ...] = ()  # the parameters whose gradients ``write`` sets (DDP)
    shards: Tuple[torch.Tensor, ...] = ()  # the FSDP reduce-scatter outputs ``write`` sets (the gradients view them)


class _DdpChunks:
    """A DDP module's parameters in the fixed chunks of their cross-replica average."""

    def __init__(self, module: nn.Module, bucket_bytes: int) -> None:
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.chunks = [tuple(params[i] for i in idx) for idx in bucket_layout(params, bucket_bytes)]
        self.group: dist.ProcessGroup = getattr(module, "process_group")  # a DistributedDataParallel's
        self.next = 0  # the first chunk not started this step
        self.done: Dict[int, torch.Tensor] = {}  # id(param) -> its in-group average, this step
        # DDP buckets whose in-group average is in flight: (their parameters, views of their gradients, the future)
        self.pending: List[Tuple[Tuple[torch.Tensor, ...], List[torch.Tensor], torch.futures.Future]] = []

    def reset(self) -> None:
        self.next, self.done, self.pending = 0, {}, []


class GradientAverage:
    """The cross-replica gradient average of one job (see the module doc)."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.replicas: Optional[Replicas] = None  # set while steps run; hooks do nothing without it
        self._early: List[_Early] = []
        self._shards: List[torch.Tensor] = []  # FSDP reduce-scatter outputs not started yet (under bucket_bytes)
        self._shard_bytes = 0
        self._ddp: List[_DdpChunks] = []  # one per DDP module attached
        # gradients accumulated over several backward passes of a step (_note_backward)
        self._in_backward = False  # a backward of this step is under way, its end to be told
        self._backward_ended = False  # one ended: a hook after it is a later pass's
        self._accumulating = False
        self._stale: List[_Early] = []  # begun before the gradients accumulated: waited for, not written

    # ------------------------------------------------------------------ hooks
    def attach(self, module: nn.Module) -> bool:
        """Begin averages during ``module``'s backward where its wrapper allows it;
        whether a hook was installed."""
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            chunks = _DdpChunks(module, self.bucket_bytes)
            try:
                module.register_comm_hook(chunks, self._on_ddp_bucket)
            except RuntimeError:  # the user registered a comm hook of their own: we average after backward
                return False
            self._ddp.append(chunks)
            return True
        hooked = False
        for m in module.modules():
            if isinstance(m, FSDPModule):
                try:
                    m.set_all_reduce_hook(self._on_fsdp_shard)
                    hooked = True
                except ValueError:  # several parameter groups: we average after backward
                    pass
        return hooked

    @property
    def _live(self) -> Replicas:
        assert self.replicas is not None, "only while steps run"
        return self.replicas

    def _note_backward(self) -> bool:
        """A hook ran: whether the step's gradients accumulate over several backward passes
        (this is a pass after one that ended).  Each pass adds into the gradients the first
        one's outputs hold, so the averages begun so far hold the first pass alone: from
        there on nothing begins early, and the whole average is of the sums, at ``step``."""
        if self._backward_ended and not self._accumulating:
            self._accumulating = True
            for chunks in self._ddp:  # every chunk of the first pass, as on every rank (timing decided how many
                self._start_ddp(chunks, wait=True)  # had begun); the FSDP outputs not begun are the same everywhere
                chunks.next = len(chunks.chunks)
            self._stale, self._early = self._early, []
            self._shards, self._shard_bytes = [], 0
        elif not self._in_backward and not self._accumulating:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
        return self._accumulating

    def _backward_ends(self) -> None:
        self._in_backward, self._backward_ended = False, True

    def _on_fsdp_shard(self, reduce_output: torch.Tensor) -> None:
        # FSDP may still divide this output after the hook (its post-divide factor, for a reduce
        # dtype at risk of overflow), so its average starts at the next module's hook, or at step.
        if self.replicas is None or self._note_backward():
            return
        if self._shards and (self._shard_bytes >= self.bucket_bytes or reduce_output.dtype != self._shards[0].dtype):
            self._start_shards()  # full, or a bucket holds one dtype
        self._shards.append(reduce_output)
        self._shard_bytes += reduce_output.numel() * reduce_output.element_size()

    def _start_shards(self, extra: Optional[torch.Tensor] = None) -> bool:
        """Start the cross-replica average of the FSDP outputs gathered so far, as one
        bucket: one all-reduce per ``bucket_bytes``, not per FSDP module (each op has a
        fixed cost that a small module's transfer does not repay). ``extra`` (``step``'s
        loss) goes at the bucket's end, sparing it an all-reduce of its own, where the
        bucket is a copy anyway (several outputs) of its dtype; whether it went."""
        if not self._shards:
            return False
        shards = tuple(self._shards)
        self._shards, self._shard_bytes = [], 0
        tail = [extra.reshape(-1)] if extra is not None and len(shards) > 1 and extra.dtype == shards[0].dtype \
            else []
        flat = torch.cat([t.reshape(-1) for t in shards] + tail) if len(shards) > 1 else shards[0]
        layout = [list(range(len(shards)))]
        self._early.append(_Early(flat, self._live.start(flat), lambda avg: unpack([avg], layout, shards),
                                  shards=shards))
        return bool(tail)

    def _on_ddp_bucket(self, chunks: _DdpChunks,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # (DDP checks the hints)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        views = bucket.gradients()  # into the buffer the in-group average is written to
        future = allreduce_hook(chunks.group, bucket)
        if self.replicas is not None and not self._note_backward():
            chunks.pending.append((tuple(bucket.parameters()), views, future))
            self._start_ddp(chunks, wait=False)
        return future

    def _start_ddp(self, chunks: _DdpChunks, *, wait: bool) -> None:
        """Start the cross-replica average of every next chunk whose parameters all have
        their in-group average (``wait``: wait for every DDP bucket first)."""
        for entry in list(chunks.pending):
            params, views, future = entry
            if wait or future.done():
                future.wait()
                chunks.pending.remove(entry)
                chunks.done.update((id(p), v) for p, v in zip(params, views))
        while chunks.next < len(chunks.chunks) and all(id(p) in chunks.done for p in chunks.chunks[chunks.next]):
            params = chunks.chunks[chunks.next]
            chunks.next += 1
            flat = torch.cat([chunks.done[id(p)].reshape(-1) for p in params])
            self._early.append(_Early(flat, self._live.start(flat), partial(_write_chunk, params=params),
                                      params=params))

    # ------------------------------------------------------------------- step
    def average(self, params: Sequence[torch.Tensor], extra: Optional[torch.Tensor],
                step: int) -> Optional[torch.Tensor]:
        """Average the gradients of ``params`` (and ``extra``, a small tensor of the
        same dtype, returned averaged) over the live replica groups, committed, and
        write them back."""
        for chunks in self._ddp if not self._accumulating else ():
            self._start_ddp(chunks, wait=True)
        folded = self._start_shards(extra)
        stale, self._stale = self._stale, []
        early, self._early = self._early, []
        covered = {id(p) for e in early for p in e.params}
        buffers = {t.untyped_storage().data_ptr() for e in early for t in e.shards}
        with torch.no_grad():  # where a DTensor's to_local is its shard, not an autograd call of 10s of us
            grads = [local(p.grad) for p in params if p.grad is not None and id(p) not in covered]
            rest = [g for g in grads if g.untyped_storage().data_ptr() not in buffers]
            buckets, layout = pack(rest, None if folded else extra, self.bucket_bytes)
            started = [e.started for e in stale + early] + [self._live.start(b) for b in buckets]
            averaged = self._live.average([e.buffer for e in stale + early] + buckets, step, started)
            for e, avg in zip(early, averaged[len(stale):]):
                e.write(avg)
            rest_avg = averaged[len(stale) + len(early):]
            unpack(rest_avg, layout, rest)
        if extra is None:
            return None
        # folded: into the bucket _start_shards began last, the last of ``early``
        return (averaged[len(stale) + len(early) - 1] if folded else rest_avg[-1])[-extra.numel():]

    def discard(self) -> None:
        """Forget what backward began (a step that ended without ``average``)."""
        self._early.clear()
        self._shards, self._shard_bytes = [], 0
        for chunks in self._ddp:
            chunks.reset()
        self._stale = []
        self._in_backward = self._backward_ended = self._accumulating = False


def _write_chunk(flat: torch.Tensor, params: Tuple[torch.Tensor, ...]) -> None:
    """Copy a DDP chunk's average into its parameters' gradients."""
    grads = []
    for p in params:
        assert p.grad is not None, "a chunk is started only once all its gradients are in"
        grads.append(p.grad)
    unpack([flat], [list(range(len(grads)))], grads)


def bucket_layout(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> List[List[int]]:
    """The indices of ``tensors`` grouped, in order, into buckets of one dtype and at most
    ``bucket_bytes`` each (a larger tensor gets a bucket of its own)."""
    layout: List[List[int]] = []
    current: List[int] = []
    size, dtype = 0, None
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > bucket_bytes or t.dtype != dtype):
            layout.append(current)
            current, size = [], 0
        current.append(i)
        size, dtype = size + nbytes, t.dtype
    if current:
        layout.append(current)
    return layout


def pack(tensors: Sequence[torch.Tensor], extra: Optional[torch.Tensor],
         bucket_bytes: int) -> Tuple[List[torch.Tensor], List[List[int]]]:
    """``tensors`` (and ``extra`` at the very end) packed into flat buckets of one dtype
    and at most ``bucket_bytes`` each (a larger tensor gets a bucket of its own); with
    the indices of the tensors in each bucket."""
    if not tensors and extra is None:
        return [], []
    layout = bucket_layout(tensors, bucket_bytes) or [[]]  # ``extra`` alone: one bucket of it
    buckets: List[torch.Tensor] = []
    for k, idx in enumerate(layout):
        parts = [tensors[i].reshape(-1) for i in idx]
        if extra is not None and k == len(layout) - 1:
            parts.append(extra.reshape(-1).to(parts[0].dtype if parts else extra.dtype))
        buckets.append(torch.cat(parts))
    return buckets, layout


def unpack(buckets: Sequence[torch.Tensor], layout: List[List[int]], tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``pack``'s buckets (averaged) back into ``tensors``."""
    with torch.no_grad():
        for flat, idx in zip(buckets, layout):
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                tensors[i].copy_(flat[offset:offset + n].view_as(tensors[i]))
                offset += n
