"""The collectives of a ``Communicator``: ``Collectives``, one method per op.

Each method checks its arguments (``validation``), builds the backend call
over the tensors as ``wire`` prepares them, and hands it to ``OpPath._run``;
the three the direct path serves try ``_direct_run`` first, and an async
all-reduce or all-gather ``_native_async``.  Reduce-scatter
may run as commslayer's own ring (``commslayer.comm.ring``) where that pays.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch._C import _distributed_c10d as c10d

from commslayer.hooks import OpIO
from commslayer.comm.op_path import OpPath
from commslayer.reduce_op import ReduceOp
from commslayer.comm.ring import RingReduceScatter, ring_tag
from commslayer.comm.validation import Checker, Timeout
from commslayer.comm.wire import averaging, in_place, premultiplied, wire
from commslayer.comm.work import Work


class Collectives(OpPath):
    """The ops every member of the group calls (see ``Communicator`` for the list)."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``tensor`` across ranks, in place (a sparse COO one too: ``_all_reduce_sparse``)."""
        if self._direct and op is ReduceOp.SUM and async_op is False and timeout is None and self._dense(tensor):
            return self._direct_run(0, tensor, tensor, op)
        if async_op is True and timeout is None and self._async_path is not None \
                and (op is ReduceOp.SUM or op is ReduceOp.AVG):
            work = self._native_async(0, tensor, tensor, op)
            if work is not None:
                return work
        chk = self._checker("all_reduce")
        if getattr(tensor, "is_sparse", False):
            return self._all_reduce_sparse(chk, tensor, op, async_op, timeout)
        chk.tensor(tensor, "tensor")
        op = chk.reduce_op(op, tensor.dtype)
        opts = self._options.get(c10d.AllreduceOptions, op)
        return self._run(chk, OpIO((tensor,), (tensor,), op, None),
                         in_place(self._ops.allreduce, [wire(tensor)], op, opts), opts=opts,
                         finish=averaging(tensor, op, self._size), fp=self._fp(chk.op, tensor, op),
                         timeout=timeout, async_op=async_op)

    def _all_reduce_into(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        """An async all-reduce of ``input`` whose result goes to ``output`` (of its dtype
        and shape), ``input`` left as it is.  On the native path the backend reads
        ``input`` itself (into the staging copy, where writes are isolated): one pass
        over the data fewer than copying it to ``output`` and reducing that, which is
        what the other paths do (replica mode's gradient average, ``Replicas.start``)."""
        if self._async_path is not None and (op is ReduceOp.SUM or op is ReduceOp.AVG):
            work = self._native_async(0, output, input, op)
            if work is not None:
                return work
        output.copy_(input)
        return self.all_reduce(output, op, async_op=True)

    def all_reduce_coalesced(self, tensors: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                             async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce each of ``tensors`` (one dtype) across ranks, in place, as one op on the wire."""
        chk = self._checker("all_reduce_coalesced")
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise chk.fail(f"tensors must be a non-empty list of tensors, got {tensors!r}")
        for i, t in enumerate(tensors):
            chk.tensor(t, f"tensors[{i}]")
            chk.same_dtype(t, tensors[0], f"tensors[{i}] and tensors[0]")
        op = chk.reduce_op(op, tensors[0].dtype)
        finishes = [f for f in (averaging(t, op, self._size) for t in tensors) if f is not None]

        def finish() -> None:
            for f in finishes:
                f()

        opts = self._options.get(c10d.AllreduceCoalescedOptions, op)
        fp = self._fp(chk.op, tensors[0], op, extra_shape=[t.numel() for t in tensors])
        issue = in_place(self._ops.allreduce_coalesced, [wire(t) for t in tensors], op, opts)
        return self._run(chk, OpIO(tuple(tensors), tuple(tensors), op, None), issue, opts=opts,
                         finish=finish if finishes else None, fp=fp, timeout=timeout, async_op=async_op)

    def _all_reduce_sparse(self, chk: Checker, tensor: torch.Tensor, op: ReduceOp, async_op: bool,
                           timeout: Timeout) -> Work:
        """The backend's own reduction of a sparse COO tensor, in place (Gloo: sums only)."""
        chk.sparse(tensor, "tensor")
        op = chk.reduce_op(op, tensor.dtype)
        if op.name != "SUM" or self._spec.name != "gloo":
            raise chk.fail(f"a sparse tensor is reduced with ReduceOp.SUM on Gloo only, not {op} on "
                           f"{self._spec.name}")
        opts = self._options.get(c10d.AllreduceOptions, op)
        return self._run(chk, OpIO((tensor,), (tensor,), op, None), lambda: self._ops.allreduce([tensor], opts),
                         opts=opts, fp=self._fp(chk.op, tensor, op), timeout=timeout, async_op=async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, *,
                          async_op: bool = False, timeout: Timeout = None) -> Work:
        """Concatenate every rank's ``input`` into ``output`` (``size`` times larger)."""
        if self._direct and async_op is False and timeout is None and self._dense_sized(output, input):
            return self._direct_run(1, output, input, None)
        if async_op is True and timeout is None and self._async_path is not None:
            work = self._native_async(1, output, input, None)
            if work is not None:
                return work
        chk = self._checker("all_gather_single")
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        chk.sized(output, input, "output input")
        opts = self._options.get(c10d.AllgatherOptions)
        return self._run(chk, OpIO((input,), (output,), None, None),
                         lambda: self._ops._allgather_base(wire(output), wire(input), opts), opts=opts,
                         fp=self._fp(chk.op, input), timeout=timeout, async_op=async_op)

    def all_gather_v(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, *,
                     async_op: bool = False, timeout: Timeout = None) -> Work:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]``, where the ranks'
        tensors may differ in size (``tensor_list[j]`` holds rank j's). One all-to-all
        on the wire (Gloo's all-gather takes equal sizes only): each rank sends a copy of
        its tensor per rank, and the result is copied out of one receive buffer."""
        chk = self._checker("all_gather_v")
        chk.tensor(tensor, "tensor")
        outs = chk.tensor_list(tensor_list, "tensor_list", tensor, uneven=True)
        send = wire(tensor).reshape(-1)
        counts = [wire(o).numel() for o in outs]
        sends = [send.numel()] * self._size
        fp = self._fp(chk.op, tensor, extra_shape=[])
        if fp is not None:  # check mode compares what each rank sends with what its peers expect
            fp["splits"] = [sends, counts]
        received = torch.empty(sum(counts), dtype=send.dtype, device=send.device)
        pieces = [wire(o).view(-1) for o in outs]

        def finish() -> None:
            for piece, part in zip(pieces, received.split(counts)):
                piece.copy_(part)

        opts = self._options.get(c10d.AllToAllOptions)
        return self._run(chk, OpIO((tensor,), tuple(outs), None, None),
                         lambda: self._ops.alltoall_base(received, send.repeat(self._size), counts, sends, opts),
                         opts=opts, finish=finish, fp=fp, timeout=timeout, async_op=async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                              async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input`` across ranks and leave this rank's slice in ``output``."""
        if self._direct and op is ReduceOp.SUM and async_op is False and timeout is None \
                and self._dense_sized(input, output) \
                and not self._takes_ring(op, output, input.nbytes):
            return self._direct_run(2, output, input, op)
        chk = self._checker("reduce_scatter_single")
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        op = chk.reduce_op(op, input.dtype)
        chk.sized(input, output, "input output")
        src = premultiplied(input, op)
        opts = self._options.get(c10d.ReduceScatterOptions, op)
        ring = self._takes_ring(op, output, input.nbytes)
        issue: Callable[[], Any] = (lambda: self._ring(list(wire(src).reshape(self._size, -1).unbind(0)), output)) \
            if ring else (lambda: self._ops._reduce_scatter_base(wire(output), wire(src), opts))
        return self._run(chk, OpIO((input,), (output,), op, None), issue, opts=opts,
                         finish=averaging(output, op, self._size), fp=self._fp(chk.op, output, op),
                         timeout=timeout, async_op=async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[Sequence[int]] = None,
                          input_split_sizes: Optional[Sequence[int]] = None, *,
                          async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send slice j of ``input`` (dim 0, by ``input_split_sizes``, even when None) to rank j."""
        return self._all_to_all(self._checker("all_to_all_single"), output, input, output_split_sizes,
                                input_split_sizes, async_op, timeout)

    def all_to_all_v_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                            input_split_sizes: Sequence[int], *, async_op: bool = False,
                            timeout: Timeout = None) -> Work:
        """Send slice j of ``input`` (dim 0, by ``input_split_sizes``) to rank j, and
        receive rank j's into slice j of ``output`` (by ``output_split_sizes``)."""
        chk = self._checker("all_to_all_v_single")
        for what, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
            if splits is None:
                raise chk.fail(f"{what} is required (all_to_all_single splits evenly)")
        return self._all_to_all(chk, output, input, output_split_sizes, input_split_sizes, async_op, timeout)

    def _all_to_all(self, chk: Checker, output: torch.Tensor, input: torch.Tensor,
                    output_split_sizes: Optional[Sequence[int]], input_split_sizes: Optional[Sequence[int]],
                    async_op: bool, timeout: Timeout) -> Work:
        chk.tensor(output, "output")
        chk.tensor(input, "input")
        chk.same_dtype(output, input, "output and input")
        if output.dim() == 0 or input.dim() == 0:
            raise chk.fail("output and input need at least one dimension")
        if output.shape[1:] != input.shape[1:]:
            raise chk.fail(f"output and input differ beyond dim 0: {list(output.shape)} vs {list(input.shape)}")
        out_splits = chk.splits(output_split_sizes, "output_split_sizes", output.shape[0])
        in_splits = chk.splits(input_split_sizes, "input_split_sizes", input.shape[0])
        if out_splits is None and in_splits is None and output.shape[0] != input.shape[0]:
            raise chk.fail(f"with even splits output and input need the same dim 0 "
                           f"({output.shape[0]} vs {input.shape[0]})")
        fp = self._fp(chk.op, input, extra_shape=list(input.shape[1:]))
        if fp is not None:  # check mode
            even_in = [input.shape[0] // self._size] * self._size
            even_out = [output.shape[0] // self._size] * self._size
            fp["splits"] = [in_splits or even_in, out_splits or even_out]
        opts = self._options.get(c10d.AllToAllOptions)
        return self._run(chk, OpIO((input,), (output,), None, None),
                         lambda: self._ops.alltoall_base(wire(output), wire(input), out_splits or [],
                                                         in_splits or [], opts), opts=opts,
                         fp=fp, timeout=timeout, async_op=async_op)

    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, *,
                   async_op: bool = False, timeout: Timeout = None) -> Work:
        """Gather every rank's ``tensor`` into ``tensor_list[rank]``."""
        chk = self._checker("all_gather")
        chk.tensor(tensor, "tensor")
        outs = chk.tensor_list(tensor_list, "tensor_list", tensor)
        opts = self._options.get(c10d.AllgatherOptions)
        return self._run(chk, OpIO((tensor,), tuple(outs), None, None),
                         lambda: self._ops.allgather([[wire(o) for o in outs]], [wire(tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, tensor), timeout=timeout, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input_list: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input_list[j]`` across ranks into rank j's ``output``."""
        chk = self._checker("reduce_scatter")
        chk.tensor(output, "output")
        ins = chk.tensor_list(input_list, "input_list", output)
        op = chk.reduce_op(op, output.dtype)
        return self._reduce_scatter(chk, output, ins, op, self._fp(chk.op, output, op), async_op, timeout, False)

    def reduce_scatter_v(self, output: torch.Tensor, input_list: List[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``input_list[j]`` across ranks into rank j's ``output``, where the ranks'
        outputs may differ in size (``input_list[j]`` is shaped like rank j's output)."""
        chk = self._checker("reduce_scatter_v")
        chk.tensor(output, "output")
        ins = chk.tensor_list(input_list, "input_list", output, uneven=True)
        op = chk.reduce_op(op, output.dtype)
        fp = self._fp(chk.op, output, op, extra_shape=[])
        if fp is not None:  # check mode compares what each rank sends with what its peers expect
            fp["splits"] = [[t.numel() for t in ins], [output.numel()] * self._size]
        return self._reduce_scatter(chk, output, ins, op, fp, async_op, timeout, True)

    def _reduce_scatter(self, chk: Checker, output: torch.Tensor, ins: List[torch.Tensor], op: ReduceOp,
                        fp: Optional[Dict[str, Any]], async_op: bool, timeout: Timeout, uneven: bool) -> Work:
        """Both list forms: the ring where the blocks are even and it pays (``_takes_ring``)."""
        ins = [premultiplied(t, op) for t in ins]
        opts = self._options.get(c10d.ReduceScatterOptions, op)
        ring = not uneven and self._takes_ring(op, output, output.numel() * output.element_size() * self._size)
        issue: Callable[[], Any] = (lambda: self._ring([wire(t).reshape(-1) for t in ins], output)) \
            if ring else (lambda: self._ops.reduce_scatter([wire(output)], [[wire(t) for t in ins]], opts))
        return self._run(chk, OpIO(tuple(ins), (output,), op, None), issue, opts=opts,
                         finish=averaging(output, op, self._size), fp=fp, timeout=timeout, async_op=async_op)

    def _ring(self, blocks: List[torch.Tensor], output: torch.Tensor) -> RingReduceScatter:
        """The ring reduce-scatter of ``blocks`` into ``output`` (run by ``_run`` on the ring thread);
        with write isolation it reduces into a staging copy."""
        return RingReduceScatter(self._backend, ring_tag(self._seq), self._rank, self._size, blocks,
                                 wire(output).view(-1),
                                 stage=self._ops is not self._backend)

    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Copy ``root``'s ``tensor`` into every rank's."""
        chk = self._checker("broadcast")
        chk.tensor(tensor, "tensor")
        root = chk.rank_arg(root, "root")
        opts = self._options.get(c10d.BroadcastOptions, root=root)
        return self._run(chk, OpIO((tensor,), (tensor,), None, root),
                         lambda: self._ops.broadcast([wire(tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, tensor, root=root), timeout=timeout, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False, timeout: Timeout = None) -> Work:
        """Reduce ``tensor`` across ranks into ``root``'s (others' are left undefined)."""
        chk = self._checker("reduce")
        chk.tensor(tensor, "tensor")
        root = chk.rank_arg(root, "root")
        op = chk.reduce_op(op, tensor.dtype)
        opts = self._options.get(c10d.ReduceOptions, op, root)
        return self._run(chk, OpIO((tensor,), (tensor,), op, root),
                         in_place(self._ops.reduce, [wire(tensor)], op, opts), opts=opts,
                         finish=averaging(tensor, op, self._size) if root == self._rank else None,
                         fp=self._fp(chk.op, tensor, op, root=root), timeout=timeout, async_op=async_op)

    def gather(self, output_tensor_list: Optional[List[torch.Tensor]], input_tensor: torch.Tensor, root: int, *,
               async_op: bool = False, timeout: Timeout = None) -> Work:
        """Collect every rank's ``input_tensor`` into ``root``'s ``output_tensor_list``."""
        chk = self._checker("gather")
        chk.tensor(input_tensor, "input_tensor")
        root = chk.rank_arg(root, "root")
        outs = chk.root_list(output_tensor_list, "output_tensor_list", root, input_tensor)
        opts = self._options.get(c10d.GatherOptions, root=root)
        wire_outs = [[wire(o) for o in outs]] if outs else []
        return self._run(chk, OpIO((input_tensor,), tuple(outs), None, root),
                         lambda: self._ops.gather(wire_outs, [wire(input_tensor)], opts), opts=opts,
                         fp=self._fp(chk.op, input_tensor, root=root), timeout=timeout, async_op=async_op)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, root: int, *,
                      async_op: bool = False, timeout: Timeout = None) -> Work:
        """Collect every rank's ``input`` into ``root``'s ``output`` (``size`` times as many
        elements, rank j's in the j-th block); other ranks' ``output`` is not touched."""
        chk = self._checker("gather_single")
        chk.tensor(input, "input")
        root = chk.rank_arg(root, "root")
        wire_outs: List[List[torch.Tensor]] = []
        outs: Tuple[torch.Tensor, ...] = ()
        if root == self._rank:
            chk.tensor(output, "output")
            chk.same_dtype(output, input, "output and input")
            chk.sized(output, input, "output input")
            wire_outs = [list(wire(output).view(self._size, *wire(input).shape).unbind(0))]
            outs = (output,)
        opts = self._options.get(c10d.GatherOptions, root=root)
        return self._run(chk, OpIO((input,), outs, None, root),
                         lambda: self._ops.gather(wire_outs, [wire(input)], opts), opts=opts,
                         fp=self._fp(chk.op, input, root=root), timeout=timeout, async_op=async_op)

    def scatter(self, output_tensor: torch.Tensor, input_tensor_list: Optional[List[torch.Tensor]], root: int, *,
                async_op: bool = False, timeout: Timeout = None) -> Work:
        """Send ``root``'s ``input_tensor_list[j]`` to rank j's ``output_tensor``."""
        chk = self._checker("scatter")
        chk.tensor(output_tensor, "output_tensor")
        root = chk.rank_arg(root, "root")
        ins = chk.root_list(input_tensor_list, "input_tensor_list", root, output_tensor)
        opts = self._options.get(c10d.ScatterOptions, root=root)
        wire_ins = [[wire(t) for t in ins]] if ins else []
        return self._run(chk, OpIO(tuple(ins), (output_tensor,), None, root),
                         lambda: self._ops.scatter([wire(output_tensor)], wire_ins, opts), opts=opts,
                         fp=self._fp(chk.op, output_tensor, root=root), timeout=timeout, async_op=async_op)

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work:
        """Return once every rank has entered the barrier."""
        chk = self._checker("barrier")
        opts = self._barrier_opts
        return self._run(chk, OpIO((), (), None, None), lambda: self._ops.barrier(opts), opts=opts,
                         fp={"op": "barrier"}, timeout=timeout, async_op=async_op)
