"""A training script run unchanged, with where its CPU went written down: what
launch/bench/bench_step_cost.py reads to explain a configuration's added step time.

    commslayer-run --nproc-per-node 4 --run-dir D launch/bench/cost_probe.py SCRIPT [ARGS ...]
    torchrun --nproc-per-node 4 launch/bench/cost_probe.py launch/plain.py SCRIPT [ARGS ...]

Runs SCRIPT as ``python SCRIPT ARGS`` would.  When the process ends (the
before-exit hooks of ``commslayer.comm.exits``, which ``job.finish()`` runs)
it writes ``cost-<pid>.json`` into ``$COMMSLAYER_RUN_DIR`` with:

- ``step_cpu_s``, ``step_main_cpu_s`` and ``step_gc_s``: per training
  iteration (from one ``job.step()`` return to the next), the CPU time of the
  whole process (every thread: ``time.process_time``), of the main thread
  (``time.thread_time``), and the time the garbage collector ran
  (``gc.callbacks``);
- ``gc_s`` and ``gc_runs``: the collector's time and runs over the whole
  process, imports and model build included;
- ``step_call_main_cpu_s`` and ``step_optimizer_cpu_s``: per training
  iteration, the main thread's CPU inside the job's ``step()`` call (the
  gradient average, the vote, the optimizers), and of that inside the
  optimizers' ``step`` (torch's global optimizer hooks);
- ``snapshot_s`` and ``snapshots``: a peer-redundant job's state snapshots
  (``_State.pack``: a ``torch.save`` of the rank's shard, on the main thread),
  their total time and count;
- ``copies_cpu_s``, ``copies`` and ``copies_bytes``: the copies' exchanges
  (``PeerCopies._exchange``, each in a thread of its own), their CPU time in
  all, their count, and the bytes they sent;
- ``process_cpu_s``: the whole process's CPU at the end, threads that ended too
- ``threads_cpu_s``: CPU time per thread still running at the end, by name
  (digits at the end of a name dropped, so that one kind of thread adds up;
  threads that are not Python's by the kernel's name, in parentheses), from
  ``/proc/self/task``, at the kernel's clock-tick resolution.

The probe adds a few clock reads per step and per optimizer step, one per
snapshot, exchange and collection (about 1 µs each); it changes nothing else.
(The async ops FSDP2 and DDP issue on a commslayer group run no Python since
the group's C++ backend, so there is no Python call of theirs to time.)
"""

import gc
import json
import os
import re
import runpy
import sys
import threading
import time
from typing import Any, Callable, Dict, List

FIGURES: Dict[str, Any] = {"gc_s": 0.0, "gc_runs": 0, "snapshot_s": 0.0, "snapshots": 0, "copies_cpu_s": 0.0,
                           "copies": 0, "copies_bytes": 0, "step_cpu_s": [], "step_main_cpu_s": [], "step_gc_s": [],
                           "step_call_main_cpu_s": [], "step_optimizer_cpu_s": []}
# Running totals, taken per iteration at each step's return (the keys' "step_" lists)
TOTALS: Dict[str, float] = {"optimizer_cpu_s": 0.0}
_PER_STEP = (("step_cpu_s", time.process_time), ("step_main_cpu_s", time.thread_time),
             ("step_gc_s", lambda: FIGURES["gc_s"]), ("step_optimizer_cpu_s", lambda: TOTALS["optimizer_cpu_s"]))
_gc_began = [0.0]
_optimizer_at = [0.0]  # the main thread's CPU as the optimizer step began
_last_step: List[float] = []


def _on_gc(phase: str, _info: Dict[str, int]) -> None:
    if phase == "start":
        _gc_began[0] = time.perf_counter()
    else:
        FIGURES["gc_s"] += time.perf_counter() - _gc_began[0]
        FIGURES["gc_runs"] += 1


def _timed_step(step: Callable[..., Any]) -> Callable[..., Any]:
    def step_and_sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        out = step(self, *args, **kwargs)
        now = [read() for _key, read in _PER_STEP]
        if _last_step:
            for (key, _read), at, before in zip(_PER_STEP, now, _last_step):
                FIGURES[key].append(at - before)
            FIGURES["step_call_main_cpu_s"].append(now[1] - began)
        _last_step[:] = now
        return out
    return step_and_sample


def _optimizer_began(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    _optimizer_at[0] = time.thread_time()


def _optimizer_ended(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    TOTALS["optimizer_cpu_s"] += time.thread_time() - _optimizer_at[0]


def _timed_pack(pack: Callable[..., Any]) -> Callable[..., Any]:
    def pack_and_time(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = pack(self, *args, **kwargs)
        FIGURES["snapshot_s"] += time.perf_counter() - began
        FIGURES["snapshots"] += 1
        return out
    return pack_and_time


def _timed_exchange(exchange: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def exchange_and_time(self: Any, version: Any) -> None:
        began, sent = time.thread_time(), self.bytes_sent
        exchange(self, version)
        FIGURES["copies_cpu_s"] += time.thread_time() - began
        FIGURES["copies"] += 1
        FIGURES["copies_bytes"] += self.bytes_sent - sent
    return exchange_and_time


def threads_cpu() -> Dict[str, float]:
    """CPU seconds per live thread of this process, by name (see the module doc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                kernel_name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), f"({kernel_name})")
        name = re.sub(r"[\d\-_ ]+$", "", name) or name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _write(_status: int, _why: str) -> None:
    run_dir = os.environ.get("COMMSLAYER_RUN_DIR") or "."
    out = dict(FIGURES, threads_cpu_s=threads_cpu(), process_cpu_s=time.process_time(), pid=os.getpid(),
               rank=os.environ.get("RANK"), replica=os.environ.get("COMMSLAYER_REPLICA"))
    path = os.path.join(run_dir, f"cost-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def install() -> Any:
    """Put the probes in place, before the script imports anything of its own; launch/plain.py's
    module, whose job the probes time (run it as this module, not as a second copy)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch/: plain.py
    import plain
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from commslayer.comm.exits import register_before_exit
    from commslayer.train import job, peerjob, redundancy

    gc.callbacks.append(_on_gc)
    register_optimizer_step_pre_hook(_optimizer_began)
    register_optimizer_step_post_hook(_optimizer_ended)
    for cls in (job.Job, peerjob.PeerJob, plain.Job):
        if "step" in cls.__dict__:
            cls.step = _timed_step(cls.__dict__["step"])
    job._State.pack = _timed_pack(job._State.pack)
    redundancy.PeerCopies._exchange = _timed_exchange(redundancy.PeerCopies._exchange)
    register_before_exit(_write)
    return plain


def main() -> None:
    plain = install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    if os.path.abspath(script) == os.path.abspath(plain.__file__):
        plain.main()
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
