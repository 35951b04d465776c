"""How long a loss stalls the survivors: commslayer's recovery next to plain
c10d Gloo and a torchrun restart, measured side by side in one run.

    python launch/bench/bench_recovery.py --repeats 5 > docs/data/recovery.md

``--smoke`` runs every scenario once with shorter timeouts, to check in
seconds that the benchmark still works.

Scenarios (4 ranks, one victim, rank 2; the op deadline is 600 s for ours,
so only detection can end the wait):

* ``ours, SIGKILL`` / ``ours, SIGSTOP (peer timeout T)`` (``--peer-timeout``):
  from the signal to the end of the first successful all_reduce on the
  shrunk communicator, on the slowest survivor (detection + agreement + the
  new group + one op);
* ``plain Gloo (timeout T), SIGKILL|SIGSTOP`` (``--plain-timeout``): from
  the signal until the slowest survivor's all_reduce raises, the time a
  plain job needs before it can even start to recover; the default Gloo
  timeout of torch (30 min) is capped at ``--cap`` seconds, and a survivor
  still waiting then counts as "more than the cap";
* ``torchrun restart``: ``torchrun --max-restarts 1`` of a job whose rank 2
  is SIGKILLed after its first all_reduce: from the kill to the end of the
  first all_reduce of the restarted job (new processes, torch imported
  again, a fresh group on a per-restart store prefix).

The ranks of the first two kinds run under ``faults.ranks.run_ranks``, a
small launcher that, unlike torchrun, leaves survivors running.  Times are
wall-clock (``time.time``) on one host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from commslayer.run.processes import free_port
from faults.ranks import run_ranks

SIZE, VICTIM = 4, 2


def _signal_self(store, sig: int) -> None:
    """The victim: 0.3 s after the others entered the op, note the time and take the signal."""
    store.set("victim_pid", str(os.getpid()))
    time.sleep(0.3)
    store.set("signal_at", repr(time.time()))
    os.kill(os.getpid(), sig)


def _ours(rank: int, size: int, store, sig: int) -> Optional[float]:
    import commslayer

    comm = commslayer.new_comm("gloo", name="bench", store=store, rank=rank, size=size, timeout=600)
    comm.barrier()
    if rank == VICTIM:
        _signal_self(store, sig)
        return None
    try:
        comm.all_reduce(torch.ones(1 << 12))
        raise RuntimeError("the op completed without the victim")
    except commslayer.PeerLost:
        pass
    comm = comm.shrink()
    comm.all_reduce(torch.ones(1 << 12))
    done = time.time()
    if comm.get_rank() == 0 and sig == signal.SIGSTOP:  # let the victim go (it is fenced) so the run ends
        os.kill(int(store.get("victim_pid")), signal.SIGCONT)
    return done - float(store.get("signal_at"))


def _plain(rank: int, size: int, store, sig: int, timeout_s: float, cap_s: float) -> Optional[float]:
    pg = dist.ProcessGroupGloo(dist.PrefixStore("plain/", store), rank, size, timedelta(seconds=timeout_s))
    pg.barrier().wait()
    if rank == VICTIM:
        _signal_self(store, sig)
        return None
    work = pg.allreduce([torch.ones(1 << 12)])
    try:
        work.wait(timedelta(seconds=cap_s))
        raise RuntimeError("the op completed without the victim")
    except RuntimeError as exc:
        noticed = time.time()
        if "Operation timed out!" in str(exc):  # our cap, not Gloo
            noticed = float("inf")
    if rank == 0 and sig == signal.SIGSTOP:
        os.kill(int(store.get("victim_pid")), signal.SIGKILL)
    return noticed - float(store.get("signal_at"))


_RESTART_JOB = r'''
import os, signal, sys, time, torch, torch.distributed as dist
from datetime import timedelta
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False,
                      timeout=timedelta(seconds=60))
pg = dist.ProcessGroupGloo(dist.PrefixStore(f"restart{restart}/", store), rank, size, timedelta(seconds=60))
pg.allreduce([torch.ones(1 << 12)]).wait()
out = sys.argv[1]
if restart == 0 and rank == 2:
    with open(out + ".kill", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
if restart == 0:
    time.sleep(60)  # torchrun ends us
elif rank == 0:
    with open(out + ".done", "w") as f:
        f.write(repr(time.time()))
os._exit(0)  # torch 2.13's Gloo can abort at interpreter exit (docs/api.md, Known limits)
'''


def _torchrun_restart(workdir: str, i: int) -> float:
    job = os.path.join(workdir, "restart_job.py")
    with open(job, "w") as f:
        f.write(_RESTART_JOB)
    out = os.path.join(workdir, f"restart{i}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(SIZE), "--max-restarts", "1",
           "--master-port", str(free_port()), job, out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    with open(out + ".kill") as f:
        killed = float(f.read())
    with open(out + ".done") as f:
        return float(f.read()) - killed


def _slowest(results: List[Optional[float]]) -> float:
    return max(r for r in results if isinstance(r, float))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cap", type=float, default=20.0, help="longest wait measured for plain Gloo (s)")
    p.add_argument("--peer-timeout", type=float, default=3.0,
                   help="ours: COMMSLAYER_PEER_TIMEOUT_S, after which a stopped rank is lost (default 3)")
    p.add_argument("--plain-timeout", type=float, default=5.0, help="plain Gloo's op timeout (default 5)")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    p.add_argument("--smoke", action="store_true", help="check that the benchmark works, in seconds: every "
                   "scenario once, peer timeout 1 s, plain Gloo timeout 2 s; explicit options still apply")
    args = p.parse_args()
    if args.smoke:
        p.set_defaults(repeats=1, peer_timeout=1.0, plain_timeout=2.0)
        args = p.parse_args()
    env = {"COMMSLAYER_TRACE_DIR": "", "COMMSLAYER_PEER_TIMEOUT_S": str(args.peer_timeout)}
    plain = f"plain Gloo (timeout {args.plain_timeout:g} s)"
    scenarios = {
        "ours, SIGKILL": lambda: _slowest(run_ranks(_ours, SIZE, signal.SIGKILL, timeout=60, env=env,
                                                    allow_errors=True)),
        f"ours, SIGSTOP (peer timeout {args.peer_timeout:g} s)": lambda: _slowest(run_ranks(
            _ours, SIZE, signal.SIGSTOP, timeout=60, env=env)),
        f"{plain}, SIGKILL": lambda: _slowest(run_ranks(
            _plain, SIZE, signal.SIGKILL, args.plain_timeout, args.cap, timeout=60, allow_errors=True)),
        f"{plain}, SIGSTOP": lambda: _slowest(run_ranks(
            _plain, SIZE, signal.SIGSTOP, args.plain_timeout, args.cap, timeout=60, allow_errors=True)),
        "plain Gloo (default 1800 s), SIGKILL": lambda: _slowest(run_ranks(
            _plain, SIZE, signal.SIGKILL, 1800.0, args.cap, timeout=args.cap + 30, allow_errors=True)),
    }
    figures: Dict[str, List[float]] = {name: [] for name in scenarios}
    figures["torchrun --max-restarts 1, SIGKILL"] = []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.repeats):
            for name, run in scenarios.items():
                figures[name].append(run())
                print(f"[bench_recovery] {i}: {name}: {figures[name][-1]:.3f} s", file=sys.stderr, flush=True)
            figures["torchrun --max-restarts 1, SIGKILL"].append(_torchrun_restart(workdir, i))
            print(f"[bench_recovery] {i}: torchrun restart: {figures['torchrun --max-restarts 1, SIGKILL'][-1]:.3f} s",
                  file=sys.stderr, flush=True)
    print(f"command: `python {' '.join(sys.argv)}`; torch {torch.__version__}; {SIZE} ranks, victim rank {VICTIM}; "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    print("| scenario | stall of the slowest survivor, median (s) | min–max (s) | repeats |")
    print("|---|---:|---:|---:|")
    for name, xs in figures.items():
        def fmt(x: float) -> str:
            return f"> {args.cap:g}" if x == float("inf") else f"{x:.3f}"
        print(f"| {name} | {fmt(statistics.median(xs))} | {fmt(min(xs))}–{fmt(max(xs))} | {len(xs)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [None if x == float("inf") else x for x in v] for k, v in figures.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
