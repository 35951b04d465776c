"""Under the route switch a job cannot tell commslayer from Gloo: one job (2 real
ranks) runs the same calls on a plain Gloo group and on a group built after
``install_routing`` (what ``COMMSLAYER_ROUTE_C10D=1`` does) and compares results
and what the job can read, then ends a receive from any source by its deadline
and by a lost peer."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch

from tests.harness import RankDied, group_kind, run_ranks


def _recv_any(group, rank: int) -> dict:
    """A receive from any source, sync and async, as c10d reports it."""
    import torch.distributed as dist

    got = {}
    for how in ("sync", "async"):
        t = torch.zeros(4)
        if rank == 1:
            dist.send(torch.arange(4.0) + (how == "async"), 0, group=group, tag=3)
        elif how == "sync":
            got[how] = (dist.recv(t, group=group, tag=3), t.tolist())
        else:
            work = dist.irecv(t, group=group, tag=3)
            work.wait()
            got[how] = (work._source_rank(), t.tolist())
    return got


def _sparse(group, rank: int) -> tuple:
    """All_reduce of sparse COO tensors (overlapping indices, uncoalesced input)."""
    import torch.distributed as dist

    t = torch.sparse_coo_tensor(torch.tensor([[0, 2, rank, 2]]), torch.tensor([1.5, 2.0, 3.0 + rank, 0.25]), (4,))
    dist.all_reduce(t, group=group)
    return t.is_coalesced(), t._indices().tolist(), t._values().tolist()  # tensors do not cross processes


def _coalesced(group, rank: int) -> tuple:
    """all_reduce_coalesced and a coalescing block: results and the profiler's events."""
    import torch.distributed as dist
    from torch.profiler import profile

    ts = [torch.arange(3.0) + rank, torch.full((2, 2), 2.0 + rank)]
    with profile() as prof:
        dist.all_reduce_coalesced(ts, group=group)
    events = sorted(e.name for e in prof.events() if "reduce" in e.name)
    more = [torch.ones(2) * (rank + 1), torch.arange(4.0) * (rank + 1)]
    with dist._coalescing_manager(group=group):
        for t in more:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = torch.zeros(3)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(3.0) * (rank + 2), 1 - rank, group),
                                        dist.P2POp(dist.irecv, got, 1 - rank, group)]):
        work.wait()
    return [t.tolist() for t in ts + more + [got]], events


def _names(group) -> dict:
    """Every name of a group a job can read, DDP's logging included."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(2, 2), process_group=group)
    return {"get_backend": dist.get_backend(group), "name": group.name(),
            "config": dist.get_backend_config(group),
            "ddp": model._get_ddp_logging_data()["backend_name"]}


def _fidelity_job(rank, size, store):
    import torch.distributed as dist

    import commslayer
    from commslayer.registration import install_routing
    from tracing.record.recorder import install

    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=size)
    plain = dist.new_group(backend="gloo")
    install_routing()
    routed = dist.new_group(backend="gloo")
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    long = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    rec = install(None, signals=False)
    out = {"types": (group_kind(plain), group_kind(routed))}
    for kind, group in (("plain", plain), ("routed", routed)):
        out[kind] = {"recv": _recv_any(group, rank), "sparse": _sparse(group, rank), "names": _names(group),
                     "coalesced": _coalesced(group, rank)}
    try:
        dist.all_reduce(torch.ones(2).to_sparse(), op=dist.ReduceOp.MAX, group=routed)
    except commslayer.InvalidArgument as err:
        out["sparse max"] = str(err)
    out["records"] = [(r["op"], r["peer"], r["seq"], r["state"]) for r in rec.records()
                      if r["comm"].startswith(f"c10d:{routed.group_name}:")]
    if rank == 1:  # no sender on `short`; then die while rank 0 receives on `long`
        dist.TCPStore.wait(store, ["timed out"], timedelta(seconds=20))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    for what, group in (("deadline", short), ("lost", long)):
        began = time.monotonic()
        try:
            dist.recv(torch.zeros(2), group=group)
            out[what] = ("completed", time.monotonic() - began)
        except commslayer.CommError as err:
            out[what] = (type(err).__name__, time.monotonic() - began)
        store.set("timed out", "1")
    return out


@pytest.mark.timeout(60)
def test_routed_group_matches_plain_gloo():
    ours, died = run_ranks(_fidelity_job, 2, timeout=45, allow_errors=True)
    assert isinstance(died, RankDied) and died.exitcode == -signal.SIGKILL, died
    assert ours["types"] == ("ProcessGroup", "commslayer"), ours
    plain, routed = ours["plain"], ours["routed"]
    for how in ("sync", "async"):
        (src, t), (ref_src, ref) = routed["recv"][how], plain["recv"][how]
        assert src == ref_src == 1 and t == ref and sum(t) > 0
    coalesced, indices, values = routed["sparse"]
    assert routed["sparse"] == plain["sparse"] and coalesced and indices == [[0, 1, 2]], routed["sparse"]
    assert "ReduceOp.SUM on Gloo only" in ours["sparse max"]
    assert routed["names"] == plain["names"] and plain["names"]["ddp"] == plain["names"]["name"] == "gloo", \
        (routed["names"], plain["names"])
    # coalesced: the same results, and one op on the wire (Gloo's one profiler event), as plain Gloo;
    # plain c10d also shows its dispatcher's event, which only a Python group's call (no native module) skips
    (values, events), (ref_values, ref_events) = routed["coalesced"], plain["coalesced"]
    assert values == ref_values and values[0] == [1.0, 3.0, 5.0] and values[3] == [0.0, 2.0, 4.0, 6.0]
    assert values[4] == [0.0, 3.0, 6.0]  # batch_isend_irecv: rank 1's message
    assert [e for e in events if e.startswith("gloo:")] == [e for e in ref_events if e.startswith("gloo:")] \
        == ["gloo:all_reduce"], (events, ref_events)
    # one record per op; a receive's sender and its number in the pair learnt as it completed
    assert ours["records"][:3] == [("recv", 1, 1, "completed"), ("recv", 1, 2, "completed"),
                               ("all_reduce", None, 1, "completed")], ours["records"]
    coalesced = [r for r in ours["records"] if r[0] == "all_reduce_coalesced"]
    assert [r[3] for r in coalesced] == ["completed"] * 2, ours["records"]  # one per call and per block
    kind, took = ours["deadline"]
    assert kind == "CollectiveTimeout" and 0.9 < took < 3.0, ours["deadline"]
    kind, took = ours["lost"]
    assert kind == "PeerLost" and took < 5.0, ours["lost"]
