"""A peer that dies (SIGKILL) mid-collective: every survivor gets a CommError
(PeerLost where Gloo says the connection closed) well before the op's
deadline, never a hang; and the communicator stays broken afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.harness import run_ranks


def _victim(rank, size, store):
    import commslayer

    comm = commslayer.new_comm("gloo", name="pl", store=store, rank=rank, size=size, timeout=30)
    comm.barrier()
    if rank == size - 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1 << 16))
        return "completed"
    except commslayer.CommError as err:
        elapsed = time.monotonic() - start
        try:
            comm.barrier()
        except commslayer.CommError as later:
            return type(err).__name__, elapsed, str(err), type(later).__name__
        return type(err).__name__, elapsed, str(err), "barrier passed"


@pytest.mark.timeout(90)
def test_sigkilled_peer_fails_survivors_fast():
    size = 4
    *results, victim = run_ranks(_victim, size, timeout=60, allow_errors=True)
    assert victim.exitcode == -signal.SIGKILL
    for kind, elapsed, msg, later in [r for r in results]:
        assert kind in ("PeerLost", "CollectiveTimeout"), msg
        assert later == kind  # still broken, same cause
        assert "communicator 'pl'" in msg and "all_reduce" in msg
    # Gloo notices a closed connection on at least one survivor long before the 30 s deadline
    assert any(kind == "PeerLost" and elapsed < 5 for kind, elapsed, _, _ in results), results
