"""The viewer against hostile input (issue 16): a corrupt line read by a
parallel reader, valid JSON with wrong field types, trace strings that look
like the HTML template's placeholders or hold terminal escapes, an empty or
wrong directory, a FIFO or a device where a trace file should be, a line that
never ends, and output paths that cannot be written.  Each must give the
answer or a one-line error with exit status 2, never a traceback or a hang.
Traces are written by hand (tests/viewer_traces.py); the CLI runs in-process."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest

from tests.viewer_traces import dump_doc, job, jsonl_lines, record, run_cli, write
from tracing.read import analysis
from tracing.read.traceio import MAX_LINE_BYTES, TraceFileError

COMMANDS = ("summary", "diagnose", "overlap", "export", "view")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(command, d, tmp_path):
    if command == "export":
        return ["export", str(d), "--perfetto", str(tmp_path / "out.json")]
    if command == "view":
        return ["view", str(d), "-o", str(tmp_path / "out.html")]
    return [command, str(d)]


def _one_error_line(err):
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ item 4: parallel readers

@pytest.mark.timeout(60)
def test_a_parallel_reader_reports_a_corrupt_line_like_a_sequential_one(tmp_path, monkeypatch):
    job(str(tmp_path), ranks=2, ops=8)
    path = tmp_path / "rank1.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[7] = b'{"event": "collective", "op_id": \n'
    path.write_bytes(b"".join(lines))
    want = f"{path}:8: truncated or corrupt JSON line"
    rc, _, err = run_cli("summary", str(tmp_path), "--jobs", "1")
    assert rc == 2 and want in _one_error_line(err)
    monkeypatch.setattr(analysis, "PARALLEL_BYTES", 0)  # two forked readers, one rank each
    monkeypatch.setattr(analysis, "_scan_chunk", _scan_in_child)
    rc, _, err2 = run_cli("summary", str(tmp_path), "--jobs", "2")
    assert rc == 2 and err2 == err, err2
    exc = TraceFileError(str(path), 8, "truncated or corrupt JSON line")
    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)


_PARENT, _SCAN_CHUNK = os.getpid(), analysis._scan_chunk


def _scan_in_child(sources, skip_bad, detail_budget):
    """analysis._scan_chunk, checking that it runs in a forked reader (pickled by name)."""
    assert os.getpid() != _PARENT, "the parallel path read in the parent process"
    return _SCAN_CHUNK(sources, skip_bad, detail_budget)


# ------------------------------------------------------------------ item 5: wrong field types

def _record_case(**fields):
    """Rank 1's third record with ``fields``: (what to write into a dump, into JSON lines)."""
    def mutate(recs):
        recs[2] = {**recs[2], **fields}
        for k, v in fields.items():
            if v is _DROP:
                del recs[2][k]
    return mutate


_DROP = object()
RECORD_CASES = {
    "seq as a string": (_record_case(seq="1"), "'seq' must be an integer, not a string '1'"),
    "enqueue_ns as a string": (_record_case(enqueue_ns="abc"), "'enqueue_ns' must be an integer"),
    "op_id as a list": (_record_case(op_id=[1]), "'op_id' must be an integer, not a list [1]"),
    "an integer of 10^30": (_record_case(end_ns=10 ** 30), "'end_ns'"),
    "a time past int64": (_record_case(start_ns=2 ** 63), "'start_ns' is 9223372036854775808, outside"),
    "a negative time": (_record_case(end_ns=-5), "'end_ns' is -5, outside"),
    "seq true": (_record_case(seq=True), "'seq' must be an integer, not true or false True"),
    "an unknown state": (_record_case(state="exploded"), "'state' is 'exploded', not one of"),
    "duration as a string": (_record_case(duration_ms="fast"), "'duration_ms' must be a number or null"),
    "root as an object": (_record_case(root={"a": 1}), "'root' must be an integer or null, not an object"),
    "call site as a list": (_record_case(call_site=["x"]), "'call_site' must be a string or null"),
    "error as a list": (_record_case(error=["boom"], state="failed"), "'error' must be a string or null"),
    "no comm_id": (_record_case(comm_id=_DROP), "record without 'comm_id'"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dump", "jsonl"])
@pytest.mark.parametrize("case", sorted(RECORD_CASES))
def test_a_record_of_the_wrong_type_is_named_and_skippable(case, layout, tmp_path):
    mutate, message = RECORD_CASES[case]
    d = tmp_path / "t"
    d.mkdir()
    job(str(d), ranks=2, ops=5, jsonl=layout == "jsonl")
    if layout == "jsonl":
        os.remove(d / "rank1.json")
        events = jsonl_lines(1, [record(i, rank=1) for i in range(1, 6)])
        recs = events[2:]
        mutate(recs)
        write(str(d / "rank1.jsonl"), events[:2] + recs)
        where = f"{d / 'rank1.jsonl'}:5: "
    else:
        recs = [record(i, rank=1) for i in range(1, 6)]
        mutate(recs)
        write(str(d / "rank1.json"), dump_doc(1, recs))
        where = f"{d / 'rank1.json'}:1: record #2: "
    for command in COMMANDS:
        rc, _, err = run_cli(*_args(command, d, tmp_path))
        assert rc == 2 and where + message in _one_error_line(err), (command, err)
    rc, out, err = run_cli("summary", "--json", "--skip-bad", str(d))
    assert rc == 0 and "Traceback" not in err
    assert "skipped " + where in err
    assert sum(g["count"] for g in json.loads(out)["groups"]) == 5 + 4  # only the bad record is left out


FILE_CASES = {
    "dump clock with a string": ("dump", lambda doc: doc["clock"].update(wall_ns="a"),
                                 "rank1.json:1: 'clock.wall_ns' must be an integer, not a string 'a'"),
    "dump without a clock": ("dump", lambda doc: doc.pop("clock"), "rank1.json:1: dump without its clock anchor"),
    "dropped_records as words": ("dump", lambda doc: doc.update(dropped_records="lots"),
                                 "rank1.json:1: 'dropped_records' must be an integer or null, not a string 'lots'"),
    "communicators as a list": ("dump", lambda doc: doc.update(communicators=[1]),
                                "rank1.json:1: 'communicators' must be an object, not [1]"),
    "a communicator of 10^12 ranks": ("dump", lambda doc: doc["communicators"]["a.0"].update(size=10 ** 12),
                                      "rank1.json:1: communicator 'a.0': 'size' is 1000000000000, outside"),
    "global ranks of strings": ("dump", lambda doc: doc["communicators"]["a.0"].update(global_ranks=["0", "1"]),
                                "'global_ranks[]' must be an integer, not a string '0'"),
    "host as a number": ("dump", lambda doc: doc.update(host=5), "rank1.json:1: 'host' must be a string or null"),
    "records as an object": ("dump", lambda doc: doc.update(records={}), "dump without a rank or a records list"),
    "main stack as a list": ("dump", lambda doc: doc.update(main_stack=["x"]),
                             "rank1.json:1: 'main_stack' must be an object or null, not a list ['x']"),
    "main stack frames of numbers": ("dump", lambda doc: doc.update(main_stack={"reason": "SIGTERM", "at": None,
                                                                                "frames": [1]}),
                                     "'main_stack.frames[]' must be a string, not an integer 1"),
    "main stack of 10^5 frames": ("dump", lambda doc: doc.update(main_stack={"reason": "SIGTERM", "at": "a:1",
                                                                             "frames": ["a:1 in f"] * 10 ** 5}),
                                  "'main_stack.frames' holds 100000 frames, more than 64"),
    "rank 10^30": ("dump", lambda doc: doc.update(rank=10 ** 30), "rank1.json:1: dump without a rank"),
    "header clock missing a key": ("jsonl", lambda ev: ev[0]["clock"].pop("mono_ns"),
                                   "rank1.jsonl:1: 'clock.mono_ns' must be an integer, not null None"),
    "header rank negative": ("jsonl", lambda ev: ev[0].update(rank=-3), "rank1.jsonl:1: 'rank' is -3, outside"),
    "header pid as a string": ("jsonl", lambda ev: ev[0].update(pid="x"), "rank1.jsonl:1: 'pid' must be"),
    "communicator_created without comm_id": (
        "jsonl", lambda ev: ev[1].pop("comm_id"),
        "rank1.jsonl:2: communicator_created: 'comm_id' must be a string, not null None"),
    "communicator_created with a size of words": (
        "jsonl", lambda ev: ev[1].update(size="two"), "rank1.jsonl:2: communicator_created: 'size' must be"),
    "sink_dropped as words": ("jsonl", lambda ev: ev.append({"event": "sink_dropped", "dropped": "many"}),
                              "rank1.jsonl:8: 'dropped' must be an integer or null, not a string 'many'"),
    "an event that is a list": ("jsonl", lambda ev: ev.append([1, 2]), "rank1.jsonl:8: not a trace event"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_a_file_with_a_field_of_the_wrong_type_is_named(case, tmp_path):
    layout, mutate, message = FILE_CASES[case]
    d = tmp_path / "t"
    d.mkdir()
    job(str(d), ranks=2, ops=5, jsonl=False)
    if layout == "jsonl":
        os.remove(d / "rank1.json")
        events = jsonl_lines(1, [record(i, rank=1) for i in range(1, 6)])
        mutate(events)
        write(str(d / "rank1.jsonl"), events)
    else:
        doc = dump_doc(1, [record(i, rank=1) for i in range(1, 6)])
        mutate(doc)
        write(str(d / "rank1.json"), doc)
    for command in COMMANDS:
        rc, _, err = run_cli(*_args(command, d, tmp_path))
        assert rc == 2 and message in _one_error_line(err), (command, err)
    rc, out, err = run_cli("diagnose", "--json", "--skip-bad", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "warning: skipped" in err, err


# ------------------------------------------------------------------ item 6: the HTML template

@pytest.mark.timeout(60)
def test_placeholders_in_trace_strings_are_not_substituted(tmp_path):
    plain, evil = tmp_path / "plain", tmp_path / "evil"
    name = "<b>%DATA%%SCRIPT%%TITLE%</b>" * 10
    for d, comm, site in ((plain, "a", "train.py:42"), (evil, name, name)):
        d.mkdir()
        for rank in range(2):
            recs = [record(i, rank=rank, comm=comm, call_site=site) for i in range(1, 21)]
            doc = dump_doc(rank, recs)
            doc["communicators"]["a.0"]["name"] = comm
            write(str(d / f"rank{rank}.json"), doc)
    sizes = {}
    for d in (plain, evil):
        rc, _, err = run_cli("view", str(d), "-o", str(d / "page.html"), "--title", d.name)
        assert rc == 0, err
        sizes[d.name] = (d / "page.html").stat().st_size
    page = (evil / "page.html").read_text()
    grown = sum(2 * len(json.dumps(r)) for r in json.loads((evil / "rank0.json").read_text())["records"])
    assert sizes["evil"] < sizes["plain"] + 2 * grown, sizes  # linear in the input (it was 60 MB)
    assert page.count('<script type="application/json" id="data">') == 1 and page.count('"use strict"') == 1
    assert "&lt;b&gt;%DATA%%SCRIPT%%TITLE%&lt;/b&gt;" in page  # the name itself, escaped, intact
    assert "\\u003cb\\u003e%DATA%%SCRIPT%%TITLE%\\u003c/b\\u003e" in page  # and in the timeline's data


# ------------------------------------------------------------------ item 7: directories, files, the terminal

@pytest.mark.timeout(60)
def test_no_trace_files_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    (tmp_path / "other" / "fr").mkdir()
    for d, what in ((tmp_path / "empty", "no trace files here"), (tmp_path / "other", "no trace files here"),
                    (tmp_path / "missing", "no such file or directory")):
        for command in COMMANDS:
            rc, out, err = run_cli(*_args(command, d, tmp_path))
            assert rc == 2 and f"{d}: {what}" in _one_error_line(err) and "No problem found" not in out
    job(str(tmp_path / "empty"), ranks=1)
    write(str(tmp_path / "empty" / "rank0.json"), [b"not json\n"])
    write(str(tmp_path / "empty" / "rank0.jsonl"), [b"{}\n"])
    rc, out, err = run_cli("diagnose", "--skip-bad", str(tmp_path / "empty"))
    assert rc == 2 and "no usable trace file" in _one_error_line(err), err  # every file skipped: nothing to say


@pytest.mark.timeout(60)
def test_a_run_directory_is_read_through_its_traces(tmp_path):
    """``commslayer-trace summary runs/x``, the run directory instead of ``runs/x/traces``: it
    was 'no trace files here'; now its traces are read, as if named."""
    run_dir = tmp_path / "run"
    (run_dir / "traces").mkdir(parents=True)
    job(str(run_dir / "traces"), ranks=2)
    (run_dir / "summary.json").write_text("{}")
    for command in ("summary", "diagnose"):
        assert run_cli(command, str(run_dir)) == run_cli(command, str(run_dir / "traces"))
    rc, out, err = run_cli("summary", str(run_dir))
    assert rc == 0 and "rank" in out and err == "", err


@pytest.mark.timeout(30)
def test_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    job(str(tmp_path), ranks=2, jsonl=False)
    os.remove(tmp_path / "rank0.json")
    os.mkfifo(tmp_path / "rank0.json")
    os.symlink("/dev/zero", tmp_path / "rank0.jsonl")
    t0 = time.monotonic()
    rc, _, err = run_cli("diagnose", str(tmp_path))
    assert rc == 2 and f"{tmp_path / 'rank0.json'}: not a regular file (a FIFO)" in _one_error_line(err)
    rc, _, err = run_cli("diagnose", str(tmp_path / "rank0.jsonl"), str(tmp_path / "rank1.json"))
    assert rc == 2 and "rank0.jsonl: not a regular file (a character device)" in _one_error_line(err)
    rc, out, err = run_cli("diagnose", "--skip-bad", str(tmp_path))
    assert rc == 1 and "rank 0 left no trace file" in out and err.count("not a regular file") == 2, out + err
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_a_line_longer_than_the_bound_is_refused_and_skipped(tmp_path):
    job(str(tmp_path), ranks=2, ops=5, jsonl=True)
    os.remove(tmp_path / "rank1.json")
    events = jsonl_lines(1, [record(i, rank=1) for i in range(1, 6)])
    lines = [json.dumps(e).encode() + b"\n" for e in events]
    lines[3] = b'{"event": "note", "pad": "' + b"x" * (2 * MAX_LINE_BYTES) + b'"}\n'
    lines[5] = b"garbage\n"
    write(str(tmp_path / "rank1.jsonl"), lines)
    path = tmp_path / "rank1.jsonl"
    rc, _, err = run_cli("summary", str(tmp_path))
    assert rc == 2 and f"{path}:4: line longer than {MAX_LINE_BYTES} bytes" in _one_error_line(err)
    rc, out, err = run_cli("summary", "--json", "--skip-bad", str(tmp_path))
    assert rc == 0 and f"skipped {path}:4: line longer" in err and f"skipped {path}:6: truncated" in err
    assert sum(g["count"] for g in json.loads(out)["groups"]) == 5 + 3


@pytest.mark.timeout(60)
def test_a_last_line_cut_short_is_left_out_with_a_warning(tmp_path):
    """A rank killed while its sink wrote a batch, or a job read while it writes one: the
    file ends part-way through a line.  Every command reads the rest, without --skip-bad,
    and says which line it left out; the same bytes followed by more lines are an error."""
    job(str(tmp_path), ranks=2, ops=5, jsonl=True)
    os.remove(tmp_path / "rank1.json")
    path = tmp_path / "rank1.jsonl"
    lines = [json.dumps(e).encode() + b"\n" for e in jsonl_lines(1, [record(i, rank=1) for i in range(1, 6)])]
    write(str(path), lines[:-1] + [lines[-1][: len(lines[-1]) // 2]])
    rc, out, err = run_cli("summary", "--json", str(tmp_path))
    assert rc == 0 and f"{path}:{len(lines)}: the last line is cut short" in err, err
    assert sum(g["count"] for g in json.loads(out)["groups"]) == 5 + 4
    write(str(path), lines[:-1] + [lines[-1][: len(lines[-1]) // 2] + b"\n", lines[-1]])
    rc, _, err = run_cli("summary", str(tmp_path))
    assert rc == 2 and f"{path}:{len(lines)}: truncated or corrupt JSON line" in _one_error_line(err), err


DEEP = "[" * 1000 + "]" * 1000  # within the JSON parser's depth limit (1024); a full repr raised RecursionError


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["dump", "jsonl"])
def test_a_field_nested_deep_is_a_bad_record(layout, tmp_path):
    """A field nested ~1000 deep gave RecursionError in every command, with --skip-bad too
    (issue 41): it is a record of the wrong type, named, and skipped by --skip-bad."""
    job(str(tmp_path), ranks=2, ops=5, jsonl=layout == "jsonl")
    recs = [record(i, rank=1) for i in range(1, 6)]
    recs[2]["root"] = "@deep@"
    if layout == "jsonl":
        os.remove(tmp_path / "rank1.json")
        lines = [json.dumps(e) for e in jsonl_lines(1, recs)]
        where = f"{tmp_path / 'rank1.jsonl'}:5: "
        (tmp_path / "rank1.jsonl").write_text("\n".join(lines).replace('"@deep@"', DEEP) + "\n")
    else:
        where = f"{tmp_path / 'rank1.json'}:1: record #2: "
        (tmp_path / "rank1.json").write_text(json.dumps(dump_doc(1, recs)).replace('"@deep@"', DEEP))
    for command in COMMANDS:
        rc, _, err = run_cli(*_args(command, tmp_path, tmp_path))
        assert rc == 2 and where + "'root' must be an integer or null, not a list [[[[" in _one_error_line(err), err
    rc, out, err = run_cli("summary", "--json", "--skip-bad", str(tmp_path))
    assert rc == 0 and "skipped " + where in err, err
    assert sum(g["count"] for g in json.loads(out)["groups"]) == 5 + 4


@pytest.mark.timeout(120)
def test_a_gigabyte_of_zeros_is_refused_without_reading_it(tmp_path):
    """A 1 GiB dump of NULs was read whole (2.1 GB of memory) before it was refused (issue 41):
    the first chunk refuses it. A sparse file; the reader is a real process, its peak memory
    read from the kernel (wait4) by a small parent of its own: a child's peak counts what it
    shared with its parent when it was forked, and pytest's own grows to hundreds of MiB."""
    traces = tmp_path / "t"
    traces.mkdir()
    with open(traces / "rank0.json", "wb") as f:
        f.truncate(1 << 30)
    for args in (["summary"], ["diagnose", "--skip-bad"], ["watch", "--once"]):
        with open(tmp_path / "err", "wb") as err:
            proc = subprocess.run([sys.executable, "-c", _PEAK_OF_CHILD, "-m", "tracing.read.cli", *args, str(traces)],
                                  stdout=subprocess.PIPE, stderr=err, cwd=ROOT, text=True, timeout=100)
        said = (tmp_path / "err").read_text()
        assert "not a commslayer trace dump (a NUL byte at offset 0)" in said and "Traceback" not in said, said
        assert proc.returncode == (0 if args[0] == "watch" else 2), (args, said)
        peak_kib = int(proc.stdout)
        assert peak_kib < 256 * 1024, f"{args}: {peak_kib} KiB at the peak"  # KiB on Linux


# Runs ``python <its arguments>`` in a child whose output goes nowhere; prints the child's peak
# resident memory (KiB, from wait4) and exits with the child's status.
_PEAK_OF_CHILD = """
import os, sys
pid = os.fork()
if pid == 0:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.timeout(60)
def test_watch_names_bad_lines_and_files_like_the_other_commands(tmp_path):
    """``watch --once`` crashed with "internal error" on some malformed inputs (a clock or a
    failure event of the wrong type) and passed over bad lines unsaid (issue 41): every line
    is checked as the other commands check it; what is skipped is named on stderr."""
    job(str(tmp_path), ranks=2, ops=5, jsonl=True)
    os.remove(tmp_path / "rank1.json")
    events = jsonl_lines(1, [record(i, rank=1) for i in range(1, 6)])
    events[0]["clock"] = 7.5
    events[3]["seq"] = "1"
    events.append({"event": "peer_lost", "rank": 1, "comm": ["x"], "error": 5})
    write(str(tmp_path / "rank1.jsonl"), events)
    (tmp_path / "rank0.json").write_bytes(b"garbage")
    path = tmp_path / "rank1.jsonl"
    rc, out, err = run_cli("watch", "--once", str(tmp_path))
    assert rc == 0 and "Traceback" not in err and "internal error" not in err, err
    assert err.splitlines() == [
        f"commslayer-trace: warning: skipped {path}:1: 'clock' must be an object with wall_ns and mono_ns, not 7.5",
        f"commslayer-trace: warning: skipped {path}:4: 'seq' must be an integer, not a string '1'",
        f"commslayer-trace: warning: skipped {path}:8: peer_lost: 'comm' must be a string or null, not a list ['x']",
        f"commslayer-trace: warning: skipped {tmp_path / 'rank0.json'}:1: not a commslayer trace dump (it starts "
        "with 'g', not '{')"], err
    assert "skipped bad input: 4 lines or files" in out, out


@pytest.mark.timeout(60)
def test_watch_refuses_bad_intervals_and_counts_and_says_which_directory_is_missing(tmp_path):
    """Before: ``--interval -1`` or ``nan`` drew once, then died with "internal error: ValueError";
    ``--last 0`` silently took every collective seen; a directory not there yet read "not a
    directory"."""
    job(str(tmp_path), ranks=2, ops=3, jsonl=True)
    for bad in (["--interval", "-1"], ["--interval", "nan"], ["--interval", "x"], ["--last", "0"]):
        rc, out, err = run_cli("watch", *bad, str(tmp_path))
        assert rc == 2 and out == "" and f"argument {bad[0]}: {bad[1]}: " in err and "internal" not in err, err
    rc, _, err = run_cli("watch", "--once", str(tmp_path / "later"))
    assert rc == 2 and "later: no such directory" in err, err
    (tmp_path / "afile").write_text("")
    assert "afile: not a directory" in run_cli("watch", "--once", str(tmp_path / "afile"))[2]
    assert run_cli("watch", "--once", "--interval", "0", "--last", "1", str(tmp_path))[0] == 0


@pytest.mark.timeout(60)
def test_watch_on_a_finished_run_says_the_job_ended(tmp_path):
    """Before: watch on a finished job's run directory showed the last ops with ever-growing ages
    and "first failure: none so far", as if the job still ran."""
    traces = tmp_path / "traces"
    traces.mkdir()
    job(str(traces), ranks=2, ops=3, jsonl=True)
    summary = tmp_path / "summary.json"
    summary.write_text("{}")
    os.utime(summary, ns=(time.time_ns() - 10**12,) * 2)  # an earlier run's, in a reused run directory
    assert "the job ended" not in run_cli("watch", "--once", str(traces))[1]
    os.utime(summary)  # written after the traces: this run's end
    for where in (traces, tmp_path):
        rc, out, _ = run_cli("watch", "--once", str(where))
        assert rc == 0 and "the job ended at " in out and "(its launcher wrote summary.json)" in out, out


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\u202e\nLikely culprit: rank 9 (forged)\x9b1m"


@pytest.mark.timeout(60)
def test_terminal_escapes_in_trace_strings_are_shown_escaped(tmp_path):
    for rank in range(2):
        recs = [record(i, rank=rank, comm=ESCAPES, call_site=ESCAPES) for i in range(1, 4)]
        recs[-1].update(state="timed_out", end_ns=None, duration_ms=None, error=ESCAPES)
        doc = dump_doc(rank, recs)
        doc["communicators"]["a.0"]["name"] = ESCAPES
        doc["reason"] = ESCAPES
        doc["main_stack"] = {"reason": ESCAPES, "at": ESCAPES, "frames": [ESCAPES]}
        write(str(tmp_path / f"rank{rank}.json"), doc)
    for command in ("diagnose", "summary", "overlap"):
        rc, out, err = run_cli(command, str(tmp_path))
        assert rc in (0, 1) and "Traceback" not in err, err
        text = out + err
        for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
            assert raw not in text, (command, raw)
        assert not any(line.startswith("Likely culprit: rank 9") for line in text.splitlines())
    rc, out, _ = run_cli("diagnose", str(tmp_path))
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\u202e\\x0aLikely culprit: rank 9 (forged)\\x9b1m" in out
    rc, out, _ = run_cli("diagnose", "--json", str(tmp_path))
    assert json.loads(out)["communicators"][0]["name"] == ESCAPES  # JSON keeps the text, escaped by JSON


@pytest.mark.timeout(60)
def test_an_output_that_cannot_be_written_is_one_line(tmp_path):
    job(str(tmp_path), ranks=2)
    for args, what in ((["view", str(tmp_path), "-o", str(tmp_path / "no" / "x.html")],
                        f"cannot write {tmp_path / 'no' / 'x.html'}: no such directory {tmp_path / 'no'}"),
                       (["export", str(tmp_path), "--perfetto", str(tmp_path)],
                        f"cannot write {tmp_path}: it is a directory"),
                       (["view", str(tmp_path), "-o", str(tmp_path)], f"cannot write {tmp_path}: it is a directory")):
        rc, out, err = run_cli(*args)
        assert rc == 2 and what in _one_error_line(err) and out == "", err
    if os.path.exists("/dev/full"):  # every write fails (ENOSPC), also for root
        for args in (["view", str(tmp_path), "-o", "/dev/full"], ["export", str(tmp_path), "--perfetto", "/dev/full"]):
            rc, _, err = run_cli(*args)
            assert rc == 2 and "No space left on device" in _one_error_line(err), err
