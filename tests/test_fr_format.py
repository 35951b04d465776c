"""PyTorch's own Flight Recorder analyzer on our dumps.

Each scenario runs real ranks (forked processes, real Gloo sockets, the
harness's TCPStore) with the recorder installed in the rank before its
communicator is built.  Every rank dumps, then ``python -m
torch.distributed.flight_recorder.fr_trace <trace_dir>/fr`` runs in a
subprocess, as a user would run it, and the test reads what it prints.

The analyzer starts matching from whichever rank's file the directory lists
first, and blames the ranks that differ from that one; where that makes the
named culprit depend on the listing order, the assertions accept both
readings (the odd rank, or every other rank).

A note on the mismatch scenarios: in check mode (``check=True``) a mismatch
raises ``CollectiveMismatch`` before the op is recorded, so there is nothing
for the analyzer to see; these scenarios therefore use mismatches Gloo
survives without it (a different dtype of the same element size, a
different shape of the same element count, a different collective), which
the analyzer does catch.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from tests.harness import run_ranks
from tracing import fr_format
from tracing.records import new_dump


# ---------------------------------------------------------------- helpers
def _analyze(trace_dir: str) -> str:
    """Run torch's analyzer on the dumps; its whole output (it logs to stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_TRACE")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", os.path.join(trace_dir, "fr")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    return out


def _fr_files(trace_dir: str, size: int) -> list:
    files = sorted(os.listdir(os.path.join(trace_dir, "fr")))
    assert files == [f"commslayer_fr_rank_{r}" for r in range(size)], files
    dumps = []
    for r in range(size):
        with open(os.path.join(trace_dir, "fr", f"commslayer_fr_rank_{r}"), "rb") as f:
            dumps.append(pickle.load(f))
    return dumps


def _install(trace_dir: str, stack: bool = False):
    from tracing.record.recorder import install

    return install(trace_dir, signals=False, stack=stack)


def _dump(rec, trace_dir: str, rank: int, after_error: bool = False) -> None:
    """Dump now.  After an error the recorder dumps on its own thread too: let
    that finish first, so no temporary file is left behind when the rank exits."""
    if after_error:
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(trace_dir, f"rank{rank}.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert rec.dump("test") is not None


def _culprits(out: str) -> set:
    return {int(r) for r in re.findall(r"Culprit rank (\d+)", out)}


# ------------------------------------------------------- clean job: silent
def _clean(rank, size, store, trace_dir):
    import commslayer

    rec = _install(trace_dir)
    comm = commslayer.new_comm("gloo", name="fr-clean", timeout=10)  # torchrun's way: knows global ranks
    t = torch.ones(8)
    comm.all_reduce(t)
    comm.all_gather_single(torch.empty(8 * size), t)
    comm.reduce_scatter_single(torch.empty(8), torch.ones(8 * size))
    comm.all_gather([torch.empty(8) for _ in range(size)], t)
    comm.reduce_scatter(torch.empty(8), [torch.ones(8) for _ in range(size)])
    rows = [rank + 1] * size  # uneven all_to_all: rank r sends r+1 rows to everyone
    comm.all_to_all_single(torch.empty(sum(range(1, size + 1))), torch.ones((rank + 1) * size),
                           output_split_sizes=list(range(1, size + 1)), input_split_sizes=rows)
    comm.broadcast(t, 1)
    comm.reduce(t, 0)
    comm.gather([torch.empty(8) for _ in range(size)] if rank == 0 else None, t, 0)
    comm.scatter(torch.empty(8), [torch.ones(8) for _ in range(size)] if rank == 0 else None, 0)
    comm.all_reduce(torch.ones(2, 3, dtype=torch.int64), async_op=True).wait()
    for _ in range(2):  # a pipeline: 0 -> 1 -> 2, and back
        if rank > 0:
            comm.recv(t, rank - 1)
        if rank < size - 1:
            comm.send(t, rank + 1)
            comm.recv(t, rank + 1)
        if rank > 0:
            comm.send(t, rank - 1)
    comm.barrier()
    rev = comm.split([2, 0], "rev")  # member order differs from the global order
    if rev is not None:
        rev.all_reduce(t)
        if rev.get_rank() == 0:
            rev.send(t, 1)
        else:
            rev.recv(t, 0)
        rev.barrier()
    comm.barrier()
    _dump(rec, trace_dir, rank)


@pytest.mark.timeout(120)
def test_clean_job_gets_a_clean_bill(tmp_path):
    run_ranks(_clean, 3, str(tmp_path), timeout=60, env={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    dumps = _fr_files(str(tmp_path), 3)
    for rank, d in enumerate(dumps):
        assert d["version"] == "2.10" and d["commslayer"]["skipped_records"] == 0
        assert d["pg_config"]["fr-clean.0"] == {"name": "fr-clean.0", "desc": "fr-clean", "ranks": "[0, 1, 2]"}
        if rank != 1:
            assert d["pg_config"]["fr-clean.0/rev"]["ranks"] == "[2, 0]"
        assert all(e["state"] == "completed" and e["retired"] for e in d["entries"])
    names = {e["profiling_name"] for e in dumps[1]["entries"]}
    assert {"gloo:all_reduce", "gloo:_all_gather_base", "gloo:_reduce_scatter_base", "gloo:all_gather",
            "gloo:reduce_scatter", "gloo:all_to_all", "gloo:broadcast", "gloo:reduce", "gloo:gather",
            "gloo:scatter", "gloo:barrier", "gloo:send 0->1", "gloo:recv 1<-0", "gloo:recv 0<-1",
            "gloo:send 1->0"} <= names
    # rank 2 is member 0 of "rev", so its send in rev is "2 -> 0": in the sorted pair, 1 -> 0
    assert any(e["process_group"][0] == "fr-clean.0/rev/p2p:2->0" and e["profiling_name"] == "gloo:send 1->0"
               for e in dumps[2]["entries"])
    out = _analyze(str(tmp_path))
    for alarm in ("Not all ranks", "has errors", "mismatch", "MISMATCH", "missing"):
        assert alarm not in out, out


# ----------------------------------------------- (a) a rank skips an op
def _skip(rank, size, store, trace_dir):
    import commslayer

    rec = _install(trace_dir, stack=True)
    comm = commslayer.new_comm("gloo", name="fr-skip", store=store, rank=rank, size=size, timeout=10)
    for _ in range(3):
        comm.all_reduce(torch.ones(16))
    outcome = None
    if rank != size - 1:  # the last rank skips the 4th all_reduce
        try:
            comm.all_reduce(torch.ones(16), timeout=1.0)
            outcome = "completed"
        except commslayer.CommError as err:
            outcome = type(err).__name__
        store.set(f"gave-up/{rank}", "1")
    # nobody leaves before everyone gave up: a closed socket would turn a timeout into PeerLost
    store.wait([f"gave-up/{r}" for r in range(size - 1)], timedelta(seconds=30))
    _dump(rec, trace_dir, rank, after_error=outcome is not None)
    return outcome


@pytest.mark.timeout(120)
def test_analyzer_names_the_rank_that_skipped_a_collective(tmp_path):
    results = run_ranks(_skip, 3, str(tmp_path), timeout=60)
    assert results == ["CollectiveTimeout", "CollectiveTimeout", None]
    dumps = _fr_files(str(tmp_path), 3)
    last = dumps[0]["entries"][-1]
    assert (last["collective_seq_id"], last["state"], last["retired"]) == (4, "started", True)
    assert last["commslayer"]["state"] == "timed_out" and last["time_discovered_completed_ns"] is None
    assert dumps[0]["pg_status"]["0"] == {"last_enqueued_collective": 4, "last_started_collective": 4,
                                          "last_completed_collective": 3}
    out = _analyze(str(tmp_path))
    assert "Not all ranks joining collective, sequence number: 4" in out, out
    assert "missing ranks: {2}" in out, out
    assert "collective: gloo:all_reduce" in out and "group info: fr-skip.0:fr-skip" in out, out
    assert "expected ranks: {0, 1, 2}" in out, out
    assert re.search(r"_skip at .*tests/test_fr_format\.py:\d+", out), out  # the Python stack, as frames


# ------------------------------------------------ (b) mismatched ops
def _mismatch(rank, size, store, trace_dir, kind):
    import commslayer

    rec = _install(trace_dir)
    comm = commslayer.new_comm("gloo", name="fr-mm", store=store, rank=rank, size=size, timeout=10)
    for _ in range(2):
        comm.all_reduce(torch.ones(4))
    odd = rank == size - 1
    outcome = "completed"
    try:
        if kind == "dtype":  # same element size: Gloo moves the bytes, the sum is garbage
            comm.all_reduce(torch.ones(4, dtype=torch.int32 if odd else torch.float32))
        elif kind == "shape":  # same element count
            comm.all_reduce(torch.ones(2, 2) if odd else torch.ones(4))
        elif kind == "op":  # a different collective: nobody's messages match, all time out, then find why
            if odd:
                comm.broadcast(torch.ones(4), rank, timeout=1.0)
            else:
                comm.all_reduce(torch.ones(4), timeout=1.0)
    except commslayer.CommError as err:
        outcome = type(err).__name__
    if outcome == "completed":
        comm.all_reduce(torch.ones(4))
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(size)], timedelta(seconds=30))
    _dump(rec, trace_dir, rank, after_error=outcome != "completed")
    return outcome


MISMATCHES = {
    # kind: (what the analyzer calls it, text it shows for the two sides)
    "dtype": ("COLLECTIVE_DTYPE_MISMATCH", ("'Int'", "'Float'")),
    "shape": ("SIZE_OR_SYNTAX_MISMATCH", ("[[2, 2]]", "[[4]]")),
    "op": ("COLLECTIVE_TYPE_MISMATCH", ("'all_reduce'", "'broadcast'")),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_analyzer_reports_a_mismatched_collective(tmp_path, kind):
    outcomes = run_ranks(_mismatch, 3, str(tmp_path), kind, timeout=60)
    assert outcomes == ["CollectiveMismatch" if kind == "op" else "completed"] * 3
    dumps = _fr_files(str(tmp_path), 3)
    third = [[e for e in d["entries"] if e["collective_seq_id"] == 3][0] for d in dumps]
    assert third[0]["profiling_name"] == "gloo:all_reduce"
    assert third[0]["input_sizes"] == [[4]] and third[0]["input_dtypes"] == ["Float"]
    if kind == "dtype":
        assert third[2]["input_dtypes"] == ["Int"]
    elif kind == "shape":
        assert third[2]["input_sizes"] == [[2, 2]]
    else:
        assert third[2]["profiling_name"] == "gloo:broadcast"
    out = _analyze(str(tmp_path))
    error_type, sides = MISMATCHES[kind]
    assert "Collective sequence number: 3 has errors" in out, out
    assert f"Error type: {error_type}" in out, out
    assert all(s in out for s in sides), out
    assert _culprits(out) in ({2}, {0, 1}), out


# ------------------------------------- point to point: a missing receiver
def _p2p(rank, size, store, trace_dir):
    import commslayer

    rec = _install(trace_dir)
    comm = commslayer.new_comm("gloo", name="fr-p2p", store=store, rank=rank, size=size, timeout=10)
    t = torch.ones(8)
    comm.all_reduce(t)
    if rank == 0:
        comm.send(t, 1)
        comm.send(t, 2)
        try:
            comm.send(t, 2, timeout=1.0)  # rank 2 takes only one message
        except commslayer.CommError as err:
            store.set("gave-up", "1")
            _dump(rec, trace_dir, rank, after_error=True)
            return type(err).__name__
        return "completed"
    comm.recv(t, 0)
    store.wait(["gave-up"], timedelta(seconds=30))
    _dump(rec, trace_dir, rank)
    return None


@pytest.mark.timeout(120)
def test_analyzer_pairs_send_and_recv_and_names_a_missing_receiver(tmp_path):
    results = run_ranks(_p2p, 3, str(tmp_path), timeout=60)
    assert results == ["CollectiveTimeout", None, None]
    _fr_files(str(tmp_path), 3)
    out = _analyze(str(tmp_path))
    # the matched sends (0->1 #1, 0->2 #1) raise nothing; only the second 0->2 does
    assert out.count("Not all ranks joining collective") == 1, out
    assert "Not all ranks joining collective, sequence number: 2" in out, out
    assert "group info: fr-p2p.0/p2p:0->2:fr-p2p p2p" in out and "collective: gloo:send 0->1" in out, out
    assert "missing ranks: {2}" in out, out


# ----------------------------- dtype names: exactly what torch's FR writes
def _torch_fr_dtypes(rank, size, store):
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo(dist.PrefixStore("fr-dtypes/", store), rank, size, timedelta(seconds=10))
    for name in fr_format.FR_DTYPES:
        try:  # torch records the op before Gloo checks the dtype
            pg.broadcast([torch.zeros(2, dtype=getattr(torch, name))]).wait()
        except RuntimeError:
            pass
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]
    return [e["input_dtypes"][0] for e in entries]


@pytest.mark.timeout(60)
def test_dtype_names_match_torchs_flight_recorder():
    [recorded] = run_ranks(_torch_fr_dtypes, 1, timeout=40, env={"TORCH_FR_BUFFER_SIZE": "64"})
    assert recorded == list(fr_format.FR_DTYPES.values())
    assert fr_format.fr_dtype("float32") == "Float" and fr_format.fr_dtype(None) is None


# ----------------------------------------------------- the mapping itself
def _record(**fields):
    rec = {"op_id": 1, "comm": "c", "comm_id": "c.0", "generation": 0, "seq": 1, "op": "all_reduce",
           "backend_op": "allreduce", "reduce_op": "SUM", "dtype": "float32", "in_sizes": [[4]],
           "out_sizes": [[4]], "in_bytes": 16, "out_bytes": 16, "root": None, "peer": None, "async_op": False,
           "timeout_s": 1.5, "state": "completed", "error": None, "enqueue_ns": 100, "start_ns": 110,
           "end_ns": 150, "duration_ms": 4e-5, "thread": "MainThread", "call_site": "/job/train.py:42",
           "stack": None}
    rec.update(fields)
    return rec


def _doc(records, global_ranks=None, generation=0):
    comm = {"name": "c", "backend": "gloo", "rank": 1, "size": 2, "global_ranks": global_ranks,
            "generation": generation, "state": "ok"}
    return new_dump(job="j", rank=1, host="h", pid=1, wall_ns=1_000_000, mono_ns=100, reason="r", dropped=0,
                    communicators={"c.0": comm}, records=records)


def test_states_times_and_frames():
    stack = ["/job/train.py:10 in main", "/job/train.py:42 in step"]
    fr = fr_format.to_flight_recorder(_doc([
        _record(op_id=1, seq=1),
        _record(op_id=2, seq=2, state="timed_out", end_ns=None, duration_ms=None, error="timed out", stack=stack),
        _record(op_id=3, seq=3, state="failed", start_ns=None, end_ns=None, duration_ms=None),
        _record(op_id=4, seq=4, state="aborted", end_ns=200, duration_ms=None),
        _record(op_id=5, seq=5, state="started", end_ns=None, duration_ms=None),
        _record(op_id=6, seq=6, state="scheduled", start_ns=None, end_ns=None, duration_ms=None),
    ]))
    e = fr["entries"]
    assert [x["state"] for x in e] == ["completed", "started", "scheduled", "started", "started", "scheduled"]
    assert [x["retired"] for x in e] == [True, True, True, True, False, False]
    assert [x["record_id"] for x in e] == [0, 1, 2, 3, 4, 5]
    assert e[1]["commslayer"]["state"] == "timed_out" and e[1]["commslayer"]["error"] == "timed out"
    # monotonic -> wall clock: wall_ns - mono_ns = 999_900
    assert (e[0]["time_created_ns"], e[0]["time_discovered_started_ns"],
            e[0]["time_discovered_completed_ns"]) == (1_000_000, 1_000_010, 1_000_050)
    assert e[0]["duration_ms"] == 4e-5 and all("duration_ms" not in x for x in e[1:])
    assert e[1]["time_discovered_completed_ns"] is None and e[2]["time_discovered_started_ns"] is None
    assert e[0]["frames"] == [{"name": "?", "filename": "/job/train.py", "line": 42}]
    assert e[1]["frames"][0] == {"name": "step", "filename": "/job/train.py", "line": 42}  # innermost first
    assert e[0]["timeout_ms"] == 1500 and e[0]["input_dtypes"] == ["Float"]
    assert fr["pg_status"] == {"0": {"last_enqueued_collective": 6, "last_started_collective": 5,
                                     "last_completed_collective": 1}}


def test_groups_ranks_and_sizes():
    fr = fr_format.to_flight_recorder(_doc([
        _record(op_id=1, seq=1, op="all_gather", in_sizes=[[3]], out_sizes=[[3], [3]]),
        _record(op_id=2, seq=2, op="reduce_scatter", in_sizes=[[3], [3]], out_sizes=[[3]]),
        _record(op_id=3, seq=1, op="recv", peer=0, in_sizes=[], out_sizes=[[5]]),
        _record(op_id=4, seq=1, op="send", peer=0, in_sizes=[[5]], out_sizes=[]),
        _record(op_id=5, seq=3, generation=1),  # a membership this dump does not know
    ], global_ranks=[7, 3]))
    assert fr["pg_config"]["c.0"] == {"name": "c.0", "desc": "c", "ranks": "[7, 3]"}
    e = fr["entries"]
    assert e[0]["output_sizes"] == [[2, 3]] and e[1]["input_sizes"] == [[2, 3]]
    # this rank is member 1 = global 3; its peer, member 0, is global 7
    assert e[2]["process_group"] == ("c.0/p2p:7->3", "c p2p") and e[2]["profiling_name"] == "gloo:recv 0<-1"
    assert e[3]["process_group"] == ("c.0/p2p:3->7", "c p2p") and e[3]["profiling_name"] == "gloo:send 0->1"
    assert fr["pg_config"]["c.0/p2p:7->3"]["ranks"] == "[3, 7]"
    assert e[2]["input_sizes"] == e[2]["output_sizes"] == [[5]] and e[2]["is_p2p"]
    assert (e[2]["collective_seq_id"], e[2]["p2p_seq_id"]) == (1, 1)
    assert len(e) == 4 and fr["commslayer"]["skipped_records"] == 1
    # without global ranks, the members are taken to be ranks 0..size-1
    assert fr_format.to_flight_recorder(_doc([]))["pg_config"]["c.0"]["ranks"] == "[0, 1]"
