"""The trace viewer on real traces of real multi-process runs: a clean run,
a rank that skips a collective, mismatched collectives, a SIGSTOPped rank and
a SIGKILLed rank.  Each scenario runs once per module (fixtures) and several
tests read its traces: ``diagnose`` names what went wrong, ``summary``'s
numbers match an independent computation from the dumps, ``overlap`` matches
a brute-force sweep, and bad input fails with file and line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.harness import RankDied, run_ranks
from tracing.records import load_dump

SIZE = 3


def _setup(rank, size, store, trace_dir, name="a", check=False):
    import commslayer
    from tracing.recorder import install

    rec = install(trace_dir, signals=False)
    comm = commslayer.new_comm("gloo", name=name, store=store, rank=rank, size=size, timeout=30, check=check)
    return rec, comm


def _finish(rec, reason="end of run"):
    rec.flush_sinks()
    rec.dump(reason)


def _clean(rank, size, store, trace_dir):
    import commslayer

    rec, comm = _setup(rank, size, store, trace_dir)
    rs = commslayer.new_comm("gloo", name="rs", store=store, rank=rank, size=size, timeout=30)
    t = torch.ones(1024)
    for _ in range(3):
        comm.all_reduce(t)
        big = 1 << 18
        ag = comm.all_gather_single(torch.empty(size * big), torch.ones(big), async_op=True)
        w = rs.reduce_scatter_single(torch.empty(big), torch.ones(size * big), async_op=True)
        ag.wait()
        w.wait()
    comm.broadcast(t, 0)
    if rank == 0:
        comm.send(t, 1)
    elif rank == 1:
        comm.recv(t, 0)
    comm.barrier()
    _finish(rec)


def _skip(rank, size, store, trace_dir):
    import commslayer

    rec, comm = _setup(rank, size, store, trace_dir)
    t = torch.ones(16)
    comm.all_reduce(t)
    comm.all_reduce(t)
    if rank != size - 1:
        comm.all_reduce(t)  # SKIPPED-BY-LAST
    try:
        comm.all_reduce(t, timeout=1.5)
    except commslayer.CommError:
        pass
    if rank != size - 1:
        store.set(f"done{rank}", "1")
    else:  # stay alive (sockets open) until the others gave up
        store.wait([f"done{r}" for r in range(size - 1)])
    _finish(rec)


def _mismatch(rank, size, store, trace_dir):
    import commslayer

    rec, comm = _setup(rank, size, store, trace_dir, name="u")
    odd = rank == size - 1
    t = torch.ones(8)
    comm.all_reduce(t)
    comm.all_reduce(t, commslayer.ReduceOp.MAX if odd else commslayer.ReduceOp.SUM)  # Gloo does not notice
    checked = commslayer.new_comm("gloo", name="c", store=store, rank=rank, size=size, timeout=30, check=True)
    checked.all_reduce(t)
    for call in (lambda: checked.broadcast(t, 0) if odd else checked.all_reduce(t),
                 lambda: checked.all_reduce(torch.ones(5) if odd else t)):
        try:
            call()
        except commslayer.CollectiveMismatch:
            pass
    checked.all_reduce(t)
    _finish(rec)


def _stopped(rank, size, store, trace_dir):
    import commslayer

    rec, comm = _setup(rank, size, store, trace_dir)
    t = torch.ones(16)
    for _ in range(3):
        comm.all_reduce(t)  # LAST-OP-OF-STOPPED
    store.set(f"pid{rank}", str(os.getpid()))
    if rank == size - 1:
        time.sleep(0.5)  # the JSON-lines sink flushes every 0.1 s
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    try:
        comm.all_reduce(t, timeout=1.5)
    except commslayer.CollectiveTimeout:
        pass
    _finish(rec, "gave up")
    if rank == 0:  # what a launcher does in the end to a rank that never answers
        os.kill(int(store.get(f"pid{size - 1}")), signal.SIGKILL)
    return None


def _killed(rank, size, store, trace_dir):
    import commslayer

    rec, comm = _setup(rank, size, store, trace_dir)
    t = torch.ones(16)
    for _ in range(3):
        comm.all_reduce(t)
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(t, timeout=5)
    except commslayer.CommError:
        pass
    _finish(rec, "peer lost")


def _run(tmp_path_factory, name, fn, env=None):
    d = tmp_path_factory.mktemp(name)
    results = run_ranks(fn, SIZE, str(d), timeout=40, env=env or {}, allow_errors=True)
    return str(d), results


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d, results = _run(tmp_path_factory, "clean", _clean, {"COMMSLAYER_TRACE_JSONL": "1"})
    assert results == [None] * SIZE, results
    return d


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    return _run(tmp_path_factory, "skip", _skip)[0]


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    d, results = _run(tmp_path_factory, "mismatch", _mismatch)
    assert results == [None] * SIZE, results
    return d


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    d, results = _run(tmp_path_factory, "stopped", _stopped, {"COMMSLAYER_TRACE_JSONL": "1"})
    assert isinstance(results[-1], RankDied) and results[-1].exitcode == -signal.SIGKILL, results
    return d


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    d, results = _run(tmp_path_factory, "killed", _killed)
    assert isinstance(results[-1], RankDied) and results[-1].exitcode == -signal.SIGKILL, results
    return d


def trace_cli(*args):
    """Run the installed console script; (exit status, stdout, stderr)."""
    exe = shutil.which("commslayer-trace")
    cmd = [exe] if exe else [sys.executable, "-m", "tracing.cli"]
    p = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def _line_of(marker):
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


# ------------------------------------------------------------------ diagnose

@pytest.mark.timeout(120)
def test_clean_run_diagnoses_ok(clean):
    assert sorted(os.listdir(clean)) >= ["fr", "rank0.json", "rank0.jsonl", "rank1.json"]
    rc, out, err = trace_cli("diagnose", clean)
    assert rc == 0, out + err
    assert out.startswith(f"No problem found in {SIZE} ranks' traces.")
    d = json.loads(trace_cli("diagnose", "--json", clean)[1])
    assert d["ok"] and d["culprits"] == [] and d["findings"] == []
    rows = {c["name"]: c["rows"] for c in d["communicators"]}
    assert [r["last_completed"] for r in rows["a"]] == ["barrier #8"] * SIZE


@pytest.mark.timeout(120)
def test_skipped_collective_names_the_rank(skipped):
    rc, out, _ = trace_cli("diagnose", skipped)
    assert rc == 1
    d = json.loads(trace_cli("diagnose", "--json", skipped)[1])
    assert d["culprits"] == [SIZE - 1], d["headline"]
    assert f"rank {SIZE - 1} (never entered all_reduce #4 of 'a'" in d["headline"]
    wrong = [f for f in d["findings"] if "went wrong at all_reduce #4" in f["text"]]
    assert wrong and wrong[0]["ranks"] == [SIZE - 1] and f"rank {SIZE - 1} never entered it" in wrong[0]["text"]
    assert "Likely culprit: rank 2" in out
    split = next(f for f in d["findings"] if "was called from different lines" in f["text"])
    assert f"ranks 0, 1 at {__file__}:{_line_of('# SKIPPED-BY-LAST')}" in split["text"] and split["ranks"] == [2]


@pytest.mark.timeout(120)
def test_mismatches_are_named(mismatched):
    rc, out, _ = trace_cli("diagnose", mismatched)
    assert rc == 1
    d = json.loads(trace_cli("diagnose", "--json", mismatched)[1])
    texts = [f["text"] for f in d["findings"] if f["text"].startswith("mismatch")]
    odd = SIZE - 1
    assert f"mismatch in 'u' (u.0) at #2: ranks 0, 1 called all_reduce(float32, 32 B, SUM); rank {odd} called " \
           "all_reduce(float32, 32 B, MAX) [differs: reduce_op]" in texts
    assert f"mismatch in 'c' (c.0) at #2: ranks 0, 1 called all_reduce(float32, 32 B, SUM); rank {odd} called " \
           "broadcast(float32, 32 B, root 0) [differs: op, reduce_op, root]" in texts
    assert f"mismatch in 'c' (c.0) at #3: ranks 0, 1 called all_reduce(float32, 32 B, SUM); rank {odd} called " \
           "all_reduce(float32, 20 B, SUM) [differs: bytes]" in texts
    assert len(texts) == 3
    assert d["culprits"] == [odd]


@pytest.mark.timeout(120)
def test_stopped_rank_named_with_its_call_site(stopped):
    assert not os.path.exists(os.path.join(stopped, f"rank{SIZE - 1}.json"))  # a stopped rank never dumps
    assert os.path.exists(os.path.join(stopped, f"rank{SIZE - 1}.jsonl"))
    rc, out, _ = trace_cli("diagnose", stopped)
    assert rc == 1
    d = json.loads(trace_cli("diagnose", "--json", stopped)[1])
    assert d["culprits"] == [SIZE - 1]
    site = f"test_viewer.py:{_line_of('# LAST-OP-OF-STOPPED')}"
    hung = d["ranks"][SIZE - 1]
    assert not hung["dump"] and hung["call_site"].endswith(site), hung
    assert "last seen after all_reduce #3 of 'a' (completed)" in hung["stands"]
    assert any("JSON lines but no dump" in f["text"] for f in d["findings"])
    wrong = next(f["text"] for f in d["findings"] if "went wrong" in f["text"])
    assert f"ranks 0, 1 timed_out" in wrong and f"rank {SIZE - 1} never entered it" in wrong
    for r in d["ranks"][:-1]:
        assert r["stands"].startswith("in all_reduce #4 of 'a' (timed_out)") and r["reason"] == "gave up"


@pytest.mark.timeout(120)
def test_killed_rank_named_and_its_missing_dump_said(killed):
    assert sorted(n for n in os.listdir(killed) if n.startswith("rank")) == ["rank0.json", "rank1.json"]
    rc, out, _ = trace_cli("diagnose", killed)
    assert rc == 1
    d = json.loads(trace_cli("diagnose", "--json", killed)[1])
    assert d["missing_ranks"] == [SIZE - 1] and d["culprits"] == [SIZE - 1]
    assert any(f"rank {SIZE - 1} left no trace file" in f["text"] for f in d["findings"])
    assert f"rank {SIZE - 1} (left no trace while its peers failed in all_reduce #4 of 'a')" in d["headline"]
    assert "rank 2: no trace file" in out
