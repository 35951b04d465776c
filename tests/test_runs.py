"""The run-results contract (commslayer.runs): what the writer saves is what every reader gets,
typed, through one definition."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from commslayer import runs
from commslayer.run.launch import compare_losses
from commslayer.runs import Admission, Recovery


def result(member: int, restart: int = 0, start_step: int = 0) -> runs.RankResult:
    steps = 4
    return runs.RankResult(member=member, replica=member // 2, rank=member % 2, restart=restart, pid=1000 + member,
                           started=1.5, steps=steps, start_step=start_step, elapsed_s=0.3,
                           step_s=[0.1] * (steps - start_step), losses={s: 1.0 / (s + 1) for s in range(start_step, steps)},
                           optimizer_steps=[steps], live=[0, 1], fingerprints=[11, 11], generation=2,
                           recoveries=[Recovery(1, [1], 1, 10.0, 10.5, 11.0)], admissions=[Admission(3, [1], 2, 0.25)])


def test_a_result_reads_back_as_written(tmp_path):
    written = [result(3, restart=1, start_step=2), result(0), result(1)]
    for r in written:
        path = runs.save(r, str(tmp_path / "run"))  # the directory is created
        assert os.path.basename(path) == f"result-m{r.member}-r{r.restart}.json"
    back = runs.load_results(str(tmp_path / "run"))
    assert sorted(back, key=lambda r: r.member) == sorted(written, key=lambda r: r.member)
    assert all(isinstance(s, int) for r in back for s in r.losses)  # JSON's string keys come back as steps
    assert isinstance(back[0].recoveries[0], Recovery) and isinstance(back[0].admissions[0], Admission)
    assert runs.longest(back).member == 0 and back[-1].end_step == 4
    assert not [n for n in os.listdir(tmp_path / "run") if ".tmp-" in n]  # no half-written file left


def test_the_job_stores_records_and_the_fault_log(tmp_path):
    store = dist.HashStore()
    assert runs.job_recoveries(store) == [] and runs.job_admissions(store) == []
    rec, adm = Recovery(5, [1], 1, 1.0, 1.2, 1.3), Admission(7, [1], 2, 0.4)
    runs.record(store, rec)
    runs.record(store, adm)
    runs.record(store, Recovery(9, [0], 3, 2.0, 2.2))
    assert runs.job_recoveries(store) == [rec, Recovery(9, [0], 3, 2.0, 2.2, None)]
    assert runs.job_admissions(store) == [adm]

    assert runs.read_log(str(tmp_path / "none.jsonl")) == []
    events = [{"event": "injected", "member": 3, "t": 1.0, "what": "SIGKILL of rank 3"},
              {"event": "failure", "member": 0, "t": 1.1}]
    (tmp_path / runs.FAULT_LOG).write_text("".join(json.dumps(e) + "\n" for e in events) + "\n")
    assert runs.read_log(str(tmp_path / runs.FAULT_LOG)) == events
    assert runs.injections(str(tmp_path), shards=2) == [dict(events[0], replica=1, rank=1)]
    assert runs.injections(str(tmp_path), shards=4) == [dict(events[0], replica=0, rank=3)]  # per-rank mode


def test_a_summary_reads_back_and_a_missing_one_is_none(tmp_path):
    assert runs.load_summary(str(tmp_path)) is None
    (tmp_path / runs.SUMMARY).write_text('{"ok": tr')  # cut short
    assert runs.load_summary(str(tmp_path)) is None
    summary = runs.Summary(ok=True, killed=[{"what": "SIGKILL", "replica": 1, "t": 1.0, "stall_s": 0.2}],
                           losses={0: 2.0, 1: 1.0}, recoveries=[Recovery(1, [1], 1, 1.0, 1.1, 1.2)],
                           admissions=[Admission(3, [1], 2, 0.3)])
    runs.save_summary(summary, str(tmp_path))
    assert runs.load_summary(str(tmp_path)) == summary


def test_loss_curves_of_different_lengths_do_not_compare(capsys):
    """A reference run with other steps is a mismatch said in one line, not a KeyError."""
    assert not compare_losses({0: 1.0, 1: 0.9}, {0: 1.0, 1: 0.9, 2: 0.8}, 2, 0.05, "ref")
    assert "different steps" in capsys.readouterr().out
    assert compare_losses({s: 1.0 for s in range(6)}, {s: 1.0 for s in range(6)}, 6, 0.05, "ref")
