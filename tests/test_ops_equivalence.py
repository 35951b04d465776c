"""Every op x dtype x size x reduce op: commslayer's result equals plain c10d's
on the same inputs, bitwise, at world sizes 2 and 3, sync and async.  At 3 ranks
reduce-scatter runs Gloo's own algorithm: the ring (commslayer/comm/ring.py, the
default for large sums) adds in another order there (tests/test_ring_reduce_scatter.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
SIZES = [0, 1, 4096, 1 << 20]


def _reduce_ops(dtype):
    from commslayer import ReduceOp

    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    if dtype.is_floating_point:
        return ops + [ReduceOp.AVG, ReduceOp.PREMUL_SUM(0.5)]
    ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops if dtype == torch.bool else ops + [ReduceOp.AVG]


def _make(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def _plain_reduce(plain_fn, x, op, size):
    """Run plain c10d for our ``op``: AVG on integers and PREMUL_SUM have no Gloo op, so
    the reference is SUM followed (AVG: truncating division) or preceded (PREMUL) by scaling."""
    if op.name == "PREMUL_SUM":
        x = x * op.factor
        plain_fn(x, dist.ReduceOp.SUM)
        return x
    if op.name == "AVG" and not x.dtype.is_floating_point:
        plain_fn(x, dist.ReduceOp.SUM)
        return torch.div(x, size, rounding_mode="trunc")
    plain_fn(x, getattr(dist.ReduceOp, op.name))
    return x


def _matrix(rank, size, store, async_op):
    import commslayer

    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=rank, world_size=size)
    comm = commslayer.new_comm("gloo", name="eq", store=store, rank=rank, size=size, timeout=60)
    failures, compared = [], 0

    def run(work):
        if async_op:
            assert work.status in (commslayer.WorkStatus.INPROGRESS, commslayer.WorkStatus.COMPLETED)
            work.wait()
        assert work.status == commslayer.WorkStatus.COMPLETED and work.is_completed()

    def same(what, ours, ref):
        nonlocal compared
        compared += 1
        if not (ours.dtype == ref.dtype and ours.shape == ref.shape and torch.equal(ours, ref)):
            failures.append(f"rank {rank}: {what}")

    for dtype in DTYPES:
        for n in SIZES:
            seed = 7919 * rank + n + 31 * DTYPES.index(dtype)
            x = _make(n, dtype, seed)
            big = _make(n * size, dtype, seed + 1)
            root = size - 1
            for op in _reduce_ops(dtype):
                tag = f"{dtype} n={n} {op}"
                a = x.clone()
                run(comm.all_reduce(a, op, async_op=async_op))
                same(f"all_reduce {tag}", a, _plain_reduce(lambda t, o: dist.all_reduce(t, o), x.clone(), op, size))

                out = torch.empty(n, dtype=dtype)
                src = big.clone()
                run(comm.reduce_scatter_single(out, src, op, async_op=async_op))
                same(f"reduce_scatter_single input untouched {tag}", src, big)
                ref = torch.empty(n, dtype=dtype)
                if op.name == "PREMUL_SUM":
                    dist.reduce_scatter_tensor(ref, big * op.factor, dist.ReduceOp.SUM)
                elif op.name == "AVG" and not dtype.is_floating_point:
                    dist.reduce_scatter_tensor(ref, big.clone(), dist.ReduceOp.SUM)
                    ref = torch.div(ref, size, rounding_mode="trunc")
                else:
                    dist.reduce_scatter_tensor(ref, big.clone(), getattr(dist.ReduceOp, op.name))
                same(f"reduce_scatter_single {tag}", out, ref)

                a = x.clone()
                run(comm.reduce(a, root, op, async_op=async_op))
                ref = _plain_reduce(lambda t, o: dist.reduce(t, root, o), x.clone(), op, size)
                if rank == root:
                    same(f"reduce {tag}", a, ref)

                if op.name not in ("AVG", "PREMUL_SUM"):
                    chunks = [c.clone() for c in big.chunk(size)] if n else [x.clone() for _ in range(size)]
                    out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    run(comm.reduce_scatter(out, chunks, op, async_op=async_op))
                    dist.reduce_scatter(ref, [c.clone() for c in chunks], getattr(dist.ReduceOp, op.name))
                    same(f"reduce_scatter(list) {tag}", out, ref)

            tag = f"{dtype} n={n}"
            out, ref = torch.empty(n * size, dtype=dtype), torch.empty(n * size, dtype=dtype)
            run(comm.all_gather_single(out, x, async_op=async_op))
            dist.all_gather_into_tensor(ref, x)
            same(f"all_gather_single {tag}", out, ref)

            outs, refs = [torch.empty(n, dtype=dtype) for _ in range(size)], [torch.empty(n, dtype=dtype)
                                                                               for _ in range(size)]
            run(comm.all_gather(outs, x, async_op=async_op))
            dist.all_gather(refs, x)
            same(f"all_gather(list) {tag}", torch.cat(outs), torch.cat(refs))

            out, ref = torch.empty(n * size, dtype=dtype), torch.empty(n * size, dtype=dtype)
            run(comm.all_to_all_single(out, big, async_op=async_op))
            dist.all_to_all_single(ref, big)
            same(f"all_to_all_single even {tag}", out, ref)

            # uneven: rank r sends (r + j) % 3 + k rows to rank j, with k chosen so rows sum right
            send = [((rank + j) % 3) * (n > 0) for j in range(size)]
            recv = [((j + rank) % 3) * (n > 0) for j in range(size)]
            inp = _make(sum(send), dtype, seed + 2)
            out, ref = torch.empty(sum(recv), dtype=dtype), torch.empty(sum(recv), dtype=dtype)
            run(comm.all_to_all_single(out, inp, recv, send, async_op=async_op))
            dist.all_to_all_single(ref, inp, recv, send)
            same(f"all_to_all_single uneven {tag}", out, ref)

            a, b = x.clone(), x.clone()
            run(comm.broadcast(a, 1, async_op=async_op))
            dist.broadcast(b, 1)
            same(f"broadcast {tag}", a, b)

            outs = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == 0 else None
            refs = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == 0 else None
            run(comm.gather(outs, x, 0, async_op=async_op))
            dist.gather(x, refs, 0)
            if rank == 0:
                same(f"gather {tag}", torch.cat(outs), torch.cat(refs))

            ins = [c.clone() for c in big.chunk(size)] if rank == root and n else (
                [x.clone() for _ in range(size)] if rank == root else None)
            out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            run(comm.scatter(out, ins, root, async_op=async_op))
            dist.scatter(ref, ins, root)
            same(f"scatter {tag}", out, ref)

            # a ring of send/recv
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            got, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            if rank % 2 == 0:
                run(comm.send(x, nxt, async_op=async_op))
                run(comm.recv(got, prv, async_op=async_op))
                dist.send(x, nxt)
                dist.recv(ref, prv)
            else:
                run(comm.recv(got, prv, async_op=async_op))
                run(comm.send(x, nxt, async_op=async_op))
                dist.recv(ref, prv)
                dist.send(x, nxt)
            same(f"send/recv {tag}", got, ref)
    run(comm.barrier(async_op=async_op))
    return failures, compared


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_every_op_matches_plain_c10d(size, async_op):
    env = {"COMMSLAYER_REDUCE_SCATTER": "native"} if size > 2 else None
    results = run_ranks(_matrix, size, async_op, timeout=200, env=env)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:40])
    assert all(count > 500 for _, count in results)
