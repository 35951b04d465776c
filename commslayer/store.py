"""Where a communicator's store comes from when the caller gives none, and how
its waits on the store stay interruptible.

Under torchrun the store is the agent's (``TORCHELASTIC_USE_AGENT_STORE``), so
it outlives any one worker; standalone, rank 0 hosts it.  One connection is
shared by every communicator of the process; each communicator works under
its own prefix.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence, Tuple

import torch.distributed as dist

POLL_S = 0.005  # the longest pause between polls of a store wait
_FIRST_POLL_S = 0.0002  # waits that usually end within a millisecond start polling this fast
_lock = threading.Lock()
_env_store: Optional[Tuple[dist.Store, int, int]] = None


def env_rank_size() -> Tuple[int, int]:
    """``RANK`` and ``WORLD_SIZE`` from the environment (torchrun sets both)."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as missing:
        raise ValueError(
            f"{missing.args[0]} is not set: run under torchrun or pass rank= and size= to new_comm"
        ) from None


def env_store(timeout: timedelta) -> Tuple[dist.Store, int, int]:
    """The process-wide store from ``MASTER_ADDR``/``MASTER_PORT``: (store, rank, size).

    Reuses the default process group's store when one exists.
    """
    global _env_store
    with _lock:
        if _env_store is None:
            if dist.is_initialized():
                from torch.distributed.distributed_c10d import _get_default_store

                _env_store = (_get_default_store(), dist.get_rank(), dist.get_world_size())
            else:
                store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
                store.set_timeout(timeout)
                _env_store = (store, rank, size)
        return _env_store


def wait_for_keys(store: dist.Store, keys: Sequence[str], interrupted: Callable[[], Optional[Exception]],
                  timeout_s: float) -> bool:
    """Wait until every key of ``keys`` exists (True), or ``timeout_s`` passes (False).

    Polls rather than blocking in ``store.wait``, so that a wait on a member that
    died ends as soon as the communicator knows: ``interrupted()`` is asked
    between polls and what it returns (an error) is raised."""
    keys = list(keys)
    start = time.monotonic()
    pause = _FIRST_POLL_S
    while not store.check(keys):
        err = interrupted()
        if err is not None:
            raise err
        if time.monotonic() - start >= timeout_s:
            return False
        time.sleep(pause)
        pause = min(pause * 2, POLL_S)
    return True
