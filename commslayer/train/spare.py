"""A warm spare's side of the job: a process that waits in ``resilience.init()`` until it is given a lost rank.

A replacement started cold after a rank is lost spends most of the
survivors' stall booting: ``import torch`` and the script's imports (1.7 s
of the 2.3 s measured in docs/bench/peer-redundancy.md) before it can even
join.  ``commslayer-run --spares S`` (commslayer.run.spares) therefore
starts S more processes of the user's unchanged script beside the ranks,
with ``COMMSLAYER_SPARE=<id>`` and no rank.  Each runs the script up to
``resilience.init()`` and waits there (``wait_for_rank``): it writes
``spare/<node>/<id>/ready`` (its pid) in the job's store and blocks on
``spare/<node>/<id>/rank``, which its launcher writes where it would
otherwise have started a replacement.  The value names the rank's
environment (``ASSIGNED``: rank, local rank, job rank, life); the spare
takes it, runs what waited for a rank (``commslayer.startup.when_placed``:
the fault injector, the trace recorder, both filed by rank), and ``init``
goes on as in a cold replacement: it joins the shard communicator's next
generation as that rank, receives its state from a holder and redoes the
step.  In replica mode the value is the whole environment torchrun gave the
restarted rank's shim (commslayer.run.shim) and the shim's pid: the spare
takes that environment in place of its own, ``init`` goes on as in a rank
torchrun started (it heals from a live replica group), and the spare ends
when the shim does (``_follow``).

While it waits a spare also imports the torch modules rank 0 had imported
by its first committed step (``MODULES``, written by ``publish_modules``):
torch imports some of its own modules only when first used, and FSDP2's
first ``fully_shard`` imports ``torch._dynamo`` (0.96 s of a spare's 1.1 s
model build in a profile of the benchmark's job).  The imports run in a
thread, so a rank given meanwhile is taken at once.

Then, in its main thread between two polls for its rank, it runs one
step of each of rank 0's optimizers (``OPTIMIZERS``, written by
``publish_optimizers``: the optimizer's class and hyperparameters, per
parameter its DTensor's shape, stride, dtype, placements and mesh) on meta
tensors of those shapes, on a mesh of the job's ranks that has no process
group: no memory, no communication.  A torch optimizer over FSDP2's DTensor
parameters computes each op's sharding on its first call and caches it
(keyed by the mesh's ranks and the tensors' shapes, not by their data or
device; part of it per thread, hence the main thread: warmed in another
thread, a first AdamW step over 32 DTensors took 52 ms, against 79 ms cold
and 7 ms warmed in the thread that steps).  In the benchmark's job the
spare's first real optimizer step took 103 ms cold (82–93 ms warmed in
another thread) and 9–25 ms warmed in its main thread; the survivors wait
for it whenever the recovery redoes a step before the interrupted one.

A spare is not a rank: it is in no communicator, vote or copy refresh, and
the ranks learn of it only when one of them is replaced by it.  It never
adopts a bug: the launcher hands it a rank only where it would have started
a replacement, and a deterministic failure stops the job instead
(commslayer.train.failures).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import select
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from commslayer import config, startup
from commslayer.agree.store import connect, wait_for_keys
from commslayer.errors import first_line

# What a spare takes from its assignment; the rest of a rank's environment it was started with.
ASSIGNED = ("RANK", "LOCAL_RANK", "COMMSLAYER_JOB_RANK", "TORCHELASTIC_RESTART_COUNT")
# What must be numbers in a replica group's environment that a spare takes whole.
REPLICA_ASSIGNED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "COMMSLAYER_REPLICA")
POLL_S = 0.01  # how often a waiting spare asks the store for its rank: 100 small requests a second
MODULES = "job/modules"  # the torch modules rank 0 had imported by its first committed step, one a line
OPTIMIZERS = "job/optimizers"  # rank 0's optimizers as a spare rebuilds them on meta tensors (JSON)
CONNECT_TIMEOUT = timedelta(seconds=60)

adopted: Optional[Tuple[int, float]] = None  # (spare id, when it took its rank) once this process was a spare
warmed_at: Optional[float] = None  # when this spare had imported rank 0's modules and stepped its optimizers


def key(node: int, spare: int, what: str) -> str:
    """The job-store key ``what`` (``ready``, ``rank``) of spare ``spare`` of host ``node``."""
    return f"spare/{node}/{spare}/{what}"


def assignment(env: Dict[str, str], why: str, follow: Optional[int] = None) -> str:
    """What the launcher writes under a spare's ``rank`` key: the ``ASSIGNED`` variables
    of the rank's next life (``env``) and why it was lost.  With ``follow`` (replica mode:
    the pid of the shim torchrun started for the rank, commslayer.run.shim), ``env`` is
    the shim's whole environment, which the spare takes in place of its own, and the
    spare ends when that pid does."""
    if follow is None:
        return json.dumps({"env": {name: env[name] for name in ASSIGNED}, "why": why})
    return json.dumps({"env": env, "why": why, "follow": follow})


def wait_for_rank(spare: int) -> None:
    """Announce this warm spare and wait until its launcher gives it a rank; then this
    process is that rank's next life (its environment says so) and what waited for a
    rank runs. A spare whose job's store goes away leaves with status 1."""
    global adopted
    node = config.node()
    address = config.job_store()
    if not address:
        print(f"[spare {spare}] COMMSLAYER_SPARE is set but COMMSLAYER_JOB_STORE is not: a spare is started by "
              "commslayer-run --spares", file=sys.stderr, flush=True)
        sys.exit(2)
    warmup = _Warmup(address)
    try:
        store = connect(address, CONNECT_TIMEOUT)
        store.set(key(node, spare, "ready"), str(os.getpid()))
        # polled, not store.wait: c10d logs a warning each time a blocking wait's slice ends
        wait_for_keys(store, [key(node, spare, "rank")], lambda: warmup.between_polls(), math.inf,
                      slow_after_s=0.0, slow_pause_s=POLL_S)
        env, why, follow = _parse(store.get(key(node, spare, "rank")))
    except (dist.DistNetworkError, RuntimeError, OSError) as exc:
        print(f"[spare {spare}] leaving without a rank: {first_line(exc)} (the job's store at {address})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    adopted = (spare, time.time())
    if follow is None:
        os.environ.update(env)
        del os.environ["COMMSLAYER_SPARE"]
        who = f"rank {env['RANK']}"
    else:
        _follow(follow)
        os.environ.clear()
        os.environ.update(env)
        who = f"replica group {env['COMMSLAYER_REPLICA']} rank {env['RANK']}"
    print(f"spare {spare} adopted {who} (life {env['TORCHELASTIC_RESTART_COUNT']}, pid {os.getpid()}): {why}",
          flush=True)
    startup.mark_placed()


def _follow(pid: int) -> None:
    """End this process (SIGKILL) when process ``pid`` ends: replica mode's shim, torchrun's
    handle on this rank, killed with it when torchrun gives up waiting for the group."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait() -> None:
        select.select([handle], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="commslayer-spare-follows", daemon=True).start()


def given() -> str:
    """What a replacement's line adds when this process was a warm spare (empty otherwise)."""
    return f", warm spare {adopted[0]} given the rank {time.time() - adopted[1]:.3f}s ago" if adopted else ""


def heal_fields() -> Dict[str, Any]:
    """What a rank's ``healed`` record adds when this process was a warm spare: its id and pid."""
    return {"spare": adopted[0], "pid": os.getpid()} if adopted else {}


def publish_modules(store: Any) -> None:
    """Rank 0, after its first committed step: the torch modules this process has imported,
    for the job's spares to import while they wait."""
    store.set(MODULES, "\n".join(sorted(name for name in sys.modules if _torchs(name))))


def publish_optimizers(store: Any, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Rank 0, after its first committed step, before ``publish_modules``: each registered
    torch optimizer whose parameters are all DTensors, as ``_warm_optimizer`` rebuilds it
    on meta tensors (the others are left out: their first step computes no sharding)."""
    recipes = [r for r in map(_recipe, optimizers) if r is not None]
    store.set(OPTIMIZERS, json.dumps(recipes))


def _recipe(opt: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
    """How to rebuild ``opt`` on meta tensors: its class (torch's own only), each param
    group's hyperparameters (JSON values only) and per parameter ``_param_spec``; None
    where any of it cannot be written down."""
    from torch.distributed.tensor import DTensor

    cls = type(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    if not cls.__module__.startswith("torch.optim.") or not all(isinstance(p, DTensor) for p in params):
        return None
    groups = []
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        try:
            json.dumps(hyper, allow_nan=False)
        except (TypeError, ValueError):
            return None  # a tensor learning rate, say: this optimizer is left cold
        specs = [_param_spec(p) for p in group["params"]]
        if None in specs:
            return None
        groups.append({"hyper": hyper, "params": specs})
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "groups": groups}


def _param_spec(p: Any) -> Optional[Dict[str, Any]]:
    """A DTensor parameter's layout: global shape and stride, dtype, this rank's local
    shape, placements (``Shard``/``Replicate`` only, else None) and mesh."""
    from torch.distributed.tensor import Replicate, Shard

    placements: List[List[int]] = []
    for placement in p.placements:
        if type(placement) is Shard:
            placements.append([placement.dim])
        elif type(placement) is Replicate:
            placements.append([])
        else:
            return None
    mesh = p.device_mesh
    return {"shape": list(p.shape), "stride": list(p.stride()), "dtype": str(p.dtype).removeprefix("torch."),
            "local": list(p.to_local().shape), "placements": placements, "mesh": mesh.mesh.tolist(),
            "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None, "device": mesh.device_type}


def _warm_optimizer(recipe: Any) -> None:
    """One step of the optimizer ``recipe`` describes (``_recipe``), on meta DTensors of a
    mesh with no process group (nothing allocated, nothing sent): what the first real
    step would compute once per process (the ops' sharding) is then cached. Best effort:
    an optimizer that fails here is left to its first real step."""
    try:
        module, name = str(recipe["class"]).split(":")
        if not module.startswith("torch.optim."):
            return
        cls = getattr(importlib.import_module(module), name)
        meshes: Dict[str, Any] = {}
        groups = [{"params": [_meta_param(spec, meshes) for spec in g["params"]], **g["hyper"]}
                  for g in recipe["groups"]]
        opt = cls(groups)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        opt.step()
    except Exception:  # noqa: BLE001  (warming up only: the first real step computes what this did not)
        return


def _meta_param(spec: Dict[str, Any], meshes: Dict[str, Any]) -> torch.nn.Parameter:
    """A parameter laid out as ``spec`` (``_param_spec``) on meta tensors, its mesh one of
    ``meshes`` (built once per layout, without a process group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = json.dumps([spec["device"], spec["mesh"], spec["names"]])
    if layout not in meshes:
        meshes[layout] = DeviceMesh(spec["device"], torch.tensor(spec["mesh"]), _init_backend=False, _rank=0,
                                    mesh_dim_names=tuple(spec["names"]) if spec["names"] else None)
    mesh = meshes[layout]
    placements = [Shard(p[0]) if p else Replicate() for p in spec["placements"]]
    local = torch.empty(spec["local"], dtype=getattr(torch, spec["dtype"]), device="meta")
    return torch.nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False,
                                                 shape=torch.Size(spec["shape"]), stride=tuple(spec["stride"])))


def _torchs(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


class _Warmup:
    """What a waiting spare runs before it has a rank: the torch modules ``MODULES`` lists,
    imported in a thread once a rank wrote them (only torch's own: the names come from
    the job's store; a module that fails to import is left to the script), then the
    optimizers ``OPTIMIZERS`` describes, stepped on meta tensors by the main thread
    between its polls for a rank (``between_polls``): DTensor keeps part of its cache
    of each op's sharding per thread, and it is the main thread that will step them."""

    def __init__(self, address: str) -> None:
        self._recipes: List[Dict[str, Any]] = []
        self._fetched = threading.Event()
        threading.Thread(target=self._fetch, args=(address,), name="commslayer-spare-imports", daemon=True).start()

    def _fetch(self, address: str) -> None:
        try:
            store = connect(address, CONNECT_TIMEOUT)
            wait_for_keys(store, [MODULES], lambda: None, math.inf, slow_after_s=0.0, slow_pause_s=0.1)
            names = store.get(MODULES).decode(errors="replace").splitlines()
            recipes = json.loads(store.get(OPTIMIZERS)) if store.check([OPTIMIZERS]) else []
        except (dist.DistNetworkError, RuntimeError, OSError, ValueError):
            return  # the main thread says why, if it matters; the optimizers stay cold
        for name in filter(_torchs, names):
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001  (warming up only: the script imports what it needs itself)
                    pass
        self._recipes = recipes if isinstance(recipes, list) else []
        self._fetched.set()

    def between_polls(self) -> None:
        """The main thread, between two polls for its rank: once the imports are done, step
        the optimizers on meta tensors, once (0.25–0.42 s in the benchmark's job: a rank
        given meanwhile is taken after it, which happens only to a loss that close to
        rank 0's first commit)."""
        global warmed_at
        if self._fetched.is_set():
            self._fetched.clear()
            for recipe in self._recipes:
                _warm_optimizer(recipe)
            warmed_at = time.time()


def _parse(raw: bytes) -> Tuple[Dict[str, str], str, Optional[int]]:
    """An assignment (``assignment``), checked: the ``ASSIGNED`` variables, each a decimal
    number, or with a pid to follow a whole environment of strings that names a replica
    group's rank; why; the pid or None."""
    try:
        data = json.loads(raw)
        env, follow = data["env"], data.get("follow")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError
        numbers: Optional[Tuple[str, ...]]
        if follow is None:
            numbers = ASSIGNED if set(env) == set(ASSIGNED) else None
        else:
            numbers = REPLICA_ASSIGNED if type(follow) is int and follow > 0 and "COMMSLAYER_SPARE" not in env \
                else None
        if numbers is None or not all(env.get(name, "").isdigit() for name in numbers):
            raise ValueError
        return env, str(data.get("why", "")), follow
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(f"its assignment is not what commslayer-run writes: {raw[:200]!r}") from None
