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
step.

While it waits a spare also imports the torch modules rank 0 had imported
by its first committed step (``MODULES``, written by ``publish_modules``):
torch imports some of its own modules only when first used, and FSDP2's
first ``fully_shard`` imports ``torch._dynamo`` (0.96 s of a spare's 1.1 s
model build in a profile of the benchmark's job).  The imports run in a
thread, so a rank given meanwhile is taken at once.

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
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from commslayer import config, startup
from commslayer.agree.store import connect, wait_for_keys
from commslayer.errors import first_line

# What a spare takes from its assignment; the rest of a rank's environment it was started with.
ASSIGNED = ("RANK", "LOCAL_RANK", "COMMSLAYER_JOB_RANK", "TORCHELASTIC_RESTART_COUNT")
POLL_S = 0.01  # how often a waiting spare asks the store for its rank: 100 small requests a second
MODULES = "job/modules"  # the torch modules rank 0 had imported by its first committed step, one a line
CONNECT_TIMEOUT = timedelta(seconds=60)

adopted: Optional[Tuple[int, float]] = None  # (spare id, when it took its rank) once this process was a spare


def key(node: int, spare: int, what: str) -> str:
    """The job-store key ``what`` (``ready``, ``rank``) of spare ``spare`` of host ``node``."""
    return f"spare/{node}/{spare}/{what}"


def assignment(env: Dict[str, str], why: str) -> str:
    """What the launcher writes under a spare's ``rank`` key: the ``ASSIGNED`` variables
    of the rank's next life (``env``) and why it was lost."""
    return json.dumps({"env": {name: env[name] for name in ASSIGNED}, "why": why})


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
    threading.Thread(target=_import_what_ranks_use, args=(address,), name="commslayer-spare-imports",
                     daemon=True).start()
    try:
        store = connect(address, CONNECT_TIMEOUT)
        store.set(key(node, spare, "ready"), str(os.getpid()))
        # polled, not store.wait: c10d logs a warning each time a blocking wait's slice ends
        wait_for_keys(store, [key(node, spare, "rank")], lambda: None, math.inf, slow_after_s=0.0,
                      slow_pause_s=POLL_S)
        env, why = _parse(store.get(key(node, spare, "rank")))
    except (dist.DistNetworkError, RuntimeError, OSError) as exc:
        print(f"[spare {spare}] leaving without a rank: {first_line(exc)} (the job's store at {address})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    adopted = (spare, time.time())
    os.environ.update(env)
    del os.environ["COMMSLAYER_SPARE"]
    print(f"spare {spare} adopted rank {env['RANK']} (life {env['TORCHELASTIC_RESTART_COUNT']}, pid "
          f"{os.getpid()}): {why}", flush=True)
    startup.mark_placed()


def publish_modules(store: Any) -> None:
    """Rank 0, after its first committed step: the torch modules this process has imported,
    for the job's spares to import while they wait."""
    store.set(MODULES, "\n".join(sorted(name for name in sys.modules if _torchs(name))))


def _torchs(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _import_what_ranks_use(address: str) -> None:
    """Import what ``MODULES`` lists once a rank wrote it (only torch's own modules: the
    names come from the job's store). A module that fails to import is left to the script."""
    try:
        store = connect(address, CONNECT_TIMEOUT)
        wait_for_keys(store, [MODULES], lambda: None, math.inf, slow_after_s=0.0, slow_pause_s=0.1)
        names = store.get(MODULES).decode(errors="replace").splitlines()
    except (dist.DistNetworkError, RuntimeError, OSError):
        return  # the main thread says why, if it matters
    for name in filter(_torchs, names):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (warming up only: the script imports what it needs itself)
                pass


def _parse(raw: bytes) -> Tuple[Dict[str, str], str]:
    """An assignment, checked: the ``ASSIGNED`` variables, each a decimal number, and why."""
    try:
        given = json.loads(raw)
        env = given["env"]
        if not (isinstance(env, dict) and set(env) == set(ASSIGNED)
                and all(isinstance(v, str) and v.isdigit() for v in env.values())):
            raise ValueError
        return env, str(given.get("why", ""))
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(f"its assignment is not what commslayer-run writes: {raw[:200]!r}") from None
