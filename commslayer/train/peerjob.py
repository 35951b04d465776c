"""A resilient job without replica groups: a lost rank is replaced, the others hold.

``commslayer-run`` without ``--replicas`` supervises every rank on its own
(``COMMSLAYER_RESTART_UNIT=rank``): one rank's death ends no other, and the
launcher starts a replacement for the same rank.  ``resilience.init`` then
returns a ``PeerJob``: the same API as a replica-group job (``register``,
``steps``, ``step``, ``finish``), for a model sharded over every rank.

How a step survives a lost rank:

- The default process group (what ``job.mesh`` and FSDP2 use) runs on the
  shard communicator, a commslayer communicator with generations.  The
  group is *held* (``CommslayerGroup.hold``): an op that fails does
  not raise into FSDP2's hooks, the step runs on to ``job.step`` on
  unspecified data, and there the commit vote fails on every survivor.
- The survivors shrink the shard communicator, mark the lost rank in the
  job's store (``rank/<r>/lost/<life>``: the launcher starts its
  replacement even if the lost process is only stopped; not a rank that
  said goodbye: its exit status decides), and wait for the
  replacement to announce itself.  It joins the next generation as the same
  rank; the group object that FSDP2 holds carries on over it
  (``CommslayerGroup.replace``): FSDP2 and DeviceMesh notice nothing.
- Every rank's state is also held by its buddies (``commslayer.train.redundancy``):
  the replacement receives its state from one, the survivors go back to the
  same boundary from their own snapshot, and the interrupted step (with the
  one before it, if the loss cut that step's copy) is redone.  The optimizer
  only runs on a committed step, so the state after the redo is the state a
  fault-free run has.
- A lost rank that gets no replacement (the launcher's restarts ran out,
  or none came in time): the survivors reshard (``_reshard``): each merges
  every rank's state into the whole (``commslayer.train.reshard``), leaves it in
  host memory and starts its script again as a rank of a job one rank
  smaller, whose ``steps`` takes its part of the whole.
- A rank whose state has no surviving copy (it and its holders lost
  together), or no replacement with resharding off, ends the job with
  ``StateLost`` or ``ReplacementMissing`` on every survivor, naming the
  ranks and the last committed step; each survivor dumps its trace on the
  way out.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist

from commslayer import config, runs
from commslayer.c10d import CommslayerGroup, adopting, group_of
from commslayer.comm.communicator import Communicator
from commslayer.comm.create import join, new_comm
from commslayer.errors import CommAborted, CommError, InvalidArgument, first_line
from commslayer.comm.exits import before_exit, exit_now
from commslayer.train import failures, packing, spare
from commslayer.hooks import recovery_hooks
from commslayer.train.redundancy import PeerCopies, StateLost, holders
from commslayer.reduce_op import ReduceOp
from commslayer.runs import FINISHED, RESHARDED, Admission, Recovery
from commslayer.train.reshard import merge
from commslayer.train.job import FINISH_IN_LOOP, Job, digest
from commslayer.agree.store import bounded, connect

COMM_NAME = "shards"
POLL_S = 0.05  # how often survivors look for the replacement


class ReplacementMissing(CommError):
    """A lost rank got no replacement (its launcher's restarts ran out, or none came
    within the wait): the job cannot go on at its size."""


class PeerJob(Job):
    """This process's place in a job whose restart unit is one rank (see the module doc)."""

    def __init__(self, *, redundancy: int, refresh_every: int, replace_timeout_s: float, **kwargs: Any) -> None:
        self._degree = redundancy
        self._refresh_every = refresh_every
        self._replace_timeout_s = replace_timeout_s
        self._broken: Optional[CommError] = None
        self._recoveries: List[Recovery] = []
        self._admissions: List[Admission] = []
        self._redo: Optional[Tuple[int, torch.Tensor]] = None  # the boundary to go back to, and this rank's state there
        self._committed = -1  # the last step committed here
        self._resharded = config.resharded()  # this process started again on the survivors of a loss
        self._epoch = self._resharded["epoch"] if self._resharded else 0
        # before joining: a replacement (the launcher restarts a rank that failed) would wait there for survivors
        size = len(self._resharded["ranks"]) if self._resharded else int(os.environ.get("WORLD_SIZE") or 1)
        if redundancy >= size:
            raise InvalidArgument(f"redundancy={redundancy}: each rank's state can have at most {size - 1} "
                                  f"holder(s) in a job of {size} rank(s)", op="init")
        super().__init__(**kwargs)
        # the launcher's rank (its store keys) of each rank of this layout
        self._launched = self._resharded["ranks"] if self._resharded else list(range(self.world_size))
        self._joined = self.restart > 0 and self._resharded is None  # a replacement (none after a reshard)

    # ------------------------------------------------------------ start-up
    def _connect(self, timeout: timedelta) -> Tuple[dist.Store, int, int]:
        raw = connect(os.environ["COMMSLAYER_JOB_STORE"], timeout)
        timeout = config.group_timeout(timeout)  # the shards' communicator is the job's default group
        store = bounded(raw)
        me = int(os.environ.get("COMMSLAYER_JOB_RANK", self.rank)) if self._resharded is None else \
            self._resharded["ranks"][self.rank]  # the launcher's rank
        name = COMM_NAME + (f".e{self._epoch}" if self._epoch else "")
        if self.restart == 0 or self._resharded is not None:
            self._shards = new_comm("gloo", name=name, store=store, rank=self.rank, size=self.world_size,
                                    timeout=timeout, isolate_writes=True)
            if self.restart == 0 and self._resharded is None:
                store.set(f"rank/{me}/node", str(config.node()))
        else:  # a replacement: admitted once the survivors see it
            self._shards = join("gloo", name=name, member=self.rank, store=store, timeout=timeout,
                                isolate_writes=True)
        store.set(f"rank/{me}/member", str(self.restart))  # the life of this rank in the communicator
        with adopting(self._shards):
            dist.init_process_group(
                "commslayer", store=dist.PrefixStore(f"c10d/{self._epoch}.{self.rank}.{self.restart}/", raw),
                rank=self.rank, world_size=self.world_size, timeout=timeout)
        self._group().hold(self._on_failure)
        return store, 0, 1

    def _group(self) -> CommslayerGroup:
        side = group_of(dist.group.WORLD)
        assert side is not None
        return side

    def _on_failure(self, err: CommError) -> None:
        if self._broken is None:
            self._broken = err

    # ------------------------------------------------------------- progress
    @property
    def live_replicas(self) -> List[int]:
        return [0]

    @property
    def generation(self) -> int:
        return self._shards.generation

    @property
    def admissions(self) -> List[Admission]:
        return self._admissions

    @property
    def recoveries(self) -> List[Recovery]:
        return self._recoveries

    @property
    def reports(self) -> bool:
        return self.rank == 0

    def register(self, **state: Any) -> None:
        """As ``Job.register``, but a ``DistributedDataParallel`` module is refused: a lost
        rank is replaced alone here, and DDP's constructor in the replacement runs
        collectives (rank 0's parameters broadcast, every rank's model compared) that
        the other ranks, already past theirs, never join."""
        from torch.nn.parallel import DistributedDataParallel

        ddp = [name for name, obj in state.items() if isinstance(obj, DistributedDataParallel)]
        if ddp:
            raise InvalidArgument(
                f"register: {', '.join(map(repr, ddp))} is a DistributedDataParallel module, which per-rank mode "
                "cannot recover (a replacement's DDP constructor runs collectives the other ranks never join): "
                "run it in replica mode (commslayer-run --replicas R --nproc-per-replica N), or shard the model "
                "with FSDP2 (fully_shard on job.mesh) in per-rank mode", op="register")
        super().register(**state)

    def failure_unit(self) -> Tuple[str, str]:
        rank = self._launched[self.rank]  # the launcher's rank: the one its keys and lines name
        return f"rank {rank}", f"rank{rank}"

    @property
    def copies(self) -> PeerCopies:
        """This rank's part of the redundancy (what it holds, bytes sent)."""
        return self._copies

    # ---------------------------------------------------------------- steps
    def steps(self, total: int) -> Iterator[int]:
        """The steps this life runs: from 0, or (a replacement) from the boundary the
        survivors went back to. A step voted down is yielded again."""
        self._begin_loop(total)
        nodes = [int(self.store.get(f"rank/{r}/node")) for r in self._launched]
        self._copies = PeerCopies(self._split(), holders(nodes, self._degree), self._on_sending)
        if self._joined:
            step, own = self._restore(joined=True)
            self._state.unpack(own)
            self.healed_at = step
            print(f"[rank {self.rank}] replacement (life {self.restart}{spare.given()}): state received from a holder "
                  f"{self._copies.plan[self.rank]}, continuing at step {step} in generation {self.generation}",
                  flush=True)
        else:
            self._check_steps_total()
            step = 0 if self._resharded is None else self._load_resharded()
            if not self._commit(self._copies.exchange(step, self._state.pack())):
                raise CommError("the first copies of the state failed", comm=self._shards.get_name(), op="steps")
            self._copies.confirm()
            if self._resharded is not None:
                self._check_resharded(step)
        self._checked = True
        self.start_step = step
        self._begin = time.perf_counter()
        while step < total:
            self._t0 = time.perf_counter()
            self._enter_step(step)
            if step % self._refresh_every == 0 and (self._copies.confirmed is None
                                                    or self._copies.confirmed.step != step):
                self._copies.refresh(step, self._state.pack(self._copies.spare()))
            yield step
            if not self._stepped:
                raise InvalidArgument(f"step {step} ended without job.step(): call it once per step, after "
                                      "backward", op="steps")
            if self._redo is not None:
                step, own = self._redo
                self._redo = None
                self._state.unpack(own)
                del self.step_s[step - self.start_step:]  # the steps from there on are redone
                continue
            step += 1
        self.step_index = -1

    def _check_steps_total(self) -> None:
        """Every rank loops over the same number of steps, or every rank raises
        ``InvalidArgument`` (``Job._check_same_total``)."""
        totals = torch.zeros(self.world_size, dtype=torch.int64)
        self._shards.all_gather_single(totals, torch.tensor([self._total], dtype=torch.int64))
        self._check_same_total(list(range(self.world_size)), totals.tolist())

    def _split(self) -> Communicator:
        comm = self._shards.split(list(range(self.world_size)), name="copies")
        assert comm is not None
        self._copies_comm = comm
        return comm

    def _on_sending(self, step: int) -> None:
        self._phase("refresh")

    def step(self, loss: Optional[torch.Tensor] = None, *, max_grad_norm: Optional[float] = None) -> bool:
        """After ``loss.backward()``: wait for the copies of the step's boundary, vote, and
        apply the optimizers only if every rank's step succeeded: True. A step voted
        down is recovered from (the lost rank replaced, every rank back at a boundary
        whose state every rank has) and ``steps`` yields that boundary's step next: False
        (its loss reads NaN until it is redone). ``max_grad_norm``: as ``Job.step``'s,
        before the vote (the norm's collective is the step's too)."""
        step, params, grads = self._begin_step(loss, max_grad_norm)
        average = None
        if loss is not None:
            average = loss.detach().reshape(1).to(grads[0].dtype) / self.world_size  # a DTensor's dtype is its shard's
            dist.all_reduce(average)
        self._clip(params, max_grad_norm, step)
        self._phase("allreduce")
        copied = self._copies.wait()
        if self._broken is not None and failures.is_mistake(self._broken):
            raise self._broken  # a held op failed by the script's mistake: recovering would repeat it
        if self._commit(copied and self._broken is None):
            self._copies.confirm()
            self._apply()
            if self._committed < 0 and self.rank == 0 and not self._joined:
                spare.publish_optimizers(self.store, self._state.optimizers.values())  # what warm spares
                spare.publish_modules(self.store)  # import and run (on meta tensors) while they wait
            self._committed = step
            if average is not None:
                self.losses[step] = average.item()
            self.step_s.append(time.perf_counter() - self._t0)
            self._report_recovery(step)
            return True
        for opt in self._state.optimizers.values():
            opt.zero_grad()
        self.losses[step] = float("nan")
        self._stepped = True
        self._recover(step)
        return False

    def _commit(self, ok: bool) -> bool:
        try:
            return self._shards.should_commit(ok)
        except CommAborted:
            raise  # fenced: the others went on without this process
        except CommError as exc:
            self._on_failure(exc)
            return False

    # ------------------------------------------------------------- recovery
    def _recover(self, step: int) -> None:
        """Replace the lost ranks and go back to a boundary every rank can reach."""
        detected = time.time()
        self._copies.wait()
        old = self._shards
        survivors = old.shrink()
        lost = sorted(set(old.members) - set(survivors.members))
        hopeless = self._copies.unrecoverable(set(lost))
        if hopeless:
            self._fail(StateLost(
                f"rank(s) {hopeless} and every holder of their state ({[self._copies.plan[r] for r in hopeless]}, "
                f"redundancy {self._degree}) were lost together at step {step}: their shard of the parameters, "
                f"optimizer state and registered objects is gone. The job last committed step {self._committed}: "
                f"resume from a checkpoint taken at or before it", comm=survivors.get_name(), op="recover",
                ranks=hopeless))
        if survivors.get_rank() == 0:
            # A rank that said goodbye is exiting on its own: its exit status tells the launcher what it was
            # (status 0 before job.finish() is a bug), and a lost key seen before the exit would replace it.
            left = old.lifecycle.left_members()
            for r in [r for r in lost if r not in left]:
                key = f"rank/{self._launched[r]}"
                life = self.store.get(f"{key}/member").decode()  # not .../life: a replacement may be up already
                self.store.set(f"{key}/lost/{life}", str(survivors.generation))
        full = self._admit(survivors, lost, step, detected)
        self._shards = full
        self._group().replace(full)
        self._copies.use(self._split())
        self._broken = None
        resumed = time.time()
        to_step, own = self._restore(joined=False)
        self._redo = (to_step, own)
        self._recoveries.append(Recovery(step, [self._launched[r] for r in lost], self.generation, detected,
                                         resumed))
        recovery_hooks("recovered", {"step": step, "lost_replicas": [], "generation": self.generation,
                                     "members": list(full.members), "seconds": time.time() - detected,
                                     "redo_from": to_step})

    def _admit(self, survivors: Communicator, lost: List[int], step: int, detected: float) -> Communicator:
        """Wait until every lost rank's replacement announced itself, then the next
        generation with all of them (member ids are ranks: the same rank order)."""
        deadline = time.monotonic() + self._replace_timeout_s
        while True:
            pending = survivors.pending_members()
            if set(lost) <= set(pending):
                start = time.perf_counter()
                full = survivors.reconfigure(sorted(survivors.members + lost))
                self._admissions.append(Admission(step, lost, full.generation, time.perf_counter() - start,
                                                  time.time()))
                recovery_hooks("admitted", {"step": step, "replicas": [], "generation": full.generation,
                                            "members": list(full.members), "seconds": self._admissions[-1].heal_s})
                return full
            gone = self._gone(lost)
            give_up = torch.tensor([int(bool(gone) or time.monotonic() > deadline)])
            survivors.all_reduce(give_up, ReduceOp.MAX)  # all decide together
            too_few = survivors.get_size() <= self._degree  # a smaller job could not hold the copies
            if int(give_up) and config.reshard() and not too_few:
                self._reshard(survivors, lost, step, detected)
            if int(give_up):
                # Asked again: another survivor may have seen the launcher's word after this one
                # looked, and every survivor must say the same.
                gone = self._gone(lost)
                self._fail(ReplacementMissing(
                    f"rank(s) {[self._launched[r] for r in lost]} lost at step {step} got no replacement ("
                    + (f"the launcher's restarts ran out for {gone}" if gone else
                       f"none within {self._replace_timeout_s:g}s") + ")"
                    + (f" and the {survivors.get_size()} survivor(s) are too few to go on resharded with redundancy "
                       f"{self._degree} (each rank's state needs {self._degree} holder(s) among the others)"
                       if too_few and config.reshard() else "") + f"; the job last committed step "
                    f"{self._committed}: resume from a checkpoint taken at or before it",
                    comm=survivors.get_name(), op="recover", ranks=lost))
            time.sleep(POLL_S)

    def _gone(self, lost: List[int]) -> List[int]:
        """The lost ranks whose launcher said their restarts ran out."""
        return [self._launched[r] for r in lost if self.store.check([f"rank/{self._launched[r]}/gone"])]

    # ------------------------------------------------------------ resharding
    def _reshard(self, survivors: Communicator, lost: List[int], step: int, detected: float) -> NoReturn:
        """No replacement came: go on with the survivors. Each gets every rank's state at
        the newest boundary the survivors can reach, merges it into the whole state
        (``commslayer.train.reshard``), leaves it in this host's memory (``/dev/shm``) and
        starts its script again as a rank of a job one rank smaller: the script builds
        FSDP2 on the smaller mesh as it did at the start, and ``steps`` takes this
        rank's part of the whole state (``_load_resharded``)."""
        comm = survivors.split(list(range(survivors.get_size())), name="reshard")
        assert comm is not None
        to_step, states = self._copies.gather(comm, survivors.members)
        snapshots = {self._launched[r]: packing.unpack(data) for r, data in states.items()}
        whole = merge(snapshots, self._state.sharded())
        kept = [self._launched[m] for m in survivors.members]
        fd, path = tempfile.mkstemp(prefix="commslayer-reshard-", suffix=".pt", dir=config.scratch_dir() or (
            "/dev/shm" if os.path.isdir("/dev/shm") else None))
        with os.fdopen(fd, "wb") as f:
            torch.save({"step": to_step, "whole": whole, "digest": _whole_digest(whole)}, f)
        if not survivors.should_commit(True):  # every survivor has its file
            raise CommError("resharding onto the survivors failed on a rank", comm=comm.get_name(), op="reshard")
        epoch = self._epoch + 1
        lost_launched = [self._launched[r] for r in lost]
        if survivors.get_rank() == 0:
            self.store.set(RESHARDED, json.dumps({"epoch": epoch, "ranks": kept}))
            print(f"resharding: rank(s) {lost_launched} lost at step {step} and not replaced; the job goes on as "
                  f"{len(kept)} rank(s) (launcher ranks {kept}) from step {to_step}; whole state fingerprint "
                  f"{_whole_digest(whole):016x}", flush=True)
        rank = survivors.get_rank()
        nodes = [int(self.store.get(f"rank/{r}/node")) for r in kept]
        # The nodes no longer hold equal blocks: every rank is given the same layout explicitly
        # (commslayer.detect.addresses.rank_hosts), runs of consecutive ranks on one node.
        runs = [len(list(group)) for _, group in itertools.groupby(nodes)]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(kept)), COMMSLAYER_JOB_RANK=str(rank),
                   LOCAL_RANK=str(sum(1 for r in range(rank) if nodes[r] == nodes[rank])),
                   LOCAL_WORLD_SIZE=str(nodes.count(nodes[rank])), COMMSLAYER_NODE_SIZES=",".join(map(str, runs)),
                   COMMSLAYER_RESHARDED=json.dumps({"epoch": epoch, "ranks": kept, "from": path, "step": step,
                                                    "lost": lost_launched, "detected": detected}))
        if config.trace_dir():  # the new layout's trace files must not overwrite this one's
            env["COMMSLAYER_TRACE_DIR"] = os.path.join(config.trace_dir() or "", f"reshard{epoch}")
        before_exit(0, "resharding onto the survivors")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

    def _load_resharded(self) -> int:
        """This rank's part of the whole state the survivors left before starting again;
        the step it is at."""
        assert self._resharded is not None
        path = self._resharded["from"]
        try:
            saved = torch.load(path, weights_only=True)
        finally:
            os.remove(path)
        self._state.load_whole(saved["whole"], self._launched[self.rank])
        self._whole_before = saved["digest"]
        self.healed_at = saved["step"]
        lost = self._resharded.get("lost", [])
        self._recoveries.append(Recovery(self._resharded.get("step", saved["step"]), lost, self.generation,
                                         self._resharded.get("detected", time.time()), time.time()))
        recovery_hooks("recovered", {"step": saved["step"], "lost_replicas": [], "generation": self.generation,
                                     "members": list(self._shards.members), "resharded": True,
                                     "seconds": time.time() - self._recoveries[-1].detected_at})
        return int(saved["step"])

    def _check_resharded(self, step: int) -> None:
        """The new layout's parts, merged again, must be the whole state the survivors
        left: a real round trip through the new shards (printed by rank 0)."""
        _, states = self._copies.gather(self._copies_comm, list(range(self.world_size)))
        snapshots = {r: packing.unpack(data) for r, data in states.items()}
        after = _whole_digest(merge(snapshots, self._state.sharded()))
        if after != self._whole_before:
            raise StateLost(f"the state resharded onto {self.world_size} ranks is not the state the survivors "
                            f"left (fingerprint {after:016x} vs {self._whole_before:016x})",
                            comm=self._shards.get_name(), op="reshard")
        if self.rank == 0:
            print(f"resharded: {self.world_size} rank(s) at step {step}, whole state fingerprint {after:016x}, the "
                  f"same as before; ranks per node {os.environ.get('COMMSLAYER_NODE_SIZES')}", flush=True)

    def _restore(self, *, joined: bool) -> Tuple[int, torch.Tensor]:
        """Agree on the boundary to go back to and get this rank's state there; every
        rank of the new generation calls it, and votes that it worked."""
        to_step, own, source = -1, torch.empty(0, dtype=torch.uint8), self.rank
        start = time.perf_counter()
        try:
            to_step, own, source = self._copies.restore(joined)
        except StateLost as exc:
            self._fail(exc)
        except CommAborted:
            raise
        except CommError:
            pass
        if not self._commit(to_step >= 0):
            raise CommError("restoring the state after a lost rank failed on a rank", comm=self._shards.get_name(),
                            op="restore")
        self._copies.confirm()
        if joined:
            recovery_hooks("healed", {"step": to_step, "generation": self.generation, "source": source,
                                      "source_replica": None, "bytes": own.numel(),
                                      "seconds": time.perf_counter() - start, **spare.heal_fields()})
        return to_step, own

    def _fail(self, exc: CommError) -> None:
        """The job cannot go on: say so in the job's store (the launcher ends the rest)
        and raise on this rank (it dumps its trace on the way out)."""
        try:
            self.store.set("job/failed", f"{type(exc).__name__}: {first_line(exc)}")
        except CommError:
            pass
        raise exc

    # ------------------------------------------------------------ reporting
    def _report_recovery(self, step: int) -> None:
        """Once the step a loss interrupted is committed again (a step before it redone
        first does not end the survivors' stall): the recovery recorded in the job's store
        (its launcher starts a taken spare's successor then, commslayer.run.spares)."""
        r = self._recoveries[-1] if self._recoveries else None
        if r is None or r.committed_at is not None or step < r.step:
            return
        r.committed_at = time.time()
        if self.rank == min(i for i, launched in enumerate(self._launched) if launched not in r.lost_replicas):
            runs.record(self.store, r)
            how = f"the job went on as {self.world_size} rank(s)" if self._resharded is not None and \
                r is self._recoveries[0] else f"replaced, generation {r.generation}"
            print(f"recovered: rank(s) {r.lost_replicas} lost at step {r.step}; {how}; step {self._committed} "
                  f"committed {r.committed_at - r.detected_at:.3f}s after the loss was seen", flush=True)

    # ------------------------------------------------------------------ end
    def finish(self, *, exit: bool = True) -> List[int]:
        """The end of the job on every rank: a last all-reduce (no rank leaves while
        another may still count on it), this rank's state fingerprint, its result
        written, and the process ended with status 0."""
        if self._total is None or self.step_index >= 0:
            raise InvalidArgument(FINISH_IN_LOOP, op="finish")
        if not dist.is_initialized():
            raise InvalidArgument("dist.destroy_process_group() before job.finish(): in per-rank mode the default "
                                  "process group is the job's own communicator, which finish() still uses; remove "
                                  "the call (finish() ends the process and its groups)", op="finish")
        elapsed = time.perf_counter() - self._begin
        prints = [self._state.fingerprint()]
        self._shards.all_reduce(torch.zeros(1), ReduceOp.SUM)
        if self.reports:
            print(f"done: steps {self.start_step}..{self._total - 1} in {elapsed:.1f}s, {len(self._recoveries)} "
                  f"recoveries (ranks replaced: {sorted(r for a in self._admissions for r in a.replicas)}), "
                  f"generation {self.generation}, copies held here {self._copies.held_bytes} bytes", flush=True)
        self.store.set(FINISHED, "1")
        if self.run_dir:
            self._write_result(elapsed, prints)
        if exit:
            exit_now(0)
        return prints


def _whole_digest(whole: Dict[str, Any]) -> int:
    """A hash of the whole state's parameters and optimizer state (not the objects, which
    are per rank: a lost rank's are dropped)."""
    return digest({"modules": whole["modules"], "optimizers": whole["optimizers"]})
