"""Per-op latency of commslayer next to plain c10d Gloo, measured in one run.

Launch it with torchrun, one process per rank::

    torchrun --nproc-per-node 2 launch/bench/bench_overhead.py [--json runs/overhead.json]

``--smoke`` checks in seconds that it still runs: every op and every variant
(``--tracing`` on, its files in a temporary directory), 4 bytes, one warm-up
and one timed round.

What it measures
----------------
For each op (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``)
and each message size, three variants run the same op on the same tensors:

* ``plain``      (A)  -- ``torch.distributed`` on the default Gloo group
  (``dist.all_reduce``, ``dist.all_gather_single``, ``dist.reduce_scatter_single``:
  torch 2.13's names for ``all_gather_into_tensor``/``reduce_scatter_tensor``,
  which are deprecated wrappers that would add a ``warnings.warn`` call to
  every plain op; the old names are used on a torch that lacks the new ones);
* ``plain2``     (A') -- the same calls on a second, independent Gloo group
  built with ``dist.new_group(backend="gloo")``;
* ``commslayer`` (B)  -- ``Communicator.all_reduce`` / ``all_gather_single`` /
  ``reduce_scatter_single`` on ``commslayer.new_comm("gloo", name="bench")``.

With ``--breakdown`` two more show where commslayer's cost lies: ``backend``
(the same op on the second plain group's Gloo backend object itself, its
method and its wait with no Python layer above them: the floor every layer
pays), ``general`` (commslayer's general op path, ``Communicator._run``,
taken by naming the communicator's own timeout; ``commslayer`` takes the
direct path of a synchronous op that no hook observes) and ``python`` (the
direct path in Python, on a communicator built with ``COMMSLAYER_NATIVE=0``;
``commslayer`` runs it in native code where ``commslayer.comm.native`` is built:
the report's header says whether it is).

With ``--tracing`` three more variants run beside them, each on its own
communicator watched by its own flight recorder (``tracing.record.recorder``): the
recorder alone (``recorder``), plus structlog JSON lines (``recorder+jsonl``),
plus OpenTelemetry spans and metrics (``recorder+jsonl+otel``).  Their files
go under ``--trace-dir``.  With ``--dispatch`` two more measure what reaching a C++ backend through
``torch.distributed`` costs, the design a commslayer group without Python
methods would have: ``forward-backend``, c10d's own (C++) ``ProcessGroup``
whose CPU backend is ``ForwardBackend`` (launch/bench/forward_backend.cpp,
built at start into a temporary directory: a C++ backend that hands each op
to a Gloo backend of its own and does nothing else), and
``forward-backend-pysub``, the same backend under a Python subclass of
``ProcessGroup`` that overrides nothing (as the group commslayer builds was
before its own C++ backend, ``GroupBackend``, and still is without the native module).  With ``--nan-check`` one more, ``nan-check``, runs
commslayer with the NaN check on (``commslayer.NanCheckHook``), on a
communicator of its own.

With ``--async-op`` every variant issues its op async and waits on the work
(``dist.all_reduce(t, async_op=True).wait()``, as FSDP2 and DDP do), and one
more runs: ``c10d-adapter``, the same ``torch.distributed`` call on a
``new_group(backend="commslayer")`` group, the routed path
(docs/bench/async-path.md; under ``COMMSLAYER_ISOLATE_WRITES=1``, which c10d
groups do not read, an isolating communicator's ``as_process_group()``, as
the resilient modes build theirs); with ``--tracing`` also
``c10d-adapter+recorder``, such a group watched by a flight recorder; with
``--breakdown`` also ``adapter-comm``, the first group's communicator called
directly.  Otherwise every op is synchronous.

Two numbers are taken around each call:

* wall time (``time.perf_counter``): what the caller waits for the op;
* the calling thread's CPU time (``time.thread_time``): the work the calling
  thread itself does.  Gloo moves and reduces the data on its own worker
  threads and the caller sleeps on a condition variable meanwhile, so this is
  almost exactly the per-call overhead of the Python/C++ layers above Gloo --
  the thing commslayer adds (argument checks, deadline, ``Work`` object).

Why A/A calibration and interleaving
------------------------------------
On a small machine (2 cores here) wall time is noisy: two identical plain
groups differ by up to ~35% on small ops, while thread CPU time is stable to a
few microseconds.  A commslayer/plain ratio only means something next to the
noise floor, so the plain2/plain ("A/A") ratio is reported beside it: a
commslayer/plain ratio inside the A/A spread is no measurable difference.

To make drift (other processes, frequency changes, cache state) hit all
variants equally, the variants are interleaved: each round runs A, A' and B
once each, in an order shuffled anew every round (the same on every rank: the
round number seeds it).  Shuffled, not rotated: an op runs partly on caches
the op before it warmed, so a rotation, which keeps each variant behind the
same neighbour, charged each one for its neighbour (A' ran behind A, on
plain c10d's warm code, and came out 0.6-12.7 µs cheaper than A in 23 of 24
figures).  Before every timed op the ranks meet in a
barrier on a fourth Gloo group used only for synchronisation, so each timed op
starts with the ranks aligned and the barrier's traffic touches none of the
measured groups.  The garbage collector is off while a size is measured.

How many repetitions
--------------------
After ``--warmup`` untimed rounds, the slowest rank's round time sets the
repetition count for that (op, size): as many rounds as fit in
``--max-seconds-per-size``, clamped to [``--min-reps``, ``--max-reps``].  So
small messages get thousands of repetitions and large ones a handful; every
rank runs the same count, agreed through an all_reduce.

What is reported
----------------
Per (op, size) and variant: the median and the interquartile range
(p25-p75) of

* wall time: per repetition, the maximum over ranks (an op is finished when
  its slowest rank returns);
* thread CPU time: per repetition, the mean over ranks.

Then commslayer/plain and plain2/plain, each the ratio of medians, and
commslayer - plain (difference of medians).  ``--json PATH`` also writes
min, max, p10, p90 and every rank's own median.

Sizes
-----
A size is bytes of float32 data (elements = bytes / 4):

* ``all_reduce``: the tensor that is reduced;
* ``all_gather_single``: each rank's input; the output is world_size x size;
* ``reduce_scatter_single``: each rank's output chunk; the input is
  world_size x size.

Correctness gate
----------------
After the timing, each op runs once more on plain c10d (default group) and on
commslayer with the same random input (``--verify-elements`` float32 elements
per rank, an odd count), and the two results must be bitwise equal on every
rank; a reduce-scatter that took commslayer's ring at more than 2 ranks must
equal the ring's documented summation order instead (Gloo's own may differ
in the last bits there).  The outcome is printed; a difference fails the run
(exit status 1).
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import commslayer
from commslayer import config as cl_config
from commslayer.c10d import group_of
from commslayer.comm import native
from commslayer.comm.ring import in_ring_order

OPS: Tuple[str, ...] = ("all_reduce", "all_gather_single", "reduce_scatter_single")
BASE_VARIANTS: Tuple[str, ...] = ("plain", "plain2", "commslayer")
TRACED_VARIANTS: Tuple[str, ...] = ("recorder", "recorder+jsonl", "recorder+jsonl+otel")
BREAKDOWN_VARIANTS: Tuple[str, ...] = ("backend", "general", "python")
VARIANTS: Tuple[str, ...] = BASE_VARIANTS  # main() adds TRACED_VARIANTS with --tracing
METRICS: Tuple[str, ...] = ("wall", "cpu")
DEFAULT_SIZES: Tuple[int, ...] = tuple(4 ** k for k in range(1, 14))  # 4 B .. 64 MiB
_SUFFIX = {"": 1, "b": 1, "k": 1024, "ki": 1024, "kib": 1024, "m": 1024 ** 2, "mi": 1024 ** 2,
           "mib": 1024 ** 2, "g": 1024 ** 3, "gi": 1024 ** 3, "gib": 1024 ** 3}

Op = Callable[[], None]

# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor in favour of these names;
# calling the deprecated wrappers would charge the baseline a warnings.warn per op.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------ arguments
def parse_size(text: str) -> int:
    """``"4"``, ``"4096"``, ``"1Ki"``, ``"64MiB"`` -> bytes (K, M, G are binary: 1024-based)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SUFFIX:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use bytes, optionally with K/Ki/KiB, M/Mi/MiB, G")
    size = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} = {size} B must be a positive multiple of 4 (float32)")
    return size


def parse_sizes(text: str) -> List[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def parse_ops(text: str) -> List[str]:
    ops = [s.strip() for s in text.split(",") if s.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad}: choose from {','.join(OPS)}")
    return ops


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Per-op latency (wall and calling-thread CPU time) of commslayer vs plain c10d Gloo, "
                    "with a plain-vs-plain A/A calibration. Run under torchrun.")
    p.add_argument("--ops", type=parse_ops, default=list(OPS),
                   help=f"comma-separated ops (default: {','.join(OPS)})")
    p.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                   help="comma-separated sizes in bytes, suffixes K/Ki/KiB, M/Mi/MiB, G allowed "
                        "(default: 4 B to 64 MiB in powers of 4)")
    p.add_argument("--max-seconds-per-size", type=float, default=5.0,
                   help="time budget of the timed rounds of one (op, size), all variants together (default 5)")
    p.add_argument("--min-reps", type=int, default=5,
                   help="at least this many timed rounds per (op, size), whatever the budget (default 5)")
    p.add_argument("--max-reps", type=int, default=2000,
                   help="at most this many timed rounds per (op, size) (default 2000)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed rounds per (op, size) before timing; at least 1 (default 3)")
    p.add_argument("--verify-elements", type=int, default=65537,
                   help="float32 elements per rank in the bitwise correctness check (default 65537)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the correctness check's inputs (default 1234)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH (rank 0)")
    p.add_argument("--tracing", action="store_true",
                   help="also measure commslayer with the flight recorder, + JSON lines, + OpenTelemetry "
                        "(one communicator and one recorder per variant)")
    p.add_argument("--breakdown", action="store_true",
                   help="also measure the layers: 'backend' (the Gloo backend's own method and wait, no Python "
                        "layer: the floor), 'general' (commslayer's general op path, taken by naming a "
                        "timeout, where 'commslayer' takes the direct path) and 'python' (the direct path "
                        "in Python, where 'commslayer' runs it in native code)")
    p.add_argument("--async-op", action="store_true",
                   help="issue every op with async_op=True and wait on its work (as FSDP2 and DDP do), and "
                        "add 'c10d-adapter': torch.distributed's call on a new_group(backend=\"commslayer\") "
                        "group (the routed path); with --tracing also 'c10d-adapter+recorder', such a group "
                        "watched by a flight recorder; with --breakdown also 'adapter-comm', the first "
                        "group's communicator called directly")
    p.add_argument("--dispatch", action="store_true",
                   help="also measure 'forward-backend' and 'forward-backend-pysub': torch.distributed's call on a "
                        "c10d ProcessGroup, and on a Python subclass of it, whose CPU backend is a C++ backend "
                        "that forwards to Gloo (launch/bench/forward_backend.cpp, built at start)")
    p.add_argument("--nan-check", action="store_true",
                   help="also measure commslayer with the NaN check on (commslayer.NanCheckHook), on a "
                        "communicator of its own")
    p.add_argument("--trace-dir", default="runs/bench-tracing",
                   help="where the traced variants write their files (default runs/bench-tracing; with --smoke "
                        "a temporary directory, removed at exit)")
    p.add_argument("--smoke", action="store_true",
                   help="check that the benchmark works, in seconds: every op and variant (--tracing), 4 B, "
                        "1 warm-up and 1 timed round; explicit options still apply")
    return p


SMOKE = {"sizes": [4], "warmup": 1, "min_reps": 1, "max_reps": 1, "verify_elements": 33, "tracing": True,
         "trace_dir": None, "nan_check": True, "breakdown": True}


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_seconds_per_size <= 0:
        p.error("--max-seconds-per-size must be positive")
    if args.min_reps < 1 or args.max_reps < args.min_reps:
        p.error("need 1 <= --min-reps <= --max-reps")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (it sizes the repetition count)")
    if args.verify_elements < 1:
        p.error("--verify-elements must be positive")


# --------------------------------------------------------------------- groups
@dataclass
class Groups:
    plain: dist.ProcessGroup       # A: the default group
    plain2: dist.ProcessGroup      # A': a second plain Gloo group
    sync: dist.ProcessGroup        # barriers and bookkeeping only, never timed
    comm: commslayer.Communicator  # B
    rank: int
    size: int
    traced: Dict[str, commslayer.Communicator] = field(default_factory=dict)  # --tracing, --nan-check variants
    async_op: bool = False  # --async-op: every variant issues async and waits on the work
    adapter: Optional[dist.ProcessGroup] = None  # --async-op: a new_group(backend="commslayer") group
    adapter_traced: Optional[dist.ProcessGroup] = None  # --async-op --tracing: one watched by a flight recorder
    forwarding: Dict[str, Tuple[dist.ProcessGroup, Any]] = field(default_factory=dict)  # --dispatch: group, backend


def setup() -> Groups:
    if cl_config.route_c10d():
        raise SystemExit("unset COMMSLAYER_ROUTE_C10D: with it the 'plain' baseline would run on commslayer too")
    dist.init_process_group("gloo")
    plain = dist.group.WORLD
    assert group_of(plain) is None, "the default group is commslayer's, not plain Gloo"
    plain2 = dist.new_group(backend="gloo")
    sync = dist.new_group(backend="gloo")
    comm = commslayer.new_comm("gloo", name="bench")
    return Groups(plain, plain2, sync, comm, dist.get_rank(), dist.get_world_size())


# ------------------------------------------------------------------------ ops
@dataclass
class Buffers:
    """The tensors of one (op, size), shared by all variants."""

    inp: torch.Tensor
    out: Optional[torch.Tensor]
    refill: bool  # whether the op writes into (or may consume) its input


def make_buffers(op: str, size_bytes: int, world: int) -> Buffers:
    n = size_bytes // 4
    if op == "all_reduce":
        return Buffers(torch.ones(n), None, True)
    if op == "all_gather_single":
        return Buffers(torch.ones(n), torch.empty(n * world), False)
    if op == "reduce_scatter_single":
        return Buffers(torch.ones(n * world), torch.empty(n), True)
    raise ValueError(op)


def _adapter_group(name: str) -> Any:
    """A commslayer group for ``torch.distributed``'s calls: as ``new_group`` makes it, or,
    where ``COMMSLAYER_ISOLATE_WRITES=1`` asks for isolation (c10d groups do not read it),
    as the resilient modes make theirs: an isolating communicator's ``as_process_group()``."""
    if not cl_config.isolate_writes():
        return dist.new_group(backend="commslayer")
    comm = commslayer.new_comm("gloo", name=name)
    comm.global_ranks = list(range(comm.get_size()))
    return comm.as_process_group()


class _Subclass(dist.ProcessGroup):
    """A Python subclass of c10d's ProcessGroup that overrides nothing (``--dispatch``)."""


def forwarding_groups() -> Dict[str, Tuple[dist.ProcessGroup, Any]]:
    """``--dispatch``'s groups, by variant: each a ProcessGroup whose CPU backend is a
    ``ForwardBackend`` over a Gloo backend of its own, with that backend.  Rank 0 builds
    the module into a temporary directory (removed at exit) while the others wait."""
    import subprocess

    name = "commslayer_bench_forward"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        directory = tempfile.mkdtemp(prefix="bench-forward-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forward_backend.cpp")
        built = subprocess.run(native.compile_command(name, os.path.join(directory, name + ".so"), source),
                               capture_output=True, text=True, timeout=native.BUILD_TIMEOUT_S)
        if built.returncode != 0:
            print(f"[bench_overhead] cannot build {source}: {built.stderr[-2000:]}", file=sys.stderr, flush=True)
            directory = ""
        store.set("bench-forward/directory", directory)
    directory = store.get("bench-forward/directory").decode()  # the store's own deadline bounds the wait
    if not directory:
        raise SystemExit("--dispatch: the forwarding backend did not build (rank 0 says why)")
    module = native.load_extension(name, os.path.join(directory, name + ".so"))
    rank, size = dist.get_rank(), dist.get_world_size()
    custom = dist.ProcessGroup.BackendType.CUSTOM
    groups = {}
    for variant, make in (("forward-backend", lambda ps: dist.ProcessGroup(ps, rank, size)),
                          ("forward-backend-pysub", lambda ps: _Subclass(rank, size))):
        prefixed = dist.PrefixStore(f"bench-{variant}/", store)
        backend = module.ForwardBackend(dist.ProcessGroupGloo(prefixed, rank, size, _dt.timedelta(seconds=60)))
        group = make(prefixed)
        group._set_default_backend(custom)
        group._register_backend(torch.device("cpu"), custom, backend)
        groups[variant] = (group, backend)
    return groups


def plain_call(op: str, group: dist.ProcessGroup, inp: torch.Tensor, out: Optional[torch.Tensor],
               async_op: bool = False) -> None:
    """The op through ``torch.distributed`` on ``group``; ``async_op``: issued async, then waited on."""
    if op == "all_reduce":
        work = dist.all_reduce(inp, group=group, async_op=async_op)
    elif op == "all_gather_single":
        work = _all_gather_single(out, inp, group=group, async_op=async_op)
    else:
        work = _reduce_scatter_single(out, inp, group=group, async_op=async_op)
    if async_op:
        work.wait()


def comm_call(op: str, comm: commslayer.Communicator, inp: torch.Tensor, out: Optional[torch.Tensor],
              timeout: Optional[_dt.timedelta] = None, async_op: bool = False) -> None:
    """The op on ``comm``; ``async_op``: issued async, then waited on."""
    if op == "all_reduce":
        work = comm.all_reduce(inp, timeout=timeout, async_op=async_op)
    elif op == "all_gather_single":
        work = comm.all_gather_single(out, inp, timeout=timeout, async_op=async_op)
    else:
        work = comm.reduce_scatter_single(out, inp, timeout=timeout, async_op=async_op)
    if async_op:
        work.wait()


def backend_call(op: str, backend: Any, inp: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    """The op on a Gloo backend itself: its method and its wait, nothing above them."""
    if op == "all_reduce":
        backend.allreduce([inp]).wait()
    elif op == "all_gather_single":
        backend._allgather_base(out, inp).wait()
    else:
        backend._reduce_scatter_base(out, inp).wait()


def variant_calls(op: str, g: Groups, b: Buffers) -> Dict[str, Op]:
    a = g.async_op
    calls = {
        "plain": lambda: plain_call(op, g.plain, b.inp, b.out, a),
        "plain2": lambda: plain_call(op, g.plain2, b.inp, b.out, a),
        "commslayer": lambda: comm_call(op, g.comm, b.inp, b.out, async_op=a),
    }
    for name, comm in g.traced.items():
        calls[name] = lambda comm=comm: comm_call(op, comm, b.inp, b.out, async_op=a)
    if g.adapter is not None:
        calls["c10d-adapter"] = lambda: plain_call(op, g.adapter, b.inp, b.out, a)
    if g.adapter_traced is not None:
        calls["c10d-adapter+recorder"] = lambda: plain_call(op, g.adapter_traced, b.inp, b.out, a)
    for name, (group, _) in g.forwarding.items():
        calls[name] = lambda group=group: plain_call(op, group, b.inp, b.out, a)
    backend = g.plain2._get_backend(torch.device("cpu"))
    calls["backend"] = lambda: backend_call(op, backend, b.inp, b.out)
    general = g.comm.get_timeout()
    calls["general"] = lambda: comm_call(op, g.comm, b.inp, b.out, timeout=general, async_op=a)
    return calls


def traced_comms(trace_dir: str) -> Dict[str, commslayer.Communicator]:
    """One communicator per traced variant, each watched by its own recorder and sinks."""
    from tracing.record.jsonl import JsonlSink
    from tracing.record.otel import OtelSink
    from tracing.record.recorder import FlightRecorder

    comms = {}
    for name in TRACED_VARIANTS:
        rec = FlightRecorder(cl_config.trace_buffer(), os.path.join(trace_dir, name.replace("+", "-")),
                             job=cl_config.job_id())
        comm = commslayer.new_comm("gloo", name=f"bench-{name.replace('+', '-')}")
        rec.attach(comm)
        if "jsonl" in name:
            JsonlSink.attach(rec)
        if "otel" in name:
            OtelSink.attach(rec)
        comms[name] = comm
    return comms


# ------------------------------------------------------------------ measuring
def timed(call: Op) -> Tuple[float, float]:
    """(wall seconds, calling-thread CPU seconds) of one synchronous op."""
    w0 = time.perf_counter()
    c0 = time.thread_time()
    call()
    c1 = time.thread_time()
    w1 = time.perf_counter()
    return w1 - w0, c1 - c0


def round_order(r: int) -> List[int]:
    """Variant indices for round ``r``, shuffled with ``r`` as the seed: every variant
    follows every other equally often, on average, and every rank runs the same order."""
    order = list(range(len(VARIANTS)))
    random.Random(r).shuffle(order)
    return order


def run_round(r: int, calls: Sequence[Op], b: Buffers, sync: dist.ProcessGroup,
              sink: Optional[torch.Tensor]) -> None:
    """One op per variant; with ``sink`` ([variants, metrics]) record the timings into it."""
    for v in round_order(r):
        if b.refill:
            b.inp.fill_(1.0)
        dist.barrier(group=sync)
        wall, cpu = timed(calls[v])
        if sink is not None:
            sink[v, 0] = wall
            sink[v, 1] = cpu


def agree_reps(round_s: float, args: argparse.Namespace, sync: dist.ProcessGroup) -> int:
    """The repetition count, from the slowest rank's warm-up round time."""
    t = torch.tensor([round_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sync)
    reps = int(args.max_seconds_per_size / max(t.item(), 1e-9))
    return max(args.min_reps, min(args.max_reps, reps))


def measure(op: str, size_bytes: int, g: Groups, args: argparse.Namespace) -> torch.Tensor:
    """Samples of every rank: a float64 tensor [world, reps, variants, metrics] (valid on every rank)."""
    b = make_buffers(op, size_bytes, g.size)
    calls = [variant_calls(op, g, b)[v] for v in VARIANTS]
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for r in range(args.warmup):
            run_round(r, calls, b, g.sync, None)
        reps = agree_reps((time.perf_counter() - t0) / args.warmup, args, g.sync)
        mine = torch.zeros(reps, len(VARIANTS), len(METRICS), dtype=torch.float64)
        for r in range(reps):
            run_round(r, calls, b, g.sync, mine[r])
    finally:
        gc.enable()
    everyone = [torch.empty_like(mine) for _ in range(g.size)]
    dist.all_gather(everyone, mine, group=g.sync)
    return torch.stack(everyone)


# ------------------------------------------------------------------ statistics
def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_xs:
        return math.nan
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: Sequence[float]) -> Dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "median": percentile(s, 50), "p25": percentile(s, 25), "p75": percentile(s, 75),
            "p10": percentile(s, 10), "p90": percentile(s, 90), "min": s[0], "max": s[-1]}


@dataclass
class Result:
    op: str
    size_bytes: int
    reps: int
    stats: Dict[str, Dict[str, Dict[str, float]]] = field(default_factory=dict)  # metric -> variant -> stat
    per_rank_median: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)

    def ratio(self, metric: str, num: str, den: str = "plain") -> float:
        d = self.stats[metric][den]["median"]
        return self.stats[metric][num]["median"] / d if d > 0 else math.nan

    def delta(self, metric: str, variant: str = "commslayer") -> float:
        return self.stats[metric][variant]["median"] - self.stats[metric]["plain"]["median"]


def reduce_samples(op: str, size_bytes: int, samples: torch.Tensor) -> Result:
    """Wall: max over ranks per repetition; CPU: mean over ranks per repetition."""
    res = Result(op, size_bytes, samples.shape[1])
    per_rep = {"wall": samples[..., 0].amax(dim=0), "cpu": samples[..., 1].mean(dim=0)}  # [reps, variants]
    for mi, metric in enumerate(METRICS):
        res.stats[metric] = {v: summarize(per_rep[metric][:, vi].tolist()) for vi, v in enumerate(VARIANTS)}
        res.per_rank_median[metric] = {
            v: [percentile(sorted(samples[rank, :, vi, mi].tolist()), 50) for rank in range(samples.shape[0])]
            for vi, v in enumerate(VARIANTS)
        }
    return res


# ----------------------------------------------------------------- correctness
def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def verify_op(op: str, g: Groups, args: argparse.Namespace) -> bool:
    """Plain c10d and commslayer on the same random input: bitwise equal on this rank?
    A reduce-scatter that took the ring at more than 2 ranks is held to the ring's
    documented summation order instead (commslayer.comm.ring.in_ring_order), where Gloo's
    own may differ in the last bits (docs/api.md)."""
    n = args.verify_elements
    gen = torch.Generator().manual_seed(args.seed * 1000 + g.rank)
    src = torch.randn(n if op != "reduce_scatter_single" else n * g.size, generator=gen)
    results = []
    for runner in ("plain", "commslayer"):
        inp = src.clone()
        out = None if op == "all_reduce" else torch.empty(n * g.size if op == "all_gather_single" else n)
        if runner == "plain":
            plain_call(op, g.plain, inp, out)
        else:
            comm_call(op, g.comm, inp, out)
        results.append(inp if out is None else out)
    if op == "reduce_scatter_single" and g.size > 2 and \
            g.comm._takes_ring(commslayer.ReduceOp.SUM, results[1], src.numel() * src.element_size()):
        everyone = [torch.empty_like(src) for _ in range(g.size)]
        dist.all_gather(everyone, src, group=g.sync)
        return bitwise_equal(in_ring_order(everyone, g.rank), results[1])
    return bitwise_equal(results[0], results[1])


def verify_all(g: Groups, args: argparse.Namespace) -> Dict[str, bool]:
    """Per op: equal on every rank (agreed through an all_reduce MIN)."""
    verdict = {}
    for op in args.ops:
        flag = torch.tensor([1 if verify_op(op, g, args) else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g.sync)
        verdict[op] = bool(flag.item())
    return verdict


# --------------------------------------------------------------------- output
def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def fmt_time(s: float) -> str:
    if math.isnan(s):
        return "n/a"
    us = s * 1e6
    if abs(us) < 1000:
        return f"{us:.1f} µs"
    if abs(us) < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


def fmt_cell(st: Dict[str, float]) -> str:
    return f"{fmt_time(st['median'])} [{fmt_time(st['p25'])}–{fmt_time(st['p75'])}]"


def command_line() -> str:
    """The torchrun command that started this worker (from the parent's /proc entry), else the worker's argv."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = [a.decode() for a in f.read().split(b"\0") if a]
        for i, a in enumerate(parent):
            if os.path.basename(a) == "torchrun":
                return shlex.join(["torchrun"] + parent[i + 1:])
            if a == "torch.distributed.run":
                return shlex.join(["python"] + parent[1:])
    except OSError:
        pass
    return "(worker argv) " + shlex.join([sys.executable] + sys.argv)


def metadata(g: Groups, args: argparse.Namespace) -> Dict[str, object]:
    return {
        "command": command_line(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "world_size": g.size,
        "commslayer_timeout_s": g.comm.get_timeout().total_seconds(),
        "commslayer_check_mode": cl_config.check_mode(),
        "commslayer_direct_path": native.why_not() or "native",
        "ops": list(args.ops),
        "sizes_bytes": list(args.sizes),
        "max_seconds_per_size": args.max_seconds_per_size,
        "min_reps": args.min_reps,
        "max_reps": args.max_reps,
        "warmup": args.warmup,
        "size_meaning": {
            "all_reduce": "bytes of the reduced tensor",
            "all_gather_single": "bytes of each rank's input (output is world_size x size)",
            "reduce_scatter_single": "bytes of each rank's output chunk (input is world_size x size)",
        },
        "wall_aggregation": "per repetition, max over ranks",
        "cpu_aggregation": "per repetition, mean over ranks (calling thread's CPU time, time.thread_time)",
        "spread": "p25-p75 (interquartile range) in the tables; JSON adds p10, p90, min, max",
    }


def table(results: Sequence[Result], metric: str) -> List[str]:
    extra = [v for v in VARIANTS if v not in BASE_VARIANTS]
    lines = [
        "| op | size | reps | plain (A) | plain2 (A') | commslayer (B) | B/A | A'/A | B−A |"
        + "".join(f" {v} | /A | −A |" for v in extra),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|---:|" * len(extra),
    ]
    for r in results:
        s = r.stats[metric]
        lines.append(
            f"| {r.op} | {fmt_bytes(r.size_bytes)} | {r.reps} | {fmt_cell(s['plain'])} | {fmt_cell(s['plain2'])} "
            f"| {fmt_cell(s['commslayer'])} | {r.ratio(metric, 'commslayer'):.3f} | {r.ratio(metric, 'plain2'):.3f} "
            f"| {fmt_time(r.delta(metric))} |"
            + "".join(f" {fmt_cell(s[v])} | {r.ratio(metric, v):.3f} | {fmt_time(r.delta(metric, v))} |"
                      for v in extra)
        )
    return lines


def report(meta: Dict[str, object], results: Sequence[Result], verdict: Dict[str, bool]) -> str:
    out = [
        "# commslayer overhead vs plain c10d Gloo",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; torch {meta['torch']}; python {meta['python']}; "
        f"world size {meta['world_size']}; host {meta['host']} ({meta['cpus']} CPUs, "
        f"torch threads {meta['torch_threads']})",
        f"- commslayer: timeout {meta['commslayer_timeout_s']:g} s, check mode "
        f"{'on' if meta['commslayer_check_mode'] else 'off'}, direct path: {meta['commslayer_direct_path']}",
        f"- budget per (op, size): {meta['max_seconds_per_size']:g} s, reps in "
        f"[{meta['min_reps']}, {meta['max_reps']}], {meta['warmup']} warm-up rounds; "
        "variants interleaved, order shuffled per round, barrier before every timed op",
        "- size: all_reduce = the reduced tensor; all_gather_single = each rank's input "
        "(output is world size × size); reduce_scatter_single = each rank's output chunk "
        "(input is world size × size); float32",
        "- cells: median [p25–p75]; B/A and A'/A are ratios of medians, B−A the difference of medians. "
        "A'/A is the noise floor: a B/A within it is no measurable difference.",
        "",
        "## Wall time per op (per repetition: slowest rank)",
        "",
        *table(results, "wall"),
        "",
        "## Calling-thread CPU time per op (per repetition: mean over ranks)",
        "",
        *table(results, "cpu"),
        "",
        "## Correctness: commslayer result bitwise equal to plain c10d (same input, every rank; a reduce-scatter "
        "on the ring at more than 2 ranks: to its documented summation order)",
        "",
    ]
    out += [f"- {op}: {'equal' if ok else 'DIFFERENT'}" for op, ok in verdict.items()]
    return "\n".join(out) + "\n"


def _finite(x: object) -> object:
    """NaN/inf become None so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def to_json(meta: Dict[str, object], results: Sequence[Result], verdict: Dict[str, bool]) -> Dict[str, object]:
    return _finite({
        "meta": meta,
        "results": [
            {
                "op": r.op, "size_bytes": r.size_bytes, "elements_per_rank_input":
                    r.size_bytes // 4 * (meta["world_size"] if r.op == "reduce_scatter_single" else 1),
                "reps": r.reps, "stats_s": r.stats, "per_rank_median_s": r.per_rank_median,
                "ratio_commslayer_over_plain": {m: r.ratio(m, "commslayer") for m in METRICS},
                "ratio_over_plain": {v: {m: r.ratio(m, v) for m in METRICS} for v in VARIANTS},
                "ratio_plain2_over_plain": {m: r.ratio(m, "plain2") for m in METRICS},
                "delta_commslayer_minus_plain_s": {m: r.delta(m) for m in METRICS},
            }
            for r in results
        ],
        "correctness_bitwise_equal": verdict,
    })


# ----------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    check_args(parser, args)
    global VARIANTS
    g = setup()
    if args.tracing:
        if args.trace_dir is None:  # --smoke: registered before the sinks' own exit handlers, so it runs after them
            args.trace_dir = tempfile.mkdtemp(prefix="bench-overhead-")
            atexit.register(shutil.rmtree, args.trace_dir, ignore_errors=True)
        VARIANTS = BASE_VARIANTS + TRACED_VARIANTS
        g.traced = traced_comms(args.trace_dir)
    if args.breakdown:
        VARIANTS = VARIANTS + BREAKDOWN_VARIANTS
        chosen = os.environ.get("COMMSLAYER_NATIVE")
        os.environ["COMMSLAYER_NATIVE"] = "0"  # read as the communicator is built
        g.traced["python"] = commslayer.new_comm("gloo", name="bench-python")
        if chosen is None:
            del os.environ["COMMSLAYER_NATIVE"]
        else:
            os.environ["COMMSLAYER_NATIVE"] = chosen
    if args.async_op:
        g.async_op = True
        g.adapter = _adapter_group("bench-adapter")
        VARIANTS = VARIANTS + ("c10d-adapter",)
        if args.tracing:
            from tracing.record.recorder import FlightRecorder

            g.adapter_traced = _adapter_group("bench-adapter-traced")
            FlightRecorder(cl_config.trace_buffer(), os.path.join(args.trace_dir, "adapter"),
                           job=cl_config.job_id()).attach(group_of(g.adapter_traced).communicator("cpu"))
            VARIANTS = VARIANTS + ("c10d-adapter+recorder",)
        if args.breakdown:
            VARIANTS = VARIANTS + ("adapter-comm",)
            g.traced["adapter-comm"] = group_of(g.adapter).communicator("cpu")
    if args.dispatch:
        g.forwarding = forwarding_groups()
        VARIANTS = VARIANTS + tuple(g.forwarding)
    if args.nan_check:
        VARIANTS = VARIANTS + ("nan-check",)
        g.traced["nan-check"] = commslayer.new_comm("gloo", name="bench-nan-check")
        commslayer.NanCheckHook().register_with_comm(g.traced["nan-check"])
    meta = metadata(g, args)
    results: List[Result] = []
    for op in args.ops:
        for size in args.sizes:
            samples = measure(op, size, g, args)
            if g.rank == 0:
                results.append(reduce_samples(op, size, samples))
                print(f"[bench_overhead] {op} {fmt_bytes(size)}: {samples.shape[1]} reps", file=sys.stderr,
                      flush=True)
    for name, (_, backend) in g.forwarding.items():  # its ops went through the C++ backend, not around it
        assert backend.forwarded() > 0, f"{name}: no op reached the forwarding backend"
    verdict = verify_all(g, args)
    if g.rank == 0:
        print(report(meta, results, verdict), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(to_json(meta, results, verdict), f, indent=2)
            print(f"[bench_overhead] wrote {args.json}", file=sys.stderr)
    dist.barrier(group=g.sync)
    g.comm.finalize()
    for comm in g.traced.values():
        comm.finalize()
    dist.destroy_process_group()
    bad = [op for op, ok in verdict.items() if not ok]
    assert not bad, f"commslayer's result differs bitwise from plain c10d for: {', '.join(bad)}"
    return 0


if __name__ == "__main__":
    sys.exit(main())
