"""The viewer on a real job that recovered: ``commslayer-run`` (two torchruns of two ranks)
runs the DDP example, rank 2 is SIGKILLed at step 20, the survivors shrink and go on, and
the restarted replica group heals and rejoins.  While it runs, ``commslayer-trace watch``
follows its trace directory in a real terminal (tmux: capture-pane, send-keys C-c); then
``diagnose``, ``export`` and ``view`` (in headless Chromium) must tell that story.

``COMMSLAYER_DOCS_SHOT=docs/viewer-recovery.png`` makes the Chromium test keep its
screenshot there (the picture in docs/viewer.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.harness import job_story
from tests.test_viewer import CHROMIUM, _chromium
from tests.viewer_traces import run_cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "launch" / "examples" / "ddp_resilient.py"
STEPS, FAULT_STEP, KILLED = 1000, 20, 2  # member 2: replica group 1's first rank
TMUX = shutil.which("tmux")


def _tmux(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=20)


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> Dict[str, Any]:
    """Run the job (watched under tmux when tmux is there); its trace directory and
    what the watching terminal showed: the pane at each look, and after Ctrl-C."""
    run_dir = tmp_path_factory.mktemp("recovered")
    traces = run_dir / "traces"
    traces.mkdir()
    socket = f"commslayer-test-{os.getpid()}"
    panes: List[str] = []
    if TMUX:
        watch = (f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m tracing.read.cli watch {traces} --interval 0.5; "
                 f"echo watch-exit=$?; sleep 60")
        assert _tmux(socket, "new-session", "-d", "-s", "w", "-x", "200", "-y", "60", watch).returncode == 0
    fault = [{"action": "sigkill", "rank": KILLED, "step": FAULT_STEP, "phase": "allreduce", "life": None}]
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSLAYER_TRACE_DIR=str(traces), COMMSLAYER_TRACE_JSONL="1",
               COMMSLAYER_FAULTS=json.dumps(fault))
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", "2", "--nproc-per-replica", "2",
           "--max-restarts", "2", "--run-dir", str(run_dir), str(EXAMPLE), "--steps", str(STEPS)]
    job = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while job.poll() is None:
            time.sleep(0.5)
            if TMUX:
                panes.append(_tmux(socket, "capture-pane", "-p", "-t", "w").stdout)
        log = job.stdout.read()
        assert job.returncode == 0, job_story(log)
        stopped = ""
        if TMUX:
            time.sleep(1.5)  # a last look after the job ended
            panes.append(_tmux(socket, "capture-pane", "-p", "-t", "w").stdout)
            _tmux(socket, "send-keys", "-t", "w", "C-c")
            for _ in range(40):
                time.sleep(0.25)
                stopped = _tmux(socket, "capture-pane", "-p", "-t", "w").stdout
                if "watch-exit=" in stopped:
                    break
        yield {"traces": str(traces), "log": log, "panes": panes, "stopped": stopped}
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if TMUX:
            _tmux(socket, "kill-server")


@pytest.mark.timeout(300)
def test_diagnose_tells_the_story_of_the_recovery(recovered):
    rc, out, err = run_cli("diagnose", recovered["traces"])
    assert rc == 0, out + err  # recovered and finished: not a failure
    head = out.splitlines()[0]
    # generation 1, or 2 when the survivors decided once without rank 2 and again without rank 3
    # (its torchrun ended it a moment later): one recovery either way
    assert re.match(rf"The job lost ranks 2, 3 \(replica group 1\) at step {FAULT_STEP} and recovered in "
                    r"\d+\.\d{3} s \(generation [12]: ranks 0, 1\)", head), head
    assert re.search(r"rank 2 rejoined at step \d+ after a restart \(heal \d+\.\d{3} s, ", head), head
    for noise in ("GLHF", ".cc:", "Likely culprit", str(ROOT)):
        assert noise not in out, (noise, out)
    d = json.loads(run_cli("diagnose", "--json", recovered["traces"])[1])
    [loss] = d["recovery"]["losses"]
    assert loss["step"] == FAULT_STEP and KILLED in loss["lost"] and loss["members_after"] == [0, 1]
    assert {det["rank"] for det in loss["detections"]} >= {0, 1} and loss["resume_s"] > 0
    [adm] = d["recovery"]["admissions"]
    assert adm["joined"] == [2, 3] and adm["step"] > FAULT_STEP
    heals = sorted((h["rank"], h["source"], h["source_replica"], h["restarted"]) for h in adm["heals"])
    assert heals == [(2, 0, 0, True), (3, 1, 0, True)]  # each from its shard's rank of replica group 0
    assert all(h["bytes"] > 0 and h["seconds"] > 0 for h in adm["heals"])
    lives = {r["rank"]: r["lives"] for r in d["ranks"]}
    assert lives == {0: 1, 1: 1, 2: 2, 3: 2}  # the restarted ranks' lives are one row each
    sites = {r["call_site"] for r in d["ranks"]}
    assert all(s.startswith("launch/examples/ddp_resilient.py:") for s in sites), sites
    assert all(r["reason"].count("(+") <= 1 and len(r["reason"]) < 300 for r in d["ranks"])


@pytest.mark.timeout(300)
def test_perfetto_export_has_the_recovery_markers(recovered, tmp_path):
    out = tmp_path / "t.json"
    rc, text, err = run_cli("export", "--perfetto", str(out), recovered["traces"])
    assert rc == 0, err
    events = json.loads(out.read_text())["traceEvents"]
    marks = [e["cat"] for e in events if e["ph"] == "i" and e.get("s") == "g"]
    assert marks[:3] == ["recovery.loss", "recovery.decision", "recovery.resume"] and "recovery.admit" in marks
    assert {e["name"] for e in events if e["ph"] == "i" and e.get("s") == "p"} >= {"peer_lost", "generation", "healed"}


@pytest.mark.timeout(300)
def test_exposed_time_per_rank_and_step(recovered):
    """The DDP example runs through c10d (async ops and their waits): exposed time is
    there, and per step for every rank (the records carry their step)."""
    whole = json.loads(run_cli("overlap", "--json", recovered["traces"])[1])["ranks"]
    assert [r["rank"] for r in whole] == [0, 1, 2, 3] and all(r["exposed_comm_s"] > 0 for r in whole), whole
    rows = json.loads(run_cli("overlap", "--by-step", "--json", recovered["traces"])[1])["ranks"]
    steps = {r["rank"]: {row["step"] for row in rows if row["rank"] == r["rank"]} for r in whole}
    assert set(range(STEPS)) <= steps[0]
    [adm] = json.loads(run_cli("diagnose", "--json", recovered["traces"])[1])["recovery"]["admissions"]
    dead = set(range(FAULT_STEP + 1, adm["step"]))  # rank 2 died in step 20 and came back at the admission's
    assert steps[2] and not steps[2] & dead, sorted(steps[2])
    for r in whole:
        mine = [row for row in rows if row["rank"] == r["rank"]]
        assert 0 < sum(row["exposed_comm_s"] for row in mine) and all(
            row["exposed_comm_s"] <= row["comm_s"] + 0.01 for row in mine)


@pytest.mark.timeout(300)
@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_watch_followed_the_running_job_and_quit_on_ctrl_c(recovered):
    panes = recovered["panes"]
    assert len(panes) >= 4
    live = [p for p in panes if re.search(r"^\s+0\s+1\s+\S+ #\d+ of '", p, re.M)]
    assert live, panes[-1]  # rank rows with their current op, while the job ran
    failed = next(i for i, p in enumerate(panes) if "first failure: none so far" not in p and "first failure:" in p)
    assert failed < len(panes) - 1, "the failure showed only after the job ended"
    assert re.search(r"first failure: \d\d:\d\d:\d\d\.\d{3} rank \d", panes[failed]), panes[failed]
    assert re.search(r"'replicas' \(replicas\.0\): generation [23], members 0, 1, 2, 3", panes[-1]), panes[-1]
    assert re.search(r"slowest of the last collectives: rank \d, last to arrive in \d+ of 20", panes[-1])
    assert "watch stopped" in recovered["stopped"] and "watch-exit=0" in recovered["stopped"]
    assert "Traceback" not in recovered["stopped"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/run.sh installs it)")
def test_page_draws_the_recovery_table_and_markers(recovered, tmp_path):
    page = tmp_path / "view.html"
    rc, _, err = run_cli("view", recovered["traces"], "-o", str(page), "--title", "a job that recovered")
    assert rc == 0, err
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert '<div id="errors"></div>' in html  # no script error
    assert "<h3>per step (the last 200 of " in html
    table = html.split('<table id="recovery">')[1].split("</table>")[0]
    kinds = re.findall(r"<tr><td>(\w[\w ]*)</td>", table)
    assert kinds[0] == "loss" and {"detection", "decision", "resume", "admission", "heal"} <= set(kinds), kinds
    n = int(re.search(r'data-markers="(\d+)"', html).group(1))
    assert n >= 4 and html.count('<li class="marker ') == n
    assert '<li class="marker loss"' in html and '<li class="marker admit"' in html
    shot = tmp_path / "view.png"
    run = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,1500", page.as_uri())
    assert run.returncode == 0, run.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1400
    keep = os.environ.get("COMMSLAYER_DOCS_SHOT")
    if keep:
        shutil.copyfile(shot, keep)
