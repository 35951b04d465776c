"""The viewer on a per-rank job (``commslayer-run`` without ``--replicas``: every rank its own
restart unit), on small hand-written traces shaped like a real one: ranks 0, 1 survive,
rank 2 is SIGKILLed in step 30 (its first life leaves no file), the survivors decide
generation 1 without it, admit its replacement (life 1) in generation 2, which receives its
state from rank 1 and continues at step 29 (the redo boundary), and every rank finishes.
The real runs are in tests/test_peer_redundancy.py (which asserts the same on their traces)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from tests.viewer_traces import MONO_NS, WALL_NS, communicators, record, run_cli, write
from tracing.messages import short_reason, split_reasons
from tracing.records import new_dump

MS = 1_000_000
T0 = MONO_NS + 100 * MS  # the first detection
LOST = "peer lost: rank 2 (member 2): rank 2: its process exited (connection closed)"


def _event(kind: str, at_ms: float, **fields: Any) -> Dict[str, Any]:
    return {"kind": kind, "mono_ns": T0 + int(at_ms * MS), "step": fields.pop("step", None), **fields}


def _op(op_id: int, rank: int, gen: int, seq: int, at_ms: float, op: str = "all_gather_single",
        site: str = "train.py:63", **fields: Any) -> Dict[str, Any]:
    """An op of communicator 's' (lineage ``s.0``) at ``at_ms`` after the first detection."""
    enq = T0 + int(at_ms * MS) + rank * 1_000
    r = record(op_id, rank=rank, seq=seq, comm="s", comm_id="s.0" if not gen else f"s.0@g{gen}", op=op,
               generation=gen, call_site=site, enqueue_ns=enq, start_ns=enq + 10_000, end_ns=enq + 500_000)
    r.update(fields)
    return r


def _comms(rank: int, gens: List[int]) -> Dict[str, Dict[str, Any]]:
    members = {0: [0, 1, 2], 1: [0, 1], 2: [0, 1, 2]}
    return {("s.0" if not g else f"s.0@g{g}"): {
        "name": "s", "backend": "gloo", "rank": members[g].index(rank), "size": len(members[g]),
        "global_ranks": members[g], "generation": g, "members": members[g], "state": "ok"} for g in gens}


def _dump(rank: int, records: List[Dict[str, Any]], gens: List[int], reason: str,
          events: List[Dict[str, Any]]) -> Dict[str, Any]:
    doc = new_dump(job="j", rank=rank, host="h", pid=100 + rank, wall_ns=WALL_NS, mono_ns=MONO_NS, reason=reason,
                   dropped=0, communicators=_comms(rank, gens), records=records)
    doc.update(cwd="/job", events=events)
    return doc


def per_rank_job(directory: str, *, replacement_site: str = "train.py:135", survivor_sites: Optional[List[str]] = None,
                 late_split: bool = False, earlier_dump: Optional[str] = None, late_report: bool = False) -> str:
    """Write the job (see the module doc).  ``replacement_site``: where the replacement's
    start-up issued generation 2's restore vote (the survivors: ``survivor_sites``, from
    their recovery, ``train.py:140``); ``late_split``: the replacement issues an op of
    step 29 (after its heal) from another line than the survivors; ``earlier_dump``: the
    killed life wrote a dump for this reason before it was killed (records up to #4);
    ``late_report``: rank 1 reports its recovery after rank 0 entered the commit (each
    survivor reports on its own, as in a replica group job) and enters it at +656 ms."""
    os.makedirs(os.path.join(directory, "replica0-restart1"), exist_ok=True)
    survivor_sites = survivor_sites or ["train.py:140", "train.py:140"]
    for rank in (0, 1):
        recs = [_op(i, rank, 0, i, -60 + 10 * i, step=30) for i in range(1, 6)]
        recs.append(_op(6, rank, 0, 6, -5, op="reduce_scatter_single", site="train.py:64", state="failed",
                        error=f"{LOST} [communicator 's'; op liveness #6; ranks 2]", step=30))
        recs.append(_op(7, rank, 1, 1, 380, op="pending_members", site="train.py:140", step=30))
        recs.append(_op(8, rank, 2, 1, 550, op="should_commit", site=survivor_sites[rank], step=30))
        recs.append(_op(9, rank, 2, 2, 620, step=29))
        recs.append(_op(10, rank, 2, 3, 656 if late_report and rank == 1 else 650, op="should_commit",
                        site="train.py:65", step=29))
        events = [_event("peer_lost", rank * 2, comm="s", comm_id="s.0", generation=0, lost=[2], op="liveness",
                         seq=6, error=LOST),
                  _event("generation", 377, comm="s", comm_id="s.0@g1", generation=1, members=[0, 1],
                         before=[0, 1, 2], step=30),
                  _event("generation", 500, comm="s", comm_id="s.0@g2", generation=2, members=[0, 1, 2],
                         before=[0, 1], step=30),
                  _event("admitted", 510, replicas=[], generation=2, members=[0, 1, 2], seconds=0.01, step=30),
                  # its seconds count from this survivor's own entry into recovery (as commslayer.train.peerjob's
                  # do): 0.277 s, shorter than the decision's 0.377 s after the first detection
                  _event("recovered", 655 if late_report and rank == 1 else 600, lost_replicas=[], generation=2,
                         members=[0, 1, 2], seconds=0.277,
                         redo_from=29, step=30)]
        reason = f"PeerLost: {LOST} [communicator 's'; op liveness #6; ranks 2]; communicator 's' being shrunk " \
                 "after a loss; exit"
        write(os.path.join(directory, f"rank{rank}.json"), _dump(rank, recs, [0, 1, 2], reason, events))
    if earlier_dump:  # the killed life's own dump, written before it was killed
        recs = [_op(i, 2, 0, i, -60 + 10 * i, step=30) for i in range(1, 5)]
        write(os.path.join(directory, "rank2.json"), _dump(2, recs, [0], earlier_dump, []))
    recs = [_op(1, 2, 2, 1, 550, op="should_commit", site=replacement_site),
            _op(2, 2, 2, 2, 620, site="train.py:99" if late_split else "train.py:63", step=29),
            _op(3, 2, 2, 3, 650, op="should_commit", site="train.py:65", step=29)]
    events = [_event("generation", 500, comm="s", comm_id="s.0@g2", generation=2, members=[0, 1, 2]),
              _event("healed", 560, generation=2, source=1, source_replica=None, bytes=4096, seconds=0.01, step=29)]
    write(os.path.join(directory, "replica0-restart1", "rank2.json"), _dump(2, recs, [2], "exit", events))
    return directory


def _diagnosis(directory: str) -> Dict[str, Any]:
    code, out, err = run_cli("diagnose", "--json", directory)
    assert code == 0, out + err
    return json.loads(out)


def test_a_replacements_start_up_ops_are_not_a_call_site_split(tmp_path):
    """Item 1: generation 2's restore vote, issued by the replacement from its start-up and by
    the survivors from their recovery, is no divergence: no warning, exit 0."""
    traces = per_rank_job(str(tmp_path / "t"))
    code, out, err = run_cli("diagnose", traces)
    assert code == 0, out + err
    assert "called from different lines" not in out and "warning" not in out, out
    assert [f["severity"] for f in _diagnosis(traces)["findings"]] == ["info"]  # the failed op, recovered from


def test_a_real_split_in_the_joining_generation_is_still_reported(tmp_path):
    """The same job where the survivors disagree among themselves on the restore vote's line,
    or where the replacement, healed and in the loop, calls a step's op from another line."""
    among = _diagnosis(per_rank_job(str(tmp_path / "a"), survivor_sites=["train.py:140", "train.py:141"]))
    [split] = [f for f in among["findings"] if "called from different lines" in f["text"]]
    assert "'s' #1 (should_commit)" in split["text"] and "rank 1 at train.py:141" in split["text"], split
    late = _diagnosis(per_rank_job(str(tmp_path / "b"), late_split=True))
    [split] = [f for f in late["findings"] if "called from different lines" in f["text"]]
    assert "'s' #2 (all_gather_single)" in split["text"] and split["ranks"] == [2], split


def test_the_replacement_rejoins_at_the_step_it_continued_at(tmp_path):
    """Item 2: the survivors were in step 30 when they admitted it; it received step 29's state
    and continued there (its heal event, what it printed): the story says 29."""
    traces = per_rank_job(str(tmp_path / "t"))
    code, out, _ = run_cli("diagnose", traces)
    head = out.splitlines()[0]
    assert head.startswith("The job lost rank 2 at step 30 and recovered in "), head
    assert "back to step 29)" in head and "rank 2 rejoined at step 29 after a restart" in head, head
    assert "admitted 2 at step 30 (continuing at step 29)" in out and "continuing at step 29" in out, out
    [adm] = _diagnosis(traces)["recovery"]["admissions"]
    assert adm["step"] == 30 and adm["continued_at"] == 29


def test_recovered_is_measured_from_the_first_detection_and_contains_the_decision(tmp_path):
    """Item 3: the ``recovered`` events say 0.277 s (from each survivor's own entry into its
    recovery); the decision came 0.377 s after the first detection.  Recovered is from the
    first detection to the end of the first step committed after the survivors were back
    (generation 2's should_commit #3 at +650 ms, ended 0.5 ms later), not the restore vote
    (#1, before their ``recovered`` events)."""
    traces = per_rank_job(str(tmp_path / "t"))
    [loss] = _diagnosis(traces)["recovery"]["losses"]
    assert round(loss["decision_s"], 3) == 0.377 and round(loss["resume_s"], 3) == 0.380
    assert loss["recovered_by"] == "first commit" and loss["commit_generation"] == 2
    assert round(loss["recovery_s"] * 1e6) == 650_000 + 500 + 2  # rank 2's end: the latest
    assert loss["recovery_s"] >= loss["resume_s"] >= loss["decision_s"]
    out = run_cli("diagnose", traces)[1]
    assert "recovered in 0.651 s (to the first step committed after it, generation 2, redone from step 29)" in out, out
    # each survivor enters the commit after its own report, not after the last report of all
    [late] = _diagnosis(per_rank_job(str(tmp_path / "late"), late_report=True))["recovery"]["losses"]
    assert late["recovered_by"] == "first commit" and round(late["recovery_s"] * 1e6) == 656_000 + 500 + 1


def test_survivors_that_finished_say_so_before_their_earlier_dump(tmp_path):
    """Item 4: a survivor's file is its dump at exit; the dump on PeerLost came before."""
    ranks = _diagnosis(per_rank_job(str(tmp_path / "t")))["ranks"]
    for r in ranks[:2]:
        assert r["reason"] == f"finished (exit 0); earlier dump on PeerLost: {LOST} (+1 more)", r["reason"]
    assert ranks[2]["reason"] == "finished (exit 0)" and ranks[2]["lives"] == 2
    assert short_reason("CollectiveTimeout: gave up; exit 1: CollectiveTimeout: x") == \
        "exit 1: CollectiveTimeout: x; earlier dump on CollectiveTimeout: gave up"
    assert short_reason("SIGTERM") == "dumped on SIGTERM"


def test_reasons_come_apart_after_a_context_cut_by_an_older_recorder(tmp_path):
    """Recorders before this fix cut a reason's "[communicator ...; ...]" at a "; " piece
    seen before, leaving its bracket open: the reasons after it still come apart."""
    reason = (f"PeerLost: {LOST} [communicator 's'; op liveness #6; ranks 2]; PeerLost: {LOST} [communicator "
              "'c'; op liveness #4; communicator 's' being shrunk after a loss; exit")
    parts = split_reasons(reason)
    assert parts[0].endswith("ranks 2]") and parts[-1] == "exit", parts
    assert short_reason(reason).startswith(f"finished (exit 0); earlier dump on PeerLost: {LOST} (+")
    assert split_reasons("a [x; y]; b (c; d); e") == ["a [x; y]", "b (c; d)", "e"]


def test_a_killed_life_without_a_file_is_told_from_its_peers_records(tmp_path):
    """Item 5: rank 2's first life was SIGKILLed and left nothing: its row in generation 0's
    communicator gives the last collective the survivors completed (it needed rank 2) and the
    op they were in when they lost it, its sequence number and call site, and says so."""
    traces = per_rank_job(str(tmp_path / "t"))
    d = _diagnosis(traces)
    [comm] = [c for c in d["communicators"] if c["uid"] == "s.0"]
    row = comm["rows"][2]
    assert row["last_entered"] is None and row["from"] == (
        "from its peers' records: it entered all_gather_single #5 (they completed it, which needs every member); "
        "they were in reduce_scatter_single #6 of 's' (failed) at train.py:64 when they lost it"), row
    assert all(r["from"] is None for r in comm["rows"][:2])
    out = run_cli("diagnose", traces)[1]
    assert "rank 2: no record of its own; from its peers' records: it entered all_gather_single #5" in out, out
    assert "last entered -" not in out


def test_a_killed_life_with_an_earlier_dump_is_told_from_it(tmp_path):
    """Item 5, the other source: the killed life had dumped before (on SIGUSR1 here): its last
    op comes from that dump, which says it may be older than the life's end (a dump on
    SIGTERM was written at its end)."""
    traces = per_rank_job(str(tmp_path / "t"), earlier_dump="SIGUSR1")
    [comm] = [c for c in _diagnosis(traces)["communicators"] if c["uid"] == "s.0"]
    row = comm["rows"][2]
    assert row["last_entered"] == "all_gather_single #4 (completed)" and row["call_site"] == "train.py:63"
    assert row["from"] == "its own last dump (dumped on SIGUSR1), written before it was lost: it may have gone on " \
                          "after it", row
    assert "(its own last dump (dumped on SIGUSR1)" in run_cli("diagnose", traces)[1]
    ended = per_rank_job(str(tmp_path / "u"), earlier_dump="SIGTERM")  # its end, not an earlier dump
    [comm] = [c for c in _diagnosis(ended)["communicators"] if c["uid"] == "s.0"]
    assert comm["rows"][2]["from"] == "its own dump at its end (dumped on SIGTERM)", comm["rows"][2]


def test_a_lost_rank_without_any_file_stands_where_its_peers_saw_it(tmp_path):
    """A rank that was lost and never came back (no file at all): "where each rank stands"
    says what its peers' records tell."""
    traces = per_rank_job(str(tmp_path / "t"))
    for name in os.listdir(os.path.join(traces, "replica0-restart1")):
        os.remove(os.path.join(traces, "replica0-restart1", name))
    os.rmdir(os.path.join(traces, "replica0-restart1"))
    code, out, _ = run_cli("diagnose", "--json", traces)
    rank2 = json.loads(out)["ranks"][2]
    assert rank2["stands"].startswith("no trace file; from its peers' records: it entered all_gather_single #5"), rank2
    assert "they were in reduce_scatter_single #6 of 's' (failed) at train.py:64" in rank2["stands"]


def test_the_recorder_keeps_each_reason_whole(tmp_path):
    """The recorder's dump lists each reason once, whole: a reason whose context repeats a
    piece of an earlier one ("ranks 2]") keeps it (it used to lose it, and its bracket)."""
    from tracing.record.recorder import FlightRecorder  # imports torch: the recorder side

    rec = FlightRecorder(16, str(tmp_path), job="j")
    rec._comms = {"a.0": (lambda: None, {"name": "a", "backend": "gloo"})}  # something to dump for
    first = f"PeerLost: {LOST} [communicator 's'; op liveness #6; ranks 2]"
    second = f"PeerLost: {LOST} [communicator 'c'; op liveness #4; ranks 2]"
    rec.dump(first)
    rec.dump(f"{second}; communicator 's' being shrunk after a loss")
    rec.dump(first)
    rec.dump("exit")
    reason = json.loads((tmp_path / "rank0.json").read_text())["reason"]
    assert split_reasons(reason) == [first, second, "communicator 's' being shrunk after a loss", "exit"], reason


def test_a_rank_hung_outside_any_collective_is_found_on_the_line_its_main_thread_was_on(tmp_path):
    """Rank 1 never entered the all-reduce rank 0 waits in (it hung in its own code), and both
    dumped on SIGTERM: the headline and "where each rank stands" give the line rank 1's main
    thread was on, which its records cannot."""
    for rank, ops in ((0, 4), (1, 3)):
        recs = [record(i, rank=rank) for i in range(1, ops + 1)]
        if rank == 0:
            recs[-1].update(state="started", end_ns=None, duration_ms=None)
        line = 88 if rank else 42
        doc = new_dump(job="j", rank=rank, host="h", pid=100 + rank, wall_ns=WALL_NS, mono_ns=MONO_NS,
                       reason="SIGTERM", dropped=0, communicators=communicators(2), records=recs, cwd=str(tmp_path),
                       main_stack={"reason": "SIGTERM", "at": f"{tmp_path}/train.py:{line}",
                                   "frames": [f"{tmp_path}/train.py:120 in <module>",
                                              f"{tmp_path}/train.py:{line} in load_batch"]})
        write(str(tmp_path / f"rank{rank}.json"), doc)
    rc, out, err = run_cli("diagnose", str(tmp_path))
    assert rc == 1 and not err, err
    assert "Likely culprit: rank 1 (never entered all_reduce #4 of 'a'; last entered all_reduce #3 of 'a' " \
           "(completed) at train.py:42; its main thread was at train.py:88 when it dumped)" in out, out
    assert "\n    its main thread was at train.py:88 when it dumped on SIGTERM\n" in out, out
    ranks = json.loads(run_cli("diagnose", "--json", str(tmp_path))[1])["ranks"]
    assert ranks[1]["main_thread"] == {"reason": "SIGTERM", "at": "train.py:88", "at_full": f"{tmp_path}/train.py:88",
                                       "frames": [f"{tmp_path}/train.py:120 in <module>",
                                                  f"{tmp_path}/train.py:88 in load_batch"]}
