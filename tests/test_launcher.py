"""``commslayer-run`` as a user runs it: from any directory, on any script, and on bad input
a one-line error, a non-zero exit status and no process left behind.

Every launch carries a tag in its environment, which every process it starts inherits:
after the launcher exited, no live process may hold it (/proc/<pid>/environ).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path
from typing import List

import pytest

from commslayer import runs

ROOT = Path(__file__).resolve().parent.parent
# The console script where it is installed (the way users run it), else the same entry point.
LAUNCHER = [shutil.which("commslayer-run")] if shutil.which("commslayer-run") else \
    [sys.executable, "-m", "commslayer.run.launcher"]

USER_SCRIPT = '''
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("commslayer")
t = torch.ones(1) * (int(os.environ["COMMSLAYER_REPLICA"]) + 1)
dist.all_reduce(t)
line = (f"user script: replica {os.environ['COMMSLAYER_REPLICA']} rank {dist.get_rank()} sum {t.item():g} "
        f"cwd {os.getcwd()} args {sys.argv[1:]} run_dir {os.environ.get('COMMSLAYER_RUN_DIR')}\\n")
os.write(1, line.encode())  # one write: the group's ranks share the launcher's pipe
dist.destroy_process_group()
'''

# Writes its result the way launch/train.py does: the launcher's summary reads it.
RESULT_SCRIPT = '''
import os, time
from commslayer import runs

runs.save(runs.RankResult(member=0, replica=0, rank=0, restart=0, pid=os.getpid(), started=time.time(), steps=2,
                          start_step=0, elapsed_s=0.1, step_s=[0.05, 0.05], losses={0: 2.0, 1: 1.5},
                          optimizer_steps=[2], live=[0]), os.environ["COMMSLAYER_RUN_DIR"])
'''


def launch(args: List[str], cwd: Path, timeout: float = 100) -> tuple[subprocess.CompletedProcess, bytes]:
    """Run the launcher; return its result and the tag its processes carried.  Past
    ``timeout`` (inside pytest's 120 s) it gets SIGTERM, which ends all it started."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_TEST_TAG=tag)
    proc = subprocess.Popen([*LAUNCHER, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
        pytest.fail(f"the launcher ran past {timeout}s:\n{out[-3000:]}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), f"COMMSLAYER_TEST_TAG={tag}".encode()


def tagged(tag: bytes) -> List[int]:
    """Live processes whose environment holds ``tag``, after a moment for the last to be reaped."""
    deadline = time.monotonic() + 2
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_console_script_is_declared():
    with open(ROOT / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["commslayer-run"] == "commslayer.run.launcher:main"


@pytest.mark.parametrize("args,says", [
    (["--replicas", "0", "{script}"], "--replicas 0: a job needs at least 1 replica group"),
    (["--replicas", "2", "--nproc-per-replica", "0", "{script}"], "--nproc-per-replica 0: a replica group needs at least 1 rank"),
    (["--replicas", "2", "--replica-ids", "2", "{script}"], "--replica-ids 2: distinct replica ids in 0..1 (--replicas 2)"),
    (["--replicas", "2", "--replica-ids", "0,0", "{script}"], "--replica-ids 0,0: distinct replica ids"),
    (["--coordinator", "10.0.0.1", "{script}"], "--coordinator '10.0.0.1': expected HOST:PORT"),
    (["--coordinator", "10.0.0.1:29600", "--port", "29600", "{script}"], "give one or the other"),
    (["--store", "etcd://10.0.0.1:2379", "{script}"], "name the job after the endpoints (etcd://HOST:PORT,.../JOB)"),
    (["--store", "10.0.0.1:2379/job", "{script}"], "--store '10.0.0.1:2379/job' is not an etcd:// address"),
    (["--store", "etcd://10.0.0.1/job", "{script}"], "'10.0.0.1' in 'etcd://10.0.0.1/job' is not host:port"),
    (["--store", "etcd://h:1/j", "--port", "29600", "{script}"], "give one or the other"),
    (["--coordinator", "etcd://h:1/j", "--store", "etcd://h:1/j", "{script}"], "give one or the other"),
    (["--max-restarts", "-1", "{script}"], "--max-restarts -1: must be 0 or more"),
    (["missing.py", "--steps", "3"], "script 'missing.py': no such file"),
    (["."], "script '.': is a directory"),
    ([], "name the script to run"),
    (["--compare-to", "{tmp}", "--run-dir", "out", "{script}"], "no result files there"),
    # sizes no host can run: refused before anything starts (the launcher once grew to 22 GB on the first)
    (["--nproc-per-node", "1000000000", "{script}"], "a job of 1000000000 ranks: at most 65536"),
    (["--replicas", "100000", "--replica-ids", "none"], "a job of 200000 ranks: at most 65536"),
    (["--replicas", "2", "--nproc-per-replica", "1000", "{script}"],
     "2 replica group(s) of --nproc-per-replica 1000 (and a torchrun agent each): 2002 processes on this host"),
    (["--nproc-per-node", "4", "--spares", "1", "--max-local-procs", "4", "{script}"],
     "--nproc-per-node 4 and --spares 1: 5 processes on this host, more than 4: --max-local-procs"),
    (["--spares", "-1", "{script}"], "--spares -1: must be 0 or more"),
    (["--spares", "1", "--max-restarts", "0", "{script}"], "--spares 1 with --max-restarts 0: a spare becomes"),
    (["--replicas", "2", "--replica-ids", "none", "--spares", "2"], "--spares 2 with --replica-ids none: spares stand"),
    (["--replicas", "2", "--spares", "2", "--max-local-procs", "6", "{script}"],
     "(and a torchrun agent each) and --spares 2: 8 processes on this host, more than 6"),
])
def test_nonsense_is_one_line_and_exit_2(tmp_path, args, says):
    script = tmp_path / "job.py"
    script.write_text(USER_SCRIPT)
    proc, tag = launch([a.format(script=script, tmp=tmp_path) for a in args], cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("commslayer-run: error: ") and says in lines[0], proc.stderr
    assert proc.stdout == ""  # nothing started, not even the coordinator
    assert not tagged(tag)


@pytest.mark.parametrize("args", [["--help"], ["--replicas", "x", "job.py"], ["--store", "etcd://h/j", "job.py"],
                                  ["--coordinator", "h", "job.py"], ["--compare-to", "nowhere", "job.py"]])
def test_help_and_usage_errors_answer_without_importing_torch(args):
    """``--help`` and every usage error come before torch is imported (seconds on a loaded
    machine): the launcher's arguments are checked by torch-free modules only."""
    probe = ("import sys\nfrom commslayer.run.launcher import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == f"exit {0 if args == ['--help'] else 2} False", (proc.stdout, proc.stderr)


def test_a_script_that_fails_at_start_up(tmp_path):
    """Every rank exits 1 at once, in every life torchrun gives it: each replica group gives up,
    the launcher says so in one line and exits 1, nothing is left."""
    (tmp_path / "fails.py").write_text("import sys\nsys.exit(1)\n")
    proc, tag = launch(["--replicas", "2", "--nproc-per-replica", "2", "--max-restarts", "1", "fails.py"],
                       cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("commslayer-run: replica group(s) [0, 1] gave up"), proc.stderr
    assert "coordinator: replica group 0 gave up (torchrun exit 1)" in proc.stdout, proc.stdout[-3000:]
    assert not tagged(tag)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [["--nproc-per-node", "2"], ["--replicas", "2", "--nproc-per-replica", "1"]])
def test_a_script_that_exits_0_at_once_is_not_a_silent_success(tmp_path, mode):
    """A script that exits 0 before it trains (an early ``sys.exit(0)``, a ``__main__`` guard
    that never calls ``main()``): the launcher exited 0 without a word. It still exits 0 (it runs
    any script), and says that no rank reached ``job.finish()``."""
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    proc, tag = launch([*mode, "quits.py"], cwd=tmp_path, timeout=60)
    log = proc.stdout[-3000:] + proc.stderr
    assert proc.returncode == 0 and "coordinator: no rank called job.finish()" in proc.stdout, log
    assert not tagged(tag)


def test_a_user_script_from_any_directory(tmp_path):
    """A script outside the repository, named relative to a directory outside it: the workers
    run there, get exactly the script's arguments (no --run-dir added: it comes in
    COMMSLAYER_RUN_DIR) and reach each other through commslayer."""
    work = tmp_path / "elsewhere"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "job.py").write_text(USER_SCRIPT)
    proc, tag = launch(["--replicas", "2", "--nproc-per-replica", "2", "--run-dir", "out",
                        "scripts/job.py", "--lr", "0.1", "data"], cwd=work)
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 0, log
    said = sorted(line.split("user script: ", 1)[1] for line in proc.stdout.splitlines() if "user script: " in line)
    expect = sorted(f"replica {r} rank {k} sum {2 * (r + 1)} cwd {work} args ['--lr', '0.1', 'data'] "
                    f"run_dir {work / 'out'}" for r in (0, 1) for k in (0, 1))
    assert said == expect, log
    assert "summary: no result files in" in proc.stdout, log  # a script that writes none is not a failure
    assert not tagged(tag)


def test_one_replica_group_and_the_results_contract(tmp_path):
    """``--replicas 1`` with no coordinator flag; a script that writes its result through
    ``commslayer.runs``: the launcher's summary reads it, and so does any reader."""
    (tmp_path / "result.py").write_text(RESULT_SCRIPT)
    proc, tag = launch(["--replicas", "1", "--nproc-per-replica", "1", "--run-dir", "out", "--", "result.py"],
                       cwd=tmp_path)
    log = proc.stdout[-4000:] + proc.stderr
    assert proc.returncode == 0, log
    assert "summary: 1 rank(s) finished, every one at step 2: True" in proc.stdout, log
    # it wrote its result without commslayer.resilience: said, and not said to have written none
    assert "coordinator: no rank called job.finish()" in proc.stdout and "no result written" not in proc.stdout, log
    [result] = runs.load_results(str(tmp_path / "out"))
    assert result.losses == {0: 2.0, 1: 1.5} and result.end_step == 2
    summary = runs.load_summary(str(tmp_path / "out"))
    assert summary is not None and summary.ok and summary.losses == {0: 2.0, 1: 1.5}
    assert not tagged(tag)


SLEEPER = """
import os, sys, time
os.write(1, f"up {os.getpid()}\\n".encode())
time.sleep(120)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--nproc-per-node", "2"], ["--replicas", "1", "--nproc-per-replica", "2"]])
def test_what_a_sigkilled_launcher_started_dies_with_it(tmp_path, mode):
    """SIGKILL leaves the launcher no chance to end anything: its ranks (per-rank mode) and its
    torchrun agents (replica mode, which end their workers) get SIGTERM from the kernel."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_TEST_TAG=tag)
    proc = subprocess.Popen([*LAUNCHER, *mode, "sleeper.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    up = []
    for line in proc.stdout:
        if " up " in line or line.startswith("up "):
            up.append(int(line.split("up ")[1]))
        if len(up) == 2:
            break
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while tagged(f"COMMSLAYER_TEST_TAG={tag}".encode()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged(f"COMMSLAYER_TEST_TAG={tag}".encode())
    for pid in left:
        os.kill(pid, 9)
    assert len(up) == 2 and not left, (up, left)


WORKER_ON_SIGTERM = '''
import signal, sys, time
def ended(*_):
    raise RuntimeError("the worker's own error on SIGTERM")
signal.signal(signal.SIGTERM, ended)
print("worker ready", flush=True)
time.sleep(60)
'''


@pytest.mark.timeout(60)
def test_stopping_a_torchrun_agent_folds_its_own_traceback_and_keeps_the_workers(tmp_path):
    """A stopped job's output used to end in two 40-line tracebacks of torchrun's frames
    per replica group (its answer to the launcher's SIGTERM), burying the line that says
    why the job stopped. That traceback is one line now; a worker's own is kept whole."""
    from commslayer.run.processes import ProcessSet

    script = tmp_path / "worker.py"
    script.write_text(WORKER_ON_SIGTERM)
    procs, lines = ProcessSet(grace_s=10.0), []
    procs.start("agent", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "0",
                          str(script)], dict(os.environ, OMP_NUM_THREADS="1"), lines.append)
    deadline = time.monotonic() + 30
    while not any("worker ready" in x for x in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("worker ready" in x for x in lines), "".join(lines)
    procs.stop()
    out = "".join(lines)
    assert "SignalException" not in out and not any('File "' in x and "torch/distributed" in x for x in lines), out
    [folded] = [x for x in lines if x.startswith("(torchrun's traceback of signal 15, sent to stop it:")]
    assert int(folded.split("stop it: ")[1].split()[0]) > 10, folded
    worker = out.index("Traceback (most recent call last):")
    assert "RuntimeError: the worker's own error on SIGTERM" in out[worker:], out


@pytest.mark.timeout(120)
def test_compare_to_its_own_run_dir_compares_with_the_run_it_held(tmp_path):
    """``--run-dir out --compare-to out``: the run ``out`` held is set aside into
    ``out/earlier/1`` before this one starts, and the comparison is with it there. (It read
    ``out`` after this run had written it: the run compared with itself and always passed.)"""
    (tmp_path / "result.py").write_text(RESULT_SCRIPT.replace("{0: 2.0,", "{0: float(__import__('sys').argv[1]),"))
    first, _ = launch(["--replicas", "1", "--nproc-per-replica", "1", "--run-dir", "out", "result.py", "2.0"],
                      cwd=tmp_path, timeout=50)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    proc, tag = launch(["--replicas", "1", "--nproc-per-replica", "1", "--run-dir", "out", "--compare-to", "out",
                        "result.py", "9.0"], cwd=tmp_path, timeout=50)
    log = proc.stdout[-3000:] + proc.stderr
    assert proc.returncode == 1, log
    assert f"they are in {tmp_path / 'out' / 'earlier' / '1'} now; --compare-to compares this run with them" \
        in proc.stdout, log
    assert f"loss vs the fault-free run {tmp_path / 'out' / 'earlier' / '1'}: steps before the fault identical: " \
        "False" in proc.stdout, log
    assert proc.stderr.splitlines() == [f"commslayer-run: the run's summary found a problem (the 'summary:' lines "
                                        f"above, {tmp_path / 'out'}/summary.json)"], log
    assert not tagged(tag)


@pytest.mark.timeout(60)
def test_a_run_dir_it_cannot_write(tmp_path):
    """A ``--run-dir`` on a read-only filesystem (or another user's folder), and one whose
    earlier run cannot be set aside (a file named ``earlier`` there): one line and exit 2
    before anything starts. (The first started the job, whose ranks failed to write, and
    ended in a traceback from writing the summary; the second in a traceback from moving
    the earlier run aside.)"""
    (tmp_path / "result.py").write_text(RESULT_SCRIPT)
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes into any folder: a read-only mount
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(locked)]).returncode != 0:
            pytest.skip("no read-only mount here")
    else:
        locked.chmod(0o555)
    try:
        proc, tag = launch(["--replicas", "1", "--nproc-per-replica", "1", "--run-dir", "locked", "result.py"],
                           cwd=tmp_path, timeout=40)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(locked)])
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.splitlines() == [f"commslayer-run: error: --run-dir '{locked}': cannot write there: "
                                        f"{'Read-only file system' if os.geteuid() == 0 else 'Permission denied'}"]
    assert not tagged(tag)

    held = tmp_path / "held"
    held.mkdir()
    (held / "result-m0-r0.json").write_text("{}")
    (held / "earlier").write_text("not a folder")
    proc, tag = launch(["--replicas", "1", "--nproc-per-replica", "1", "--run-dir", "held", "result.py"],
                       cwd=tmp_path, timeout=40)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.splitlines() == [f"commslayer-run: error: --run-dir '{held}' holds an earlier run's files, "
                                        f"which cannot be moved aside: Not a directory: {held / 'earlier' / '1'}"]
    assert (held / "result-m0-r0.json").exists() and not tagged(tag)


# 2 MB of output, after a line that is not UTF-8 (a Latin-1 name): more than any pipe holds
CHATTY_SCRIPT = '''
import os
os.write(2, b"caf\\xe9 \\xff\\n")
for i in range(20000):
    os.write(1, b"%d %s\\n" % (i, b"x" * 100))
os.write(1, b"chatty: done\\n")
'''


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", [["--nproc-per-node", "1"], ["--replicas", "1", "--nproc-per-replica", "1"]])
def test_output_that_is_not_utf8_or_that_nobody_reads(tmp_path, mode):
    """A script that writes a byte that is not UTF-8, and a launcher whose own output is
    closed early (``commslayer-run ... | head``): the job runs to its end. (The reader thread
    of that process's output died, of a UnicodeDecodeError or of the BrokenPipeError of its
    write, the process blocked on its full pipe, and the job hung until it was killed.)"""
    (tmp_path / "chatty.py").write_text(CHATTY_SCRIPT)
    proc, tag = launch([*mode, "--max-restarts", "0", "chatty.py"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "caf\ufffd \ufffd\n" in proc.stdout and "] chatty: done\n" in proc.stdout, proc.stdout[-3000:]
    assert not tagged(tag)

    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_TEST_TAG=tag)
    head = subprocess.Popen([*LAUNCHER, *mode, "--max-restarts", "0", "chatty.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert head.stdout is not None and head.stdout.readline().startswith("coordinator: ")
    head.stdout.close()  # the reader is gone
    try:
        err = head.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        head.terminate()
        pytest.fail(f"the job hung once its launcher's output was closed: {head.communicate(timeout=15)[1]}")
    assert head.returncode == 0 and err.splitlines() == [
        "commslayer-run: its standard output was closed (broken pipe): the job goes on, and the output of its "
        "processes is dropped from here on"], err
    assert not tagged(f"COMMSLAYER_TEST_TAG={tag}".encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,value", [("COMMSLAYER_SPARE", "0"), ("COMMSLAYER_RESTART_UNIT", "rank"),
                                        ("COMMSLAYER_JOB_RANK", "0")])
@pytest.mark.parametrize("mode", [["--nproc-per-node", "1"], ["--replicas", "1", "--nproc-per-replica", "1"]])
def test_a_variable_of_the_launchers_own_left_in_the_environment(tmp_path, monkeypatch, mode, name, value):
    """``COMMSLAYER_SPARE``, ``COMMSLAYER_RESTART_UNIT`` or ``COMMSLAYER_JOB_RANK`` left in the
    caller's environment (copied from a rank's): one line and exit 2 before anything starts. (Every rank inherited
    it: with the first each waited as a warm spare for a rank nobody gave it, with the
    second replica mode's ranks started as per-rank mode's: either way the job hung; with
    the third every replica group's rank 0 was job rank 0, writing one trace file.)"""
    (tmp_path / "job.py").write_text("from commslayer import resilience\nresilience.init().finish()\n")
    monkeypatch.setenv(name, value)
    proc, tag = launch([*mode, "job.py"], cwd=tmp_path, timeout=30)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"commslayer-run: error: {name}='{value}' is in the environment: commslayer-run sets it itself") \
        and lines[0].endswith("unset it"), proc.stderr
    assert not tagged(tag)


@pytest.mark.timeout(90)
def test_two_jobs_in_one_run_dir_at_once(tmp_path):
    """A second job started with the ``--run-dir`` of one that runs: one line and exit 2, and
    the first runs on undisturbed. (Both ran: the first's summary counted the second's rank,
    2 rank(s) finished for a job of 1, and its summary.json overwrote the second's.)"""
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\n")
    tag = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR="", COMMSLAYER_TEST_TAG=tag)
    first = subprocess.Popen([*LAUNCHER, "--nproc-per-node", "1", "--run-dir", "out", "slow.py"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().startswith("coordinator: ")
        proc, second = launch(["--nproc-per-node", "1", "--run-dir", "out", "slow.py"], cwd=tmp_path, timeout=40)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
        assert proc.stderr.splitlines() == [f"commslayer-run: error: --run-dir '{tmp_path / 'out'}': another "
                                            "commslayer-run runs a job there now (the two runs' results, traces and "
                                            "summaries would mix): give another --run-dir, or wait until that job "
                                            "ends"], proc.stderr
        assert first.poll() is None and not tagged(second)
    finally:
        first.terminate()
        first.communicate(timeout=30)
    assert first.returncode == 130 and not tagged(f"COMMSLAYER_TEST_TAG={tag}".encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "-5"])
def test_a_store_deadline_that_is_not_a_number_of_seconds(tmp_path, monkeypatch, value):
    """``COMMSLAYER_STORE_TIMEOUT_S``, which bounds the launcher's own calls to the job's store,
    set to text or a negative number: one line naming it and exit 2 before anything starts.
    (A launcher joining a job with ``--coordinator`` read it after it had connected, and ended
    in a traceback from commslayer.config, exit 1.)"""
    (tmp_path / "job.py").write_text(USER_SCRIPT)
    monkeypatch.setenv("COMMSLAYER_STORE_TIMEOUT_S", value)
    proc, tag = launch(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--coordinator",
                        "127.0.0.1:1", "job.py"], cwd=tmp_path, timeout=40)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-3000:] + proc.stderr
    assert proc.stderr.splitlines() == [f"commslayer-run: error: COMMSLAYER_STORE_TIMEOUT_S='{value}' is not "
                                        "allowed: a positive number of seconds below 10 years"], proc.stderr
    assert not tagged(tag)
