"""Every benchmark in launch/ still runs: its ``--smoke`` mode (the smallest sizes, one
repeat, every configuration it compares) as a real subprocess, the way a user starts it.

Each test checks the exit status and reads the table the benchmark prints: its columns,
one row per configuration, numbers in the cells.  The overlap benchmark builds network
namespaces and runs as root only.  No benchmark may touch docs/data.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from commslayer.run.processes import free_port
from faults.etcd import available as etcd_available

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
NUMBER = re.compile(r"(?<![\d.])[-+]?\d+(?:\.\d+)?")  # "0.15-0.20" is two numbers, not 0.15 and -0.20


@pytest.fixture(autouse=True)
def docs_data_untouched():
    """A smoke run never overwrites the published figures."""
    before = {p.name: p.stat().st_mtime_ns for p in DATA.iterdir()}
    yield
    assert {p.name: p.stat().st_mtime_ns for p in DATA.iterdir()} == before


def run_bench(*argv: str, timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """``python *argv`` from the repository root; its stdout, once it exited 0."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []


def rows(out: str, header: List[str], nth: int = 0) -> List[List[str]]:
    """The rows of the ``nth`` Markdown table in ``out`` whose columns are ``header``."""
    lines = out.splitlines()
    heads = [i for i, line in enumerate(lines) if cells(line) == header]
    assert len(heads) > nth, f"no table with columns {header} in:\n{out[-3000:]}"
    i = heads[nth]
    assert re.fullmatch(r"\|(-+:?\|)+", lines[i + 1].strip()), lines[i + 1]
    found = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        assert len(cells(line)) == len(header), line
        found.append(cells(line))
    return found


def table(out: str, header: List[str], key: str) -> Dict[str, Dict[str, str]]:
    """Such a table as {row's ``key`` cell: {column: cell}}, the keys in their order."""
    found = {}
    for row in rows(out, header):
        found[row[header.index(key)]] = dict(zip(header, row))
    return found


def numbers(cell: str) -> List[float]:
    """Every number in a cell ("1.23 ms [1.20 ms–1.30 ms]", "-0.35–5.38 %", "+0.00"); at least one."""
    found = [float(x) for x in NUMBER.findall(cell)]
    assert found, f"no number in {cell!r}"
    return found


def median_in_range(cell: str) -> float:
    """A "median [min–max]" cell: the median, checked to lie in its range."""
    med, lo, hi = numbers(cell)[:3]
    assert lo <= med <= hi, cell
    return med


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 2])
def test_hotpath_smoke(ranks):
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())] \
        if ranks > 1 else []
    out = run_bench(*launch, "launch/bench/bench_hotpath.py", "--smoke", timeout=50)
    header = ["variant", "CPU µs/op, median of rounds", "min–max over rounds", "minus plain c10d"]
    found = table(out, header, "variant")
    assert list(found) == ["plain c10d", "commslayer", "commslayer + recorder", "commslayer, isolate_writes",
                           "recorder calls alone"] + (["should_commit", "should_commit + recorder"] if ranks > 1 else [])
    for row in found.values():
        med, (lo, hi) = numbers(row[header[1]])[0], numbers(row[header[2]])
        assert 0 < lo == med == hi  # one round
        numbers(row[header[3]])
    assert found["plain c10d"][header[3]] == "+0.00"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", [[], ["--async-op", "--dispatch"]], ids=["sync", "async"])
def test_overhead_smoke(tmp_path, how):
    out = run_bench("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                    "launch/bench/bench_overhead.py", "--smoke", *how, timeout=140, env={"TMPDIR": str(tmp_path)})
    traced = ["recorder", "recorder+jsonl", "recorder+jsonl+otel", "backend", "general", "python"]
    if how:  # the routed path, traced and not, the adapter's communicator called directly, the C++ backends
        traced += ["c10d-adapter", "c10d-adapter+recorder", "adapter-comm", "forward-backend", "forward-backend-pysub"]
    traced += ["nan-check"]
    header = ["op", "size", "reps", "plain (A)", "plain2 (A')", "commslayer (B)", "B/A", "A'/A", "B−A"]
    header += [col for v in traced for col in (v, "/A", "−A")]
    medians = [header.index(v) for v in ("plain (A)", "plain2 (A')", "commslayer (B)", *traced)]
    ratios = [i for i, col in enumerate(header) if col in ("B/A", "A'/A", "/A")]
    for nth in (0, 1):  # wall time, then the calling thread's CPU time
        found = rows(out, header, nth)
        assert [r[0] for r in found] == ["all_reduce", "all_gather_single", "reduce_scatter_single"]
        for row in found:
            assert row[1:3] == ["4 B", "1"]  # the smallest size, one timed round
            assert all(median_in_range(row[i]) > 0 for i in medians), row
            assert all(numbers(row[i])[0] > 0 for i in ratios), row
    for op in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
        assert f"- {op}: equal" in out
    assert not list(tmp_path.glob("bench-overhead-*")), "the traced variants' temporary directory was left behind"
    assert not list(tmp_path.glob("bench-forward-*")), "the forwarding backend's build was left behind"


@pytest.mark.timeout(240)
def test_routed_smoke():
    # two configurations of six (each job is a torchrun of its own, about 7 s): the rest differ
    # only in the environment they set, and the paths they take have tests of their own
    out = run_bench("launch/bench/bench_routed.py", "--smoke", "--configs", "routed, recorder", timeout=230)
    header = ["job", "configuration", "step ms (median)", "min–max", "vs plain (median)", "min–max",
              "CPU ms a step, 2 ranks (median)", "main thread (median)"]
    found = rows(out, header)
    configs = ["plain", "routed, recorder"]
    assert [r[:2] for r in found] == [[job, c] for job in ("fsdp2", "ddp") for c in configs], found
    for row in found:
        low, high = numbers(row[3])
        assert 0 < low <= numbers(row[2])[0] <= high, row
        assert row[4] == "–" if row[1] == "plain" else len(numbers(row[5])) == 2, row
        cpu, main = numbers(row[6])[0], numbers(row[7])[0]
        assert 0 < main <= cpu, row


@pytest.mark.timeout(120)
def test_tracing_train_smoke():
    out = run_bench("launch/bench/bench_tracing_train.py", "--smoke", timeout=110)
    header = ["variant", "median step (ms)", "min–max over repeats (ms)", "ratio to off", "runs that failed at exit"]
    found = table(out, header, "variant")
    assert list(found) == ["off", "off (A/A)", "all sinks"]
    for row in found.values():
        step, (lo, hi) = numbers(row[header[1]])[0], numbers(row[header[2]])
        assert 0 < lo == step == hi  # one run
        assert numbers(row["ratio to off"])[0] > 0
        assert re.fullmatch(r"[01] of 1", row["runs that failed at exit"])
    assert found["off"]["ratio to off"] == "1.000"


@pytest.mark.timeout(120)
def test_recovery_smoke():
    out = run_bench("launch/bench/bench_recovery.py", "--smoke", timeout=110)
    header = ["scenario", "stall of the slowest survivor, median (s)", "min–max (s)", "repeats"]
    found = table(out, header, "scenario")
    assert list(found) == ["ours, SIGKILL", "ours, SIGSTOP (peer timeout 1 s)", "plain Gloo (timeout 2 s), SIGKILL",
                           "plain Gloo (timeout 2 s), SIGSTOP", "plain Gloo (default 1800 s), SIGKILL",
                           "torchrun --max-restarts 1, SIGKILL"]
    stall = {}
    for name, row in found.items():
        assert row["repeats"] == "1"
        assert not row[header[1]].startswith(">"), row  # every survivor saw the loss within the cap
        stall[name] = numbers(row[header[1]])[0]
        assert stall[name] > 0 and numbers(row["min–max (s)"]) == [stall[name]] * 2
    # the smoke mode's shorter timeouts are the ones in force (at the defaults, about 3 and 4.7 s)
    assert stall["ours, SIGSTOP (peer timeout 1 s)"] < 2.5
    assert stall["plain Gloo (timeout 2 s), SIGSTOP"] < 2.5


@pytest.mark.timeout(300)
def test_training_smoke():
    out = run_bench("launch/bench/bench_training.py", "--smoke", timeout=290)
    header = ["configuration", "step time, median (ms)", "min–max (ms)", "steps/s, median", "min–max",
              "vs plain Gloo, median", "min–max"]
    free = rows(out, header)
    assert [r[0] for r in free] == ["ours", "ours, untraced", "plain Gloo"]  # the smoke runs no A/A
    for row in free:
        assert numbers(row[1])[0] > 0 and numbers(row[3])[0] > 0
        if row[0] == "plain Gloo":  # the reference of the last two columns
            assert row[5:] == ["–", "–"]
        else:
            median_in_range(row[5] + " " + row[6])
    header = ["configuration", "what is timed", "median (s)", "min–max (s)"]
    faulted = rows(out, header)
    assert [r[0] for r in faulted] == ["ours, SIGKILL in allreduce"] * 3 + ["torchrun + DCP"] * 8
    for row in faulted:
        med, (lo, hi) = numbers(row[2])[0], numbers(row[3])
        assert lo == med == hi, row  # one run
    assert all(numbers(r[2])[0] > 0 for r in faulted if "survivor stall" in r[1])
    # the job went on to its end after the recovery
    assert "ours, SIGKILL in allreduce: the job ended in failure after the recovery in 0 of 1 runs" in out
    assert "bitwise equal to the first time: [True]" in out


@pytest.mark.timeout(300)
def test_resilience_smoke():
    out = run_bench("launch/bench/bench_resilience.py", "--smoke", timeout=290)
    scripts = ["DDP example"]
    configs = ["ours", "ours, after backward", "plain HSDP", "plain torchrun, 4 ranks"]  # the smoke runs no A/A
    header = ["script", "configuration", "step time, median (ms)", "min–max (ms)", "vs plain HSDP, median", "min–max"]
    free = rows(out, header)
    assert [(r[0], r[1]) for r in free] == [(s, c) for s in scripts for c in configs]
    for row in free:
        step, (lo, hi) = numbers(row[2])[0], numbers(row[3])
        assert 0 < lo == step == hi, row  # one run
        if row[1] == "plain HSDP":
            assert row[4:] == ["–", "–"]
        else:
            assert numbers(row[4]) and numbers(row[5]), row
    assert [r[0] for r in rows(out, ["script", "median", "min–max"])] == scripts
    header = ["script", "fault", "kill → the step committed by the survivors (stall)", "min–max",
              "loss detected → committed", "min–max", "heal (join + state transfer)", "min–max",
              "kill → the group back in", "min–max"]
    faulted = rows(out, header)
    assert [(r[0], r[1]) for r in faulted] == [("DDP example", "SIGKILL in backward")]
    for row in faulted:
        stall, detected, heal, back = (numbers(row[i])[0] for i in (2, 4, 6, 8))
        assert 0 < detected <= stall and 0 < heal < back, row


@pytest.mark.timeout(240)
def test_step_cost_smoke():
    configs = ["plain torchrun", "plain HSDP", "plain HSDP + vote", "replica, recorder", "per-rank, JSON lines"]
    out = run_bench("launch/bench/bench_step_cost.py", "--smoke", "--scripts", "train.py", "--configs", *configs,
                    timeout=230)
    header = ["script", "configuration", "step time, median (ms)", "min–max (ms)", "vs baseline, median", "min–max"]
    steps = rows(out, header)
    assert [r[:2] for r in steps] == [["train.py", c] for c in configs], steps
    for row in steps:
        step, (lo, hi) = numbers(row[2])[0], numbers(row[3])
        assert 0 < lo == step == hi, row  # one run
        assert (row[4:] == ["–", "–"]) == (row[1] in ("plain torchrun", "plain HSDP")), row  # the baselines
    header = ["script", "configuration", "process CPU", "min–max", "main thread", "min–max", "gc", "min–max",
              "snapshots", "min–max", "copies' threads", "min–max", "copies' bytes per step"]
    account = {r[1]: r for r in rows(out, header)}
    assert list(account) == configs
    for config, row in account.items():
        cpu, main = numbers(row[2])[0], numbers(row[4])[0]
        assert 0 < main <= cpu, row
        copied = config.startswith("per-rank")
        # per-rank mode snapshots its state and copies it to a peer every step; nothing else copies anything
        assert (numbers(row[8])[0] > 0, numbers(row[10])[0] > 0, int(row[12]) > 0) == (copied,) * 3, row
    header = ["script", "configuration", "step()", "min–max", "optimizers", "min–max", "step() less optimizers"]
    parts = {r[1]: r for r in rows(out, header)}
    assert list(parts) == configs
    for config, row in parts.items():
        call, optimizers, rest = numbers(row[2])[0], numbers(row[4])[0], numbers(row[6])[0]
        assert 0 < optimizers < call and rest > 0, row
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| train.py: configuration |"))
    kinds = cells(lines[at])[1:]
    assert "MainThread" in kinds, kinds
    assert [cells(line)[0] for line in lines[at + 2:at + 2 + len(configs)]] == configs


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="builds network namespaces: needs root and iproute2")
def test_overlap_smoke():
    out = run_bench("launch/bench/bench_overlap.py", "--smoke", timeout=170)
    assert "**2 ranks**" in out
    header = ["configuration", "backward ms, median [min–max]", "step ms, median [min–max]",
              "RS hidden under AG, median [min–max]", "rank 0 sent per step, rail 1 / rail 2 (MB)",
              "backward speed-up vs default / vs native"]
    found = table(out, header, "configuration")
    assert list(found) == ["default", "default (A/A)", "native", "ours, 1 link", "ours, 2 links"]
    for name, row in found.items():
        assert median_in_range(row[header[1]]) > 0 and median_in_range(row[header[2]]) > 0
        assert 0 <= median_in_range(row[header[3]]) <= 100
        assert len(numbers(row[header[5]])) == 2
        rail1, rail2 = numbers(row[header[4]])
        # the testbed carries the traffic: reduce-scatter moves to rail 2 in "ours, 2 links" only
        assert rail1 > 0 and (rail2 > 0) == (name == "ours, 2 links"), row


@pytest.mark.timeout(60)
def test_viewer_smoke():
    out = run_bench("launch/bench/bench_viewer.py", "--smoke", timeout=50)
    header = ["layout", "files", "command", "wall s", "max RSS MiB (largest process)", "peak MiB (process tree)",
              "exit"]
    found = rows(out, header)
    assert [(r[0], r[2]) for r in found] == [("jsonl", "summary"), ("jsonl", "diagnose"), ("dump", "summary"),
                                            ("dump", "diagnose"), ("jsonl", "view"), ("dump", "view")]
    for row in found:
        assert row[6] == "[0]", row  # every command succeeded
        assert all(median_in_range(row[i]) > 0 for i in (3, 4, 5)), row


@pytest.mark.timeout(120)
def test_gloo_exit_smoke():
    out = run_bench("launch/bench/bench_gloo_exit.py", "--smoke", timeout=110)
    found = rows(out, ["arm", "runs", "aborted", "of those, 'terminate called'", "wait at exit, ms: median", "min–max"])
    assert [r[0] for r in found] == ["plain torch", "commslayer, wait removed", "commslayer"]
    for row in found:
        assert row[1] == "1" and int(row[2]) in (0, 1) and 0 <= int(row[3]) <= int(row[2]), row
    assert found[2][2] == "0" and float(found[2][4]) >= 0, found[2]  # the wait ran (timed) and nothing aborted


@pytest.mark.timeout(120)
def test_watch_simulation_smoke():
    out = run_bench("launch/bench/simulate_watch.py", "--smoke", timeout=110)
    header = ["members", "topology", "jitter ms", "kill median / p99 / max ms", "stop median / p99 / max ms",
              "missed", "frames/member/s median (max)", "heartbeats/member/s", "false positives", "sim wall s"]
    sparse, mesh = rows(out, header)
    assert sparse[:3] == ["200", "k=3", "50"] and mesh[:3] == ["16", "full mesh", "50"]
    for row in (sparse, mesh):
        kill, stop = ([float(x) for x in row[i].split(" / ")] for i in (3, 4))
        assert row[5] == "0" and row[8] == "0", row  # every member saw both faults; no healthy one declared
        assert kill[0] <= kill[1] <= kill[2] < 500 and 3000 - 250 <= stop[0] <= stop[2] < 3000 + 500, row
    assert sparse[7] == "12.0 (12.0)" and mesh[7] == "60.0 (60.0)"  # k or N - 1 heartbeats per 0.25 s


@pytest.mark.timeout(240)
def test_watch_processes_smoke():
    out = run_bench("launch/bench/bench_watch.py", "--smoke", timeout=230)
    header = ["run", "members", "topology", "kill → declared, median / max ms", "stop → declared, median / max s",
              "frames/member/s, median / max", "survivors' declarations of healthy ranks"]
    real, sim = rows(out, header)
    assert real[:3] == ["real processes", "8", "k=3"] and sim[:3] == ["simulator", "8", "k=3"]
    for row in (real, sim):
        kill, stop, frames = ([float(x) for x in row[i].split(" / ")] for i in (3, 4, 5))
        assert row[6] == "0", row  # no healthy rank declared lost
        assert 0 < kill[0] <= kill[1] < 3000 and 1.0 - 0.2 <= stop[0] <= stop[1] < 1.0 + 1.5, row
        assert 3 * 10 <= frames[0] < 3 * 10 * 2, row  # k heartbeats per 0.1 s, plus the two losses' reports


@pytest.mark.timeout(120)
def test_agreement_smoke():
    out = run_bench("launch/bench/bench_agreement.py", "--smoke", timeout=110)
    header = ["members", "waits", "requests per survivor: median (max)", "requests per decision",
              "agree s: median (min–max)"]
    got = rows(out, header)
    assert [r[:2] for r in got] == [["4", "blocking"], ["4", "polling"], ["8", "blocking"], ["8", "polling"]]
    for blocking, polling in (got[0:2], got[2:4]):
        (b, b_most), (p, _) = (map(int, re.fullmatch(r"(\d+) \((\d+)\)", r[2]).groups()) for r in (blocking, polling))
        # join (with what it suspects), one wait, one read of the decision; the proposer reads the list too
        assert b == 3 <= b_most, blocking
        assert b < p <= 40, polling  # a poll of the decision every few milliseconds costs more
        for row in (blocking, polling):
            assert 0 < median_in_range(row[4]) < 10, row


@pytest.mark.timeout(60)
def test_agreement_simulation_smoke():
    out = run_bench("launch/bench/simulate_agreement.py", "--smoke", timeout=50)
    header = ["members", "fault", "waits", "decision written s", "last survivor has it s: median (max)",
              "agreement's own s", "requests per survivor: median (max)", "requests per decision", "server busy s",
              "sim wall s"]
    got = rows(out, header)
    assert [r[:3] for r in got] == [["200", f, w] for f in ("kill", "stop") for w in ("blocking", "polling")]
    for row in got:
        decided, last, own = float(row[3]), float(row[4].split()[0]), float(row[5])
        assert 0 < decided <= last and 0 < own < 1.0, row  # within 1 s of the last detection
        assert (decided < 0.5) if row[1] == "kill" else (2.0 < decided < 3.5), row
    assert got[0][6].startswith("3 ") and got[2][6].startswith("3 "), got  # one wait per survivor


def pair(row: List[str], i: int) -> float:
    """The median in cell ``i`` of a row whose next cell is its min–max, checked to lie in it."""
    return median_in_range(f"{row[i]} {row[i + 1]}")


@pytest.mark.timeout(180)
def test_peer_smoke():
    # four runs of 4 ranks: 15-18 s each on a loaded 2-core machine
    out = run_bench("launch/bench/bench_peer.py", "--smoke", timeout=170)
    header = ["configuration", "stall: kill → step F committed again", "min–max", "steps redone",
              "replacement: kill → process started", "min–max", "process start (→ model built)", "min–max",
              "stall − process start", "min–max"]
    [lost] = rows(out, header)
    assert lost[0] == "peer redundancy (per-rank mode)"
    stall, started, start = pair(lost, 1), pair(lost, 4), pair(lost, 6)
    assert lost[3] in ("[0]", "[1]")  # the interrupted step redone, at most the one before it too
    # the survivors commit step F again only with the replacement, which was started and built its model first;
    # its start is the kernel's, in clock ticks rounded down, so it may read up to one tick before the kill
    # when the launcher restarts it within that tick
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert -tick <= started < 5 and 0 < start and started + start < stall < 60, lost
    header = ["configuration", "exec → interpreter up", "min–max", "import torch", "min–max", "other imports",
              "min–max", "model build (FSDP2)", "min–max", "checkpoint load", "min–max"]
    [parts] = rows(out, header)
    up, torch_, other, build = (pair(parts, i) for i in (1, 3, 5, 7))
    assert min(up, torch_, other, build) > 0 and up + torch_ + other + build <= start + 0.001, parts
    header = ["configuration", "stall", "min–max", "steps redone", "fault → spare given the rank", "min–max",
              "→ init() returned", "min–max", "→ model build begins", "min–max", "model build", "min–max",
              "→ step F committed", "min–max"]
    [spared] = rows(out, header)
    assert spared[0] == "peer + 1 warm spare"
    stall, parts = pair(spared, 1), [pair(spared, i) for i in (4, 6, 8, 10, 12)]
    # the parts follow one another from the kill to the commit: they add up to the stall
    assert min(parts) >= 0 and parts[3] > 0 and abs(sum(parts) - stall) < 0.005 and stall < 60, spared
    header = ["configuration", "step time, median (ms)", "min–max (ms)", "vs plain torchrun, median", "min–max"]
    free = rows(out, header)
    assert [r[0] for r in free] == ["plain torchrun", "peer, refresh every step"]
    assert free[0][3:] == ["–", "–"] and pair(free[0], 1) > 0
    assert pair(free[1], 1) > 0 and numbers(free[1][3])
    header = ["configuration", "packed state (bytes)", "min–max", "sent per step (bytes)", "min–max",
              "held at the end / state", "min–max", "peak held / state", "min–max"]
    [copies] = rows(out, header)
    state, sent, held, peak = (pair(copies, i) for i in (1, 3, 5, 7))
    # one holder per rank: the copies sent each step are at most one state; what is held is at least the ward's copy
    assert 0 < sent <= state and 1 <= held <= peak, copies


@pytest.mark.timeout(60)
@pytest.mark.parametrize("issue", [[], ["--async-adapter"]], ids=["api", "async-adapter"])
def test_reduce_scatter_smoke(issue):
    out = run_bench("launch/bench/bench_reduce_scatter.py", "--smoke", *issue, timeout=50)
    assert "**2 ranks**" in out
    header = ["input", "configuration", "ms per op, median [min–max]", "speed-up vs native",
              "caller CPU per op, µs [min–max]", "rank 0 sent per op: wire / TCP payload (MB)",
              "payload / ((n-1)/n × input)"]
    found = rows(out, header)
    assert [(r[0], r[1]) for r in found] == [(size, cfg) for size in ("64 KiB", "1 MiB")
                                             for cfg in ("native", "native (A/A)", "ring")]
    for row in found:
        assert median_in_range(row[2]) > 0 and numbers(row[3])[0] > 0 and median_in_range(row[4]) > 0
        assert row[5] == row[6] == "–"  # loopback: no link counters
    assert "command: python launch/bench/bench_reduce_scatter.py --smoke" in out


@pytest.mark.timeout(240)
@pytest.mark.skipif(not etcd_available(), reason="etcd is not installed (Debian's etcd-server)")
def test_etcd_smoke():
    out = run_bench("launch/bench/bench_etcd.py", "--smoke", timeout=230)
    header = ["store", "step time, median (ms)", "min–max (ms)", "vs TCPStore, median", "min–max"]
    free = rows(out, header)
    assert [r[0] for r in free] == ["TCPStore", "etcd"]  # the smoke leaves out the A/A
    assert free[0][3:] == ["–", "–"] and all(pair(r, 1) > 0 for r in free)
    assert numbers(free[1][3]) and numbers(free[1][4])
    assert "SIGKILLed in the all-reduce" not in out  # the smoke leaves out a rank's SIGKILL
    header = ["fault", "stall", "min–max", "longest step", "min–max"]
    leader = rows(out, header)
    assert [r[0] for r in leader] == ["leader SIGKILL"]  # the smoke leaves out its SIGSTOP
    assert all(0 < pair(r, 3) < 8 for r in leader)  # the job went on, each step within the store deadline


@pytest.mark.timeout(120)
def test_nccl_smoke():
    """Without CUDA (this project's CI) it says so and exits 0; with a GPU, its table."""
    import torch

    out = run_bench("launch/bench/bench_nccl.py", "--smoke", timeout=100)
    if not torch.cuda.is_available():
        assert "no CUDA device here" in out
        return
    header = ["variant", "bytes", "CPU µs (median)", "CPU µs (min–max)", "wall µs (median)", "wall µs (min–max)",
              "CPU over plain, µs"]
    found = table(out, header, "variant")
    assert list(found) == ["plain", "plain A'", "commslayer", "plain async", "commslayer async"]
    for row in found.values():
        assert numbers(row["CPU µs (median)"])[0] > 0 and numbers(row["wall µs (median)"])[0] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_op_instructions_smoke():
    """Under valgrind, minutes: in the slow suite. Each variant's row, and plain's the reference."""
    if shutil.which("valgrind") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        pytest.skip("needs valgrind and its headers")
    out = run_bench("launch/bench/bench_op_instructions.py", "--smoke", timeout=590)
    header = ["op", "bytes", "variant", "instructions", "over plain", "L1 misses (I / D read / D write)",
              "last-level misses", "est. cycles", "over plain", "≈ µs over plain"]
    found = rows(out, header)
    variants = ("plain", "commslayer", "commslayer, recorder")
    assert [r[:3] for r in found] == [["all_reduce", "4096", v] for v in variants], found
    for row in found:
        instructions, cycles = int(row[3].replace(",", "")), int(row[7].replace(",", ""))
        assert 1000 < instructions < cycles, row  # a real op's work, and its misses cost cycles
    assert found[0][4] == "+0" and found[0][8] == "+0", found[0]


@pytest.mark.timeout(60)
def test_pack_smoke():
    out = run_bench("launch/bench/bench_pack.py", "--smoke", timeout=50)
    found = table(out, ["what", "CPU per pack, median (ms)", "min–max over runs (ms)"], "what")
    assert list(found) == ["pack, values changing every step"]
    assert numbers(found["pack, values changing every step"]["CPU per pack, median (ms)"])[0] > 0


@pytest.mark.timeout(120)
def test_status_scrape_smoke():
    out = run_bench("launch/bench/bench_status_scrape.py", "--smoke", timeout=110)
    header = ["path", "median (ms)", "p90 (ms)", "max (ms)", "body (bytes)"]
    found = table(out, header, "path")
    assert list(found) == ["`/metrics`", "`/`"], out
    for row in found.values():
        median, p90, top = (numbers(row[c])[0] for c in header[1:4])
        assert 0 < median <= p90 <= top and numbers(row["body (bytes)"].replace(",", ""))[0] > 0, row
    assert re.search(r"the server's reads of the store meanwhile: \d+, median \d+ ms", out), out


@pytest.mark.timeout(150)
def test_status_steps_smoke():
    """One repeat of the DDP example, traced, 30 steps: the three configurations, each a median
    step time, and "on" answered scrapes."""
    out = run_bench("launch/bench/bench_status_steps.py", "--repeats", "1", "--steps", "30", "--skip", "5",
                    "--examples", "DDP", "--traced", timeout=140)
    for config in ("off", "off (A/A)", "on, scraped 1/s"):
        found = re.search(rf"^DDP traced {re.escape(config)}: median of 1 (\d+\.\d+) ms", out, re.M)
        assert found and float(found.group(1)) > 0, out
    assert re.search(r"^DDP repeat 0 on, scraped 1/s: median step \d+\.\d+ ms \([1-9]\d* scrapes\)", out, re.M), out


@pytest.mark.timeout(60)
def test_headline_runs_every_pages_benchmark_with_options_it_has(tmp_path):
    """``headline.py --list`` names a run for every page under docs/bench/, each of an existing
    script, with only options that script defines; and runs nothing."""
    out = run_bench("launch/bench/headline.py", "--list", "--out", str(tmp_path / "headline"), timeout=50)
    runs = [line.split("\t") for line in out.splitlines()]
    assert all(len(run) == 3 for run in runs), out
    pages = {p.name for p in (ROOT / "docs/bench").glob("*.md")}
    assert {page for _, named, _ in runs for page in named.split(",")} == pages
    for name, _, command in runs:
        argv = command.split(" ")
        script = ROOT / next(a for a in argv if a.startswith("launch/bench/"))
        source = script.read_text() + (ROOT / "launch/bench/measure.py").read_text()
        for option in (a for a in argv[argv.index(str(script.relative_to(ROOT))) + 1:] if a.startswith("--")):
            assert f'"{option}"' in source, f"{name}: {script.name} has no {option}"
    assert not (tmp_path / "headline").exists()
