"""The direct path in native code (commslayer/comm/direct_path.cpp, commslayer/comm/native.py):
the README's commands build it, its results equal the pure-Python path's and plain
c10d's bitwise, its flight-recorder records say what the Python recorder's do, it
leaves what it cannot take to Python, and a build that cannot happen says why."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from commslayer.comm import native
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tagged(torch.Tensor):
    """A tensor subclass: the native path must leave it to Python, which honours its type."""


def test_the_readme_commands_built_it():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine: communicators run the direct path in Python")
    assert os.environ.get("COMMSLAYER_NATIVE") is None
    assert native.why_not() is None, native.why_not()
    assert os.path.exists(native.module_path())


def test_a_build_that_cannot_happen_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        native.build(str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match=r"the compiler failed \(exit 1\)"):
        native.build(str(tmp_path))
    assert os.listdir(tmp_path) == []  # no partial module left behind
    # The command line says so, and the README's commands go on without it.
    env = {**os.environ, "CXX": "false"}
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.prefix = {str(tmp_path)!r}; "
                           "from commslayer import native; sys.exit(native.main())"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1 and "take the pure-Python direct path" in done.stderr, done.stderr
    # Installed without its source, it is not loaded, and says so; communicators still work.
    done = subprocess.run([sys.executable, "-c", "from commslayer import native; native.SOURCE = '/nowhere.cpp'; "
                           "print(native.load(), native.why_not())"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("None its source is missing"), done.stdout + done.stderr


def _native_and_python(rank, size, store):
    """Two communicators of the same ranks: "native" on the native direct path, "python" on the pure-Python one."""
    import commslayer

    fast = commslayer.new_comm("gloo", name="native", store=store, rank=rank, size=size, timeout=60)
    os.environ["COMMSLAYER_NATIVE"] = "0"
    slow = commslayer.new_comm("gloo", name="python", store=store, rank=rank, size=size, timeout=60)
    del os.environ["COMMSLAYER_NATIVE"]
    return fast, slow


def _same_but_times(native_records, python_records):
    """The two paths' records of the same ops say the same, save the times and the communicator."""
    timing = {"op_id", "comm", "comm_id", "enqueue_ns", "start_ns", "end_ns", "duration_ms"}
    for fast, slow in zip(native_records, python_records):
        assert {k: v for k, v in fast.items() if k not in timing} == \
            {k: v for k, v in slow.items() if k not in timing}, (fast, slow)


def _three_paths(rank, size, store):
    import commslayer

    dist.init_process_group("gloo", store=dist.PrefixStore("plain/", store), rank=rank, world_size=size)
    fast, slow = _native_and_python(rank, size, store)
    out = {"native": fast._native is not None, "python": slow._native is None, "differ": [], "compared": 0}

    def same(what, *tensors):
        out["compared"] += 1
        if not all(t.dtype == tensors[0].dtype and torch.equal(t, tensors[0]) for t in tensors[1:]):
            out["differ"].append(what)

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool):
        for n in (0, 1, 4097, 1 << 18):
            g = torch.Generator().manual_seed(97 * rank + n)
            x = torch.randint(0, 2, (n * size,), generator=g).to(dtype) if dtype == torch.bool else \
                (torch.randn(n * size, generator=g) * 100).to(dtype)
            tag = f"{dtype} n={n}"
            reduced = [x.clone() for _ in range(3)]
            fast.all_reduce(reduced[0])
            slow.all_reduce(reduced[1])
            dist.all_reduce(reduced[2])
            same(f"all_reduce {tag}", *reduced)
            part = x[:n].clone()
            gathered = [torch.empty(n * size, dtype=dtype) for _ in range(3)]
            fast.all_gather_single(gathered[0], part)
            slow.all_gather_single(gathered[1], part)
            dist.all_gather_into_tensor(gathered[2], part)
            same(f"all_gather_single {tag}", *gathered)
            if dtype != torch.bool:  # Gloo has no reduce-scatter of bool
                scattered = [torch.empty(n, dtype=dtype) for _ in range(3)]
                fast.reduce_scatter_single(scattered[0], x)
                slow.reduce_scatter_single(scattered[1], x)
                dist.reduce_scatter_tensor(scattered[2], x)
                same(f"reduce_scatter_single {tag}", *scattered)

    # What the native checks refuse goes the general way: a tensor subclass keeps its
    # type's behaviour, a Parameter is a plain tensor, a view that is not contiguous is
    # refused with the op's name.
    tagged = torch.ones(4).as_subclass(Tagged)
    out["subclass"] = (fast._dense(tagged), fast._dense(torch.nn.Parameter(torch.ones(4))))
    fast.all_reduce(tagged)
    out["subclass result"] = (type(tagged).__name__, tagged.tolist())
    try:
        fast.all_reduce(torch.ones(4, 2).t())
    except commslayer.CommError as exc:
        out["strided"] = (type(exc).__name__, exc.op, "contiguous" in str(exc))

    # A peer that comes late: the watched communicator's native wait runs out of its 50 ms
    # slices several times (each time Python looks at the liveness monitor) and then completes.
    if rank == 1:
        time.sleep(0.4)
    began = time.monotonic()
    late = torch.empty(2 * size)
    fast.all_gather_single(late, torch.full((2,), float(rank)))
    out["late"] = (fast.lifecycle.watched, late.tolist(), time.monotonic() - began)
    # The same for a reduce-scatter, whose Gloo wait ignores its timeout: the native path
    # runs it as Gloo does, an all-reduce of a copy, with a wait that keeps its slices.
    if rank == 1:
        time.sleep(0.4)
    began = time.monotonic()
    scattered = torch.empty(2)
    fast.reduce_scatter_single(scattered, torch.arange(2.0 * size) + rank)
    out["late reduce-scatter"] = (scattered.tolist(), time.monotonic() - began)

    # A sync op's Work from the native path: completed, numbered, with a future that is done.
    work = fast.all_reduce(torch.ones(2))
    out["work"] = (work.status.value, work.is_completed(), work.seq > 0, work.end_ns >= work.start_ns,
                   work.get_future().done(), work.wait())

    # set_timeout reaches the native path: an op nobody else joins ends at the new deadline.
    fast.set_timeout(timedelta(seconds=1.0))
    if rank == 0:
        began = time.monotonic()
        try:
            fast.all_gather_single(torch.zeros(2 * size), torch.ones(2))
        except commslayer.CommError as exc:
            out["deadline"] = (type(exc).__name__, exc.op, time.monotonic() - began, fast.state.split(":")[0])
        store.set("native-timed-out", "1")
    else:
        store.wait(["native-timed-out"], timedelta(seconds=30))
    fast.abort()
    slow.finalize()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_native_and_python_paths_match_plain_c10d():
    if native.why_not() is not None:
        pytest.skip(f"the native direct path is not built: {native.why_not()}")
    results = run_ranks(_three_paths, 2, timeout=100)
    for rank, out in enumerate(results):
        assert out["native"] and out["python"], out
        assert out["differ"] == [] and out["compared"] == 5 * 4 * 3 - 4, (rank, out["differ"], out["compared"])
        assert out["subclass"] == (False, True), out["subclass"]
        assert out["subclass result"] == ("Tagged", [2.0] * 4), out["subclass result"]
        assert out["strided"] == ("InvalidArgument", "all_reduce", True), out["strided"]
        assert out["work"] == ("completed", True, True, True, True, True), out["work"]
        watched, gathered, _ = out["late"]
        assert watched and gathered == [float(r) for r in range(2) for _ in range(2)], out["late"]
    assert results[0]["late"][2] > 0.3, results[0]["late"]  # rank 0 waited through several slices
    assert results[0]["late reduce-scatter"][1] > 0.3, results[0]["late reduce-scatter"]
    for rank, out in enumerate(results):
        expected = [sum(2 * rank + i + r for r in range(2)) for i in range(2)]
        assert out["late reduce-scatter"][0] == expected, (rank, out["late reduce-scatter"])
    kind, op, took, state = results[0]["deadline"]
    assert (kind, op, state) == ("CollectiveTimeout", "all_gather_single", "broken"), results[0]["deadline"]
    assert 0.9 < took < 3.0, took


def _issue(comm, op, size, dtype):
    """One op of each kind, issued from one line, so both paths' records name one call site."""
    x = torch.arange(6 * size, dtype=dtype).reshape(2 * size, 3)
    out = torch.empty(2 * size, 3, dtype=dtype) if op == "all_gather_single" else torch.empty(2, 3, dtype=dtype)
    args = {"all_reduce": (x,), "all_gather_single": (out, x[:2].clone()), "reduce_scatter_single": (out, x)}[op]
    return getattr(comm, op)(*args)


def _recorded_both_ways(rank, size, store, trace_dir):
    import threading

    import commslayer
    from tracing.record import recorder

    fast, slow = _native_and_python(rank, size, store)
    # A short ring keeps the newest records of both kinds, by op id.
    small = recorder.FlightRecorder(5, "", job="small")
    for comm in (fast, slow):
        small.attach(comm)
    issued = [comm.all_reduce(torch.ones(4)).op_id for _ in range(6) for comm in (fast, slow)]
    doc = small.document("test")
    out = {"short ring": ([r["op_id"] for r in doc["records"]], doc["dropped_records"], issued)}
    small.close()

    rec = recorder.FlightRecorder(64, trace_dir, job="native")
    for comm in (fast, slow):
        rec.attach(comm)
    out["native ring"] = rec.native_ring is not None
    rec._step_begins(None, 7)
    for op, dtype in (("all_reduce", torch.float32), ("all_gather_single", torch.int64),
                      ("reduce_scatter_single", torch.bfloat16)):
        for comm in (fast, slow):
            _issue(comm, op, size, dtype)
    worker = threading.Thread(target=lambda: [_issue(c, "all_reduce", size, torch.float32) for c in (fast, slow)],
                              name="grad-sync")
    worker.start()
    worker.join()
    out["python records"] = rec._count
    out["taken before"] = rec._native.taken
    out["records"] = rec.records()

    # A native op that fails hands its record to Python, which records how it ended.
    fast.set_timeout(timedelta(seconds=1.0))
    if rank == 0:
        try:
            _issue(fast, "all_reduce", size, torch.float32)
        except commslayer.CommError as exc:
            out["error"] = type(exc).__name__
        store.set("recorded-timed-out", "1")
    else:
        store.wait(["recorded-timed-out"], timedelta(seconds=30))
    out["after failure"] = rec.records()[-1]
    out["taken"] = rec._native.taken

    # An op in flight when its communicator is aborted is recorded as aborted.
    third = commslayer.new_comm("gloo", name="aborted", store=store, rank=rank, size=size, timeout=60)
    rec.attach(third)
    if rank == 0:
        def stuck_op():
            try:
                _issue(third, "all_reduce", size, torch.float32)
            except commslayer.CommError as exc:
                out["stuck op"] = type(exc).__name__

        stuck = threading.Thread(target=stuck_op)
        stuck.start()
        time.sleep(0.5)
        third.abort()
        stuck.join(30)
        out["aborted"] = [r for r in rec.records() if r["comm"] == "aborted"]
        store.set("recorded-aborted", "1")
    else:
        store.wait(["recorded-aborted"], timedelta(seconds=30))
        third.abort()
    out["dump"] = rec.dump("test")
    fast.abort()
    slow.finalize()
    return out


@pytest.mark.timeout(120)
def test_a_reader_past_the_native_rings_end_reads_nothing():
    """A cursor whose position is past the records ever begun (one made for another
    ring) reads an empty list from there, not an error."""
    if native.why_not() is not None:
        pytest.skip(f"the native direct path is not built: {native.why_not()}")
    ring = native.ring(8, {}, (), threading.__file__)
    assert ring.records_from(5) == (5, []) and ring.records() == [] and ring.count == 0


def test_native_records_equal_python_records(tmp_path):
    """The native direct path writes its records itself (direct_path.cpp's NativeRing): they
    say what the Python recorder says of the same ops, field by field, save the times."""
    if native.why_not() is not None:
        pytest.skip(f"the native direct path is not built: {native.why_not()}")
    results = run_ranks(_recorded_both_ways, 2, str(tmp_path), timeout=100)
    for rank, out in enumerate(results):
        kept, dropped, issued = out["short ring"]
        assert kept == issued[-5:] and dropped == 7, out["short ring"]
        assert out["native ring"], out
        records = out["records"]
        assert [r["op_id"] for r in records] == sorted(r["op_id"] for r in records)  # one order, both rings
        # The Python ring holds the Python communicator's ops, and those of the native one
        # that outlasted a 50 ms slice of their wait: Python took their records over.
        assert out["python records"] == 4 + out["taken before"], out
        by_comm = {name: [r for r in records if r["comm"] == name] for name in ("native", "python")}
        assert len(by_comm["native"]) == len(by_comm["python"]) == 4, records
        _same_but_times(by_comm["native"], by_comm["python"])
        for fast in by_comm["native"]:
            assert fast["enqueue_ns"] <= fast["start_ns"] < fast["end_ns"], fast
            assert fast["duration_ms"] == (fast["end_ns"] - fast["start_ns"]) / 1e6
        first = by_comm["native"][0]
        assert first["call_site"].endswith(f"test_native.py:{_issue.__code__.co_firstlineno + 5}"), first
        assert (first["state"], first["step"], first["thread"], first["seq"]) == ("completed", 7, "MainThread", 7)
        assert first["in_sizes"] == [[2 * 2, 3]] and first["in_bytes"] == 2 * 2 * 3 * 4, first
        assert by_comm["native"][-1]["thread"] == "grad-sync", by_comm["native"][-1]
    failed = results[0]["after failure"]
    assert results[0]["error"] == "CollectiveTimeout" and results[0]["taken"] == results[0]["taken before"] + 1, \
        results[0]
    assert (failed["comm"], failed["state"], failed["seq"]) == ("native", "timed_out", 11), failed
    assert "timed out" in failed["error"] or "Timed out" in failed["error"], failed
    aborted = results[0]["aborted"]
    # The recorder's abort hook or the op's own wait marks it, whichever comes first.
    assert [r["state"] for r in aborted] == ["aborted"] and "aborted" in aborted[0]["error"], aborted
    assert aborted[0]["end_ns"] > aborted[0]["start_ns"]
    assert os.path.exists(results[0]["dump"])


def _votes(rank, size, store):
    from tracing.record import recorder

    fast, slow = _native_and_python(rank, size, store)
    rec = recorder.FlightRecorder(64, "", job="votes")
    for comm in (fast, slow):
        rec.attach(comm)
    out = {"watched": fast.lifecycle.watched,
           "votes": [[comm.should_commit(True) for comm in (fast, slow)] for _ in range(3)]}
    out["python records"] = rec._count
    out["records"] = [r for r in rec.records() if r["op"] == "should_commit"]
    # A hook observes the vote: it takes the general path, and the hook sees it.
    seen = []
    hook = fast.register_pre_hook(lambda op, op_id, args: seen.append(op))
    out["hooked"] = (fast.should_commit(True), list(seen))
    # One member votes no: no on both, on the general path and, the hook gone, on the
    # direct path's kept buffer; the yes after it is a yes.
    out["no"] = [comm.should_commit(rank == 0) for comm in (fast, slow)]
    hook.remove()
    before = rec._count
    out["no, direct"] = [fast.should_commit(rank == 0), fast.should_commit(True)]
    out["python records of those"] = rec._count - before
    fast.abort()
    slow.abort()
    return out


@pytest.mark.timeout(120)
def test_the_vote_takes_the_direct_path():
    """should_commit's tally (a MIN all-reduce, once a step in replica mode) runs on the
    direct path, natively recorded, unless a hook observes it: the same answers and
    the same records as the pure-Python path's."""
    if native.why_not() is not None:
        pytest.skip(f"the native direct path is not built: {native.why_not()}")
    results = run_ranks(_votes, 2, timeout=100)
    for out in results:
        assert out["watched"] and out["votes"] == [[True, True]] * 3, out
        records = out["records"]
        # The native ring holds the native communicator's votes: Python recorded only the other's.
        assert out["python records"] == 3, out
        by_comm = {name: [r for r in records if r["comm"] == name] for name in ("native", "python")}
        assert len(by_comm["native"]) == len(by_comm["python"]) == 3, records
        _same_but_times(by_comm["native"], by_comm["python"])
        first = by_comm["native"][0]
        assert (first["reduce_op"], first["dtype"], first["in_sizes"], first["state"]) == \
            ("MIN", "int64", [[1]], "completed"), first  # one int64: the vote and the joiners counted
        assert first["call_site"].endswith(f"test_native.py:{_votes.__code__.co_firstlineno + 8}"), first
        assert out["hooked"] == (True, ["should_commit"]), out["hooked"]
        assert out["no"] == [False, False], out["no"]
        assert out["no, direct"] == [False, True] and out["python records of those"] == 0, out


def _load_in_child(directory):
    """(exit status, why_not) of a fresh process that loads the module from ``directory``."""
    done = subprocess.run([sys.executable, "-c", "from commslayer.comm import native; "
                           f"native.load({str(directory)!r}); print(native.why_not())"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    return done.returncode, (done.stdout + done.stderr).strip()


@pytest.mark.timeout(120)
def test_a_module_another_user_could_have_planted_or_cut_short_is_not_loaded(tmp_path):
    """Issue 41: the module was loaded from any directory, whoever could write it, and a
    truncated one killed the process with SIGBUS. Each is refused with its reason in
    ``why_not``, and communicators take the Python path; an intact copy still loads."""
    if native.why_not() is not None:
        pytest.skip(f"the module is not built here: {native.why_not()}")
    built = native.module_path()
    good = tmp_path / "good"
    good.mkdir(mode=0o755)
    shutil.copy2(built, good / os.path.basename(built))
    assert _load_in_child(good) == (0, "None")
    cases = {}
    for case in ("open directory", "open file", "cut short", "another owner"):
        d = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, d)
        cases[case] = d / os.path.basename(built)
    os.chmod(cases["open directory"].parent, 0o777)
    os.chmod(cases["open file"], 0o666)
    with open(cases["cut short"], "r+b") as f:
        f.truncate(os.path.getsize(built) // 2)
    if os.geteuid() == 0:
        os.chown(cases["another owner"], 65534, -1)
    else:
        del cases["another owner"]  # only root can give a file away
    says = {"open directory": "-directory is writable by its group and others (mode 0777): another user could",
            "open file": "is writable by its group and others (mode 0666)",
            "cut short": f"truncated ({os.path.getsize(built) // 2} bytes",
            "another owner": "is owned by uid 65534, not this process's uid 0"}
    for case, path in cases.items():
        rc, why = _load_in_child(path.parent)
        assert rc == 0 and why.startswith(f"{path} is not loaded: ") and says[case] in why, (case, rc, why)


@pytest.mark.timeout(120)
def test_a_killed_build_leaves_no_partial_module_behind(tmp_path):
    """A build SIGKILLed mid-way left its ``*.so.partial`` for good (issue 41): the next build
    removes a partial whose process is gone, and keeps one whose build still runs."""
    compiler = tmp_path / "slow-c++"
    compiler.write_text("#!/bin/sh\nsleep 60\n")
    compiler.chmod(0o755)
    out = tmp_path / "build"
    env = {**os.environ, "CXX": str(compiler)}
    build = subprocess.Popen([sys.executable, "-c", f"from commslayer.comm import native; native.build({str(out)!r})"],
                             env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out.is_dir() and any(n.endswith(".so.partial") for n in os.listdir(out))):
        assert time.monotonic() < deadline and build.poll() is None, "the build never started"
        time.sleep(0.05)
    os.killpg(build.pid, signal.SIGKILL)  # the build and its compiler, as a killed job's are: no orphan left
    build.wait()
    left = [n for n in os.listdir(out) if n.endswith(".so.partial")]
    assert len(left) == 1 and f".{build.pid}." in left[0], left  # what a killed build leaves
    running = out / f"{native.module_name()}.{os.getpid()}.x.so.partial"  # a build still running: this process
    running.touch()
    with pytest.raises(RuntimeError, match=r"the compiler failed"):
        os.environ["CXX"] = "false"
        try:
            native.build(str(out))
        finally:
            os.environ.pop("CXX")
    assert sorted(os.listdir(out)) == [running.name]
