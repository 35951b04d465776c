"""What resilience costs a training job and what it saves: launch/train.py on
commslayer next to the same job on plain Gloo, and next to the usual
alternative, a torchrun restart that reloads a checkpoint, measured side by
side in one run.

    python launch/bench/bench_training.py --repeats 3 --json docs/data/training.json

``--smoke`` runs every configuration but the A/A once on a tiny model for a
few steps (the fault in one phase only), to check that the benchmark still works.

The job is launch/train.py's decoder-only LM at its default size (dim 128,
4 layers, seq 128, batch 8 per rank), 2 replica groups of 2 FSDP2 ranks
(4 ranks), ``--steps`` steps.  Configurations:

* ``ours``: ``commslayer-run`` running train.py on commslayer (the
  ``"commslayer"`` backend inside each replica group, the resilient
  replicate dimension across them, tracing on: the launcher's default,
  ``COMMSLAYER_TRACE_DIR=<run dir>/traces``), no fault;
* ``ours, untraced``: the same with ``COMMSLAYER_TRACE_DIR=""`` in the launcher's
  environment (tracing off), so that the resilience's cost and tracing's
  cost can be told apart;
* ``plain Gloo`` and ``plain Gloo (A/A)``: the same launcher and job with
  ``--plain`` (plain Gloo groups, no resilience), twice: the second run
  calibrates what two identical configurations differ by here;
* ``ours, SIGKILL in PHASE`` (``--phases``): ``--kill 1:F:PHASE``, rank 0 of
  replica group 1 SIGKILLs itself at step F (``--fault-step``);
* ``torchrun + DCP``: the usual alternative, written below (``_DCP_JOB``):
  one ``torchrun --max-restarts 1`` of all 4 ranks, FSDP2 HSDP on a 2x2
  DeviceMesh ("replicate", "shard") over plain Gloo, the same model, data
  and AdamW, a ``torch.distributed.checkpoint`` of model and optimizer
  every ``--ckpt-every`` steps; global rank 2 (replica 1, rank 0) SIGKILLs
  itself at the start of step F, torchrun restarts all 4 ranks, they load
  the latest checkpoint and redo the steps since it.

Every repeat runs each configuration once, the order rotated from repeat
to repeat so drift hits them alike.  Figures:

* fault-free step time: for each step from ``--warmup`` on, the slowest
  rank's step time (train.py's ``step_s``: data, forward, backward, the
  averages, the optimizer); a run's figure is the median over those steps,
  its steps/s the inverse.  Overhead: the ratio of a repeat's step time
  to plain Gloo's in the same repeat, minus 1 (and the same for the A/A);
  tracing's cost: ours' step time over ours, untraced's in the same repeat,
  minus 1;
* survivor stall (ours, traced: the launcher's default): from the kill (the wall
  time the victim noted just before SIGKILL) to the commit of the step it
  hit, as world rank 0 of the survivors recorded the recovery (the launcher's
  ``summary.json``); also the loss detected to that commit, and how much
  longer the faulted step took on the survivor that saw the whole run than
  its median step before the fault: the work lost, as opposed to the rest
  of the step that the survivors do anyway;
* restart (torchrun + DCP): from the kill to the first step committed by the
  restarted job; to the job being back where it was (step F-1 committed
  again); and to step F committed, the same end point as ours' stall.  The
  restarted rank 0's own milestones (process started, torch and the model
  imported, model built, checkpoint loaded) and the time of one checkpoint
  save are reported too.

Times are wall clock (``time.time``) on one host.  Progress goes to stderr,
the Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # launch.bench

from commslayer.run.processes import free_port  # noqa: E402
from commslayer.runs import load_results, load_summary, longest  # noqa: E402
from launch.bench.measure import fail, launcher_env, measured_revision, median_range, ratio_cells, save_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

REPLICAS, RANKS = 2, 2
VICTIM_REPLICA = 1  # rank 0 of this replica group dies (global rank 2 in the DCP job)
MODEL = {"batch": 8, "seq": 128, "dim": 128, "layers": 4, "heads": 4, "vocab": 256, "lr": 3e-3, "seed": 0}
SMOKE = {"repeats": 1, "steps": 6, "warmup": 1, "fault_step": 3, "ckpt_every": 2, "phases": ["allreduce"],
         "model": dict(MODEL, batch=4, seq=32, dim=32, layers=2, vocab=64)}

# The baseline job: run by torchrun (argv[1]: its settings as JSON); launch/ and the repository are on PYTHONPATH.
_DCP_JOB = r'''
import os, time
T_START = time.time()
import json, signal, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from train import TinyLM, batch
T_IMPORTED = time.time()
import io
import torch.distributed.distributed_c10d as c10d


def _tensor_to_object(tensor, tensor_size, group):
    """c10d's own without NumPy: torch 2.13 reads the gathered bytes with tensor.numpy(), which
    fails where NumPy is not installed (commslayer does not need it); DCP's planning gathers objects."""
    return c10d._unpickler(io.BytesIO(bytes(tensor.cpu().tolist())[:tensor_size])).load()


c10d._tensor_to_object = _tensor_to_object

cfg = json.loads(sys.argv[1])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
timeout = timedelta(seconds=60)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout,
                      use_libuv=True)
# A per-restart prefix: a restarted job must not read the addresses the killed one left in torchrun's store.
dist.init_process_group("gloo", store=dist.PrefixStore(f"restart{restart}/", store), rank=rank, world_size=size,
                        timeout=timeout)
shards = size // cfg["replicas"]
mesh = (init_device_mesh("cpu", (size,)) if cfg["replicas"] == 1 else  # plain FSDP2 over every rank
        init_device_mesh("cpu", (cfg["replicas"], shards), mesh_dim_names=("replicate", "shard")))
torch.manual_seed(cfg["seed"])
model = TinyLM(cfg["vocab"], cfg["dim"], cfg["layers"], cfg["heads"], cfg["seq"])
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
T_BUILT = time.time()

ckpt = os.path.join(cfg["out"], "ckpt")
log = open(os.path.join(cfg["out"], "rank0.jsonl"), "a") if rank == 0 else None


def record(**fields):
    if log is not None:
        log.write(json.dumps(dict(restart=restart, **fields)) + "\n")
        log.flush()


start = 0
if os.path.exists(os.path.join(ckpt, "latest")):
    with open(os.path.join(ckpt, "latest")) as f:
        start = int(f.read())
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(ckpt, f"step{start}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
record(event="start", start_step=start, started=T_START, imported=T_IMPORTED, built=T_BUILT, loaded=time.time())

replica, shard = rank // shards, rank % shards
for step in range(start, cfg["steps"]):
    t0 = time.perf_counter()
    if restart == 0 and step == cfg["fault_step"] and rank == cfg["victim"]:
        with open(os.path.join(cfg["out"], "kill"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    data = batch(step, replica, shard, cfg["batch"], cfg["seq"], cfg["vocab"])
    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    record(event="step", step=step, t=time.time(), step_s=time.perf_counter() - t0, loss=loss.item())
    if (step + 1) % cfg["ckpt_every"] == 0:
        t1 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(ckpt, f"step{step + 1}"))
        dist.barrier()
        if rank == 0:  # the checkpoint is whole: point at it
            with open(os.path.join(ckpt, "latest.tmp"), "w") as f:
                f.write(str(step + 1))
            os.replace(os.path.join(ckpt, "latest.tmp"), os.path.join(ckpt, "latest"))
        record(event="save", step=step + 1, s=time.perf_counter() - t1)
dist.barrier()
os._exit(0)  # torch 2.13's Gloo can abort at interpreter exit (docs/api.md, Known limits)
'''


def _log(msg: str) -> None:
    print(f"[bench_training] {msg}", file=sys.stderr, flush=True)


def _train_args(args: argparse.Namespace) -> List[str]:
    out = ["--steps", str(args.steps)]
    for k, v in args.model.items():
        out += [f"--{k}", str(v)]
    return out


def _launch(run_dir: str, train_args: List[str], log_path: str, trace: bool = True) -> int:
    cmd = [sys.executable, "-m", "commslayer.run.launcher", "--replicas", str(REPLICAS), "--nproc-per-replica",
           str(RANKS), "--run-dir", run_dir, str(ROOT / "launch" / "train.py"), *train_args]
    with open(log_path, "w") as log:
        return subprocess.run(cmd, cwd=ROOT, env=launcher_env(trace), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=600).returncode


def fault_free(plain: bool, args: argparse.Namespace, work: str, name: str, trace: bool = True) -> dict:
    """One fault-free run through the launcher: the slowest rank's step time per step, its median from --warmup on."""
    run_dir, log_path = os.path.join(work, name), os.path.join(work, name + ".log")
    rc = _launch(run_dir, _train_args(args) + (["--plain"] if plain else []), log_path, trace)
    results = [r for r in load_results(run_dir) if r.restart == 0]
    if rc != 0 or len(results) != REPLICAS * RANKS or any(len(r.step_s) != args.steps for r in results):
        fail(f"{name}: launcher exit status {rc}, {len(results)} ranks' results", log_path)
    traced = os.path.isdir(os.path.join(run_dir, "traces"))
    if not plain and traced != trace:
        fail(f"{name}: traces {'written' if traced else 'not written'} with tracing {'on' if trace else 'off'}",
              log_path)
    slowest = [max(r.step_s[s] for r in results) for s in range(args.warmup, args.steps)]
    step = statistics.median(slowest)
    return {"step_s": step, "steps_per_s": 1 / step, "slowest_rank_step_s": slowest, "traces_written": traced}


def survivor_stall(phase: str, args: argparse.Namespace, work: str, name: str) -> dict:
    """One run of ours with a replica group SIGKILLed at --fault-step in ``phase``."""
    run_dir, log_path = os.path.join(work, name), os.path.join(work, name + ".log")
    kill = f"{VICTIM_REPLICA}:{args.fault_step}:{phase}"
    rc = _launch(run_dir, _train_args(args) + ["--kill", kill], log_path)
    summary = load_summary(run_dir)
    if summary is None:
        fail(f"{name}: launcher exit status {rc}, no summary", log_path)
    with open(log_path) as f:  # what train.py prints when a rank gives up
        leaving = [line.strip() for line in f if "leaving (" in line]
    killed = summary.killed
    if len(killed) != 1 or killed[0]["step"] != args.fault_step:
        fail(f"{name}: faults fired {killed}, expected one at step {args.fault_step}", log_path)
    t = killed[0]["t"]
    # As the launcher's summary: the recovery that names the victim's group, after the kill.
    rec = next((x for x in summary.recoveries if VICTIM_REPLICA in x.lost_replicas and x.committed_at
                and x.detected_at >= t), None)
    if rec is None or rec.step != args.fault_step:
        fail(f"{name}: no recovery committed step {args.fault_step}: {summary.recoveries}", log_path)
    leader = longest(load_results(run_dir))  # a survivor that saw the whole run
    before = statistics.median(leader.step_s[args.warmup:args.fault_step])
    return {"stall_s": rec.committed_at - t, "detected_to_committed_s": rec.committed_at - rec.detected_at,
            "killed_to_detected_s": rec.detected_at - t,
            "faulted_step_extra_s": leader.step_s[args.fault_step] - before, "median_step_before_s": before,
            "admissions": [asdict(a) for a in leader.admissions], "job_ok": rc == 0 and summary.ok, "run_py_exit": rc,
            "ranks_that_gave_up": leaving, "log": log_path}


def dcp_restart(args: argparse.Namespace, work: str, name: str, replicas: int = REPLICAS) -> dict:
    """One run of the torchrun + DCP baseline: the kill, the restart, the replay (``replicas``
    1: FSDP2 over all 4 ranks, no replica groups; launch/bench/bench_peer.py's baseline)."""
    out, log_path = os.path.join(work, name), os.path.join(work, name + ".log")
    os.makedirs(os.path.join(out, "ckpt"))
    job = os.path.join(work, "dcp_job.py")
    with open(job, "w") as f:
        f.write(_DCP_JOB)
    cfg = dict(args.model, replicas=replicas, steps=args.steps, fault_step=args.fault_step,
               ckpt_every=args.ckpt_every, victim=VICTIM_REPLICA * RANKS, out=out)
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch"), str(ROOT)] + env.get("PYTHONPATH", "").split(os.pathsep))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(REPLICAS * RANKS),
           "--max-restarts", "1", "--monitor-interval", "0.1", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), job, json.dumps(cfg)]
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            timeout=600).returncode
    if rc != 0 or not os.path.exists(os.path.join(out, "kill")):
        fail(f"{name}: torchrun exit status {rc}", log_path)
    with open(os.path.join(out, "kill")) as f:
        killed = float(f.read())
    with open(os.path.join(out, "rank0.jsonl")) as f:
        events = [json.loads(line) for line in f]
    steps = {r: {e["step"]: e for e in events if e["event"] == "step" and e["restart"] == r} for r in (0, 1)}
    start = next(e for e in events if e["event"] == "start" and e["restart"] == 1)
    resumed = start["start_step"]
    if resumed != args.fault_step // args.ckpt_every * args.ckpt_every or max(steps[1]) != args.steps - 1:
        fail(f"{name}: restarted at step {resumed}, last step {max(steps[1])}", log_path)
    f_step = args.fault_step
    return {
        "first_commit_s": steps[1][resumed]["t"] - killed,
        "back_where_it_was_s": (steps[1][f_step - 1]["t"] if f_step > resumed else start["loaded"]) - killed,
        "fault_step_committed_s": steps[1][f_step]["t"] - killed,
        "resumed_at_step": resumed,
        "steps_redone": f_step - resumed,
        "process_started_s": start["started"] - killed,
        "imported_s": start["imported"] - killed,
        "built_s": start["built"] - killed,
        "checkpoint_loaded_s": start["loaded"] - killed,
        "save_s": [e["s"] for e in events if e["event"] == "save" and e["restart"] == 0],
        "median_step_before_s": statistics.median(steps[0][s]["step_s"] for s in range(args.warmup, f_step)),
        "replayed_losses_identical": all(steps[1][s]["loss"] == steps[0][s]["loss"] for s in range(resumed, f_step)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time figures")
    p.add_argument("--fault-step", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=5, help="the DCP baseline saves a checkpoint every N steps")
    p.add_argument("--phases", nargs="+", default=["allreduce", "forward"],
                   choices=["forward", "backward", "allreduce", "optimizer"], help="where ours' victim dies")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works: every configuration "
                   "but the A/A once, a tiny model, 6 steps, the fault at step 3 (in allreduce only); explicit "
                   "options still apply")
    p.set_defaults(model=MODEL)
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args()
    if not args.warmup < args.fault_step < args.steps or args.fault_step < args.ckpt_every:
        raise SystemExit("need --warmup < --fault-step < --steps and a checkpoint before --fault-step")

    runs: Dict[str, Callable[[str, str], dict]] = {
        "ours": lambda work, name: fault_free(False, args, work, name),
        "ours, untraced": lambda work, name: fault_free(False, args, work, name, trace=False),
        "plain Gloo": lambda work, name: fault_free(True, args, work, name),
        "plain Gloo (A/A)": lambda work, name: fault_free(True, args, work, name),
    }
    if args.smoke:  # the A/A takes the same path as plain Gloo
        del runs["plain Gloo (A/A)"]
    for phase in args.phases:
        runs[f"ours, SIGKILL in {phase}"] = lambda work, name, phase=phase: survivor_stall(phase, args, work, name)
    runs["torchrun + DCP"] = lambda work, name: dcp_restart(args, work, name)

    figures: Dict[str, List[dict]] = {name: [] for name in runs}
    revision = measured_revision()
    began = time.time()
    work = tempfile.mkdtemp(prefix="bench-training-")  # kept when a run fails: its logs are there
    for i in range(args.repeats):
        order = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        for name in order:
            t0 = time.time()
            run = f"r{i}-{name.replace(' ', '_').replace('/', '').replace(',', '')}"
            figures[name].append(runs[name](work, run))
            shown = {k: round(v, 4) for k, v in figures[name][-1].items() if isinstance(v, float)}
            if figures[name][-1].get("job_ok") is False:
                shown["job failed after the recovery"] = figures[name][-1]["ranks_that_gave_up"]
            _log(f"repeat {i} {name} ({time.time() - t0:.0f} s): {shown}")
    failed = [x for xs in figures.values() for x in xs if x.get("job_ok") is False]
    if failed:
        _log(f"{len(failed)} faulted run(s) failed after the recovery; their logs are kept in {work}")
    else:
        shutil.rmtree(work)
    _log(f"done in {time.time() - began:.0f} s")

    print(f"command: `{shlex.join(['python'] + sys.argv)}`; {REPLICAS} replica groups x {RANKS} ranks on "
          f"{os.cpu_count()} CPU(s); {args.steps} steps, model {args.model}; fault at step {args.fault_step}, "
          f"checkpoint every {args.ckpt_every} steps; {args.repeats} repeats; commit {revision}; "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    print(f"Fault-free: the slowest rank's step time, median over steps {args.warmup}..{args.steps - 1} of a run; "
          "median and min–max over runs. Overhead: a run's step time / plain Gloo's in the same repeat − 1.\n")
    print("| configuration | step time, median (ms) | min–max (ms) | steps/s, median | min–max "
          "| vs plain Gloo, median | min–max |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in (n for n in ("ours", "ours, untraced", "plain Gloo", "plain Gloo (A/A)") if n in figures):
        xs = figures[name]
        print(f"| {name} | {median_range([x['step_s'] for x in xs], 1e3, 1)} | "
              f"{median_range([x['steps_per_s'] for x in xs])} | "
              f"{ratio_cells(xs, figures['plain Gloo'], 'vs_plain')} |")
    traced = ratio_cells(figures["ours"], figures["ours, untraced"], "vs_untraced")
    print(f"\nTracing's cost (ours / ours, untraced in the same repeat − 1): median and min–max "
          f"{traced.replace(' | ', ', ')}.")

    print(f"\nA fault at step {args.fault_step} (replica group {VICTIM_REPLICA}'s rank 0 SIGKILLed); seconds from "
          "the kill, median and min–max over runs.\n")
    print("| configuration | what is timed | median (s) | min–max (s) |")
    print("|---|---|---:|---:|")
    failures: Dict[str, List[dict]] = {}
    for phase in args.phases:
        xs = figures[f"ours, SIGKILL in {phase}"]
        name = f"ours, SIGKILL in {phase}"
        print(f"| {name} | kill → step {args.fault_step} committed by the survivors (survivor stall) "
              f"| {median_range([x['stall_s'] for x in xs])} |")
        print(f"| {name} | loss detected → step {args.fault_step} committed | "
              f"{median_range([x['detected_to_committed_s'] for x in xs])} |")
        print(f"| {name} | step {args.fault_step}'s time − the run's median step before it "
              f"| {median_range([x['faulted_step_extra_s'] for x in xs])} |")
        failures[name] = [x for x in xs if not x["job_ok"]]
    xs = figures["torchrun + DCP"]
    resumed = xs[0]["resumed_at_step"]
    rows = [("process_started_s", "kill → restarted rank 0 process started"),
            ("imported_s", "kill → torch and train.py imported"),
            ("built_s", "kill → process group up, model sharded"),
            ("checkpoint_loaded_s", f"kill → checkpoint of step {resumed} loaded"),
            ("first_commit_s", f"kill → first step committed after the restart (step {resumed})"),
            ("back_where_it_was_s", f"kill → back where it was (step {args.fault_step - 1} committed again)"),
            ("fault_step_committed_s", f"kill → step {args.fault_step} committed (ours' end point)")]
    for key, what in rows:
        print(f"| torchrun + DCP | {what} | {median_range([x[key] for x in xs])} |")
    saves = [s for x in xs for s in x["save_s"]]
    print(f"| torchrun + DCP | one checkpoint save (all {len(saves)} saves before the fault) | {median_range(saves)} |")
    for name, bad in failures.items():
        print(f"\n{name}: the job ended in failure after the recovery in {len(bad)} of {len(figures[name])} runs"
              + "".join(f"\n- launcher exit {x['run_py_exit']}, {x['log']}: {x['ranks_that_gave_up']}" for x in bad))
    before = [x["median_step_before_s"] * 1e3 for x in xs]
    print(f"\nTorchrun + DCP: losses of the redone steps bitwise equal to the first time: "
          f"{[x['replayed_losses_identical'] for x in xs]}; median step time before the fault "
          f"{statistics.median(before):.1f} ms ({min(before):.1f}–{max(before):.1f} ms over runs).")
    if args.json:
        save_runs(args.json, revision, began, figures, replicas=REPLICAS, ranks_per_replica=RANKS, model=args.model,
                  steps=args.steps, warmup=args.warmup, fault_step=args.fault_step, ckpt_every=args.ckpt_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
