"""The resilient job of replica groups: ``Job``, what ``commslayer.resilience.init``
returns under ``commslayer-run --replicas`` (and under plain ``torchrun``).

What ``step`` does: the gradients of the registered modules (the local
shards of FSDP2's) are averaged across the live replica groups, begun during
backward for FSDP2 and DDP modules and in buckets after it for the rest
(``commslayer.train.gradients``); every rank of every live group votes that
its part succeeded, and only then is the optimizer applied, on all of them
(or, after a loss, the average is redone on the survivors from the same
local gradients: the optimizer never ran on a half-averaged gradient).  A
rank whose own group lost a member leaves (its torchrun restarts the group);
the restarted group announces itself, is admitted at a step boundary,
receives every registered state from a live replica (parameters, buffers,
optimizer state, the user's objects through ``state_dict``) and continues at
the survivors' step.  So ``steps`` yields each step exactly once per life,
and a step is committed on every live replica or on none.

Mistakes are errors, never a silent divergence: registered state that
differs across replicas (names, keys, shapes, dtypes) raises
``StateMismatch`` at the first step or heal, naming it and the replicas; a
``step`` with no gradients, a loop that skips ``step``, or ``steps`` before
``register`` raise ``InvalidArgument``.

Fault points: ``resilience.register_phase_hook(fn)`` runs ``fn(job, step, phase)`` at
``forward`` (entering the first registered module), ``backward`` (its
output's gradient), ``allreduce`` (entering the average) and ``optimizer``
(before the optimizer's step).  The fault harness fires its step faults
there, in any script that uses this module.  ``register_step_hook(fn)`` runs
``fn(job, step)`` once as each step begins (the flight recorder's).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from commslayer import config, runs

from commslayer.train import failures, packing, spare
from commslayer.errors import CommError, InvalidArgument
from commslayer.comm.exits import exit_now
from commslayer.train.gradients import GradientAverage, local
from commslayer.hooks import live_communicators, register_recovery_hook, status_reporters, status_sources
from commslayer.hooks import phase_hooks as _phase_hooks
from commslayer.hooks import step_hooks as _step_hooks
from commslayer.train.replicas import Replicas, fingerprint
from commslayer.runs import Admission, Recovery
from commslayer.train.reshard import piece
from commslayer.agree.store import bounded, connect

log = logging.getLogger("commslayer")
BUCKET_BYTES = 4 << 20  # gradient bytes per bucket of the cross-replica average


FINISH_IN_LOOP = ("finish() before the loop over steps() ended (a break out of it?): every rank runs every step "
                  "of job.steps(total), the same total on every rank")
VALUES = " (parameter values)"  # a key of parameter_digests in a state's signature
STATUS_EVERY_S = 1.0  # a rank writes its status record at most this often
MAX_STATUS_EVERY_LOG2 = 20  # and at least every 2**20 steps


def _resizable_comms() -> List[Tuple[str, int, List[int]]]:
    """(name, generation, members) of each resizable communicator of this process (made by
    new_comm or join), its latest generation."""
    latest: Dict[str, Tuple[str, int, List[int]]] = {}
    for comm in live_communicators():
        if comm.lifecycle.resizable() is not None and comm.generation >= latest.get(comm.get_name(), ("", -1))[1]:
            latest[comm.get_name()] = (comm.get_name(), comm.generation, list(comm.members))
    return sorted(latest.values())


STATUS_SERVED = "status/served"  # the job's store key a status server sets: the status sources run from then on


def status_key(unit_key: str) -> str:
    """The job store's key of a rank's status record (``Job.failure_unit``'s key names the rank)."""
    return f"status/{unit_key}"


def op_key(unit_key: str) -> str:
    """The job store's key of a rank's current op, which the status reporters write from a thread
    of their own while the rank is inside an op (``register_status_reporter``)."""
    return f"status/{unit_key}/op"


class _StatusWriter:
    """Writes a rank's status records to the job's store from a thread of its own, reads
    whether a status server serves the job (``STATUS_SERVED``) there too, and once it does,
    starts the status reporters (``register_status_reporter``) from there.  A store request
    may wait out an etcd leader election (1 to 2 s, docs/bench/etcd.md) or a slow store,
    and the training thread must not.  Only the latest record is kept: one the thread had
    no time for is replaced, never queued.  A failed request is logged, once a life, and
    the next record is tried: a status record must not stop the job."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._latest: Optional[Tuple[str, Dict[str, Any]]] = None  # (unit key, record)
        self._changed = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._warned = False
        self.served = False  # set by the thread once it read STATUS_SERVED

    def put(self, unit_key: str, record: Dict[str, Any]) -> None:
        """Write ``record`` (not changed afterwards) as the status of the rank ``unit_key``
        names as soon as the thread can; then, while status sources are registered, read
        ``STATUS_SERVED`` until it is there."""
        with self._changed:
            self._latest = (unit_key, record)
            self._changed.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commslayer-status-record", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._latest is None:
                    self._changed.wait()
                (unit_key, record), self._latest = self._latest, None
            try:
                self._store.set(status_key(unit_key), json.dumps(record))
                if status_sources.fns and not self.served and self._store.check([STATUS_SERVED]):
                    self.served = True
                    for reporter in status_reporters.fns:  # each returns at once
                        reporter(self._store, op_key(unit_key))
            except Exception:  # the store's own failures reach the training thread at its next request
                if not self._warned:
                    self._warned = True
                    log.warning("commslayer: a status record could not be written to the job's store (the next "
                                "one is tried)", exc_info=True)


class StateMismatch(CommError):
    """The registered state differs across replicas (names, keys, shapes or dtypes)."""


class _State:
    """Everything registered, packed for a restarted replica and hashed for comparison."""

    def __init__(self) -> None:
        self.modules: Dict[str, nn.Module] = {}
        self.optimizers: Dict[str, torch.optim.Optimizer] = {}
        self.objects: Dict[str, Any] = {}  # anything with state_dict()/load_state_dict()
        self._packer = packing.Packer()

    def add(self, name: str, obj: Any) -> None:
        if name in self.modules or name in self.optimizers or name in self.objects:
            raise InvalidArgument(f"register: {name!r} is registered already", op="register")
        self._check_not_registered(name, obj)
        if isinstance(obj, nn.Module):
            self.modules[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizers[name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            self.objects[name] = obj
        else:
            raise InvalidArgument(f"register: {name!r} is a {type(obj).__name__}, not a module, an optimizer or "
                                  "an object with state_dict() and load_state_dict()", op="register")

    def _check_not_registered(self, name: str, obj: Any) -> None:
        """``InvalidArgument`` if ``obj``, or a parameter it holds, is registered already
        under another name: each step would then average those gradients or apply that
        optimizer twice, and train wrong without a word."""
        for other, known in {**self.modules, **self.optimizers, **self.objects}.items():
            if known is obj:
                raise InvalidArgument(f"register: {name!r} is {other!r} again: register each object once",
                                      op="register")
        if isinstance(obj, nn.Module):
            held = {id(p) for p in self.params()}
            if any(id(p) in held for p in obj.parameters()):
                raise InvalidArgument(f"register: module {name!r} shares parameters with a registered module (one "
                                      "is a submodule of the other?): their gradients would be averaged twice; "
                                      "register only the outermost module", op="register")
        elif isinstance(obj, torch.optim.Optimizer):
            held = {id(p) for opt in self.optimizers.values() for p in _held(opt)}
            if any(id(p) in held for p in _held(obj)):
                raise InvalidArgument(f"register: optimizer {name!r} updates parameters that a registered optimizer "
                                      "updates too: each step would update them twice; give each parameter to one "
                                      "optimizer", op="register")

    def parameter_digests(self) -> Dict[str, str]:
        """Each registered module's parameter values, hashed: what must be the same on
        every replica of a shard before the first step (buffers may already differ:
        a forward pass updates a batch norm's statistics from this replica's data)."""
        return {f"{name}{VALUES}": f"{digest([local(p).detach() for p in m.parameters()]):016x}"
                for name, m in self.modules.items()}

    def params(self) -> List[torch.Tensor]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def check_training(self) -> None:
        """``InvalidArgument`` if what is registered would not train as the loop expects:
        ``step`` applies the registered optimizers to the registered modules' parameters
        and heals both, so an optimizer missing, parameters no registered optimizer
        holds, an optimizer over parameters of no registered module (built before
        ``fully_shard``, or over another model), or an LR scheduler driving an optimizer
        but not registered (a restarted replica would start its schedule over) would
        each train wrong, silently."""
        if not self.optimizers:
            raise InvalidArgument("no optimizer is registered, so step() would train nothing: register it "
                                  "with the model, job.register(model=model, optimizer=opt)", op="step")
        held = {id(p) for opt in self.optimizers.values() for p in _held(opt)}
        orphans = [f"{name}.{pname}" for name, m in self.modules.items() for pname, p in m.named_parameters()
                   if p.requires_grad and id(p) not in held]
        if orphans:
            raise InvalidArgument(f"{len(orphans)} trainable parameter(s) of the registered modules are held by no "
                                  f"registered optimizer ({', '.join(orphans[:3])}{', ...' if len(orphans) > 3 else ''}"
                                  "): they would never change; register the optimizer that holds them", op="step")
        mine = {id(p) for p in self.params()}
        for name, opt in self.optimizers.items():
            if any(id(p) not in mine for p in _held(opt)):
                raise InvalidArgument(f"optimizer {name!r} updates parameters of no registered module (built before "
                                      "fully_shard, or over another model?): their gradients would not be averaged "
                                      "across replicas and their state would not heal; register the module it "
                                      "trains, and build the optimizer after sharding it", op="step")
            driven = any("initial_lr" in g for g in opt.param_groups)  # an LRScheduler's mark on its optimizer
            if driven and not any(getattr(o, "optimizer", None) is opt for o in self.objects.values()):
                raise InvalidArgument(f"optimizer {name!r} is driven by a learning-rate scheduler that is not "
                                      "registered: a restarted replica would start its schedule over; register "
                                      "it too, job.register(..., scheduler=sched)", op="step")

    def _module_tensors(self) -> Dict[str, List[torch.Tensor]]:
        return {name: [local(t).detach() for t in list(m.parameters()) + list(m.buffers())]
                for name, m in self.modules.items()}

    def _optimizer_state(self, opt: torch.optim.Optimizer) -> Dict[str, Any]:
        params = [p for g in opt.param_groups for p in g["params"]]
        state = []
        for p in params:
            entry = {}
            for k, v in opt.state.get(p, {}).items():
                entry[k] = (local(v).detach(), hasattr(v, "to_local")) if isinstance(v, torch.Tensor) else (v, False)
            state.append(entry)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return {"state": state, "groups": groups}

    def snapshot(self) -> Dict[str, Any]:
        with torch.no_grad():  # a DTensor's to_local() is then its local tensor, not an autograd call
            return {"modules": self._module_tensors(),
                    "optimizers": {n: self._optimizer_state(o) for n, o in self.optimizers.items()},
                    "objects": {n: o.state_dict() for n, o in self.objects.items()}}

    # -------------------------------------------------------------- Healable
    def pack(self, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._packer.pack(self.snapshot(), into)

    def unpack(self, data: torch.Tensor) -> None:
        self.load(packing.unpack(data))

    def load(self, got: Dict[str, Any]) -> None:
        """Overwrite the state with a snapshot of the same layout (``snapshot``'s format)."""
        mismatch = _differences(signature(got), signature(self.snapshot(), optimizer_state=False),
                                optimizer_state=False)
        if mismatch:
            raise StateMismatch(f"the state a live replica sent does not fit this one's: {mismatch}", op="heal")
        with torch.no_grad():
            for name, tensors in got["modules"].items():
                for mine, theirs in zip(self._module_tensors()[name], tensors):
                    mine.copy_(theirs)
        for name, opt in self.optimizers.items():
            self._load_optimizer(opt, got["optimizers"][name])
        for name, obj in self.objects.items():
            obj.load_state_dict(got["objects"][name])

    @staticmethod
    def _load_optimizer(opt: torch.optim.Optimizer, got: Dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        params = [p for g in opt.param_groups for p in g["params"]]
        for p, entry in zip(params, got["state"]):
            state = opt.state[p]
            for k, (v, sharded) in entry.items():
                if not sharded:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v
                elif k in state:
                    with torch.no_grad():
                        local(state[k]).copy_(v)
                else:
                    state[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements, run_check=False,
                                                  shape=p.size(), stride=p.stride())
        for group, saved in zip(opt.param_groups, got["groups"]):
            group.update(saved)

    def fingerprint(self) -> int:
        return digest(self.snapshot())

    # ------------------------------------------------------------ resharding
    def sharded(self) -> Dict[str, List[bool]]:
        """Per registered module, per tensor (parameters, then buffers): whether it is a shard."""
        return {name: [hasattr(t, "to_local") for t in list(m.parameters()) + list(m.buffers())]
                for name, m in self.modules.items()}

    def load_whole(self, whole: Dict[str, Any], objects_of: int) -> None:
        """Take this rank's part of the whole state (``reshard.merge``) for the current
        layout, and the objects of rank ``objects_of`` of the layout it came from."""
        params = {name: list(m.parameters()) + list(m.buffers()) for name, m in self.modules.items()}
        optimizers = {}
        for name, opt in self.optimizers.items():
            mine = [p for g in opt.param_groups for p in g["params"]]
            got = whole["optimizers"][name]
            optimizers[name] = {"state": [{k: (piece(v, p) if flag else v, flag) for k, (v, flag) in entry.items()}
                                          for p, entry in zip(mine, got["state"])], "groups": got["groups"]}
        self.load({"modules": {name: [piece(w, t) for w, t in zip(tensors, params[name])]
                               for name, tensors in whole["modules"].items()},
                   "optimizers": optimizers, "objects": whole["objects"][objects_of]})


def _held(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The parameters an optimizer updates."""
    return [p for g in opt.param_groups for p in g["params"]]


def digest(obj: Any) -> int:
    """A 63-bit hash of a snapshot (tensors by their bytes, the rest by ``repr``)."""
    h = hashlib.blake2b(digest_size=8)
    _digest(obj, h)
    return int.from_bytes(h.digest(), "little") >> 1


def _digest(obj: Any, h: "hashlib.blake2b") -> None:
    if isinstance(obj, torch.Tensor):
        h.update(fingerprint([obj]).to_bytes(8, "little"))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            h.update(repr(k).encode())
            _digest(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest(v, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def signature(snapshot: Dict[str, Any], *, optimizer_state: bool = True) -> Dict[str, str]:
    """Path -> "dtype[shape]" (or the type's name) of every leaf of a snapshot: what must
    be the same on every replica. Optimizer state is created lazily (a fresh replica has
    none yet), so healing compares it only where both have it."""
    out: Dict[str, str] = {}

    def walk(path: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            out[path] = f"{str(obj.dtype).replace('torch.', '')}{list(obj.shape)}"
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{path}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{path}[{i}]", v)
        else:
            out[path] = type(obj).__name__

    for kind in ("modules", "objects"):
        for name, v in snapshot[kind].items():
            walk(name, v)
    for name, opt in snapshot["optimizers"].items():
        out[f"{name}.param_groups"] = str(len(opt["groups"]))
        out[f"{name}.params"] = str(len(opt["state"]))
        if optimizer_state:
            walk(f"{name}.state", opt["state"])
    return out


def _differences(a: Dict[str, str], b: Dict[str, str], *, optimizer_state: bool = True, limit: int = 4) -> str:
    """What differs between two signatures, in words (empty if nothing)."""
    out = []
    for path in sorted(set(a) | set(b)):
        if not optimizer_state and ".state[" in path:
            continue
        if a.get(path) != b.get(path):
            out.append(f"{path}: {a.get(path, 'missing')} vs {b.get(path, 'missing')}")
    more = f" (+{len(out) - limit} more)" if len(out) > limit else ""
    return "; ".join(out[:limit]) + more


class Job:
    """This process's place in a resilient job; made by ``init``."""

    def __init__(self, *, timeout: timedelta, bucket_bytes: int, overlap: bool, run_dir: Optional[str],
                 heal_timeout_s: float) -> None:
        self.started = time.time()
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.restart = config.restart_count()
        self.run_dir = run_dir if run_dir is not None else config.run_dir()
        self._average = GradientAverage(bucket_bytes)
        self._overlap = overlap
        self._heal_timeout_s = heal_timeout_s
        self.store, self.replica, self.replicas = self._connect(timeout)
        self.process_group = dist.group.WORLD
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (self.world_size,))
        self.member = self.replica * self.world_size + self.rank
        if config.job_store() and config.restart_unit() != "rank":  # under commslayer-run's replica mode
            self.store.set(runs.joined_key(self.replica), "1")  # the script can start (the launcher's bug rule)
            if self.restart and self.rank == 0:  # a new life of this group: the crash-loop rule counts them
                failures.record_restart(self.store, self.replica)
        if self.restart and self.store.check([runs.FINISHED]):
            print(f"[replica {self.replica} rank {self.rank}] the job finished while this group restarted",
                  flush=True)
            exit_now(0)
        self._timeout = timeout
        self._replicas: Optional[Replicas] = None  # built by steps(): a restarted group announces itself
        # only once its model is built, so that the survivors admitting it do not wait for that
        self._state = _State()
        self.overlapped: List[str] = []  # the registered modules whose average begins during backward
        self.start_step: Optional[int] = None  # known once ``steps`` begins (after a heal)
        self.healed_at: Optional[int] = None  # the step a restarted life healed to
        self.step_index = -1  # the step the loop is in
        self.losses: Dict[int, float] = {}
        self.grad_norms: Dict[int, float] = {}  # step -> the averaged gradients' norm, where step() clipped them
        self.step_s: List[float] = []
        self._stepped = True
        self._admissions_reported = 0
        self._checked = False
        self._training_checked = False  # check_training ran (at the first step)
        self._applying = False  # step() is applying the registered optimizers
        self._total: Optional[int] = None
        self._begin = 0.0
        self._status_at = -STATUS_EVERY_S  # when this rank last wrote its status record (monotonic)
        self._status_step: Optional[int] = None  # the step it was of
        self._status_every = 1  # a record is written at a step that is a multiple of this (_status_due)
        self._healed: Optional[Dict[str, Any]] = None  # this life's heal (_on_recovery)
        self._status_writer: Optional[_StatusWriter] = None  # made with the first record
        register_recovery_hook(self._on_recovery)
        self._committed_here = 0  # steps committed in this life

    # --------------------------------------------------------------- stores
    def _connect(self, timeout: timedelta) -> Tuple[dist.Store, int, int]:
        """Make the default process group; the job's store, this replica's id and the count."""
        dist.init_process_group("commslayer", store=self._group_store(timeout), rank=self.rank,
                                world_size=self.world_size, timeout=timeout)
        return self._job_store(timeout)

    def _group_store(self, timeout: timedelta) -> dist.Store:
        """This replica group's store (torchrun's), under a per-restart prefix: a restarted
        group must not read the addresses its previous life left there."""
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout, use_libuv=True)
        return dist.PrefixStore(f"restart{self.restart}/", store)

    def _job_store(self, timeout: timedelta) -> Tuple[dist.Store, int, int]:
        """The launcher's job store (``COMMSLAYER_JOB_STORE``) with this replica's id and the
        count; under plain torchrun, this torchrun's store as the one replica group."""
        address = config.job_store()
        if not address:
            from torch.distributed.distributed_c10d import _get_default_store

            return bounded(_get_default_store(), f"job{self.restart}/"), 0, 1
        return bounded(connect(address, timeout)), config.replica_id() or 0, int(os.environ["COMMSLAYER_REPLICAS"])

    # ---------------------------------------------------------------- state
    def register(self, **state: Any) -> None:
        """Register what must heal, by name: modules (their parameters and buffers; the
        gradients of their parameters are the ones ``step`` averages), optimizers, and
        any object with ``state_dict()``/``load_state_dict()`` (an LR scheduler, a data
        position, RNG state, counters). Every replica registers the same names, before
        ``steps``. Registered state must be the same on every replica (it is what a
        restarted replica receives, and ``finish`` compares it): a data stream that
        differs per replica keeps its position as state and derives the rest from
        ``job.replica`` and ``job.rank``. Objects' state must be made of tensors,
        numbers, strings, lists and dicts (it is loaded with
        ``torch.load(weights_only=True)``)."""
        if self.start_step is not None:
            raise InvalidArgument("register() after steps() began: register everything first", op="register")
        for name, obj in state.items():
            self._state.add(name, obj)
        for name, obj in state.items():
            if isinstance(obj, nn.Module) and self._overlap and self.replicas > 1 and self._average.attach(obj):
                self.overlapped.append(name)
            if isinstance(obj, nn.Module) and obj is next(iter(self._state.modules.values())):
                obj.register_forward_pre_hook(lambda *_: self._phase("forward"))
                obj.register_forward_hook(self._on_output)
            elif isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(lambda *_, name=name: self._on_optimizer_step(name))

    def _on_optimizer_step(self, name: str) -> None:
        """A registered optimizer is about to step: only ``step`` may make it, once the
        gradients are averaged and the step committed."""
        if not self._applying:
            raise InvalidArgument(f"optimizer {name!r} stepped outside job.step(): remove {name}.step() and "
                                  "zero_grad() from the loop, job.step(loss) applies it once the gradients are "
                                  "averaged across replicas (a step of its own trains on this replica's gradients "
                                  "alone, or twice)", op="step")
        self._phase("optimizer")

    def _on_output(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """The first module's output: its gradient is where backward begins.  A tensor
        hook costs autograd a Python call in backward: none while no phase hook is registered."""
        if _phase_hooks.fns and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._phase("backward"))

    def _phase(self, phase: str) -> None:
        """Run the phase hooks; unlike op hooks, what they raise propagates (a fault
        that raises must raise in the job's own code)."""
        if self.step_index >= 0:
            for fn in _phase_hooks.fns:
                fn(self, self.step_index, phase)

    # ---------------------------------------------------------------- steps
    @property
    def _replica_groups(self) -> Replicas:
        """The replica groups, once ``steps()`` began."""
        if self._replicas is None:
            raise InvalidArgument("the job has not begun: loop over job.steps(total) first", op="steps")
        return self._replicas

    @property
    def live_replicas(self) -> List[int]:
        """The replica groups in the current generation."""
        return self._replica_groups.live

    @property
    def generation(self) -> int:
        return self._replica_groups.generation

    @property
    def admissions(self) -> List[Admission]:
        return self._replica_groups.admissions

    @property
    def recoveries(self) -> List[Recovery]:
        return self._replica_groups.recoveries

    def steps(self, total: int) -> Iterator[int]:
        """The steps this life runs: ``start_step`` (0, or where a restarted group healed
        to) up to ``total``. At each boundary, restarted replica groups are admitted."""
        self._begin_loop(total)
        rejoin = self.restart > 0 and "COMMSLAYER_JOB_STORE" in os.environ  # under plain torchrun a restart
        # is the whole job's: there is no live replica to heal from, it starts again at step 0
        self._replicas = Replicas(replica=self.replica, replicas=self.replicas, shard=self.rank,
                                  shards=self.world_size, store=self.store, rejoin=rejoin, timeout=self._timeout)
        self._average.replicas = self._replicas
        if rejoin:
            self.start_step = self.healed_at = self._replicas.heal(self._state)
            self._checked = True  # the heal compared this state with a live replica's
            if self.rank == 0:
                failures.record_healed(self.store, self.replica)
                print(f"[replica {self.replica}] restarted (restart {self.restart}{spare.given()}): healed from a "
                      f"live replica, continuing at step {self.start_step} in generation {self.generation}", flush=True)
        else:
            self.start_step = 0
        self._begin = time.perf_counter()
        for step in range(self.start_step, total):
            self._t0 = time.perf_counter()
            self._replicas.admit(self._state, step)
            self._report_admissions()
            self._enter_step(step)
            self._average.discard()
            yield step
            if not self._stepped:
                raise InvalidArgument(f"step {step} ended without job.step(): call it once per step, after "
                                      "backward", op="steps")
        self.step_index = -1

    def _enter_step(self, step: int) -> None:
        """The loop is in ``step`` from here; the step hooks are told."""
        self.step_index, self._stepped = step, False
        if _step_hooks.fns:
            _step_hooks(self, step)

    def _begin_loop(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, numbers.Integral) or total < 1:
            raise InvalidArgument(f"steps({total!r}): the job's number of steps must be an int >= 1 (a job of "
                                  "no steps trains nothing)", op="steps")
        if self._total is not None:
            raise InvalidArgument(f"steps() called again (steps({self._total}), then steps({total})): loop over "
                                  "job.steps(total) once, for the whole job (a restarted replica resumes from its "
                                  "step); count epochs from the step, epoch = step // steps_per_epoch", op="steps")
        if not (self._state.modules or self._state.optimizers or self._state.objects):
            raise InvalidArgument("steps() before register(): register the model and optimizer first",
                                  op="steps")
        self._total = total

    def step(self, loss: Optional[torch.Tensor] = None, *, max_grad_norm: Optional[float] = None) -> bool:
        """After ``loss.backward()``: average the gradients across the live replica groups,
        commit, apply every registered optimizer and zero the gradients. When this
        returns the step is committed on every live replica (a loss during it was
        recovered by redoing the average on the survivors): True. ``loss``, if given, is
        averaged over the job and recorded in ``losses`` (and the run's results).
        ``max_grad_norm``: clip the averaged gradients to that total norm first, as
        ``clip_grad_norm_`` before ``opt.step()`` does in a plain script (``_clip``)."""
        step, params, grads = self._begin_step(loss, max_grad_norm)
        if not self._checked:
            self._check_same_state(loss)
        extra = None
        if loss is not None:
            extra = loss.detach().reshape(1).to(grads[0].dtype) / self.world_size  # a DTensor's dtype is its shard's
            dist.all_reduce(extra)
        self._phase("allreduce")
        averaged_loss = self._average.average(params, extra, step)
        if averaged_loss is not None:
            self.losses[step] = averaged_loss.item()
        self._clip(params, max_grad_norm, step)
        self._apply()
        if self._committed_here == 1 and self.rank == 0 and self.replica == 0 and self.restart == 0:
            spare.publish_optimizers(self.store, self._state.optimizers.values())  # what warm spares import
            spare.publish_modules(self.store)  # and run (on meta tensors) while they wait
        self.step_s.append(time.perf_counter() - self._t0)
        self._report_recovery(step)
        return True

    def _begin_step(self, loss: Any, max_grad_norm: Any) -> Tuple[int, List[torch.Tensor], List[torch.Tensor]]:
        """``step``'s checks: the step, the loss, the norm to clip to, the registered parameters
        and their gradients."""
        step = self.step_index
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not 0 < max_grad_norm < math.inf):
            raise InvalidArgument(f"step(max_grad_norm={max_grad_norm!r}): a finite number > 0, or None", op="step")
        if loss is not None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            what = (f"a tensor of {loss.numel()} elements" if isinstance(loss, torch.Tensor)
                    else f"a {type(loss).__name__}")
            raise InvalidArgument(f"step(loss): loss is {what}, not a one-element tensor: pass the loss tensor "
                                  "itself, job.step(loss) (not loss.item(), not a loss per sample)", op="step")
        if step < 0:
            raise InvalidArgument("step() outside steps(): loop with `for step in job.steps(n)`", op="step")
        if self._stepped:
            raise InvalidArgument(f"step() called twice in step {step}", op="step")
        if not self._training_checked:
            self._training_checked = True
            self._state.check_training()
        params = self._state.params()
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            raise InvalidArgument(f"step() at step {step} found no gradients on the registered modules: call "
                                  "loss.backward() first (and register the model)", op="step")
        return step, params, grads

    def _clip(self, params: List[torch.Tensor], max_grad_norm: Optional[float], step: int) -> None:
        """Clip the gradients of ``params``, averaged over the job, to a total (2-)norm of
        ``max_grad_norm``, which ``grad_norms[step]`` records before clipping.  The norm is
        the plain script's: that of the whole average (FSDP2's shards: across the
        replica group), the same on every replica.  Clipping before ``step`` would
        clip each replica group's own gradients instead, and train otherwise."""
        if max_grad_norm is None:
            return
        norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
        self.grad_norms[step] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _apply(self) -> None:
        """The committed step: every registered optimizer steps, the gradients are zeroed."""
        self._applying = True
        try:
            for opt in self._state.optimizers.values():
                opt.step()
                opt.zero_grad()
        finally:
            self._applying = False
        self._stepped = True
        self._write_status()

    def _write_status(self) -> None:
        """At a committed step, at most once every ``STATUS_EVERY_S`` (``_status_due``): this
        rank's status record in the job's store (``status_key``; JSON: its launcher's rank,
        life, pid, the step committed, the steps committed in this life, that step's time,
        the generation, the wall clock, each resizable communicator's generation and
        members, this life's heal if it healed, and, once a status server says it serves
        the job (``STATUS_SERVED``), what the status sources add: the flight recorder's op
        figures, tracing.record.figures), which ``commslayer-run --status-port`` serves
        (commslayer.run.status); once it is served, the status reporters start (the current
        op, written while the rank is inside one). The record goes to ``_StatusWriter``, whose
        thread makes the store requests (a write a second, and a check of ``STATUS_SERVED``
        until it is there): the step never waits on the store for it."""
        self._committed_here += 1
        if not self._status_due() or not config.job_store():  # the cheaper test first: it runs at every step
            return
        unit, key = self.failure_unit()
        record = {"unit": unit, "life": self.restart, "pid": os.getpid(), "step": self.step_index,
                  "steps": self._committed_here, "step_s": time.perf_counter() - self._t0,
                  "generation": self.generation, "t": time.time(), "comms": _resizable_comms(),
                  "healed": self._healed}
        if self._status_writer is None:
            self._status_writer = _StatusWriter(self.store)
        for source in status_sources.fns if self._status_writer.served else ():
            try:
                record.update(source(self.step_index))
            except Exception:  # an observer must not stop the job; the record goes without its figures
                log.exception("commslayer: status source %r raised", source)
        self._status_writer.put(key, record)

    def _status_due(self) -> bool:
        """Whether this committed step writes a status record: a step whose number is a
        multiple of ``_status_every``, a power of two this rank sets from its pace so that
        records are ``STATUS_EVERY_S`` or more apart. Ranks stepping at the same pace pick
        the same power, and one that picked half another's writes at each of its steps
        too: their records are of the same step, whose collectives the status server
        matches across ranks (the slowest rank). A life's first committed step writes one."""
        step = self.step_index
        if step % self._status_every:
            return False
        now = time.monotonic()
        elapsed = now - self._status_at
        if self._status_step is not None and step > self._status_step:
            per_step = elapsed / (step - self._status_step)
            self._status_every = 1 << min(MAX_STATUS_EVERY_LOG2, max(0, math.ceil(math.log2(
                STATUS_EVERY_S / max(per_step, 1e-9)))))
        if elapsed < STATUS_EVERY_S:
            return False
        self._status_at, self._status_step = now, step
        return True

    def _on_recovery(self, kind: str, fields: Dict[str, Any]) -> None:
        """A recovery hook: this life's heal (step, generation, seconds, bytes received) goes
        into its status records."""
        if kind == "healed":
            self._healed = {k: fields.get(k) for k in ("step", "generation", "seconds", "bytes")}

    # ------------------------------------------------------- state checks
    def _check_same_state(self, loss: Optional[torch.Tensor]) -> None:
        """At the first step: every rank loops over the same steps, or every rank raises
        ``InvalidArgument``; every replica of this shard registered the same state
        (names, keys, shapes, dtypes, and the modules' parameter values, still those
        the script started with), or every rank raises ``StateMismatch`` naming it;
        replicas whose losses are all the same say that they read the same data."""
        self._checked = True
        mine = signature(self._state.snapshot(), optimizer_state=False)
        mine.update(self._state.parameter_digests())
        world = self._replica_groups.world
        digest = int.from_bytes(hashlib.blake2b(json.dumps([self.rank, mine], sort_keys=True).encode(),
                                                digest_size=8).digest(), "little") >> 1
        loss_bits = 0 if loss is None else int(torch.tensor([loss.item()], dtype=torch.float64).view(torch.int64))
        gathered = torch.zeros(3 * world.get_size(), dtype=torch.int64)
        world.all_gather_single(gathered, torch.tensor([digest, self._total or 0, loss_bits], dtype=torch.int64))
        hashes, totals = gathered[0::3].tolist(), gathered[1::3].tolist()
        self._check_same_total(world.members, totals)
        members = world.members
        if loss is not None:
            self._warn_if_same_data(members, gathered[2::3].tolist())
        by_shard: Dict[int, Set[int]] = {}
        for member, h in zip(members, hashes):
            by_shard.setdefault(member % self.world_size, set()).add(h)
        if all(len(v) == 1 for v in by_shard.values()):
            return
        key = f"signature/g{self.generation}"
        self.store.set(f"{key}/{self.member}", json.dumps(mine))
        differing = []
        for shard in sorted(s for s, v in by_shard.items() if len(v) > 1):
            holders = [m for m in members if m % self.world_size == shard]
            sigs = {m: json.loads(self.store.get(f"{key}/{m}")) for m in holders}
            first = holders[0]
            for m in holders[1:]:
                diff = _differences(sigs[first], sigs[m], optimizer_state=False)
                if diff:
                    differing.append(f"shard {shard}: replica {first // self.world_size} vs replica "
                                     f"{m // self.world_size}: {diff}")
        seeds = (" (parameter values differ: build the model from the same seed, torch.manual_seed(...) before "
                 "it, or load the same checkpoint, on every replica)") if any(VALUES in d for d in differing) else ""
        raise StateMismatch("registered state differs across replicas: " + "; ".join(differing) + seeds,
                            comm=world.get_name(), op="step")

    def _warn_if_same_data(self, members: List[int], losses: List[int]) -> None:
        """Say so (on the rank that reports) when every replica of every shard computed
        bitwise the same first loss: the replicas read the same data, most likely from
        ``RANK``/``job.rank``, which repeat in every replica group, and add nothing."""
        by_shard: Dict[int, Set[int]] = {}
        for member, bits in zip(members, losses):
            by_shard.setdefault(member % self.world_size, set()).add(bits)
        if len(members) > self.world_size and all(len(v) == 1 for v in by_shard.values()) and self.reports:
            print(f"warning: at step {self.step_index} every replica group computed bitwise the same loss on each "
                  "shard: they read the same data, and the replicas add nothing; derive each rank's data from "
                  "job.member (its place in the whole job), not RANK or job.rank, which repeat in every replica "
                  "group", flush=True)

    def _check_same_total(self, members: List[int], totals: List[int]) -> None:
        """``InvalidArgument`` on every rank unless every rank of the job called
        ``steps`` with the same total: a rank whose loop ends first would wait in
        ``finish`` for ranks still stepping, and they for it."""
        if len(set(totals)) == 1:
            return
        by_total: Dict[int, List[int]] = {}
        for member, total in zip(members, totals):
            by_total.setdefault(total, []).append(member)
        ranks = "; ".join(f"job rank(s) {m}: steps({t})" for t, m in sorted(by_total.items()))
        raise InvalidArgument(f"the ranks loop over different numbers of steps ({ranks}): give every rank the "
                              "same job.steps(total), from arguments every rank has (not from its rank or data "
                              "size)", op="steps")

    # ------------------------------------------------------------ reporting
    def _report_admissions(self) -> None:
        """Record in the job's store and print the admissions not reported yet (by the
        first survivor of each)."""
        for a in self.admissions[self._admissions_reported:]:
            first = min(m for m in self._replica_groups.world.members if m // self.world_size not in a.replicas)
            if self.member == first:
                runs.record(self.store, a)
                print(f"admitted replica(s) {a.replicas} at step {a.step}: generation {a.generation}, join and "
                      f"state transfer {a.heal_s:.3f}s", flush=True)
        self._admissions_reported = len(self.admissions)

    def _report_recovery(self, step: int) -> None:
        """World rank 0 records (in the job's store, which outlives every rank) and prints
        the recovery that this step's commit ended."""
        r = self.recoveries[-1] if self.recoveries else None
        if r is None or r.step != step or r.committed_at is None or self._replica_groups.world.get_rank() != 0:
            return
        runs.record(self.store, r)
        print(f"recovered: lost replica(s) {r.lost_replicas} at step {step}; generation {r.generation} built "
              f"{r.resumed_at - r.detected_at:.3f}s and the step committed {r.committed_at - r.detected_at:.3f}s "
              f"after the loss was seen", flush=True)

    def failure_unit(self) -> Tuple[str, str]:
        """This rank in the launcher's words, and as a key of the job's store."""
        return f"replica group {self.replica} rank {self.rank}", failures.unit_key(self.replica, self.rank)

    @property
    def reports(self) -> bool:
        """Whether this rank is the one that prints the job's progress (world rank 0)."""
        return self._replica_groups.world.get_rank() == 0

    # ------------------------------------------------------------------ end
    def finish(self, *, exit: bool = True) -> List[int]:
        """The end of the job, on every rank: keep admitting restarted replica groups
        until all are back or their launchers gave up, compare the replicas' state
        (printed by each shard's first rank), write this rank's result into the run
        directory, and end the process with status 0 (``exit=False``: return the
        fingerprints instead; Gloo may abort during interpreter teardown). Replicas
        whose state differs raise ``StateMismatch``: they trained different models."""
        if self._total is None or self.step_index >= 0:
            raise InvalidArgument(FINISH_IN_LOOP, op="finish")
        elapsed = time.perf_counter() - self._begin
        rep = self._replica_groups
        rep.wait_for(self._state, self._total, lambda r: self.store.check([f"replica/{r}/gone"]),
                     self._heal_timeout_s)
        self._report_admissions()
        prints = rep.fingerprints(self._state)
        if rep.replicate.get_rank() == 0 and len(prints) > 1:  # one replica: nothing to compare
            same = "identical" if len(set(prints)) == 1 else "DIFFERENT"
            print(f"shard {self.rank}: state of replicas {[m // self.world_size for m in rep.replicate.members]} "
                  f"fingerprints {[f'{x:016x}' for x in prints]}: {same}", flush=True)
        if self.reports:
            print(f"done: steps {self.start_step}..{self._total - 1} in {elapsed:.1f}s, {len(self.recoveries)} "
                  f"recoveries, {len(self.admissions)} admissions, replicas {self.live_replicas}/{self.replicas} "
                  f"live at the end, generation {self.generation}", flush=True)
        self.store.set(runs.FINISHED, "1")  # a group restarting from now on has nothing to rejoin
        if self.run_dir:
            self._write_result(elapsed, prints)
        if len(set(prints)) > 1:
            replicas = [m // self.world_size for m in rep.replicate.members]
            raise StateMismatch(
                f"the replicas ended with different state (shard {self.rank}: replicas {replicas}, fingerprints "
                f"{[f'{x:016x}' for x in prints]}): a replica's registered state changed outside job.step() (a "
                "checkpoint loaded, or parameters edited, on some replicas only), so the replicas trained different "
                "models", op="finish")
        if exit:
            exit_now(0)
        return prints

    def _write_result(self, elapsed: float, prints: List[int]) -> None:
        run_dir, total = self.run_dir, self._total
        assert run_dir is not None and total is not None  # finish() writes one only then
        opt = next(iter(self._state.optimizers.values()), None)
        counts = [int(opt.state[p]["step"]) for p in self._state.params() if opt is not None and
                  "step" in opt.state.get(p, {})]
        runs.save(runs.RankResult(
            member=self.member, replica=self.replica, rank=self.rank, restart=self.restart, pid=os.getpid(),
            started=self.started, steps=total, start_step=self.start_step or 0, elapsed_s=elapsed,
            step_s=self.step_s, losses=self.losses, optimizer_steps=counts, live=self.live_replicas,
            fingerprints=prints, recoveries=list(self.recoveries), admissions=list(self.admissions),
            generation=self.generation, overlapped=self.overlapped), run_dir)
