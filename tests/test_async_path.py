"""c10d's async ops through the adapter on the native path (``GroupBackend`` and
``AsyncOpWork``, commslayer/comm/direct_path.cpp): real ranks compare every result bitwise with
a plain Gloo group on the same inputs, and hold the path to the guarantees of
the general one: a deadline met by the caller's wait and by the watchdog when
nobody waits, a lost peer named, an error that stays with its op."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch

import commslayer
import faults
import tracing
from commslayer.c10d import group_of
from commslayer.comm import native
from tests.harness import RankDied, run_ranks

needs_native = pytest.mark.skipif(native.why_not() is not None, reason=f"no native path: {native.why_not()}")


def _ops(group, x: torch.Tensor, size: int) -> tuple:
    """Each op the path takes, issued the ways c10d's callers issue it; (results, work types)."""
    import torch.distributed as dist

    n = x.numel() // size
    got, kinds = [], []

    def waited(work):
        kinds.append(type(work).__name__)
        work.wait()

    t = x.clone()
    waited(dist.all_reduce(t, group=group, async_op=True))
    got.append(t)
    gathered = torch.empty(x.numel() * size)
    waited(dist.all_gather_into_tensor(gathered, x, group=group, async_op=True))
    got.append(gathered)
    scattered = torch.empty(n)
    waited(dist.reduce_scatter_tensor(scattered, x, group=group, async_op=True))
    got.append(scattered)
    t = x.clone()  # DDP's way: a future
    dist.all_reduce(t, group=group, async_op=True).get_future().wait()
    got.append(t)
    t = x.clone()  # polled until it ends, then waited
    work = dist.all_reduce(t, group=group, async_op=True)
    while not work.is_completed():
        time.sleep(0.001)
    assert work.is_success()
    waited(work)
    got.append(t)
    t = x.clone()
    dist.all_reduce(t, group=group)  # synchronous
    got.append(t)
    t = x.clone()  # not a sum: the general path
    waited(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))
    got.append(t)
    return got, kinds


def _same_as_plain(rank, size, store):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    plain = dist.new_group(backend="gloo")
    routed = dist.new_group(backend="commslayer")
    x = torch.randn(1001 * size, generator=torch.Generator().manual_seed(rank))
    ref, _ = _ops(plain, x, size)
    got, kinds = _ops(routed, x, size)
    return [torch.equal(a, b) for a, b in zip(ref, got)], kinds, group_of(routed).communicator("cpu")._seq


@needs_native
@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3])
def test_async_ops_take_the_native_path_and_match_plain_gloo_bitwise(size):
    for equal, kinds, seq in run_ranks(_same_as_plain, size, timeout=60):
        assert equal == [True] * 7, equal
        assert kinds == ["AsyncOpWork"] * 4 + ["PythonWork"], kinds
        assert seq == 7  # every op numbered, whichever path it took


@pytest.mark.timeout(90)
def test_without_the_native_module_a_group_takes_the_python_path_and_matches_plain_gloo_bitwise():
    for equal, kinds, seq in run_ranks(_same_as_plain, 2, timeout=60, env={"COMMSLAYER_NATIVE": "0"}):
        assert equal == [True] * 7, equal
        assert kinds == ["C10dWork"] * 5, kinds  # CommslayerProcessGroup's own works
        assert seq == 7


def _python_called(rank, size, store):
    """The Python functions each async op calls while torch.distributed issues it, on a
    plain Gloo group and on a commslayer group."""
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    groups = {"plain": dist.new_group(backend="gloo"), "ours": dist.new_group(backend="commslayer")}
    x = torch.ones(64 * size)
    out = {}
    for name, group in groups.items():
        for _ in range(2):  # the second round: caches warm, nothing imported or built on first use
            called = []

            def profile(frame, event, arg):
                if event == "call":
                    called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

            works = []
            sys.setprofile(profile)
            works.append(dist.all_reduce(x.clone(), group=group, async_op=True))
            works.append(dist.all_gather_into_tensor(torch.empty(64 * size * size), x, group=group, async_op=True))
            works.append(dist.reduce_scatter_tensor(torch.empty(64), x, group=group, async_op=True))
            sys.setprofile(None)
            for work in works:
                work.wait()
        out[name] = (called, [type(w).__name__ for w in works])
    dist.destroy_process_group()
    return out


@needs_native
@pytest.mark.timeout(90)
def test_c10ds_async_ops_on_a_commslayer_group_run_no_python_of_commslayers():
    """The group is c10d's own ProcessGroup and its backend is C++ (GroupBackend): issuing
    FSDP2's and DDP's ops runs the same Python as on plain Gloo, torch's own."""
    for seen in run_ranks(_python_called, 2, timeout=60):
        (plain, plain_kinds), (ours, kinds) = seen["plain"], seen["ours"]
        assert kinds == ["AsyncOpWork"] * 3, kinds
        mine = tuple(os.path.dirname(m.__file__) + os.sep for m in (commslayer, faults, tracing))
        assert not [f for f in ours if f.startswith(mine)], ours
        assert len(ours) == len(plain), (ours, plain)


def _deadline(rank, size, store):
    import torch.distributed as dist

    import commslayer
    from tracing.record.recorder import install

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    rec = install(None, signals=False)  # the flight recorder on: the native path writes the records
    waited = dist.new_group(backend="commslayer", timeout=timedelta(seconds=1))
    unwaited = dist.new_group(backend="commslayer", timeout=timedelta(seconds=1))
    if rank == 1:  # joins neither op
        dist.TCPStore.wait(store, ["done"], timedelta(seconds=30))
        return None
    out = {}
    work = dist.all_reduce(torch.ones(4), group=waited, async_op=True)
    began = time.monotonic()
    try:
        work.wait()
        out["wait"] = "completed"
    except commslayer.CommError as err:
        out["wait"] = (type(err).__name__, err.op, err.seq, time.monotonic() - began, type(work).__name__)
    try:
        work.wait()
    except commslayer.CommError as err:
        out["again"] = type(err).__name__
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=waited)
    except commslayer.CommError as err:
        out["next"] = (type(err).__name__, time.monotonic() - began)
    # nobody waits: the watchdog declares it timed out, and breaks its communicator
    work = dist.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=unwaited, async_op=True)
    time.sleep(2.5)
    failure = group_of(unwaited).communicator("cpu").lifecycle.failure
    out["watchdog"] = None if failure is None else (type(failure).__name__, failure.op)
    try:
        work.wait()
    except commslayer.CommError as err:
        out["later wait"] = type(err).__name__
    out["records"] = sorted((r["comm"].split(":")[1], r["op"], r["seq"], r["state"]) for r in rec.records()
                            if r["comm"].startswith("c10d:") and r["op"] != "barrier")
    store.set("done", "1")
    return out


@needs_native
@pytest.mark.timeout(60)
def test_an_async_op_a_peer_never_joins_ends_at_its_deadline_waited_on_or_not():
    out = run_ranks(_deadline, 2, timeout=45)[0]
    kind, op, seq, took, work = out["wait"]
    assert (kind, op, seq, work) == ("CollectiveTimeout", "all_reduce", 1, "AsyncOpWork"), out
    assert 0.9 < took < 3.0, out
    assert out["again"] == "CollectiveTimeout"  # the error stays with the op
    kind, took = out["next"]
    assert kind == "CollectiveTimeout" and took < 0.5, out  # refused: the communicator is broken
    assert out["watchdog"] == ("CollectiveTimeout", "all_gather_single"), out
    assert out["later wait"] == "CollectiveTimeout", out
    # each op's record taken over from the native ring as it failed, the refused one's too
    records = out["records"]
    assert [r[1:] for r in records] == [("all_reduce", 1, "timed_out"), ("all_reduce", 2, "failed"),
                                        ("all_gather_single", 1, "timed_out")], records


def _recorded(rank, size, store):
    import torch.distributed as dist

    from tracing.record.recorder import install

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    rec = install(None, signals=False)
    group = dist.new_group(backend="commslayer")
    t = torch.ones(1000)
    work = dist.all_reduce(t, group=group, async_op=True)
    time.sleep(0.3)  # it ends meanwhile: its record's end comes before the wait
    work.wait()
    gathered = torch.empty(2000)
    dist.all_gather_into_tensor(gathered, t, group=group)
    value = t[0].item()
    rec._step_begins(None, 7)
    for _ in range(3):  # a thread named and codes known: these records are begun without the GIL (raw_frames)
        dist.all_reduce(t, group=group, async_op=True).wait()
    ops = [r for r in rec.records() if r["comm"] == f"c10d:{group.group_name}:cpu"]
    return type(work).__name__, [(r["op"], r["seq"], r["state"], r["async_op"]) for r in ops[:2]], \
        ops[0]["wait_ns"] - ops[0]["end_ns"], [r["call_site"] for r in ops], [r.get("step") for r in ops], \
        value, rec._native.raw_frames


@needs_native
@pytest.mark.timeout(60)
def test_the_flight_recorder_records_native_async_ops_as_the_general_path_does():
    here = __file__.replace('.pyc', '.py')
    line = _recorded.__code__.co_firstlineno
    for work, ops, late, sites, steps, value, raw_frames in run_ranks(_recorded, 2, timeout=40):
        assert work == "AsyncOpWork" and value == 2.0
        assert ops == [("all_reduce", 1, "completed", True), ("all_gather_single", 2, "completed", True)], ops
        assert late > 0.15e9, late  # the end is the transfer's, not the wait's
        # the caller's line, not torch's or commslayer's
        assert sites == [f"{here}:{line + 9}", f"{here}:{line + 13}"] + [f"{here}:{line + 17}"] * 3, sites
        assert steps == [None, None, 7, 7, 7], steps
        assert raw_frames == (sys.version_info[:2] == (3, 11)), raw_frames


SITES = 4200  # past NativeRing's 4096 codes


def _many_call_sites(rank, size, store):
    import weakref

    import torch.distributed as dist

    from tracing.record.recorder import install

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    rec = install(None, capacity=100, signals=False)
    group = dist.new_group(backend="commslayer")
    t = torch.zeros(4)
    first = None
    for i in range(SITES):  # each function its own code object: more than the ring's map of codes keeps
        namespace: dict = {}
        exec(compile("def site(dist, t, group):\n    dist.all_reduce(t, group=group, async_op=True).wait()\n",
                     f"<site {i}>", "exec"), namespace)
        namespace["site"](dist, t, group)
        if first is None:
            first = weakref.ref(namespace["site"].__code__)
    ops = [r for r in rec.records() if r["comm"] == f"c10d:{group.group_name}:cpu"]
    return [(r["seq"], r["call_site"]) for r in ops], first() is None


@needs_native
@pytest.mark.timeout(90)
def test_the_native_ring_keeps_its_records_call_sites_and_lets_go_of_older_codes():
    """More distinct call sites than the ring's map of codes holds: the records still
    in the ring keep theirs, and the codes no record points to are let go of."""
    for sites, first_gone in run_ranks(_many_call_sites, 2, timeout=70):
        assert sites == [(i + 1, f"<site {i}>:2") for i in range(SITES - 100, SITES)], sites[:3]
        assert first_gone


def _lost(rank, size, store):
    import torch.distributed as dist

    import commslayer

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    group = dist.new_group(backend="commslayer", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(2), group=group)  # both are in: the monitor watches
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8), group=group, async_op=True)
    began = time.monotonic()
    try:
        work.wait()
        return "completed", None, time.monotonic() - began, type(work).__name__
    except commslayer.CommError as err:
        return type(err).__name__, err.ranks, time.monotonic() - began, type(work).__name__


@needs_native
@pytest.mark.timeout(60)
def test_a_peer_killed_during_an_async_op_is_named_within_seconds():
    ours, died = run_ranks(_lost, 2, timeout=45, allow_errors=True)
    assert isinstance(died, RankDied) and died.exitcode == -signal.SIGKILL, died
    kind, ranks, took, work = ours
    assert kind == "PeerLost" and tuple(ranks) == (1,) and took < 5.0 and work == "AsyncOpWork", ours


def _lost_in_flight(rank, size, store):
    """Rank 1 dies while rank 0's op waits for it, rank 0 reading the op's future the way
    DDP's default comm hook does; rank 0's error, its text, and the work's type."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    group = dist.new_group(backend="commslayer", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(2), group=group)
    if rank == 1:
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
    future = work.get_future().then(lambda fut: fut.value()[0])
    try:
        future.wait()
        return "completed", "", type(work).__name__
    except RuntimeError as err:
        return type(err).__name__, str(err), type(work).__name__


@needs_native
@pytest.mark.timeout(90)
def test_a_peer_lost_while_a_future_waits_fails_it_with_peer_lost():
    # The backend fails its future before its work: the op's future used to carry
    # Gloo's raw error, which a resilient job took for the script's own bug.
    for _ in range(2):
        ours, died = run_ranks(_lost_in_flight, 2, timeout=40, allow_errors=True)
        assert isinstance(died, RankDied) and died.exitcode == -signal.SIGKILL, died
        kind, text, work = ours
        assert work == "AsyncOpWork" and "PeerLost: " in text and "pair.cc" not in text.split("PeerLost")[0], ours


def _held(rank, size, store):
    """Rank 1 dies while rank 0 has two async ops in flight on a held group (per-rank
    mode's FSDP2 group: a failure is reported, the step redone), one waited on and one
    read through its future; what rank 0 saw."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    group = dist.new_group(backend="commslayer", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(2), group=group)
    taken: list = []
    group_of(group).hold(taken.append)
    if rank == 1:
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    waited = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
    read = dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
    began = time.monotonic()
    done = waited.wait()
    value = read.get_future().wait()
    return ([type(waited).__name__, type(read).__name__], done, type(value).__name__, time.monotonic() - began,
            [(type(e).__name__, tuple(e.ranks or ())) for e in taken], waited.is_success())


@needs_native
@pytest.mark.timeout(60)
def test_a_held_groups_native_ops_report_a_lost_peer_to_the_hold_instead_of_raising():
    ours, died = run_ranks(_held, 2, timeout=45, allow_errors=True)
    assert isinstance(died, RankDied) and died.exitcode == -signal.SIGKILL, died
    kinds, done, value, took, taken, success = ours
    assert kinds == ["AsyncOpWork", "AsyncOpWork"] and done is True and value == "list" and not success, ours
    assert taken == [("PeerLost", (1,))] * 2 and took < 5.0, ours


def _isolated_and_averaged(rank, size, store):
    """c10d's async ops on a group whose communicator isolates its writes (the resilient
    modes' groups), SUM and AVG (FSDP2's reduce-scatter), float32 and float64, against plain
    Gloo's SUM on the same inputs (divided by the size for AVG, as the general path divides):
    each equal bitwise?, and the type of each work."""
    import torch.distributed as dist

    import commslayer

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    plain = dist.new_group(backend="gloo")
    comm = commslayer.new_comm("gloo", name="isolated", store=dist.PrefixStore("iso/", store), rank=rank,
                               size=size, isolate_writes=True)
    group = comm.as_process_group()
    same, kinds = [], []
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(1001 * size, generator=torch.Generator().manual_seed(rank), dtype=dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            ref = x.clone()
            dist.all_reduce(ref, group=plain)
            got = x.clone()
            work = dist.all_reduce(got, op=op, group=group, async_op=True)
            kinds.append(type(work).__name__)
            work.get_future().wait()  # the future's way, as DDP reads it
            same.append(torch.equal(got, ref if op == dist.ReduceOp.SUM else ref.div_(size)))
            rows = x.view(7 * size, 143)  # a rank's block is whole rows
            ref = torch.empty(7, 143, dtype=dtype)
            dist.reduce_scatter_tensor(ref, rows, group=plain)
            got = torch.empty(7, 143, dtype=dtype)
            work = dist.reduce_scatter_tensor(got, rows, op=op, group=group, async_op=True)
            kinds.append(type(work).__name__)
            work.wait()  # (Gloo's reduce-scatter has no future, and so has none here)
            same.append(torch.equal(got, ref if op == dist.ReduceOp.SUM else ref.div_(size)))
        ref = torch.empty(x.numel() * size, dtype=dtype)
        dist.all_gather_into_tensor(ref, x, group=plain)
        got = torch.empty(x.numel() * size, dtype=dtype)
        work = dist.all_gather_into_tensor(got, x, group=group, async_op=True)
        kinds.append(type(work).__name__)
        while not work.is_completed():  # polled: the result is there once it says so
            time.sleep(0.001)
        same.append(torch.equal(got, ref))
    ints = torch.arange(8, dtype=torch.int64) * (rank + 1)  # an integer AVG truncates: the general path
    work = dist.all_reduce(ints, op=dist.ReduceOp.AVG, group=group, async_op=True)
    kinds.append(type(work).__name__)
    work.wait()  # a rank that left with its op pending would be a peer lost to the other
    return same, kinds


@needs_native
@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [2, 3])
def test_isolated_groups_and_avg_take_the_native_path_and_match_plain_gloo_bitwise(size):
    for same, kinds in run_ranks(_isolated_and_averaged, size, timeout=60):
        assert same == [True] * 10, same
        assert kinds == ["AsyncOpWork"] * 10 + ["PythonWork"], kinds


def _late_write(rank, size, store, isolate, into=False):
    """Rank 1 stops before an async all_reduce through the c10d adapter; rank 0 gives it up
    (PeerLost), resumes it, and the op Gloo still runs completes: what rank 0's tensor holds.
    ``into``: rank 0's op is replica mode's average (``_all_reduce_into``, out of place);
    then what its output and its input hold."""
    import torch.distributed as dist

    import commslayer

    comm = commslayer.new_comm("gloo", name="late", store=store, rank=rank, size=size, timeout=600,
                               isolate_writes=isolate)
    group = comm.as_process_group()
    comm.barrier()
    store.set(f"pid/{rank}", str(os.getpid()))
    canary = torch.full((1 << 10,), float(rank + 1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            dist.all_reduce(canary, group=group, async_op=True).wait()
        except commslayer.CommError:
            pass
        return None
    time.sleep(0.3)
    out = torch.zeros_like(canary)
    work = comm._all_reduce_into(out, canary, commslayer.ReduceOp.SUM) if into else \
        dist.all_reduce(canary, group=group, async_op=True)
    try:
        work.wait()
        return "completed with a stopped peer"
    except commslayer.PeerLost:
        pass
    os.kill(int(store.get("pid/1")), signal.SIGCONT)
    time.sleep(1.5)  # the resumed rank joins the op Gloo still runs here
    if into:
        return type(work).__name__, out[0].item(), canary[0].item()
    return type(work).__name__, canary[0].item()


@needs_native
@pytest.mark.timeout(90)
@pytest.mark.parametrize("isolate", [True, False])
def test_an_isolated_native_op_never_writes_late(isolate):
    ours, _ = run_ranks(_late_write, 2, isolate, timeout=60,
                        env={"COMMSLAYER_PEER_TIMEOUT_S": "1.5", "COMMSLAYER_HEARTBEAT_S": "0.1"})
    assert ours == ("AsyncOpWork", 1.0 if isolate else 3.0), ours  # without isolation, Gloo's late write lands


@needs_native
@pytest.mark.timeout(90)
@pytest.mark.parametrize("isolate", [True, False])
def test_an_all_reduce_into_another_tensor_never_writes_its_input_nor_late_into_an_isolated_output(isolate):
    """Replica mode redoes a failed average from the same gradients: the op's input."""
    ours, _ = run_ranks(_late_write, 2, isolate, True, timeout=60,
                        env={"COMMSLAYER_PEER_TIMEOUT_S": "1.5", "COMMSLAYER_HEARTBEAT_S": "0.1"})
    assert ours == ("NativeWork", 0.0 if isolate else 3.0, 1.0), ours


def _into(rank, size, store, isolate):
    """Replica mode's gradient average (``Collectives._all_reduce_into``): the
    reduction of ``input`` written to ``output`` only, SUM and AVG, against plain Gloo's
    in-place all_reduce of a copy."""
    import torch.distributed as dist

    import commslayer
    from commslayer import ReduceOp

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    comm = commslayer.new_comm("gloo", name="into", store=dist.PrefixStore("into/", store), rank=rank, size=size,
                               isolate_writes=isolate)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    seen = {"equal": [], "kinds": [], "input kept": []}
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        inp, out = x.clone(), torch.full_like(x, -7.0)
        work = comm._all_reduce_into(out, inp, op)
        seen["kinds"].append(type(work).__name__)
        work.wait()
        ref = x.clone()
        dist.all_reduce(ref)
        seen["equal"].append(torch.equal(out, ref / size if op is ReduceOp.AVG else ref))
        seen["input kept"].append(torch.equal(inp, x))
    return seen


@needs_native
@pytest.mark.timeout(90)
@pytest.mark.parametrize("isolate", [True, False])
def test_an_all_reduce_into_another_tensor_reads_the_input_and_writes_only_the_output(isolate):
    for seen in run_ranks(_into, 3, isolate, timeout=60):
        assert seen == {"equal": [True, True], "kinds": ["NativeWork"] * 2, "input kept": [True, True]}, seen
    for seen in run_ranks(_into, 2, isolate, timeout=60, env={"COMMSLAYER_NATIVE": "0"}):  # the general path
        assert seen == {"equal": [True, True], "kinds": ["Work"] * 2, "input kept": [True, True]}, seen


def _comm_api(rank, size, store):
    """The communicator's own async ops (its API, not c10d's) on the native path and on a
    plain Gloo group, isolated as the resilient modes build theirs; then a deadline, waited
    on with a shorter timeout, and one nobody waits for."""
    import torch.distributed as dist

    import commslayer
    from commslayer import ReduceOp

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    comm = commslayer.new_comm("gloo", name="api", store=dist.PrefixStore("api/", store), rank=rank, size=size,
                               timeout=2, isolate_writes=True)
    x = torch.randn(16 * size, generator=torch.Generator().manual_seed(rank))
    ours, plain, kinds = [], [], []
    for op, plain_op in ((ReduceOp.SUM, dist.ReduceOp.SUM), (ReduceOp.AVG, dist.ReduceOp.SUM)):
        t = x.clone()
        work = comm.all_reduce(t, op, async_op=True)
        kinds.append(type(work).__name__)
        work.wait()
        ref = x.clone()
        dist.all_reduce(ref, op=plain_op)
        ours.append(t)
        plain.append(ref / size if op is ReduceOp.AVG else ref)
        t = x.clone()  # the way of waiting DDP's hooks take: a future
        work = comm.all_reduce(t, op, async_op=True)
        kinds.append(type(work).__name__)
        work.get_future().wait()
        ours.append(t)
        plain.append(plain[-1])
    gathered, ref = torch.empty(16 * size * size), torch.empty(16 * size * size)
    work = comm.all_gather_single(gathered, x, async_op=True)
    kinds.append(type(work).__name__)
    while not work.is_completed():
        time.sleep(0.001)
    dist.all_gather_into_tensor(ref, x)
    ours.append(gathered)
    plain.append(ref)
    seen = {"equal": [torch.equal(a, b) for a, b in zip(ours, plain)], "kinds": kinds,
            "status": work.status.value, "integer AVG": type(comm.all_reduce(torch.tensor([3]), ReduceOp.AVG,
                                                                              async_op=True)).__name__}
    comm.all_reduce(torch.ones(1))  # every rank is past the integer AVG above
    if rank == 1:  # joins neither op below
        dist.TCPStore.wait(store, ["done"], timedelta(seconds=30))
        return seen
    t = torch.ones(4)
    work = comm.all_reduce(t, async_op=True)
    began = time.monotonic()
    try:
        work.wait(timeout=0.5)
    except commslayer.CommError as err:
        seen["short wait"] = (type(err).__name__, err.op, work.status.value, time.monotonic() - began)
    seen["untouched"] = t.tolist()  # isolated: a failed op leaves the caller's tensor as it was
    other = commslayer.new_comm("gloo", name="other", store=dist.PrefixStore("other/", store), rank=0, size=1,
                                timeout=1)
    store.set("done", "1")
    return seen, other is not None


@needs_native
@pytest.mark.timeout(90)
def test_the_communicators_own_async_ops_take_the_native_path():
    """``comm.all_reduce(..., async_op=True)`` (SUM and AVG) and ``all_gather_single`` on
    an isolating communicator: bitwise what plain Gloo gives (AVG: its sum over the size), as a
    ``NativeWork`` waited on every way; an integer AVG stays on the general path; a wait
    shorter than the deadline times the op out as the general path does."""
    first, second = run_ranks(_comm_api, 2, timeout=60)
    seen, _ = first
    for s in (seen, second):
        assert s["equal"] == [True] * 5, s
        assert s["kinds"] == ["NativeWork"] * 5, s
        assert s["status"] == "completed" and s["integer AVG"] == "Work", s
    kind, op, status, took = seen["short wait"]
    assert (kind, op, status) == ("CollectiveTimeout", "all_reduce", "timedout"), seen
    assert 0.4 < took < 1.5, took
    assert seen["untouched"] == [1.0] * 4
