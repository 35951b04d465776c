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
    from tracing.record.recorder import install

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
    cmd = [exe] if exe else [sys.executable, "-m", "tracing.read.cli"]
    p = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def _line_of(marker):
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


@pytest.mark.timeout(60)
def test_viewer_imports_neither_torch_nor_commslayer():
    code = ("import sys, tracing.read.cli, tracing.read.watch, tracing.read.story; bad = {'torch', 'commslayer'} & set(sys.modules); "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


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
    site = f"{os.path.relpath(__file__)}:{_line_of('# SKIPPED-BY-LAST')}"  # relative to the job's directory
    assert f"ranks 0, 1 at {site}" in split["text"] and split["ranks"] == [2]


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
    assert "ranks 0, 1 timed_out" in wrong and f"rank {SIZE - 1} never entered it" in wrong
    for r in d["ranks"][:-1]:
        assert r["stands"].startswith("in all_reduce #4 of 'a' (timed_out)")
        # how it ended, then its first earlier dump: the dump on error (recorder's thread) may land after "gave up"
        assert r["reason"].startswith("finished (exit 0); earlier dump on "), r["reason"]
        assert "gave up" in r["reason"] or "CollectiveTimeout" in r["reason"], r["reason"]


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


# ------------------------------------------------------------------ summary, overlap, clocks

def _dump_records(d):
    """Every record of every rank's dump, with its rank and its anchor."""
    out = []
    for name in sorted(os.listdir(d)):
        if name.endswith(".json"):
            doc = load_dump(os.path.join(d, name))
            anchor = doc["clock"]["wall_ns"] - doc["clock"]["mono_ns"]
            out += [dict(r, rank=doc["rank"], anchor=anchor) for r in doc["records"]]
    return out


BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0, "send": lambda n: 1.0,
       "recv": lambda n: 1.0, "all_gather_single": lambda n: (n - 1) / n, "reduce_scatter_single": lambda n: (n - 1) / n}


@pytest.mark.timeout(120)
def test_summary_matches_an_independent_computation(clean):
    s = json.loads(trace_cli("summary", "--json", clean)[1])
    records = _dump_records(clean)
    assert len(records) == 3 * 11 + 2  # nothing lost or doubled by merging the JSON lines with the dumps
    expect = {}
    for r in records:
        size = r["out_bytes"] if r["op"] in ("all_gather_single", "recv") else r["in_bytes"]
        g = expect.setdefault((r["comm_id"], r["op"], size.bit_length()), {"S": 0, "t": 0, "d": []})
        g["S"] += size
        g["t"] += r["end_ns"] - r["start_ns"]
        g["d"].append((r["end_ns"] - r["start_ns"]) / 1e6)
    got = {(g["comm"], g["op"], g["bucket_max_bytes"].bit_length() - 1): g for g in s["groups"]}
    assert set(got) == set(expect)
    for key, e in expect.items():
        g, d = got[key], sorted(e["d"])
        assert g["count"] == len(d)
        assert g["total_ms"] == pytest.approx(sum(d))
        assert g["mean_ms"] == pytest.approx(sum(d) / len(d))
        assert g["p50_ms"] == pytest.approx(d[(len(d) + 1) // 2 - 1])
        assert g["p99_ms"] == pytest.approx(d[-1])  # fewer than 100 samples: nearest rank is the largest
        if key[1] == "barrier":
            assert g["algbw_gbps"] is None and g["busbw_gbps"] is None
        else:
            assert g["algbw_gbps"] == pytest.approx(e["S"] / e["t"])
            assert g["busbw_gbps"] == pytest.approx(e["S"] / e["t"] * BUS[key[1]](SIZE))
    # straggler time: wait for the last arrival, over collectives all ranks recorded
    offsets = {c["rank"]: round(c["offset_us"] * 1e3) for c in s["clock"]}  # ints: wall ns overflow a float's 53 bits
    arrivals = {}
    for r in records:
        if r["op"] not in ("send", "recv"):
            arrivals.setdefault((r["comm_id"], r["seq"]), {})[r["rank"]] = r["enqueue_ns"] + r["anchor"] \
                - offsets[r["rank"]]
    wait = {rank: 0.0 for rank in range(SIZE)}
    for per in arrivals.values():
        assert len(per) == SIZE
        for rank, t in per.items():
            wait[rank] += (max(per.values()) - t) / 1e9
    for row in s["stragglers"]:
        assert row["collectives"] == len(arrivals)
        assert row["wait_s"] == pytest.approx(wait[row["rank"]], abs=1e-9)
    assert sum(row["last_arrivals"] for row in s["stragglers"]) == len(arrivals)
    for c in s["clock"]:  # one host, one monotonic clock: the anchors already agree
        assert c["low_us"] <= 0 <= c["high_us"] and c["offset_us"] == 0 and c["consistent"]


@pytest.mark.timeout(60)
def test_clock_offsets_recover_a_shifted_clock(clean, tmp_path):
    shift_ns = 500_000_000
    for name in os.listdir(clean):
        if name.endswith(".json"):  # the dumps only: their anchors are the clocks
            doc = load_dump(os.path.join(clean, name))
            if doc["rank"] == 1:
                doc["clock"]["wall_ns"] += shift_ns
            (tmp_path / name).write_text(json.dumps(doc))
    s = json.loads(trace_cli("summary", "--json", str(tmp_path))[1])
    c = next(c for c in s["clock"] if c["rank"] == 1)
    assert c["collectives"] == 10 and c["consistent"]  # the symmetric ones: not the broadcast
    assert c["low_us"] * 1e3 <= shift_ns <= c["high_us"] * 1e3
    assert abs(c["offset_us"] * 1e3 - shift_ns) <= c["uncertainty_us"] * 1e3 < shift_ns / 5


def _busy(intervals):
    return sorted(intervals)


def _covered(t, intervals):
    return any(a <= t < b for a, b in intervals)


@pytest.mark.timeout(60)
def test_overlap_matches_a_brute_force_sweep(clean):
    rc, out, _ = trace_cli("overlap", "--json", clean)
    assert rc == 0
    got = {r["rank"]: r for r in json.loads(out)["ranks"]}
    for rank in range(SIZE):
        mine = [r for r in _dump_records(clean) if r["rank"] == rank]
        rs = [(r["start_ns"], r["end_ns"]) for r in mine if r["op"] == "reduce_scatter_single"]
        ag = [(r["start_ns"], r["end_ns"]) for r in mine if r["op"] == "all_gather_single"]
        points = sorted({t for a, b in rs + ag for t in (a, b)})
        rs_ns = hidden = 0
        for a, b in zip(points, points[1:]):
            if _covered(a, rs):
                rs_ns += b - a
                if _covered(a, ag):
                    hidden += b - a
        g = got[rank]
        assert g["rs_count"] == 3 and g["ag_count"] == 3
        assert g["rs_s"] == pytest.approx(rs_ns / 1e9) and g["hidden_rs_s"] == pytest.approx(hidden / 1e9)
        assert g["hidden_fraction"] == pytest.approx(hidden / rs_ns)
        assert 0 < g["exposed_comm_s"] <= g["comm_s"]


def test_covered_length_matches_a_sweep_of_random_intervals():
    import random
    from array import array

    from tracing.read.analysis import Busy, covered

    rng = random.Random(3)
    for _ in range(300):
        groups = [[(a, a + rng.randrange(-3, 12)) for a in (rng.randrange(0, 60) for _ in range(rng.randrange(0, 9)))]
                  for _ in range(rng.randrange(1, 4))]  # ends before starts too: empty
        flat = [array("q", [t for span in g for t in span]) for g in groups]
        spans = [(a, b) for g in groups for a, b in g if b > a]
        assert covered(*flat) == sum(_covered(t, spans) for t in range(-5, 80))
    busy = Busy()  # a corrupt wait time (no int64 fits it) is left out, not an overflow
    busy.add(0, 10, 20, 5, True, -(10 ** 30), 10 ** 30)
    busy.add(0, 30, 40, 25, True, 31, 35)
    stats = busy.stats(0, None)
    assert stats.comm_s == pytest.approx(20e-9) and stats.exposed_comm_s == pytest.approx(4e-9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", ["clean", "skipped", "mismatched"])  # skipped: call-site ids remapped
def test_parallel_reading_gives_the_same_answers(scenario, request, monkeypatch):
    from tracing.read import analysis

    d = request.getfixturevalue(scenario)
    one = analysis.JobScan([d])
    monkeypatch.setattr(analysis, "PARALLEL_BYTES", 0)
    split = analysis.JobScan([d], jobs=SIZE)  # one rank per worker: ids interned apart, then remapped
    assert analysis.summary(split) == analysis.summary(one)
    assert analysis.diagnose(split) == analysis.diagnose(one)
    assert {k: list(a) for k, a in split.collectives.items()} == {k: list(a) for k, a in one.collectives.items()}


# ------------------------------------------------------------------ Perfetto export

@pytest.mark.timeout(60)
def test_perfetto_export_structure(clean, tmp_path):
    out = tmp_path / "trace.json"
    rc, text, err = trace_cli("export", clean, "--perfetto", str(out))
    assert rc == 0, err
    events = json.loads(out.read_text())["traceEvents"]
    meta = {(e["pid"], e["tid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 3 * 11 + 2
    for rank in range(SIZE):
        assert meta[(rank, 0, "process_name")] == {"name": f"rank {rank} ({load_dump(os.path.join(clean, f'rank{rank}.json'))['host']})"}
        assert meta[(rank, 0, "process_sort_index")] == {"sort_index": rank}
    lanes = {}
    for e in slices:
        assert isinstance(meta[(e["pid"], e["tid"], "thread_name")]["name"], str)
        assert isinstance(meta[(e["pid"], e["tid"], "thread_sort_index")]["sort_index"], int)
        assert e["dur"] >= 0 and e["ts"] >= 0
        lanes.setdefault((e["pid"], e["tid"]), []).append(e)
    assert len({tid for _, tid in lanes}) == len(lanes)  # a lane is one thread id in the whole file
    for lane in lanes.values():  # slices of one thread never overlap: proper nesting
        lane.sort(key=lambda e: e["ts"])
        assert len({e["args"]["comm_id"] for e in lane}) == 1
        for a, b in zip(lane, lane[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    # the async all-gather and reduce-scatter overlap in time: different communicators, different threads
    flows = {}
    for e in events:
        if e["ph"] in "stf":
            flows.setdefault(e["id"], []).append(e)
    assert len(flows) == 11  # one per collective (8 on 'a', 3 on 'rs')
    for chain in flows.values():
        phases = sorted(e["ph"] for e in chain)
        assert phases == ["f", "s", "t"] and len({e["pid"] for e in chain}) == SIZE
        s_, t_, f_ = (next(e for e in chain if e["ph"] == p) for p in "stf")
        assert s_["ts"] <= t_["ts"] <= f_["ts"] and f_["bp"] == "e"
        for e in chain:  # each end binds to a slice of its own thread
            assert any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in lanes[(e["pid"], e["tid"])]), e


# ------------------------------------------------------------------ bad input

def _copy_dumps(src, dst):
    for name in os.listdir(src):
        if name.startswith("rank"):
            shutil.copy(os.path.join(src, name), dst / name)


@pytest.mark.timeout(60)
def test_bad_input_names_file_and_line(clean, tmp_path):
    _copy_dumps(clean, tmp_path)
    dump = tmp_path / "rank1.json"
    dump.write_bytes(dump.read_bytes()[:-200])  # truncated
    lines = (tmp_path / "rank2.jsonl").read_bytes().splitlines(keepends=True)
    lines[3] = b'{"event": "collective", "rank": 2, "op_id": \n'
    (tmp_path / "rank2.jsonl").write_bytes(b"".join(lines))
    rc, out, err = trace_cli("diagnose", str(tmp_path))
    assert rc == 2 and f"{dump}:1: truncated or corrupt JSON" in err and "--skip-bad" in err
    rc, out, err = trace_cli("summary", "--json", "--skip-bad", str(tmp_path))
    assert rc == 0
    assert f"skipped {dump}:1: truncated or corrupt JSON" in err
    assert f"skipped {tmp_path / 'rank2.jsonl'}:4: truncated or corrupt JSON line" in err
    s = json.loads(out)
    assert s["ranks"] == [0, 1, 2] and len(s["problems"]) == 2
    # rank 1 still counts through its JSON lines; rank 2's lost line comes from its dump
    assert sum(g["count"] for g in s["groups"]) == 3 * 11 + 2
    os.remove(tmp_path / "rank2.jsonl")
    os.remove(tmp_path / "rank1.jsonl")
    doc = json.loads((tmp_path / "rank0.json").read_text())
    doc["schema"] = 2
    (tmp_path / "rank0.json").write_text(json.dumps(doc))
    rc, _, err = trace_cli("summary", str(tmp_path))
    assert rc == 2 and f"{tmp_path / 'rank0.json'}:1: trace schema 2; this reader knows 1" in err
    rc, _, err = trace_cli("diagnose", "--skip-bad", str(tmp_path))
    assert rc == 1 and "trace schema 2" in err  # rank 0 and 1 are gone: said, and diagnosed as missing


# ------------------------------------------------------------------ HTML view in a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EVIL = "</script><img src=x onerror=\"document.title='pwned'\">&amp;"


def _chromium(tmp_path, *args):
    profile = tmp_path / f"profile-{len(os.listdir(tmp_path))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,1000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/run.sh installs it)")
def test_html_view_in_headless_chromium(stopped, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    _copy_dumps(stopped, traces)
    os.remove(traces / "rank0.jsonl")  # so that rank 0's records come from the dump edited here
    doc = load_dump(str(traces / "rank0.json"))
    doc["records"][-1]["call_site"] = EVIL  # trace strings are data, never markup
    (traces / "rank0.json").write_text(json.dumps(doc))
    page = tmp_path / "view.html"
    rc, out, err = trace_cli("view", str(traces), "-o", str(page), "--title", "seeded hang")
    assert rc == 0, err
    text = page.read_text()
    assert "<img" not in text and "http://" not in text and "https://" not in text  # nothing to fetch
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    html_out = dom.stdout
    assert 'data-rendered="11"' in html_out  # the script ran to its end and drew every op
    assert "Likely culprit: rank 2 (never entered all_reduce #4 of 'a'" in html_out
    assert "&lt;/script&gt;&lt;img src=x" in html_out and "<img" not in html_out
    assert "<title>seeded hang</title>" in html_out and '<div id="errors"></div>' in html_out
    shot = tmp_path / "view.png"
    run = _chromium(tmp_path, "--enable-logging=stderr", "--v=0", f"--screenshot={shot}", page.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert len(console) == 1 and "commslayer-trace view rendered 11 ops" in console[0], console
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1400 and len(png) > 20000
