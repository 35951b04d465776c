"""The viewer's recovery story, lives and readable messages on small hand-written traces
(the format as the recorder writes it; no processes): a job that lost a rank and went on
is told as recovered (exit 0), one that never resumed as failed (exit 1); a restarted
rank's lives are one row; backend noise stays out of the headlines."""

from __future__ import annotations

import json
import os

from tests.viewer_traces import MONO_NS, WALL_NS, communicators, dump_doc, record, run_cli, write
from tracing.read.analysis import JobScan
from tracing.messages import loss_cause, relative_site, short_error, short_reason
from tracing.read.traceio import LIFE_OP_IDS

GLOO = ("peer lost: rank(s) 1 (backend: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:27868. This is typically caused by a remote worker crashing. "
        "Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f) "
        "[communicator 'a'; op all_reduce #3; timeout 60s; elapsed 0.042s; ranks 1]")
MS = 1_000_000


def test_short_error_keeps_the_cause_only():
    assert short_error(GLOO) == "peer lost: rank(s) 1 (backend: Connection closed by peer)"
    assert loss_cause(GLOO) == "Connection closed by peer"
    assert short_error("peer lost: rank(s) 1 (backend: [/x/gloo/transport/tcp/pair.cc:589] Read error "
                       "[127.0.0.1]:25480: Connection reset by peer)") == \
        "peer lost: rank(s) 1 (backend: Read error: Connection reset by peer)"
    assert loss_cause("peer lost: rank 2 (member 2): rank 2: no heartbeat for 5.00s (stopped or hung)") == \
        "no heartbeat for 5.00s (stopped or hung)"
    reason = f"PeerLost: {GLOO}; communicator 'a' being shrunk after a loss; exit"
    assert short_reason(reason) == \
        "finished (exit 0); earlier dump on PeerLost: peer lost: rank(s) 1 (backend: Connection closed by peer) (+1 more)"
    assert relative_site("/job/dir/train.py:12", "/job/dir") == "train.py:12"
    assert relative_site("/elsewhere/x.py:3", "/job/dir") == "/elsewhere/x.py:3"


def _event(kind, mono_ns, **fields):
    return {"kind": kind, "mono_ns": mono_ns, "step": fields.pop("step", None), **fields}


def _recovered_job(directory, *, resumed=True):
    """Ranks 0 and 1 of 3 lose rank 2 at op 3 of 'a' (generation 0), agree on
    generation 1 (members 0, 1) and, if ``resumed``, run two ops in it."""
    os.makedirs(directory, exist_ok=True)
    for rank in (0, 1):
        recs = [record(i, rank=rank, call_site="/job/dir/train.py:42") for i in (1, 2)]
        recs.append(record(3, rank=rank, state="failed", error=GLOO, end_ns=MONO_NS + 3 * MS + 900_000,
                           call_site="/job/dir/train.py:42"))
        if resumed:
            recs += [record(i, rank=rank, seq=i - 3, comm_id="a.0@g1", generation=1, call_site="/job/dir/train.py:50")
                     for i in (4, 5)]
        comms = communicators(3)
        comms["a.0"]["rank"] = rank
        comms["a.0@g1"] = {"name": "a", "backend": "gloo", "rank": rank, "size": 2, "global_ranks": [0, 1],
                           "generation": 1, "members": [0, 1], "state": "ok"}
        doc = dump_doc(rank, recs, 3)
        doc.update(communicators=comms, cwd="/job/dir", reason=f"PeerLost: {GLOO}; exit", events=[
            _event("peer_lost", MONO_NS + 3 * MS + 100_000 * (rank + 1), comm="a", comm_id="a.0", generation=0,
                   lost=[2], op="liveness", seq=2, error="peer lost: rank 2 (member 2): rank 2: its process exited "
                                                         "(connection closed)", step=7),
            _event("generation", MONO_NS + 3 * MS + 600_000, comm="a", comm_id="a.0@g1", generation=1,
                   members=[0, 1], before=[0, 1, 2], step=7)])
        write(os.path.join(directory, f"rank{rank}.json"), doc)
    return directory


def test_a_job_that_recovered_is_told_as_such(tmp_path):
    traces = _recovered_job(str(tmp_path / "t"))
    rc, out, _ = run_cli("diagnose", traces)
    assert rc == 0, out
    head = out.splitlines()[0]
    assert head.startswith("The job lost rank 2 at step 7 and recovered in ") and "(generation 1: ranks 0, 1)" in head
    assert "GLHF" not in out and "pair.cc" not in out  # the backend's text is not in the report
    assert "recovered from: 'a' (a.0) went wrong at all_reduce #3" in out
    assert "finished (exit 0); earlier dump on PeerLost: peer lost: rank(s) 1 (backend: Connection closed by peer)]" \
        in out
    assert "at train.py:42" in out and "/job/dir" not in out
    d = json.loads(run_cli("diagnose", "--json", traces)[1])
    [loss] = d["recovery"]["losses"]
    assert loss["lost"] == [2] and loss["members_before"] == [0, 1, 2] and loss["members_after"] == [0, 1]
    assert [det["rank"] for det in loss["detections"]] == [0, 1]
    assert [round(det["latency_s"] * 1e6) for det in loss["detections"]] == [0, 100]
    assert loss["detections"][0]["how"] == "its process exited (connection closed)"
    assert round(loss["decision_s"] * 1e6) == 500  # first detection at +100 us, decision at +600 us
    assert d["ranks"][0]["call_site_full"] == "/job/dir/train.py:50" and d["ranks"][0]["reason_full"].endswith("exit")


def test_a_job_that_did_not_resume_failed(tmp_path):
    traces = _recovered_job(str(tmp_path / "t"), resumed=False)
    rc, out, _ = run_cli("diagnose", traces)
    assert rc == 1, out
    assert "did not resume in a new generation" in out and "GLHF" not in out


def test_a_second_loss_before_the_new_generation_ran_is_one_recovery(tmp_path):
    """Ranks 0 and 1 of 4 lose rank 2, decide generation 1 (members 0, 1, 3), then lose
    rank 3 before generation 1 ran an op, decide generation 2 (members 0, 1) and go on:
    one loss of ranks 2 and 3, timed from the first detection to generation 2's first op."""
    directory = str(tmp_path / "t")
    os.makedirs(directory)
    lost = "peer lost: rank {r} (member {r}): rank {r}: its process exited (connection closed)"
    for rank in (0, 1):
        recs = [record(i, rank=rank) for i in (1, 2)]
        recs.append(record(3, rank=rank, state="failed", error=GLOO, end_ns=MONO_NS + 3 * MS + 900_000))
        recs += [record(i, rank=rank, seq=i - 5, comm_id="a.0@g2", generation=2) for i in (6, 7)]
        comms = communicators(4)
        comms["a.0"]["rank"] = rank
        for gen, members in ((1, [0, 1, 3]), (2, [0, 1])):
            comms[f"a.0@g{gen}"] = {"name": "a", "backend": "gloo", "rank": rank, "size": len(members),
                                    "global_ranks": members, "generation": gen, "members": members, "state": "ok"}
        doc = dump_doc(rank, recs, 4)
        doc.update(communicators=comms, events=[
            _event("peer_lost", MONO_NS + 3 * MS + 100_000, comm="a", comm_id="a.0", generation=0, lost=[2],
                   op="liveness", seq=2, error=lost.format(r=2), step=7),
            _event("generation", MONO_NS + 3 * MS + 600_000, comm="a", comm_id="a.0@g1", generation=1,
                   members=[0, 1, 3], before=[0, 1, 2, 3], step=7),
            _event("peer_lost", MONO_NS + 4 * MS, comm="a", comm_id="a.0@g1", generation=1, lost=[3],
                   op="liveness", seq=0, error=lost.format(r=3), step=7),
            _event("generation", MONO_NS + 5 * MS, comm="a", comm_id="a.0@g2", generation=2,
                   members=[0, 1], before=[0, 1, 3], step=7)])
        write(os.path.join(directory, f"rank{rank}.json"), doc)
    rc, out, _ = run_cli("diagnose", directory)
    assert rc == 0, out
    head = out.splitlines()[0]
    assert head.startswith("The job lost ranks 2, 3 at step 7 and recovered in 0.003 s (generation 2: ranks 0, 1)"), head
    assert "did not resume" not in out
    [loss] = json.loads(run_cli("diagnose", "--json", directory)[1])["recovery"]["losses"]
    assert loss["lost"] == [2, 3] and loss["members_before"] == [0, 1, 2, 3] and loss["members_after"] == [0, 1]
    # generation 2's first op: op 6 of rank 0, enqueued at +6 ms; the first detection at +3.1 ms
    assert round(loss["resume_s"] * 1e6) == round(loss["recovery_s"] * 1e6) == 2900
    assert round(loss["decision_s"] * 1e6) == 1900


def test_lives_of_a_restarted_rank_are_one_row(tmp_path):
    """Rank 1's second life (another process: other clock anchor, op ids from 1 again)
    lies under replica1-restart1/; it continues rank 1's row, on the same time axis."""
    top = tmp_path / "traces"
    later = top / "replica1-restart1"
    later.mkdir(parents=True)
    for rank in (0, 1):
        write(str(top / f"rank{rank}.json"), dump_doc(rank, [record(i, rank=rank) for i in (1, 2)]))
    # life 2 starts 10 s later on the wall clock; its monotonic clock began elsewhere (offset 7 s)
    doc = dump_doc(1, [record(i, rank=1, comm_id="a.0@g1", generation=1, seq=i) for i in (1, 2)])
    doc["clock"] = {"wall_ns": WALL_NS + 10_000 * MS, "mono_ns": MONO_NS + 3_000 * MS}
    write(str(later / "rank1.json"), doc)
    scan = JobScan([str(top)])
    assert sorted(scan.sources) == [0, 1] and len(scan.sources[1].files) == 2
    (first, start1, end1), (second, start2, _) = [(lv[0], lv[1], lv[2]) for lv in scan.lives[1]]
    assert (first, second) == (0, 1)
    assert round((start2 - end1) / MS) == 7_000 - 2  # a visible gap: 7 s later on the common axis
    d = json.loads(run_cli("diagnose", "--json", str(top))[1])
    assert d["ranks"][1]["lives"] == 2 and "no trace" not in json.dumps(d["ranks"])
    assert scan.last_record[1]["op_id"] == LIFE_OP_IDS + 2 and scan.last_record[1]["life"] == 1


def test_fencing_is_told_and_marked(tmp_path):
    traces = _recovered_job(str(tmp_path / "t"))
    doc = json.loads((tmp_path / "t" / "rank1.json").read_text())
    doc["events"].append(_event("fenced", MONO_NS + 4 * MS, comm="a", comm_id="a.0@g1", generation=1,
                                why="fenced out of generation 2: the others went on with members [0]"))
    write(os.path.join(traces, "rank1.json"), doc)
    d = json.loads(run_cli("diagnose", "--json", traces)[1])
    assert d["recovery"]["fenced"][0]["rank"] == 1
    assert "rank 1 was fenced out of 'a': fenced out of generation 2: the others went on with members [0]" \
        in d["recovery"]["lines"]
    assert [m["kind"] for m in d["recovery"]["markers"]][-1] == "fenced"


def test_watch_reads_whole_lines_as_they_are_appended(tmp_path):
    """A line still being written waits for the next look; the first failure shows as it comes."""
    from tests.viewer_traces import jsonl_lines
    from tracing.read.watch import Watch

    path = tmp_path / "rank0.jsonl"
    lines = [json.dumps(x).encode() + b"\n" for x in jsonl_lines(0, [record(i) for i in (1, 2)])]
    path.write_bytes(b"".join(lines) + lines[-1][:20])  # and half of a repeated line
    w = Watch(str(tmp_path))
    w.poll()
    frame = "\n".join(w.frame(WALL_NS + 10_000 * MS))
    assert "all_reduce #2 of 'a'" in frame and "first failure: none so far" in frame
    failed = record(3, state="failed", error=GLOO)
    with open(path, "ab") as f:
        f.write(b"\n" + json.dumps({"event": "collective", "rank": 0, **failed}).encode() + b"\n")
    w.poll()
    frame = "\n".join(w.frame(WALL_NS + 10_000 * MS))
    assert "all_reduce #3 of 'a'" in frame
    assert "first failure:" in frame and "(backend: Connection closed by peer)" in frame and "GLHF" not in frame


def test_a_bad_event_names_its_file_and_field(tmp_path):
    traces = _recovered_job(str(tmp_path / "t"))
    doc = json.loads((tmp_path / "t" / "rank0.json").read_text())
    doc["events"][0]["lost"] = ["2"]
    write(os.path.join(traces, "rank0.json"), doc)
    rc, _, err = run_cli("diagnose", traces)
    assert rc == 2 and "rank0.json:1: 'event lost[]' must be an integer" in err, err
    rc, out, err = run_cli("diagnose", "--skip-bad", traces)
    assert rc in (0, 1) and "skipped" in err and "Traceback" not in err
