"""Files a job writes, in a trace directory others can write to: a name planted
there before the job writes it (a symbolic link to a victim file or directory,
a FIFO, a hard link, the dump's temporary name) never redirects, blocks or
stops the job; the refusal is logged, naming the path and why; what the job
creates is private (files 0600, directories 0700) unless
``COMMSLAYER_TRACE_MODE`` says otherwise."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest
import torch

from tests.harness import run_ranks

VICTIM = b"the victim's own content\n"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)  # the usual umask: without the fix, what the job creates is world-readable
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    return victim


def test_what_a_job_creates_is_private(tmp_path, umask_022):
    from tracing.dumps import AppendWriter, DumpWriter

    traces = tmp_path / "runs" / "job" / "traces"
    writer = DumpWriter(str(traces))
    assert writer.write("rank0.json", b"{}") and writer.write("fr/commslayer_fr_rank_0", b"fr")
    assert AppendWriter(str(traces / "rank0.jsonl")).write(b"{}\n", records=1)
    for d in (tmp_path / "runs", tmp_path / "runs" / "job", traces, traces / "fr"):
        assert _mode(d) == 0o700, d
    for f in ("rank0.json", "fr/commslayer_fr_rank_0", "rank0.jsonl"):
        assert _mode(traces / f) == 0o600, f
    shared = DumpWriter(str(tmp_path / "shared"), mode=0o640)  # COMMSLAYER_TRACE_MODE=0640
    assert shared.write("fr/commslayer_fr_rank_1", b"fr")
    assert _mode(tmp_path / "shared") == _mode(tmp_path / "shared" / "fr") == 0o750
    assert _mode(tmp_path / "shared" / "fr" / "commslayer_fr_rank_1") == 0o640


def test_trace_mode_is_validated(monkeypatch):
    from commslayer import config

    monkeypatch.setenv("COMMSLAYER_TRACE_MODE", "0640")
    assert config.trace_mode() == 0o640
    for bad in ("0666", "0755", "0400", "rw-r-----", "-1"):
        monkeypatch.setenv("COMMSLAYER_TRACE_MODE", bad)
        with pytest.raises(ValueError, match=f"COMMSLAYER_TRACE_MODE='{bad}'.*0600, 0640"):
            config.trace_mode()


def test_each_life_of_a_rank_dumps_into_its_own_directory(tmp_path, monkeypatch):
    """A replacement rank (per-rank mode) and a restarted replica group write below their life's
    directory, which the viewer reads as a later life: never over the dump of the life before."""
    from commslayer import config

    monkeypatch.setenv("COMMSLAYER_TRACE_DIR", str(tmp_path))
    for name in ("COMMSLAYER_REPLICA", "COMMSLAYER_RESTART_UNIT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert config.trace_dir() == str(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert config.trace_dir() == str(tmp_path)  # plain torchrun: no replica group, not per-rank
    monkeypatch.setenv("COMMSLAYER_RESTART_UNIT", "rank")
    assert config.trace_dir() == str(tmp_path / "replica0-restart2")
    monkeypatch.delenv("COMMSLAYER_RESTART_UNIT")
    monkeypatch.setenv("COMMSLAYER_REPLICA", "1")
    assert config.trace_dir() == str(tmp_path / "replica1-restart2")


def test_a_planted_jsonl_link_is_refused_and_logged(tmp_path, caplog):
    from tracing.dumps import AppendWriter

    victim = _victim(tmp_path)
    (tmp_path / "rank0.jsonl").symlink_to(victim)
    writer = AppendWriter(str(tmp_path / "rank0.jsonl"))
    with caplog.at_level(logging.WARNING, logger="commslayer.tracing"):
        assert not writer.write(b'{"event":"collective"}\n', records=1)
        assert not writer.write(b'{"event":"collective"}\n', records=1)
    assert victim.read_bytes() == VICTIM
    assert writer.failed_writes == 2 and writer.dropped_records == 2
    [error] = [r for r in caplog.records if "rank0.jsonl" in r.getMessage()]  # once, not per write
    assert error.levelno == logging.ERROR and f"symbolic link to {victim}" in error.getMessage()


def test_a_fifo_or_hard_link_is_refused_without_blocking(tmp_path, caplog):
    from tracing.dumps import AppendWriter

    os.mkfifo(tmp_path / "rank0.jsonl")
    reader = os.open(tmp_path / "rank0.jsonl", os.O_RDONLY | os.O_NONBLOCK)  # an attacker reads it...
    try:
        done = []
        writer = threading.Thread(target=lambda: done.append(AppendWriter(str(tmp_path / "rank0.jsonl"))
                                                             .write(b"x" * (1 << 20), records=1)), daemon=True)
        writer.start()
        writer.join(10)  # ...and stops reading: a write to the FIFO would block for good
        assert done == [False]
    finally:
        os.close(reader)
    victim = _victim(tmp_path)
    os.link(victim, tmp_path / "rank1.jsonl")
    with caplog.at_level(logging.WARNING, logger="commslayer.tracing"):
        assert not AppendWriter(str(tmp_path / "rank1.jsonl")).write(b"x\n", records=1)
    assert victim.read_bytes() == VICTIM
    assert any("2 hard links" in r.getMessage() for r in caplog.records)


def test_a_planted_fr_link_is_refused_and_the_dump_still_written(tmp_path, caplog):
    from tracing.dumps import DumpWriter

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "fr").symlink_to(elsewhere)
    writer = DumpWriter(str(traces))
    with caplog.at_level(logging.WARNING, logger="commslayer.tracing"):
        assert writer.write("rank0.json", b"{}")
        assert not writer.write("fr/commslayer_fr_rank_0", b"fr")
    assert os.listdir(elsewhere) == []
    assert any("fr is a symbolic link" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_a_planted_dump_link_or_temporary_never_reaches_the_victim(tmp_path):
    from tracing.dumps import DumpWriter

    victim = _victim(tmp_path)
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "rank0.json").symlink_to(victim)
    # The temporary name the writer used to pick: pid and thread, both known to a neighbour.
    (traces / f".tmp-{os.getpid()}-{threading.get_ident()}").symlink_to(victim)
    writer = DumpWriter(str(traces))
    assert writer.write("rank0.json", b'{"dump": 1}')
    assert victim.read_bytes() == VICTIM
    dump = traces / "rank0.json"  # the planted link is replaced by the dump itself
    assert not dump.is_symlink() and dump.read_bytes() == b'{"dump": 1}' and _mode(dump) == 0o600
    assert not [n for n in os.listdir(traces) if n.startswith(".tmp-") and not (traces / n).is_symlink()]


def test_a_planted_faults_log_link_is_refused(tmp_path, capfd):
    from faults.inject import Log

    victim = _victim(tmp_path)
    (tmp_path / "faults.jsonl").symlink_to(victim)
    Log(str(tmp_path / "faults.jsonl")).write("injected", fault=0)  # returns: the job goes on
    assert victim.read_bytes() == VICTIM
    err = capfd.readouterr().err
    assert "cannot write" in err and "faults.jsonl is a symbolic link" in err


# ------------------------------------------------------------ a real job
def _job_in_a_booby_trapped_dir(rank, size, store, trace_dir):
    import commslayer
    from tracing.record.recorder import install

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("commslayer.tracing").addHandler(handler)
    rec = install(trace_dir, signals=False)  # COMMSLAYER_TRACE_JSONL=1: the JSON lines sink too
    comm = commslayer.new_comm("gloo", name="trap", store=store, rank=rank, size=size, timeout=30)
    t = torch.ones(8)
    for _ in range(20):
        comm.all_reduce(t)
    rec.flush_sinks()
    dumped = rec.dump("test")
    comm.all_reduce(t)
    comm.finalize()
    return t[0].item(), dumped, messages


@pytest.mark.timeout(90)
def test_a_job_in_a_booby_trapped_trace_dir_goes_on(tmp_path):
    victim = _victim(tmp_path)
    stolen = tmp_path / "stolen"
    stolen.mkdir()
    traces = tmp_path / "traces"
    traces.mkdir()
    for rank in range(2):
        (traces / f"rank{rank}.jsonl").symlink_to(victim)
    (traces / "fr").symlink_to(stolen)
    results = run_ranks(_job_in_a_booby_trapped_dir, 2, str(traces), timeout=60,
                        env={"COMMSLAYER_TRACE_JSONL": "1"})
    assert victim.read_bytes() == VICTIM and os.listdir(stolen) == []
    for rank, (value, dumped, messages) in enumerate(results):
        assert value == 2.0 ** 21  # every all_reduce ran, before and after the refusals
        assert dumped == str(traces / f"rank{rank}.json") and _mode(dumped) == 0o600
        assert any(f"rank{rank}.jsonl is a symbolic link to {victim}" in m for m in messages), messages
        assert any("fr is a symbolic link" in m for m in messages), messages
