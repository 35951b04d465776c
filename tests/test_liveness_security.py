"""The liveness mesh against a hostile neighbour on the same host.

An attacker that can reach a member's liveness listener but cannot read the
communicator's store (it learns the port, not the key) connects while member
1 waits for member 0's hello and sends junk, a hello that claims to be rank
0 with a forged signature, a truncated hello, and a connection that stays
silent; after the set-up it tries again.  The mesh must come up on time with
the real member 0, keep both members alive (heartbeats flow, nobody is
declared lost), and log each dropped connection; the listener is closed
once the mesh is up.  A communicator built beside the attack works too."""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks



def _member_or_attacker(rank, size, store):
    import commslayer
    from commslayer.detect.liveness import Liveness

    if rank == 2:  # the attacker: knows the address, not the key
        published = dist.PrefixStore("mesh", store)  # where member 1 publishes its listener (and its key)
        published.wait(["liveness/1"])
        host, port, _key = published.get("liveness/1").decode().rsplit(":", 2)
        addr = (host, int(port))
        junk = socket.create_connection(addr)
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)
        forged = socket.create_connection(addr)
        forged.sendall(b"CLhb" + struct.pack("!III", 0, 1, 0) + os.urandom(32))
        short = socket.create_connection(addr)
        short.sendall(b"CLhb\x00")
        short.close()
        silent = socket.create_connection(addr)
        store.set("attacked", "1")
        store.wait(["mesh-up"])
        try:
            socket.create_connection(addr, timeout=2).close()
            after = "accepted"
        except OSError as exc:
            after = type(exc).__name__
        for s in (silent, junk, forged):
            s.close()
        store.set("attacked-after", "1")
        return after

    dropped, lost = [], []

    class Keep(logging.Handler):
        def emit(self, record):
            dropped.append(record.getMessage())

    logging.getLogger("commslayer").addHandler(Keep(level=logging.WARNING))
    if rank == 0:
        store.wait(["attacked"])  # member 1 is listening with the attacker's sockets on it
    start = time.monotonic()
    mesh = Liveness(dist.PrefixStore("mesh", store), rank, 2, heartbeat_s=0.1, peer_timeout_s=1.0,
                    connect_timeout_s=60, on_lost=lambda ranks, why: lost.append(why), on_left=lambda ranks: None,
                    label="mesh")
    setup_s = time.monotonic() - start
    if rank == 1:
        store.set("mesh-up", "1")
    store.wait(["attacked-after"])
    time.sleep(1.5)  # more than the peer timeout: heartbeats must have flowed
    comm = commslayer.new_comm("gloo", name="sec", store=store, rank=rank, size=2, timeout=60)
    t = torch.full((8,), float(rank + 1))
    comm.all_reduce(t)
    comm.finalize()
    mesh.close()
    return setup_s, lost, t.tolist(), [m for m in dropped if "dropped a liveness connection" in m]


@pytest.mark.timeout(90)
def test_attackers_are_dropped_and_the_mesh_comes_up():
    (setup0, lost0, t0, dropped0), (setup1, lost1, t1, dropped1), after_setup = \
        run_ranks(_member_or_attacker, 3, timeout=60)
    assert lost0 == lost1 == []
    assert t0 == t1 == [3.0] * 8
    assert setup1 < 10, setup1  # the silent socket did not hold member 1 for the 60 s timeout
    assert after_setup == "ConnectionRefusedError"  # the listener closed once the mesh was up
    reasons = " | ".join(dropped1)
    assert "not a liveness hello" in reasons
    assert "wrong signature" in reasons
    assert "closed before a whole hello" in reasons
    assert dropped0 == []


@pytest.mark.timeout(60)
def test_a_member_that_chose_another_topology_is_a_config_error_not_an_unwatched_member():
    """Rank 0 watches everyone (the full mesh); ranks 1 and 2 were told to watch one
    peer each (a ring): set up that way, some member would be watched by nobody."""
    from commslayer.errors import ConfigError
    from commslayer.detect.liveness import Liveness
    from tests.harness import on_threads

    store = dist.HashStore()

    def member(rank):
        ring = {} if rank == 0 else {"watch_peers": 1, "mesh_max": 1}
        return Liveness(dist.PrefixStore("mix", store), rank, 3, heartbeat_s=0.1, peer_timeout_s=1.0,
                        connect_timeout_s=5, on_lost=lambda ranks, why: None, on_left=lambda ranks: None,
                        label="mix", **ring)

    got = on_threads(*(lambda r=r: member(r) for r in range(3)))
    mismatch = [g for g in got if isinstance(g, ConfigError)]
    assert mismatch and "chose another watch topology" in str(mismatch[0]), got
    assert "COMMSLAYER_WATCH_PEERS" in str(mismatch[0])
    for g in got:
        if isinstance(g, Liveness):
            g.close()
