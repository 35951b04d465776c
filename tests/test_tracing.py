"""The flight recorder on real ranks: complete records, gapless sequence
numbers, right states for completed, timed-out and failed ops, dumps on a
timeout (every rank that saw it) and on SIGTERM (also while blocked in a
collective), and a full trace disk that never stops training."""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness import RankDied, run_ranks
from tracing.records import OPTIONAL_FIELDS, RECORD_FIELDS, load_dump

ROOT = Path(__file__).resolve().parent.parent


def _traced_run(rank, size, store, trace_dir):
    import commslayer
    from tracing.record.recorder import install

    rec = install(trace_dir, signals=False)
    comm = commslayer.new_comm("gloo", name="a", store=store, rank=rank, size=size, timeout=30)
    pair = comm.split([0, 1], "b")
    t = torch.ones(64)
    for i in range(4):
        comm.all_reduce(t)
        w = comm.all_gather_single(torch.empty(64 * size), t, async_op=True)
        w.wait()
    comm.reduce_scatter_single(torch.empty(8), torch.ones(8 * size), commslayer.ReduceOp.AVG)
    comm.broadcast(t, 0)
    if rank == 0:
        comm.send(t, 1)
    elif rank == 1:
        comm.recv(t, 0)
    comm.barrier()
    # a timeout: rank 2 never joins this all_reduce
    if rank == size - 1:
        time.sleep(1.6)
        return rec.records()
    try:
        comm.all_reduce(t, timeout=1.0)
    except commslayer.CollectiveTimeout:
        pass
    time.sleep(0.3)  # the dump on error runs on the recorder's thread
    # a failure: rank 1 dies during an op on the pair communicator
    pair.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        pair.all_reduce(torch.ones(1 << 16))
    except commslayer.CommError:
        pass
    return rec.records()


@pytest.mark.timeout(90)
def test_records_complete_ordered_and_states_right(tmp_path):
    results = run_ranks(_traced_run, 3, str(tmp_path), timeout=60, allow_errors=True)
    r0, r1, r2 = results
    assert isinstance(r1, RankDied) and r1.exitcode == -signal.SIGKILL
    for records in (r0, r2):
        assert records and all(set(RECORD_FIELDS) <= set(r) <= set(RECORD_FIELDS + OPTIONAL_FIELDS) for r in records)
        by_comm = {}
        for r in records:
            if r["op"] not in ("send", "recv"):
                by_comm.setdefault(r["comm_id"], []).append(r["seq"])
            if r["start_ns"] is None:  # refused before it reached the backend (its communicator was broken)
                assert r["state"] == "failed" and r["enqueue_ns"] <= r["end_ns"], r
            else:
                assert r["enqueue_ns"] <= r["start_ns"] <= r["end_ns"], r
            assert r["duration_ms"] >= 0 and "tests/test_tracing.py:" in r["call_site"] and r["thread"]
        for seqs in by_comm.values():
            assert seqs == list(range(1, len(seqs) + 1))  # gapless, in order
        # the exact line, for an op on the direct path (synchronous, unobserved) and one off it
        source = open(__file__).read().splitlines()
        line = source.index("        comm.all_reduce(t)") + 1
        assert records[0]["op"] == "all_reduce" and records[0]["call_site"].endswith(f"test_tracing.py:{line}")
        line = source.index("        w = comm.all_gather_single(torch.empty(64 * size), t, async_op=True)") + 1
        assert records[1]["op"] == "all_gather_single" and records[1]["call_site"].endswith(f"test_tracing.py:{line}")
        ops = [r["op_id"] for r in records]
        assert ops == sorted(ops)
    ok = [r for r in r0 if r["state"] == "completed"]
    assert {r["op"] for r in ok} >= {"all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast",
                                     "send", "barrier"}
    rs = next(r for r in ok if r["op"] == "reduce_scatter_single")
    assert rs["reduce_op"] == "AVG" and rs["in_bytes"] == 8 * 3 * 4 and rs["out_sizes"] == [[8]]
    assert rs["backend_op"] == "_reduce_scatter_base" and rs["dtype"] == "float32"
    ag = next(r for r in ok if r["op"] == "all_gather_single")
    assert ag["async_op"] is True
    timed_out = [r for r in r0 if r["state"] == "timed_out"]
    assert len(timed_out) == 1 and timed_out[0]["op"] == "all_reduce" and "timed out" in timed_out[0]["error"]
    failed = [r for r in r0 if r["state"] == "failed"]
    assert len(failed) == 1 and failed[0]["comm"] == "b", [r["state"] for r in r0[-3:]]
    # every rank that saw the timeout left a dump naming it
    for rank in (0, 1):
        doc = load_dump(str(tmp_path / f"rank{rank}.json"))
        assert "CollectiveTimeout" in doc["reason"]
        assert any(r["state"] == "timed_out" and r["op"] == "all_reduce" for r in doc["records"])
        assert doc["communicators"] and doc["clock"]["wall_ns"] > 0


def _sigterm_target(rank, size, store, trace_dir, blocked):
    import commslayer
    from tracing.record.recorder import install

    install(trace_dir)
    comm = commslayer.new_comm("gloo", name="st", store=store, rank=rank, size=size, timeout=60)
    for _ in range(5):
        comm.all_reduce(torch.ones(4))
    store.set(f"pid{rank}", str(os.getpid()))
    if rank == 0:
        victim = int(store.get("pid1"))
        time.sleep(0.5)
        os.kill(victim, signal.SIGTERM)
        return None
    if blocked:  # wait in a collective nobody else joins: the main thread is in C++
        comm.all_reduce(torch.ones(4))
    while True:
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocked", [False, True], ids=["running", "blocked-in-collective"])
def test_sigterm_leaves_a_readable_dump(tmp_path, blocked):
    start = time.monotonic()
    _, victim = run_ranks(_sigterm_target, 2, str(tmp_path), blocked, timeout=30, allow_errors=True)
    assert isinstance(victim, RankDied) and victim.exitcode == -signal.SIGTERM
    assert time.monotonic() - start < 20
    doc = load_dump(str(tmp_path / "rank1.json"))
    assert doc["reason"] == "SIGTERM"
    assert sum(r["op"] == "all_reduce" and r["state"] == "completed" for r in doc["records"]) == 5
    if blocked:
        assert doc["records"][-1]["state"] == "started"
    # where the main thread was: the line it waited on, the dump's own frames left out
    stack = doc["main_stack"]
    path, line = stack["at"].rsplit(":", 1)
    assert stack["reason"] == "SIGTERM" and path == __file__, stack
    waited_on = "comm.all_reduce(torch.ones(4))" if blocked else "time.sleep(0.01)"
    assert linecache.getline(path, int(line)).strip() == waited_on, stack
    assert stack["frames"][-1] == f"{__file__}:{line} in _sigterm_target" or blocked, stack
    assert not any("/tracing/" in f for f in stack["frames"]), stack


_ENDING_SLOWLY = """
import hashlib, sys
from commslayer.comm.exits import exit_now, register_before_exit
# a hook that runs before the dump, in C for about 1.5 s (no Python, so no signal handler, meanwhile)
register_before_exit(lambda status, why: hashlib.pbkdf2_hmac("sha256", b"x", b"y", 6_000_000))
import torch, torch.distributed as dist
import commslayer
from tracing.record.recorder import install
install(sys.argv[1])
commslayer.new_comm("gloo", name="one", store=dist.HashStore(), rank=0, size=1).all_reduce(torch.ones(4))
print("ending", flush=True)
exit_now(3, "done")
"""


@pytest.mark.timeout(60)
def test_a_sigterm_while_the_process_ends_lets_it_end_with_its_dump(tmp_path):
    """SIGTERM lands while the main thread runs the before-exit hooks: the process ends as
    it was ending (its status, its reason), not 10 s later nor killed before its dump."""
    proc = subprocess.Popen([sys.executable, "-c", _ENDING_SLOWLY, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline() == "ending\n"
    time.sleep(0.3)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 3
    assert time.monotonic() - start < 5
    doc = load_dump(str(tmp_path / "rank0.json"))
    assert doc["reason"] == "exit 3: done" and [r["op"] for r in doc["records"]] == ["all_reduce"]


def _full_disk(rank, size, store, trace_dir):
    import logging

    import commslayer
    from tracing.record.recorder import install

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("commslayer.tracing").addHandler(handler)
    rec = install(trace_dir, capacity=20000, signals=False)
    comm = commslayer.new_comm("gloo", name="fd", store=store, rank=rank, size=size, timeout=30)
    t = torch.ones(16)
    written = failed_records = 0
    for step in range(6):
        for _ in range(400):
            comm.all_reduce(t, commslayer.ReduceOp.MAX)
        expected = len(rec.records())
        if rec.dump(f"step {step}") is None:
            failed_records += expected
        else:
            written += 1
    return t[0].item(), written, failed_records, rec.writer.dropped_records, warnings


@pytest.mark.timeout(90)
def test_full_trace_disk_warns_once_and_counts(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        results = run_ranks(_full_disk, 2, str(mnt), timeout=60)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
    for value, written, failed_records, dropped, warnings in results:
        assert value == 1.0  # training went on: every all_reduce completed
        assert failed_records > 0, "the disk never filled: make the tmpfs smaller"
        assert dropped == failed_records
        assert len([w for w in warnings if "cannot write" in w]) == 1


def test_the_recorder_learns_the_step_without_a_hook_on_backward(tmp_path):
    """The recorder needs only a resilient job's step: it takes it from a step hook, one
    call a step. Before, its phase hook cost four calls a step and made the job hook the
    backward pass (a tensor hook, about 15 us of autograd's Python a step)."""
    script = ("import torch; from commslayer.hooks import phase_hooks, step_hooks; "
              "from tracing.record.recorder import install; install(); "
              "print(len(phase_hooks.fns), len(step_hooks.fns))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMSLAYER_")}
    proc = subprocess.run([sys.executable, "-c", script], env=dict(env, COMMSLAYER_TRACE_DIR=str(tmp_path)),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "1"], proc.stdout + proc.stderr
